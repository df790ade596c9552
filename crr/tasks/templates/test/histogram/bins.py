"""Equal-width histograms."""


def bin_index(value, low, width):
    if width <= 0:
        raise ValueError("width must be positive")
    return int((value - low) // width)


def histogram(values, low, high, bins):
    """Counts per bin on [low, high]; values outside are dropped; `high` goes in the last bin."""
    width = (high - low) / bins
    counts = [0] * bins
    for v in values:
        if v < low or v > high:
            continue
        i = bin_index(v, low, width)
        counts[min(i, bins - 1)] += 1
    return counts


def bin_edges(low, high, bins):
    width = (high - low) / bins
    return [round(low + i * width, 6) for i in range(bins + 1)]
