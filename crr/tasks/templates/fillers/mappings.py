"""Dictionary helpers."""


def invert(mapping):
    return {value: key for key, value in mapping.items()}


def group_pairs(pairs):
    """(key, value) pairs -> {key: [values...]}, keys in first-seen order."""
    groups = {}
    for key, value in pairs:
        groups.setdefault(key, []).append(value)
    return groups
