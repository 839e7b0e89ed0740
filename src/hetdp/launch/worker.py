"""A worker of ``hetdp run``: the script run as ``python`` would run it, its failure left in torchrun's error file for
the launch, and a word on rank 0 when the launch's settings did nothing."""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

from hetdp.launch.launcher import ENV_RESTART
from hetdp.runtime.errorfile import ERROR_FILE, Report, others_stopped, rank_label, report_of
from hetdp.runtime.group import is_peer_failure


def run_worker(argv: list[str]) -> None:
    """Run a script (``PATH ARGS``) or a module (``-m NAME ARGS``) as ``python`` would, leaving its failure in
    torchrun's error file for the launch: a HetDPError's line, another exception's line and traceback (from the
    script's own frames), which the launch prints once."""
    module = argv[0] == "-m"
    target, rest = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *rest]
    os.environ["TORCHELASTIC_RESTART_COUNT"] = os.environ.get(ENV_RESTART, "0")  # each attempt is a fresh torchrun
    error_file = os.environ.get(ERROR_FILE)
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(target).resolve().parent)  # as `python script.py` sets it
            runpy.run_path(target, run_name="__main__")
    except SystemExit as error:
        if error.code not in (0, None) and error_file:
            code = error.code if isinstance(error.code, int) else 1
            Report(rank=int(os.environ.get("RANK", "0")), message=f"{rank_label()} exited with {error.code!r}"
                   f"{others_stopped()}", exit_code=code).write(error_file)
        elif error.code in (0, None):
            _warn_if_settings_unused()
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        if not error_file:
            raise
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            trace = trace.tb_next  # the launcher's own frames: the user's traceback starts at their script
        told = "".join(traceback.format_exception(type(error), error, trace))
        report = report_of(error, consequence=is_peer_failure(error), traceback=told)
        report.write(error_file)
        sys.exit(report.exit_code)
    _warn_if_settings_unused()


def _warn_if_settings_unused() -> None:
    """On rank 0 of a launch whose emulation, allocation or synchronization settings no step of a drop-in
    (``hetdp.DDP``, ``hetdp.fully_shard``) used (a plain torch DDP script, or an allocated loader never iterated), say
    so in one line."""
    from hetdp.allocate.policy import ENV_ALLOCATION
    from hetdp.cluster.emulate import Emulation
    from hetdp.sync.policy import ENV_SYNC

    if os.environ.get("RANK", "0") != "0":
        return
    chosen = [name for name, is_set in (("emulation", Emulation.from_env().active),
                                        ("--allocation", bool(os.environ.get(ENV_ALLOCATION))),
                                        ("--sync", bool(os.environ.get(ENV_SYNC)))) if is_set]
    coordinator = sys.modules.get("hetdp.ddp.coordinator")
    if chosen and (coordinator is None or coordinator.StepCoordinator.steps_in_process == 0):
        print(f"hetdp: warning: the {' and '.join(chosen)} settings did nothing: no step ran through a hetdp drop-in's "
              "allocated loader (a plain torch DDP script? model.allocate(loader)'s result not iterated?)",
              file=sys.stderr, flush=True)
