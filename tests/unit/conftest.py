"""Fixtures shared by unit tests."""

import datetime
import socket

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank():
    """A default group of world size 1, made without torchrun, for code that needs torch.distributed even alone."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()
