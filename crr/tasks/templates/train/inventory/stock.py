"""Stock levels and reorder decisions."""

REORDER_BUFFER = 2


def available(on_hand, reserved):
    """Units that can still be sold; never negative."""
    free = on_hand - reserved
    if free < 0:
        return 0
    return free


def needs_reorder(on_hand, reserved, reorder_point):
    """True when sellable stock has fallen to the reorder point or below."""
    return available(on_hand, reserved) <= reorder_point


def reorder_quantity(on_hand, reserved, reorder_point, batch_size):
    """Whole batches that lift stock above the reorder point plus a safety buffer."""
    if not needs_reorder(on_hand, reserved, reorder_point):
        return 0
    shortfall = reorder_point + REORDER_BUFFER - available(on_hand, reserved)
    batches = (shortfall + batch_size - 1) // batch_size
    return batches * batch_size
