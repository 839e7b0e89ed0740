"""The declared torch floor is the one the code needs, and an older torch fails at import in one line."""

import tomllib
from pathlib import Path

import pytest
import torch.distributed as dist

from hetdp.floor import TORCH_FLOOR, check_torch


@pytest.mark.parametrize("version", ["2.2.0", "2.5.1+cu121", "1.13.1"])
def test_an_older_torch_fails_at_import_in_one_line_naming_the_floor(version):
    with pytest.raises(ImportError, match=r"hetdp needs torch >= 2\.6") as raised:
        check_torch(version)
    assert "\n" not in str(raised.value) and version in str(raised.value)


@pytest.mark.parametrize("version", ["2.6.0", "2.13.0+cpu", "2.7.0a0+git123"])
def test_the_floor_and_newer_torches_import(version):
    check_torch(version)


def test_pyproject_declares_the_floor_the_code_checks():
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert f"torch>={TORCH_FLOOR}" in project["dependencies"]


def test_the_running_torch_has_what_the_floor_stands_for():
    import inspect

    assert "group_src" in inspect.signature(dist.broadcast_object_list).parameters


def test_the_sharded_path_refuses_a_torch_without_the_fsdp2_methods_it_calls(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from hetdp.errors import ConfigError
    from hetdp.floor import SHARDED_FLOOR, check_sharded

    check_sharded()  # the running torch has them all
    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    with pytest.raises(ConfigError, match=rf"needs torch >= {SHARDED_FLOOR} \(FSDP2's set_reduce_scatter_unused_params\)"):
        check_sharded("2.6.0")
