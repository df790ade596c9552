"""Compression statistics."""

from .codec import encode, to_string


def compression_ratio(text):
    """Length of the compact form over the original length (1.0 for empty text)."""
    if not text:
        return 1.0
    return round(len(to_string(encode(text))) / len(text), 3)


def longest_run(text):
    """(character, length) of the first longest run."""
    best = ("", 0)
    for ch, count in encode(text):
        if count > best[1]:
            best = (ch, count)
    return best


def run_count(text, min_length=2):
    return sum(1 for _, count in encode(text) if count >= min_length)
