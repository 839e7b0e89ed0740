"""`hetdp bench simcheck` without processes: the simulator prices each row's emulation as the ranks pace it."""

import numpy as np
import pytest

from hetdp.allocate.policy import Adaptive, Static
from hetdp.bench.simcheck import drop_in_pairing, emulation, loop_costs
from hetdp.sim.engine import Strategy

CALIBRATION = {"loop_s": 0.002, "allreduce_s": 0.003, "round_s": 0.01, "gather_s": 0.004}


@pytest.mark.parametrize("setting", ["speeds", "straggler", "speeds+straggler", "device curve"])
def test_predicted_compute_is_what_the_emulated_ranks_sleep(setting):
    emulated = emulation(setting, 8, (1.0, 1.0, 2.0, 4.0), 8.0, 150.0, seed=3)
    costs = loop_costs(CALIBRATION, emulated, 8)
    shares = np.array([8, 8, 16, 32, 8, 8, 16, 32], dtype=float)
    for step in range(5):
        expected = [emulated.straggler_delay_s(step, rank, 8) + emulated.block_s(rank, share, step)
                    for rank, share in enumerate(shares)]
        assert costs.compute_s(step, shares).tolist() == pytest.approx(expected)


def test_the_drop_in_runs_the_pairing_the_simulator_prices():
    emulated = emulation("speeds", 4, (1.0, 2.0), 8.0, 0.0, seed=0)
    assert drop_in_pairing(Strategy.parse("static"), emulated, 4) == (Static((1.0, 2.0, 1.0, 2.0)), "allreduce")
    assert drop_in_pairing(Strategy.parse("adaptive+quorum"), emulated, 4) == (Adaptive(), "quorum:2")
    assert drop_in_pairing(Strategy.parse("adaptive+local:5"), emulated, 4)[1] == "local:5"
