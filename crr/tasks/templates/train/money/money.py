"""Amounts in integer cents."""


def to_cents(amount):
    """Convert a decimal amount to cents, rounding half away from zero."""
    cents = abs(amount) * 100 + 0.5
    sign = -1 if amount < 0 else 1
    return sign * int(cents)


def split_evenly(total_cents, people):
    """Split cents among people; the first ones get the leftover cents."""
    if people <= 0:
        raise ValueError("people must be positive")
    share, leftover = divmod(total_cents, people)
    return [share + 1 if i < leftover else share for i in range(people)]


def apply_discount(price_cents, percent):
    """Price after a whole-percent discount, rounding the discount down."""
    if percent < 0 or percent > 100:
        raise ValueError("percent must be between 0 and 100")
    return price_cents - price_cents * percent // 100
