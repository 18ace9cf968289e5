"""The synthetic batch of the startup check (``redknot.attention.startup_check``) and its
reference attention.

Three requests run three forwards, as a server runs them: ``prefill`` (each request's prefix,
nothing cached), ``extend`` (new tokens over the cached prefix) and ``decode`` (one token).
With ``span = sink + window``:

| request | prefix (P)    | new (E) | whole length after decode      | what it covers                  |
| ------- | ------------- | ------- | ------------------------------ | ------------------------------- |
| 0       | span + 37     | 45      | span + 83                      | a ring that has wrapped         |
| 1       | span // 4     | 3       | below span (when span > 5)     | a request shorter than the span |
| 2       | span - 7      | 20      | span + 14                      | an extend crossing the span     |

With adaptive restore (``layout.restore > 0``), request 0 promotes the first local head of every
checked layer (``promoted``), which it then attends as a global head, so that the restore
columns and the kernels' per-request classes are checked too.

Keys and values are drawn once per request for its whole sequence, so the reference reads them
directly and never the stores the path under test wrote. Query, key and value of a forward are
slices of one fused ``[T, (Hq + 2 H) * D]`` tensor, with the strides of a model's QKV output.
Token slots are shuffled, so a slot mix-up cannot go unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.kernels.geometry import SegGeometry
from redknot.kernels.reference import visibility
from redknot.pool.layout import HeadLayout

PHASES = ("prefill", "extend", "decode")
_SCORE_BYTES = 1 << 25  # reference score matrix per query chunk (fp32)


@dataclass(frozen=True)
class Request:
    row: int  # req_pool_idx: row of req_to_token, ring slot
    prefix: int  # P: tokens the prefill phase computes and the extend phase finds cached
    new: int  # E: tokens of the extend phase

    @property
    def length(self) -> int:
        """Tokens after the decode phase."""
        return self.prefix + self.new + 1

    def positions(self, phase: str) -> range:
        return {
            "prefill": range(self.prefix),
            "extend": range(self.prefix, self.prefix + self.new),
            "decode": range(self.prefix + self.new, self.length),
        }[phase]


def synthetic_requests(sink: int, window: int, max_len: int) -> tuple[Request, ...]:
    """The requests of the module table, cut to ``max_len`` tokens each."""
    span = sink + window
    shapes = ((span + 37, 45), (max(1, span // 4), 3), (max(1, span - 7), 20))
    requests = []
    for row, (prefix, new) in enumerate(shapes, start=1):
        prefix = max(1, min(prefix, max_len - new - 1))
        requests.append(Request(row=row, prefix=prefix, new=new))
    return tuple(requests)


class SyntheticBatch:
    """Random Q/K/V of every request over its whole sequence, per layer of ``layout``, and the
    request-to-token table mapping them to shuffled token slots, on ``device``."""

    def __init__(
        self,
        layout: HeadLayout,
        requests: tuple[Request, ...],
        dtype: torch.dtype,
        device: torch.device,
        table_width: int,
        seed: int = 0,
    ):
        self.layout, self.requests, self.dtype, self.device = layout, requests, dtype, device
        self.geo = SegGeometry.from_layout(layout)
        g = torch.Generator().manual_seed(seed)
        total = sum(r.length for r in requests)
        self.num_slots = total + 1  # slot 0 is SGLang's padding slot, never used
        slots = 1 + torch.randperm(total, generator=g)
        self.req_to_token_cpu = torch.zeros((max(r.row for r in requests) + 1, table_width),
                                            dtype=torch.int32)  # fmt: skip
        start = 0
        for r in requests:
            self.req_to_token_cpu[r.row, : r.length] = slots[start : start + r.length]
            start += r.length
        Hq, H, D = layout.num_q_heads, layout.num_kv_heads, layout.head_dim
        width = (Hq + 2 * H) * D
        # _base[b]: [length_b, (Hq + 2 H) * D]; layer l sees it rolled by l * 17 columns, so
        # that layers hold different K/V at the memory cost of one layer.
        self._base = [torch.randn(r.length, width, generator=g).to(dtype).to(device)
                      for r in requests]  # fmt: skip
        # (request index, layer) -> the local KV head the request promoted there
        self.promoted: dict[tuple[int, int], int] = {}
        if layout.restore:
            for layer in range(layout.num_layers):
                local = layout.local_heads(layer)
                if local:
                    self.promoted[(0, layer)] = local[0]

    def promote_in(self, promoted: torch.Tensor) -> None:
        """Write :attr:`promoted` into a pool's ``[rows, layers, R]`` table of promoted heads."""
        for (b, layer), h in self.promoted.items():
            promoted[self.requests[b].row, layer, 0] = h

    def _is_local(self, b: int, layer: int) -> torch.Tensor:
        """[H] bool: the KV heads request ``b`` attends as local heads in ``layer``."""
        classes = list(self.layout.classes[layer])
        if (b, layer) in self.promoted:
            classes[self.promoted[(b, layer)]] = "G"
        return torch.tensor([c != "G" for c in classes], device=self.device)

    def fused(self, layer: int) -> list[torch.Tensor]:
        """Per request, [length, (Hq + 2 H) * D]: its fused Q/K/V projection in ``layer``."""
        return [x.roll(layer * 17, dims=1) for x in self._base]

    # ---- one forward -------------------------------------------------------------------------

    def forward_batch(self, phase: str, req_to_token: torch.Tensor):
        """SGLang's ``ForwardBatch`` of ``phase`` over every request."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        dev = self.device
        pos = [r.positions(phase) for r in self.requests]
        prefix = [p.start for p in pos]
        lens = [len(p) for p in pos]
        seq = torch.tensor([p.stop for p in pos], dtype=torch.int64)
        rows = torch.tensor([r.row for r in self.requests], dtype=torch.int64)
        loc = torch.cat([req_to_token[r.row, p.start : p.stop].cpu() for r, p in zip(
            self.requests, pos)]).to(torch.int64)  # fmt: skip
        positions = torch.cat([torch.arange(p.start, p.stop) for p in pos])
        decode = phase == "decode"
        start_loc = torch.cumsum(torch.tensor([0] + lens[:-1]), 0)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(self.requests),
            input_ids=torch.zeros(sum(lens), dtype=torch.int64, device=dev),
            req_pool_indices=rows.to(dev),
            seq_lens=seq.to(dev),
            out_cache_loc=loc.to(dev),
            seq_lens_sum=int(seq.sum()),
            seq_lens_cpu=seq,
            positions=positions.to(dev),
            extend_seq_lens=None if decode else torch.tensor(lens, dtype=torch.int32).to(dev),
            extend_prefix_lens=None if decode else torch.tensor(prefix, dtype=torch.int32).to(dev),
            extend_start_loc=None if decode else start_loc.to(torch.int32).to(dev),
            extend_prefix_lens_cpu=None if decode else prefix,
            extend_seq_lens_cpu=None if decode else lens,
        )

    def qkv_of(self, layer: int, phase: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` [T, Hq * D], ``k``, ``v`` [T, H, D] of a phase: column slices of one fused
        tensor, shaped as SGLang's ``RadixAttention.forward`` hands them to a backend."""
        parts = []
        for r, x in zip(self.requests, self.fused(layer)):
            pos = r.positions(phase)
            parts.append(x[pos.start : pos.stop])
        fused = torch.cat(parts)
        Hq, H, D = self.layout.num_q_heads, self.layout.num_kv_heads, self.layout.head_dim
        q, k, v = fused.split([Hq * D, H * D, H * D], dim=1)
        return q, k.view(-1, H, D), v.view(-1, H, D)

    # ---- the reference -----------------------------------------------------------------------

    def reference(self, layer: int, phase: str, scale: float) -> torch.Tensor:
        """[T, Hq, D] float32: each query attends the keys its head class lets it see
        (``redknot.kernels.reference.visibility``), in fp32 with full-precision matmuls."""
        return self.reference_with_lse(layer, phase, scale)[0]

    def reference_with_lse(
        self, layer: int, phase: str, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`reference` and ``[T, Hq]`` the natural-log log-sum-exp of each query's scaled
        scores over the keys it sees."""
        Hq, H, D = self.layout.num_q_heads, self.layout.num_kv_heads, self.layout.head_dim
        grp = Hq // H
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            outs, lses = [], []
            for b, (r, x) in enumerate(zip(self.requests, self.fused(layer))):
                local_q = self._is_local(b, layer).repeat_interleave(grp)[:, None, None]
                x = x.float()
                q_all = x[:, : Hq * D].view(-1, Hq, D)
                k = x[:, Hq * D : (Hq + H) * D].view(-1, H, D).repeat_interleave(grp, dim=1)
                v = x[:, (Hq + H) * D :].view(-1, H, D).repeat_interleave(grp, dim=1)
                pos = r.positions(phase)
                keys = torch.arange(pos.stop, device=self.device)
                k, v = k[: pos.stop], v[: pos.stop]
                chunk = max(1, _SCORE_BYTES // (4 * Hq * pos.stop))
                for c in range(pos.start, pos.stop, chunk):
                    i = torch.arange(c, min(c + chunk, pos.stop), device=self.device)
                    vis = torch.where(
                        local_q,
                        visibility(i, keys, True, self.geo)[None],
                        visibility(i, keys, False, self.geo)[None],
                    )  # [Hq, n, N]
                    s = torch.einsum("nhd,mhd->hnm", q_all[i], k) * scale
                    s = s.masked_fill(~vis, float("-inf"))
                    lse = torch.logsumexp(s, dim=-1)  # every query sees itself: finite
                    outs.append(torch.einsum("hnm,mhd->nhd", torch.exp(s - lse[..., None]), v))
                    lses.append(lse.T)
        finally:
            torch.set_float32_matmul_precision(precision)
        return torch.cat(outs), torch.cat(lses)

    def locate(self, phase: str, token: int) -> tuple[int, int]:
        """(request index, position) of row ``token`` of a ``phase`` forward."""
        for b, r in enumerate(self.requests):
            n = len(r.positions(phase))
            if token < n:
                return b, r.positions(phase).start + token
            token -= n
        raise IndexError(token)
