"""`hetdp probe` with real processes over gloo: it writes a cluster file that loads and plans."""

from __future__ import annotations

import math

import hetdp
from hetdp.bench.datasets import load_digits
from hetdp.bench.models import ConvNet
from hetdp.cli import main

CONVNET_ACTIVATION_MB_PER_SAMPLE = 14120 / 1e6  # see tests/unit/cluster/test_probe.py


def test_probe_writes_a_valid_cluster_file_that_from_toml_loads_and_plans(tmp_path, capsys):
    out = tmp_path / "probed.toml"
    argv = ["probe", "-n", "2", "--speeds", "2,1", "--bandwidths-mbps", "inf,200", "--latencies-ms", "0,10"]
    assert main([*argv, "--batch-size", "16", "--repeats", "2", "--out", str(out)]) == 0
    assert f"cluster written to {out}" in capsys.readouterr().out

    cluster = hetdp.ClusterSpec.from_toml(out)
    owner, peer = cluster.devices
    assert [d.name for d in cluster.devices] == ["rank0-cpu", "rank1-cpu"]
    assert owner.bandwidth_mbps == math.inf and owner.latency_ms == 0.0
    assert 0 < peer.bandwidth_mbps < math.inf and peer.latency_ms > 0
    for device in cluster.devices:
        assert device.batch_size == 16 and device.batch_time_s > 0
        assert device.activation_mb_per_sample == CONVNET_ACTIVATION_MB_PER_SAMPLE
        assert device.memory_mb > device.fixed_memory_mb > 0
    assert cluster.sample_bytes == 8 * 8 * 4 + 8  # one float32 digits image and its int64 label
    assert cluster.model_bytes == sum(p.numel() * 4 for p in ConvNet().parameters())
    assert hetdp.ClusterSpec.from_toml(out) == cluster
    assert sum(hetdp.plan(cluster, 1000, epochs=3).samples) == 1000
    assert cluster.dataset_size == len(load_digits().train)  # the data it timed: `hetdp plan` needs no flag
    capsys.readouterr()
    assert main(["plan", str(out)]) == 0
    assert f"{cluster.dataset_size} samples" in capsys.readouterr().out
