"""PyTorch Lightning: ``Trainer(strategy="hetdp")`` trains with ``hetdp.DDP`` and re-cuts only the training loader;
``HetdpShardedStrategy``, Lightning's FSDP2 path (``ModelParallelStrategy``), with the sharded drop-in.

Importing this module registers the strategy names ``"hetdp"`` and ``"hetdp_fsdp"``; ``HetdpStrategy(allocation=...,
sync=..., loss=...)`` and ``HetdpShardedStrategy(allocation=..., loss=...)`` take the drop-ins' settings. Launch with
torchrun or ``hetdp run``, whose emulation reaches them with no code.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from hetdp.allocate.policy import AllocationPolicy
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError
from hetdp.figures.metrics import EpochReport, MetricsConfig
from hetdp.floor import check_framework
from hetdp.fsdp.dropin import DropInSettings, ShardedDropIn
from hetdp.integrations.steps import LoopLoader
from hetdp.sync.base import LossConvention, check_loss
from hetdp.sync.policy import SyncPolicy

try:
    import lightning.pytorch as pl

    check_framework("lightning", pl.__version__, user="hetdp.integrations.lightning")
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ConfigError("hetdp.integrations.lightning needs PyTorch Lightning: pip install 'hetdp[lightning]'") from error

log = logging.getLogger(__name__)


class _SampleMeans:
    """A strategy's ``reduce`` that takes the mean of integers as a float: ``self.log``'s epoch means divide by the mean
    of the ranks' sample counts, which unequal shares make fractional (DDP would floor it: 50 samples on 4 ranks read
    as 12 a rank, and the mean loss came out 4% high)."""

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        mean = reduce_op is not None and str(reduce_op).lower().rsplit(".", 1)[-1] in ("mean", "avg")
        if isinstance(tensor, torch.Tensor) and mean and not tensor.is_floating_point():
            tensor = tensor.double()
        return super().reduce(tensor, group, reduce_op)  # type: ignore[misc]


class HetdpStrategy(_SampleMeans, DDPStrategy):
    """Lightning's DDP strategy, with ``hetdp.DDP`` in place of torch's: rank i trains ``shares[i]`` of every step.

    The model is wrapped in ``hetdp.DDP(allocation, sync)``; the training loader
    (with the ``DistributedSampler`` Lightning injected) is re-cut by
    ``model.allocate``, the same number of batches on every rank, so
    ``estimated_stepping_batches`` and the schedules it sizes are those of
    ``strategy="ddp"``; validation, sanity-check, test and predict loaders are left
    as Lightning made them. Accumulation (``no_sync``), clipping and precision
    plugins are Lightning's own. Each epoch's figures reach Lightning's loggers as
    ``hetdp/...`` metrics, its diagnosis the ``hetdp`` logger.

    Lightning's checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``) hold
    ``model.hetdp_state_dict()`` under ``"hetdp"``: the allocation and the position in
    the epoch. ``trainer.fit(..., ckpt_path=...)`` restores it once the training loader
    is re-cut, and a checkpoint taken inside an epoch continues that epoch at the
    step after the one saved, as an uninterrupted run would. hetdp's own step
    checkpoints (``model.checkpointer``) are refused: they hold none of Lightning's
    loop state.

    Warning:
        Every rank must run the same Trainer settings: each step is collective.
        A ``training_step`` that takes ``dataloader_iter`` is not supported (the
        steps pair with the batches Lightning fetches, one per ``training_step``).

    Examples:
        >>> # on every rank, launched with `hetdp run -n 4 --speeds 1,1,2,4 train.py` or torchrun
        >>> import hetdp.integrations.lightning                     # registers strategy="hetdp"
        >>> trainer = L.Trainer(strategy="hetdp", devices=4, max_epochs=3)   # was: strategy="ddp"
        >>> trainer.fit(model, train_loader, val_loader)            # rank i: shares[i] of 32 x 4 samples a step
    """

    strategy_name = "hetdp"

    def __init__(self, allocation: str | AllocationPolicy | None = None, sync: str | SyncPolicy | None = None, *,
                 step_timeout_s: float = 60.0, metrics: MetricsConfig | None = None, loss: LossConvention = "mean",
                 **kwargs: Any) -> None:
        """Args: ``allocation``, ``sync``, ``step_timeout_s``, ``metrics`` and ``loss`` as ``hetdp.DDP`` takes them
        (None: ``hetdp run``'s ``--allocation`` / ``--sync``, else adaptive and allreduce; ``loss``: what
        ``training_step``'s loss is, ``"mean"`` over the rank's batch by default, ``"sum"`` or ``"global_mean"``, so
        that unequal shares give plain DDP's update at equal shares); ``kwargs`` as ``DDPStrategy`` takes them (its
        DDP options go to ``hetdp.DDP``).

        Raises:
            ConfigError: a ``loss`` that names no convention.
        """
        super().__init__(**kwargs)
        self.allocation = allocation
        self.sync = sync
        self.step_timeout_s = step_timeout_s
        self.metrics = metrics
        self.loss = check_loss(loss)
        self.loader: _ResumableLoader | None = None
        """The training loader as re-cut, once Lightning asked for it."""
        self._resumed: dict[str, Any] | None = None
        """hetdp's state in the checkpoint a fit resumes from, until the training loader is re-cut."""

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        stream = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else contextlib.nullcontext()
        with stream:  # as DDPStrategy does
            return _LightningDDP(model, self.allocation, self.sync, step_timeout_s=self.step_timeout_s,
                                 metrics=self.metrics, loss=self.loss, device_ids=device_ids, **self._ddp_kwargs)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and not any(isinstance(c, _Steps) for c in trainer.callbacks):
            # First: a step closes before any other callback's on_train_batch_end, so that a ModelCheckpoint saving
            # there (Lightning puts it last) records the step as done, as its loop state does.
            trainer.callbacks.insert(0, _Steps(self))

    def process_dataloader(self, dataloader: object) -> object:
        """Re-cut the training loader by the shares; leave every other loader as it is."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (trainer is None or trainer.state.stage != RunningStage.TRAINING
                or not isinstance(self.model, DistributedDataParallel)):
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise ConfigError(f"strategy='hetdp' re-cuts a torch DataLoader, got a {type(dataloader).__name__} "
                              "as the training loader")
        self.loader = _ResumableLoader(self.model.allocate(dataloader))
        if self._resumed is not None:
            self.model.load_hetdp_state_dict(self._resumed)  # the shares, steps done and where the epoch continues
            self._resumed = None
        return self.loader

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's parameters, after the ranks met (collective, as Lightning's checkpointing is): under partial
        or local synchronization the replicas may differ between meetings, and rank 0's would be saved alone."""
        if isinstance(self.model, DistributedDataParallel):
            self.model.synchronize()
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
                        ) -> None:
        """Save Lightning's checkpoint with ``model.hetdp_state_dict()`` under ``"hetdp"`` (every rank calls it)."""
        if self.loader is not None:
            checkpoint = {**checkpoint, "hetdp": self.loader.model.hetdp_state_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint; keep hetdp's state in it for the fit that resumes from it."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._resumed = checkpoint.get("hetdp")
            if self._resumed is None:
                log.warning("%s holds no hetdp state (saved under another strategy): the shares start afresh, and "
                            "an epoch it saved inside starts over at its first batch", checkpoint_path)
        return checkpoint

    def teardown(self) -> None:
        model = self.model
        super().teardown()
        if isinstance(model, DistributedDataParallel):
            model.close()
        self._resumed = None


class HetdpShardedStrategy(_SampleMeans, ModelParallelStrategy):
    """Lightning's FSDP2 strategy (``ModelParallelStrategy``: ``fully_shard`` applied in ``configure_model``) with the
    sharded drop-in over the module's units: rank i trains ``shares[i]`` samples of every step, exactly.

    Data parallel over every rank (``tensor_parallel_size=1``, the default here). Once Lightning has set the module
    up, the drop-in installs its weighed and timed collectives on every FSDP2 unit under it (sharded by torch's
    ``fully_shard`` or hetdp's); the training loader is re-cut by ``allocate``, the same number of batches on every
    rank; validation and the other loaders are left as Lightning made them. Clipping (``gradient_clip_val``) and
    precision plugins are Lightning's own. Lightning's Trainer reduce-scatters every batch it accumulates
    (``accumulate_grad_batches``): each is a step of the drop-in, weighed by its own shares. Each epoch's figures
    reach Lightning's loggers as ``hetdp/...`` metrics.

    Lightning's checkpoints (sharded, as ``ModelParallelStrategy`` writes them: a folder every rank writes into) hold
    none of hetdp's allocation: a fit resumed with ``ckpt_path`` starts the shares afresh. The position in the epoch is
    kept, in Lightning's loop state, by the re-cut loader (as under ``strategy="hetdp"``); a resume inside an epoch
    has not been tested under this strategy.

    Warning:
        Every rank must run the same Trainer settings: each step is collective, and every rank joins every unit's
        collectives.

    Examples:
        >>> # on every rank, launched with `hetdp run -n 4 --speeds 1,1,2,4 train.py` or torchrun
        >>> import hetdp.integrations.lightning
        >>> trainer = L.Trainer(strategy="hetdp_fsdp", devices=4)   # was: ModelParallelStrategy(data_parallel_size=4,
        >>> trainer.fit(model, train_loader)                       #                           tensor_parallel_size=1)
    """

    strategy_name = "hetdp_fsdp"

    def __init__(self, allocation: str | AllocationPolicy | None = None, *, step_timeout_s: float = 60.0,
                 metrics: MetricsConfig | None = None, loss: LossConvention = "mean", **kwargs: Any) -> None:
        """Args: ``allocation``, ``step_timeout_s``, ``metrics`` and ``loss`` as ``hetdp.fully_shard`` takes them
        (``loss``: what ``training_step``'s loss is, ``"mean"`` over the rank's batch by default, ``"sum"`` or
        ``"global_mean"``, so that unequal shares give FSDP2's update at equal shares); ``kwargs`` as
        ``ModelParallelStrategy`` takes them (``data_parallel_size`` defaults to every rank, ``tensor_parallel_size``
        to 1: the drop-in shards over every rank).

        Raises:
            ConfigError: a ``loss`` that names no convention, a ``step_timeout_s`` that is not positive.
        """
        kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(**kwargs)
        self.settings = DropInSettings(allocation=allocation, step_timeout_s=step_timeout_s, metrics=metrics,
                                       loss=loss)
        self.drop_in: ShardedDropIn | None = None
        self.loader: _ResumableLoader | None = None
        """The training loader as re-cut, once Lightning asked for it."""

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_processes * self.num_nodes
        if self._tensor_parallel_size != 1:
            raise ConfigError(f"strategy='hetdp_fsdp' shards over every rank: tensor_parallel_size must be 1, got "
                              f"{self._tensor_parallel_size!r}")
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.drop_in is None:
            module = self.lightning_module
            units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
            self.drop_in = ShardedDropIn(module, units, self.settings)
            if not any(isinstance(c, _Steps) for c in trainer.callbacks):
                trainer.callbacks.insert(0, _Steps(self))

    def process_dataloader(self, dataloader: object) -> object:
        """Re-cut the training loader by the shares; leave every other loader as it is."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or self.drop_in is None:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise ConfigError(f"strategy='hetdp_fsdp' re-cuts a torch DataLoader, got a {type(dataloader).__name__} "
                              "as the training loader")
        self.loader = _ResumableLoader(self.drop_in.allocate(dataloader))
        return self.loader

    def teardown(self) -> None:
        if self.drop_in is not None:
            self.drop_in.close()
            self.drop_in = None
        super().teardown()


class _LightningDDP(DistributedDataParallel):
    """``hetdp.DDP`` as the strategy wraps the LightningModule: hetdp's step checkpoints are refused."""

    def checkpointer(self, *args: Any, **kwargs: Any) -> Any:
        """Refuse: a step checkpoint holds the module, optimizer and hetdp's position, but none of Lightning's loop
        state (epoch and step counters, schedulers' configuration, callbacks), so a resumed Trainer would restart
        its loops at epoch 0 while the data continued elsewhere."""
        raise ConfigError("hetdp's step checkpoints (model.checkpointer) do not hold Lightning's loop state: under "
                          "strategy='hetdp' use Lightning's ModelCheckpoint(every_n_train_steps=K) or "
                          "trainer.save_checkpoint, and trainer.fit(..., ckpt_path=...) to resume (they hold hetdp's "
                          "allocation and position too)")


class _ResumableLoader(LoopLoader):
    """The re-cut training loader as Lightning sees it: resumable in Lightning's sense (``state_dict`` /
    ``load_state_dict``), so that a fit restarted inside an epoch continues its order at the saved step."""

    def __len__(self) -> int:
        # The whole epoch's batches, those a resumed epoch skips included: Lightning counts a resumed epoch's batches
        # from the number it had done (its fetcher and loop progress start there).
        return self.allocated.sampler.steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch continues: (epoch, steps of it done); kept with Lightning's fit loop state."""
        return {"position": list(self.model.hetdp_state_dict()["position"])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the epoch at the saved step (Lightning restores this when it restarts inside an epoch)."""
        self.allocated.sampler.resume_at(*state["position"])


class _Steps(Callback):
    """Opens a step before each training batch, closes it after its optimizer step, and the epoch after its last;
    sends each epoch's figures to Lightning's loggers."""

    def __init__(self, strategy: HetdpStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.strategy.loader is None:
            return
        ticket = self.strategy.loader.begin_batch()
        if ticket.samples == 0 and trainer._results is not None:
            # self.log weighs epoch means by the batch's size: a stand-in batch (weighted 0 in the gradient)
            # counts for nothing there either.
            trainer._results.batch_size = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.strategy.loader is not None:
            self.strategy.loader.end_batch()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = self.strategy.loader.end_epoch() if self.strategy.loader is not None else None
        if report is not None:
            pl_module.log_dict(_figures(report), on_step=False, on_epoch=True, sync_dist=True)  # equal on all ranks
            if trainer.is_global_zero:
                log.info("epoch %d: shares %s; %s", report.epoch, report.shares, report.diagnosis())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.strategy.loader is not None:
            self.strategy.loader.end_epoch()  # a run stopped inside an epoch (max_steps)


def _figures(report: EpochReport) -> dict[str, float]:
    """An epoch's figures as Lightning metrics (identical on every rank)."""
    figures = {"hetdp/epoch_s": report.epoch_s}
    for rank, (share, compute, wait) in enumerate(zip(report.shares, report.compute_s, report.wait_s)):
        figures |= {f"hetdp/share_{rank}": float(share), f"hetdp/compute_s_{rank}": compute,
                    f"hetdp/wait_s_{rank}": wait}
    return figures


if HetdpStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(HetdpStrategy.strategy_name, HetdpStrategy,
                              description="hetdp.DDP: ranks train unequal shares of every step, sized by speed")
if HetdpShardedStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(HetdpShardedStrategy.strategy_name, HetdpShardedStrategy,
                              description="hetdp.fully_shard over Lightning's FSDP2 path: unequal shares, sharded")
