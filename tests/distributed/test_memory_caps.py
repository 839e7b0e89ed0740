"""``allocate(loader, max_batch="measure")`` with real processes over gloo, on CPU: no cap from memory there."""

from __future__ import annotations

import json

import pytest

RANKS = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory, torchrun) -> list[dict]:
    out = tmp_path_factory.mktemp("measure")
    torchrun("measure_worker.py", RANKS, "--out", out, timeout_s=180)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)]


def test_measure_on_cpu_caps_nothing_and_trains_as_without_caps(results):
    for figures in results:
        assert figures["measured"]["caps"] == [None, None] and figures["measured"]["shares"] == [4, 4]
        assert figures["measured"]["state"] == figures["uncapped"]["state"]


def test_measure_takes_the_emulated_devices_caps_on_every_rank(results):
    for figures in results:
        assert figures["emulated"]["caps"] == [3, None] and figures["emulated"]["shares"] == [3, 5]


def test_a_bad_max_batch_is_one_config_error_line_on_every_rank(results):
    for figures in results:
        assert figures["bad"]["error"] == ("max_batch must be an int >= 1, one cap (or None) per rank, 'measure' or "
                                           "None, got 'auto'")
