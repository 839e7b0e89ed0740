"""The pure parts of the probe: link figures from round trips, the CPU memory estimate, its flags."""

from __future__ import annotations

import math

import pytest
import torch

from hetdp.bench.models import ConvNet
from hetdp.cli import main
from hetdp.cli.probe import parse_per_rank
from hetdp.cluster.probe import ProbeConfig, activation_bytes_per_sample, link_from_round_trips
from hetdp.errors import ConfigError


def test_link_figures_from_a_tiny_and_a_large_round_trip():
    # 2 alpha = 10 ms; 4 MB more at 1 Gb/s = 32 ms more.
    bandwidth_mbps, latency_ms = link_from_round_trips(0.010, 0.042, 4_000_000)
    assert bandwidth_mbps == pytest.approx(1000.0)
    assert latency_ms == pytest.approx(5.0)


def test_a_link_faster_than_the_clock_reads_as_infinite_bandwidth():
    assert link_from_round_trips(0.002, 0.002, 1000) == (math.inf, 1.0)


def test_link_figures_reject_a_negative_time():
    with pytest.raises(ConfigError):
        link_from_round_trips(-0.1, 0.2, 1000)


def test_activation_estimate_of_the_convnet_equals_its_layer_outputs():
    # Per 1x8x8 sample, bytes: input 256; conv 16x8x8 4096; relu 4096; pool 16x4x4 1024;
    # conv 32x4x4 2048; relu 2048; pool 32x2x2 512; linear 10 logits 40.
    expected = 256 + 4096 + 4096 + 1024 + 2048 + 2048 + 512 + 40
    assert activation_bytes_per_sample(ConvNet(), torch.zeros(5, 1, 8, 8)) == expected


@pytest.mark.parametrize(
    ("field", "value"), [("batch_size", 0), ("repeats", 0), ("warmup", -1), ("sample_bytes", -1.0)]
)
def test_probe_config_names_the_bad_field(field, value):
    with pytest.raises(ConfigError, match=field):
        ProbeConfig(**{field: value})


def test_per_rank_flags_allow_inf_and_need_one_value_per_rank():
    assert parse_per_rank("inf,100,50", "--bandwidths-mbps", 3, positive=True) == [math.inf, 100.0, 50.0]
    assert parse_per_rank(None, "--latencies-ms", 3, positive=False) is None
    with pytest.raises(ConfigError, match="gives 2 values for 3 ranks"):
        parse_per_rank("1,2", "--latencies-ms", 3, positive=False)
    with pytest.raises(ConfigError, match="rank 1"):
        parse_per_rank("inf,0", "--bandwidths-mbps", 2, positive=True)


@pytest.mark.parametrize(
    "argv",
    [
        ["probe", "-n", "2", "--bandwidths-mbps", "inf"],
        ["probe", "-n", "2", "--latencies-ms", "0,-5"],
        ["probe", "-n", "2", "--speeds", "1,0"],
    ],
)
def test_bad_probe_flags_exit_2_with_one_line_before_launching(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetdp probe: error:") and err.count("\n") == 1
