"""`hetdp bench simcheck` without processes: the simulator prices each row's emulation as the ranks pace it."""

import numpy as np
import pytest

from hetdp.allocate.policy import Adaptive, Static
from hetdp.bench.simcheck import drop_in_pairing, emulation, loop_costs
from hetdp.cluster.emulate import Pacer
from hetdp.sim.engine import Strategy

CALIBRATION = {"loop_s": 0.002, "allreduce_s": 0.003, "round_s": 0.01, "gather_s": 0.004}
SHARES = [8, 8, 16, 32, 8, 8, 16, 32]
STRAGGLER_S = 0.150
BLOCK_MS = {
    # 8 ms a sample at speed 1, speeds 1, 1, 2, 4 repeated: shares in proportion to the speeds take 64 ms each.
    "speeds": [64.0] * 8,
    # every rank at speed 1: 8 ms a sample
    "straggler": [64.0, 64.0, 128.0, 256.0, 64.0, 64.0, 128.0, 256.0],
    "speeds+straggler": [64.0] * 8,
    # speed 1; the odd ranks' device adds 20 ms a step and prices a share under its knee of 12 as 12 samples
    "device curve": [64.0, 20 + 12 * 8.0, 128.0, 20 + 32 * 8.0, 64.0, 20 + 12 * 8.0, 128.0, 20 + 32 * 8.0],
}
"""Each rank's compute at ``SHARES`` under each setting, worked out by hand from the settings (no straggler)."""


def paced_s(emulated, rank: int, step: int, samples: int) -> float:
    """Seconds a rank's pacer sleeps through a step of ``samples`` whose real compute took no time: what the emulated
    rank spends on it."""
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += max(seconds, 0.0)

    pacer = Pacer(emulated, rank, len(SHARES), clock=lambda: clock[0], sleep=sleep)
    pacer.start(step, samples)
    pacer.finish(step, samples, compute_s=0.0)
    return clock[0]


@pytest.mark.parametrize("setting", list(BLOCK_MS))
def test_predicted_compute_is_what_the_emulated_ranks_sleep(setting):
    emulated = emulation(setting, 8, (1.0, 1.0, 2.0, 4.0), 8.0, 1e3 * STRAGGLER_S, seed=3)
    costs = loop_costs(CALIBRATION, emulated, 8)
    stragglers = []
    for step in range(5):
        predicted = costs.compute_s(step, np.array(SHARES, dtype=float)).tolist()
        assert predicted == pytest.approx([paced_s(emulated, rank, step, share) for rank, share in enumerate(SHARES)])
        delayed = [rank for rank, seconds in enumerate(predicted) if seconds > BLOCK_MS[setting][rank] / 1e3 + 1e-9]
        assert len(delayed) == ("straggler" in setting), (step, predicted)
        assert predicted == pytest.approx([ms / 1e3 + STRAGGLER_S * (rank in delayed)
                                           for rank, ms in enumerate(BLOCK_MS[setting])])
        stragglers += delayed
    assert len(set(stragglers)) > 1 or "straggler" not in setting  # one random rank a step, not always the same


def test_the_drop_in_runs_the_pairing_the_simulator_prices():
    emulated = emulation("speeds", 4, (1.0, 2.0), 8.0, 0.0, seed=0)
    assert drop_in_pairing(Strategy.parse("static"), emulated, 4) == (Static((1.0, 2.0, 1.0, 2.0)), "allreduce")
    assert drop_in_pairing(Strategy.parse("adaptive+quorum"), emulated, 4) == (Adaptive(), "quorum:2")
    assert drop_in_pairing(Strategy.parse("adaptive+local:5"), emulated, 4)[1] == "local:5"
