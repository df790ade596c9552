"""A small INI-style configuration parser."""


def parse_bool(value):
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def parse_line(line):
    """'key = value' -> (key, value); comments and blank lines -> None."""
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    if "=" not in stripped:
        raise ValueError(f"missing '=' in {line!r}")
    key, _, value = stripped.partition("=")
    return key.strip(), value.strip()


def parse_config(text):
    """Sections as nested dicts; keys before any section go under 'default'."""
    config = {"default": {}}
    section = "default"
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("[") and s.endswith("]"):
            section = s[1:-1].strip()
            config.setdefault(section, {})
            continue
        pair = parse_line(line)
        if pair is not None:
            config[section][pair[0]] = pair[1]
    return config
