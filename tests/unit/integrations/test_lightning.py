"""The re-cut training loader as Lightning sees it: resumable in Lightning's sense, and as long as the whole epoch
while a resumed epoch yields only the batches left (Lightning counts them from the batches it had done)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hetdp.data.loader import AllocatedLoader
from hetdp.data.steps import StepSampler

# Lightning is imported by the tests, not at collection: every pytest worker collects every module, and Lightning's
# import alone takes several seconds of CPU.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs hetdp[lightning]")


class Model:
    """What the loader needs of hetdp.DDP: rank 0 of 2, shares 3 and 1 of 4 a step, 1 step of epoch 0 done."""

    rank, world_size = 0, 2
    last_epoch = None
    steps_done = epochs_done = 0

    def shares_at(self, step: int) -> list[int]:
        return [3, 1]

    def begin_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.begun = (epoch, start_step)

    def hetdp_state_dict(self) -> dict:
        return {"position": (0, 1)}


def _loader():
    from hetdp.integrations.lightning import _ResumableLoader

    data = TensorDataset(torch.arange(10))
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    steps = StepSampler(10, 4, 0, shares_at=Model().shares_at, shuffle=False, seed=0, drop_last=False,
                        epoch_source=loader.sampler)
    return _ResumableLoader(AllocatedLoader(Model(), loader, steps))  # type: ignore[arg-type]


def test_lightning_keeps_and_restores_the_position_in_the_epoch():
    from lightning.fabric.utilities.types import _Stateful

    loader = _loader()
    assert isinstance(loader, _Stateful)  # Lightning saves it with the fit loop and restores it mid-epoch
    state = loader.state_dict()
    assert state == {"position": [0, 1]}
    resumed = _loader()
    resumed.load_state_dict(state)
    batches = [batch[0].tolist() for batch in resumed]
    assert batches == [[4, 5, 6], [8]]  # steps 1 and 2 of the epoch (4 samples each, 3 of them rank 0's)
    assert resumed.model.begun == (0, 1)


def test_a_resumed_epoch_keeps_its_whole_length():
    loader = _loader()
    loader.load_state_dict({"position": [0, 1]})
    assert len(loader) == 3  # the epoch's 3 steps: Lightning's loop and fetcher start counting at the 1 done
