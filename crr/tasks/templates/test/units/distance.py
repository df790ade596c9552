"""Distance units."""

FACTORS = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048,
           "mi": 1609.344}


def convert(value, from_unit, to_unit):
    if from_unit not in FACTORS or to_unit not in FACTORS:
        raise ValueError(f"unknown unit in {from_unit!r} -> {to_unit!r}")
    return round(value * FACTORS[from_unit] / FACTORS[to_unit], 4)


def parse_quantity(text):
    """'12.5 km' -> (12.5, 'km')."""
    number, _, unit = text.strip().partition(" ")
    if not unit:
        raise ValueError(f"missing unit in {text!r}")
    return float(number), unit.strip().lower()


def total_distance(quantities, unit="m"):
    """Sum of (value, unit) pairs expressed in `unit`."""
    return round(sum(convert(v, u, unit) for v, u in quantities), 4)
