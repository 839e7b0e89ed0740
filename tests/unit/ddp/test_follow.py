"""A model that follows another's steps (``hetdp.DDP(..., follow=model)``): what it refuses, on one rank.

That it trains exactly on the leader's shares is tested with real ranks in tests/distributed/test_dropin.py.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hetdp
from hetdp.cluster.emulate import ENV_SAMPLE_COST_MS
from hetdp.errors import ConfigError


@pytest.fixture
def leader(one_rank):
    model = hetdp.DDP(nn.Linear(2, 2), "equal")
    yield model
    model.close()


@pytest.mark.parametrize("setting", [{"allocation": "adaptive"}, {"emulation": hetdp.Emulation(speeds=(2.0,))}])
def test_a_follower_takes_its_leaders_shares_and_emulation(leader, setting):
    with pytest.raises(ConfigError, match="give allocation= and emulation= to the model it follows"):
        hetdp.DDP(nn.Linear(2, 2), follow=leader, **setting)


def test_follow_takes_a_hetdp_ddp(one_rank):
    with pytest.raises(ConfigError, match="follow must be a hetdp.DDP, got Linear"):
        hetdp.DDP(nn.Linear(2, 2), follow=nn.Linear(2, 2))


def test_a_follower_has_no_loader_of_its_own_and_leaves_the_emulation_to_its_leader(leader, monkeypatch):
    monkeypatch.setenv(ENV_SAMPLE_COST_MS, "5")  # as `hetdp run --sample-cost-ms 5` sets it for every model
    alone = hetdp.DDP(nn.Linear(2, 2), "equal")
    alone.close()
    assert alone.emulation.active  # a model of its own paces its steps
    follower = hetdp.DDP(nn.Linear(2, 2), follow=leader)
    try:
        assert not follower.emulation.active  # its steps run inside the leader's, already paced
        with pytest.raises(ConfigError, match="allocate that model's loader"):
            follower.allocate(DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2))
    finally:
        follower.close()


def test_a_closed_follower_no_longer_follows(leader):
    follower = hetdp.DDP(nn.Linear(2, 2), follow=leader)
    assert leader._open_followers() == [follower]
    follower.close()
    assert leader._open_followers() == []


@pytest.mark.parametrize(("leads", "follows"), [("majority", "allreduce"), ("allreduce", "quorum:2"),
                                                ("local", "full")])
def test_a_follower_refuses_partial_rounds_that_wait_beside_its_leader(one_rank, leads, follows):
    # Each model's partial allreduce blocks its caller until its round fires: a rank blocked in one model's round
    # can hold up the other's, and the GAN of two majority models deadlocked (a PeerTimeoutError after 60 s).
    leader = hetdp.DDP(nn.Linear(2, 2), "equal", leads)
    try:
        with pytest.raises(ConfigError, match="would wait on the other model's exchange"):
            hetdp.DDP(nn.Linear(2, 2), sync=follows, follow=leader)
    finally:
        leader.close()


@pytest.mark.parametrize(("leads", "follows"), [("solo", "local"), ("allreduce", "quorum:1")])
def test_a_follower_runs_beside_rounds_that_wait_for_no_one(one_rank, leads, follows):
    leader = hetdp.DDP(nn.Linear(2, 2), "equal", leads)
    follower = hetdp.DDP(nn.Linear(2, 2), sync=follows, follow=leader)
    assert leader._open_followers() == [follower]
    follower.close()
    leader.close()
