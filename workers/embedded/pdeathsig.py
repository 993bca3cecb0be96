"""Child-side: ask the Linux kernel to signal this process when its parent dies (PR_SET_PDEATHSIG).

Used as a `preexec_fn` by every process the embedded stack starts (servers, agent processes), so
that a parent killed with SIGKILL takes its children with it. The kernel sends the signal when the
parent *thread* that forked the child exits: start children from a thread that lives as long as
the parent (the main thread). A no-op where prctl is missing (not Linux).
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Run in the child between fork and exec: `sig` arrives when the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        pass
