"""The per-head pieces of an LFPS decode step around the candidate kernels.

``lfps_sparsity_kernel``, grid ``(Hkv, B)``: Eq. 5-6 and the sink-plus-mean bypass output for the
``GRP`` query heads of a KV head (``redknot.lfps.batched.head_sparsity``). It reads the ``S``
sinks and the last ``W`` keys: key ``p`` of a block of ``BLOCK_P >= S + W`` is sink ``p`` for
``p < S``, else position ``n - W + p - S`` (kept if non-sink).

``lfps_update_stats_kernel`` then ``lfps_update_add_kernel``, grid ``(segments, Hs, B)`` each:
from the Top-K of a selection head's rank (``lfps_select.lfps_topk_kernel``'s, or
``torch.topk``'s), the selected positions (each row's own budget of them) and Eq. 10 with the
lazy decay (``redknot.lfps.batched.select_topk`` then ``update_tables_``). The first writes the
selection and each segment's max and sum of exponentials of every query head's logits; the
second merges them into each head's softmax and adds the mean attention of the non-bypassed
heads to the tables. A program per segment of the Top-K, not per row: the adds are scattered
reads and writes of the tables, and 64 programs (one per row at B = 8, 8 KV heads) left the GPU
waiting on memory (46 us of a 383 us step at 128K, ``lfps_decode_stages.json``). A selection
head whose heads all bypass is left as is and its candidate list emptied.
"""

from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.common import NO_KEY_MAX, mma


@triton.jit
def log_sum_exp(x):
    """``(max, log-sum-exp)`` of each row of ``x`` [M, N] (``-inf`` for a row of ``-inf``)."""
    top = tl.max(x, 1)
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(x - safe[:, None]), 1)
    return top, tl.where(total > 0.0, safe + tl.log(tl.where(total > 0.0, total, 1.0)), top)


@triton.jit
def lfps_sparsity_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Mean_key, Mean_value, Query_stat,
    State_rows, Sparsity, Bypass, Bypass_out,
    sm_scale, tau, num_sink, local_window,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t,
    stride_mkb, stride_mkh, stride_mvb, stride_mvh, stride_rb, stride_sb, stride_yb,
    stride_ob, stride_oh,
    GRP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    n = tl.load(Seq_lens + b).to(tl.int32)
    req_row = tl.load(Req_pool_indices + b).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    is_sink = p < num_sink
    pos = tl.where(is_sink, p, n - local_window + (p - num_sink))
    is_local = ~is_sink & (p < num_sink + local_window) & (pos >= num_sink)
    valid = (is_sink | is_local) & (pos < n)
    slot = tl.load(Req_to_token + req_row * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    kv = kvh.to(tl.int64)
    k = tl.load(K_buf + kv * stride_kh + slot[:, None] * stride_ks + d[None, :],
                mask=valid[:, None], other=0.0)  # fmt: skip
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GRP
    head = kvh * GRP + rows
    q = tl.load(Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # fmt: skip
    logits = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_P], tl.float32), UPCAST) * sm_scale
    sink_l = tl.where((is_sink & valid)[None, :], logits, float("-inf"))
    local_l = tl.where((is_local & valid)[None, :], logits, float("-inf"))
    sink_max, sink = log_sum_exp(sink_l)
    _, local = log_sum_exp(local_l)
    sb = tl.load(State_rows + b).to(tl.int64)  # the request's row of the state
    mk = tl.load(Mean_key + sb * stride_mkb + kvh * stride_mkh + d)
    mv = tl.load(Mean_value + sb * stride_mvb + kvh * stride_mvh + d)
    qf = q.to(tl.float32)
    mu = tl.sum(qf * mk[None, :], 1) * sm_scale
    spread = sm_scale * tl.sqrt(tl.sum(qf * qf, 1)) * tl.sqrt(tl.sum(mk * mk, 0))
    rho = tl.load(Query_stat + sb * stride_rb + head, mask=row_ok, other=0.0)
    log_rest = tl.log(tl.maximum(n - num_sink, 1).to(tl.float32))
    rest = tl.maximum(log_rest + mu + 0.5 * rho * spread * spread, local)
    sparsity = tl.where(n > num_sink, 1.0 / (1.0 + tl.exp(rest - sink)), 0.0)
    tl.store(Sparsity + b * stride_sb + head, sparsity, mask=row_ok)
    tl.store(Bypass + b * stride_yb + head, (sparsity > tau).to(tl.int8), mask=row_ok)

    mean_logit = mu + log_rest
    top = tl.maximum(sink_max, mean_logit)
    e_s = tl.exp(sink_l - top[:, None])
    e_m = tl.exp(mean_logit - top)
    v = tl.load(V_buf + kv * stride_vh + slot[:, None] * stride_vs + d[None, :],
                mask=(is_sink & valid)[:, None], other=0.0).to(tl.float32)  # fmt: skip
    num = tl.dot(e_s, v, input_precision="ieee") + e_m[:, None] * mv[None, :]
    out = num / (tl.sum(e_s, 1) + e_m)[:, None]
    tl.store(Bypass_out + b * stride_ob + head[:, None] * stride_oh + d[None, :], out,
             mask=row_ok[:, None])  # fmt: skip


@triton.jit
def row_budget(Budget, n, num_sink, FRACTION: tl.constexpr):
    """``LfpsParams.budget_for(n - num_sink)`` (Python's ``round``: half to even, in float64)."""
    keys = tl.maximum(n - num_sink, 0)
    if FRACTION:
        x = tl.load(Budget) * keys.to(tl.float64)
        f = tl.floor(x)
        frac = x - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        k = (f + ((frac > 0.5) | ((frac == 0.5) & odd)).to(tl.float64)).to(tl.int32)
    else:
        k = tl.load(Budget).to(tl.int32) + keys * 0
    return tl.maximum(tl.minimum(k, keys), 1)


@triton.jit
def selected_block(Top_val, Top_at, Cand_row, top_row, e, width, budget):
    """Entries ``e`` of a row's Top-K: kept mask, list index and position (-1 where not kept)."""
    in_k = e < width
    val = tl.load(Top_val + top_row + e, mask=in_k, other=float("-inf"))
    at = tl.load(Top_at + top_row + e, mask=in_k, other=0)
    keep = in_k & (val > float("-inf")) & (e < budget)
    pos = tl.load(Cand_row + at, mask=keep, other=-1)
    return keep, at, pos


@triton.jit
def lfps_update_stats_kernel(
    Top_val, Top_at, Cand, Logits, Bypass, Seq_lens, Budget, Scale, State_rows, Selected, Filled,
    Stats,
    decay, num_sink, width,
    stride_tb, stride_th, stride_cb, stride_ch, stride_lb, stride_lh, stride_yb, stride_scb,
    stride_eb, stride_eh, stride_fb, stride_ab, stride_ah, stride_as,
    HAS_FILLED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FRACTION: tl.constexpr,
):  # fmt: skip
    """Program ``(s, hs, b)``: entries ``[s * BLOCK_K, (s + 1) * BLOCK_K)`` of the row's Top-K:
    their selected positions, and each query head's max and sum of exponentials of their logits
    (``Stats[b, hs, s, r] = (max, sum)``). Program 0 of a row with a non-bypassed head applies
    the decay to its scale (the add kernel reads the decayed scale)."""
    s = tl.program_id(0)
    hs = tl.program_id(1)
    b = tl.program_id(2)
    n = tl.load(Seq_lens + b).to(tl.int32)
    budget = row_budget(Budget, n, num_sink, FRACTION)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < ROWS
    head = hs * ROWS + r
    off = tl.load(Bypass + b * stride_yb + head, mask=r_ok, other=1)
    act = r_ok & (off == 0)
    top_row = b.to(tl.int64) * stride_tb + hs * stride_th
    cand_row = Cand + b.to(tl.int64) * stride_cb + hs * stride_ch
    e = s * BLOCK_K + tl.arange(0, BLOCK_K)
    end = width
    if HAS_FILLED:  # entries past the first Filled are padding: -1 written, nothing read
        end = tl.minimum(width, tl.load(Filled + b * stride_fb + hs))
    keep, at, pos = selected_block(Top_val, Top_at, cand_row, top_row, e, end, budget)
    sel_row = Selected + b.to(tl.int64) * stride_eb + hs * stride_eh
    tl.store(sel_row + e, tl.where(keep, pos, -1), mask=e < width)
    logit_rows = Logits + b.to(tl.int64) * stride_lb + head[:, None] * stride_lh
    x = tl.load(logit_rows + at[None, :], mask=act[:, None] & keep[None, :], other=float("-inf"))
    m_r = tl.maximum(tl.max(x, 1), NO_KEY_MAX)
    l_r = tl.sum(tl.exp(x - m_r[:, None]), 1)
    stats = Stats + b.to(tl.int64) * stride_ab + hs * stride_ah + s * stride_as + r * 2
    tl.store(stats, m_r, mask=r_ok)
    tl.store(stats + 1, l_r, mask=r_ok)
    if (s == 0) & (tl.sum(act.to(tl.int32), 0) > 0):
        sb = tl.load(State_rows + b).to(tl.int64)  # the request's row of the state
        tl.store(Scale + sb * stride_scb + hs, tl.load(Scale + sb * stride_scb + hs) * decay)


@triton.jit
def lfps_update_add_kernel(
    Top_val, Top_at, Cand, Count, Logits, Bypass, Seq_lens, Budget, Vert, Slash, Scale, State_rows,
    Filled, Stats,
    V_buf, Req_to_token, Req_pool_indices, Seq_lens_v, Vidx, Part_o, Lse,
    decay, num_sink, width, capacity,
    stride_tb, stride_th, stride_cb, stride_ch, stride_nb, stride_lb, stride_lh, stride_yb,
    stride_vb, stride_vh, stride_sb, stride_sh, stride_scb, stride_fb, stride_ab, stride_ah,
    stride_as,
    stride_us, stride_uh, stride_r2t, stride_xb, stride_xh, stride_pob, stride_poh, stride_pos,
    stride_eb,
    HAS_FILLED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SEGMENTS_P2: tl.constexpr,
    FRACTION: tl.constexpr,
    ATTEND: tl.constexpr,
    DIRECT: tl.constexpr,
    GRP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Program ``(s, hs, b)``, after ``lfps_update_stats_kernel``: each query head's softmax
    over the row's selection, merged from every segment's stats; the mean attention of the
    non-bypassed heads at the segment's entries added to the tables (Eq. 10 with the lazy
    decay). A row whose heads all bypass has its candidate list emptied instead (each program a
    share of it, program 0 the count).

    ``ATTEND``: the same softmax weights the values of the segment's entries, so the sparse
    attention over the selection needs no key: entry ``e``'s value is at position
    ``Vidx[b, hs, e]`` of ``V_buf`` through ``Req_to_token`` (read where ``num_sink <= p <
    Seq_lens_v[b]``; ``DIRECT``: at its selected position, in the store the tables index).
    Each non-bypassed head's weighted sum goes to ``Part_o[b, head, s]`` (its softmax is the
    selection's: the sum over the segments is the attention over the selection) and program 0
    writes its log-sum-exp to ``Lse[b, head]`` (``-inf``: no key, or every head of the row
    bypasses; then no part is written)."""
    s = tl.program_id(0)
    hs = tl.program_id(1)
    b = tl.program_id(2)
    segments = tl.num_programs(0)
    n = tl.load(Seq_lens + b).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < ROWS
    head = hs * ROWS + r
    off = tl.load(Bypass + b * stride_yb + head, mask=r_ok, other=1)
    act = r_ok & (off == 0)
    n_act = tl.sum(act.to(tl.int32), 0)
    cand_row = Cand + b.to(tl.int64) * stride_cb + hs * stride_ch
    if n_act > 0:
        budget = row_budget(Budget, n, num_sink, FRACTION)
        seg = tl.arange(0, SEGMENTS_P2)
        stats = Stats + b.to(tl.int64) * stride_ab + hs * stride_ah
        at_rs = stats + seg[None, :] * stride_as + r[:, None] * 2
        ok_rs = r_ok[:, None] & (seg[None, :] < segments)
        m_s = tl.load(at_rs, mask=ok_rs, other=NO_KEY_MAX)
        l_s = tl.load(at_rs + 1, mask=ok_rs, other=0.0)
        m_r = tl.max(m_s, 1)
        l_r = tl.sum(l_s * tl.exp(m_s - m_r[:, None]), 1)
        l_safe = tl.where(l_r > 0.0, l_r, 1.0)
        end = width
        if HAS_FILLED:
            end = tl.minimum(width, tl.load(Filled + b * stride_fb + hs))
        top_row = b.to(tl.int64) * stride_tb + hs * stride_th
        e = s * BLOCK_K + tl.arange(0, BLOCK_K)
        keep, at, pos = selected_block(Top_val, Top_at, cand_row, top_row, e, end, budget)
        if ATTEND:  # the values' loads first, to overlap the tables' adds
            if DIRECT:
                v_ok = keep
                vpos = pos
            else:
                vpos = tl.load(Vidx + b.to(tl.int64) * stride_xb + hs * stride_xh + e, mask=keep,
                               other=-1)  # fmt: skip
                n_v = tl.load(Seq_lens_v + b).to(tl.int32)
                v_ok = keep & (vpos >= num_sink) & (vpos < n_v)
            req_row = tl.load(Req_pool_indices + b).to(tl.int64)
            slot = tl.load(Req_to_token + req_row * stride_r2t + vpos, mask=v_ok, other=0)
            d = tl.arange(0, HEAD_DIM)
            kv_head = ((hs * ROWS) // GRP).to(tl.int64)
            v = tl.load(V_buf + kv_head * stride_uh + slot.to(tl.int64)[:, None] * stride_us
                        + d[None, :], mask=v_ok[:, None], other=0.0)  # fmt: skip
        logit_rows = Logits + b.to(tl.int64) * stride_lb + head[:, None] * stride_lh
        x = tl.load(logit_rows + at[None, :], mask=act[:, None] & keep[None, :],
                    other=float("-inf"))  # fmt: skip
        attn = tl.exp(x - m_r[:, None]) / l_safe[:, None]
        sb = tl.load(State_rows + b).to(tl.int64)
        scale = tl.load(Scale + sb * stride_scb + hs)  # decayed by the stats kernel
        coef = (1.0 - decay) * 0.5 / scale / n_act.to(tl.float32)
        add = tl.sum(tl.where(act[:, None] & keep[None, :], attn, 0.0), 0) * coef
        vert_row = Vert + sb * stride_vb + hs * stride_vh
        slash_row = Slash + sb * stride_sb + hs * stride_sh
        old_v = tl.load(vert_row + pos, mask=keep, other=0.0)
        tl.store(vert_row + pos, old_v + add, mask=keep)
        old_s = tl.load(slash_row + (n - 1 - pos), mask=keep, other=0.0)
        tl.store(slash_row + (n - 1 - pos), old_s + add, mask=keep)
        if ATTEND:
            p = tl.where(act[:, None] & v_ok[None, :], attn, 0.0)
            if BLOCK_K >= 16:  # tl.dot's least K
                o = mma(p.to(v.dtype), v, tl.zeros([BLOCK_R, HEAD_DIM], tl.float32), UPCAST)
            else:
                o = tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None], 1)
            part = b.to(tl.int64) * stride_pob + head * stride_poh + s * stride_pos
            tl.store(Part_o + part[:, None] + d[None, :], o, mask=r_ok[:, None])
            if s == 0:
                lse = tl.where(l_r > 0.0, m_r + tl.log(l_safe), float("-inf"))
                tl.store(Lse + b * stride_eb + head, lse, mask=r_ok)
    else:
        if ATTEND:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if s == 0:
                tl.store(Lse + b * stride_eb + head, tl.full([BLOCK_R], float("-inf"), tl.float32),
                         mask=r_ok)  # fmt: skip
        share = tl.cdiv(capacity, segments)
        for c0 in range(s * share, tl.minimum((s + 1) * share, capacity), BLOCK_K):
            c = c0 + tl.arange(0, BLOCK_K)
            tl.store(cand_row + c, -1, mask=c < tl.minimum((s + 1) * share, capacity))
        if s == 0:
            tl.store(Count + b * stride_nb + hs, 0)


@triton.jit
def lfps_attend_merge_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens_v, Part_o, Lse, Bypass, Bypass_out,
    Out,
    sm_scale, num_sink, segments,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_r2t, stride_pob,
    stride_poh, stride_pos, stride_eb, stride_yb, stride_bb, stride_bh, stride_ob, stride_oh,
    GRP: tl.constexpr,
    SINKS_P2: tl.constexpr,
    SEGMENTS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Program ``(b, head)``, after ``lfps_update_add_kernel`` with ``ATTEND``: the head's
    output. A bypassed head takes its sink-plus-mean output (``Bypass_out``); any other
    attends its sinks (positions ``< min(num_sink, Seq_lens_v[b])``, keys and values read here)
    and its selection, whose attention is the sum of its segments' parts, weighted by the two
    log-sum-exps (0 where it attends nothing)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    out_row = Out + b.to(tl.int64) * stride_ob + head * stride_oh
    if tl.load(Bypass + b * stride_yb + head) != 0:
        bypass = tl.load(Bypass_out + b.to(tl.int64) * stride_bb + head * stride_bh + d)
        tl.store(out_row + d, bypass.to(Out.dtype.element_ty))
    else:
        kv_head = (head // GRP).to(tl.int64)
        t = tl.arange(0, SINKS_P2)
        sink_ok = (t < num_sink) & (t < tl.load(Seq_lens_v + b).to(tl.int32))
        req_row = tl.load(Req_pool_indices + b).to(tl.int64)
        slot = tl.load(Req_to_token + req_row * stride_r2t + t, mask=sink_ok, other=0).to(tl.int64)
        k = tl.load(K_buf + kv_head * stride_kh + slot[:, None] * stride_ks + d[None, :],
                    mask=sink_ok[:, None], other=0.0).to(tl.float32)  # fmt: skip
        q = tl.load(Q + b.to(tl.int64) * stride_qb + head * stride_qh + d).to(tl.float32)
        x = tl.where(sink_ok, tl.sum(q[None, :] * k, 1) * sm_scale, float("-inf"))
        lse = tl.load(Lse + b * stride_eb + head)
        top = tl.maximum(tl.max(x, 0), lse)
        top = tl.where(top == float("-inf"), 0.0, top)
        w_sink = tl.exp(x - top)
        w_sel = tl.exp(lse - top)
        v = tl.load(V_buf + kv_head * stride_vh + slot[:, None] * stride_vs + d[None, :],
                    mask=sink_ok[:, None], other=0.0).to(tl.float32)  # fmt: skip
        seg = tl.arange(0, SEGMENTS_P2)
        part = Part_o + b.to(tl.int64) * stride_pob + head * stride_poh
        written = tl.where(lse > float("-inf"), segments, 0)  # parts written (none: no key)
        parts = tl.load(part + seg[:, None] * stride_pos + d[None, :],
                        mask=seg[:, None] < written, other=0.0)  # fmt: skip
        num = w_sel * tl.sum(parts, 0) + tl.sum(w_sink[:, None] * v, 0)
        den = w_sel + tl.sum(w_sink, 0)
        tl.store(out_row + d, (num / tl.where(den > 0.0, den, 1.0)).to(Out.dtype.element_ty))
