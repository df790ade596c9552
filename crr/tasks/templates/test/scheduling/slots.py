"""Free time between busy intervals."""

from .intervals import merge_intervals, overlaps


def free_slots(busy, day_start, day_end, min_length=1):
    """Gaps of at least `min_length` minutes between `day_start` and `day_end`."""
    free = []
    cursor = day_start
    for start, end in merge_intervals(busy):
        if start - cursor >= min_length:
            free.append((cursor, start))
        cursor = max(cursor, end)
    if day_end - cursor >= min_length:
        free.append((cursor, day_end))
    return free


def fits(busy, start, length):
    slot = (start, start + length)
    return not any(overlaps(slot, b) for b in busy)


def first_fit(busy, day_start, day_end, length):
    """Earliest start of a free slot that is long enough, or None."""
    for start, end in free_slots(busy, day_start, day_end):
        if end - start >= length:
            return start
    return None
