import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist

from hetdp.runtime import liveness, teardown
from hetdp.runtime.group import (
    defer_nccl_watchdog,
    gpu_per_local_rank,
    group_timeout_s,
    is_peer_failure,
)


@pytest.mark.parametrize(("gpus", "local_ranks", "expected"), [(0, 1, False), (1, 1, True), (1, 4, False), (4, 4, True)])
def test_nccl_only_when_every_local_rank_has_its_own_gpu(monkeypatch, gpus, local_ranks, expected):
    # NCCL refuses two ranks on one GPU: four emulated workers on a one-GPU laptop must fall back to gloo
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert gpu_per_local_rank() is expected


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2999ms for recv operation"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:19859"), True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (RuntimeError("NCCL communicator was aborted on rank 2"), True),
        (RuntimeError("gloo: the tensor sizes do not match across ranks (4 vs 8)"), False),
        (RuntimeError("NCCL error: invalid usage, ncclInvalidArgument"), False),
        (ValueError("connection closed"), False),
    ],
)
def test_only_a_dead_or_silent_peer_counts_as_a_peer_failure(error, expected):
    # A bug or a bad argument in a collective must keep its own type and traceback, not become a PeerTimeoutError.
    assert is_peer_failure(error) is expected


def test_an_nccl_groups_watchdog_waits_past_the_heartbeats_verdict():
    # The watchdog ending the process first would leave the dead peer unnamed: the wait fails, the heartbeat
    # names the culprit, and only then may NCCL's own timeout fire. gloo has no watchdog.
    assert group_timeout_s("nccl", 60.0) >= 60.0 + liveness.SILENCE_S + liveness.STORE_TIMEOUT_S
    assert group_timeout_s("gloo", 60.0) == 60.0


def test_nccl_errors_abort_the_communicator_not_the_process_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    defer_nccl_watchdog()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: the next wait raises in Python
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    defer_nccl_watchdog()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_a_fork_is_preceded_by_a_collection_only_while_a_released_group_is_still_held(one_rank, monkeypatch):
    # A loader forks its workers after collect_released: a destroyed group left to a reference cycle must end in this
    # process first; with none held, the fork is not preceded by a full collection (0.05-0.2 s of CPU each epoch).
    monkeypatch.setattr(teardown, "_released", weakref.WeakSet())
    collections: list[int] = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda: collections.append(collect()))
    teardown.collect_released()
    assert collections == []
    cycle: dict = {"group": dist.new_group([0])}
    cycle["cycle"] = cycle
    teardown.release_group(cycle["group"])
    del cycle
    teardown.collect_released()
    assert len(collections) == 1 and len(teardown._released) == 0  # the cycle, and the group with it, went
    teardown.collect_released()
    assert len(collections) == 1
