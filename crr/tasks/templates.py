"""Source templates of the embedded micro task set: small, realistic Python packages and their tests.

A template is a package in a domain (inventory, text statistics, ...) of two or three modules with
documented functions. `cases` lists, per public function, argument lists written as Python source;
the generator computes each expected value by running the correct code, so tests are right by
construction. Templates are split between train and test (disjoint domains); the shared FILLERS are
generic utility modules added to reach a task's module count. Bugs are only injected in template
modules, never in fillers.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Module:
    name: str                                   # module file name without .py
    source: str
    cases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # function -> argument sources


@dataclass(frozen=True)
class Template:
    name: str
    split: str                   # "train" or "test": the pool it belongs to
    packages: tuple[str, ...]    # candidate package names
    purpose: str                 # what a user does with it, for the README and the issue text
    modules: tuple[Module, ...]


def _m(name: str, source: str, **cases: tuple[str, ...]) -> Module:
    return Module(name, textwrap.dedent(source).lstrip("\n"), cases)


TEMPLATES: tuple[Template, ...] = (
    # ----------------------------------------------------------------------------- train
    Template("inventory", "train", ("stockroom", "shelfkeeper", "warehouse_kit"),
             "track stock levels and decide when to reorder", (
        _m("stock", '''
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
            ''',
           available=("5, 2", "2, 5", "3, 3", "0, 0", "10, 1"),
           needs_reorder=("10, 2, 5", "7, 2, 5", "3, 0, 5", "6, 0, 5", "4, 4, 0"),
           reorder_quantity=("10, 0, 5, 4", "5, 0, 5, 4", "1, 0, 5, 3", "0, 0, 5, 10", "6, 3, 5, 2",
                             "8, 1, 5, 1")),
        _m("ledger", '''
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
            ''',
           apply_movements=("{'a': 1}, [('a', 2), ('b', 3)]", "{}, []", "{'x': 5}, [('x', -5), ('x', 1)]",
                            "{'p': 2, 'q': 9}, [('q', -4)]"),
           low_stock=("{'a': 1, 'b': 5, 'c': 0}, 3", "{'a': 3}, 3", "{'b': 2, 'a': 2}, 5",
                      "{'m': 4, 'n': 1, 'o': 2}, 4"),
           stock_value=("{'a': 2, 'b': 3}, {'a': 1.5, 'b': 2.0}", "{'a': 1}, {}", "{}, {'a': 1.0}",
                        "{'a': 4, 'b': 1}, {'b': 2.25}")),
    )),
    Template("text_stats", "train", ("wordcount", "textmetrics", "prose_stats"),
             "compute readability statistics of short texts", (
        _m("tokens", '''
            """Splitting text into words and sentences."""

            import re

            WORD_RE = re.compile(r"[A-Za-z']+")


            def words(text):
                """Lower-cased words of `text`; apostrophes stay inside words."""
                return [w.lower() for w in WORD_RE.findall(text)]


            def sentences(text):
                """Non-empty sentences, split on '.', '!' and '?'."""
                parts = re.split(r"[.!?]+", text)
                return [p.strip() for p in parts if p.strip()]
            ''',
           words=("'Hello, world!'", "\"It's a dog's life\"", "''", "'ONE two Three'"),
           sentences=("'Hi. How are you? Fine!'", "'No punctuation'", "'...'", "'A.B'")),
        _m("stats", '''
            """Word and sentence statistics."""

            from .tokens import sentences, words


            def word_frequencies(text, top=3):
                """The `top` most frequent words as (word, count), ties broken alphabetically."""
                counts = {}
                for w in words(text):
                    counts[w] = counts.get(w, 0) + 1
                ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
                return ranked[:top]


            def average_word_length(text):
                ws = words(text)
                if not ws:
                    return 0.0
                return sum(len(w) for w in ws) / len(ws)


            def average_sentence_length(text):
                """Mean number of words per sentence."""
                ss = sentences(text)
                if len(ss) == 0:
                    return 0.0
                return len(words(text)) / len(ss)


            def lexical_density(text, stopwords=("the", "a", "an", "and", "of", "to")):
                """Share of words that are not stopwords, to three decimals."""
                ws = words(text)
                if not ws:
                    return 0.0
                content = [w for w in ws if w not in stopwords]
                return round(len(content) / len(ws), 3)


            def longest_word(text):
                """The first longest word."""
                best = ""
                for w in words(text):
                    if len(w) > len(best):
                        best = w
                return best
            ''',
           word_frequencies=("'the cat and the hat', 2", "'b a b a c', 3", "'', 3", "'Red red RED blue', 1",
                             "'x y z y', 5"),
           average_word_length=("'hello world'", "'a bb ccc'", "''", "\"It's fine.\""),
           average_sentence_length=("'One two. Three four five!'", "'Just words'", "''", "'A b c. D.'"),
           lexical_density=("'the cat sat on the mat'", "'a an the'", "'Data science rocks'", "''"),
           longest_word=("'a bb ccc dd'", "'tie tie'", "''", "'short loooong mid'", "'ab cd'")),
    )),
    Template("money", "train", ("ledgerly", "moneybox", "centsible"),
             "split bills, apply discounts and estimate taxes", (
        _m("money", '''
            """Amounts in integer cents."""


            def to_cents(amount):
                """Convert a decimal amount to cents, rounding half away from zero."""
                cents = abs(amount) * 100 + 0.5
                sign = -1 if amount < 0 else 1
                return sign * int(cents)


            def split_evenly(total_cents, people):
                """Split cents among people; the first ones get the leftover cents."""
                if people <= 0:
                    raise ValueError("people must be positive")
                share, leftover = divmod(total_cents, people)
                return [share + 1 if i < leftover else share for i in range(people)]


            def apply_discount(price_cents, percent):
                """Price after a whole-percent discount, rounding the discount down."""
                if percent < 0 or percent > 100:
                    raise ValueError("percent must be between 0 and 100")
                return price_cents - price_cents * percent // 100
            ''',
           to_cents=("12.34", "-3.5", "0.1", "2", "-0.25"),
           split_evenly=("100, 3", "10, 5", "7, 0", "5, 7", "11, 2"),
           apply_discount=("1000, 15", "999, 50", "100, 0", "100, 100", "100, 101", "100, -1")),
        _m("tax", '''
            """Progressive income tax and compound growth."""

            BRACKETS = ((1000, 0.0), (5000, 0.1), (None, 0.2))


            def progressive_tax(income):
                """Tax owed: each bracket's rate applies to the income inside it."""
                tax = 0.0
                lower = 0
                for upper, rate in BRACKETS:
                    if upper is None or income <= upper:
                        tax += (income - lower) * rate
                        break
                    tax += (upper - lower) * rate
                    lower = upper
                return round(tax, 2)


            def net_income(income):
                return round(income - progressive_tax(income), 2)


            def compound(principal, rate, years):
                """Value after `years` of yearly compounding."""
                amount = principal
                for _ in range(years):
                    amount = amount * (1 + rate)
                return round(amount, 2)
            ''',
           progressive_tax=("500", "1000", "3000", "5000", "8000", "0"),
           net_income=("3000", "8000", "999"),
           compound=("100, 0.05, 2", "100, 0.1, 0", "250, 0.02, 3", "1000, 0.5, 1")),
    )),
    Template("geometry", "train", ("planegeo", "geomkit", "polyline"),
             "measure polygons and bounding boxes in the plane", (
        _m("shapes", '''
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
            ''',
           distance=("(0, 0), (3, 4)", "(1, 1), (1, 1)", "(-1, 2), (2, -2)"),
           polygon_area=("[(0, 0), (4, 0), (4, 3)]", "[(0, 0), (1, 0)]", "[(0, 0), (2, 0), (2, 2), (0, 2)]",
                         "[(0, 0), (0, 2), (3, 2), (3, 0)]"),
           perimeter=("[(0, 0), (3, 0), (3, 4)]", "[(0, 0)]", "[(0, 0), (1, 0)]", "[(0, 0), (2, 0), (2, 2), (0, 2)]"),
           centroid=("[(0, 0), (2, 0), (2, 2), (0, 2)]", "[]", "[(1, 5)]", "[(0, 0), (3, 0), (0, 3)]")),
        _m("boxes", '''
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
            ''',
           bounding_box=("[(1, 2), (3, -1), (0, 0)]", "[]", "[(5, 5)]", "[(2, 8), (4, 1)]"),
           contains=("(0, 0, 2, 2), (2, 2)", "(0, 0, 2, 2), (3, 1)", "(0, 0, 2, 2), (1, 1)", "(0, 0, 2, 2), (-1, 0)",
                     "(0, 0, 4, 2), (4, 0)"),
           overlap_area=("(0, 0, 2, 2), (1, 1, 3, 3)", "(0, 0, 1, 1), (1, 1, 2, 2)", "(0, 0, 4, 4), (1, 1, 2, 3)",
                         "(0, 0, 1, 1), (2, 2, 3, 3)", "(0, 0, 5, 1), (2, 0, 9, 4)")),
    )),
    Template("config", "train", ("confkit", "settingsparse", "iniwise"),
             "read INI-style configuration files", (
        _m("parser", '''
            """A small INI-style configuration parser."""


            def parse_bool(value):
                v = value.strip().lower()
                if v in ("1", "true", "yes", "on"):
                    return True
                if v in ("0", "false", "no", "off"):
                    return False
                raise ValueError(f"not a boolean: {value!r}")


            def parse_line(line):
                """'key = value' -> (key, value); comments and blank lines -> None."""
                stripped = line.strip()
                if not stripped or stripped.startswith("#"):
                    return None
                if "=" not in stripped:
                    raise ValueError(f"missing '=' in {line!r}")
                key, _, value = stripped.partition("=")
                return key.strip(), value.strip()


            def parse_config(text):
                """Sections as nested dicts; keys before any section go under 'default'."""
                config = {"default": {}}
                section = "default"
                for line in text.splitlines():
                    s = line.strip()
                    if s.startswith("[") and s.endswith("]"):
                        section = s[1:-1].strip()
                        config.setdefault(section, {})
                        continue
                    pair = parse_line(line)
                    if pair is not None:
                        config[section][pair[0]] = pair[1]
                return config
            ''',
           parse_bool=("'yes'", "' Off '", "'TRUE'", "'maybe'", "'0'"),
           parse_line=("'a = 1'", "'# comment'", "''", "'noequals'", "'url = http://x?a=b'"),
           parse_config=("'[db]\\nhost = x\\nport = 5\\n'", "'name = app\\n[log]\\nlevel = debug'", "''",
                         "'[ a ]\\nk=v\\n# c\\n'")),
        _m("values", '''
            """Typed access to parsed configuration."""


            def coerce(value):
                """Config text as int, float, bool or str."""
                try:
                    return int(value)
                except ValueError:
                    pass
                try:
                    return float(value)
                except ValueError:
                    pass
                low = value.lower()
                if low in ("true", "false"):
                    return low == "true"
                return value


            def get_int(config, section, key, default=0, minimum=None):
                raw = config.get(section, {}).get(key)
                if raw is None:
                    return default
                number = int(raw)
                if minimum is not None and number < minimum:
                    return minimum
                return number


            def merge(base, override):
                """Override's keys win; neither input is modified."""
                merged = {name: dict(values) for name, values in base.items()}
                for name, values in override.items():
                    merged.setdefault(name, {}).update(values)
                return merged
            ''',
           coerce=("'42'", "'3.5'", "'True'", "'hello'", "'-7'"),
           get_int=("{'db': {'port': '5432'}}, 'db', 'port'", "{'db': {}}, 'db', 'port', 10",
                    "{'db': {'n': '1'}}, 'db', 'n', 0, 3", "{}, 'x', 'y'", "{'a': {'n': '5'}}, 'a', 'n', 0, 5"),
           merge=("{'a': {'x': '1'}}, {'a': {'y': '2'}, 'b': {'z': '3'}}", "{}, {}",
                  "{'a': {'x': '1'}}, {'a': {'x': '2'}}")),
    )),
    Template("ranking", "train", ("leaderboard", "rankit", "scoreboard"),
             "rank players and update Elo ratings", (
        _m("ranking", '''
            """Rankings of {name: score} tables."""


            def rank_scores(scores):
                """Competition ranking ('1224'): equal scores share a rank."""
                ordered = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
                ranks = {}
                previous = None
                rank = 0
                for position, (name, score) in enumerate(ordered, start=1):
                    if score != previous:
                        rank = position
                        previous = score
                    ranks[name] = rank
                return ranks


            def top_n(scores, n):
                if n <= 0:
                    return []
                ordered = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
                return [name for name, _ in ordered[:n]]


            def percentile_rank(values, value):
                """Percent of values below `value`, counting ties as half."""
                if not values:
                    raise ValueError("percentile of empty data")
                below = sum(1 for v in values if v < value)
                equal = sum(1 for v in values if v == value)
                return round(100.0 * (below + 0.5 * equal) / len(values), 2)
            ''',
           rank_scores=("{'a': 10, 'b': 20, 'c': 10}", "{'x': 5}", "{'a': 1, 'b': 2, 'c': 3, 'd': 3}", "{}"),
           top_n=("{'a': 3, 'b': 5, 'c': 5}, 2", "{'a': 1}, 0", "{'a': 1, 'b': 2}, 5", "{'z': 1, 'y': 1}, 1"),
           percentile_rank=("[1, 2, 3, 4], 3", "[5, 5, 5], 5", "[1, 2, 3], 10", "[], 1", "[1, 2, 3, 4], 0")),
        _m("elo", '''
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
            ''',
           expected_score=("1500, 1500", "1600, 1400", "1200, 1800"),
           update_elo=("1500, 1500, 1", "1600, 1400, 0", "1400, 1600, 0.5", "2000, 1000, 1"),
           win_probability_table=("{'a': 1500, 'b': 1700}", "{'x': 1000}")),
    )),
    Template("calendar", "train", ("datewise", "calendarkit", "daycount"),
             "do calendar arithmetic without datetime", (
        _m("months", '''
            """Months and leap years (proleptic Gregorian)."""

            DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


            def is_leap_year(year):
                return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


            def days_in_month(year, month):
                if month < 1 or month > 12:
                    raise ValueError("month must be in 1..12")
                if month == 2 and is_leap_year(year):
                    return 29
                return DAYS_IN_MONTH[month - 1]


            def day_of_year(year, month, day):
                """1 for January 1st."""
                total = day
                for m in range(1, month):
                    total += days_in_month(year, m)
                return total
            ''',
           is_leap_year=("2000", "1900", "2024", "2023"),
           days_in_month=("2024, 2", "2023, 2", "2023, 4", "2023, 12", "2023, 13", "2023, 0", "2023, 1"),
           day_of_year=("2023, 1, 1", "2023, 3, 1", "2024, 3, 1", "2023, 12, 31")),
        _m("spans", '''
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
            ''',
           add_months=("2023, 11, 2", "2023, 1, -1", "2024, 5, 0", "2020, 12, 12"),
           overlapping_days=("1, 10, 5, 15", "1, 4, 5, 9", "1, 5, 5, 9", "3, 3, 1, 10"),
           weekday_name=("0", "6", "7", "15"),
           business_days=("0, 7", "5, 2", "4, 3", "0, 0", "3, 10")),
    )),
    Template("matrix", "train", ("gridmath", "matrixlite", "tinylinalg"),
             "do small linear-algebra computations on nested lists", (
        _m("matrices", '''
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
            ''',
           transpose=("[[1, 2, 3], [4, 5, 6]]", "[]", "[[1]]"),
           matmul=("[[1, 2], [3, 4]], [[5, 6], [7, 8]]", "[[1, 2, 3]], [[1], [2], [3]]", "[[1, 2]], [[1, 2]]"),
           trace=("[[1, 2], [3, 4]]", "[[1, 2, 3], [4, 5, 6]]", "[[7]]"),
           identity=("3", "1", "0")),
        _m("vectors", '''
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
            ''',
           dot=("[1, 2, 3], [4, 5, 6]", "[], []", "[1, 2], [1]"),
           norm=("[3, 4]", "[]", "[1, 1, 1, 1]"),
           cosine_similarity=("[1, 0], [0, 1]", "[1, 2], [2, 4]", "[0, 0], [1, 1]", "[1, 1], [1, 0]"),
           scale=("[1, 2], 3", "[], 5", "[0.5, -1], 2")),
    )),
    # ----------------------------------------------------------------------------- test
    Template("cart", "test", ("cartwheel", "checkout_kit", "basketcalc"),
             "price shopping carts with coupons and bulk discounts", (
        _m("cart", '''
            """Cart lines are (unit_price, quantity) pairs."""


            def line_total(unit_price, quantity):
                if quantity < 0:
                    raise ValueError("quantity must not be negative")
                return round(unit_price * quantity, 2)


            def subtotal(lines):
                return round(sum(line_total(price, qty) for price, qty in lines), 2)


            def shipping_cost(amount, free_over=50.0, flat_rate=4.99):
                """Flat shipping, free for empty carts and from `free_over` upwards."""
                if amount >= free_over:
                    return 0.0
                if amount == 0:
                    return 0.0
                return flat_rate


            def item_count(lines):
                return sum(qty for _, qty in lines)
            ''',
           line_total=("2.5, 4", "19.99, 0", "1.1, 3", "5, -1"),
           subtotal=("[(2.5, 4), (1.25, 2)]", "[]", "[(19.99, 1)]"),
           shipping_cost=("49.99", "50.0", "0", "12.5", "80, 100, 7.5"),
           item_count=("[(1.0, 2), (3.0, 5)]", "[]", "[(9.99, 1)]")),
        _m("coupons", '''
            """Discounts."""

            from .cart import subtotal


            def percent_off(amount, percent):
                if not 0 <= percent <= 100:
                    raise ValueError("percent must be between 0 and 100")
                return round(amount * (100 - percent) / 100, 2)


            def bulk_price(quantity, unit_price, tiers=((10, 0.05), (50, 0.1))):
                """Price of `quantity` units with the best tier discount reached."""
                rate = 0.0
                for minimum, discount in tiers:
                    if quantity >= minimum:
                        rate = discount
                return round(quantity * unit_price * (1 - rate), 2)


            def best_coupon(lines, coupons):
                """(code, price) of the coupon giving the lowest price; (None, subtotal) if none helps."""
                amount = subtotal(lines)
                best_code = None
                best_price = amount
                for code in sorted(coupons):
                    price = percent_off(amount, coupons[code])
                    if price < best_price:
                        best_code = code
                        best_price = price
                return best_code, best_price
            ''',
           percent_off=("80.0, 25", "19.99, 0", "10, 100", "10, 101", "10, -5"),
           bulk_price=("9, 2.0", "10, 2.0", "50, 1.0", "75, 1.0", "0, 3.0"),
           best_coupon=("[(10.0, 2)], {'A': 10, 'B': 25}", "[(10.0, 1)], {}", "[(5.0, 2)], {'Z': 5, 'Y': 5}",
                        "[(4.0, 1)], {'NONE': 0}")),
    )),
    Template("gradebook", "test", ("gradebook", "markbook", "classgrades"),
             "compute weighted course grades and curves", (
        _m("grades", '''
            """Course grades."""

            WEIGHTS = {"homework": 0.3, "midterm": 0.3, "final": 0.4}


            def weighted_score(scores, weights=WEIGHTS):
                """Weighted mean over the parts present in `scores`."""
                total = 0.0
                used = 0.0
                for part, weight in weights.items():
                    if part in scores:
                        total += scores[part] * weight
                        used += weight
                if used == 0:
                    return 0.0
                return round(total / used, 2)


            def letter_grade(score):
                if score >= 90:
                    return "A"
                elif score >= 80:
                    return "B"
                elif score >= 70:
                    return "C"
                elif score >= 60:
                    return "D"
                return "F"


            def passing_students(scores, threshold=60):
                return sorted(name for name, score in scores.items() if score >= threshold)
            ''',
           weighted_score=("{'homework': 80, 'midterm': 70, 'final': 90}", "{}", "{'final': 55}",
                           "{'homework': 100, 'final': 50}"),
           letter_grade=("95", "90", "85", "70", "65", "59.5", "80"),
           passing_students=("{'ann': 60, 'bob': 59, 'cy': 88}", "{}", "{'x': 40, 'y': 45}, 45")),
        _m("curve", '''
            """Curving and dropping scores."""


            def class_average(scores):
                if not scores:
                    return 0.0
                return round(sum(scores) / len(scores), 2)


            def curve_to_target(scores, target=75, cap=100):
                """Shift every score up so that the average reaches `target`, never above `cap`."""
                shift = target - class_average(scores)
                if shift <= 0:
                    return list(scores)
                return [min(cap, round(s + shift, 2)) for s in scores]


            def drop_lowest(scores, count=1):
                """Remaining scores, in ascending order, after dropping the `count` lowest."""
                if count >= len(scores):
                    return []
                return sorted(scores)[count:]
            ''',
           class_average=("[70, 80, 90]", "[]", "[55]"),
           curve_to_target=("[60, 70, 80]", "[80, 90]", "[50, 99]", "[]"),
           drop_lowest=("[3, 1, 2]", "[5]", "[4, 8, 6, 2], 2", "[1, 2], 0")),
    )),
    Template("units", "test", ("unitconv", "measurekit", "quantities"),
             "convert temperatures and distances", (
        _m("temperature", '''
            """Temperature conversions."""

            ABSOLUTE_ZERO_C = -273.15


            def celsius_to_fahrenheit(c):
                return round(c * 9 / 5 + 32, 2)


            def fahrenheit_to_celsius(f):
                return round((f - 32) * 5 / 9, 2)


            def celsius_to_kelvin(c):
                if c < ABSOLUTE_ZERO_C:
                    raise ValueError("below absolute zero")
                return round(c - ABSOLUTE_ZERO_C, 2)


            def describe(c):
                if c <= 0:
                    return "freezing"
                elif c < 15:
                    return "cold"
                elif c < 25:
                    return "mild"
                return "hot"
            ''',
           celsius_to_fahrenheit=("0", "100", "-40", "36.6"),
           fahrenheit_to_celsius=("32", "212", "-40", "98.6"),
           celsius_to_kelvin=("0", "-273.15", "-300", "25"),
           describe=("-5", "0", "14.9", "15", "24", "25", "30")),
        _m("distance", '''
            """Distance units."""

            FACTORS = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048,
                       "mi": 1609.344}


            def convert(value, from_unit, to_unit):
                if from_unit not in FACTORS or to_unit not in FACTORS:
                    raise ValueError(f"unknown unit in {from_unit!r} -> {to_unit!r}")
                return round(value * FACTORS[from_unit] / FACTORS[to_unit], 4)


            def parse_quantity(text):
                """'12.5 km' -> (12.5, 'km')."""
                number, _, unit = text.strip().partition(" ")
                if not unit:
                    raise ValueError(f"missing unit in {text!r}")
                return float(number), unit.strip().lower()


            def total_distance(quantities, unit="m"):
                """Sum of (value, unit) pairs expressed in `unit`."""
                return round(sum(convert(v, u, unit) for v, u in quantities), 4)
            ''',
           convert=("5, 'km', 'm'", "12, 'in', 'cm'", "1, 'mi', 'km'", "3, 'yd', 'm'"),
           parse_quantity=("'12.5 km'", "' 3 FT '", "'7'"),
           total_distance=("[(1, 'km'), (500, 'm')]", "[]", "[(1, 'ft'), (1, 'in')], 'cm'")),
    )),
    Template("rle", "test", ("runlength", "rlecodec", "squeeze"),
             "run-length encode strings and measure compression", (
        _m("codec", '''
            """Run-length encoding: 'aaab' <-> [('a', 3), ('b', 1)]."""


            def encode(text):
                runs = []
                for ch in text:
                    if runs and runs[-1][0] == ch:
                        runs[-1] = (ch, runs[-1][1] + 1)
                    else:
                        runs.append((ch, 1))
                return runs


            def decode(runs):
                return "".join(ch * count for ch, count in runs)


            def to_string(runs):
                """Compact text form: counts of 1 are omitted ('a3b')."""
                parts = []
                for ch, count in runs:
                    if count > 1:
                        parts.append(ch + str(count))
                    else:
                        parts.append(ch)
                return "".join(parts)
            ''',
           encode=("'aaab'", "''", "'abc'", "'zzzz'", "'aabba'"),
           decode=("[('a', 3), ('b', 1)]", "[]", "[('x', 2), ('y', 2)]"),
           to_string=("[('a', 3), ('b', 1)]", "[]", "[('q', 1), ('r', 2), ('s', 1)]")),
        _m("measure", '''
            """Compression statistics."""

            from .codec import encode, to_string


            def compression_ratio(text):
                """Length of the compact form over the original length (1.0 for empty text)."""
                if not text:
                    return 1.0
                return round(len(to_string(encode(text))) / len(text), 3)


            def longest_run(text):
                """(character, length) of the first longest run."""
                best = ("", 0)
                for ch, count in encode(text):
                    if count > best[1]:
                        best = (ch, count)
                return best


            def run_count(text, min_length=2):
                return sum(1 for _, count in encode(text) if count >= min_length)
            ''',
           compression_ratio=("'aaaabbb'", "''", "'abc'", "'aab'"),
           longest_run=("'aabbbcc'", "''", "'abcd'", "'xxyy'"),
           run_count=("'aabccc'", "'abc'", "'aabccc', 3", "''")),
    )),
    Template("scheduling", "test", ("slotplanner", "agenda_kit", "timeslots"),
             "find free meeting slots in busy calendars", (
        _m("intervals", '''
            """Half-open intervals (start, end) in minutes."""


            def merge_intervals(intervals):
                merged = []
                for start, end in sorted(intervals):
                    if merged and start <= merged[-1][1]:
                        merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                    else:
                        merged.append((start, end))
                return merged


            def total_covered(intervals):
                return sum(end - start for start, end in merge_intervals(intervals))


            def overlaps(a, b):
                return a[0] < b[1] and b[0] < a[1]
            ''',
           merge_intervals=("[(1, 3), (2, 6), (8, 10)]", "[]", "[(5, 7), (1, 5)]", "[(1, 10), (2, 3)]"),
           total_covered=("[(0, 10), (5, 15)]", "[]", "[(0, 1), (2, 3)]"),
           overlaps=("(0, 5), (4, 8)", "(0, 5), (5, 8)", "(2, 3), (0, 10)", "(6, 9), (1, 2)")),
        _m("slots", '''
            """Free time between busy intervals."""

            from .intervals import merge_intervals, overlaps


            def free_slots(busy, day_start, day_end, min_length=1):
                """Gaps of at least `min_length` minutes between `day_start` and `day_end`."""
                free = []
                cursor = day_start
                for start, end in merge_intervals(busy):
                    if start - cursor >= min_length:
                        free.append((cursor, start))
                    cursor = max(cursor, end)
                if day_end - cursor >= min_length:
                    free.append((cursor, day_end))
                return free


            def fits(busy, start, length):
                slot = (start, start + length)
                return not any(overlaps(slot, b) for b in busy)


            def first_fit(busy, day_start, day_end, length):
                """Earliest start of a free slot that is long enough, or None."""
                for start, end in free_slots(busy, day_start, day_end):
                    if end - start >= length:
                        return start
                return None
            ''',
           free_slots=("[(60, 90), (120, 150)], 0, 180", "[], 0, 60", "[(0, 30), (29, 60)], 0, 60",
                       "[(10, 20)], 0, 30, 15", "[(10, 20)], 0, 30, 10"),
           fits=("[(60, 90)], 30, 30", "[(60, 90)], 30, 31", "[], 0, 10", "[(0, 10), (20, 30)], 10, 10"),
           first_fit=("[(60, 90)], 0, 120, 60", "[(60, 90)], 0, 120, 61", "[(0, 30)], 0, 60, 30",
                      "[(0, 60)], 0, 60, 1")),
    )),
    Template("banking", "test", ("banklog", "accountbook", "tallyhall"),
             "keep account balances and compute interest", (
        _m("accounts", '''
            """Transactions are (kind, amount) pairs with kind 'deposit' or 'withdrawal'."""

            OVERDRAFT_FEE = 25


            def balance(transactions, opening=0):
                total = opening
                for kind, amount in transactions:
                    if kind == "deposit":
                        total += amount
                    elif kind == "withdrawal":
                        total -= amount
                    else:
                        raise ValueError(f"unknown transaction kind {kind!r}")
                return total


            def overdraft_fees(transactions, opening=0):
                """A fee for every withdrawal that leaves the balance below zero."""
                total = opening
                fees = 0
                for kind, amount in transactions:
                    total = balance([(kind, amount)], total)
                    if total < 0 and kind == "withdrawal":
                        fees += OVERDRAFT_FEE
                return fees


            def largest_withdrawal(transactions):
                amounts = [amount for kind, amount in transactions if kind == "withdrawal"]
                if not amounts:
                    return 0
                return max(amounts)
            ''',
           balance=("[('deposit', 100), ('withdrawal', 30)]", "[]", "[('withdrawal', 5)], 10",
                    "[('refund', 1)]", "[('deposit', 1), ('deposit', 2)], -3"),
           overdraft_fees=("[('withdrawal', 50), ('deposit', 10), ('withdrawal', 1)], 20", "[]",
                           "[('withdrawal', 10)], 10", "[('withdrawal', 11)], 10"),
           largest_withdrawal=("[('withdrawal', 5), ('deposit', 50), ('withdrawal', 7)]", "[]",
                               "[('deposit', 3)]")),
        _m("interest", '''
            """Interest and loan payments."""


            def simple_interest(principal, annual_rate, days):
                return round(principal * annual_rate * days / 365, 2)


            def monthly_payment(principal, annual_rate, months):
                """Annuity payment; plain division when the rate is zero."""
                if months <= 0:
                    raise ValueError("months must be positive")
                if annual_rate == 0:
                    return round(principal / months, 2)
                r = annual_rate / 12
                return round(principal * r / (1 - (1 + r) ** -months), 2)


            def savings_after(deposit, annual_rate, months):
                """Balance after depositing at the start of each month with monthly compounding."""
                total = 0.0
                for _ in range(months):
                    total = (total + deposit) * (1 + annual_rate / 12)
                return round(total, 2)
            ''',
           simple_interest=("1000, 0.05, 365", "1000, 0.05, 73", "0, 0.1, 10"),
           monthly_payment=("1200, 0, 12", "10000, 0.06, 12", "500, 0.1, 0", "1000, 0.12, 1"),
           savings_after=("100, 0.12, 2", "50, 0, 3", "100, 0.06, 0")),
    )),
    Template("csv_lite", "test", ("csvlite", "tabletext", "delimited"),
             "read and summarise small CSV tables", (
        _m("fields", '''
            """Splitting CSV lines."""


            def split_fields(line, delimiter=","):
                """Fields of one line; double quotes protect delimiters and '""' is a literal quote."""
                fields = []
                current = []
                in_quotes = False
                skip = False
                for i, ch in enumerate(line):
                    if skip:
                        skip = False
                        continue
                    if ch == '"':
                        if in_quotes and i + 1 < len(line) and line[i + 1] == '"':
                            current.append('"')
                            skip = True
                        else:
                            in_quotes = not in_quotes
                    elif ch == delimiter and not in_quotes:
                        fields.append("".join(current))
                        current = []
                    else:
                        current.append(ch)
                fields.append("".join(current))
                return fields


            def parse_rows(text, delimiter=","):
                """Rows as dicts keyed by the header line; blank lines are skipped."""
                lines = [line for line in text.splitlines() if line.strip()]
                if not lines:
                    return []
                header = split_fields(lines[0], delimiter)
                return [dict(zip(header, split_fields(line, delimiter))) for line in lines[1:]]
            ''',
           split_fields=("'a,b,c'", "'\"x,y\",z'", "'say \"\"hi\"\",2'", "''", "'a;b', ';'", "'1,,3'"),
           parse_rows=("'n,v\\na,1\\nb,2'", "''", "'k\\n\\nx\\n'", "'a;b\\n1;2', ';'")),
        _m("table", '''
            """Working with parsed rows."""


            def column(rows, name):
                return [row[name] for row in rows if name in row]


            def numeric_summary(rows, name):
                """count/min/max/mean of a numeric column; blank cells are skipped."""
                values = [float(v) for v in column(rows, name) if v.strip()]
                if not values:
                    return {"count": 0, "min": None, "max": None, "mean": None}
                return {"count": len(values), "min": min(values), "max": max(values),
                        "mean": round(sum(values) / len(values), 3)}


            def filter_rows(rows, name, value):
                return [row for row in rows if row.get(name) == value]


            def to_line(values, delimiter=","):
                """One CSV line; fields with delimiters or quotes are quoted."""
                out = []
                for v in values:
                    text = str(v)
                    if delimiter in text or '"' in text:
                        text = '"' + text.replace('"', '""') + '"'
                    out.append(text)
                return delimiter.join(out)
            ''',
           column=("[{'a': '1'}, {'b': '2'}, {'a': '3'}], 'a'", "[], 'a'"),
           numeric_summary=("[{'x': '1'}, {'x': '4'}, {'x': ''}], 'x'", "[{'y': '2'}], 'x'",
                            "[{'x': '2.5'}, {'x': '-1'}], 'x'"),
           filter_rows=("[{'k': 'a'}, {'k': 'b'}, {'k': 'a', 'n': '1'}], 'k', 'a'", "[], 'k', 'x'"),
           to_line=("['a', 'b,c', 3]", "[]", "['say \"hi\"']", "['a;b', 'c'], ';'")),
    )),
    Template("histogram", "test", ("binstats", "histokit", "bucketize"),
             "bin numeric data and summarise distributions", (
        _m("bins", '''
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
            ''',
           bin_index=("5, 0, 2", "0, 0, 1", "-1, -3, 0.5", "3, 0, 0"),
           histogram=("[1, 2, 2, 9, 10], 0, 10, 5", "[], 0, 1, 2", "[-1, 0, 11], 0, 10, 2", "[5], 0, 10, 1"),
           bin_edges=("0, 10, 5", "0, 1, 3", "-2, 2, 4")),
        _m("summary", '''
            """Summary statistics."""


            def mode(values):
                """Most frequent value; the smallest one on ties; None for no data."""
                counts = {}
                for v in values:
                    counts[v] = counts.get(v, 0) + 1
                best = None
                for v in sorted(counts):
                    if best is None or counts[v] > counts[best]:
                        best = v
                return best


            def cumulative(counts):
                total = 0
                out = []
                for c in counts:
                    total += c
                    out.append(total)
                return out


            def median(values):
                if not values:
                    raise ValueError("median of empty data")
                ordered = sorted(values)
                mid = len(ordered) // 2
                if len(ordered) % 2 == 1:
                    return ordered[mid]
                return (ordered[mid - 1] + ordered[mid]) / 2
            ''',
           mode=("[1, 2, 2, 3]", "[]", "[3, 1, 3, 1]", "[7]"),
           cumulative=("[1, 2, 3]", "[]", "[0, 5, 0]"),
           median=("[3, 1, 2]", "[4, 1, 3, 2]", "[]", "[5]")),
    )),
)

# Generic utility modules shared by all templates: they pad a package to its module count with code
# that an agent has to read past. Bugs are never injected here.
FILLERS: tuple[Module, ...] = (
    _m("text_utils", '''
        """String helpers."""

        import re


        def slugify(text):
            return "-".join(re.findall(r"[a-z0-9]+", text.lower()))


        def truncate(text, width, suffix="..."):
            if len(text) <= width:
                return text
            return text[: max(0, width - len(suffix))] + suffix
        ''',
       slugify=("'Hello, World!'", "''", "'  A  b '"), truncate=("'abcdef', 4", "'abc', 3", "'abcdef', 2, '.'")),
    _m("numeric", '''
        """Number helpers."""


        def clamp(value, low, high):
            return max(low, min(high, value))


        def percent(part, whole):
            if whole == 0:
                return 0.0
            return round(100.0 * part / whole, 1)
        ''',
       clamp=("5, 0, 3", "-1, 0, 3", "2, 0, 3"), percent=("1, 3", "0, 0", "5, 5")),
    _m("sequences", '''
        """Sequence helpers."""


        def chunked(items, size):
            if size <= 0:
                raise ValueError("size must be positive")
            return [items[i:i + size] for i in range(0, len(items), size)]


        def flatten(nested):
            return [x for part in nested for x in part]


        def dedupe(items):
            """Items in first-seen order without repeats."""
            seen = []
            for item in items:
                if item not in seen:
                    seen.append(item)
            return seen
        ''',
       chunked=("[1, 2, 3, 4, 5], 2", "[], 3", "[1], 0"), flatten=("[[1], [2, 3], []]", "[]"),
       dedupe=("[3, 1, 3, 2, 1]", "[]")),
    _m("validation", '''
        """Argument checks."""


        def require_positive(name, value):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
            return value


        def require_non_empty(name, value):
            if not value:
                raise ValueError(f"{name} must not be empty")
            return value
        ''',
       require_positive=("'n', 3", "'n', 0"), require_non_empty=("'items', [1]", "'name', ''")),
    _m("formatting", '''
        """Human-readable output."""


        def pluralize(count, word, plural=None):
            if count == 1:
                return f"1 {word}"
            return f"{count} {plural or word + 's'}"


        def thousands(n):
            return f"{n:,}"
        ''',
       pluralize=("1, 'item'", "3, 'box', 'boxes'", "0, 'file'"), thousands=("1234567", "12", "-1000")),
    _m("retry", '''
        """Retry delays."""


        def backoff_delay(attempt, base=0.5, cap=30.0):
            """Exponential backoff in seconds, capped."""
            return min(cap, base * 2 ** attempt)
        ''',
       backoff_delay=("0", "3", "10", "2, 1.0, 3.0")),
    _m("versioning", '''
        """Version strings like '1.2.3'."""


        def parse_version(text):
            return tuple(int(part) for part in text.strip().split("."))


        def is_newer(a, b):
            return parse_version(a) > parse_version(b)
        ''',
       parse_version=("'1.2.3'", "' 10.0 '"), is_newer=("'1.10', '1.9'", "'2.0', '2.0'", "'0.9.1', '1.0'")),
    _m("colors", '''
        """Hex colours."""


        def hex_to_rgb(code):
            code = code.lstrip("#")
            if len(code) != 6:
                raise ValueError(f"bad colour {code!r}")
            return tuple(int(code[i:i + 2], 16) for i in (0, 2, 4))


        def rgb_to_hex(rgb):
            return "#" + "".join(f"{c:02x}" for c in rgb)
        ''',
       hex_to_rgb=("'#ff8000'", "'00ff00'", "'#fff'"), rgb_to_hex=("(255, 128, 0)", "(0, 0, 0)")),
    _m("roman", '''
        """Roman numerals."""

        NUMERALS = ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
                    (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))


        def to_roman(n):
            if n <= 0:
                raise ValueError("roman numerals start at 1")
            out = []
            for value, letters in NUMERALS:
                count, n = divmod(n, value)
                out.append(letters * count)
            return "".join(out)
        ''',
       to_roman=("1994", "4", "0", "3888")),
    _m("checksum", '''
        """Check digits."""


        def luhn_valid(number):
            digits = [int(d) for d in str(number)][::-1]
            total = 0
            for i, d in enumerate(digits):
                if i % 2 == 1:
                    d = d * 2
                    if d > 9:
                        d -= 9
                total += d
            return total % 10 == 0


        def digit_sum(n):
            return sum(int(d) for d in str(abs(n)))
        ''',
       luhn_valid=("79927398713", "79927398710", "0"), digit_sum=("12345", "-90", "0")),
    _m("bits", '''
        """Bit tricks."""


        def is_power_of_two(n):
            return n > 0 and n & (n - 1) == 0


        def bit_count(n):
            return bin(n).count("1")
        ''',
       is_power_of_two=("1", "6", "64", "0"), bit_count=("0", "255", "1024")),
    _m("wrapping", '''
        """Word wrapping."""


        def wrap_words(text, width):
            """Greedy wrap; words longer than `width` get a line of their own."""
            lines = []
            current = ""
            for word in text.split():
                if current and len(current) + 1 + len(word) > width:
                    lines.append(current)
                    current = word
                else:
                    current = f"{current} {word}" if current else word
            if current:
                lines.append(current)
            return lines
        ''',
       wrap_words=("'the quick brown fox', 10", "'', 5", "'supercalifragilistic is long', 8")),
    _m("mappings", '''
        """Dictionary helpers."""


        def invert(mapping):
            return {value: key for key, value in mapping.items()}


        def group_pairs(pairs):
            """(key, value) pairs -> {key: [values...]}, keys in first-seen order."""
            groups = {}
            for key, value in pairs:
                groups.setdefault(key, []).append(value)
            return groups
        ''',
       invert=("{'a': 1, 'b': 2}", "{}"), group_pairs=("[('x', 1), ('y', 2), ('x', 3)]", "[]")),
    _m("naming", '''
        """Identifier styles."""

        import re


        def snake_to_camel(name):
            head, *rest = name.split("_")
            return head + "".join(part.title() for part in rest)


        def camel_to_snake(name):
            return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
        ''',
       snake_to_camel=("'max_retry_count'", "'x'"), camel_to_snake=("'maxRetryCount'", "'Name'", "'id'")),
    _m("paths", '''
        """Path-like strings."""


        def split_ext(name):
            base, dot, ext = name.rpartition(".")
            if not dot or not base:
                return name, ""
            return base, "." + ext


        def common_prefix(paths):
            if not paths:
                return ""
            parts = [p.split("/") for p in paths]
            prefix = []
            for column in zip(*parts):
                if len(set(column)) != 1:
                    break
                prefix.append(column[0])
            return "/".join(prefix)
        ''',
       split_ext=("'report.tar.gz'", "'.bashrc'", "'README'"),
       common_prefix=("['a/b/c', 'a/b/d']", "[]", "['x/y', 'z/y']")),
    _m("ciphers", '''
        """Toy ciphers."""


        def caesar(text, shift):
            out = []
            for ch in text:
                if ch.isalpha() and ch.isascii():
                    base = ord("a") if ch.islower() else ord("A")
                    out.append(chr((ord(ch) - base + shift) % 26 + base))
                else:
                    out.append(ch)
            return "".join(out)
        ''',
       caesar=("'Hello, World', 3", "'xyz', 2", "'abc', -1")),
    _m("errors", '''
        """Exceptions raised by this package."""


        class PackageError(Exception):
            """Base class for errors raised on purpose."""


        class NotFoundError(PackageError):
            pass


        class InvalidInputError(PackageError, ValueError):
            pass
        '''),
    _m("constants", '''
        """Shared constants."""

        DEFAULT_ENCODING = "utf-8"
        MAX_ITEMS = 1000
        PRECISION = 2
        '''),
)


def templates_for(split: str) -> tuple[Template, ...]:
    return tuple(t for t in TEMPLATES if t.split == split)
