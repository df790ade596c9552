"""Elo ratings."""

K_FACTOR = 32


def expected_score(rating_a, rating_b):
    return 1 / (1 + 10 ** ((rating_b - rating_a) / 400))


def update_elo(rating_a, rating_b, score_a):
    """A's new rating after scoring `score_a` (1 win, 0.5 draw, 0 loss) against B."""
    expected = expected_score(rating_a, rating_b)
    return round(rating_a + K_FACTOR * (score_a - expected), 1)


def win_probability_table(ratings):
    names = sorted(ratings)
    return {(a, b): round(expected_score(ratings[a], ratings[b]), 3)
            for a in names for b in names if a != b}
