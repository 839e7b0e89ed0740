"""A typical FSDP2 training script adopted by hetdp's sharded drop-in: a small causal transformer LM, `fully_shard` on
every block and on the root, AdamW with a OneCycle schedule, a DistributedSampler loader, gradient clipping on the
sharded parameters, and a sharded checkpoint through torch.distributed.checkpoint (DCP).

    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 examples/adopt_fsdp2.py --epochs 2
    torchrun --nproc-per-node 4 examples/adopt_fsdp2.py --epochs 2          # real devices: nothing emulated

Against the script before hetdp (tests/unit/adoption/plain_fsdp2.py), the import, `model.allocate(loader)` and the
printed diagnosis changed: rank i now trains shares[i] samples of every step, sized by its speed and memory, and the
gradient is still exactly the mean over the step's samples."""
import argparse
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from hetdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, width=64, heads=4, layers=4, context=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens) + self.position[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def sequences(n, context=32, vocab=64, seed=0):
    """Arithmetic progressions modulo the vocabulary, each with its own start and stride: learnable in context."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return TensorDataset((start + stride * torch.arange(context + 1)) % vocab)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--checkpoint", default="")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = TinyLM().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    dataset = sequences(args.samples)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    loader = model.allocate(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=args.epochs * len(loader))

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for (tokens,) in loader:
            tokens = tokens.to(device)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}; {model.last_epoch.diagnosis()}", flush=True)
    if rank == 0:
        print(f"trained in {time.perf_counter() - start:.2f} s", flush=True)

    if args.checkpoint:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=args.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
