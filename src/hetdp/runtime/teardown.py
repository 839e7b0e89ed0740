"""Process groups that ``destroy_process_group`` released end before interpreter finalization, while their threads
can still take the GIL.

gloo runs every collective on a thread of its group, which frees the collective's tensors once it has run it. A
tensor whose Python object the caller dropped first can only be freed under the GIL. Once the interpreter
finalizes, a thread that asks for the GIL is ended by ``pthread_exit``, whose forced unwinding through the tensor's
destructor aborts the process: "terminate called without an active exception" (SIGABRT) after the script itself
has finished.

``destroy_process_group`` only takes a group out of torch's registry; its threads end when its last reference goes.
Two holders kept groups into finalization: ``torch.distributed.nn.functional``, whose collectives take the default
group as a default argument once imported while it exists (the first optimizer imports it, through torch._dynamo),
and the reference cycles of models and drop-ins (FSDP2's units and hooks, a drop-in's planner and heartbeat), which
only the interpreter's last collection, during finalization, would free. This module imports the first before any
group exists and collects the second at exit. FSDP2's mesh group is also held by DTensor's sharding caches, which
live as long as the interpreter: that one is not freed here.
"""

from __future__ import annotations

import atexit
import gc
import threading
import weakref

import torch.distributed as dist

# Imported here, with hetdp, so before a script makes its process group: its collectives take ``group.WORLD`` as a
# default argument, evaluated at import, and once imported while the default group exists they hold that group for
# the interpreter's life, past ``destroy_process_group`` and any collection. torch imports it with torch._dynamo,
# which the first optimizer imports, and with FSDP2.
import torch.distributed.nn.functional  # noqa: F401

_registered = False
_lock = threading.Lock()
_released: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()
"""Groups hetdp destroyed, for as long as something (a reference cycle, until a collection) still holds them."""


def collect_at_exit() -> None:
    """Collect reference cycles at interpreter exit, before finalization, once per process (idempotent).

    Call it when a process starts using process groups: exit handlers run last-registered first, so the collection
    runs after those registered later (a heartbeat's stop, a drop-in's finalizers), once nothing of the run holds a
    destroyed group but its cycles. A group still in torch's registry (never destroyed) or held by a live object (a
    module-level model) is not freed by it.
    """
    global _registered
    with _lock:
        if not _registered:
            atexit.register(gc.collect)
            _registered = True


def release_group(group: dist.ProcessGroup) -> None:
    """``destroy_process_group(group)``, and remember the group until it is freed (``collect_released``)."""
    dist.destroy_process_group(group)
    _released.add(group)


def collect_released() -> None:
    """Collect reference cycles if a group hetdp destroyed is still held, so that it ends in this process and not in
    a process forked from it (a loader's worker), where its threads do not exist. A full collection costs 0.05-0.2 s
    of CPU: it runs only then, not before every fork."""
    if _released:
        gc.collect()
