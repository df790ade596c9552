"""Rankings of {name: score} tables."""


def rank_scores(scores):
    """Competition ranking ('1224'): equal scores share a rank."""
    ordered = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
    ranks = {}
    previous = None
    rank = 0
    for position, (name, score) in enumerate(ordered, start=1):
        if score != previous:
            rank = position
            previous = score
        ranks[name] = rank
    return ranks


def top_n(scores, n):
    if n <= 0:
        return []
    ordered = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
    return [name for name, _ in ordered[:n]]


def percentile_rank(values, value):
    """Percent of values below `value`, counting ties as half."""
    if not values:
        raise ValueError("percentile of empty data")
    below = sum(1 for v in values if v < value)
    equal = sum(1 for v in values if v == value)
    return round(100.0 * (below + 0.5 * equal) / len(values), 2)
