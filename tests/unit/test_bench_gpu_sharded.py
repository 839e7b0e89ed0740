"""`hetdp bench gpu`'s sharded parts, without a GPU: the small card's fraction and the figures' table (the worker runs
only where CUDA is)."""

import math

import pytest

from hetdp.allocate.caps import shard_cap
from hetdp.bench import gpu, gpu_sharded
from hetdp.cluster.memory import HEADROOM


def test_the_small_card_s_fraction_leaves_the_cap_the_drop_in_then_measures():
    total, used, held, per_sample = 80e9, 2e9, 3e9, 0.5e9
    fraction = gpu_sharded.card_fraction(8, total_bytes=total, used_bytes=used, held_bytes=held,
                                         per_sample_bytes=per_sample)
    free = fraction * total - used  # what the drop-in reads on that card once its shard is placed
    assert shard_cap(HEADROOM * free, held, per_sample, device="card") == 8
    assert math.isclose(gpu_sharded.card_fraction(10_000, total_bytes=total, used_bytes=used, held_bytes=held,
                                                  per_sample_bytes=per_sample), 1.0)


def test_the_gpu_table_gives_the_sharded_overhead_and_the_small_card():
    raw = {"overhead": {"epoch_s": {"torch_fully_shard": [9.0, 2.0, 2.0], "hetdp_fully_shard": [9.0, 2.04, 2.04]},
                        "samples": 4096, "parameters": 26_000_000},
           "small_card": {"fraction": 0.05, "cap": 8, "expected_cap": 8, "peak_bytes": 3.5e9, "limit_bytes": 4e9,
                          "out_of_memory": None, "epoch_s": 3.0, "per_sample_bytes": 1e8}}
    sharded = gpu_sharded.summarize(raw)
    assert sharded["overhead"] == pytest.approx(0.02)
    overhead = {"torch_ddp": [9.0, 1.0, 1.0], "hetdp": [9.0, 1.0, 1.0], "device": "NVIDIA H100"}
    mixed = {"runs": {}, "parameters": {}}
    text = gpu.render(gpu.summarize(overhead, mixed, {}, raw))
    assert "hetdp.fully_shard" in text and "overhead +2.0%, target at most +3%" in text
    assert "cap 8 (expected 8)" in text and "trained without running out of memory" in text
