"""A run ends with exit code 0 once its script has finished: no gloo thread of a group the script destroyed is left to
race the interpreter's finalization (where one that waits for the GIL to free a tensor aborts the process)."""

from __future__ import annotations

import json


def test_no_gloo_thread_is_left_at_finalization_of_a_script_that_makes_its_own_group(torchrun, tmp_path):
    # hetdp imported first, then the script's own init_process_group, the first optimizer (torch._dynamo imports
    # torch.distributed.nn.functional) and a drop-in left to its reference cycles: once destroyed, every group ends
    # before finalization, where a gloo thread that waits for the GIL to free a tensor aborts the process.
    torchrun("exit_worker.py", 2, "--out", tmp_path)
    for rank in range(2):
        threads = json.loads((tmp_path / f"threads_{rank}.json").read_text())
        assert not [name for name in threads if "gloo" in name], threads


def test_a_loader_worker_forked_after_a_closed_drop_in_collects_nothing_of_its_group(torchrun):
    # The worker collects what it inherited as it starts; a destroyed group still in a cycle would run its destructor
    # there, joining threads only the parent has (a segmentation fault of the worker, every launch).
    result = torchrun("fork_worker.py", 2, timeout_s=240, expect_rc=None)
    assert "segmentation fault" not in result.stdout.lower(), result.stdout[-4000:]
    assert result.returncode == 0, result.stdout[-4000:]
