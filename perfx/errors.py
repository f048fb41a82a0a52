"""The one exception type users see: its message says what was wrong and what to do."""


class PerfxError(Exception):
    """A problem the user can act on (bad input, missing driver, a limit exceeded).

    The CLI prints ``str(error)`` as one clear message instead of a traceback.
    """
