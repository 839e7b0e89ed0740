import pytest
import torch

from hetdp.runtime import gpu_per_local_rank


@pytest.mark.parametrize(("gpus", "local_ranks", "expected"), [(0, 1, False), (1, 1, True), (1, 4, False), (4, 4, True)])
def test_nccl_only_when_every_local_rank_has_its_own_gpu(monkeypatch, gpus, local_ranks, expected):
    # NCCL refuses two ranks on one GPU: four emulated workers on a one-GPU laptop must fall back to gloo
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    assert gpu_per_local_rank() is expected
