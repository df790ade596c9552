"""Summary statistics."""


def mode(values):
    """Most frequent value; the smallest one on ties; None for no data."""
    counts = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    best = None
    for v in sorted(counts):
        if best is None or counts[v] > counts[best]:
            best = v
    return best


def cumulative(counts):
    total = 0
    out = []
    for c in counts:
        total += c
        out.append(total)
    return out


def median(values):
    if not values:
        raise ValueError("median of empty data")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
