"""Cart lines are (unit_price, quantity) pairs."""


def line_total(unit_price, quantity):
    if quantity < 0:
        raise ValueError("quantity must not be negative")
    return round(unit_price * quantity, 2)


def subtotal(lines):
    return round(sum(line_total(price, qty) for price, qty in lines), 2)


def shipping_cost(amount, free_over=50.0, flat_rate=4.99):
    """Flat shipping, free for empty carts and from `free_over` upwards."""
    if amount >= free_over:
        return 0.0
    if amount == 0:
        return 0.0
    return flat_rate


def item_count(lines):
    return sum(qty for _, qty in lines)
