"""Retry delays."""


def backoff_delay(attempt, base=0.5, cap=30.0):
    """Exponential backoff in seconds, capped."""
    return min(cap, base * 2 ** attempt)
