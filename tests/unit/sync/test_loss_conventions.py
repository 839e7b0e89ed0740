"""Loss conventions: what a rank's gradient weighs for the step's to be plain DDP's, and the settings refused."""

from __future__ import annotations

import pytest

from hetdp.ddp.hook import loss_convention
from hetdp.errors import ConfigError
from hetdp.fsdp.dropin import DropInSettings
from hetdp.sync.base import check_loss, step_part
from hetdp.sync.policy import sync_policy


def test_a_per_rank_mean_weighs_its_samples_of_the_step():
    assert step_part("mean", 3, 16, 4) == (3, 16)
    assert step_part("mean", 0, 16, 4) == (0, 16)


@pytest.mark.parametrize("loss", ["sum", "global_mean"])
def test_a_sum_or_a_global_mean_weighs_one_over_the_ranks_and_a_stand_in_nothing(loss):
    assert step_part(loss, 3, 16, 4) == (1, 4)
    assert step_part(loss, 9, 16, 4) == (1, 4)
    assert step_part(loss, 0, 16, 4) == (0, 4)


@pytest.mark.parametrize("bad", ["avg", "Sum", None, 1])
def test_an_unknown_loss_convention_is_one_config_error_naming_the_choices(bad):
    with pytest.raises(ConfigError, match="global_mean"):
        check_loss(bad)
    with pytest.raises(ConfigError, match="global_mean"):
        DropInSettings(loss=bad)


@pytest.mark.parametrize("sync", ["majority", "solo", "local", "local:3"])
def test_a_sum_loss_needs_the_allreduce(sync):
    with pytest.raises(ConfigError, match="allreduce"):
        loss_convention("sum", sync_policy(sync))
    assert loss_convention("mean", sync_policy(sync)) == "mean"
    assert loss_convention("global_mean", sync_policy("allreduce")) == "global_mean"
