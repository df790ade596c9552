"""Exceptions raised by this package."""


class PackageError(Exception):
    """Base class for errors raised on purpose."""


class NotFoundError(PackageError):
    pass


class InvalidInputError(PackageError, ValueError):
    pass
