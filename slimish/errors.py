"""`UserError`: the base of every error that means "an input is wrong; here is what to change".

The CLI prints such an error as one line, `error: <message>`, and exits with status 2 (no traceback). Each
subclass's message names the file, key or flag at fault and what to do. Anything else escaping is a bug in slimish
and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """An input the user must fix (a config key, a file, a command-line flag); the message says which and how."""


def find_user_error(exc: BaseException) -> UserError | None:
    """The `UserError` behind `exc`: itself, or one it was raised from (`__cause__` / `__context__`), or the error a
    Ray task or actor raised (`RayTaskError.cause`)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, UserError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
    return None
