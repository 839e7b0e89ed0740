"""A fork (a loader's workers, at every epoch) kept clear of one CPython bug: before 3.11.10 a forked child may hang
in ``os.fork()`` itself, on the runtime's lock of thread states (gh-112275).

The child deletes the parent's other thread states under that lock before it re-initialises it. A thread that Python
did not start (gloo's or NCCL's, entering Python to free a tensor or to run a future's callback) takes the lock
without the GIL while it makes its thread state; a fork in that moment leaves the child waiting on it forever, and
its parent waiting forever for the child's first batch. Taking the lock once just before each fork
(``sys._current_frames`` takes it) waits out such a holder. It narrows the moment and cannot close it: a thread may
take the lock again before the fork itself. Measured with six threads that enter Python without pause while the main
thread forks 3,000 times (``tools/fork_stress.py``): 8-17 children hung in five runs without the wait, 0-2 in four
runs with it.
"""

from __future__ import annotations

import os
import sys
import threading

AFFECTED = sys.version_info < (3, 11, 10)
"""Whether this CPython has the bug (3.11.10 and 3.12 re-initialise the lock first)."""

_registered = False
_lock = threading.Lock()


def guard_forks() -> None:
    """From now on, wait out a holder of the thread states' lock before every fork of this process, where CPython
    has the bug (idempotent)."""
    global _registered
    with _lock:
        if AFFECTED and not _registered:
            os.register_at_fork(before=_wait_for_thread_states)
            _registered = True


def _wait_for_thread_states() -> None:
    sys._current_frames()  # takes the lock and lets it go
