"""examples/eager_sgd.py under `hetdp run`: eager-SGD through the drop-in, its last line counts steps and rounds."""

import re
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "eager_sgd.py"


def test_eager_example_trains_through_the_drop_in_and_steps_once_per_round(hetdp_run):
    completed = hetdp_run("-n", 2, "--stragglers", "1:50", EXAMPLE, "--mode", "majority", "--epochs", 1)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.strip().splitlines()
    assert re.match(r"epoch 0: .* test accuracy 0\.\d{3}", lines[-2]), lines[-2]
    found = re.match(r"majority: (\d+) steps per rank; (\d+) optimizer steps on rank 0, one per round", lines[-1])
    assert found, lines[-1]
    steps, optimizer_steps = map(int, found.groups())
    assert steps == 23  # the digits' 1,438 training images in steps of 2 x 32
    assert optimizer_steps >= steps  # every step applies the round it joined, and any it missed
    assert "more rounds than steps" in lines[-1]
