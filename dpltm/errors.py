"""The one exception type for user mistakes.

The CLI turns a `DpltmUserError` into a single line on stderr and a non-zero exit, with no
traceback; anything else is a bug and keeps its traceback.
"""


class DpltmUserError(Exception):
    """A mistake the user can fix: bad option, missing file, foreign checkpoint, ..."""
