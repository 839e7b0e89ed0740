"""Worker for tests/distributed/test_integrations.py: Lightning's Trainer with strategy="hetdp", the scenarios given
one after another in each process (one launch, one import of Lightning, for several scenarios).

"exact": unequal static shares, AdamW with a OneCycle schedule sized by ``estimated_stepping_batches``, clipping and
two batches accumulated per optimizer step on the Trainer, ``self.log`` epoch means, a validation loader, and a
last step of 2 samples for 4 ranks; then the same fit under ``precision="bf16-mixed"``. "interrupted": that fit
with an optimizer step per batch, stopped after its fifth (the second epoch's first), where a ``ModelCheckpoint``
saved; "resumed": a new launch that resumes it with ``ckpt_path``; "local": the interrupted fit under local SGD
(replicas apart until the epoch ends), each rank comparing its parameters with the checkpoint. "emulated": adaptive
shares under ``hetdp run``'s emulation (the environment), saved after the fit and resumed for a second epoch.
"sharded": Lightning's FSDP2 path (``fully_shard`` in ``configure_model``) under ``strategy="hetdp_fsdp"`` at unequal
static shares, with clipping, against one process (tests/distributed/test_sharded.py's reference). "sum" and
"sharded_sum": a summed loss (``loss="sum"``) at unequal static shares through each strategy, SGD. Rank 0 (or every
rank) saves what the test checks.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from dropin_worker import Pairs, make_model
from loops_worker import LR_SUM
from sharded_worker import BATCH, SEED, full_state, loss_of, make_optimizer, sequences
from sharded_worker import make_model as make_language_model
from torch import nn
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

import hetdp
from hetdp.errors import ConfigError
from hetdp.integrations.lightning import HetdpShardedStrategy, HetdpStrategy


class Classifier(L.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net = make_model(7 + int(os.environ["RANK"]))  # hetdp.DDP starts every rank from rank 0's parameters
        self.kind = kind
        self.val_batches: list[int] = []
        self.refused = ""
        self.checked_at: int | None = None
        """A global step after which this rank compares its parameters with the checkpoint saved there."""
        self.saved_gap: float | None = None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.cross_entropy(self.net(batch["x"]), batch["y"])
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_batches.append(len(batch["x"]))

    def on_train_start(self) -> None:
        try:  # hetdp's step checkpoints, which hold none of Lightning's loop state
            self.trainer.strategy.model.checkpointer("unused", self.trainer.optimizers[0], every=1)
        except ConfigError as error:
            self.refused = str(error)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # After every callback's, the ModelCheckpoint's save included (Lightning runs the module's hook last).
        if self.checked_at is not None and self.trainer.global_step == self.checked_at:
            saved = torch.load(self.trainer.checkpoint_callback.best_model_path, weights_only=False)["state_dict"]
            self.saved_gap = max((saved[name] - value).abs().max().item() for name, value in self.state_dict().items())

    def on_train_end(self) -> None:
        # Kept outside the module's attributes (a submodule wrapping its parent would make a cycle), before teardown
        # unwraps it.
        self.__dict__["hetdp"] = self.trainer.strategy.model

    def configure_optimizers(self):
        if self.kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.3)
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.05, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Sharded(L.LightningModule):
    """The sharded tests' language model, sharded by torch's fully_shard where Lightning expects it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_language_model()

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_of(self.net, batch[0])

    def configure_optimizers(self):
        return make_optimizer(self.net, "adamw")


class SummedLoss(L.LightningModule):
    """``make_model``'s classifier whose loss is the sum over the rank's batch (``loss="sum"``), SGD; ``sharded``: its
    layers and itself sharded by torch's ``fully_shard`` where Lightning expects it."""

    def __init__(self, sharded: bool) -> None:
        super().__init__()
        self.net = make_model(7 + (0 if sharded else int(os.environ["RANK"])))  # FSDP2 shards what each rank holds
        self.sharded = sharded

    def configure_model(self) -> None:
        if self.sharded:
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch["x"]), batch["y"], reduction="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR_SUM)


def fit_summed(sharded: bool) -> tuple[L.Trainer, SummedLoss]:
    """2 epochs of 50 samples, 4 a rank, in the order of a ``DistributedSampler`` seeded 3; static shares 1:2:3:2."""
    allocation = hetdp.Static((1.0, 2.0, 3.0, 2.0))
    strategy = (HetdpShardedStrategy(allocation, loss="sum") if sharded else HetdpStrategy(allocation, loss="sum"))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_epochs=2,
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    data = Pairs(50)
    sampler = DistributedSampler(data, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                                 seed=3)
    model = SummedLoss(sharded)
    trainer.fit(model, DataLoader(data, batch_size=4, sampler=sampler))
    return trainer, model


class StopAfter(Callback):
    """Stops the fit after its ``steps``-th optimizer step: an interruption, right after a checkpoint."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.steps:
            trainer.should_stop = True


def fit(strategy: HetdpStrategy, kind: str, train: DataLoader, val: DataLoader | None, epochs: int,
        ckpt_path: Path | None = None, checked_at: int | None = None, **options) -> tuple[L.Trainer, Classifier]:
    options = {"enable_checkpointing": False, **options}
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        **options)
    model = Classifier(kind)
    model.checked_at = checked_at
    trainer.fit(model, train, val, ckpt_path=ckpt_path)
    return trainer, model


def fit_exact(workers: int = 0, accumulate: int = 2, sync: str = "allreduce", **options
              ) -> tuple[L.Trainer, Classifier]:
    """The exact scenario's fit: 2 epochs of 4 batches (50 samples, 4 a rank), ``accumulate`` per AdamW step."""
    L.seed_everything(3)  # the seed of Lightning's DistributedSampler: the reference's order
    train = DataLoader(Pairs(50), batch_size=4, shuffle=True, num_workers=workers)
    val = DataLoader(Pairs(40), batch_size=5)
    return fit(HetdpStrategy(hetdp.Static((1.0, 2.0, 3.0, 2.0)), sync), "adamw", train, val, 2,
               gradient_clip_val=0.5, accumulate_grad_batches=accumulate, **options)


def run(scenario: str, out: Path) -> dict:
    if scenario == "exact":
        trainer, model = fit_exact(workers=1)
        if trainer.global_rank == 0:
            torch.save(model.net.state_dict(), out / "lightning_exact.pt")
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        _, bf16 = fit_exact(precision="bf16-mixed")
        if trainer.global_rank == 0:
            torch.save(bf16.net.state_dict(), out / "lightning_bf16.pt")
        return {"bf16_blocks": [f.shares for f in bf16.hetdp.step_figures],
                "blocks": [f.shares for f in model.hetdp.step_figures], "batches": len(trainer.train_dataloader),
                "stepping_batches": trainer.estimated_stepping_batches, "val_batches": model.val_batches,
                "epochs": len(model.hetdp.epoch_reports), "metrics": metrics, "closed": model.hetdp._group is None}
    if scenario == "interrupted":
        saving = ModelCheckpoint(dirpath=out, filename="interrupted", every_n_train_steps=5, save_top_k=-1)
        trainer, model = fit_exact(accumulate=1, enable_checkpointing=True, callbacks=[StopAfter(5), saving])
        return {"blocks": [f.shares for f in model.hetdp.step_figures], "global_step": trainer.global_step}
    if scenario == "local":
        saving = ModelCheckpoint(dirpath=out, filename="local", every_n_train_steps=5, save_top_k=-1)
        _, model = fit_exact(accumulate=1, sync="local", enable_checkpointing=True, checked_at=5,
                             callbacks=[StopAfter(5), saving])
        return {"saved_gap": model.saved_gap}
    if scenario == "resumed":
        saved = torch.load(out / "interrupted.ckpt", weights_only=False)
        trainer, model = fit_exact(accumulate=1, ckpt_path=out / "interrupted.ckpt")
        if trainer.global_rank == 0:
            torch.save(model.net.state_dict(), out / "lightning_resumed.pt")
        return {"blocks": [f.shares for f in model.hetdp.step_figures], "saved": saved["hetdp"]["position"],
                "steps_done": model.hetdp.steps_done, "global_step": trainer.global_step, "refused": model.refused}
    if scenario == "emulated":
        L.seed_everything(0)
        train = DataLoader(Pairs(2560), batch_size=32, shuffle=True)
        trainer, model = fit(HetdpStrategy(), "sgd", train, None, 1)
        report = model.hetdp.epoch_reports[0]
        trainer.save_checkpoint(out / "emulated.ckpt")  # after the fit, as a script saves its model
        _, resumed = fit(HetdpStrategy(), "sgd", train, None, 2, ckpt_path=out / "emulated.ckpt")
        return {"shares": report.shares, "replans": report.replans, "speeds": list(model.hetdp.emulation.speeds),
                "resumed_first": resumed.hetdp.step_figures[0].shares,
                "resumed_epochs": len(resumed.hetdp.epoch_reports)}
    if scenario == "sharded":
        trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                            strategy=HetdpShardedStrategy(hetdp.Static((1.0, 1.0, 2.0, 4.0))), max_epochs=2,
                            gradient_clip_val=0.5, use_distributed_sampler=False, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        model = Sharded()
        dataset = sequences()  # the process group may not exist yet: the sampler is told its place
        sampler = DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                                     seed=SEED)
        trainer.fit(model, DataLoader(dataset, batch_size=BATCH, sampler=sampler))
        drop_in = trainer.strategy.loader.model
        state = full_state(model.net)
        if trainer.global_rank == 0:
            torch.save(state, out / "lightning_sharded.pt")
        return {"blocks": [f.shares for f in drop_in.step_figures], "shares": drop_in.shares,
                "epochs": len(drop_in.epoch_reports), "closed": drop_in._group is None}
    if scenario in ("sum", "sharded_sum"):
        sharded = scenario == "sharded_sum"
        trainer, model = fit_summed(sharded)
        drop_in = trainer.strategy.loader.model
        state = full_state(model.net)
        if trainer.global_rank == 0:
            torch.save(state, out / f"lightning_{scenario}.pt")
        return {"blocks": [f.shares for f in drop_in.step_figures], "epochs": len(drop_in.epoch_reports)}
    raise SystemExit(f"unknown scenario {scenario}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated, run in this order")
    args = parser.parse_args()
    for scenario in args.scenarios.split(","):
        result = run(scenario, args.out)
        (args.out / f"lightning_{scenario}_{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
