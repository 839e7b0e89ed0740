"""`hetdp run` launches a user's script on N ranks with the emulation reaching every rank."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "allocation_train.py"


def test_hetdp_run_trains_the_example_and_resumes_from_its_checkpoint(tmp_path):
    checkpoint = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "hetdp.cli", "run", "-n", "2", "--speeds", "1,3", "--sample-cost-ms", "1",
               str(EXAMPLE), "--epochs", "1", "--checkpoint", str(checkpoint)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "epoch 0: shares" in first.stdout and any(checkpoint.glob("step-*.pt"))
    command[command.index("--epochs") + 1] = "2"
    second = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "epoch 0:" not in second.stdout and "epoch 1: shares" in second.stdout
