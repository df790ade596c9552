"""Run-length encoding: 'aaab' <-> [('a', 3), ('b', 1)]."""


def encode(text):
    runs = []
    for ch in text:
        if runs and runs[-1][0] == ch:
            runs[-1] = (ch, runs[-1][1] + 1)
        else:
            runs.append((ch, 1))
    return runs


def decode(runs):
    return "".join(ch * count for ch, count in runs)


def to_string(runs):
    """Compact text form: counts of 1 are omitted ('a3b')."""
    parts = []
    for ch, count in runs:
        if count > 1:
            parts.append(ch + str(count))
        else:
            parts.append(ch)
    return "".join(parts)
