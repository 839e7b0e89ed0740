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
    with socket.socket() as holder:  # bound until the store binds beside it (SO_REUSEADDR): no one else takes it
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{holder.getsockname()[1]}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()
