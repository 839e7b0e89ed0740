"""The synchronization axis: the choices a run makes about how contributions combine, as small frozen specs.

A spec is pure configuration (``Partial`` is the partial allreduce's own, in ``hetdp.collectives.partial``); the
drop-in (``hetdp.DDP``) turns it into the runtime
(``GradientSum``, ``PartialGradients``, ``ParameterAveraging``). Strings name the
common ones: ``"allreduce"``, ``"solo"``, ``"majority"``, ``"quorum:K"``, ``"full"``,
``"local"`` (average per epoch) and ``"local:K"`` (average every K steps).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hetdp.collectives.partial import Partial
from hetdp.collectives.protocol import MODES
from hetdp.errors import ConfigError

ENV_SYNC = "HETDP_SYNC"
"""Set by ``hetdp run --sync``: the synchronization of a drop-in whose code does not choose one."""


@dataclass(frozen=True)
class Allreduce:
    """Every step, every rank: the gradient is exactly the mean over the step's samples (synchronous SGD)."""

    def describe(self) -> str:
        return "allreduce"


@dataclass(kw_only=True, frozen=True)
class LocalAveraging:
    """Ranks train alone and average their parameters, weighted by the samples each trained on (local SGD, C-ADP).

    The merge is w = sum_i (D_i / D) w_i (C-ADP paper, section 3), D_i being the
    samples rank i trained on since the last merge.
    """

    every: int = 0
    """Steps between merges; 0: once per epoch, as C-ADP does."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ConfigError(f"every must be an integer >= 0 steps (0: per epoch), got {self.every!r}")

    def describe(self) -> str:
        return f"local:{self.every}" if self.every else "local"


SyncPolicy = Allreduce | Partial | LocalAveraging


def sync_policy(spec: str | SyncPolicy | None = None) -> SyncPolicy:
    """The spec for ``spec``: a policy as is, a name (see the module docstring), or None for ``$HETDP_SYNC``
    (set by ``hetdp run --sync``) and else ``"allreduce"``.

    Raises:
        ConfigError: an unknown name or a bad number.
    """
    if isinstance(spec, Allreduce | Partial | LocalAveraging):
        return spec
    if spec is None:
        spec = os.environ.get(ENV_SYNC) or "allreduce"
    if not isinstance(spec, str):
        raise ConfigError(f"sync must be a name or hetdp.Allreduce / Partial / LocalAveraging, got {spec!r}")
    name, _, argument = spec.partition(":")
    if name == "allreduce" and not argument:
        return Allreduce()
    if name in MODES:
        if name == "quorum":
            return Partial(mode="quorum", quorum=_count(spec, argument, "quorum:K"))
        if not argument:
            return Partial(mode=name)  # type: ignore[arg-type]
    if name == "local":
        return LocalAveraging(every=_count(spec, argument, "local:K") if argument else 0)
    raise ConfigError(
        f"sync must be allreduce, solo, majority, quorum:K, full, local or local:K; got {spec!r}"
    )


def _count(spec: str, text: str, form: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise ConfigError(f"sync {spec!r}: expected {form} with K a positive integer")
    return value
