"""Hex colours."""


def hex_to_rgb(code):
    code = code.lstrip("#")
    if len(code) != 6:
        raise ValueError(f"bad colour {code!r}")
    return tuple(int(code[i:i + 2], 16) for i in (0, 2, 4))


def rgb_to_hex(rgb):
    return "#" + "".join(f"{c:02x}" for c in rgb)
