"""Exact-prefix reuse for head-class KV: SGLang's radix tree plus local-head snapshots.

Global heads keep every token in the radix tree's token slots, exactly as SGLang caches them.
Local heads keep only a ring of ``sink + window`` positions per request, so the tree cannot hold
their KV for every prefix length. When a sequence is inserted, the request's ring is saved to a
*snapshot* attached to the tree node that ends the sequence; a later request may reuse a cached
prefix only up to a node that carries a snapshot, and its ring is restored from that snapshot
before its first forward. Reuse is therefore exact (same global and local KV as recomputation)
and happens at sequence ends: the previous turn of a conversation, a finished chunk of a long
prompt, a prompt that was served alone (e.g. a shared system prompt).

Shared prefixes that no request ended at (a system prompt followed by different questions) get
a snapshot when they prove shared: a request whose match continues past its last snapshot
recomputes from there, and its prefill also *captures* its local KV as it stands at the branch
point (``CaptureJob``), so the next request with that prefix reuses it exactly. A captured
snapshot is usable once the capturing forward has been issued.

Snapshot slots are few (``RedknotKVPool.num_snapshots``); when none is free, the least recently
used snapshot of an unlocked node is dropped (the node keeps its global KV and is still reused
as part of longer matches that end at a snapshot below it). A node's snapshot is freed with the
node.

Content-addressed segments (reused at any position, not only as a prefix) live in the pool's
segment region and are managed by ``segments``, a ``redknot.segcache.store.SegmentStore``; a
cache reset (``/flush_cache``, weight updates) drops them with the tree.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import (
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    zero_match_result,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from redknot.pool.kv_pool import CaptureJob, RedknotKVPool
from redknot.segcache import registration, reuse, samkv
from redknot.segcache.store import SegmentStore

logger = logging.getLogger(__name__)

SNAPSHOT_ATTR = "redknot_snapshot"
READY_ATTR = "redknot_snapshot_ready"
BRANCH_ATTR = "redknot_branch"  # on a request: tree node where its reuse stops short of its match
# A capture is worth a snapshot slot when it saves at least this many recomputed tokens.
MIN_CAPTURE_GAIN = 32


class RedknotRadixCache(RadixCache):
    def __init__(self, params: Any, pool: RedknotKVPool, segments: SegmentStore | None = None):
        self.pool = pool
        self.segments = segments if segments is not None else SegmentStore.for_pool(pool)
        self.uses_snapshots = pool.ring_len > 0
        self._free_snapshots: list[int] = list(range(pool.num_snapshots))
        self._snapshot_lru: OrderedDict[int, TreeNode] = OrderedDict()
        self._inside_insert_path = False
        self._last_inserted: TreeNode | None = None
        self.snapshot_saves = 0
        self.snapshot_drops = 0
        pool.cache = self  # the backend reports issued captures here
        super().__init__(params)

    # ---- SGLang's prefix-cache contract --------------------------------------------------

    def reset(self) -> None:
        super().reset()
        self.segments.clear()
        self._free_snapshots = list(range(self.pool.num_snapshots))
        self._snapshot_lru = OrderedDict()
        # Saves of finished requests' rings into snapshots still queued (they run at the next
        # forward) would write snapshots that no longer exist; SGLang resets only when idle, so
        # no queued restore belongs to a live request.
        self.pool.pending.clear()
        self.pool.capture_jobs.clear()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        cap = samkv.prefix_cap(params.req)
        if cap is not None:  # a SamKV-cut prompt: its rows past the first document are not its
            limit = params.key.limit  # tokens' K/V
            params.key.limit = cap if limit is None else min(limit, cap)
        result = super().match_prefix(params)
        if registration.is_registration(params.req):
            # A registration computes its whole prompt (redknot.segcache.registration).
            return zero_match_result(self, result, extra_key=params.key.extra_key)
        if not self.uses_snapshots or self._inside_insert_path:
            return result
        matched, node, length = (
            result.last_device_node,
            result.last_device_node,
            len(result.device_indices),
        )
        while node is not self.root_node and not self._usable(node):
            length -= len(node.key)
            node = node.parent
        if node is not self.root_node:
            self._snapshot_lru.move_to_end(getattr(node, SNAPSHOT_ATTR))
        if params.req is not None:
            gain = len(result.device_indices) - length
            branch = gain >= MIN_CAPTURE_GAIN and self.snapshot_of(matched) is None
            setattr(params.req, BRANCH_ATTR, matched if branch else None)
        return result._replace(
            device_indices=result.device_indices[:length],
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )

    def insert(self, params) -> InsertResult:
        result = super().insert(params)
        self._last_inserted = result.last_device_node
        return result

    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int):
        self._cancel_capture(req.req_pool_idx)
        registration.finish(self.pool, req.req_pool_idx)
        reuse.finish(self, req.req_pool_idx)
        self._last_inserted = None
        self._inside_insert_path = True
        if samkv.is_cut(req):  # a middle row holds a different token in each layer
            is_insert = False
        try:
            super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        finally:
            self._inside_insert_path = False
        node = self._last_inserted
        if node is not None and self._node_end(node) == kv_len_to_handle:
            self._save_snapshot(node, req.req_pool_idx)

    def cache_unfinished_req(self, req: Any, chunked: bool = False):
        self._inside_insert_path = True
        try:
            super().cache_unfinished_req(req, chunked=chunked)
        finally:
            self._inside_insert_path = False
        node = req.last_node
        ends_here = node is not None and node is not self.root_node
        if ends_here and self._node_end(node) == len(req.get_fill_ids()):
            self._save_snapshot(node, req.req_pool_idx)

    def _delete_leaf(self, node: TreeNode) -> None:
        self._drop_snapshot(node)
        super()._delete_leaf(node)

    # ---- snapshots -------------------------------------------------------------------------

    def snapshot_of(self, node: TreeNode) -> int | None:
        return getattr(node, SNAPSHOT_ATTR, None)

    def _usable(self, node: TreeNode) -> bool:
        return self.snapshot_of(node) is not None and getattr(node, READY_ATTR, True)

    def plan_capture(self, req: Any) -> None:
        """Called when ``req`` gets its request slot: capture its branch point if it has one."""
        node = getattr(req, BRANCH_ATTR, None)
        setattr(req, BRANCH_ATTR, None)
        if node is None or node.parent is None or self.snapshot_of(node) is not None:
            return  # evicted, or another request is capturing it
        index = self._take_snapshot_slot()
        if index is None:
            return
        setattr(node, SNAPSHOT_ATTR, index)
        setattr(node, READY_ATTR, False)
        self._snapshot_lru[index] = node
        job = CaptureJob(position=self._node_end(node), slot=self.pool.snapshot_slot(index))
        self.pool.capture_jobs[req.req_pool_idx] = job

    def capture_issued(self, ring_slot: int) -> None:
        """The backend issued the capture of ``ring_slot``'s job: its snapshot becomes usable."""
        job = self.pool.capture_jobs.pop(ring_slot, None)
        if job is None:
            return
        node = self._snapshot_lru.get(job.slot - self.pool.num_rings)
        if node is not None:
            setattr(node, READY_ATTR, True)

    def _cancel_capture(self, ring_slot: int | None) -> None:
        job = self.pool.capture_jobs.pop(ring_slot, None) if ring_slot is not None else None
        if job is not None:
            node = self._snapshot_lru.get(job.slot - self.pool.num_rings)
            if node is not None:
                self._drop_snapshot(node)

    def queue_restore(self, ring_slot: int, node: TreeNode) -> None:
        """Queue the copy of ``node``'s snapshot into a request's ring (before its prefill)."""
        index = self.snapshot_of(node)
        assert index is not None, "a reused prefix must end at a node with a snapshot"
        self.pool.pending.queue(ring_slot, self.pool.snapshot_slot(index))

    def _node_end(self, node: TreeNode) -> int:
        length = 0
        while node is not self.root_node:
            length += len(node.key)
            node = node.parent
        return length

    def _save_snapshot(self, node: TreeNode, ring_slot: int) -> None:
        if not self.uses_snapshots or ring_slot is None:
            return
        index = self.snapshot_of(node)
        if index is None:
            index = self._take_snapshot_slot()
            if index is None:
                return
            setattr(node, SNAPSHOT_ATTR, index)
            self._snapshot_lru[index] = node
        setattr(node, READY_ATTR, True)
        self._snapshot_lru.move_to_end(index)
        self.pool.pending.queue(self.pool.snapshot_slot(index), ring_slot)
        self.snapshot_saves += 1

    def _take_snapshot_slot(self) -> int | None:
        if self._free_snapshots:
            return self._free_snapshots.pop()
        for node in self._snapshot_lru.values():
            if node.lock_ref == 0 and getattr(node, READY_ATTR, True):
                self._drop_snapshot(node)
                return self._free_snapshots.pop()
        return None

    def _drop_snapshot(self, node: TreeNode) -> None:
        index = self.snapshot_of(node)
        if index is None:
            return
        setattr(node, SNAPSHOT_ATTR, None)
        del self._snapshot_lru[index]
        slot = self.pool.snapshot_slot(index)
        self.pool.pending.drop_writes_to(slot)
        for ring, job in list(self.pool.capture_jobs.items()):
            if job.slot == slot:
                del self.pool.capture_jobs[ring]
        self._free_snapshots.append(index)
        self.snapshot_drops += 1

    @property
    def snapshots_in_use(self) -> int:
        return len(self._snapshot_lru)

    def pool_state(self) -> dict[str, int]:
        """What the cache and the pool hold besides token slots (plain ints, for
        ``GET /server_info``). Idle after a flush, everything but the totals is 0: anything else
        is a leak."""
        return {
            "snapshots_total": self.pool.num_snapshots,
            "snapshots_in_use": self.snapshots_in_use,
            "snapshots_free": len(self._free_snapshots),
            "capture_jobs": len(self.pool.capture_jobs),
            "segment_writes": len(self.pool.segment_jobs),
            "segment_reads": len(self.pool.segment_reads),
            "pending_ring_copies": len(self.pool.pending),
            "tree_evictable_tokens": int(self.evictable_size()),
            "tree_protected_tokens": int(self.protected_size()),
        }
