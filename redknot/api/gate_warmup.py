"""The reuse gate's startup calibration: recompute forwards measured before the server listens.

Under ``--redknot-reuse-gate auto`` on one GPU the gate corrects its device record by the
forward times its server measures (:mod:`redknot.costmodel.measured`). A size it has not served
yet is decided by the record alone, and the record can be far off for a model it was not fitted
on: on SmolLM2's shape the H200 record predicts recomputing a 577-token prompt in 22.4 ms, a
server replaying SGLang's prefill graph did it in 10.5, and its first marked prompts of that
size were reused at 1.75-1.9x their recompute before served recomputes turned the gate
(``benchmarks/results/ttft_side_by_side_smollm2_order_h200.json``).

So the HTTP process runs this as one of SGLang's custom warmups (``--warmups``, which run before
the server starts listening): it asks the scheduler for the gate's plan
(:meth:`redknot.costmodel.gate.ReuseGate.calibration_plan`, control op ``gate``), sends those
prompts one at a time (random token ids, one output token, no markup), and logs the recompute
ratios the gate measured. The scheduler times them like any other forward; nothing else about
them is special, and their tokens stay in the radix cache as evictable leaves.

It is added to the server's warmups (:func:`install`) unless ``--skip-server-warmup`` is given,
or the server has several data-parallel ranks (each would measure a share of the prompts), or
runs disaggregated (redknot refuses several tokenizer workers at startup). A plan can be empty:
a gate that decides by the record alone, or one that recomputes every size the calibration
would measure.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from redknot.api import control

logger = logging.getLogger(__name__)

WARMUP_NAME = "redknot_reuse_gate"
SEED = 0  # the calibration's prompts are the same at every start


def skip_reason(server_args: Any) -> str | None:
    """Why this server is not calibrated at startup, None when it is."""
    if getattr(server_args, "skip_server_warmup", False):
        return "--skip-server-warmup"
    if getattr(server_args, "disaggregation_mode", "null") != "null":
        return "a disaggregated server"
    dp_size = getattr(server_args, "dp_size", 1) or 1
    if dp_size > 1:  # each rank would get a share of the prompts (and has no control path)
        return f"--dp-size {dp_size}"
    return None


def install(server_args: Any) -> None:
    """Register the calibration with SGLang's custom warmups and add it to ``--warmups``
    (HTTP process, before the server runs); says in the log when it is not added."""
    from sglang.srt.entrypoints import warmup

    why = skip_reason(server_args)
    if why is not None:
        logger.info(
            "redknot: the reuse gate is not calibrated at startup (%s): it decides by its "
            "device record until this server's own forwards correct it", why,
        )  # fmt: skip
        return
    warmup._warmup_registry[WARMUP_NAME] = calibrate
    names = [n for n in (server_args.warmups or "").split(",") if n]
    if WARMUP_NAME not in names:
        server_args.override("redknot", warmups=",".join([*names, WARMUP_NAME]))


async def calibrate(disaggregation_mode: str, tokenizer_manager: Any) -> None:
    """Send the gate's calibration prompts and log what it measured; never raises (a server
    whose calibration fails serves as it would without one, and says so)."""
    try:
        await _calibrate(tokenizer_manager)
    except Exception as e:  # noqa: BLE001 -- the server must come up
        logger.warning(
            "redknot: the reuse gate's startup calibration failed (%s: %s); it decides by its "
            "device record until this server's own forwards correct it", type(e).__name__, e,
        )  # fmt: skip


async def _calibrate(tokenizer_manager: Any) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    state = await control.call(tokenizer_manager, "gate")
    # sized by the scheduler, below the longest prompt SGLang takes (its max_req_input_len)
    plan = [(int(n), int(k)) for n, k in state.get("calibrate") or ()]
    if not plan:
        return
    vocab = int(tokenizer_manager.model_config.vocab_size)
    rng = np.random.default_rng(SEED)
    began, refused = time.perf_counter(), []
    for tokens, count in plan:
        for _ in range(count):
            req = GenerateReqInput(
                input_ids=rng.integers(0, vocab, size=tokens).tolist(),
                sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            )
            try:
                async for _ in tokenizer_manager.generate_request(req, None):
                    pass
            except ValueError as e:  # refused by SGLang: the other sizes are still measured
                refused.append(f"{tokens} tokens: {e}")
    took = time.perf_counter() - began
    if refused:
        logger.warning(
            "redknot: reuse gate calibration: %d of its prompts refused (first: %s)",
            len(refused), refused[0],
        )  # fmt: skip
    after = await control.call(tokenizer_manager, "gate")
    measured = after.get("recompute_ratios") or []
    ratios = [r for _, r in measured if r is not None]
    sent = sum(k for _, k in plan) - len(refused)
    if not ratios:
        logger.warning(
            "redknot: reuse gate calibration: %d prompts of %d-%d tokens recomputed in %.1f s, "
            "and no recompute ratio was kept (times out of range): the device record decides",
            sent, plan[0][0], plan[-1][0], took,
        )  # fmt: skip
        return
    inert = after.get("inert")
    logger.info(
        "redknot: reuse gate calibrated: %d prompts of %d-%d tokens recomputed in %.1f s, "
        "recomputing measured at x%.2f-x%.2f of the device record (%d of %d sizes)%s",
        sent, plan[0][0], plan[-1][0], took, min(ratios), max(ratios), len(ratios), len(plan),
        f"; {inert}: segment markup will be inert" if inert else "",
    )  # fmt: skip
