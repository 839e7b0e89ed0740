"""The exceptions hetdp raises: one root, so ``except hetdp.HetDPError`` catches ours only."""

from __future__ import annotations


class HetDPError(Exception):
    """Root of every error hetdp raises on purpose."""


class ConfigError(HetDPError, ValueError):
    """A setting, flag or file field is invalid; the message names it and says what is allowed."""


class PeerTimeoutError(HetDPError, TimeoutError):
    """A peer did not answer within its deadline; the message names the rank and the timeout."""

    def __init__(self, message: str, *, rank: int | None = None, timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.timeout_s = timeout_s


class CheckpointError(HetDPError):
    """A checkpoint cannot be read, or does not match the run that tries to resume from it."""


class RefusedCheckpointError(CheckpointError):
    """A checkpoint holds objects other than tensors and plain data: it is refused unread (nothing in it ran)."""


class WorkerError(HetDPError):
    """A worker of a launch failed: the message names its rank and what it raised; its traceback, if any, was
    printed once by that worker."""

    def __init__(self, message: str, *, rank: int, exit_code: int, output: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        """The failed worker's exit code, which ``hetdp run`` exits with."""
        self.output = output
        """The launch's output, where it was captured."""
