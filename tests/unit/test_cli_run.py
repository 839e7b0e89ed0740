"""`hetdp run` / `hetdp demo` on bad input: exit code 2 and one line naming the problem, no traceback."""

import pytest

from hetdp.cli import main
from hetdp.cluster.emulate import Emulation
from hetdp.errors import ConfigError


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return path


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speeds", "0"], "speeds must be positive numbers, got '0' (rank 0)"),
        (["--speeds", "-1"], "speeds must be positive numbers, got '-1' (rank 0)"),
        (["--speeds", "abc"], "speeds must be positive numbers, got 'abc' (rank 0)"),
        (["--speeds", "1,2,3"], "--speeds gives 3 values for 2 processes"),
        (["--speeds", "1,nan"], "got 'nan' (rank 1)"),
        (["--stragglers", "x"], "stragglers must look like K:DELAY_MS"),
        (["--stragglers", "3:10"], "--stragglers asks for 3 delayed ranks among 2 processes"),
        (["--knee", "4,x"], "--knee must be integers >= 0, got 'x' (rank 1)"),
        (["--max-batch", "4"], "--max-batch gives 1 values for 2 processes"),
        (["--step-overhead-ms", "1,2"], "give sample_cost_ms > 0"),
        (["--devices", "missing.toml"], "cannot read device table 'missing.toml'"),
        (["--devices", "t.toml", "--speeds", "1,2"], "--devices gives every rank's speed"),
    ],
)
def test_bad_emulation_flags_exit_2_with_one_line(capsys, script, flags, message):
    code, err = run_cli(capsys, "run", "-n", "2", *flags, str(script))
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "-n", "2", "missing.py"], "script not found: missing.py"),
    (["run", "-n", "0", "x.py"], "expected a positive integer, got '0'"),
    (["run", "-n", "2", "--max-restarts", "-1", "x.py"], "--max-restarts must be >= 0, got -1"),
    (["demo", "--speeds", "2,0"], "got '0' (rank 1)"),
    (["demo", "--epochs", "1"], "--epochs must be >= 2"),
    (["demo", "--dataset", "mnist"], "needs --data-root"),
    (["demo", "--sample-cost-ms", "-1"], "sample_cost_ms must be >= 0, got -1.0"),
    (["bench", "allocation", "--speeds", "1,x"], "got 'x' (rank 1)"),
    (["bench", "collectives", "--iterations", "0"], "--iterations must be >= 1, got 0"),
    (["bench", "collectives", "--skew-ms", "-1"], "--skew-ms must be >= 0, got -1.0"),
])
def test_bad_arguments_exit_2_with_one_line_and_nothing_before_it(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and message in captured.err
    assert captured.out == ""


def test_a_bad_speed_is_one_line_naming_the_rank_and_no_traceback(capsys):
    # In this process: tests/unit/test_cli.py runs the installed command itself, `python -m hetdp.cli`, once.
    assert main(["run", "-n", "2", "--speeds", "1,0", "train.py"]) == 2
    assert capsys.readouterr().err == "hetdp run: error: speeds must be positive numbers, got '0' (rank 1)\n"


NODE_FLAGS = ["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29500"]


@pytest.fixture
def launches(monkeypatch):
    """What `hetdp run` would hand torchrun on this node, instead of launching it."""
    import hetdp.cli.run

    seen = []

    def launch(script, nproc, script_args, *, env, nodes, **_):
        seen.append({"nproc": nproc, "env": env, "node": nodes.rank})
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(hetdp.cli.run, "run_local", launch)
    return seen


def test_nodes_with_unequal_ranks_share_one_list_of_global_values(capsys, script, launches):
    # node 0 runs global ranks 0 and 1, node 1 runs rank 2: the same flags on both, one value per global rank
    per_rank = ["--speeds", "1,2,4", "--sample-cost-ms", "5", "--max-batch", "0,0,16", "--speed-change", "9:4,2,1"]
    for node, nproc in ((0, "2"), (1, "1")):
        assert main(["run", "-n", nproc, *NODE_FLAGS, "--node-rank", str(node), *per_rank, str(script)]) == 0
    first, second = (Emulation.from_env(launch["env"]) for launch in launches)
    assert first == second and [launch["nproc"] for launch in launches] == [2, 1]
    # each worker takes the value at its global rank; a group of another size is refused on every rank
    assert [first.speed(rank) for rank in range(3)] == [1.0, 2.0, 4.0] and first.pacer(2, 3).rank == 2
    assert first.devices[2].max_batch == 16 and first.speeds_at(9) == (4.0, 2.0, 1.0)
    with pytest.raises(ConfigError, match=r"gives 3 speeds \(HETDP_SPEEDS\) for a group of 4 ranks"):
        first.pacer(0, 4)


@pytest.mark.parametrize(("nproc", "flags", "message"), [
    ("2", ["--speeds", "1,2"], "--speeds gives 2 values, fewer than the 3 ranks of this launch at the least"),
    ("1", ["--speeds", "1,2,4", "--knee", "0,8"], "--knee gives 2 values for 3 processes"),
    ("1", ["--speeds", "1,2,4", "--speed-change", "5:1,1"], "--speeds gives 2 values for 3 processes"),
])
def test_per_rank_flags_across_nodes_must_agree_and_cover_the_group(capsys, script, launches, nproc, flags, message):
    code, err = run_cli(capsys, "run", "-n", nproc, *NODE_FLAGS, "--node-rank", "1", *flags, str(script))
    assert code == 2 and message in err and err.count("\n") == 1 and launches == []
