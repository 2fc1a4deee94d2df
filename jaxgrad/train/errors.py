"""Errors a user can fix (a bad option, key, file or run directory): front ends print the message on one line and
exit with status 2, never a traceback."""


class ConfigError(ValueError):
    """A bad configuration key or value, option, or input file; the message names it."""
