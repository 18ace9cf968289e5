"""The SegPaged pool: layout, sizing, ring addressing, queued copies."""

from __future__ import annotations

import pytest
import torch

from redknot.headmap import ModelShape, synthetic_map
from redknot.pool.kv_pool import PendingCopies, RedknotKVPool, bytes_per_ring, bytes_per_token
from redknot.pool.layout import HeadLayout
from redknot.pool.sizing import plan_slots

SHAPE = ModelShape(
    "LlamaForCausalLM", num_layers=4, num_kv_heads=4, num_attention_heads=8, head_dim=16
)


def _layout(frac=0.25, window=8, sink=2, seed=0):
    return HeadLayout.from_head_map(synthetic_map(SHAPE, frac, window=window, sink=sink, seed=seed))


def test_buffers_hold_only_what_each_head_keeps():
    layout = _layout()
    pool = RedknotKVPool(100, 1, torch.float16, layout, num_rings=5, num_snapshots=3, device="cpu")
    for layer in range(layout.num_layers):
        assert pool.k_global[layer].shape == (101, layout.num_global(layer), 16)
        assert pool.k_local[layer].shape == (8 * 10, layout.num_local(layer), 16)
    # 4 global heads in all, fp16, K+V: 4 * 16 * 2 bytes * 2
    assert bytes_per_token(layout, torch.float16) == 4 * 16 * 2 * 2
    assert bytes_per_ring(layout, torch.float16) == 12 * 10 * 16 * 2 * 2
    k, v = pool.get_kv_size_bytes()
    assert k + v == 101 * bytes_per_token(layout, torch.float16) + 8 * bytes_per_ring(
        layout, torch.float16
    )


def test_all_global_pool_is_the_dense_layout():
    layout = HeadLayout.from_head_map(synthetic_map(SHAPE, 1.0))
    pool = RedknotKVPool(50, 1, torch.bfloat16, layout, num_rings=3, num_snapshots=0, device="cpu")
    assert pool.ring_len == 0 and all(t.shape == (51, 4, 16) for t in pool.k_global)
    assert bytes_per_ring(layout, torch.bfloat16) == 0


@pytest.mark.parametrize("sink, window", [(0, 5), (3, 4), (2, 1)])
def test_ring_keeps_sink_and_last_window(sink, window):
    layout = _layout(window=window, sink=sink)
    pool = RedknotKVPool(10, 1, torch.float32, layout, num_rings=3, num_snapshots=0, device="cpu")
    slot = torch.tensor(2)
    rows_seen = {}
    for p in range(40):  # write positions in order, as decoding does
        rows_seen[p] = int(pool.local_rows(slot, torch.tensor(p)))
        live = {q for q in range(p + 1) if q < sink or p - q < window}
        # every live position owns a distinct row of this ring
        rows = [rows_seen[q] for q in live]
        assert len(set(rows)) == len(rows)
        assert all(2 * pool.ring_len <= r < 3 * pool.ring_len for r in rows)
        # and no later position overwrote it
        for q in live:
            assert all(rows_seen[r] != rows_seen[q] for r in range(q + 1, p + 1))


def test_write_global_and_local_split_heads():
    layout = _layout()
    pool = RedknotKVPool(20, 1, torch.float32, layout, num_rings=3, num_snapshots=1, device="cpu")
    k = torch.randn(3, 4, 16)
    v = torch.randn(3, 4, 16)
    loc = torch.tensor([4, 7, 9])
    rows = pool.local_rows(torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]))
    for layer in range(layout.num_layers):
        pool.write_global(layer, loc, k, v)
        pool.write_local(layer, rows, k, v)
        g, loc_heads = layout.global_heads(layer), layout.local_heads(layer)
        torch.testing.assert_close(pool.k_global[layer][loc], k[:, g])
        torch.testing.assert_close(pool.v_local[layer][rows], v[:, loc_heads])


def test_pending_copies_run_in_order():
    layout = _layout()
    pool = RedknotKVPool(10, 1, torch.float32, layout, num_rings=4, num_snapshots=2, device="cpu")
    for layer in range(layout.num_layers):
        view = pool.k_local[layer].view(6, pool.ring_len, -1, 16)
        for s in range(6):
            view[s] = float(s)
    q = PendingCopies()
    q.queue(4, 1)  # save ring 1 -> snapshot slot 4
    q.queue(2, 4)  # restore snapshot 4 -> ring 2 (must see ring 1's data)
    q.queue(5, 3)
    q.queue(0, 5)
    q.drop_writes_to(5)  # the snapshot in slot 5 was dropped: its save is not run
    q.run(pool)
    view = pool.k_local[0].view(6, pool.ring_len, -1, 16)
    assert [float(view[s].mean()) for s in range(6)] == [5.0, 1.0, 1.0, 3.0, 1.0, 5.0]
    assert len(q) == 0


def test_slot_plan_fits_budget_and_honours_requested_count():
    layout = _layout()
    ring = bytes_per_ring(layout, torch.bfloat16)
    token = bytes_per_token(layout, torch.bfloat16)
    budget = 10**9
    plan = plan_slots([layout], torch.bfloat16, budget_bytes=budget, requested=None)
    # balanced: slots of BALANCE_LEN-token requests run out together with token slots
    per_request = 1.25 * ring + 16384 * token
    assert plan.request_slots == int(budget // per_request)
    tokens_left = (budget - plan.fixed_bytes) // token
    assert abs(tokens_left / plan.request_slots - 16384) < 0.05 * 16384
    plan = plan_slots([layout], torch.bfloat16, budget_bytes=1000 * ring, requested=40)
    assert plan.request_slots == 40 and plan.snapshots == 10
    assert plan.fixed_bytes == (40 + 1 + 10) * ring
    with pytest.raises(ValueError, match="lower --max-running-requests"):
        plan_slots([layout], torch.bfloat16, budget_bytes=10 * ring, requested=40)
    dense = HeadLayout.from_head_map(synthetic_map(SHAPE, 1.0))
    assert plan_slots([dense], torch.bfloat16, 10**9, None).request_slots is None


@pytest.mark.gpu
@pytest.mark.parametrize("frac, restore", [(1.0, 0), (0.25, 0), (0.25, 1), (1.0, 1)])
def test_global_writes_match_indexed_writes_on_the_gpu(frac, restore):
    """Whole global rows go through SGLang's store kernel; rows with restore columns keep the
    indexed write. Either way the stored K/V equal an indexed write of the global heads, for
    K/V that are views of a fused QKV projection (strided rows), as attention hands them."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    layout = HeadLayout.from_head_map(synthetic_map(SHAPE, frac, seed=1), restore=restore)
    pool = RedknotKVPool(
        64, 1, torch.bfloat16, layout, num_rings=2, num_snapshots=0, device="cuda"
    )  # fmt: skip
    qkv = torch.randn(5, (8 + 4 + 4) * 16, dtype=torch.bfloat16, device="cuda")
    k = qkv[:, 8 * 16 : 12 * 16].view(5, 4, 16)
    v = qkv[:, 12 * 16 :].view(5, 4, 16)
    loc = torch.tensor([0, 3, 17, 40, 64], device="cuda")  # slot 0 (graph padding) included
    for layer in range(layout.num_layers):
        g = layout.global_heads(layer)
        before = pool.k_global[layer].clone()
        pool.write_global(layer, loc, k, v)
        torch.testing.assert_close(pool.k_global[layer][loc, : len(g)], k[:, g], rtol=0, atol=0)
        torch.testing.assert_close(pool.v_global[layer][loc, : len(g)], v[:, g], rtol=0, atol=0)
        untouched = torch.ones(pool.k_global[layer].shape[0], dtype=torch.bool, device="cuda")
        untouched[loc] = False
        assert torch.equal(pool.k_global[layer][untouched], before[untouched])
        if restore:  # the restore columns are never written by this path
            assert torch.equal(pool.k_global[layer][:, len(g) :], before[:, len(g) :])
    if restore:  # restore columns follow the global heads: no whole rows to store
        assert pool._store_widths == {}
    else:  # the store kernel was built for every row width and took the writes
        assert pool._store_widths and all(pool._store_widths.values())
