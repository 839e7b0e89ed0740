"""Destroyed groups leave no gloo threads behind: one still releasing a tensor at interpreter exit aborts."""

from __future__ import annotations

import json


def test_no_gloo_thread_outlives_the_groups_after_an_optimizer_and_a_closed_drop_in(torchrun, tmp_path):
    torchrun("shutdown_worker.py", 2, "--out", tmp_path)
    for rank in range(2):
        threads = json.loads((tmp_path / f"threads_{rank}.json").read_text())
        assert sum("gloo" in name for name in threads["during"]) >= 2  # the default group's and the drop-in's
        assert not [name for name in threads["after"] if "gloo" in name]
