"""examples/eager_sgd.py under `hetdp run`: its last line accounts for every gradient and says why rounds > steps."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "eager_sgd.py"


def test_eager_example_reports_rounds_steps_and_every_gradient():
    command = [sys.executable, "-m", "hetdp.cli", "run", "-n", "2", "--stragglers", "1:50", str(EXAMPLE),
               "--mode", "majority", "--epochs", "1"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    last = completed.stdout.strip().splitlines()[-1]
    found = re.match(r"majority: (\d+) steps per rank; (\d+) rounds held (\d+) gradients \((\d+) steps x 2 ranks", last)
    assert found, last
    steps, rounds, gradients, _ = map(int, found.groups())
    assert gradients == 2 * steps  # each gradient in exactly one round
    assert rounds > steps and "more rounds than steps" in last
