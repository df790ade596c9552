"""Matrices as lists of rows."""


def transpose(m):
    if not m:
        return []
    return [[row[j] for row in m] for j in range(len(m[0]))]


def matmul(a, b):
    if len(a[0]) != len(b):
        raise ValueError("shape mismatch")
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))]
            for i in range(len(a))]


def trace(m):
    """Sum of the main diagonal (of the leading square part)."""
    return sum(m[i][i] for i in range(min(len(m), len(m[0]))))


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]
