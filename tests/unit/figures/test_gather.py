"""The gathered row of step figures: named fields that travel as one float64 row and read back as they left."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from hetdp.allocate.policy import Allocator
from hetdp.figures.gather import FiguresRow

seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(steps=st.integers(0, 6), data=st.data())
def test_a_row_reads_back_as_it_was_gathered(steps, data):
    row = FiguresRow(horizon=data.draw(st.integers(0, 10**6)),
                     compute_s=data.draw(st.lists(seconds, min_size=steps, max_size=steps)),
                     wait_s=data.draw(st.lists(seconds, min_size=steps, max_size=steps)),
                     period_s=data.draw(st.lists(seconds, min_size=steps, max_size=steps)),
                     samples=data.draw(st.lists(st.integers(0, 10**5), min_size=steps, max_size=steps)),
                     extra=data.draw(st.lists(seconds, max_size=6)))
    values = row.values()
    assert len(values) == 1 + 4 * steps + len(row.extra)
    assert FiguresRow.of(values, steps) == row


def test_the_fields_keep_their_places_in_the_row():
    row = FiguresRow(horizon=7, compute_s=[0.5, 0.25], wait_s=[0.125, 0.0], period_s=[0.75, 0.625], samples=[3, 5],
                     extra=[9.0])
    assert row.values() == [7.0, 0.5, 0.25, 0.125, 0.0, 0.75, 0.625, 3.0, 5.0, 9.0]


class OnDevice:
    """A step's times whose CUDA events never complete: reading them would wait for the device."""

    completed = False
    period_s = 0.0  # a host figure, known at once

    @property
    def compute_s(self) -> float:
        raise AssertionError("a step waited on the device for its figures")

    wait_s = compute_s


class Done:
    """A step's times, complete."""

    completed = True

    def __init__(self, compute_s: float) -> None:
        self.compute_s, self.wait_s, self.period_s = compute_s, 0.0, compute_s


def test_no_step_waits_on_the_device_for_its_figures_and_they_go_out_once_complete(one_rank, tmp_path):
    import torch.distributed as dist

    from hetdp.allocate.policy import Equal
    from hetdp.collectives.paths import agree
    from hetdp.data.steps import StepTicket
    from hetdp.figures.clock import EndedStep
    from hetdp.figures.gather import Planner
    from hetdp.figures.metrics import MetricsConfig
    from hetdp.sync.gradient_sum import GradientSum

    class Listener:
        def replanned(self, first: int, shares: list[int]) -> None: ...

    group, listener = dist.group.WORLD, Listener()
    planner = Planner(GradientSum(group, 30.0, agree("gloo", ["cpu"])), torch.nn.Linear(1, 1), group, timeout_s=30.0,
                      metrics=MetricsConfig(csv=tmp_path / "steps.csv", every=1), writer=None,
                      on_replan=listener.replanned)
    planner.start(Allocator(Equal(), 1, 8))
    tickets = [StepTicket(step=k, epoch=0, index=k, block=(8,), rank=0) for k in range(10)]
    for ticket in tickets[:6]:
        planner.step_ended(EndedStep(ticket, OnDevice()))  # a gather is due at every step: none reads them
    assert list(planner.step_figures) == [] and planner.steps_done == 6
    for ticket in tickets[6:]:
        planner.step_ended(EndedStep(ticket, Done(0.5)))
    assert [figures.step for figures in planner.step_figures] == [6, 7, 8, 9]  # the six are still on the device
