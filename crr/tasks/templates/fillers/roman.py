"""Roman numerals."""

NUMERALS = ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
            (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))


def to_roman(n):
    if n <= 0:
        raise ValueError("roman numerals start at 1")
    out = []
    for value, letters in NUMERALS:
        count, n = divmod(n, value)
        out.append(letters * count)
    return "".join(out)
