"""Version strings like '1.2.3'."""


def parse_version(text):
    return tuple(int(part) for part in text.strip().split("."))


def is_newer(a, b):
    return parse_version(a) > parse_version(b)
