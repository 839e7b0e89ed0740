"""A typical user's PyTorch Lightning script, adopted by hetdp: tests/unit/adoption/plain_lightning.py with 2 lines
changed (an import that registers the strategy, and ``strategy="hetdp"`` for ``strategy="ddp"``).

Everything else is Lightning's: the LightningModule with training and validation steps and ``self.log``,
AdamW with a OneCycle schedule sized by ``estimated_stepping_batches``, clipping and accumulation on the Trainer,
the DistributedSampler Lightning injects. hetdp wraps the model in ``hetdp.DDP`` and re-cuts the training loader
so that each rank's batch is its share of the step, sized to its measured speed; the validation loader is untouched.

    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 examples/adopt_lightning.py --epochs 3
    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 --allocation equal examples/adopt_lightning.py  # DDP's split
    torchrun --nproc-per-node 4 examples/adopt_lightning.py                                              # real devices
"""

import argparse
import os

import hetdp.integrations.lightning  # noqa: F401  (registers strategy="hetdp")
import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Regression(Dataset):
    """y = x @ w + noise, items as dicts."""

    def __init__(self, size: int, features: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=g)
        w = torch.randn(features, 1, generator=torch.Generator().manual_seed(0))
        self.y = self.x @ w + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "target": self.y[i]}


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self.net(batch["features"]), batch["target"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self.net(batch["features"]), batch["target"]), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=1e-2, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--size", type=int, default=4099)
    args = parser.parse_args()

    L.seed_everything(0)
    train = DataLoader(Regression(args.size), batch_size=args.batch_size, shuffle=True, num_workers=1)
    val = DataLoader(Regression(512, seed=1), batch_size=64)
    trainer = L.Trainer(
        accelerator="auto",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy="hetdp",
        max_epochs=args.epochs,
        gradient_clip_val=1.0,
        accumulate_grad_batches=args.accumulate,
        precision="bf16-mixed" if torch.cuda.is_available() else "32-true",
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(Model(), train, val)
    if trainer.is_global_zero:
        print(f"val_loss {trainer.callback_metrics['val_loss']:.4f}", flush=True)


if __name__ == "__main__":
    main()
