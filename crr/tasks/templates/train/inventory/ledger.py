"""Stock movements recorded as (sku, delta) pairs."""


def apply_movements(levels, movements):
    """New stock levels after the movements; unknown skus start at zero."""
    result = dict(levels)
    for sku, delta in movements:
        result[sku] = result.get(sku, 0) + delta
    return result


def low_stock(levels, threshold):
    """Skus whose level is below `threshold`, lowest first, ties by name."""
    low = [(level, sku) for sku, level in levels.items() if level < threshold]
    return [sku for level, sku in sorted(low)]


def stock_value(levels, prices):
    """Total value of the stock; skus without a price are ignored."""
    total = 0.0
    for sku, level in levels.items():
        if sku in prices:
            total += level * prices[sku]
    return round(total, 2)
