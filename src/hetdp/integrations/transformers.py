"""transformers: ``hetdp.integrations.transformers.Trainer`` in place of transformers' trains with ``hetdp.DDP``, its
training batches re-cut by the shares, the loss normalization counted once."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from hetdp.allocate.policy import AllocationPolicy
from hetdp.errors import ConfigError
from hetdp.figures.metrics import MetricsConfig
from hetdp.floor import check_framework
from hetdp.integrations.accelerate import Accelerator, AllocatedDataLoader
from hetdp.integrations.steps import LoopLoader
from hetdp.sync.policy import SyncPolicy

try:
    import transformers

    check_framework("transformers", transformers.__version__, user="hetdp.integrations.transformers")
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ConfigError("hetdp.integrations.transformers needs Hugging Face transformers: "
                      "pip install 'hetdp[transformers]'") from error


class Trainer(transformers.Trainer):
    """transformers' ``Trainer``, with ``hetdp.DDP`` in place of torch's: rank i trains ``shares[i]`` of every step.

    Its Accelerator is hetdp's (``hetdp.integrations.accelerate``): the model is
    wrapped in ``hetdp.DDP(allocation, sync)`` and the training loader re-cut by
    the shares, the same number of batches on every rank, so ``max_steps``, the
    schedule and logging count as under DDP; evaluation loaders are
    transformers'. The Trainer fetches all the batches of an optimizer step before
    it trains the first, so each batch's step opens in ``training_step`` and
    closes at the callbacks that follow it (``on_substep_end``, ``on_step_end``).

    With ``average_tokens_across_devices`` (the default) the Trainer already
    divides each rank's loss by the step's token count over all ranks, and scales
    it by the number of ranks to undo DDP's mean: those steps are weighed as plain
    DDP weighs them, not by the ranks' shares again, and a rank's stand-in
    batch (the epoch's last step, fewer samples than ranks) adds neither
    tokens nor gradient. Otherwise each rank's loss is the mean over its own batch
    and is weighed by its samples, as ``hetdp.DDP`` does.

    Warning:
        Every rank must run the same arguments: each step is collective. The
        training sampler must be transformers' default (a random order):
        ``group_by_length`` and ``batch_rebalance`` order batches themselves.

    Examples:
        >>> # on every rank, launched with `hetdp run -n 4 --speeds 1,1,2,4 train.py` or torchrun
        >>> from hetdp.integrations.transformers import Trainer      # was: from transformers import Trainer
        >>> trainer = Trainer(model=model, args=TrainingArguments(per_device_train_batch_size=8), train_dataset=data)
        >>> trainer.train()                                           # rank i: shares[i] of 8 x 4 samples a step
        >>> trainer.accelerator.hetdp_model.last_epoch.diagnosis()
    """

    def __init__(self, *args: Any, allocation: str | AllocationPolicy | None = None,
                 sync: str | SyncPolicy | None = None, step_timeout_s: float = 60.0,
                 metrics: MetricsConfig | None = None, **kwargs: Any) -> None:
        """Args: ``allocation``, ``sync``, ``step_timeout_s`` and ``metrics`` as ``hetdp.DDP`` takes them (None:
        ``hetdp run``'s ``--allocation`` / ``--sync``, else adaptive and allreduce); the rest as transformers'
        ``Trainer`` takes them."""
        self.hetdp_options = {"allocation": allocation, "sync": sync, "step_timeout_s": step_timeout_s,
                              "metrics": metrics}
        self._train_loader: AllocatedDataLoader | None = None
        self._hetdp_stand_in = False
        super().__init__(*args, **kwargs)
        self.add_callback(_Steps(self))

    def create_accelerator_and_postprocess(self) -> None:
        # transformers builds its Accelerator inside this method, by the name its module imported: for the length
        # of the call, that name is hetdp's Accelerator with this Trainer's settings.
        module = sys.modules[transformers.Trainer.__module__]
        accelerator = module.Accelerator
        module.Accelerator = functools.partial(Accelerator, **self.hetdp_options)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            module.Accelerator = accelerator

    @property
    def hetdp_loader(self) -> LoopLoader | None:
        """The training loader as re-cut, once the Trainer built it and prepared the model."""
        if self._train_loader is None or self.accelerator.hetdp_model is None:
            return None
        return self._train_loader.loop

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        if isinstance(loader, AllocatedDataLoader):
            loader.opens_steps = False  # this Trainer's hooks open and close the steps
            self._train_loader = loader
        elif self.accelerator.wraps_in_ddp:
            raise ConfigError("hetdp's Trainer re-cuts a training loader that shuffles: use the default "
                              f"train_sampling_strategy, not {self.args.train_sampling_strategy!r}")
        return loader

    def _normalized_across_devices(self, num_items_in_batch: Any) -> bool:
        """Whether the loss of a step is already divided by its token count over all ranks (``compute_loss``)."""
        return bool(self.args.average_tokens_across_devices and num_items_in_batch is not None
                    and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None))

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """Count the step's tokens as transformers does, without those of stand-in batches (weighted 0)."""
        tickets = list(self.hetdp_loader.allocated.sampler.tickets) if self.hetdp_loader is not None else []
        stand_ins = [i for i, ticket in enumerate(tickets[: len(batch_samples)]) if ticket.samples == 0]
        if stand_ins:
            batch_samples = [_without_labels(batch) if i in stand_ins else batch
                             for i, batch in enumerate(batch_samples)]
        return super()._get_num_items_in_batch(batch_samples, device)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        if self.hetdp_loader is None:
            return super().training_step(model, inputs, num_items_in_batch)
        normalized = self._normalized_across_devices(num_items_in_batch)
        world = self.accelerator.hetdp_model.world_size
        ticket = self.hetdp_loader.begin_batch(weights=(1.0,) * world if normalized else None)
        self._hetdp_stand_in = normalized and ticket.samples == 0
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._hetdp_stand_in = False

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self._hetdp_stand_in:
            return result
        # Weighed as plain DDP, a stand-in batch would count: its loss is zeroed (its forward still runs, so that
        # its backward joins the step's allreduce).
        return (result[0] * 0.0, result[1]) if return_outputs else result * 0.0


def _without_labels(batch: Any) -> Any:
    """``batch`` with every label ignored (-100): transformers counts no token of it."""
    masked = dict(batch)
    for key in ("labels", "shift_labels"):
        if key in masked and isinstance(masked[key], torch.Tensor):
            masked[key] = torch.full_like(masked[key], -100)
    return masked


class _Steps(TrainerCallback):
    """Closes each batch's step after it (after the optimizer step, for the last of an update), the epoch after its
    last, and the model when training ends (evaluation runs the unwrapped model)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.hetdp_loader is not None:
            self.trainer.hetdp_loader.end_batch()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.hetdp_loader is not None:
            self.trainer.hetdp_loader.end_batch()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.hetdp_loader is not None:
            self.trainer.hetdp_loader.end_epoch()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.hetdp_loader is not None:
            self.trainer.hetdp_loader.end_epoch()  # a run stopped inside an epoch (max_steps)
            self.trainer.hetdp_loader.model.close()
