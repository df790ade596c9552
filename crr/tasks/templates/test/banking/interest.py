"""Interest and loan payments."""


def simple_interest(principal, annual_rate, days):
    return round(principal * annual_rate * days / 365, 2)


def monthly_payment(principal, annual_rate, months):
    """Annuity payment; plain division when the rate is zero."""
    if months <= 0:
        raise ValueError("months must be positive")
    if annual_rate == 0:
        return round(principal / months, 2)
    r = annual_rate / 12
    return round(principal * r / (1 - (1 + r) ** -months), 2)


def savings_after(deposit, annual_rate, months):
    """Balance after depositing at the start of each month with monthly compounding."""
    total = 0.0
    for _ in range(months):
        total = (total + deposit) * (1 + annual_rate / 12)
    return round(total, 2)
