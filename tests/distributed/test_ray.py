"""hetdp.DDP under Ray Train (examples/ray_train.py on a local Ray instance, 4 CPU workers): Ray starts the workers and
their process group; adaptive shares train exactly what one process trains, and a worker that dies mid-epoch is
restarted by Ray's FailureConfig and the loop resumes from hetdp's step checkpoint, exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("ray.train.torch", reason="Ray Train is an optional extra: pip install '.[ray]'")

EXAMPLE = Path(__file__).parents[2] / "examples" / "ray_train.py"
sys.path.insert(0, str(EXAMPLE.parent))
import ray_train  # noqa: E402

WORKERS, EPOCHS = 4, 2


def one_process() -> list[torch.Tensor]:
    """The same model on the same global batches (``BATCH`` per worker, in the data's order), one mean loss a step."""
    model, data = ray_train.network(), ray_train.dataset()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ray_train.BATCH * WORKERS
    for _ in range(EPOCHS):
        for start in range(0, len(data), step):
            x, y = data[start:start + step]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return [parameter.detach() for parameter in model.parameters()]


@pytest.mark.timeout(600)
def test_a_worker_killed_under_ray_resumes_from_the_step_checkpoint_exactly(tmp_path):
    out, checkpoint = tmp_path / "out.json", tmp_path / "ckpt"
    command = [sys.executable, str(EXAMPLE), "--workers", str(WORKERS), "--epochs", str(EPOCHS), "--allocation",
               "adaptive", "--checkpoint", str(checkpoint), "--fail-at", "5", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert (checkpoint / "failed-once").exists()  # worker 2 did die once, and Ray started the group again
    result = json.loads(out.read_text())
    assert result["resumed"]
    for got, want in zip(result["parameters"], one_process(), strict=True):
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
