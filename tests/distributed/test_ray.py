"""hetdp.DDP under Ray Train (examples/ray_train.py on a local Ray instance, 3 CPU workers): Ray starts the workers and
their process group; equal and adaptive shares train exactly what one process trains, emulation settings reach the
workers through Ray's runtime_env, and a worker that dies mid-epoch is restarted by Ray's FailureConfig and the loop
resumes from hetdp's step checkpoint, exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("ray.train.torch", reason="Ray Train is an optional extra: pip install '.[ray]'")

EXAMPLE = Path(__file__).parents[2] / "examples" / "ray_train.py"
sys.path.insert(0, str(EXAMPLE.parent))
import ray_train  # noqa: E402

WORKERS, EPOCHS = 3, 2
SPEEDS = (1.0, 2.0, 4.0)

# One Ray instance for both runs; its workers import the example from PYTHONPATH and read hetdp's emulation settings
# from the job's environment, as on a Ray cluster.
DRIVER = """
    import sys
    import ray
    import hetdp

    sys.path.insert(0, {examples!r})
    import ray_train

    emulation = hetdp.Emulation(speeds={speeds!r}, sample_cost_ms=1.0).to_env()
    ray.init(num_cpus={workers} + 1, include_dashboard=False, log_to_driver=False,
             runtime_env={{"env_vars": {{"PYTHONPATH": {examples!r}, **emulation}}}})
    common = {{"epochs": {epochs}, "fail_at": -1}}
    ray_train.fit({workers}, {{**common, "allocation": "equal", "checkpoint": {equal_ckpt!r}, "out": {equal!r}}})
    ray_train.fit({workers}, {{**common, "allocation": "adaptive", "checkpoint": {adaptive_ckpt!r}, "out": {adaptive!r},
                               "fail_at": 5}}, max_failures=1)
    ray.shutdown()
"""


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
def test_equal_and_adaptive_under_ray_train_as_one_process_and_a_killed_worker_resumes_exactly(tmp_path):
    paths = {name: str(tmp_path / name) for name in ("equal", "adaptive", "equal_ckpt", "adaptive_ckpt")}
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER.format(examples=str(EXAMPLE.parent), workers=WORKERS, epochs=EPOCHS,
                                                    speeds=SPEEDS, **paths)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    completed = subprocess.run([sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=540)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert (Path(paths["adaptive_ckpt"]) / "failed-once").exists()  # worker 2 died once; Ray started the group again
    expected = one_process()
    for run in ("equal", "adaptive"):
        result = json.loads(Path(paths[run]).read_text())
        assert result["world_size"] == WORKERS  # hetdp.init_distributed returned Ray's group
        assert result["speeds"] == list(SPEEDS)  # the emulation came through Ray's runtime_env
        assert result["resumed"] == (run == "adaptive")
        for got, want in zip(result["parameters"], expected, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)
