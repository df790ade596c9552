"""Vectors as lists of numbers."""

import math


def dot(u, v):
    if len(u) != len(v):
        raise ValueError("vectors differ in length")
    return sum(a * b for a, b in zip(u, v))


def norm(v):
    return math.sqrt(dot(v, v))


def cosine_similarity(u, v):
    """0.0 when either vector is zero."""
    nu, nv = norm(u), norm(v)
    if nu == 0 or nv == 0:
        return 0.0
    return round(dot(u, v) / (nu * nv), 6)


def scale(v, factor):
    return [x * factor for x in v]
