"""`hetdp run` launches a user's script on N ranks with the emulation reaching every rank."""

import math
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from hetdp.bench.datasets import load_digits
from hetdp.bench.models import ConvNet

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from torch_order import global_batches  # noqa: E402

EXAMPLES = Path(__file__).parents[2] / "examples"
EXAMPLE = EXAMPLES / "allocation_train.py"
SAMPLES = 384
"""The example trains on its first 384 digits: 6 steps an epoch."""
RESUME_ATOL = 1e-5
"""The resumed example against one process: 12 steps of SGD with momentum whose sums ran in another order (unequal
shares, micro-batches of 16) than one process's."""


def one_process(epochs: int, momentum_lost_at: int | None = None) -> dict[str, torch.Tensor]:
    """The example's model and recipe trained by one process on the global batches of torch's
    ``DistributedSampler(seed=0)`` over the first ``SAMPLES`` (32 samples a rank, 2 ranks), the mean loss over each;
    ``momentum_lost_at``: the optimizer's state dropped at that epoch's start (what a resume without it gives)."""
    train = load_digits().train
    torch.manual_seed(0)
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images, labels = (tensor[:SAMPLES] for tensor in train.tensors)
    for epoch in range(epochs):
        if epoch == momentum_lost_at:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for index in global_batches(SAMPLES, 64, seed=0, epoch=epoch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images[index]), labels[index]).backward()
            optimizer.step()
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_hetdp_run_trains_the_example_and_resumes_from_its_checkpoint_as_one_process(tmp_path, hetdp_run):
    checkpoint = tmp_path / "checkpoints"
    command = ["-n", "2", "--speeds", "1,3", "--sample-cost-ms", "1", EXAMPLE, "--epochs", "1",
               "--samples", SAMPLES, "--checkpoint", checkpoint]
    first = hetdp_run(*command)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "epoch 0: shares" in first.stdout and any(checkpoint.glob("step-*.pt"))
    command[command.index("--epochs") + 1] = "2"
    second = hetdp_run(*command)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "epoch 0:" not in second.stdout and "epoch 1: shares" in second.stdout
    # The last checkpoint, saved at the second epoch's end, holds the model the resumed run ended with.
    trained = torch.load(max(checkpoint.glob("step-*.pt")), weights_only=True)["module"]
    expected, momentum_lost = one_process(2), one_process(2, momentum_lost_at=1)
    wrong = max((momentum_lost[name] - tensor).abs().max().item() for name, tensor in expected.items())
    assert RESUME_ATOL < wrong / 100, wrong  # the bound tells a resume without the optimizer's state apart
    for name, tensor in expected.items():
        torch.testing.assert_close(trained[name], tensor, rtol=0, atol=RESUME_ATOL, msg=name)


PLAIN_DDP_SCRIPT = """
import torch
import torch._dynamo  # before the group: imported later, it keeps gloo alive into exit (see hetdp.runtime)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(2, 1))
data = TensorDataset(torch.randn(32, 2))
with torch.no_grad():
    for (x,) in DataLoader(data, batch_size=4, sampler=DistributedSampler(data)):
        model(x)
dist.barrier()
dist.destroy_process_group()
"""

DROPPED_ALLOCATE_SCRIPT = """
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp

hetdp.init_distributed()
data = TensorDataset(torch.randn(32, 2))
loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
with hetdp.DDP(torch.nn.Linear(2, 1)) as model:
    {allocate}
    for (x,) in loader:
        model(x).sum().backward()
"""


def run_script(hetdp_run, tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(body)
    return hetdp_run("-n", 2, "--speeds", "1,2", "--sync", "allreduce", script)


def test_emulation_under_a_plain_torch_ddp_script_warns_once_that_it_did_nothing(tmp_path, hetdp_run):
    completed = run_script(hetdp_run, tmp_path, PLAIN_DDP_SCRIPT)
    assert completed.returncode == 0, completed.stderr
    unused = [line for line in completed.stderr.splitlines() if "did nothing" in line]
    assert len(unused) == 1 and "emulation and --sync" in unused[0] and "plain torch DDP" in unused[0]


def test_an_allocated_loader_left_unused_warns_once_what_the_model_does_instead(tmp_path, hetdp_run):
    body = DROPPED_ALLOCATE_SCRIPT.replace("{allocate}", "model.allocate(loader)")
    completed = run_script(hetdp_run, tmp_path, body)
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.count("hetdp.DDP: a training forward outside any step") == 1  # rank 0's, once
    assert "averages the ranks' gradients as plain DDP does" in completed.stderr
    assert len([line for line in completed.stderr.splitlines() if "did nothing" in line]) == 1


def test_the_adopted_ddp_script_warns_of_nothing_and_prints_its_shares_and_straggler(hetdp_run):
    # The README's example, its allocated loader in use, on ranks of speeds 1 and 3: the shares (64 a step, 32 a
    # rank's batch) go to the fast rank, and the first epoch, begun at equal shares, names the slow rank 0.
    completed = hetdp_run("-n", 2, "--speeds", "1,3", "--sample-cost-ms", 4, "--sync", "allreduce",
                          EXAMPLES / "adopt_ddp.py", "--size", 512, "--epochs", 2)
    assert completed.returncode == 0, completed.stderr
    assert "did nothing" not in completed.stderr and "outside any step" not in completed.stderr
    lines = completed.stdout.strip().splitlines()
    assert len(lines) == 5, completed.stdout
    for epoch, line in enumerate(lines[0:4:2]):
        found = re.fullmatch(rf"epoch {epoch}: loss (\d+\.\d{{4}}), shares \[(\d+), (\d+)\]", line)
        assert found and math.isfinite(float(found.group(1))), line
        slow, fast = int(found.group(2)), int(found.group(3))
        assert slow + fast == 64 and slow < fast, line
    assert lines[1].startswith("rank 0 is the straggler, by compute: "), lines[1]
    assert re.fullmatch(r"trained 2 epochs in \d+\.\d\d s", lines[4]), lines[4]
