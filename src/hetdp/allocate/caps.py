"""Memory caps: the most samples each rank's forward may hold, whether a step's global batch fits under them, and
shares (a resumed run's) brought within them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from hetdp.allocate.apportion import apportion
from hetdp.allocate.pack import CostBalance
from hetdp.cluster.emulate import Emulation
from hetdp.errors import ConfigError


def memory_caps(max_batch: int | Sequence[int | None] | Literal["measure"] | None, world_size: int,
                emulation: Emulation, gather: Callable[[Any, str], list[Any]],
                measure: Callable[[], int | None]) -> list[int | None] | None:
    """Every rank's largest forward: given for all, exchanged (each rank gives its own, an int or ``measure()``'s,
    through ``gather``, a collective), or the emulated devices' (``hetdp run --devices``); None: no cap. A rank whose
    ``measure()`` fails raises its ConfigError on every rank, after the exchange."""
    if max_batch is None:
        devices = emulation.devices
        return None if devices is None else [device.max_batch for device in devices]
    if isinstance(max_batch, str) and max_batch == "measure":
        try:
            mine: int | str | None = measure()
        except ConfigError as error:  # raised on every rank after the exchange, so that none waits for this one
            mine = str(error)
        caps = gather(mine, "exchanging the ranks' measured max_batch")
        failed = [(rank, cap) for rank, cap in enumerate(caps) if isinstance(cap, str)]
        if failed:
            raise ConfigError(f"rank {failed[0][0]}: {failed[0][1]}")
        return caps
    if isinstance(max_batch, int):
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1 sample, got {max_batch}")
        return gather(max_batch, "exchanging the ranks' max_batch")
    if isinstance(max_batch, str) or not isinstance(max_batch, Sequence):
        raise ConfigError(f"max_batch must be an int >= 1, one cap (or None) per rank, 'measure' or None, "
                          f"got {max_batch!r}")
    caps = list(max_batch)
    if len(caps) != world_size or any(cap is not None and cap < 1 for cap in caps):
        raise ConfigError(f"max_batch needs one cap >= 1 (or None) per rank for {world_size} ranks, got {caps}")
    return caps


def check_fits(caps: Sequence[int | None], global_batch: int, cost: CostBalance | None) -> None:
    """Raise ConfigError unless shares capped at ``caps`` (None: no cap) can hold a step of ``global_batch``."""
    limits = [cap for cap in caps if cap is not None]
    if not limits:
        return
    if cost is not None and cost.pack:
        raise ConfigError("memory caps bound a rank's samples, and cost-packed steps size blocks by cost: "
                          "pass accumulates=True and split large blocks in the loop, or drop max_batch")
    if len(limits) == len(caps) and global_batch > sum(limits):
        raise ConfigError(
            f"a global batch of {global_batch} does not fit under the ranks' memory caps {limits} (at most "
            f"{sum(limits)} samples, one forward each; the drop-in cannot split a share for your loop): lower "
            f"global_batch, or run shares as micro-batches under no_sync in your loop (accumulates=True)")


def within_caps(shares: Sequence[int], caps: Sequence[int | None] | None, minimum: int) -> list[int]:
    """``shares`` where each is within its rank's cap (None: no cap), else their total split again within the caps,
    in proportion to ``shares``, each nonzero share at least ``minimum``: a checkpoint's shares resumed under the caps
    of the run that resumes them (another card, another ``max_batch``). A rank at 0 (it sits out) stays out where
    the others' caps hold the step; where they do not, every rank takes part again.

    Raises:
        ConfigError: the caps of every rank together cannot hold the step (``check_fits`` refuses that earlier).
    """
    if caps is None or all(cap is None or share <= cap for share, cap in zip(shares, caps)):
        return list(shares)
    total = sum(shares)
    members = [rank for rank, share in enumerate(shares) if share > 0]
    room = [caps[rank] for rank in members]
    ranks = members if None in room or sum(room) >= total else list(range(len(shares)))  # type: ignore[arg-type]
    split = apportion([float(shares[rank] or 1) for rank in ranks], total, minimum, caps=[caps[rank] for rank in ranks])
    fitted = [0] * len(shares)
    for rank, share in zip(ranks, split):
        fitted[rank] = share
    return fitted


def shard_cap(memory_bytes: float, held_bytes: float, per_sample_bytes: float, *, device: str) -> int | None:
    """The most samples one forward may hold on a device of ``memory_bytes`` (what a step may use of it) once it holds
    ``held_bytes`` whatever the batch (its shard of the model's state, FSDP's gathered units): ``floor((memory -
    held) / per_sample)`` (C-ADP eq. 3's P_max, with the shard in the fixed part). None: memory does not grow with
    the batch (``per_sample_bytes`` <= 0).

    Raises:
        ConfigError: not even one sample fits; names ``device`` and the bytes it would need.
    """
    if per_sample_bytes <= 0:
        return None
    cap = math.floor((memory_bytes - held_bytes) / per_sample_bytes)
    if cap < 1:
        need = held_bytes + per_sample_bytes
        raise ConfigError(f"{device} cannot hold its shard plus one sample: it would need {_megabytes(need)} "
                          f"({_megabytes(held_bytes)} of model state and FSDP buffers, {_megabytes(per_sample_bytes)} "
                          f"per sample) and has {_megabytes(memory_bytes)}; shard over more ranks, or free memory")
    return cap


def _megabytes(count: float) -> str:
    """Bytes as MB, with three significant digits however small (a test model's shard is a tenth of one)."""
    return f"{count / 1e6:,.{max(0, 2 - math.floor(math.log10(max(count / 1e6, 1e-9))))}f} MB"
