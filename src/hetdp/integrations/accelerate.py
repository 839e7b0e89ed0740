"""Hugging Face Accelerate: ``hetdp.integrations.accelerate.Accelerator`` in place of accelerate's wraps the model in
``hetdp.DDP`` and re-cuts the training loader, leaving the loop (``prepare``, ``accumulate``, ``backward``,
``clip_grad_norm_``, ``gather_for_metrics``) as it is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from hetdp.allocate.policy import AllocationPolicy
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError
from hetdp.figures.metrics import MetricsConfig
from hetdp.floor import check_framework
from hetdp.integrations.steps import LoopLoader
from hetdp.sync.base import LossConvention, check_loss
from hetdp.sync.policy import SyncPolicy

try:
    import accelerate

    check_framework("accelerate", accelerate.__version__, user="hetdp.integrations.accelerate")
    from accelerate.data_loader import DataLoaderStateMixin
    from accelerate.state import GradientState
    from accelerate.utils import DDPCommunicationHookType, DistributedType, send_to_device
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ConfigError("hetdp.integrations.accelerate needs Hugging Face Accelerate: "
                      "pip install 'hetdp[accelerate]'") from error


class Accelerator(accelerate.Accelerator):
    """Accelerate's ``Accelerator``, with ``hetdp.DDP`` in place of torch's: rank i trains ``shares[i]`` of every step.

    ``prepare`` wraps the trainable model in ``hetdp.DDP(allocation, sync)`` where
    Accelerate would wrap it in torch's DDP (a multi-GPU or multi-CPU run), and
    re-cuts every loader that shuffles (the training loaders) by ``model.allocate``,
    in place of Accelerate's sharding (its ``BatchSamplerShard`` would re-shard
    the re-cut batches, and drop those of another size). Loaders that do not
    shuffle (evaluation) are Accelerate's own, so ``gather_for_metrics`` drops
    their padding as usual. A re-cut loader has Accelerate's length per process,
    moves batches to the device, reshuffles each epoch (``set_epoch`` as
    Accelerate's), and tells ``accumulate`` of its last batch, where the
    gradients synchronize.

    Warning:
        Every rank must run the same settings and loop: each step is collective.
        Gathering training outputs (``gather``, ``gather_for_metrics``) needs
        equal shapes on every rank, which unequal shares are not: pad them first
        (``pad_across_processes``), or read the epoch's figures from
        ``accelerator.hetdp_model.last_epoch``.

    Examples:
        >>> # on every rank, launched with `hetdp run -n 4 --speeds 1,1,2,4 train.py` or torchrun
        >>> from hetdp.integrations.accelerate import Accelerator      # was: from accelerate import Accelerator
        >>> accelerator = Accelerator(gradient_accumulation_steps=2)
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)   # loader shuffles
        >>> for batch in loader:                                        # rank i: shares[i] of 32 x 4 samples
        ...     with accelerator.accumulate(model):
        ...         accelerator.backward(loss_fn(model(batch["x"]), batch["y"]))
        ...         optimizer.step()
        ...         optimizer.zero_grad()
    """

    def __init__(self, *args: Any, allocation: str | AllocationPolicy | None = None,
                 sync: str | SyncPolicy | None = None, step_timeout_s: float = 60.0,
                 metrics: MetricsConfig | None = None, loss: LossConvention = "mean", **kwargs: Any) -> None:
        """Args: ``allocation``, ``sync``, ``step_timeout_s``, ``metrics`` and ``loss`` as ``hetdp.DDP`` takes them
        (None: ``hetdp run``'s ``--allocation`` / ``--sync``, else adaptive and allreduce; ``loss``: what the loop's
        loss is, ``"mean"`` over the rank's batch by default, ``"sum"`` or ``"global_mean"``, so that unequal shares
        give plain DDP's update at equal shares); the rest as Accelerate's ``Accelerator`` takes them.

        Raises:
            ConfigError: a ``loss`` that names no convention.
        """
        super().__init__(*args, **kwargs)
        self.hetdp_options = {"allocation": allocation, "sync": sync, "step_timeout_s": step_timeout_s,
                              "metrics": metrics, "loss": check_loss(loss)}
        self.hetdp_model: DistributedDataParallel | None = None
        """The model wrapped in ``hetdp.DDP`` by ``prepare``: its shares, epoch reports and diagnosis."""

    @property
    def wraps_in_ddp(self) -> bool:
        """Whether Accelerate would wrap models in torch's DDP (multi-GPU, multi-CPU and the like)."""
        tensor_parallel = self.parallelism_config is not None and self.parallelism_config.tp_enabled
        return self.distributed_type == DistributedType.MULTI_CPU or (self.multi_device and not tensor_parallel)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Prepare as Accelerate does (placement, mixed precision), then wrap in ``hetdp.DDP`` where Accelerate
        would wrap in torch's DDP."""
        if evaluation_mode or getattr(model, "_is_accelerate_prepared", False) or not self.wraps_in_ddp:
            if self.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU) and not self.multi_device:
                raise ConfigError(f"hetdp's Accelerator trains data-parallel runs (multi-GPU or multi-CPU), not "
                                  f"{self.distributed_type.value}")
            return super().prepare_model(model, device_placement, evaluation_mode)
        prepared = super().prepare_model(model, device_placement, evaluation_mode=True)  # everything but the wrap
        if not any(p.requires_grad for p in prepared.parameters()):
            return prepared
        if self.hetdp_model is not None:
            raise ConfigError("hetdp's Accelerator trains one model: its shares size every step of its loader")
        handler = self.ddp_handler
        if handler is not None and handler.comm_hook != DDPCommunicationHookType.NO:
            raise ConfigError(f"hetdp.DDP combines gradients by the ranks' shares in a comm hook of its own, "
                              f"so it cannot take the comm hook {handler.comm_hook.value!r}")
        device_ids = None if self.device.type == "cpu" else [self.local_process_index]
        wrapped = DistributedDataParallel(prepared, **self.hetdp_options, device_ids=device_ids,
                                          **(handler.to_kwargs() if handler is not None else {}))
        wrapped._is_accelerate_prepared = True
        self._models[self._models.index(prepared)] = wrapped
        self.hetdp_model = wrapped
        return wrapped

    def end_training(self) -> None:
        """Release the hetdp model's process group, then end as Accelerate does."""
        if self.hetdp_model is not None:
            self.hetdp_model.close()
        super().end_training()

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """Re-cut a loader that shuffles (a training loader) by the shares; leave any other to Accelerate."""
        if not self.wraps_in_ddp or not _shuffles(data_loader):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        placement = self.device_placement if device_placement is None else device_placement
        return AllocatedDataLoader(self, data_loader, self.device if placement else None)


def _shuffles(loader: DataLoader) -> bool:
    """Whether ``loader`` draws a new order each epoch, as training loaders do and evaluation loaders do not."""
    sampler = loader.sampler if loader.batch_size is not None else getattr(loader.batch_sampler, "sampler", None)
    return isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)


_END = object()


class AllocatedDataLoader(DataLoaderStateMixin):
    """A training loader re-cut by the shares of ``accelerator.hetdp_model``, iterated as Accelerate's own.

    It is bound to the model at its first use, so ``prepare`` may take the loader
    before the model. Each step opens as its batch is handed to the loop and closes
    when the loop asks for the next (after its optimizer step); the batch after it
    is fetched first, so that ``accumulate`` knows the epoch's last batch.
    """

    def __init__(self, accelerator: Accelerator, loader: DataLoader, device: torch.device | None) -> None:
        self.gradient_state = GradientState()
        self.accelerator = accelerator
        self.original = loader
        self.device = device
        self.iteration = 0
        """The epoch the next iteration runs (Accelerate's name): each iteration draws its own order."""
        self._drop_last = loader.drop_last
        self._loop: LoopLoader | None = None
        self.opens_steps = True
        """Whether iterating opens and closes the model's steps; False: the loop's hooks do (transformers' Trainer
        fetches all the batches of an optimizer step before training the first)."""

    @property
    def loop(self) -> LoopLoader:
        if self._loop is None:
            model = self.accelerator.hetdp_model
            if model is None:
                raise ConfigError("a training loader re-cut by hetdp needs its model: pass the model to the same "
                                  "accelerator.prepare (or an earlier one)")
            self._loop = LoopLoader(model.allocate(self.original))
        return self._loop

    @property
    def sampler(self) -> Any:
        return self.loop.sampler

    @property
    def dataset(self) -> Any:
        return self.original.dataset

    def __len__(self) -> int:
        if self._loop is None and self.original.batch_size is not None:  # before the model is prepared
            global_batch = self.original.batch_size * self.accelerator.num_processes
            full, partial = divmod(len(self.original.dataset), global_batch)
            return full + int(bool(partial) and not self._drop_last)
        return len(self.loop)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["original"], name)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order (Accelerate's loaders advance it by themselves at each iteration)."""
        self.iteration = epoch
        self.loop.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        loop = self.loop
        self.set_epoch(self.iteration)
        self.begin()
        try:
            if not self.opens_steps:
                for batch in loop:
                    yield batch if self.device is None else send_to_device(batch, self.device)
                self.iteration += 1
                return
            batches = iter(loop)
            current = next(batches, _END)
            while current is not _END:
                following = next(batches, _END)
                self.end_of_dataloader = following is _END
                loop.begin_batch()
                yield current if self.device is None else send_to_device(current, self.device)
                loop.end_batch()
                current = following
            loop.end_epoch()
            self.iteration += 1
        finally:
            self.end()
