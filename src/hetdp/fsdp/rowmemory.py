"""What a rank holds whatever its batch under memory-sized shards (``hetdp.fsdp.uneven``), for its memory cap: its rows
of the state, and the buffers hetdp's exchange takes beside them.

The even path's count is ``hetdp.fsdp.memory.footprint`` (FSDP2's buffers); this
one differs only in the buffers: a unit gathers through one ``all_to_all_single``
that sends this rank's segment to every rank (``ranks x segment``) and receives
the unit whole, and reduces through one that sends the unit's gradient whole and
receives every rank's rows of this rank's segment.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from hetdp.fsdp.memory import OPTIMIZER_COPIES, Footprint, UnitShape


def uneven_footprint(units: Sequence[nn.Module], shapes: Sequence[UnitShape], parameter_bytes: int, *,
                     gradients_wait: bool = False) -> Footprint:
    """This rank's ``Footprint``: ``parameter_bytes`` of its rows (``storage_bytes`` of its parameters), as many of
    their gradients, ``OPTIMIZER_COPIES`` for the optimizer, and the largest unit's exchange at its peak beside the
    units kept gathered from forward to backward. ``units`` are ``UnevenModule`` s, ``shapes`` their
    ``unit_shapes``; ``gradients_wait``: the loop lets gradients wait, each unit's summed whole until a backward
    reduces them."""
    peak = 0
    for unit, shape in zip(units, shapes):
        storage = unit._uneven.storage  # type: ignore[attr-defined]
        mine = storage.sizes[storage.rank] * storage.world_size
        gathering = shape.gathered_bytes + mine * storage.param_dtype.itemsize
        reducing = shape.reduced_bytes + mine * storage.reduce_dtype.itemsize
        peak = max(peak, shape.gathered_bytes + max(gathering, shape.reduced_bytes + reducing))
    kept = sum(shape.gathered_bytes for shape in shapes if shape.kept)
    waiting = sum(shape.reduced_bytes for shape in shapes) if gradients_wait else 0
    return Footprint(parameters=parameter_bytes, gradients=parameter_bytes,
                     optimizer=OPTIMIZER_COPIES * parameter_bytes, buffers=peak + kept, waiting=waiting)
