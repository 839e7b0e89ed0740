"""`hetdp bench gpu` without a GPU says so in one line and exits 2; its table from figures as the workers write them."""

import pytest
import torch

from hetdp.bench import gpu
from hetdp.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the benchmark would run")
def test_without_a_gpu_the_benchmark_says_so_in_one_line_and_exits_2(capsys):
    assert main(["bench", "gpu", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a CUDA GPU" in err


def test_the_table_gives_the_overhead_and_every_pairing_against_the_gpu_alone():
    overhead = {"torch_ddp": [9.0, 1.0, 1.0], "hetdp": [9.0, 1.02, 1.02], "device": "NVIDIA H200"}
    runs = {pairing: {"epoch_s": [5.0, 2.0, 2.0], "shares": [500, 4, 4, 4], "sat_out": []}
            for pairing in gpu.PAIRINGS}
    mixed = {"runs": {name: {**runs, "gpu_alone": {"epoch_s": [3.0, 1.0, 1.0]}} for name in gpu.MODELS},
             "parameters": {name: 1000 for name in gpu.MODELS}}
    paths = {"gloo": {"devices": ["cuda", "cpu", "cpu", "cpu"], "runs": {"allreduce": {"ok": True},
                                                                         "solo": {"ok": False}}}}
    result = gpu.summarize(overhead, mixed, paths)
    assert result["overhead"]["overhead"] == pytest.approx(0.02)
    figures = result["mixed"]["mlp (communication-heavy)"]
    assert figures["adaptive"]["vs_gpu_alone"] == 0.5 and figures["gpu_alone_epoch_s"] == 1.0
    text = gpu.render(result)
    assert "NVIDIA H200" in text and "overhead +2.0%" in text and "GPU alone s" in text
    assert "adaptive vs alone" in text and "0.5" in text
    assert "paths checked on devices cuda,cpu,cpu,cpu over gloo: allreduce ok; solo FAILED" in text


def test_the_resnet_is_resnet_18_at_cifar_size():
    model = gpu.resnet18()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(11.17e6, rel=0.01)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
