"""The knobs of LFPS, one frozen dataclass (defaults are the paper's, not yet measured here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LfpsParams:
    """Hyper-parameters of the LFPS selection.

    Attributes:
        budget: keys kept per head and step besides the sinks (the ``k`` of Top-k); a float in
            (0, 1) is a fraction of the non-sink keys, an int >= 1 an absolute count.
        decay: ``gamma`` of Eq. 4 and Eq. 10 (paper: 0.95).
        lam: ``lambda`` of Eq. 8; a larger value raises the thresholds (paper: 0.1-0.4).
        sparsity_threshold: ``tau`` of Eq. 6; heads whose sink ratio exceeds it take the bypass
            (paper: 0.85). A value > 1 disables the bypass.
        num_sink: leading tokens always attended and kept out of the score tables (paper: 4).
        local_window: most recent tokens of the local-attention term of Eq. 5 (paper: 5).
        history_steps: prefill queries (the last ones) that build the tables of Eq. 4.
        offsets: the expansion offsets of Eq. 9.
    """

    budget: float | int = 0.02
    decay: float = 0.95
    lam: float = 0.2
    sparsity_threshold: float = 0.85
    num_sink: int = 4
    local_window: int = 5
    history_steps: int = 64
    offsets: tuple[int, ...] = (-1, 0, 1, 2)

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        if self.budget <= 0:
            raise ValueError(f"budget must be > 0 (fraction or count), got {self.budget}")
        if self.num_sink < 0 or self.local_window < 1 or self.history_steps < 1:
            raise ValueError("num_sink >= 0, local_window >= 1 and history_steps >= 1 required")

    def budget_for(self, num_keys: int) -> int:
        """Top-k size for ``num_keys`` non-sink keys (at least 1, at most ``num_keys``)."""
        if isinstance(self.budget, float) and self.budget < 1.0:
            k = round(self.budget * num_keys)
        else:
            k = int(self.budget)
        return max(1, min(k, num_keys))
