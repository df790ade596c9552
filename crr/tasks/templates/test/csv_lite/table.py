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
