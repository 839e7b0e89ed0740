"""The framework adapters are optional extras: the core never imports a framework, and an adapter whose framework
is missing says in one line what to install. A DDP script does not pay for the sharded drop-in's imports either."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from hetdp.errors import ConfigError

ADAPTERS = {"lightning": "lightning.pytorch", "accelerate": "accelerate", "transformers": "transformers"}


def test_the_core_and_its_cli_import_no_framework():
    code = ("import sys, hetdp, hetdp.cli, hetdp.cli.bench; "
            "print(sorted(m for m in ('lightning', 'accelerate', 'transformers') if m in sys.modules))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]"


@pytest.mark.parametrize(("adapter", "framework"), ADAPTERS.items())
def test_a_missing_framework_is_one_config_error_naming_the_extra(monkeypatch, adapter, framework):
    monkeypatch.setitem(sys.modules, framework, None)  # import of it fails, as when it is not installed
    monkeypatch.delitem(sys.modules, f"hetdp.integrations.{adapter}", raising=False)
    with pytest.raises(ConfigError, match=rf"pip install 'hetdp\[{adapter}\]'") as error:
        importlib.import_module(f"hetdp.integrations.{adapter}")
    assert "\n" not in str(error.value)


def test_a_ddp_script_imports_none_of_the_sharding_machinery():
    # FSDP2, DTensor and torch.distributed.checkpoint cost every rank over a second of start-up: only
    # hetdp.fully_shard's scripts pay it.
    code = ("import sys, hetdp, hetdp.ddp.model; "
            "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor', "
            "'torch.distributed.checkpoint') if m in sys.modules))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]"
