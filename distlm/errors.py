"""The one exception type for bad input.

Anything the user can fix (a flag, a file, a degree) raises ``UsageError`` with a
one-line message that names the setting and the fix. ``distlm.train.main`` turns it
into that line on stderr and exit status 2, so users never see a torch traceback for
their own mistakes.
"""


class UsageError(Exception):
    """Bad input: a one-line message naming the setting or file and how to fix it."""

    exit_code = 2
