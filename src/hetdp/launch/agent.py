"""The torchrun of ``hetdp run``: torch.distributed.run in this process, its elastic agent starting the workers, minus
its logs and failure summary when a worker fails."""

from __future__ import annotations

import logging
import os
import sys

from hetdp.launch.failures import NO_RANK, first_failure
from hetdp.runtime.errorfile import ERROR_FILE, Report, rank_label

ENV_WORKER_CPP_LOG = "HETDP_WORKER_CPP_LOG_LEVEL"
"""The user's ``TORCH_CPP_LOG_LEVEL`` (empty: unset), handed to the workers of a launch across nodes, whose torchrun
runs at FATAL: a rendezvous that failed is told in one line, not in c10d's stack traces of every retry."""


def run_torchrun(argv: list[str]) -> None:
    """torchrun, minus its logs and failure summary when a worker fails: the failure that started the others is told
    instead, its traceback once and its line in this launch's error file. A worker that died without a word (killed,
    crashed) gets its line here, from torchrun's first observed failure."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # "Sending process ... closing signal", "failed"
    worker_level = os.environ.pop(ENV_WORKER_CPP_LOG, None)
    if worker_level is not None:  # this process read FATAL as it started; its workers log as the user asked
        os.environ.pop("TORCH_CPP_LOG_LEVEL")
        if worker_level:
            os.environ["TORCH_CPP_LOG_LEVEL"] = worker_level
    try:
        main(argv)
    except DistError as error:  # the rendezvous of a launch across nodes: the others never came, or never answered
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        Report(rank=NO_RANK, message=text, exit_code=2).write(os.environ[ERROR_FILE])
        sys.exit(2)
    except ChildFailedError as error:
        reports = {rank: Report.of(failure.error_file_data) for rank, failure in error.failures.items()}
        told = [report for report in reports.values() if report is not None]
        wordless = [rank for rank, report in reports.items() if report is None]
        if wordless:
            rank = min(wordless, key=lambda r: error.failures[r].timestamp)
            died = error.failures[rank]
            if not told or (all(report.consequence for report in told) and died.exitcode < 0):
                # died without a word (killed, crashed): torchrun's first observed failure tells it
                how = f"signal {died.signal_name()}" if died.exitcode < 0 else f"exit code {died.exitcode}"
                stopped = "; the other ranks were stopped" if len(error.failures) > 1 else ""
                report = Report(rank=rank, message=f"{rank_label(rank)} died ({how}){stopped}",
                                exit_code=128 - died.exitcode if died.exitcode < 0 else died.exitcode)
                report.write(os.environ[ERROR_FILE])
                told.append(report)
        failure = first_failure(told)
        if failure.traceback:
            print(failure.traceback, end="", file=sys.stderr, flush=True)
        sys.exit(failure.exit_code)
