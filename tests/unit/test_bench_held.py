"""``bench.held``: the memory a piece of training allocates, counted tensor by tensor, with no arithmetic of the
drop-in's in it."""

from __future__ import annotations

import torch
from torch import nn

from hetdp.bench.held import HeldBytes, state_bytes


def test_new_storages_count_until_freed_and_views_and_in_place_results_do_not():
    before = torch.zeros(1000)  # not allocated in the block: never counted
    with HeldBytes() as held:
        kept = torch.ones(256)  # 1024 bytes
        view = kept.view(16, 16)
        kept.add_(1.0)
        before.mul_(2.0)
        temporary = kept * 2  # 1024 bytes more, then freed
        del temporary
        alias = before[:10]
    assert held.peak == 2048 and held.now == 1024
    del kept, view, alias
    assert held.now == 0  # a storage freed after the block leaves the count too


def test_a_training_step_peaks_above_what_it_leaves_and_its_activations_grow_with_the_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 2))
    peaks = []
    for batch in (8, 16):
        model.zero_grad(set_to_none=True)
        with HeldBytes() as held:
            model(torch.randn(batch, 32)).sum().backward()
        peaks.append(held.peak)
        gradients = sum(p.numel() * 4 for p in model.parameters())
        assert held.now == gradients  # what stays: the gradients
        assert held.peak > gradients
    assert peaks[1] - peaks[0] >= 8 * 256 * 4  # 8 more samples keep at least their hidden activations


def test_state_bytes_count_parameters_gradients_and_optimizer_state_once_each():
    model = nn.Linear(10, 10)  # 110 parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert state_bytes(model.parameters(), optimizer) == 440
    model(torch.randn(2, 10)).sum().backward()
    optimizer.step()  # momentum appears
    assert state_bytes(model.parameters(), optimizer) == 3 * 440
