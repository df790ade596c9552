"""Half-open intervals (start, end) in minutes."""


def merge_intervals(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_covered(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))


def overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]
