import json
from pathlib import Path

import pytest

from hetdp.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.toml"


def test_plan_prints_the_allocation_table(capsys):
    assert main(["plan", str(EXAMPLE), "--epochs", "5"]) == 0
    out = capsys.readouterr().out
    for name in ("gpu-a100", "cpu-4c-b", "samples", "send_s", "epoch_s", "T_total", "proved optimal", "equal split"):
        assert name in out


def test_plan_writes_json_that_sums_to_the_dataset(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", str(EXAMPLE), "--dataset-size", "5000", "--method", "alm", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    assert figures["method"] == "alm" and figures["dataset_size"] == 5000
    assert sum(device["samples"] for device in figures["devices"]) == 5000
    assert figures["total_s"] <= figures["equal_split"]["total_s"]
    # ALM's gap: its distance from the exact solver's optimum, which no plan beats
    assert figures["lower_bound_s"] <= figures["total_s"]
    assert figures["gap"] == pytest.approx((figures["total_s"] - figures["lower_bound_s"]) / figures["total_s"])


BAD = {
    "missing field": (
        "sample_bytes = 1\nmodel_bytes = 1\n[[devices]]\nname = 'cpu-2'\n",
        "device 'cpu-2': missing field 'batch_size'",
    ),
    "negative bandwidth": (
        "sample_bytes = 1\nmodel_bytes = 1\ndataset_size = 10\n[[devices]]\nname = 'cpu-2'\nbatch_size = 4\n"
        "batch_time_s = 1.0\nbandwidth_mbps = -5\n",
        "device 'cpu-2': bandwidth_mbps must be > 0, got -5",
    ),
    "no dataset size": (
        "sample_bytes = 1\nmodel_bytes = 1\n[[devices]]\nname = 'a'\nbatch_size = 4\nbatch_time_s = 1.0\n"
        "bandwidth_mbps = 5\n",
        "no dataset size: pass --dataset-size",
    ),
    "not toml": ("= oops", "not valid TOML"),
}


@pytest.mark.parametrize("text, message", BAD.values(), ids=BAD.keys())
def test_bad_cluster_file_exits_2_with_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    assert main(["plan", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("hetdp plan: error: ")
    assert message in captured.err and "Traceback" not in captured.err


def test_a_missing_file_exits_2_with_one_line_without_traceback(tmp_path, capsys):
    # In this process: tests/unit/test_cli.py runs the installed command itself, `python -m hetdp.cli`, once.
    assert main(["plan", str(tmp_path / "absent.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read cluster file" in err
    assert "Traceback" not in err


def test_every_bad_field_is_reported_in_one_line(tmp_path, capsys):
    path = tmp_path / "cluster.toml"
    path.write_text("sample_bytes = 1\nmodel_bytes = 1\ndataset_size = 10\n"
                    "[[devices]]\nname = 'a'\nbatch_size = 0\nbatch_time_s = 1.0\nbandwidth_mbps = 5\n"
                    "[[devices]]\nname = 'b'\nbatch_size = 4\nbatch_time_s = -1.0\nbandwidth_mbps = -5\n")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for problem in ("device 'a': batch_size must be >= 1, got 0", "device 'b': batch_time_s must be > 0, got -1.0",
                    "device 'b': bandwidth_mbps must be > 0, got -5"):
        assert problem in err
