"""What a run is doing, for the process that watches it.

bpt-train, bpt-eval and bpt-sample run their work in a child process
(bpt.cli.common.supervise). A crash that kills the child without a Python error (a
segmentation fault inside XLA's GPU compiler, a failed check that aborts it, the host's
out-of-memory killer) is then reported by the parent in one sentence: what the run was doing
when it died (the last phase entered here) and the settings to try.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PHASE_ENV = "BPT_PHASE_FILE"


def enter(phase: str, hint: str = "") -> None:
    """Records that the run is now `phase` ("compiling the train step"); hint: what to try if
    it dies there. Does nothing when no watching process asked for it."""
    path = os.environ.get(PHASE_ENV)
    if not path:
        return
    path = Path(path)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"phase": phase, "hint": hint}))
    temporary.replace(path)  # the parent never reads half a record


def read(path: str | Path) -> dict:
    """The last phase recorded in path ({} if none)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
