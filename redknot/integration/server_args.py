"""redknot options on SGLang's server arguments.

The hooks here add ``--redknot-*`` flags to ``sglang.launch_server`` and accept
``redknot_*`` keywords in ``sgl.Engine(...)``. After SGLang resolves its own arguments, the
redknot configuration is merged (config file, then flags), validated against the served model
and the TP size, and published to every process of the server through
``REDKNOT_RESOLVED_CONFIG``: the scheduler processes read it there when they build the backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from typing import Any

from redknot import envs
from redknot.config import RedknotConfig, RedknotConfigError
from redknot.headmap import HeadMapError, ModelShape
from redknot.headmap.served import ModelSignature
from redknot.pool.layout import HeadLayout

logger = logging.getLogger(__name__)

BACKEND_NAME = "redknot"
CONFIG_FILE_KEY = "config"
_PREFIX = "redknot_"

# Options given to the ServerArgs being built in this process (CLI namespace or Engine
# keywords), consumed by its __post_init__.
_pending: dict[str, Any] = {}


def option_keys() -> list[str]:
    return [CONFIG_FILE_KEY] + RedknotConfig.field_names()


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add the ``--redknot-*`` flags; ``None`` defaults mean "not given"."""
    group = parser.add_argument_group("redknot (with --attention-backend redknot)")
    group.add_argument(
        "--redknot-config",
        dest="redknot_config",
        default=None,
        help="JSON or YAML file with redknot options (keys as the flags without the "
        "--redknot- prefix, dashes as underscores); flags override it.",
    )
    for f in dataclasses.fields(RedknotConfig):
        flag = "--redknot-" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": _PREFIX + f.name, "default": None}
        if f.type == "bool":
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = float if "float" in f.type else int if "int" in f.type else str
        group.add_argument(flag, help=f.metadata["help"], **kwargs)


def take_cli_options(args: argparse.Namespace) -> None:
    """Move the ``redknot_*`` attributes of a parsed namespace into ``_pending``."""
    for key in option_keys():
        value = getattr(args, _PREFIX + key, None)
        if hasattr(args, _PREFIX + key):
            delattr(args, _PREFIX + key)
        if value is not None:
            _pending[key] = value


def take_engine_options(kwargs: dict) -> dict:
    """Move ``redknot_*`` keywords of ``ServerArgs(...)``/``sgl.Engine(...)`` into ``_pending``."""
    known = set(option_keys())
    for name in [k for k in kwargs if k.startswith(_PREFIX)]:
        key = name[len(_PREFIX) :]
        if key not in known:
            raise RedknotConfigError(
                f"unknown redknot option {name!r}; known: {[_PREFIX + k for k in sorted(known)]}"
            )
        value = kwargs.pop(name)
        if value is not None:
            _pending[key] = value
    return kwargs


def uses_redknot(server_args: Any) -> bool:
    backends = {
        server_args.attention_backend,
        getattr(server_args, "prefill_attention_backend", None),
        getattr(server_args, "decode_attention_backend", None),
    }
    return BACKEND_NAME in backends


def _reject_unsupported(server_args: Any) -> None:
    """Features the redknot backend does not serve: refuse them instead of misbehaving."""
    problems = []
    pre = getattr(server_args, "prefill_attention_backend", None)
    dec = getattr(server_args, "decode_attention_backend", None)
    if {pre, dec} - {None, BACKEND_NAME}:
        problems.append(
            "redknot must serve both prefill and decode: drop --prefill-attention-backend/"
            "--decode-attention-backend or set both to redknot"
        )
    if server_args.speculative_algorithm is not None:
        problems.append("speculative decoding is not supported: drop --speculative-algorithm")
    if server_args.enable_dp_attention:
        problems.append("DP attention is not supported: drop --enable-dp-attention")
    if server_args.pp_size > 1:
        problems.append("pipeline parallelism is not supported: use --pp-size 1")
    if server_args.enable_hierarchical_cache:
        problems.append("hierarchical cache is not supported: drop --enable-hierarchical-cache")
    if server_args.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        problems.append(
            f"--kv-cache-dtype {server_args.kv_cache_dtype} is not supported: "
            "redknot stores KV in the model dtype (use auto)"
        )
    if server_args.tokenizer_worker_num > 1:
        problems.append(
            "--tokenizer-worker-num > 1 is not supported: redknot's segment API runs in the "
            "launching process; use 1"
        )
    if server_args.page_size != 1:
        problems.append(f"--page-size {server_args.page_size} is not supported: use 1")
    if server_args.post_capture_kv_sizing_planned():
        problems.append(
            "post-capture KV sizing is not supported: unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"
        )
    if server_args.radix_cache_backend not in (None, BACKEND_NAME):
        problems.append(
            f"--radix-cache-backend {server_args.radix_cache_backend} cannot hold redknot's "
            f"head-segmented KV: omit it (redknot selects its own '{BACKEND_NAME}' cache)"
        )
    if problems:
        raise RedknotConfigError("--attention-backend redknot: " + "; ".join(problems))


def resolve(server_args: Any) -> RedknotConfig | None:
    """Called after ``ServerArgs.__post_init__``: validate and publish the configuration."""
    options = dict(_pending)
    _pending.clear()
    if not uses_redknot(server_args):
        if options:
            raise RedknotConfigError(
                f"redknot options {sorted(options)} were given but the attention backend is "
                f"{server_args.attention_backend!r}: add --attention-backend redknot"
            )
        return None
    _reject_unsupported(server_args)
    file_path = options.pop(CONFIG_FILE_KEY, None) or envs.REDKNOT_CONFIG.get()
    if server_args.model_path.lower() in ("none", "dummy"):
        config = RedknotConfig.merge(file_path, options)
    else:
        model_config = server_args.get_model_config()
        shape = ModelShape.from_hf_config(model_config.hf_config)
        signature = ModelSignature.from_hf_config(model_config.hf_config)
        config = RedknotConfig.merge(file_path, options, model=signature)
        try:
            head_map = config.resolve_head_map(
                shape,
                tp_size=server_args.tp_size,
                context_len=model_config.context_len,
                model_name=server_args.model_path,
            )
        except HeadMapError as e:
            raise RedknotConfigError(str(e)) from None
        logger.info(
            "redknot: policy %s, %d of %d KV heads global (%.1f%%), sink %d + window %d, "
            "segment cache %s, kernels %s",
            config.policy,
            head_map.num_global,
            head_map.model.num_layers * head_map.model.num_kv_heads,
            100 * head_map.global_fraction,
            head_map.sink,
            head_map.window,
            f"{config.segment_fraction:g} of the KV budget" if config.segment_fraction else "off",
            config.kernel,
        )
    if config.lfps != "off" and server_args.enable_mixed_chunk:
        raise RedknotConfigError(
            f"--redknot-lfps {config.lfps} cannot be combined with --enable-mixed-chunk: a "
            "decode step run inside a prefill batch would not update the request's LFPS state; "
            "drop one of them"
        )
    if server_args.radix_cache_backend != BACKEND_NAME:
        server_args.override("redknot", radix_cache_backend=BACKEND_NAME)
    envs.REDKNOT_RESOLVED_CONFIG.set(config.to_json())
    return config


def rank_layout(config: RedknotConfig, model_config: Any) -> HeadLayout:
    """The head layout this tensor-parallel rank serves, from a model's SGLang ``ModelConfig``."""
    from sglang.srt.runtime_context import get_parallel

    tp_size, tp_rank = get_parallel().attn_tp_size, get_parallel().attn_tp_rank
    head_map = config.resolve_head_map(
        ModelShape.from_hf_config(model_config.hf_config),
        tp_size=tp_size,
        context_len=model_config.context_len,
    )
    return HeadLayout.from_head_map(
        head_map, tp_size=tp_size, tp_rank=tp_rank, restore=config.restore_heads
    )


def published_config() -> RedknotConfig:
    """The configuration resolved by the launcher, as every server process sees it."""
    text = envs.REDKNOT_RESOLVED_CONFIG.get()
    if text is None:
        raise RedknotConfigError(
            "the redknot configuration was never resolved in this server: the redknot plugin "
            "did not run in the launching process (is the redknot package installed in the "
            "same environment as sglang, and SGLANG_PLUGINS unset or naming 'redknot'?)"
        )
    return _parsed(text)


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> RedknotConfig:
    """``text`` parsed and validated once: the scheduler asks for the configuration for every
    request it queues (the served policy), and parsing it takes ~0.07 ms."""
    return RedknotConfig.from_json(text)
