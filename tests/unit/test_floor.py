"""The declared torch floor is the one the code needs, and an older torch fails at import in one line; the sharded
path's floor and each integration's framework's are checked where first used, in one line naming the version needed."""

import re
import tomllib
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist

from hetdp.floor import FRAMEWORKS, TORCH_FLOOR, check_framework, check_torch


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


def test_hetdp_fully_shard_refuses_an_old_torch_before_it_shards_anything(monkeypatch):
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    from hetdp import fully_shard
    from hetdp.errors import ConfigError

    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    module = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"hetdp.fully_shard needs torch >= 2\.13 \(FSDP2's "
                                          r"set_force_sum_reduction_for_comms\)"):
        fully_shard(module)
    assert not isinstance(module, FSDPModule)


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_a_framework_below_its_floor_is_one_config_error_naming_the_version_needed(name):
    from hetdp.errors import ConfigError

    floor, _ = FRAMEWORKS[name]
    older = "0.9.1"
    with pytest.raises(ConfigError, match=rf"^the adapter needs {name} >= {re.escape(floor)}, found {older}: "
                                          rf"pip install 'hetdp\[{name}\]'") as raised:
        check_framework(name, older, user="the adapter")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_a_framework_in_its_range_passes_and_one_past_it_warns(name):
    floor, untested = FRAMEWORKS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_framework(name, f"{floor}.0", user="the adapter")
    with pytest.warns(UserWarning, match=rf"the adapter was tested with {name} >= {re.escape(floor)}, "
                                         rf"< {re.escape(untested)}, found {untested}\.0"):
        check_framework(name, f"{untested}.0", user="the adapter")


def test_the_framework_floors_are_the_extras_ranges_in_pyproject():
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, (floor, untested) in FRAMEWORKS.items():
        pins = [pin for pin in extras[name] if re.match(rf"{name}(\[.*\])?[<>=]", pin)]
        assert pins and all(pin.endswith(f">={floor},<{untested}") for pin in pins), (name, extras[name])
