"""`python -m hetdp.hosts` where hosts cannot be made, and on bad input: exit code 2 and one line."""

from __future__ import annotations

import pytest

from hetdp.hosts import __main__ as hosts_cli


def run(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = hosts_cli.main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    return code, capsys.readouterr().err


def test_without_root_it_refuses_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    code, err = run(capsys, "--hosts", "2", "--", "true")
    assert code == 2
    assert err == "python -m hetdp.hosts: error: emulated hosts need root (network namespaces and tc); run as root " \
                  "or skip them\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--hosts", "2"], "give the command each host runs after --"),
    (["--site", "2:x", "--", "true"], "a site looks like HOSTS[:RATE_MBIT[:UPLINK_MBIT]]"),
    (["--site", "2", "--rate-mbit", "5", "--", "true"], "--rate-mbit goes with --hosts"),
    (["--hosts", "2", "--timeout-s", "0", "--", "true"], "--timeout-s must be > 0"),
    (["--hosts", "0", "--", "true"], "expected a positive integer, got '0'"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    code, err = run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and message in err
