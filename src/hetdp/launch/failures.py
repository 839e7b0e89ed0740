"""The failure a launch ends in, chosen from the reports its ranks left in torchrun's error files
(``hetdp.runtime.errorfile``): the first that no peer's failure caused, with every rank that reported the same."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hetdp.runtime.errorfile import Report

NO_RANK = -1
"""The rank of a failure report that no worker wrote: the node's rendezvous failed before any rank existed."""


@dataclass(frozen=True)
class Failure:
    """The failure a launch ends in: its first rank's report, with every rank that reported the same."""

    message: str
    """One line: what the worker raised, and which rank (or ranks, that raised the same)."""
    rank: int
    exit_code: int
    retry: bool
    """Whether a restart may get past it (no rank raised a ConfigError)."""
    traceback: str | None


def first_failure(reports: Iterable[Report | None]) -> Failure | None:
    """The failure that started the others: the first report whose rank did not fail because a peer did. A rank's
    report may come twice (torchrun copies the first it saw into its own error file)."""
    by_rank = {report.rank: report for report in reports if report is not None}
    ordered = sorted(by_rank.values(), key=lambda report: (report.consequence, report.time))
    if not ordered:
        return None
    first = ordered[0]
    ranks = sorted(report.rank for report in ordered if report.message == first.message)
    message = first.message if first.names_rank else (
        f"{first.message} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})")
    return Failure(message, rank=first.rank, exit_code=first.exit_code,
                   retry=all(report.retry for report in ordered), traceback=first.traceback)
