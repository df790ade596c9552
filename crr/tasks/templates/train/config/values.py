"""Typed access to parsed configuration."""


def coerce(value):
    """Config text as int, float, bool or str."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        pass
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    return value


def get_int(config, section, key, default=0, minimum=None):
    raw = config.get(section, {}).get(key)
    if raw is None:
        return default
    number = int(raw)
    if minimum is not None and number < minimum:
        return minimum
    return number


def merge(base, override):
    """Override's keys win; neither input is modified."""
    merged = {name: dict(values) for name, values in base.items()}
    for name, values in override.items():
        merged.setdefault(name, {}).update(values)
    return merged
