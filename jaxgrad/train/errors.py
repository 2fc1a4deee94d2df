"""Errors a user can fix (a bad option, key, file, data set or run directory): front ends print the message on one
line and exit with status 2, never a traceback. Any other exception raised while a run is set up or trained (a
``ValueError`` from JAX, a ``KeyError`` from a bug) is not one of these and keeps its traceback."""


class ConfigError(ValueError):
    """A bad configuration key or value, option, or input file; the message names it."""


class DataError(ConfigError):
    """A data set that cannot be used as configured (no file matches a pattern, too few bytes or items, a data file
    that cannot be read); the message names the key or the file and what was expected."""
