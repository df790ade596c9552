"""Temperature conversions."""

ABSOLUTE_ZERO_C = -273.15


def celsius_to_fahrenheit(c):
    return round(c * 9 / 5 + 32, 2)


def fahrenheit_to_celsius(f):
    return round((f - 32) * 5 / 9, 2)


def celsius_to_kelvin(c):
    if c < ABSOLUTE_ZERO_C:
        raise ValueError("below absolute zero")
    return round(c - ABSOLUTE_ZERO_C, 2)


def describe(c):
    if c <= 0:
        return "freezing"
    elif c < 15:
        return "cold"
    elif c < 25:
        return "mild"
    return "hot"
