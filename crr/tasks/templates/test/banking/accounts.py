"""Transactions are (kind, amount) pairs with kind 'deposit' or 'withdrawal'."""

OVERDRAFT_FEE = 25


def balance(transactions, opening=0):
    total = opening
    for kind, amount in transactions:
        if kind == "deposit":
            total += amount
        elif kind == "withdrawal":
            total -= amount
        else:
            raise ValueError(f"unknown transaction kind {kind!r}")
    return total


def overdraft_fees(transactions, opening=0):
    """A fee for every withdrawal that leaves the balance below zero."""
    total = opening
    fees = 0
    for kind, amount in transactions:
        total = balance([(kind, amount)], total)
        if total < 0 and kind == "withdrawal":
            fees += OVERDRAFT_FEE
    return fees


def largest_withdrawal(transactions):
    amounts = [amount for kind, amount in transactions if kind == "withdrawal"]
    if not amounts:
        return 0
    return max(amounts)
