"""Fixtures that start real worker processes through torch.distributed.run (gloo on CPU)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

from hetdp.cli import main
from hetdp.launch import run_local

WORKERS = Path(__file__).parent / "workers"

TorchRun = Callable[..., subprocess.CompletedProcess]
HetdpRun = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="session")
def torchrun() -> TorchRun:
    """Run ``tests/distributed/workers/<name>`` on ``nproc`` ranks; fail with the workers' output if it fails.

    Usage: ``torchrun("partial_worker.py", 3, "--out", tmp_path, expect_rc=0, env={...}, timeout_s=120)``.
    Pass ``expect_rc=None`` to get the result whatever the exit code.
    """

    def launch(
        name: str,
        nproc: int,
        *args: object,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 120.0,
        expect_rc: int | None = 0,
    ) -> subprocess.CompletedProcess:
        result = run_local(WORKERS / name, nproc, [str(a) for a in args], env=env, timeout_s=timeout_s, capture=True)
        if expect_rc is not None and result.returncode != expect_rc:
            pytest.fail(f"{name} on {nproc} ranks exited {result.returncode}, expected {expect_rc}:\n{result.stdout}")
        return result

    return launch


@pytest.fixture
def hetdp_run(capfd) -> HetdpRun:
    """Run ``hetdp run ARGS`` through the command's ``main`` in this process, not one more interpreter (about 3 s of
    CPU to import torch and hetdp); the workers it launches write to this process's descriptors, so the result holds
    what the installed command prints, and its exit code.

    Usage: ``completed = hetdp_run("-n", 2, script)``, then ``completed.returncode``, ``.stdout``, ``.stderr``.
    """

    def run(*args: object) -> subprocess.CompletedProcess:
        argv = ["run", *map(str, args)]
        returncode = main(argv)
        captured = capfd.readouterr()
        return subprocess.CompletedProcess(["hetdp", *argv], returncode, captured.out, captured.err)

    return run


def pytest_collection_modifyitems(items: Sequence[pytest.Item]) -> None:
    for item in items:
        if "distributed" in str(item.fspath):
            item.add_marker(pytest.mark.distributed)
