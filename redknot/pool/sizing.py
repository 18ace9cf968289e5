"""How the redknot pool divides the KV memory budget SGLang profiles.

SGLang sizes its KV pool as ``budget / cell_size`` token slots and derives
``max_running_requests`` from that. For redknot a token slot holds only the global heads
(``bytes_per_token``), and every request slot reserves one ring for its local heads
(``bytes_per_ring``), plus snapshot slots that keep the local KV of cached prefixes:

    budget = segment_bytes + fixed_bytes(rings + snapshots) + token_slots * bytes_per_token

``segment_bytes`` is ``--redknot-segment-fraction`` of the budget, taken first (the segment region
of ``redknot.pool.segment_region``; 0 when segment caching is off), and the rest is split as
below.

The number of request slots is ``--max-running-requests`` when given. Otherwise it is chosen so
that requests of ``BALANCE_LEN`` tokens exhaust request slots and token slots together:
``slots = budget / (ring_and_snapshot_bytes + BALANCE_LEN * bytes_per_token)``. Shorter requests
are then limited by request slots, longer ones by token slots. Serving mostly longer (shorter)
requests, pass ``--max-running-requests budget / (per_slot + L * bytes_per_token)`` for your
typical length ``L``. Snapshots are ``SNAPSHOTS_PER_REQUEST`` per request slot.

Under tensor parallelism every rank sizes its token slots, request slots and rings by the rank
that needs the most bytes (a map may give ranks different numbers of global heads in a layer).
SGLang's schedulers, one per rank, take the same admission decisions only if their pools have the
same capacity; a rank with fewer global heads leaves the difference unused.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from redknot.pool.kv_pool import bytes_per_ring, bytes_per_token
from redknot.pool.layout import HeadLayout
from redknot.pool.segment_region import SegmentPlan, plan_segments

logger = logging.getLogger(__name__)

BALANCE_LEN = 16384
SNAPSHOTS_PER_REQUEST = 0.25
MAX_REQUEST_SLOTS = 4096


@dataclass(frozen=True)
class SlotPlan:
    request_slots: int | None  # None: no local heads, SGLang decides
    snapshots: int
    fixed_bytes: int


def plan_slots(
    layouts: list[HeadLayout], dtype: torch.dtype, budget_bytes: int, requested: int | None
) -> SlotPlan:
    """Request and snapshot slots for the rank layouts ``layouts`` (the costliest decides)."""
    ring = max(bytes_per_ring(layout, dtype) for layout in layouts)
    token = max(bytes_per_token(layout, dtype) for layout in layouts)
    if ring == 0:
        return SlotPlan(request_slots=None, snapshots=0, fixed_bytes=0)
    if requested is not None:
        slots = requested
    else:
        per_request = ring * (1 + SNAPSHOTS_PER_REQUEST) + BALANCE_LEN * token
        slots = max(1, min(int(budget_bytes // per_request), MAX_REQUEST_SLOTS))
    snapshots = max(1, int(slots * SNAPSHOTS_PER_REQUEST))
    # One extra ring for SGLang's padding request row 0 (CUDA-graph padded batches).
    fixed = (slots + 1 + snapshots) * ring
    if fixed >= budget_bytes:
        raise ValueError(
            f"redknot: {slots} request slots need {fixed / (1 << 30):.2f} GB of local-head "
            f"rings, more than the {budget_bytes / (1 << 30):.2f} GB KV budget; lower "
            "--max-running-requests or raise --mem-fraction-static"
        )
    return SlotPlan(request_slots=slots, snapshots=snapshots, fixed_bytes=fixed)


# Per-configurator state (SGLang's KVCacheConfigurator has __slots__): id -> {"layout", "slots"}.
# Each entry keeps its configurator alive, so that an id is never reused for another one.
_state: dict[int, dict] = {}


def state_of(kvc: Any) -> dict:
    """The sizing state of one configurator (created empty on first use)."""
    entry = _state.setdefault(id(kvc), {"kvc": kvc})
    assert entry["kvc"] is kvc
    return entry


def is_redknot(kvc: Any) -> bool:
    return kvc.server_args.attention_backend == "redknot"


def layout_of(kvc: Any) -> HeadLayout:
    """The head layout of this rank, resolved once per KV-cache configurator."""
    cached = state_of(kvc).get("layout")
    if cached is not None:
        return cached
    from redknot.integration.server_args import published_config, rank_layout

    layout = rank_layout(published_config(), kvc.model_config)
    state_of(kvc)["layout"] = layout
    return layout


def cell_size(kvc: Any) -> int:
    """Bytes of one token slot: the costliest rank's, so every rank gets as many slots."""
    return max(bytes_per_token(layout, kvc.kv_cache_dtype) for layout in rank_layouts(kvc))


def rank_layouts(kvc: Any) -> list[HeadLayout]:
    """The head layout of every attention-TP rank (rank ``r`` at index ``r``), resolved once."""
    cached = state_of(kvc).get("rank_layouts")
    if cached is not None:
        return cached
    from sglang.srt.runtime_context import get_parallel

    from redknot.headmap import ModelShape
    from redknot.integration.server_args import published_config

    tp_size = get_parallel().attn_tp_size
    if tp_size == 1:
        layouts = [layout_of(kvc)]
    else:
        config = published_config()
        head_map = config.resolve_head_map(
            ModelShape.from_hf_config(kvc.model_config.hf_config),
            tp_size=tp_size,
            context_len=kvc.model_config.context_len,
        )
        layouts = [
            HeadLayout.from_head_map(
                head_map, tp_size=tp_size, tp_rank=r, restore=config.restore_heads
            )
            for r in range(tp_size)
        ]
    state_of(kvc)["rank_layouts"] = layouts
    return layouts


def reserve_segment_bytes(kvc: Any, budget_bytes: int) -> SegmentPlan:
    """Plan the segment region: the same page count on every TP rank (see segment_region)."""
    from redknot.integration.server_args import published_config

    config = published_config()
    plan = plan_segments(
        rank_layouts(kvc),
        kvc.kv_cache_dtype,
        budget_bytes,
        config.segment_fraction,
        config.segment_heads,
    )
    state_of(kvc)["segments"] = plan
    logger.info(
        "redknot: segment region of %d pages x %d tokens (%s heads) reserves %.2f GB",
        plan.num_pages,
        plan.page_tokens,
        plan.which,
        plan.reserved_bytes / (1 << 30),
    )
    return plan


def lfps_shape(kvc: Any):
    """The LFPS state's shape on this rank (``--redknot-lfps``), or None when it is off."""
    from redknot.integration.server_args import published_config
    from redknot.lfps.serving import LfpsShape, rows_of

    config = published_config()
    if config.lfps == "off":
        return None
    layout = layout_of(kvc)
    hq, hkv = layout.num_q_heads, layout.num_kv_heads
    return LfpsShape(
        num_layers=layout.num_layers, num_q_heads=hq, num_kv_heads=hkv,
        head_dim=layout.head_dim, rows=rows_of(config.lfps_selection, hq, hkv),
        max_len=kvc.model_config.context_len,
    )  # fmt: skip


LFPS_REQUESTS = 8  # --redknot-lfps-max-requests when not given and the KV is in GPU memory


def lfps_request_rows(
    requested: int | None, host_bytes: int, token_bytes: int, context: int,
    budget_bytes: int = 0, row_bytes: int = 0,
) -> int:  # fmt: skip
    """Rows of LFPS state: ``--redknot-lfps-max-requests`` if given; else, with the KV in a
    host store of ``host_bytes``, the full-context requests the store holds (at least
    ``LFPS_REQUESTS``: requests beyond the rows decode densely, across PCIe there); else
    ``LFPS_REQUESTS``. With ``budget_bytes`` of GPU KV budget beside the host store (a tiered
    store, ``redknot.pool.vmm``), each request takes a row of ``row_bytes`` from that budget and
    its tokens from either memory: ``(host + budget) // (context tokens + row)`` requests."""
    if requested is not None:
        return requested
    if host_bytes:
        full = host_bytes // token_bytes // context
        if budget_bytes:
            full = max(full, (host_bytes + budget_bytes) // (token_bytes * context + row_bytes))
        return max(LFPS_REQUESTS, full)
    return LFPS_REQUESTS


def reserve_lfps_bytes(kvc: Any, budget_bytes: int, host_bytes: int = 0,
                       tiered: bool = False) -> int:  # fmt: skip
    """Bytes of the LFPS state (``--redknot-lfps-max-requests`` rows of tables as long as the
    context in every layer, by default as many as a host store of ``host_bytes`` holds, and
    with ``tiered`` the GPU budget's token slots beside it), taken from the KV budget so that
    admission counts them."""
    from redknot.integration.server_args import published_config
    from redknot.lfps.serving import state_bytes

    shape = lfps_shape(kvc)
    if shape is None:
        return 0
    row = state_bytes(shape, 1) - state_bytes(shape, 0)
    slots = lfps_request_rows(
        published_config().lfps_max_requests, host_bytes, cell_size(kvc), shape.max_len,
        budget_bytes if tiered else 0, row,
    )  # fmt: skip
    need = state_bytes(shape, slots)
    if need >= budget_bytes:
        raise ValueError(
            f"redknot: --redknot-lfps-max-requests {slots} needs {need / (1 << 30):.2f} GB of "
            f"LFPS score tables ({shape.max_len}-token context), more than the "
            f"{budget_bytes / (1 << 30):.2f} GB KV budget: lower --redknot-lfps-max-requests or "
            "--context-length, or pass --redknot-lfps-selection kv-head (tables per KV head)"
        )
    state_of(kvc)["lfps"] = (shape, slots)
    logger.info(
        "redknot: LFPS state for %d requests (%d-token tables, %d selection heads x %d layers) "
        "reserves %.2f GB of the KV budget",
        slots, shape.max_len, shape.selection_heads, shape.num_layers, need / (1 << 30),
    )  # fmt: skip
    return need


def host_kv_bytes(kvc: Any) -> int:
    """Bytes of pinned host memory for the token slots under ``--redknot-lfps-offload-gb`` (0:
    the KV stays in GPU memory), checked against what the host has available."""
    from redknot.integration.server_args import published_config
    from redknot.pool.host_memory import check_host_budget, meminfo_bytes

    want = int(published_config().lfps_offload_gb * (1 << 30))
    if want:
        from sglang.srt.runtime_context import get_parallel

        check_host_budget(
            want, get_parallel().attn_tp_size, meminfo_bytes("MemTotal"),
            meminfo_bytes("MemAvailable"),
        )  # fmt: skip
    return want


def tiered_store_usable(kvc: Any) -> bool:
    """Whether this GPU's driver maps GPU and pinned host memory into one range (a store of 2
    granules, one of each, made and released); where it does not, the offloaded store stays in
    host memory only and the log says why."""
    from redknot.pool import vmm

    try:
        vmm.check_mapping(kvc.device)
    except (vmm.VmmError, RuntimeError) as e:
        logger.warning(
            "redknot: the GPU's KV budget cannot hold token slots beside the host store (%s); "
            "the offloaded store is in host memory only",
            e,
        )
        return False
    return True


def reserve_local_bytes(kvc: Any, budget_bytes: int) -> int:
    """Plan the LFPS state, the segment region and the request/snapshot slots; return the budget
    left for token slots (under ``--redknot-lfps-offload-gb``, the host's: the GPU budget then
    holds only the LFPS state)."""
    host = host_kv_bytes(kvc)
    tiered = bool(host) and tiered_store_usable(kvc)
    budget_bytes -= reserve_lfps_bytes(kvc, budget_bytes, host, tiered)
    if host:
        # offload needs every head global and no segment region (RedknotConfig): no rings
        state_of(kvc)["slots"] = SlotPlan(request_slots=None, snapshots=0, fixed_bytes=0)
        device = max(budget_bytes, 0) if tiered else 0
        state_of(kvc)["device_token_slots"] = device // cell_size(kvc)
        if tiered:
            logger.info(
                "redknot: token slots in %.2f GB of the GPU's KV budget first, then %.1f GiB of "
                "pinned host memory (--redknot-lfps-offload-gb), one store (redknot.pool.vmm)",
                device / (1 << 30),
                host / (1 << 30),
            )
        else:
            logger.info(
                "redknot: token slots in %.1f GiB of pinned host memory "
                "(--redknot-lfps-offload-gb); %.2f GB of the GPU's KV budget left unused",
                host / (1 << 30),
                budget_bytes / (1 << 30),
            )
        return host + device
    budget_bytes -= reserve_segment_bytes(kvc, budget_bytes).reserved_bytes
    plan = plan_slots(
        rank_layouts(kvc), kvc.kv_cache_dtype, budget_bytes, kvc.server_args.max_running_requests
    )
    state_of(kvc)["slots"] = plan
    if plan.request_slots is not None:
        logger.info(
            "redknot: %d request slots + %d snapshots reserve %.2f GB for local heads; "
            "%.2f GB remain for global-head token slots",
            plan.request_slots,
            plan.snapshots,
            plan.fixed_bytes / (1 << 30),
            (budget_bytes - plan.fixed_bytes) / (1 << 30),
        )
    return budget_bytes - plan.fixed_bytes


def cap_requests(kvc: Any, max_num_reqs: int) -> int:
    plan: SlotPlan | None = state_of(kvc).get("slots")
    if plan is None or plan.request_slots is None:
        return max_num_reqs
    return min(max_num_reqs, plan.request_slots)


def build_pool(kvc: Any, max_total_num_tokens: int, req_to_token_pool: Any):
    from redknot.integration.server_args import published_config
    from redknot.pool.kv_pool import RedknotKVPool

    plan: SlotPlan | None = state_of(kvc).get("slots")
    snapshots = plan.snapshots if plan is not None else 0
    pool = RedknotKVPool(
        max_total_num_tokens,
        page_size=kvc.pool_page_size,
        dtype=kvc.kv_cache_dtype,
        layout=layout_of(kvc),
        num_rings=req_to_token_pool.size + 1,
        num_snapshots=snapshots,
        device=kvc.device,
        segment_plan=state_of(kvc).get("segments"),
        host_kv=bool(published_config().lfps_offload_gb),
        device_rows=state_of(kvc).get("device_token_slots", 0),
    )
    lfps = state_of(kvc).get("lfps")
    if lfps is not None:
        from redknot.lfps.serving import LfpsStore

        pool.lfps_store = LfpsStore(*lfps, device=kvc.device)
        if pool.host_kv:
            _warn_dense_over_host(max_total_num_tokens, *lfps)
    pool.reuse_gate = _reuse_gate(kvc, rank_layouts(kvc)[0])
    pool.reuse_policy = published_config().policy
    return pool


def _warn_dense_over_host(tokens: int, shape: Any, rows: int) -> None:
    """Requests beyond ``--redknot-lfps-max-requests`` decode densely, which over host memory
    reads every key across PCIe at every step: say so when the store holds more full-context
    requests than there are rows."""
    full = tokens // shape.max_len
    if full > rows:
        logger.warning(
            "redknot: the host store holds %d requests of the full %d-token context but "
            "--redknot-lfps-max-requests is %d: the others decode densely over PCIe (at 128K a "
            "layer's dense decode over host memory took 10.5 ms against LFPS's 0.48 ms, "
            "docs/lfps.md); raise --redknot-lfps-max-requests to %d",
            full, shape.max_len, rows, full,
        )  # fmt: skip


def _reuse_gate(kvc: Any, layout: HeadLayout):
    """The per-request reuse decision (redknot.costmodel.gate), or None under
    ``--redknot-reuse-gate always``. Every tensor-parallel rank decides from rank 0's layout
    and the same record, so that all ranks serve a request the same way."""

    from redknot.costmodel.gate import ReuseGate
    from redknot.integration.server_args import published_config

    config = published_config()
    if not config.segment_fraction:  # no segment region: nothing to reuse
        return None
    if config.reuse_gate == "always":
        logger.info("redknot: reuse gate off (--redknot-reuse-gate always): every hit is reused")
        return None
    if config.policy == "samkv":  # its point is the memory a request holds, not its speed
        logger.info(
            "redknot: reuse gate off for --redknot-policy samkv: every request whose documents "
            "are stored holds only their anchors and chosen blocks (no cost record of samkv)"
        )
        return None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    args = kvc.server_args
    tp_size = getattr(args, "tp_size", 1) or 1
    return ReuseGate.build(
        config, kvc.model_config.hf_config, layout, device, tp_size=tp_size,
        chunk=getattr(args, "chunked_prefill_size", None),
        host_probe=functools.partial(_host_probe, tp_size) if torch.cuda.is_available() else None,
    )  # fmt: skip


def _host_probe(tp_size: int) -> float:
    """This machine's host probe (:mod:`redknot.costmodel.host_probe`) on the rank's GPU, the
    largest over the tensor-parallel ranks so that every rank scales the record alike."""
    from redknot.costmodel.host_probe import probe_ms

    probe = probe_ms(torch.device("cuda", torch.cuda.current_device()))
    if tp_size > 1:
        from sglang.srt.distributed import get_tp_group

        value = torch.tensor([probe], dtype=torch.float64)
        torch.distributed.all_reduce(
            value, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().cpu_group
        )
        probe = float(value)
    return probe
