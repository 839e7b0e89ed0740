"""The measurement behind ``hetdp.runtime.forks``: how many forked children hang in ``os.fork()`` while threads that
Python did not start keep entering it (CPython gh-112275, before 3.11.10), with and without the wait hetdp registers.

Each foreign thread (a ``pthread_create`` of a ctypes callback) makes and drops a thread state on every entry, as a
gloo or NCCL thread does when it frees a tensor under the GIL. The main thread forks; a child that has not exited
within 2 s hung. Run::

    python tools/fork_stress.py --forks 3000 --threads 6            # without the wait
    python tools/fork_stress.py --forks 3000 --threads 6 --guarded  # with hetdp's
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import threading
import time

from hetdp.runtime.forks import AFFECTED, guard_forks

HUNG_AFTER_S = 2.0

_libc = ctypes.CDLL(None)
_Entry = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_pthread_create = _libc.pthread_create
_pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, _Entry, ctypes.c_void_p]
_pthread_join = _libc.pthread_join
_pthread_join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]


def _enter_python(_: object) -> None:
    return None


_entry = _Entry(_enter_python)


def enter_from_foreign_threads(stop: threading.Event) -> None:
    """Start a thread of libc's that enters Python once and ends, again and again until ``stop``."""
    handle = ctypes.c_ulong()
    while not stop.is_set():
        _pthread_create(ctypes.byref(handle), None, _entry, None)
        _pthread_join(handle.value, None)


def hung_children(forks: int) -> int:
    """Fork ``forks`` children that exit at once; count those that did not within ``HUNG_AFTER_S``."""
    hung = 0
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + HUNG_AFTER_S
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                hung += 1
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    return hung


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forks", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=6, help="foreign threads entering Python meanwhile")
    parser.add_argument("--guarded", action="store_true", help="with hetdp's wait before each fork")
    args = parser.parse_args()
    if args.guarded:
        guard_forks()
    stop = threading.Event()
    for _ in range(args.threads):
        threading.Thread(target=enter_from_foreign_threads, args=(stop,), daemon=True).start()
    began = time.perf_counter()
    hung = hung_children(args.forks)
    stop.set()
    print(f"forks={args.forks} threads={args.threads} guarded={args.guarded} (this CPython has the bug: {AFFECTED}) "
          f"hung={hung} in {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
