"""Axis-aligned boxes as (x0, y0, x1, y1) with x0 <= x1 and y0 <= y1."""


def bounding_box(points):
    if not points:
        raise ValueError("no points")
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return (min(xs), min(ys), max(xs), max(ys))


def contains(box, point):
    """True when the point lies inside the box or on its edge."""
    x0, y0, x1, y1 = box
    x, y = point
    return x0 <= x <= x1 and y0 <= y <= y1


def overlap_area(a, b):
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    if width <= 0 or height <= 0:
        return 0
    return width * height
