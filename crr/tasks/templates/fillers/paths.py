"""Path-like strings."""


def split_ext(name):
    base, dot, ext = name.rpartition(".")
    if not dot or not base:
        return name, ""
    return base, "." + ext


def common_prefix(paths):
    if not paths:
        return ""
    parts = [p.split("/") for p in paths]
    prefix = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        prefix.append(column[0])
    return "/".join(prefix)
