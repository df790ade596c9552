"""Number helpers."""


def clamp(value, low, high):
    return max(low, min(high, value))


def percent(part, whole):
    if whole == 0:
        return 0.0
    return round(100.0 * part / whole, 1)
