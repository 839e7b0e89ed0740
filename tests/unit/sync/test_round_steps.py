"""A step that applies several partial rounds runs the loop's optimizer once per round, as the ranks that received
them one by one did."""

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hetdp.sync.round_steps import RoundSteps


def model_and_rounds(count: int, seed: int = 0) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    numel = sum(p.numel() for p in model.parameters())
    return model, [torch.randn(numel) for _ in range(count)]


def layout_of(model: nn.Module) -> list[tuple[nn.Parameter, int]]:
    layout, offset = [], 0
    for p in model.parameters():
        layout.append((p, offset))
        offset += p.numel()
    return layout


def set_grads(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def one_by_one(model: nn.Module, make_optimizer, rounds: list[torch.Tensor], scale: float = 1.0) -> nn.Module:
    """A rank that received the rounds in steps of their own (a warm optimizer: one step on a first gradient)."""
    optimizer = make_optimizer(model)
    set_grads(model, torch.ones_like(rounds[0]))
    optimizer.step()
    for part in rounds:
        set_grads(model, part * scale)
        optimizer.step()
    return model


def at_once(model: nn.Module, make_optimizer, rounds: list[torch.Tensor], scale: float = 1.0,
            steps: RoundSteps | None = None) -> nn.Module:
    """A rank that received the rounds in one step: the loop hands the optimizer their sum, scaled (unscaled by a
    GradScaler, clipped by norm)."""
    optimizer = make_optimizer(model)
    set_grads(model, torch.ones_like(rounds[0]))
    optimizer.step()
    whole = torch.stack(rounds).sum(0)
    if steps is not None:
        steps.hold(layout_of(model), rounds, whole)
    set_grads(model, whole * scale)
    optimizer.step()
    return model


OPTIMIZERS = {
    "momentum": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=0.01),
}


@settings(max_examples=30, deadline=None)
@given(count=st.integers(2, 5), scale=st.floats(0.01, 4.0), kind=st.sampled_from(sorted(OPTIMIZERS)),
       seed=st.integers(0, 1000))
def test_rounds_received_at_once_move_the_model_as_rounds_received_one_by_one(count, scale, kind, seed):
    model, rounds = model_and_rounds(count, seed)
    expected = one_by_one(copy.deepcopy(model), OPTIMIZERS[kind], rounds, scale)
    steps = RoundSteps()
    try:
        caught_up = at_once(copy.deepcopy(model), OPTIMIZERS[kind], rounds, scale, steps)
    finally:
        steps.close()
    assert steps.extra_steps == count - 1
    assert torch.allclose(flat_parameters(caught_up), flat_parameters(expected), rtol=1e-4, atol=1e-5)


def test_without_them_a_stateful_optimizer_stepped_once_on_the_sum_falls_behind():
    model, rounds = model_and_rounds(3)
    expected = one_by_one(copy.deepcopy(model), OPTIMIZERS["momentum"], rounds)
    summed = at_once(copy.deepcopy(model), OPTIMIZERS["momentum"], rounds)
    assert not torch.allclose(flat_parameters(summed), flat_parameters(expected), rtol=1e-4, atol=1e-5)


def test_after_the_step_the_gradient_is_the_one_the_loop_handed_the_optimizer():
    model, rounds = model_and_rounds(3)
    optimizer = OPTIMIZERS["momentum"](model)
    whole = torch.stack(rounds).sum(0)
    steps = RoundSteps()
    steps.hold(layout_of(model), rounds, whole)
    set_grads(model, whole)
    grads = [p.grad for p in model.parameters()]
    optimizer.step()
    steps.close()
    assert all(p.grad is grad for p, grad in zip(model.parameters(), grads))
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), whole)


def test_the_optimizers_other_parameters_step_once_and_the_next_step_applies_nothing_held():
    model, rounds = model_and_rounds(3)
    extra = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([*model.parameters(), extra], lr=1.0)
    steps = RoundSteps()
    steps.hold(layout_of(model), rounds, torch.stack(rounds).sum(0))
    set_grads(model, torch.stack(rounds).sum(0))
    extra.grad = torch.ones(2)
    optimizer.step()
    assert torch.equal(extra.detach(), -torch.ones(2)) and steps.extra_steps == 2
    optimizer.step()  # the rounds were consumed: a second step is the loop's alone
    steps.close()
    assert torch.equal(extra.detach(), -2 * torch.ones(2)) and steps.extra_steps == 2


def test_a_step_with_a_closure_applies_the_sum_in_one_step():
    model, rounds = model_and_rounds(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    whole = torch.stack(rounds).sum(0)
    before = flat_parameters(model).clone()
    steps = RoundSteps()
    steps.hold(layout_of(model), rounds, whole)
    set_grads(model, whole)
    optimizer.step(lambda: torch.tensor(0.0))
    steps.close()
    assert steps.extra_steps == 0
    assert torch.allclose(flat_parameters(model), before - 0.1 * whole)


def test_a_closed_hold_takes_no_part_in_later_steps():
    model, rounds = model_and_rounds(3)
    steps = RoundSteps()
    steps.close()
    steps.hold(layout_of(model), rounds, torch.stack(rounds).sum(0))  # after close: held, but no hook runs it
    set_grads(model, torch.stack(rounds).sum(0))
    OPTIMIZERS["momentum"](model).step()
    assert steps.extra_steps == 0


def test_a_grad_scaler_step_applies_each_round_unscaled():
    model, rounds = model_and_rounds(3)
    expected = one_by_one(copy.deepcopy(model), OPTIMIZERS["momentum"], rounds)
    caught_up = copy.deepcopy(model)
    optimizer = OPTIMIZERS["momentum"](caught_up)
    set_grads(caught_up, torch.ones_like(rounds[0]))
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.zeros(())).item()  # the scaler's state starts at its first scale()
    whole = torch.stack(rounds).sum(0)
    steps = RoundSteps()
    steps.hold(layout_of(caught_up), [part * 1024.0 for part in rounds], whole * 1024.0)  # a scaled loss's rounds
    set_grads(caught_up, whole * 1024.0)
    scaler.step(optimizer)
    steps.close()
    assert steps.extra_steps == 2
    assert torch.allclose(flat_parameters(caught_up), flat_parameters(expected), rtol=1e-4, atol=1e-5)
