"""LFPS state of a batch of requests in padded, fixed-shape tensors (the GPU decode path).

A *selection head* owns one pair of score tables and one list of selected keys; it serves
``rows`` query heads of one KV head: ``rows = 1`` is the reference's per-query-head LFPS,
``rows = Hq / Hkv`` shares one selection among a KV head's query heads (``redknot.lfps.batched``
says how). ``Hs = Hq / rows``.

| field        | shape           | dtype   | meaning                                             |
| ------------ | --------------- | ------- | --------------------------------------------------- |
| ``vertical`` | [B, Hs, N_max]  | float32 | stored vertical table by position                   |
| ``slash``    | [B, Hs, N_max]  | float32 | stored slash table by distance                      |
| ``scale``    | [B, Hs]         | float32 | true table = stored * scale (lazy decay, below)     |
| ``mean_key`` | [B, Hkv, D]     | float32 | mean non-sink prompt key                            |
| ``mean_value``| [B, Hkv, D]    | float32 | mean non-sink prompt value                          |
| ``query_stat``| [B, Hq]        | float32 | Var(q) / ``|q|^2`` of the last prefill query        |
| ``index``     | [b] or None    | int32   | the row each of the step's ``b`` requests uses      |

With ``index`` the tensors hold ``B`` rows (a server's slots) and a step over ``b`` requests
reads and updates row ``index[i]`` for request ``i`` (several requests may share a scratch row
whose contents do not matter); without it request ``i`` uses row ``i`` (``b = B``).

Invariant: before a step over ``n`` keys, entries at positions / distances ``>= n - 1`` are 0.

Lazy decay: Eq. 10 multiplies a whole table by ``gamma`` each step; here only ``scale`` is
multiplied and the new terms are added divided by it, so a step writes only its selected
entries. Every decision (Eq. 8 thresholds, Eq. 9 means, priorities) is scale-free. Stored values
grow as ``gamma^-steps``: call ``renormalize_`` every few hundred steps (float32 holds
``0.95^-1700``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from redknot.lfps.state import LfpsState


@dataclass
class LfpsBatchState:
    """Score tables and priors of a batch (module table for shapes)."""

    vertical: torch.Tensor
    slash: torch.Tensor
    scale: torch.Tensor
    mean_key: torch.Tensor
    mean_value: torch.Tensor
    query_stat: torch.Tensor
    rows: int
    index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        B, Hs, N = self.vertical.shape
        Hkv, D = self.mean_key.shape[1:]
        Hq = self.query_stat.shape[1]
        assert self.slash.shape == (B, Hs, N) and self.scale.shape == (B, Hs), self.slash.shape
        assert self.mean_value.shape == (B, Hkv, D) and self.query_stat.shape == (B, Hq)
        assert Hs * self.rows == Hq and Hq % Hkv == 0 and (Hq // Hkv) % self.rows == 0, (
            Hs, self.rows, Hq, Hkv,
        )  # fmt: skip
        for name in ("vertical", "slash", "scale", "mean_key", "mean_value", "query_stat"):
            t = getattr(self, name)
            assert t.dtype == torch.float32 and t.is_contiguous(), f"{name}: {t.dtype}"
        if self.index is not None:
            assert self.index.dtype == torch.int32 and self.index.dim() == 1, self.index.dtype

    @property
    def batch_size(self) -> int:
        """Requests of a step: ``len(index)``, else the rows."""
        return self.vertical.shape[0] if self.index is None else self.index.shape[0]

    def state_rows(self) -> torch.Tensor:
        """[batch_size] int32: the row of each request (``index``, else ``0 .. B - 1``)."""
        if self.index is not None:
            return self.index
        return _arange(self.vertical.shape[0], self.vertical.device)

    @property
    def selection_heads(self) -> int:
        return self.vertical.shape[1]

    @property
    def max_len(self) -> int:
        return self.vertical.shape[2]

    def true_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(vertical, slash)`` with the lazy decay applied, [B, Hs, N_max] each."""
        return self.vertical * self.scale[..., None], self.slash * self.scale[..., None]

    def clone(self) -> LfpsBatchState:
        return self.to(self.vertical.device, copy=True)

    def to(self, device: torch.device | str, copy: bool = False) -> LfpsBatchState:
        """The state with its tensors on ``device`` (copies if ``copy``)."""
        moved = {
            f.name: getattr(self, f.name).to(device, copy=copy)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def renormalize_(self) -> None:
        """Fold ``scale`` into the stored tables (a pass over them; outside the hot loop)."""
        self.vertical.mul_(self.scale[..., None])
        self.slash.mul_(self.scale[..., None])
        self.scale.fill_(1.0)


@functools.cache
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``0 .. n - 1`` as int32 on ``device``, made once (a copy from the host cannot be
    captured in a CUDA graph)."""
    return torch.arange(n, dtype=torch.int32, device=device)


def pack_states(
    states: list[LfpsState], max_len: int, rows: int, num_kv_heads: int
) -> LfpsBatchState:
    """A batch state from per-request reference states (``build_state`` over K/V expanded to the
    query heads). With ``rows > 1`` a selection head's tables are the mean of its query heads'.

    Args:
        states: one per request, tables of ``n_b - 1`` keys (``<= max_len``).
        max_len: ``N_max``, the table width (the longest ``n_b`` of any step to come).
        rows: query heads per selection head.
        num_kv_heads: ``Hkv`` (the priors are stored per KV head).
    """
    Hq = states[0].vertical.shape[0]
    grp = Hq // num_kv_heads

    def table(x: torch.Tensor) -> torch.Tensor:
        x = x.view(Hq // rows, rows, -1).mean(1)
        return torch.nn.functional.pad(x, (0, max_len - x.shape[1]))

    return LfpsBatchState(
        vertical=torch.stack([table(s.vertical) for s in states]).contiguous(),
        slash=torch.stack([table(s.slash) for s in states]).contiguous(),
        scale=torch.ones(len(states), Hq // rows),
        mean_key=torch.stack([s.mean_key[::grp] for s in states]).contiguous(),
        mean_value=torch.stack([s.mean_value[::grp] for s in states]).contiguous(),
        query_stat=torch.stack([s.query_stat for s in states]).contiguous(),
        rows=rows,
    )
