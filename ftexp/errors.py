"""The one exception type that means "bad input": the CLI prints its message on one line and exits 2."""


class InputError(Exception):
    """Bad configuration or input (unknown mode, malformed predicate, corrupt dump, ...)."""
