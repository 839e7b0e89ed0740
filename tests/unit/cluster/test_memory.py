"""The memory cap: the arithmetic of C-ADP eq. 3, where it comes from, and trial steps that leave no trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetdp import ConfigError, Emulation
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.memory import cap_from_memory, largest_forward, trial_step


def test_memory_cap_is_what_fits_after_the_fixed_part():
    assert cap_from_memory(10e9, 1e9, 100e6, headroom=0.9) == 80
    assert cap_from_memory(10e9, 1e9, 0.0) is None
    with pytest.raises(ConfigError, match="not one sample fits"):
        cap_from_memory(1e9, 2e9, 1e6)


def test_largest_forward_is_the_emulated_cap_else_none_on_cpu():
    model = nn.Linear(3, 2)
    loader = [(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))]
    emulation = Emulation(sample_cost_ms=1.0, devices=(DeviceModel(max_batch=7), DeviceModel()))
    assert largest_forward(model, loader, rank=0, emulation=emulation) == 7
    assert largest_forward(model, loader, rank=1, emulation=emulation) is None
    assert largest_forward(model, loader, rank=0, emulation=Emulation()) is None  # CPU: memory does not cap it


class Keywords(nn.Module):
    """A model called with a batch's keyword arguments, as a mapping batch is fed, with BatchNorm and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.body(x), "labels": labels}


@pytest.mark.parametrize("feed", ["tensor", "pair", "mapping"])
def test_a_trial_step_runs_on_the_first_samples_and_leaves_the_model_as_it_was(feed):
    keywords, inputs, labels = Keywords(), torch.randn(6, 3), torch.zeros(6)
    model, batch = {"tensor": (keywords.body, inputs), "pair": (keywords.body, (inputs, labels)),
                    "mapping": (keywords, {"x": inputs, "labels": labels})}[feed]
    keywords.body(inputs).sum().backward()  # a step before: the trial must not add to its gradients
    keywords.body[3].bias.grad = None  # nor give one to a parameter without
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    sizes: list[int] = []
    keywords.body.register_forward_hook(lambda _, __, output: sizes.append(len(output)))
    trial_step(model, batch, 3)
    assert sizes == [3]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name  # BatchNorm's statistics too
    for parameter, grad in zip(model.parameters(), grads):
        assert parameter.grad is grad is None or torch.equal(parameter.grad, grad)


def test_a_batch_the_trial_cannot_feed_is_one_config_error_line():
    with pytest.raises(ConfigError, match=r"^max_batch='measure' could not run a trial step .*: pass max_batch=<"):
        trial_step(nn.Linear(3, 2), [[1, 2], [3, 4]], 1)
