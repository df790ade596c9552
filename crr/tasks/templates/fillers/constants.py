"""Shared constants."""

DEFAULT_ENCODING = "utf-8"
MAX_ITEMS = 1000
PRECISION = 2
