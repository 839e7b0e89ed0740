import pytest
import torch

from hetdp.runtime import gpu_per_local_rank, is_peer_failure


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
