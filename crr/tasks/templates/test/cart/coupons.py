"""Discounts."""

from .cart import subtotal


def percent_off(amount, percent):
    if not 0 <= percent <= 100:
        raise ValueError("percent must be between 0 and 100")
    return round(amount * (100 - percent) / 100, 2)


def bulk_price(quantity, unit_price, tiers=((10, 0.05), (50, 0.1))):
    """Price of `quantity` units with the best tier discount reached."""
    rate = 0.0
    for minimum, discount in tiers:
        if quantity >= minimum:
            rate = discount
    return round(quantity * unit_price * (1 - rate), 2)


def best_coupon(lines, coupons):
    """(code, price) of the coupon giving the lowest price; (None, subtotal) if none helps."""
    amount = subtotal(lines)
    best_code = None
    best_price = amount
    for code in sorted(coupons):
        price = percent_off(amount, coupons[code])
        if price < best_price:
            best_code = code
            best_price = price
    return best_code, best_price
