"""Named fault points for crash tests: a process SIGKILLs itself at an exact place in its code.

Chaos tests must hit the narrow windows that matter (between two files of a checkpoint, inside
a journal transaction), which a kill timed from outside reaches only by luck. Code marks those
places with ``fault_point("checkpoint.before_manifest")``; a test starts the real node process
with ``HIVESPEC_FAULTS="checkpoint.before_manifest@3"`` and the process kills itself with SIGKILL
the 3rd time it gets there (``@N`` defaults to 1). Several points are separated by commas. With
the variable unset, a fault point is one dict lookup.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter

from hivespec.protocol.errors import UserError

FAULTS_ENV = "HIVESPEC_FAULTS"

_counts: Counter[str] = Counter()


def parse_faults(spec: str) -> dict[str, int]:
    """``"a.b@3,c.d"`` -> ``{"a.b": 3, "c.d": 1}``; raises `UserError` naming a malformed entry."""
    faults: dict[str, int] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = entry.partition("@")
        try:
            hit = int(count) if count else 1
        except ValueError:
            raise UserError(f"{FAULTS_ENV} entry {entry!r}: the part after '@' must be an integer") from None
        if not name or hit < 1:
            raise UserError(f"{FAULTS_ENV} entry {entry!r}: expected name@N with N >= 1")
        faults[name] = hit
    return faults


_armed = parse_faults(os.environ.get(FAULTS_ENV, ""))


def fault_point(name: str) -> None:
    """SIGKILL this process if ``name`` is armed in ``$HIVESPEC_FAULTS`` and this is its N-th hit."""
    if name not in _armed:
        return
    _counts[name] += 1
    if _counts[name] == _armed[name]:
        print(f"hivespec: fault point {name!r} hit {_counts[name]} time(s): SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
