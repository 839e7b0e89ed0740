"""The sharded drop-in under faults, with real processes over gloo: a killed rank restarted by the launcher, and a
run resumed on fewer ranks, from torch's even shards onto memory-sized ones and onto one rank. Its own file, apart
from ``test_sharded.py``'s long launch: under ``--dist loadfile`` each file runs on one worker, so the two run side by
side."""

from __future__ import annotations

import collections
import json
import sys

import torch

from hetdp.launch import run_local

from .conftest import WORKERS

sys.path.insert(0, str(WORKERS))
from sharded_worker import STEPS_PER_EPOCH, assert_as_one_process, reference  # noqa: E402


def test_a_killed_rank_resumes_under_restarts_on_even_and_uneven_shards_and_fewer_ranks_reshard_them_exactly(
        tmp_path):
    # One chain of launches over 3 epochs (15 steps), every rank saving every 2 steps, each launch on fewer ranks than
    # the last: 3 ranks on torch's even shards, rank 1 killed in step 3 and the launch restarted from the save at
    # step 2, stopped after step 5; 2 ranks of 1 and 3 MB resume it (DCP reshards the model and AdamW's state from
    # even shards onto memory-sized ones), rank 1 killed in step 9 and restarted from the save at step 8, stopped
    # after step 11; one rank resumes that and ends the run (memory-sized shards onto one).
    restarts: list[int] = []
    args = ["--ckpt", tmp_path / "ckpt", "--record", tmp_path / "steps.log", "--out", tmp_path / "final.pt",
            "--epochs", 3]
    for ranks, options in ((3, ["--die-at", 3, "--stop-at", 6]), (2, ["--memories", "1,3", "--die-at", 9,
                                                                     "--stop-at", 12]), (1, [])):
        completed = run_local(WORKERS / "sharded_resume_worker.py", ranks, [*map(str, args), *map(str, options)],
                              capture=True, timeout_s=300, max_restarts=1 if options else 0, report_errors=True,
                              on_restart=lambda attempt, code: restarts.append(attempt))
        assert completed.returncode == 0, completed.stdout
    assert restarts == [1, 1]
    steps: dict[str, set[int]] = collections.defaultdict(set)
    ranks: dict[str, set[int]] = collections.defaultdict(set)
    for line in (tmp_path / "steps.log").read_text().splitlines():
        launch, step, rank = line.split()
        steps[launch].add(int(step))
        ranks[launch].add(int(rank))
    # In the order the launches ran: each killed one, its restart (two steps redone), then the last.
    assert [(min(each), max(each)) for each in steps.values()] == [(0, 3), (2, 5), (6, 9), (8, 11),
                                                                   (12, 3 * STEPS_PER_EPOCH - 1)]
    assert list(ranks.values()) == [{0, 1, 2}] * 2 + [{0, 1}] * 2 + [{0}]
    held = [json.loads(line) for line in (tmp_path / "final.pt.rows").read_text().splitlines()]
    assert [launch["uneven"] for launch in held] == [False, True, False]  # one rank holds everything: torch's path
    elements = held[1]["elements"]  # the 2 ranks of 1 and 3 MB
    assert abs(elements[0] / sum(elements) - 0.25) < 0.02, elements
    assert_as_one_process(torch.load(tmp_path / "final.pt"), reference(3))
