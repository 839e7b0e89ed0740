"""How a step's samples divide among the ranks by their shares, a short last step included (``StepSampler`` cuts
every step of the drop-in's allocated loader with it)."""

from __future__ import annotations

from collections.abc import Sequence

from hetdp.allocate.apportion import apportion


def split_step(shares: Sequence[int], count: int) -> list[int]:
    """Each rank's part of a step of ``count`` samples: ``shares`` for a full step, else in proportion to them.

    A short step (an epoch's last) gives every rank with a share at least one
    sample whenever it has enough samples for that, so no rank sits out a step
    it could take part in; with fewer samples than such ranks, some get none.
    """
    if count == sum(shares):
        return list(shares)
    active = [rank for rank, share in enumerate(shares) if share > 0]
    parts = apportion([shares[rank] for rank in active], count, minimum=1 if count >= len(active) else 0)
    block = [0] * len(shares)
    for rank, part in zip(active, parts):
        block[rank] = part
    return block
