"""Launching a benchmark's worker module on N local ranks, with a progress bar, and reading back rank 0's figures."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hetdp.errors import HetDPError
from hetdp.launch import run_local
from hetdp.report import LaunchProgress


def launch_workers(module: str, nproc: int, args: Sequence[object], *, total: int, description: str, unit: str,
                   on_row: Callable[[dict[str, Any]], None] | None = None,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m module --out PATH ARGS`` on ``nproc`` ranks; return the JSON object rank 0 wrote to PATH.

    The progress bar counts ``total`` ``unit``s from the workers' ``EventWriter``; rows they send go to
    ``on_row`` as they are measured.

    Raises:
        HetDPError: the workers failed, or wrote nothing.
    """
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        with LaunchProgress(total, description, nproc=nproc, unit=unit, on_row=on_row) as progress:
            completed = run_local(module, nproc, ["--out", out, *args], module=True, follow=progress,
                                  report_errors=True, env=env)
        if completed.returncode != 0 or not out.is_file():
            name = module.rsplit(".", 1)[-1]
            raise HetDPError(f"{name} workers on {nproc} ranks failed (exit code {completed.returncode}); "
                             f"see their output above")
        return json.loads(out.read_text())
