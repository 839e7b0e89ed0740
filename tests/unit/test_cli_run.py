"""`hetdp run` / `hetdp demo` on bad input: exit code 2 and one line naming the problem, no traceback."""

import pytest

from hetdp.cli import main


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
