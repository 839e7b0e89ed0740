"""The device benchmark's tables and figures (its runs are timing, which tests never judge)."""

import pytest

from hetdp.allocate.minmax import min_max_shares, step_time_of
from hetdp.bench.devices import TABLES, step_tables, summarize_table
from hetdp.cli import main
from hetdp.cluster.devices import device_model, device_table


def table(name):
    return device_table({"devices": TABLES[name]["devices"]}), TABLES[name]["global_batch"]


def test_the_mixed_table_forces_micro_batches_on_every_card_at_the_optimum():
    cluster, global_batch = table("a6000x2+2080tix2")
    caps = [device_model(device).max_batch for device in cluster.devices]
    ideal = min_max_shares(step_tables(cluster, global_batch), global_batch, minimum=1)
    assert caps == [225, 225, 40, 40] and global_batch > sum(caps)
    assert all(share > cap for share, cap in zip(ideal, caps))


def test_the_fixed_cost_table_is_the_issues_case():
    cluster, global_batch = table("fixed-costs")
    rows = step_tables(cluster, global_batch)
    assert step_time_of(rows, min_max_shares(rows, global_batch, minimum=1)) == pytest.approx(143.0)


def test_the_modelled_efficiency_reads_the_device_model_and_the_measured_one_the_wall_clock():
    cluster, global_batch = table("fixed-costs")
    ideal, slower = [23, 23, 40, 42], [32, 32, 32, 32]
    early = {"shares": slower, "compute_s": [0.2] * 4, "wait_s": [0.0] * 4, "wall_s": 0.3}
    steady = {"shares": ideal, "compute_s": [0.15] * 4, "wait_s": [0.007, 0.004, 0.01, 0.02], "wall_s": 0.16}
    raw = {"runs": {"paper": [early] * 4 + [steady] * 4, "piecewise": [early] * 4 + [steady] * 4},
           "replans": {"paper": 1, "piecewise": 1}}
    figures = summarize_table(cluster, global_batch, raw, "note")["rules"]["paper"]
    assert figures["efficiency_modelled"] == pytest.approx(1.0) and figures["final_shares"] == ideal
    # the ideal step (143 ms) plus the exchange the run measured (the least wait, 4 ms), over the steps' 160 ms
    assert figures["exchange_ms"] == pytest.approx(4.0) and figures["measured_ms"] == pytest.approx(160.0)
    assert figures["efficiency_measured"] == pytest.approx(147.0 / 160.0)


def test_bad_flags_exit_2_with_one_line(capsys):
    assert main(["bench", "devices", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps >= 8" in err
