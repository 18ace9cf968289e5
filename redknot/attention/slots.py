"""A forward batch's request slots on the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def request_slots(fb: ForwardBatch) -> list[int]:
    """The request slots of ``fb``'s requests, in batch order, from the host copy the plugin
    attaches to every forward batch (``redknot_req_slots``, :mod:`redknot.integration.plugin`)
    when it is there; else read from the device, which waits for the GPU."""
    slots = getattr(fb, "redknot_req_slots", None)
    if slots is not None and len(slots) == fb.req_pool_indices.shape[0]:
        return slots
    return fb.req_pool_indices.tolist()
