"""Progressive income tax and compound growth."""

BRACKETS = ((1000, 0.0), (5000, 0.1), (None, 0.2))


def progressive_tax(income):
    """Tax owed: each bracket's rate applies to the income inside it."""
    tax = 0.0
    lower = 0
    for upper, rate in BRACKETS:
        if upper is None or income <= upper:
            tax += (income - lower) * rate
            break
        tax += (upper - lower) * rate
        lower = upper
    return round(tax, 2)


def net_income(income):
    return round(income - progressive_tax(income), 2)


def compound(principal, rate, years):
    """Value after `years` of yearly compounding."""
    amount = principal
    for _ in range(years):
        amount = amount * (1 + rate)
    return round(amount, 2)
