"""``python -m hetdp.launch torchrun|worker ...``: the two processes of a launch that ``run_local`` starts."""

import sys

from hetdp.launch.agent import run_torchrun
from hetdp.launch.worker import run_worker

if len(sys.argv) < 3 or sys.argv[1] not in ("torchrun", "worker"):
    sys.exit("usage: python -m hetdp.launch torchrun|worker ... (started by hetdp.launch.run_local)")
(run_torchrun if sys.argv[1] == "torchrun" else run_worker)(sys.argv[2:])
