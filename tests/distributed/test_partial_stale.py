"""A gradient that misses its partial round is applied once, stale, in a later one: with 2 real processes over gloo,
across torch DDP's rebuild of its gradient buckets after the first step."""

from __future__ import annotations

import json

import pytest

REPEATS = 3
TOLERANCE = 1e-5
"""Float rounding of a few sums of float32 gradients; a contribution applied to the wrong parameters is 1e-2 off."""


@pytest.fixture(scope="module")
def runs(torchrun, tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("stale") / "runs.json"
    torchrun("stale_worker.py", 2, "--out", out, "--repeats", REPEATS, timeout_s=240)
    return json.loads(out.read_text())


@pytest.mark.parametrize("sync", ["solo", "majority"])
def test_a_first_gradient_carried_past_the_bucket_rebuild_is_applied_once_to_its_own_parameters(runs, sync):
    for run in runs[sync]:
        assert run["replica_gap"] <= TOLERANCE, run
        assert run["reference_gap"] <= TOLERANCE, run
    # The scenario happened: the late rank's first gradient missed round 0 (a loaded machine may keep it fresh once).
    assert any(run["late_missed_round_0"] for run in runs[sync]), runs[sync]
