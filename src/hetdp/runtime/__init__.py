"""The process group at run time, whatever started the workers: joining it from the engine's variables
(``engines``), the groups hetdp adds and the one family of deadlines their waits keep (``group``), heartbeats that
name a silent peer (``liveness``), a failure's one line in torchrun's error file (``errorfile``), and the groups'
end (``teardown``) and forks (``forks``) kept clear of their threads.
"""

from hetdp.runtime.group import (
    Timeouts,
    barrier,
    defer_nccl_watchdog,
    global_rank,
    group_timeout_s,
    host_group,
    init_distributed,
    is_peer_failure,
    local_device,
    new_step_group,
    peer_failures,
    synchronize,
    wait_for,
)

__all__ = [
    "Timeouts",
    "barrier",
    "defer_nccl_watchdog",
    "global_rank",
    "group_timeout_s",
    "host_group",
    "init_distributed",
    "is_peer_failure",
    "local_device",
    "new_step_group",
    "peer_failures",
    "synchronize",
    "wait_for",
]
