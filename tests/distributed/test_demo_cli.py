"""`hetdp demo` end to end: the README's first command prints its rows and writes its files."""

import stat

from hetdp.cli import main


def test_demo_prints_a_row_per_epoch_and_writes_files_alike(tmp_path, capsys):
    out = tmp_path / "demo"
    # Three workers, not the default four: the rows and files are the same, and a worker fewer is 4 s of CPU less.
    assert main(["demo", "--speeds", "1,2,4", "--epochs", "2", "--sample-cost-ms", "2", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("shares: samples each rank computes per step") for line in lines)  # the legend
    header = next(number for number, line in enumerate(lines) if line.split()[:2] == ["policy", "epoch"])
    assert lines[header].split() == ["policy", "epoch", "shares", "compute", "s", "wait", "s", "epoch", "s", "accuracy"]
    rows = [line.split()[:2] for line in lines[header + 2 : header + 6]]
    assert rows == [["equal", "0"], ["adaptive", "0"], ["adaptive", "1"], ["equal", "1"]]  # in turn, order reversed
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert sorted(modes) == ["accuracy.png", "compute_wait.png", "demo.json", "shares.png"]
    assert len(set(modes.values())) == 1, modes  # demo.json as readable as the plots
