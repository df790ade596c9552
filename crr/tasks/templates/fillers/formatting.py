"""Human-readable output."""


def pluralize(count, word, plural=None):
    if count == 1:
        return f"1 {word}"
    return f"{count} {plural or word + 's'}"


def thousands(n):
    return f"{n:,}"
