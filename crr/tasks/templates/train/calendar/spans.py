"""Spans of day numbers (day 0 is a Monday)."""

WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def add_months(year, month, count):
    index = year * 12 + (month - 1) + count
    return index // 12, index % 12 + 1


def overlapping_days(a_start, a_end, b_start, b_end):
    """Days shared by two inclusive ranges of day numbers."""
    start = max(a_start, b_start)
    end = min(a_end, b_end)
    if end < start:
        return 0
    return end - start + 1


def weekday_name(day_number):
    return WEEKDAYS[day_number % 7]


def business_days(start_day, count):
    """Weekdays (Mon-Fri) among `count` consecutive days from `start_day`."""
    total = 0
    for day in range(start_day, start_day + count):
        if day % 7 < 5:
            total += 1
    return total
