"""``hetdp run``'s launcher: N local ranks of a script through torch.distributed.run, on one node or this node's part
of a launch across several, with restarts on a fresh rendezvous and one line for a failure.

``launcher`` starts torchrun and waits (``run_local``), ``agent`` is that torchrun, ``worker`` each worker's wrapper,
``failures`` the line a launch ends in, ``events`` rank 0's progress and rows, ``nodes`` a launch across nodes.
"""

from hetdp.launch.events import EventReader, EventWriter
from hetdp.launch.launcher import ENV_RESTART, run_local

__all__ = ["ENV_RESTART", "EventReader", "EventWriter", "run_local"]
