"""`hetdp simulate`: relative speeds as everywhere else, every column defined, every bad flag one line."""

import json

import pytest

from hetdp.cli import main


def run_cli(capsys, *argv):
    try:
        code = main(["simulate", *argv])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_speeds_are_relative_as_in_run_and_demo(capsys, tmp_path):
    path = tmp_path / "sim.json"
    quiet = ["--jitter", "0", "--straggler-probability", "0", "--model-mb", "0", "--latency-us", "0"]
    code, out, _ = run_cli(capsys, "--speeds", "1,1,2,4", "--steps", "20", *quiet, "--json", str(path))
    assert code == 0
    assert "4 workers, 8,000 samples/s in all (1000 x relative speed)" in out
    throughput = {r["strategy"]: r["samples_per_s"] for r in json.loads(path.read_text())["results"]}
    assert throughput["equal"] == pytest.approx(4 * 1000)  # four workers at the slowest one's pace
    assert throughput["static"] == pytest.approx(8 * 1000)  # everyone at their own


def test_every_column_is_defined_and_the_gap_to_the_ideal_explained(capsys):
    code, out, _ = run_cli(capsys, "--workers", "1000", "--steps", "5")
    assert code == 0
    text = " ".join(out.split())
    for definition in ("samples/step:", "samples/s = steps x samples/step / simulated s", "fresh %:",
                       "compute, wait, allreduce %:", "ideal allocation speedup",
                       "latency 0.0999 s (2(N-1) = 1998 hops x 50 us)"):
        assert definition in text


def test_help_shows_every_default(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    text = " ".join(out.split())
    for flag in ("--steps N steps per strategy, every worker runs all of them (default 200)",
                 "--jitter SIGMA", "(default 0.05; 0: none)", "--seed SEED seed of speeds, jitter and stragglers",
                 "--straggler-probability P", "(default 0.01)", "--straggler-delay-ms MS", "(default 300)",
                 "fresh %:"):
        assert flag in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--workers", "2", "--speeds", "1,2,3"], "--speeds gives 3 values for --workers 2"),
    (["--speeds", "1,0"], "got '0' (rank 1)"),
    (["--strategies", "gossip"], "--strategies: unknown 'gossip'"),
    (["--workers", "4", "--quorum", "5"], "--quorum must be in [1, 4], got 5"),
    (["--workers", "4", "--global-batch", "3"], "--global-batch must be >= 4, one sample per worker, got 3"),
    (["--straggler-delay-ms", "-1"], "--straggler-delay-ms must be >= 0, got -1.0"),
    (["--replan-every", "0"], "--replan-every must be >= 1, got 0"),
    (["--speed-spread", "-1"], "--speed-spread must be >= 0"),
    (["--json", "out/"], "--json needs a file path"),
])
def test_bad_flags_exit_2_with_one_line(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and message in err and err.startswith("hetdp simulate: error: ")


def test_each_allreduce_algorithm_gets_its_own_table(capsys, tmp_path):
    path = tmp_path / "sim.json"
    code, out, _ = run_cli(capsys, "--workers", "64", "--steps", "5", "--strategies", "equal,adaptive+majority",
                           "--allreduce", "ring,tree,hierarchical", "--json", str(path))
    assert code == 0
    for algorithm in ("ring", "tree", "hierarchical"):
        assert f"global batch 4096, {algorithm} allreduce" in out
    figures = json.loads(path.read_text())
    assert set(figures["allreduce"]) == {"ring", "tree", "hierarchical"}
    assert {(r["allreduce"], r["strategy"]) for r in figures["results"]} == {
        (a, s) for a in ("ring", "tree", "hierarchical") for s in ("equal", "adaptive+majority")}


def test_scales_project_every_strategy_against_the_first(capsys, tmp_path):
    path = tmp_path / "projection.json"
    code, out, _ = run_cli(capsys, "--scales", "8,32", "--steps", "5", "--strategies", "equal,static,equal+solo",
                           "--speeds", "1,2", "--json", str(path))
    assert code == 0
    assert "ring allreduce" in out and "8 workers" in out and "32 workers" in out
    rows = json.loads(path.read_text())["projection"]
    assert len(rows) == 6 and all(r["vs_first"] == 1.0 for r in rows if r["strategy"] == "equal")


@pytest.mark.parametrize(("argv", "message"), [
    (["--allreduce", "butterfly"], "--allreduce: unknown 'butterfly'; choose from ring, tree, doubling, hierarchical"),
    (["--scales", "100,x"], "--scales needs worker counts >= 1, got '100,x'"),
    (["--strategies", "equal+local:0"], "--strategies: unknown 'equal+local:0'"),
    (["--local-size", "0"], "--local-size must be >= 1, got 0"),
])
def test_bad_network_and_projection_flags_exit_2_with_one_line(capsys, argv, message):
    code, _, err = run_cli(capsys, "--workers", "4", *argv)
    assert code == 2
    assert err.count("\n") == 1 and message in err
