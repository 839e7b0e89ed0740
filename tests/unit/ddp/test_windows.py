"""A loop that trains a window of fetched batches with no fetch between them: what tells a batch is done (one process).

``StepProgress`` reads the loop's events on real modules and optimizers; a one-rank ``hetdp.DDP`` shows where the
next batch's step begins. Exactness under unequal shares, with real ranks: tests/distributed/test_loops.py.
"""

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hetdp
from hetdp.ddp.windows import BackwardEnd, StepProgress, batch_samples, fed_by_a_model


def step(model: nn.Module, progress: StepProgress, *, waiting: bool = False) -> None:
    """A forward and backward of ``model``, told to ``progress`` as the drop-in tells it."""
    progress.forward(3, synchronizing=not waiting)
    model(torch.randn(3, 2)).sum().backward()
    progress.backward_ended(model.parameters(), waiting=waiting)


def stepped(progress: StepProgress, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, told to ``progress`` as torch's global hook tells the drop-in."""
    optimizer.step()
    held = {id(p) for p in model.parameters()}
    progress.optimizer_stepped(any(id(p) in held for group in optimizer.param_groups for p in group["params"]))


def test_a_batch_is_done_once_its_backward_ran_and_an_optimizer_over_the_model_stepped():
    model, progress = nn.Linear(2, 1), StepProgress()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not progress.done(accumulates=False)  # nothing ran yet
    progress.forward(3, synchronizing=True)
    assert not progress.done(accumulates=False)  # a forward, no backward: the batch trains
    step(model, progress)
    assert not progress.done(accumulates=False)  # a second backward of the step may follow
    stepped(progress, model, optimizer)
    assert progress.done(accumulates=False) and progress.done(accumulates=True)


def test_a_backward_whose_gradients_wait_ends_a_batch_unless_the_loop_runs_batches_as_micro_batches():
    model, progress = nn.Linear(2, 1), StepProgress()
    step(model, progress, waiting=True)  # under no_sync
    assert progress.done(accumulates=False)
    assert not progress.done(accumulates=True)


def test_an_update_a_grad_scaler_skipped_ends_the_batch_once_its_gradients_are_cleared():
    # A GradScaler that finds an inf calls no optimizer step (its first steps in fp16 often do): no hook tells the
    # drop-in, but zero_grad clears the gradients that no update moved the parameters by.
    model, progress = nn.Linear(2, 1), StepProgress()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
    progress.forward(3, synchronizing=True)
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    progress.backward_ended(model.parameters(), waiting=False)
    scaler.step(optimizer)
    scaler.update()
    assert not progress.done(accumulates=False)  # the gradients are still there: a second backward may follow
    optimizer.zero_grad()
    assert progress.done(accumulates=False)


def test_a_sharpness_aware_first_step_keeps_the_batch():
    # SAM: backward, move the parameters up the gradient and clear it (no optimizer step), forward and backward
    # again, then the optimizer's step. The first step's cleared gradients are not a skipped update.
    model, progress = nn.Linear(2, 1), StepProgress()
    step(model, progress)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * parameter.grad.sign())
    model.zero_grad()
    assert not progress.done(accumulates=False)


def test_another_models_update_keeps_the_batch_even_with_this_models_gradients_cleared():
    # A GAN whose generator steps first: its backward ran through the discriminator, the generator's optimizer
    # stepped, the discriminator's gradients are cleared before its own losses of the same batch.
    discriminator, generator, progress = nn.Linear(2, 1), nn.Linear(2, 2), StepProgress()
    generator_optimizer = torch.optim.SGD(generator.parameters(), lr=0.1)
    progress.forward(3, synchronizing=True)
    discriminator(generator(torch.randn(3, 2))).sum().backward()
    progress.backward_ended(discriminator.parameters(), waiting=False)
    stepped(progress, discriminator, generator_optimizer)
    discriminator.zero_grad()
    assert progress.stepped_other and not progress.done(accumulates=False)


def test_a_forward_fed_by_another_models_output_is_no_batch_of_its_own():
    data = torch.randn(3, 2)
    assert not fed_by_a_model(((data,), {"mask": torch.ones(3)}))
    assert fed_by_a_model(((nn.Linear(2, 2)(data),), {}))
    assert fed_by_a_model(((), {"inputs": [nn.Linear(2, 2)(data)]}))


@pytest.mark.parametrize(("args", "kwargs", "samples"), [
    ((torch.zeros(5, 3),), {}, 5),
    ((), {"input_ids": torch.zeros(4, 7, dtype=torch.long)}, 4),
    (([torch.zeros(3, 8, 8)] * 6,), {}, 6),  # a list of images
    (({"x": torch.zeros(2, 3), "y": torch.zeros(2)},), {}, 2),
    ((torch.tensor(1.0),), {}, None),
    (("text",), {}, None),
])
def test_batch_samples_are_what_the_first_argument_tells(args, kwargs, samples):
    assert batch_samples(args, kwargs) == samples


def test_backward_end_calls_back_once_per_backward_after_the_whole_backward():
    model = nn.Linear(2, 2)
    seen = []
    watch = BackwardEnd(lambda: seen.append(model.weight.grad is not None))
    output = model(torch.randn(3, 2))
    watch.watch((output, {"also": output * 2}))
    (output.sum() + (output * 2).sum()).backward()
    assert seen == [True]


@pytest.fixture
def window_loop(one_rank):
    """A one-rank ``hetdp.DDP`` on 10 samples in batches of 3 (the last of 1), and what its loop body saw."""
    model = hetdp.DDP(nn.Linear(2, 1), "equal")
    data = TensorDataset(torch.randn(10, 2), torch.randn(10, 1))
    loader = model.allocate(DataLoader(data, batch_size=3))
    yield model, loader
    model.close()


def test_each_batch_of_a_window_opens_its_step_at_its_first_forward(window_loop):
    # A GradScaler that skips every update (an inf scale), with zero_grad at the loop body's start: the window's
    # batches still each train under their own step.
    model, loader = window_loop
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
    for skipping in (False, True):
        seen = []
        batches = iter(loader)
        while window := list(itertools.islice(batches, 3)):
            for x, y in window:
                optimizer.zero_grad()
                seen.append((len(x), model.step_samples))
                loss = nn.functional.mse_loss(model(x), y)
                seen[-1] += (model.steps_done,)
                if skipping:
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    optimizer.step()
        first = 4 * skipping
        assert seen == [(3, 3, first), (3, 3, first + 1), (3, 3, first + 2), (1, 1, first + 3)]
    # The epoch's last step closes at the optimizer step after its batch, once the loader ran out; one the scaler
    # skipped closes as the next pass starts.
    assert model.steps_done == 7 and len(model.epoch_reports) == 1
    iter(loader).__next__()
    assert model.steps_done == 8 and len(model.epoch_reports) == 2


def test_two_losses_a_step_behind_a_prefetcher_stay_in_the_step(window_loop):
    model, loader = window_loop
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(loader)
    ahead = next(batches)
    steps = []
    for following in itertools.chain(batches, [None]):
        x, y = ahead
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        steps.append(model.steps_done)
        nn.functional.mse_loss(model(-x), -y).backward()
        steps.append(model.steps_done)
        optimizer.step()
        ahead = following
    assert steps == [0, 0, 1, 1, 2, 2, 3, 3] and model.steps_done == 4


def test_a_window_through_a_model_that_follows_another_begins_each_step_at_the_followers_forward(window_loop):
    # The tower's forward takes the batch; the head's takes the tower's output (it never begins a batch's step).
    head, loader = window_loop
    tower = hetdp.DDP(nn.Linear(2, 2), follow=head)
    try:
        optimizer = torch.optim.SGD([*tower.parameters(), *head.parameters()], lr=0.1)
        steps = []
        batches = iter(loader)
        while window := list(itertools.islice(batches, 3)):
            for x, y in window:
                optimizer.zero_grad()
                nn.functional.mse_loss(head(tower(x)), y).backward()
                steps.append((head.steps_done, tower.steps_done))
                optimizer.step()
        assert steps == [(0, 0), (1, 1), (2, 2), (3, 3)]
        assert head.steps_done == tower.steps_done == 4 and len(tower.epoch_reports) == 1
    finally:
        tower.close()


def test_a_gans_discriminator_on_the_generators_output_behind_a_prefetcher_stays_in_the_step(window_loop):
    # DCGAN's order: the discriminator's two losses and its optimizer step, then its forward on the generator's
    # output for the generator's loss. That forward follows the discriminator's update with a batch fetched ahead,
    # but another model's output feeds it: it is the step's, not the next batch's. (Once the loader has run out, a
    # step closes at the first optimizer step after its batch trained: the epoch's last batch is left out here.)
    discriminator, loader = window_loop
    generator = hetdp.DDP(nn.Linear(2, 2), follow=discriminator)
    try:
        d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.1)
        g_optimizer = torch.optim.SGD(generator.parameters(), lr=0.1)
        batches = iter(loader)
        ahead = next(batches)
        steps = []
        while following := next(batches, None):
            real, _ = ahead
            fake = generator(torch.randn(len(real), 2))
            d_optimizer.zero_grad()
            discriminator(real).mean().backward()
            (-discriminator(fake.detach()).mean()).backward()
            d_optimizer.step()
            g_optimizer.zero_grad()
            discriminator(fake).mean().backward()
            steps.append(discriminator.steps_done)
            g_optimizer.step()
            ahead = following
        assert steps == [0, 1, 2] and discriminator.steps_done == 3
    finally:
        generator.close()
