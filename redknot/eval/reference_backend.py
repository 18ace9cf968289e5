"""The reference backend: cases served by :mod:`redknot.recovery` on the PyTorch reference
runner (CPU by default). No TTFT: the reference path is an oracle, not a fast path."""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from typing import Any

import torch

from redknot.eval.base import FidelityBackend, PolicyOutput, PolicySetting
from redknot.eval.cases import Case
from redknot.eval.compose import ComposedCase, auto_chunked, auto_learned, compose
from redknot.headmap import HeadMap
from redknot.recovery import (
    POLICIES,
    RecoveryOptions,
    ReusePrompt,
    Segment,
    cache_kv,
    create_policy,
    serve,
)
from redknot.reference import ReferenceRunner, load_model


class ReferenceBackend(FidelityBackend):
    """Serves cases with a loaded Hugging Face model, its tokenizer and a head map (see
    :meth:`load`)."""

    name = "reference"

    def __init__(
        self,
        hf_model: torch.nn.Module,
        tokenizer,
        head_map: HeadMap,
        *,
        model_name: str,
        head_map_path: str = "",
        device: str = "cpu",
        max_new_tokens: int = 16,
        auto_chunk_tokens: int | None = None,
        auto_mode: str = "cdc",
        auto_pool: tuple[str, ...] = (),
        capture_context: int = 0,
    ) -> None:
        self.capture_context = capture_context  # learned modes: captured after that many tokens
        self.runner = ReferenceRunner(hf_model)
        self.auto_chunk_tokens = auto_chunk_tokens  # None: the case's segments
        self.auto_mode = auto_mode  # cdc: chunks inside segments; cdc-edges, cdc-docs: learned
        self.auto_pool = auto_pool  # cdc-edges, cdc-docs: other documents, as neighbours
        self.dtype = next(hf_model.parameters()).dtype
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = device
        self.head_map_path = head_map_path
        self.head_map = head_map
        self.head_map.validate_against(self.runner.shape, source=head_map_path or "head map")
        self.max_new_tokens = max_new_tokens
        stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
        self.stop_token_ids = sorted(t for t in stops if isinstance(t, int) and t >= 0)

    @classmethod
    def load(
        cls,
        model: str,
        head_map: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_new_tokens: int = 16,
        auto_chunk_tokens: int | None = None,
        auto_mode: str = "cdc",
        auto_pool: tuple[str, ...] = (),
        capture_context: int = 0,
    ) -> ReferenceBackend:
        """Load ``model`` (a :func:`redknot.reference.resolve_source` spec, never downloaded)
        in ``dtype`` and the head map file ``head_map``."""
        hf_model, tokenizer, source = load_model(model, device=device, dtype=dtype)
        return cls(
            hf_model,
            tokenizer,
            HeadMap.load(head_map),
            model_name=source.name,
            head_map_path=head_map,
            device=device,
            max_new_tokens=max_new_tokens,
            auto_chunk_tokens=auto_chunk_tokens,
            auto_mode=auto_mode,
            auto_pool=auto_pool,
            capture_context=capture_context,
        )

    def composed(self, case: Case) -> ComposedCase:
        """The case's prompt; its segments, or under ``auto_chunk_tokens`` the chunks of it
        that automatic segments would reuse (``auto_mode``: ``cdc``, those inside one segment;
        ``cdc-edges`` / ``cdc-docs``, what the store holds after the documents were seen in
        other orders, :func:`redknot.eval.compose.auto_learned`)."""
        if self.auto_chunk_tokens is not None and self.auto_mode != "cdc":
            return auto_learned(
                self.tokenizer,
                case,
                self.auto_chunk_tokens,
                self.auto_mode,
                self.auto_pool,
                context_tokens=self.capture_context,
            )
        composed = compose(self.tokenizer, case)
        if self.auto_chunk_tokens is not None:
            composed = auto_chunked(composed, self.auto_chunk_tokens)
        return composed

    def describe(self) -> dict[str, Any]:
        hm = self.head_map
        detail = platform.processor() or platform.machine()
        device = str(self.device)
        if device.startswith("cuda") and torch.cuda.is_available():
            device = torch.cuda.get_device_name(torch.device(device))  # the GPU, not "cuda"
        return {
            "backend": self.name,
            "device": device,
            "device_detail": f"{self.device} ({torch.get_num_threads()} threads, {detail}, "
            f"{platform.platform()})",
            "dtype": str(self.dtype).removeprefix("torch."),
            "model": self.model_name,
            "head_map": {
                "path": self.head_map_path,
                "global_fraction": hm.global_fraction,
                "window": hm.window,
                "sink": hm.sink,
                "dense_layers": hm.dense_layers,
            },
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": self.stop_token_ids,
            "segments": (
                "case"
                if self.auto_chunk_tokens is None
                else (
                    f"auto chunks of ~{self.auto_chunk_tokens} tokens inside the case's segments"
                    if self.auto_mode == "cdc"
                    else f"--redknot-auto-segments {self.auto_mode} of ~{self.auto_chunk_tokens} "
                    "tokens after 16 prompts of the case's documents and two others in other orders"
                )
            ),
        }

    def _prompt(self, composed: ComposedCase, head_map: HeadMap | None) -> ReusePrompt:
        """The case with its prefix and segments cached under ``head_map`` (``None``: dense)."""
        ids = composed.ids
        prefix = None
        if composed.prefix_len:
            prefix = cache_kv(self.runner, ids[: composed.prefix_len], head_map)
        contexts = composed.contexts or ((),) * len(composed.segments)
        segments = tuple(
            Segment(s, e, cache_kv(self.runner, ids[s:e], head_map, context))
            for (s, e), context in zip(composed.segments, contexts)
        )
        return ReusePrompt(ids, segments, prefix)

    def run_case(self, case: Case, settings: Sequence[PolicySetting]) -> dict[str, PolicyOutput]:
        composed = self.composed(case)
        prompts: dict[tuple, ReusePrompt] = {}
        outputs = {}
        for setting in settings:
            serving_map = None
            if POLICIES[setting.policy].uses_head_map:
                serving_map = (setting.options or RecoveryOptions()).head_map(self.head_map)
            # full serves without reuse; its prompt's segments only label rows for the record
            key = (
                None
                if serving_map is None
                else (serving_map.window, serving_map.sink, serving_map.classes)
            )
            if key not in prompts:
                prompts[key] = self._prompt(composed, serving_map)
            prompt = prompts[key]
            policy = create_policy(
                setting.policy,
                prompt,
                shape=self.runner.shape,
                head_map=self.head_map,
                options=setting.options,
            )
            started = time.perf_counter()
            served = serve(
                self.runner,
                policy,
                max_new_tokens=self.max_new_tokens,
                stop_token_ids=self.stop_token_ids,
            )
            logits = served.generation.first_logits.detach().to("cpu", torch.float32)
            outputs[setting.label] = PolicyOutput(
                first_top=logits.topk(10).indices.tolist(),
                first_logits=logits,
                text=self.tokenizer.decode(served.generation.tokens, skip_special_tokens=True),
                tokens=served.generation.tokens,
                flops=served.flops.to_json(),
                fractions=served.fractions,
                restored_heads=served.restored_heads,
                wall_s=time.perf_counter() - started,
            )
        return outputs
