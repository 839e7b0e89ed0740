"""A small transformers Trainer run, adopted by hetdp: tests/unit/adoption/plain_transformers.py with its ``Trainer``
imported from hetdp.

The run is transformers': a small GPT-2 built from its config on sequences of unequal lengths (the Trainer divides
the loss by the step's token count across devices), accumulation, clipping, a linear schedule with warm-up. hetdp's
``Trainer`` wraps the model in ``hetdp.DDP`` and re-cuts the training loader so that each rank's batch is its share
of the step, sized to its measured speed, and counts the token normalization once.

    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 examples/adopt_transformers.py --epochs 3
    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 --allocation equal examples/adopt_transformers.py  # DDP's split
    torchrun --nproc-per-node 4 examples/adopt_transformers.py                                            # real devices
"""

import argparse
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from hetdp.integrations.transformers import Trainer


class Sequences(Dataset):
    """Token sequences of 8 to 32 tokens, padded to 32; each continues a pattern the model can learn."""

    def __init__(self, size: int, length: int = 32, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, vocab, (size, 1), generator=g), torch.randint(1, 4, (size, 1), generator=g)
        self.ids = (start + stride * torch.arange(length)) % vocab
        self.mask = (torch.arange(length) < torch.randint(8, length + 1, (size, 1), generator=g)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--size", type=int, default=4099)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch_size, num_train_epochs=args.epochs,
        gradient_accumulation_steps=args.accumulate, learning_rate=3e-3, warmup_steps=10, max_grad_norm=1.0,
        use_cpu=not cuda, bf16=cuda, logging_steps=20, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Sequences(args.size))
    started = time.perf_counter()
    result = trainer.train()
    if trainer.is_world_process_zero():
        print(f"trained {args.epochs} epochs in {time.perf_counter() - started:.2f} s, loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
