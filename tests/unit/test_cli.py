"""The `hetdp` command itself: usage when a command is missing, --version, and the benchmarks' common flags."""

import subprocess
import sys

import pytest

from hetdp.cli import main


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's own exits (--help, --version, errors)
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(("argv", "listed", "last_line"), [
    ([], ["demo", "simulate", "--version"], "hetdp: error: choose a COMMAND: demo, run, plan, probe, bench, simulate"),
    (["bench"], ["collectives", "--quick", "--json PATH", "--seed N"],
     ("hetdp bench: error: choose a NAME: allocation, cadp, planner, collectives, eager, imbalance, devices, "
      "compose, drift, simcheck, chaos, frameworks")),
])
def test_a_missing_command_prints_the_usage_then_one_error_line(capsys, argv, listed, last_line):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("usage: hetdp") and err.splitlines()[-1] == last_line
    for word in listed:
        assert word in " ".join(err.split())  # help text wraps at the terminal's width


def test_version(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("hetdp ")


def test_bench_help_lists_the_flags_every_benchmark_takes(capsys):
    code, out, _ = run_cli(capsys, "bench", "--help")
    assert code == 0
    for flag in ("--quick", "--json PATH", "--seed N", "`hetdp bench NAME --help`"):
        assert flag in " ".join(out.split())


def test_a_benchmarks_error_names_the_benchmark(capsys):
    code, _, err = run_cli(capsys, "bench", "collectives", "--nproc", "1")
    assert (code, err) == (2, "hetdp bench collectives: error: --nproc needs counts >= 2, got '1'\n")


def test_the_installed_command_without_arguments_exits_2():
    completed = subprocess.run([sys.executable, "-m", "hetdp.cli"], capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    assert completed.stderr.splitlines()[-1].startswith("hetdp: error: choose a COMMAND")
