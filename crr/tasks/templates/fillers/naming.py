"""Identifier styles."""

import re


def snake_to_camel(name):
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def camel_to_snake(name):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
