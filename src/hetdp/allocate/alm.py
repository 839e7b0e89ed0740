"""The C-ADP paper's Algorithm 1: p-norm relaxation of eq. (7), augmented Lagrangian with a log barrier, rounding.

The two maxima of eq. (7) become p-norms and the ceiling is dropped (eq. (10)):

    Phi(x) = || s * x ||_p + num * || (T / bs) * x + c ||_p,   x >= 0, sum(x) = D,

a convex function (Theorem 1). Algorithm 1 minimizes the augmented Lagrangian

    L(x, lambda, mu) = Phi(x) + lambda (sum x - D) + rho/2 (sum x - D)^2 - mu sum ln x

by gradient descent (inner loop), then updates lambda <- lambda + rho (sum x - D) and
mu <- mu_decay mu (outer loop), and rounds the relaxed optimum to integers that sum to D.

Choices the paper leaves open, made here so that one set of defaults works on any cluster:

- units: x = (D / N) u, so the equal split (the paper's starting point) is u = 1; Phi is
  divided by its value there and multiplied by N, so that rho, mu, eta and epsilon do not
  depend on D, N, bytes or seconds;
- the gradient step is scaled by u^2 (see ``_descend``) and backtracks until the iterate
  stays inside the barrier's domain and L decreases;
- the loop stops when the gradient is small *and* sum(x) = D holds (the paper checks the
  gradient only, which can stop before the multiplier has converged).

Shares are balanced to within the p-norm's tilt (a device with an r times larger per-sample
cost ends about r^(1/(p-1)) above the others: ~1% for p = 100); rounding under the ceiling of
eq. (5) then adds up to one batch time per device, so ALM is within about 1% of optimal when
each device gets many batches and a few percent when it gets only a few (Theorem 2: the
rounding error does not shrink with D, only relative to it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hetdp.allocate.cost import CostModel
from hetdp.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class AlmConfig:
    """Hyper-parameters of Algorithm 1 (names as in the paper), in normalized units (equal split = 1)."""

    p: float = 100.0
    """Order of the p-norm that stands in for max (Lemma 1); the paper uses 100. Larger is closer to max
    but stiffer to descend."""
    rho: float = 10.0
    """rho: weight of the quadratic penalty on sum(x) - D."""
    lambda0: float = 0.0
    """lambda^(0): initial multiplier of the constraint sum(x) = D."""
    mu0: float = 1e-3
    """mu^(0): initial weight of the log barrier that keeps x > 0."""
    mu_decay: float = 0.3
    """mu_decay: factor applied to mu after each outer iteration (< 1 lets x approach 0)."""
    eta0: float = 0.5
    """eta^(0): initial gradient step; the step is halved within an iteration until L decreases."""
    eta_decay: float = 0.9
    """eta_decay: factor applied to eta after each outer iteration."""
    epsilon: float = 1e-6
    """epsilon: an inner loop stops when the scaled gradient's 2-norm falls below it; the whole loop
    when, in addition, sum(x) is within epsilon * D of D."""
    outer_iterations: int = 30
    """psi: outer iterations (multiplier and barrier updates)."""
    inner_iterations: int = 100
    """zeta: gradient steps per outer iteration."""
    rounding: Literal["batches", "nearest"] = "batches"
    """Round(x): ``nearest`` moves each D_i by less than one sample (largest remainder, the paper's
    Theorem 2 neighbourhood); ``batches`` rounds each D_i down to whole batches and hands the
    remaining samples to the devices whose next batch ends their epoch soonest, so that the
    ceiling of eq. (5) costs as little as it can (each D_i moves by less than one batch)."""

    def __post_init__(self) -> None:
        for name in ("p", "rho", "mu0", "eta0", "epsilon"):
            if not _is_number(getattr(self, name)) or not 0 < getattr(self, name) < np.inf:
                raise ConfigError(f"{name} must be a positive finite number, got {getattr(self, name)!r}")
        if self.p < 1:
            raise ConfigError(f"p must be >= 1 (a norm), got {self.p!r}")
        for name in ("mu_decay", "eta_decay"):
            if not _is_number(getattr(self, name)) or not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not _is_number(self.lambda0) or not np.isfinite(self.lambda0):
            raise ConfigError(f"lambda0 must be a finite number, got {self.lambda0!r}")
        if self.rounding not in ("batches", "nearest"):
            raise ConfigError(f"rounding must be 'batches' or 'nearest', got {self.rounding!r}")
        for name in ("outer_iterations", "inner_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def solve_alm(
    model: CostModel, dataset_size: int, epochs: int, *, min_samples: int = 0, config: AlmConfig | None = None
) -> np.ndarray:
    """Algorithm 1: the relaxed optimum of eq. (10), rounded to D_i >= ``min_samples`` summing to D."""
    config = config or AlmConfig()
    relaxed = relaxed_optimum(model, dataset_size, epochs, config)
    if config.rounding == "batches":
        return round_to_batches(model, relaxed, dataset_size, epochs, min_samples)
    return round_preserving_sum(relaxed, dataset_size, min_samples)


def relaxed_optimum(model: CostModel, dataset_size: int, epochs: int, config: AlmConfig) -> np.ndarray:
    """Minimize eq. (10) over x >= 0, sum(x) = D by the augmented Lagrangian loop; returns real x."""
    n = model.size
    unit = dataset_size / n  # x = unit * u: the equal split is u = 1
    send = model.send_s_per_sample * unit
    compute = model.batch_time_s / model.batch_size * unit
    comm = model.comm_s
    scale = _p_norm(send, config.p)[0] + epochs * _p_norm(compute + comm, config.p)[0]

    def phi_and_gradient(u: np.ndarray) -> tuple[float, np.ndarray]:
        norm_send, grad_send = _p_norm(send * u, config.p)
        norm_epoch, grad_epoch = _p_norm(compute * u + comm, config.p)
        value = (norm_send + epochs * norm_epoch) / scale
        gradient = (send * grad_send + epochs * compute * grad_epoch) / scale
        # Measured per device, the objective's slope is ~1/N at balance: scale by N so that
        # the multiplier, the barrier and the step are O(1) whatever the cluster size.
        return n * value, n * gradient

    def lagrangian(u: np.ndarray, lam: float, mu: float) -> tuple[float, np.ndarray]:
        phi, gradient = phi_and_gradient(u)
        residual = u.sum() - n
        value = phi + lam * residual + config.rho / (2 * n) * residual**2 - mu * np.log(u).sum()
        return value, gradient + lam + config.rho / n * residual - mu / u

    u = np.ones(n)  # Algorithm 1, line 1: start from the equal split x = D/n
    lam, mu, eta = config.lambda0, config.mu0, config.eta0
    for _ in range(config.outer_iterations):
        value, gradient = lagrangian(u, lam, mu)
        converged = False
        step = eta
        for _ in range(config.inner_iterations):
            if np.linalg.norm(u * gradient) <= config.epsilon:
                converged = True
                break
            u, value, gradient, step = _descend(u, value, gradient, step, lambda z: lagrangian(z, lam, mu))
            step = min(2 * step, eta)  # let the step grow back after a backtrack
        residual = u.sum() - n
        lam += config.rho / n * residual
        mu *= config.mu_decay
        eta *= config.eta_decay
        # Algorithm 1 stops on a small gradient alone (lines 12-14); that can stop with lambda
        # still far from its optimum and sum(x) off D, so stop only when x is also feasible.
        if converged and abs(residual) <= config.epsilon * n:
            break
    return u * unit


def _descend(
    u: np.ndarray,
    value: float,
    gradient: np.ndarray,
    step: float,
    evaluate: Callable[[np.ndarray], tuple[float, np.ndarray]],
) -> tuple[np.ndarray, float, np.ndarray, float]:
    """One scaled gradient step u - step * u^2 * grad, halving the step until u > 0 and L decreases.

    The diagonal scaling u^2 (the affine-scaling step of interior-point methods, whose log
    barrier it makes isotropic) keeps devices whose shares differ by orders of magnitude
    moving at the same relative pace; plain gradient steps are bound by the slowest device's
    curvature and leave the fast devices where they started.
    """
    direction = -(u * u) * gradient
    slope = float(gradient @ direction)
    while step > 1e-14:
        candidate = u + step * direction
        if (candidate > 0).all():
            new_value, new_gradient = evaluate(candidate)
            if new_value <= value + 1e-4 * step * slope:
                return candidate, new_value, new_gradient, step
        step /= 2
    return u, value, gradient, step


def _p_norm(y: np.ndarray, p: float) -> tuple[float, np.ndarray]:
    """||y||_p for y >= 0 and its gradient (y / ||y||_p)^(p-1), computed without overflow.

    Ratios are floored where their p-th power would be subnormal (those entries add less
    than 1e-250 of the norm): subnormal arithmetic is two orders of magnitude slower.
    """
    top = float(y.max())
    if top <= 0:
        return 0.0, np.zeros_like(y)
    ratio = np.maximum(y / top, 1e-250 ** (1 / p))
    total = float(np.sum(_power(ratio, p)))
    root = total ** (1 / p)
    return top * root, _power(ratio / root, p - 1)


def _power(x: np.ndarray, exponent: float) -> np.ndarray:
    """x ** exponent; by repeated squaring for integer exponents, ~20x faster than np.power."""
    if exponent != int(exponent) or not 0 < exponent <= 1 << 16:
        return x**exponent
    n = int(exponent)
    result = None
    square = x
    while n:
        if n & 1:
            result = square.copy() if result is None else result * square
        n >>= 1
        if n:
            square = square * square
    return result


def round_preserving_sum(relaxed: np.ndarray, total: int, minimum: int = 0) -> np.ndarray:
    """Round real shares to integers >= ``minimum`` that sum to ``total`` (largest remainder).

    Each result lies within one of ``max(relaxed, minimum)`` rescaled to the total, so the
    rounding moves x by less than one sample per device (the neighbourhood of Theorem 2).
    Batch sizes are not touched, so constraint (4) still holds.
    """
    n = len(relaxed)
    spare = total - minimum * n
    if spare < 0:
        raise ConfigError(f"dataset_size {total} cannot give {n} devices min_samples={minimum}")
    extra = np.maximum(np.nan_to_num(relaxed, nan=0.0) - minimum, 0.0)
    if extra.sum() <= 0:
        extra = np.ones(n)
    quota = extra / extra.sum() * spare  # normalize first: spare / a subnormal sum overflows
    shares = np.floor(quota).astype(np.int64)
    leftover = spare - int(shares.sum())
    order = np.lexsort((np.arange(n), -(quota - shares)))  # largest remainder, then lowest index
    shares[order[:leftover]] += 1
    return shares + minimum


def round_to_batches(
    model: CostModel, relaxed: np.ndarray, total: int, epochs: int, minimum: int = 0
) -> np.ndarray:
    """Round real shares to whole batches, then give the remaining samples a batch at a time.

    Each device first keeps floor(x_i / bs_i) whole batches (at least ``minimum`` samples);
    the samples left over go, up to one more batch per device, to the devices for which
    num * (epoch with that batch) + (send time with it) is least. The result sums to
    ``total`` and lies within one batch of x (below it, or above by less than a batch).
    """
    bs = model.batch_size
    whole = np.floor(np.maximum(np.nan_to_num(relaxed, nan=0.0), 0.0) / bs).astype(np.int64)
    shares = np.maximum(whole * bs, minimum)
    left = total - int(shares.sum())
    if left < 0:  # the minimum pushed the floor above the total: fall back to nearest rounding
        return round_preserving_sum(relaxed, total, minimum)
    batches = -(-shares // bs)
    room = batches * bs - shares  # free slots in a partial last batch cost no extra compute
    room = np.where(room > 0, room, bs)
    extra_batches = np.where(batches * bs - shares > 0, batches, batches + 1)
    cost = epochs * (model.comm_s + extra_batches * model.batch_time_s) + model.send_s(shares + room)
    order = np.lexsort((np.arange(len(bs)), cost))
    room = room[order]
    give = np.minimum(room, np.maximum(0, left - (np.cumsum(room) - room)))
    shares[order] += give
    remainder = total - int(shares.sum())
    if remainder:  # more left than one batch per device can hold (x far from the total)
        return round_preserving_sum(relaxed, total, minimum)
    return shares
