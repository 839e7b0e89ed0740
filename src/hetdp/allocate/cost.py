"""The C-ADP cost model (paper eqs. (2)-(7)) as arrays, shared by the planner and its solvers.

For an allocation D_1..D_N of a dataset over N devices, device i spends

- T_send,i = b D_i / B_0i seconds receiving its data, once (eq. 2);
- T_comp,i = ceil(D_i / batchsize(i)) T_i^batch seconds computing, per epoch (eq. 5);
- T_comm,i = 2 (alpha_0i + M_m / B_0i) seconds exchanging the model, per epoch (eq. 6);

and the training takes max_i T_send,i + num * max_i (T_comp,i + T_comm,i) (eq. 7).
Every device pays T_comm every epoch, even with no data: the paper's C (eq. 8) is a
constant, and a rank with no data still takes part in the per-epoch merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetdp.cluster.spec import ClusterSpec


@dataclass(frozen=True, eq=False)
class CostModel:
    """Per-device constants of eqs. (2)-(6), one array entry per device, in cluster order.

    Batch sizes already satisfy constraint (4) (``DeviceSpec.feasible_batch_size``).
    """

    names: tuple[str, ...]
    send_s_per_sample: np.ndarray
    """b / B_0i: seconds to send one sample (0 for the data owner itself, or when only indices travel)."""
    comm_s: np.ndarray
    """2 (alpha_0i + M_m / B_0i): seconds of parameter exchange per epoch (eq. 6)."""
    batch_time_s: np.ndarray
    """T_i^batch for a batch of ``batch_size`` samples."""
    batch_size: np.ndarray
    """batchsize(i) as int64, <= P_max(i)."""

    @classmethod
    def from_cluster(cls, cluster: ClusterSpec) -> CostModel:
        devices = cluster.devices
        return cls(
            names=tuple(device.name for device in devices),
            send_s_per_sample=np.array([cluster.send_s_per_sample(d) for d in devices], dtype=float),
            comm_s=np.array([cluster.comm_s(d) for d in devices], dtype=float),
            batch_time_s=np.array([d.feasible_batch_time_s for d in devices], dtype=float),
            batch_size=np.array([d.feasible_batch_size for d in devices], dtype=np.int64),
        )

    @property
    def size(self) -> int:
        return len(self.names)

    def batches(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """ceil(D_i / batchsize(i)): local batches per epoch."""
        samples = np.asarray(samples, dtype=np.int64)
        return -(-samples // self.batch_size)

    def send_s(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """T_send,i (eq. 2)."""
        return self.send_s_per_sample * np.asarray(samples, dtype=float)

    def compute_s(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """T_comp,i per epoch (eq. 5), with the ceiling."""
        return self.batches(samples) * self.batch_time_s

    def epoch_s(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """T_comp,i + T_comm,i: each device's time for one epoch, merge included."""
        return self.compute_s(samples) + self.comm_s

    def total_s(self, samples: Sequence[int] | np.ndarray, epochs: int) -> float:
        """The eq. (7) objective: max_i T_send,i + epochs * max_i (T_comp,i + T_comm,i)."""
        return float(self.send_s(samples).max() + epochs * self.epoch_s(samples).max())
