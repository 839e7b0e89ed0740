"""A worker's failure as one line naming its rank, in the error file torchrun gives every worker.

torch.distributed.elastic sets ``TORCHELASTIC_ERROR_FILE`` for each worker it starts; a worker that fails leaves
its error there, and the launcher shows the first failure's (torchrun's failure summary, "Root Cause"). hetdp
writes its line there in elastic's own format, with what ``hetdp run`` needs to tell the story beside it: so under
torchrun (and ``srun torchrun``, a PyTorchJob's torchrun) the summary names the rank in one line, and ``hetdp run``
reads the same files to end a launch in that line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from hetdp.runtime.engines import ENV_NODE
from hetdp.errors import ConfigError, HetDPError
from hetdp.files import atomic_write

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where this process leaves its failure: set by torchrun for each worker, and by ``hetdp run`` for its torchrun."""


@dataclass(frozen=True)
class Report:
    """One rank's failure, as its error file holds it."""

    rank: int
    message: str
    """One line: what the worker raised."""
    exit_code: int
    retry: bool = True
    """Whether a restart may get past it (not a ConfigError)."""
    names_rank: bool = True
    """Whether ``message`` says which rank failed (a HetDPError's does not: the launcher adds every rank that raised
    the same)."""
    consequence: bool = False
    """A peer's failure caused it (a collective the peer broke off): any other report tells the story better."""
    traceback: str | None = None
    """The worker's traceback, shown once for the launch (None for a HetDPError, which is its one line)."""
    time: float = dataclasses.field(default_factory=time.time)

    @property
    def line(self) -> str:
        """What this report says alone: its message, naming its rank."""
        return self.message if self.names_rank else f"{self.message} (rank {self.rank})"

    def write(self, path: str | Path) -> None:
        """Leave this report at ``path`` whole or not at all, in elastic's format (a ``message`` and an integer
        ``timestamp``, which torchrun's summary reads) with hetdp's fields beside it."""
        data = {"message": self.line, "timestamp": str(int(self.time)), "hetdp": dataclasses.asdict(self)}
        atomic_write(path, lambda handle: handle.write(json.dumps(data).encode()))

    @classmethod
    def of(cls, data: dict) -> Report | None:
        """The report in an error file's ``data``; None for one that hetdp did not write (elastic's ``@record``)."""
        fields = data.get("hetdp")
        return cls(**fields) if isinstance(fields, dict) else None

    @classmethod
    def read(cls, path: Path) -> Report | None:
        try:
            return cls.of(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None


def rank_label(rank: int | str | None = None) -> str:
    """``rank`` (default: this worker's) as a failure names it: with its node in a ``hetdp run`` across nodes."""
    rank = os.environ.get("RANK", "0") if rank is None else rank
    node = os.environ.get(ENV_NODE)
    return f"rank {rank}" if node is None else f"rank {rank} on {node}"


def others_stopped() -> str:
    """What a worker's failure did to the rest of the group, as its report's message ends."""
    return "; the other ranks were stopped" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def report_of(error: BaseException, *, consequence: bool = False, traceback: str | None = None) -> Report:
    """This worker's report of ``error``: a HetDPError's first line (a ConfigError is not retried, and exits 2),
    anything else as ``rank R failed with TYPE: TEXT``."""
    rank = int(os.environ.get("RANK", "0"))
    text = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, HetDPError):
        return Report(rank=rank, message=text or type(error).__name__, exit_code=2,
                      retry=not isinstance(error, ConfigError), names_rank=False)
    return Report(rank=rank, message=f"{rank_label()} failed with {type(error).__name__}{': ' if text else ''}{text}"
                  f"{others_stopped()}", exit_code=1, consequence=consequence, traceback=traceback)


def record_uncaught() -> None:
    """Under torchrun, leave an uncaught exception's one line in this worker's error file, which torchrun's failure
    summary then shows as the root cause (``traceback : rank 1 failed with ValueError: ...``) instead of a link to
    elastic's docs. Python still prints the traceback; a file already there (``@record``'s) is kept. Does nothing
    where no launcher asked for an error file (srun alone, Ray)."""
    path = os.environ.get(ERROR_FILE)
    if not path or getattr(sys.excepthook, "records_to", None) == path:
        return
    previous = sys.excepthook

    def record(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        if isinstance(error, Exception) and not Path(path).exists():
            report_of(error).write(path)
        previous(kind, error, trace)

    record.records_to = path  # type: ignore[attr-defined]
    sys.excepthook = record
