"""Process groups that outlive ``destroy_process_group`` end at interpreter exit, before finalization, while their
threads can still take the GIL.

gloo runs every collective on a thread of its group, which frees the collective's tensors once it has run it. A
tensor whose Python object the interpreter has given up (the caller dropped it before the thread let go) can only be
freed under the GIL. Once the interpreter finalizes, a thread that asks for the GIL is ended by ``pthread_exit``,
whose forced unwinding through the tensor's destructor aborts the process: "terminate called without an active
exception" (SIGABRT) after the script itself has finished.

``destroy_process_group`` only takes a group out of torch's registry; its threads end when its last reference goes.
An FSDP2 model holds its mesh's group in reference cycles (each unit's state, its hooks and its modules), and so
does any model a drop-in wraps, so that group stays alive, its threads with it, until the interpreter's last
collection: that collection runs during finalization, where freeing the group releases the GIL to join its threads
and a thread that has been waiting for the GIL to free a tensor takes it and is ended. Collecting those cycles at
exit, before finalization, ends the groups there: their threads free what they hold and are joined while the
interpreter still serves them.
"""

from __future__ import annotations

import atexit
import gc
import threading

# Imported here, with hetdp, so before a script makes its process group: its collectives take ``group.WORLD`` as a
# default argument, evaluated at import, and once imported while the default group exists they hold that group for
# the interpreter's life, past ``destroy_process_group`` and any collection. torch imports it with torch._dynamo,
# which the first optimizer imports, and with FSDP2.
import torch.distributed.nn.functional  # noqa: F401

_registered = False
_lock = threading.Lock()


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
