"""Start N local worker processes through torch.distributed.run, the way users launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hetdp.errors import HetDPError


def torchrun_command(target: str | Path, nproc: int, args: Sequence[str] = (), *, module: bool = False) -> list[str]:
    """The command line that runs ``target`` (a script, or a module if ``module``) on ``nproc`` local ranks."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", str(target)] if module else [str(target)]
    return command + [str(arg) for arg in args]


def run_local(
    target: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    capture: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``target`` on ``nproc`` local ranks and wait; kill the whole process group past ``timeout_s``.

    Raises:
        HetDPError: the workers were still running after ``timeout_s`` seconds.
    """
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    command = torchrun_command(target, nproc, args, module=module)
    process = subprocess.Popen(
        command,
        env=full_env,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise HetDPError(f"{target} on {nproc} ranks still running after {timeout_s} s; killed\n{output or ''}") from error
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return subprocess.CompletedProcess(command, process.returncode, output, None)
