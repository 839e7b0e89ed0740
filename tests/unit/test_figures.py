"""Every page quotes the same recorded runs (tools/figures.py over docs/figures.toml), marked where off target."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("hetdp_tools_figures", ROOT / "tools" / "figures.py")
assert _spec is not None and _spec.loader is not None
figures = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = figures  # dataclasses look their module up
_spec.loader.exec_module(figures)

SMALL = """
[tables.t]
header = ["| bench | figure |", "| --- | --- |"]
row = "| {title} | {line} |"
benches = ["sim"]

[bench.sim]
title = "`sim`"
line = "`max_abs_error` {max_abs_error:t}; {runs}, {commits}"
keys.max_abs_error = { json = "max_abs_error", fmt = ".3f", target = "<= 0.10" }
keys.shares = { json = "rows.*.shares", fmt = "d" }

[[bench.sim.runs]]
commit = "aaaaaaa"
date = "2026-12-01"
max_abs_error = 0.082
"""


def _copy_pages(to: Path) -> Path:
    """The repository's pages and recorded runs, alone in a folder."""
    shutil.copy(ROOT / "README.md", to / "README.md")
    shutil.copytree(ROOT / "docs", to / "docs", ignore=lambda _, names: [n for n in names if n.endswith((".png",))])
    return to


def _small(tmp_path: Path, runs: str = "") -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "figures.toml").write_text(SMALL + runs)
    return tmp_path


def test_the_pages_quote_the_recorded_runs():
    stale = figures.stale(ROOT)
    assert not stale, ("pages differ from docs/figures.toml; run `python tools/figures.py write`: "
                       f"{[str(page.relative_to(ROOT)) for page, _, _ in stale]}")


def test_a_page_edited_to_disagree_fails_check_until_written(tmp_path, capsys):
    root = _copy_pages(tmp_path)
    assert figures.main(["check"], root=root) == 0
    status = root / "docs" / "status.md"
    text = status.read_text()
    span = re.search(r"<!-- figure allocation\.efficiency -->(?P<value>[^<]+)<!-- /figure -->", text)
    assert span is not None
    status.write_text(text.replace(span[0], span[0].replace(span["value"], "0.1234")))

    assert figures.main(["check"], root=root) == 1
    assert "docs/status.md" in capsys.readouterr().out
    assert figures.main(["write"], root=root) == 0
    assert figures.main(["check"], root=root) == 0
    assert status.read_text() == text


def test_a_recorded_run_changes_every_page_that_quotes_it(tmp_path):
    root = _copy_pages(tmp_path)
    result = tmp_path / "simcheck.json"
    result.write_text(json.dumps({"max_abs_error": 0.199, "mean_abs_error": 0.05, "rows": []}))
    assert figures.main(["record", "simcheck", str(result), "--commit", "1234567", "--date", "2026-12-08",
                         "--fresh"], root=root) == 0
    assert figures.main(["check"], root=root) == 1
    assert figures.main(["write"], root=root) == 0

    quoted = "0.199 ✗ (target ≤ 0.10)"
    for page in ("README.md", "docs/benchmarks.md", "docs/status.md", "docs/guide/simulation.md"):
        assert quoted in (root / page).read_text(), page
    assert "0.086" not in (root / "docs" / "guide" / "simulation.md").read_text()


def test_a_value_outside_its_target_is_marked(tmp_path):
    root = _small(tmp_path, '\n[[bench.sim.runs]]\ncommit = "bbbbbbb"\ndate = "2026-12-02"\nmax_abs_error = 0.103\n')
    loaded = figures.Figures.load(root / "docs" / "figures.toml")
    assert loaded.span("sim.max_abs_error") == "0.082-0.103 ✗ (target ≤ 0.10; 1 of 2 runs)"
    assert loaded.span("sim.max_abs_error:each") == "0.082, 0.103 ✗ (target ≤ 0.10; 1 of 2 runs)"
    assert loaded.table("t").splitlines()[-1] == (
        "| `sim` | `max_abs_error` 0.082-0.103 ✗ (target ≤ 0.10; 1 of 2 runs); two runs, aaaaaaa, bbbbbbb |")


def test_a_value_within_its_target_is_not_marked(tmp_path):
    loaded = figures.Figures.load(_small(tmp_path) / "docs" / "figures.toml")
    assert loaded.span("sim.max_abs_error") == "0.082"
    assert loaded.span("sim.max_abs_error:t") == "0.082 (target ≤ 0.10)"
    assert loaded.span("sim.runs") == "one run"


def test_record_reads_the_keys_from_the_bench_json(tmp_path):
    root = _small(tmp_path)
    path = root / "docs" / "figures.toml"
    result = {"max_abs_error": 0.2, "rows": [{"shares": 8}, {"shares": 24}]}
    figures.record(path, "sim", result, commit="ccccccc", date="2026-12-03")
    loaded = figures.Figures.load(path)
    assert [run["commit"] for run in loaded.benches["sim"].runs] == ["aaaaaaa", "ccccccc"]
    assert loaded.benches["sim"].runs[-1]["shares"] == [8, 24]

    figures.record(path, "sim", {**result, "max_abs_error": 0.05}, commit="ddddddd", date="2026-12-04", fresh=True)
    loaded = figures.Figures.load(path)
    assert [run["commit"] for run in loaded.benches["sim"].runs] == ["ddddddd"]
    assert loaded.span("sim.max_abs_error:t") == "0.050 (target ≤ 0.10)"


def test_record_refuses_a_json_without_the_key(tmp_path):
    path = _small(tmp_path) / "docs" / "figures.toml"
    before = path.read_text()
    with pytest.raises(figures.FiguresError, match="max_abs_error"):
        figures.record(path, "sim", {"rows": []}, commit="eeeeeee", date="2026-12-05")
    assert path.read_text() == before


def test_a_span_naming_an_unknown_key_is_an_error(tmp_path, capsys):
    root = _small(tmp_path)
    (root / "README.md").write_text("<!-- figure sim.max_error -->0.1<!-- /figure -->\n")
    assert figures.main(["check"], root=root) == 2
    assert "no key 'max_error'" in capsys.readouterr().err


def test_a_span_in_backticks_is_an_example_left_alone(tmp_path):
    root = _small(tmp_path)
    span = "<!-- figure sim.max_abs_error -->{}<!-- /figure -->"
    page = f"`{span.format('...')}`, {span.format('?')}\n"
    (root / "README.md").write_text(page)
    assert figures.main(["write"], root=root) == 0
    assert (root / "README.md").read_text() == f"`{span.format('...')}`, {span.format('0.082')}\n"


def _bench_test(name: str):
    """A bench's own unit-test module, for the raw figures its tests summarize."""
    spec = importlib.util.spec_from_file_location(f"figures_{name}", ROOT / "tests" / "unit" / f"test_bench_{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summaries() -> dict[str, dict]:
    """What `hetdp bench NAME --json` writes, for the benches whose tests summarize raw figures in one process."""
    from hetdp.bench import allocation, fsdp, gpu, memory, subset

    gpu_runs = {pairing: {"epoch_s": [5.0, 2.0, 2.0], "shares": [500, 4, 4, 4], "sat_out": []}
                for pairing in gpu.PAIRINGS}
    gpu_mixed = {"runs": {name: {**gpu_runs, "gpu_alone": {"epoch_s": [3.0, 1.0, 1.0]}} for name in gpu.MODELS},
                 "parameters": {name: 1000 for name in gpu.MODELS}}
    alloc = _bench_test("allocation")
    side = alloc._rows([3.0, 2.0, 2.0, 2.0], [16] * 4, [1.0] * 4, [100] * 4)
    homogeneous = {"torch_ddp": side, "hetdp_adaptive": side, "hetdp_equal": side}
    return {
        "allocation": allocation.summarize(alloc.SPEEDS, alloc._raw(homogeneous)),
        "fsdp": fsdp.summarize(_bench_test("fsdp")._raw({"16": 9_000_000, "20": 11_400_000})),
        "memory": memory.summarize(_bench_test("memory")._raw(), (12.0, 12.0, 24.0, 48.0)),
        "subset": subset.summarize(_bench_test("subset")._raw(exchange_s=0.05)),
        "gpu": gpu.summarize({"torch_ddp": [9.0, 1.0, 1.0], "hetdp": [9.0, 1.02, 1.02], "device": "GPU"},
                             gpu_mixed, {}),
    }


def test_record_finds_every_key_in_what_the_benches_write(tmp_path):
    path = tmp_path / "figures.toml"
    shutil.copy(ROOT / "docs" / "figures.toml", path)
    for bench, result in _summaries().items():
        block = figures.record(path, bench, json.loads(json.dumps(result)), commit="fffffff", date="2026-12-06")
        assert all(f"{key} = " in block for key in figures.Figures.load(path).benches[bench].keys), bench


def test_a_figure_never_reached_misses_its_target(tmp_path):
    path = _small(tmp_path) / "docs" / "figures.toml"
    figures.record(path, "sim", {"max_abs_error": None, "rows": []}, commit="ggggggg", date="2026-12-07", fresh=True)
    assert figures.Figures.load(path).span("sim.max_abs_error") == "none ✗ (target ≤ 0.10)"


def test_a_fresh_record_keeps_every_other_bench_and_comment(tmp_path):
    path = tmp_path / "figures.toml"
    shutil.copy(ROOT / "docs" / "figures.toml", path)
    before = path.read_text()
    figures.record(path, "drift", {"steps_to_recover": 12, "recovered_step_ratio": 1.01}, commit="hhhhhhh",
                   date="2026-12-07", fresh=True)
    after = path.read_text()
    old_run = before[before.index("[[bench.drift.runs]]"):before.index("# --- imbalance")]
    new_run = after[after.index("[[bench.drift.runs]]"):after.index("# --- imbalance")]
    assert after.replace(new_run, "") == before.replace(old_run, "")
    assert "steps_to_recover = 12" in new_run and "50857b3" not in new_run
