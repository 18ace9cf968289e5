"""The reference runner: a Llama-family model computed layer by layer under a head map.

It is the oracle for the SGLang path (same head-class semantics, plain PyTorch), the engine of
the head profiler (attention statistics per layer and head) and the host of CPU recovery
policies (:mod:`redknot.reference.hooks`). One sequence at a time.

>>> runner = ReferenceRunner(hf_model)
>>> out = runner.forward(ids, head_map=hm, probe_last=32)   # ids: [T] int64
>>> out.logits.shape, out.kv.length, out.probes[5].outside_mass.shape
(torch.Size([1, V]), T, torch.Size([Hq]))
>>> gen = runner.generate(ids, head_map=hm, max_new_tokens=16, stop_token_ids=[eos])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from redknot.headmap import HeadMap, ModelShape
from redknot.reference.attention import head_class_attention
from redknot.reference.hooks import LayerContext, LayerHooks
from redknot.reference.kv import ReferenceKV
from redknot.reference.model import LlamaFamily
from redknot.reference.stats import AttentionProbe, probe_attention


@dataclass
class ForwardResult:
    """Outputs of one forward call over ``T`` new tokens.

    | field     | shape                     | meaning                                        |
    | --------- | ------------------------- | ---------------------------------------------- |
    | ``logits``| [R, vocab] float32        | logits of the requested rows                   |
    | ``rows``  | [R] int64                 | which rows ``logits`` belong to                |
    | ``hidden``| [T, D]                    | residual stream after the last layer (pre-norm) |
    | ``kv``    | ReferenceKV or None       | past + new KV (``keep_kv=True``)                |
    | ``probes``| per layer AttentionProbe or None | statistics of probed rows               |
    """

    logits: Tensor
    rows: Tensor
    hidden: Tensor
    kv: ReferenceKV | None
    probes: list[AttentionProbe | None] = field(default_factory=list)


@dataclass
class Generation:
    """A greedy continuation: ``tokens`` (generated ids, stop token included if hit) and the
    first generated token's logits ``first_logits`` ``[vocab]`` float32."""

    tokens: list[int]
    first_logits: Tensor
    prompt_len: int


class ReferenceRunner:
    """Runs a Hugging Face Llama-family model (``LlamaForCausalLM`` and relatives) under a
    head map. Without a map every head is global: the dense model."""

    def __init__(self, hf_model: nn.Module) -> None:
        self.model = LlamaFamily(hf_model)

    @property
    def shape(self) -> ModelShape:
        return self.model.shape

    def _map(self, head_map: HeadMap | None) -> HeadMap:
        if head_map is None:
            return HeadMap.every_head_global(self.shape)
        head_map.validate_against(self.shape, source="head map given to the reference runner")
        return head_map

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor | Sequence[int],
        *,
        head_map: HeadMap | None = None,
        hooks: LayerHooks | None = None,
        past: ReferenceKV | None = None,
        probe_last: int = 0,
        probe_edge: int = 16,
        keep_probs: bool = False,
        logits_rows: str | Tensor = "last",
        keep_kv: bool = True,
    ) -> ForwardResult:
        """Compute ``input_ids`` (``[T]`` or ``[1, T]``) after ``past`` (positions continue
        from ``past.length``). ``logits_rows``: ``"last"``, ``"all"``, ``"none"`` or an
        ``[R]`` int64 tensor of rows. ``probe_last``: probe that many final rows in every
        layer (``probe_edge`` sets the window-edge width of the statistics)."""
        m = self.model
        hm = self._map(head_map)
        hooks = hooks or LayerHooks()
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=m.device).reshape(-1)
        num_new, past_len = ids.numel(), 0 if past is None else past.length
        assert num_new > 0, "forward needs at least one new token"
        assert past is None or past.num_layers == m.num_layers, "past KV of another model"
        positions = torch.arange(past_len, past_len + num_new, device=m.device)
        default_probe = torch.arange(max(num_new - probe_last, 0), num_new, device=m.device)

        x = m.embed(ids)
        keys, values, probes = [], [], []
        for layer in range(m.num_layers):
            classes = hooks.head_classes(layer, hm.classes[layer])
            assert len(classes) == len(hm.classes[layer]), (layer, classes)
            ctx = LayerContext(layer, positions, past_len, classes, hm.window, hm.sink, m)
            q, k, v = m.qkv(layer, x, positions)
            if past is not None:
                k = torch.cat((past.keys[layer], k), dim=1)
                v = torch.cat((past.values[layer], v), dim=1)
            restored = hooks.restore_classes(ctx, q, k, v)
            if restored != classes:
                assert len(restored) == len(classes), (layer, restored)
                classes = restored
                ctx = replace(ctx, classes=classes)
            k, v = hooks.edit_kv(ctx, k, v)
            if keep_kv:
                keys.append(k)
                values.append(v)

            rows = hooks.attention_rows(ctx)
            q_rows = q if rows is None else q[:, rows]
            q_pos = positions if rows is None else positions[rows]
            o = head_class_attention(
                q_rows, k, v, q_pos, classes, window=hm.window, sink=hm.sink, scale=m.scale
            )
            update = m.attn_output(layer, o)
            x = x + update if rows is None else x.index_add(0, rows, update)

            probe_rows = hooks.probe_rows(ctx)
            probe_rows = default_probe if probe_rows is None else probe_rows
            probe = None
            if probe_rows.numel():
                probe = probe_attention(
                    q[:, probe_rows],
                    k,
                    probe_rows,
                    positions[probe_rows],
                    classes,
                    window=hm.window,
                    sink=hm.sink,
                    edge=probe_edge,
                    scale=m.scale,
                    keep_probs=keep_probs,
                )
            probes.append(probe)

            ffn = hooks.ffn_rows(ctx, probe)
            if ffn is None:
                x = x + m.ffn(layer, x)
            elif ffn.numel():
                x = x.index_add(0, ffn, m.ffn(layer, x[ffn]))
            hooks.after_layer(ctx, x, probe)

        out_rows = self._logit_rows(logits_rows, num_new, m.device)
        logits = m.logits(x[out_rows]).to(torch.float32)
        kv = ReferenceKV(keys, values) if keep_kv else None
        return ForwardResult(logits=logits, rows=out_rows, hidden=x, kv=kv, probes=probes)

    @staticmethod
    def _logit_rows(spec: str | Tensor, num_new: int, device: torch.device) -> Tensor:
        if isinstance(spec, Tensor):
            return spec.to(device=device, dtype=torch.int64)
        if spec == "last":
            return torch.tensor([num_new - 1], device=device)
        if spec == "all":
            return torch.arange(num_new, device=device)
        if spec == "none":
            return torch.zeros(0, dtype=torch.int64, device=device)
        raise ValueError(f"logits_rows must be 'last', 'all', 'none' or a tensor, got {spec!r}")

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor | Sequence[int],
        *,
        head_map: HeadMap | None = None,
        hooks: LayerHooks | None = None,
        max_new_tokens: int = 32,
        stop_token_ids: Sequence[int] = (),
        past: ReferenceKV | None = None,
    ) -> Generation:
        """Greedy decoding. The hooks see the prefill (``ctx.past_len == 0``, or
        ``past.length`` when ``input_ids`` continue a cached ``past``, e.g. an exact-prefix
        hit) and every decode step (one row after the prompt)."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
        out = self.forward(ids, head_map=head_map, hooks=hooks, past=past)
        first_logits = out.logits[-1]
        tokens = [int(first_logits.argmax())]
        kv = out.kv
        stops = {int(t) for t in stop_token_ids}
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            out = self.forward([tokens[-1]], head_map=head_map, hooks=hooks, past=kv)
            kv = out.kv
            tokens.append(int(out.logits[-1].argmax()))
        prompt_len = ids.numel() + (0 if past is None else past.length)
        return Generation(tokens=tokens, first_logits=first_logits, prompt_len=prompt_len)
