"""Splitting text into words and sentences."""

import re

WORD_RE = re.compile(r"[A-Za-z']+")


def words(text):
    """Lower-cased words of `text`; apostrophes stay inside words."""
    return [w.lower() for w in WORD_RE.findall(text)]


def sentences(text):
    """Non-empty sentences, split on '.', '!' and '?'."""
    parts = re.split(r"[.!?]+", text)
    return [p.strip() for p in parts if p.strip()]
