"""Word wrapping."""


def wrap_words(text, width):
    """Greedy wrap; words longer than `width` get a line of their own."""
    lines = []
    current = ""
    for word in text.split():
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        lines.append(current)
    return lines
