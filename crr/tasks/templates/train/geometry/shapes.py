"""Points are (x, y) tuples; polygons are lists of points."""

import math


def distance(p, q):
    return math.hypot(q[0] - p[0], q[1] - p[1])


def polygon_area(points):
    """Shoelace formula; positive for either orientation."""
    n = len(points)
    if n < 3:
        return 0.0
    s = 0.0
    for i in range(n):
        x1, y1 = points[i]
        x2, y2 = points[(i + 1) % n]
        s += x1 * y2 - x2 * y1
    return abs(s) / 2


def perimeter(points):
    """Length of the closed outline through the points."""
    if len(points) < 2:
        return 0.0
    total = 0.0
    for i in range(len(points)):
        total += distance(points[i], points[(i + 1) % len(points)])
    return round(total, 6)


def centroid(points):
    if not points:
        raise ValueError("centroid of no points")
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return (sum(xs) / len(points), sum(ys) / len(points))
