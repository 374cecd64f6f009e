"""`UserError`: the one family of errors a user causes and can fix (a value, a path, a flag, a URL, a package).

Raised where the mistake is detected, in any layer (the config, the model loader, the hub, the
key file, the dashboard's node URL); `hivespec` prints one as a single line,
``hivespec <command>: <what>, <why>; <fix>``, and exits 2, in whichever phase it surfaces.
Everything that is not a `UserError` is a bug and keeps its traceback. It lives in the bottom
layer so the dashboard (which may not import the node) raises the same family.

A message is one line and names the value, why it cannot work and what to do instead.
"""

from __future__ import annotations

__all__ = ["UserError", "one_line"]


class UserError(ValueError):
    """Something the user gave or set up is wrong; ``str(error)`` says what, why, and the fix, on one line.

    `exit_status` is the command's exit code for it: 2, except where a script must tell one
    mistake apart (a home another running node holds exits 3: `build.HomeInUse`).
    """

    exit_status: int = 2


def one_line(error: BaseException) -> str:
    """``str(error)`` on a single line (a message that spans lines is joined with "; ")."""
    parts = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(parts) or type(error).__name__
