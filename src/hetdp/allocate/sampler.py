"""How a step's samples divide among the ranks by their shares, a short last step included (``StepSampler`` cuts
every step of the drop-in's allocated loader with it)."""

from __future__ import annotations

from collections.abc import Sequence

from hetdp.allocate.apportion import apportion


def split_step(shares: Sequence[int], count: int, least: int = 1) -> list[int]:
    """Each rank's part of a step of ``count`` samples: ``shares`` for a full step, else in proportion to them.

    A short step (an epoch's last) gives every rank with a share at least
    ``least`` samples (2 where a BatchNorm trains: ``stand_in_samples``) whenever it has enough samples for that,
    so no rank sits out a step it could take part in; with fewer samples than that, some get none (with
    ``least`` > 1, the ranks of the largest shares keep theirs, and no part lies between 0 and ``least``).
    """
    if count == sum(shares):
        return list(shares)
    active = [rank for rank, share in enumerate(shares) if share > 0]
    if least > 1 and count < least * len(active):
        active = sorted(active, key=lambda rank: -shares[rank])[: max(1, count // least)]
    parts = apportion([shares[rank] for rank in active], count,
                      minimum=min(least, count) if count >= len(active) else 0)
    block = [0] * len(shares)
    for rank, part in zip(active, parts):
        block[rank] = part
    return block
