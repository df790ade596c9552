"""Curving and dropping scores."""


def class_average(scores):
    if not scores:
        return 0.0
    return round(sum(scores) / len(scores), 2)


def curve_to_target(scores, target=75, cap=100):
    """Shift every score up so that the average reaches `target`, never above `cap`."""
    shift = target - class_average(scores)
    if shift <= 0:
        return list(scores)
    return [min(cap, round(s + shift, 2)) for s in scores]


def drop_lowest(scores, count=1):
    """Remaining scores, in ascending order, after dropping the `count` lowest."""
    if count >= len(scores):
        return []
    return sorted(scores)[count:]
