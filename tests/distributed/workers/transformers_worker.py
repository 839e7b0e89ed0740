"""Worker for tests/distributed/test_integrations.py: transformers' Trainer from hetdp, the scenarios given one after
another in each process.

"exact": a tiny GPT-2 built from its config (no download) on token sequences of unequal lengths, unequal static
shares, two batches accumulated per optimizer step, clipping, and transformers' loss normalized by the step's
token count across devices; a last step of 2 samples for 4 ranks. "emulated": adaptive shares under ``hetdp run``'s
emulation (the environment).
"""

from __future__ import annotations

import argparse
import os
import json
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import hetdp
from hetdp.integrations.transformers import Trainer

LENGTH, VOCAB = 12, 32


class Tokens(Dataset):
    """Token sequences of 4 to 12 tokens, padded to 12 (padding ignored by the loss: labels -100)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(1, VOCAB, (size, LENGTH), generator=generator)
        lengths = torch.randint(4, LENGTH + 1, (size,), generator=generator)
        self.mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": self.labels[index]}


def make_lm(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def run(scenario: str, out: Path, rank: int) -> dict:
    if scenario == "exact":
        model = make_lm(7 + rank)  # hetdp.DDP starts every rank from rank 0's parameters
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, num_train_epochs=2, max_grad_norm=0.5, use_cpu=True,
                                 ddp_backend="gloo", report_to=[], save_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(50), optimizers=(optimizer, constant),
                          allocation=hetdp.Static((1.0, 2.0, 3.0, 2.0)))
        trainer.train()
        ddp = trainer.hetdp_loader.model
        if rank == 0:
            torch.save(model.state_dict(), out / "transformers_exact.pt")
        return {"blocks": [f.shares for f in ddp.step_figures], "batches": len(trainer.hetdp_loader),
                "updates": trainer.state.global_step, "epochs": len(ddp.epoch_reports), "closed": ddp._group is None,
                "shifts_labels": bool(trainer._loss_shifts_labels), "seed": trainer.hetdp_loader.sampler.seed}
    if scenario == "emulated":
        args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=32, num_train_epochs=1,
                                 learning_rate=1e-3, use_cpu=True, ddp_backend="gloo", report_to=[],
                                 save_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=make_lm(0), args=args, train_dataset=Tokens(2560))
        trainer.train()
        ddp = trainer.hetdp_loader.model
        report = ddp.epoch_reports[0]
        return {"shares": report.shares, "replans": report.replans, "speeds": list(ddp.emulation.speeds)}
    raise SystemExit(f"unknown scenario {scenario}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated, run in this order")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    for scenario in args.scenarios.split(","):
        result = run(scenario, args.out, rank)
        (args.out / f"transformers_{scenario}_{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
