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
