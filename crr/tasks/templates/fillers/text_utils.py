"""String helpers."""

import re


def slugify(text):
    return "-".join(re.findall(r"[a-z0-9]+", text.lower()))


def truncate(text, width, suffix="..."):
    if len(text) <= width:
        return text
    return text[: max(0, width - len(suffix))] + suffix
