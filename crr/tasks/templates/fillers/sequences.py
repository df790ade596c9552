"""Sequence helpers."""


def chunked(items, size):
    if size <= 0:
        raise ValueError("size must be positive")
    return [items[i:i + size] for i in range(0, len(items), size)]


def flatten(nested):
    return [x for part in nested for x in part]


def dedupe(items):
    """Items in first-seen order without repeats."""
    seen = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
