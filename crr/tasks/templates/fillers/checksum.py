"""Check digits."""


def luhn_valid(number):
    digits = [int(d) for d in str(number)][::-1]
    total = 0
    for i, d in enumerate(digits):
        if i % 2 == 1:
            d = d * 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def digit_sum(n):
    return sum(int(d) for d in str(abs(n)))
