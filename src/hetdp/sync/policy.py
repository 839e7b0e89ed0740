"""The synchronization axis: the choices a run makes about how contributions combine, as small frozen specs.

A spec is pure configuration; the drop-in (``hetdp.DDP``) turns it into the runtime
(``GradientSum``, ``PartialGradients``, ``ParameterAveraging``). Strings name the
common ones: ``"allreduce"``, ``"solo"``, ``"majority"``, ``"quorum:K"``, ``"full"``,
``"local"`` (average per epoch) and ``"local:K"`` (average every K steps).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hetdp.collectives.partial import PartialConfig
from hetdp.collectives.protocol import GRACE, MODES, Mode
from hetdp.errors import ConfigError
from hetdp.runtime import Timeouts

ENV_SYNC = "HETDP_SYNC"
"""Set by ``hetdp run --sync``: the synchronization of a drop-in whose code does not choose one."""


@dataclass(frozen=True)
class Allreduce:
    """Every step, every rank: the gradient is exactly the mean over the step's samples (synchronous SGD)."""

    def describe(self) -> str:
        return "allreduce"


@dataclass(kw_only=True, frozen=True)
class Partial:
    """Each step waits for a partial allreduce of the gradients, not for every rank (eager-SGD).

    A round's gradient is the sample-weighted mean of the contributions it holds
    (fresh ones, and stale ones carried from rounds their rank missed), counted as
    the part of a step its samples are; a rank that missed rounds applies all of
    them in its next step. Every ``sync_every`` steps and
    at each epoch's end the ranks meet: they flush the rounds in flight and average
    their parameters (the paper's periodic model synchronization), which is also
    when an adaptive allocation re-plans.
    """

    mode: Mode = "majority"
    """solo: the first arrival fires a round; majority: a random initiator; quorum: k arrivals; full: all."""
    quorum: int | None = None
    """k, for ``mode="quorum"``."""
    sync_every: int = 0
    """Steps between meetings (parameter averaging); 0: only at each epoch's end."""
    seed: int = 0
    """Seed of the majority initiators; every rank must use the same."""
    grace: float = GRACE
    """Majority mode: the part of its recent step an initiator waits for the ranks still out (``protocol.grace_s``;
    0: the paper's rule, at once). With allocation equalizing the ranks' times, many arrive just after the
    initiator: the grace lets them in fresh, and a real straggler is still not waited for."""
    bypass: bool = True
    """Majority mode: a round whose initiator is the only rank still out fires without it once the others waited
    out their grace, at most once until that initiator arrives again (``PartialConfig.bypass``; False: the paper's
    rule, always waiting for the initiator). A transient straggler then holds up none of its rounds."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Deadlines of the partial allreduce (see ``PartialConfig.timeouts``)."""

    def __post_init__(self) -> None:
        self.partial_config()  # validates mode and quorum
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 0:
            raise ConfigError(f"sync_every must be an integer >= 0 steps (0: per epoch), got {self.sync_every!r}")

    def partial_config(self) -> PartialConfig:
        return PartialConfig(mode=self.mode, quorum=self.quorum, seed=self.seed, grace=self.grace,
                             bypass=self.bypass, timeouts=self.timeouts)

    def describe(self) -> str:
        return f"quorum:{self.quorum}" if self.mode == "quorum" else self.mode


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
