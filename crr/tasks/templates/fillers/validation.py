"""Argument checks."""


def require_positive(name, value):
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def require_non_empty(name, value):
    if not value:
        raise ValueError(f"{name} must not be empty")
    return value
