"""Course grades."""

WEIGHTS = {"homework": 0.3, "midterm": 0.3, "final": 0.4}


def weighted_score(scores, weights=WEIGHTS):
    """Weighted mean over the parts present in `scores`."""
    total = 0.0
    used = 0.0
    for part, weight in weights.items():
        if part in scores:
            total += scores[part] * weight
            used += weight
    if used == 0:
        return 0.0
    return round(total / used, 2)


def letter_grade(score):
    if score >= 90:
        return "A"
    elif score >= 80:
        return "B"
    elif score >= 70:
        return "C"
    elif score >= 60:
        return "D"
    return "F"


def passing_students(scores, threshold=60):
    return sorted(name for name, score in scores.items() if score >= threshold)
