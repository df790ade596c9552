"""Bit tricks."""


def is_power_of_two(n):
    return n > 0 and n & (n - 1) == 0


def bit_count(n):
    return bin(n).count("1")
