"""Eq. 5-9, the Top-k on candidates, the exact limit and the vertical/slash property."""

from __future__ import annotations

import math

import torch

from redknot.lfps import LfpsParams, build_state, lfps_step
from redknot.lfps.candidates import expand_candidates, initial_candidates
from redknot.lfps.metrics import recall_vs_exact_topk
from redknot.lfps.sparsity import bypass_output, head_sparsity


def dense(query, keys, values):
    att = torch.softmax(torch.einsum("hd,hnd->hn", query, keys) / math.sqrt(keys.shape[-1]), -1)
    return torch.einsum("hn,hnd->hd", att, values)


def random_request(seed, h=3, n=50, d=16, m=8):
    torch.manual_seed(seed)
    return torch.randn(h, m, d), torch.randn(h, n, d), torch.randn(h, n, d), torch.randn(h, d)


def test_sparsity_matches_loop():
    q_hist, k, v, q = random_request(10)
    k[:, :4] *= 3.0  # some sink mass
    params = LfpsParams(num_sink=4, local_window=5)
    st = build_state(q_hist, k[:, :-1], v[:, :-1], params)
    got = head_sparsity(q, k, st, params)
    h, n, d = k.shape
    for hh in range(h):
        x = [float(q[hh] @ k[hh, j]) / math.sqrt(d) for j in range(n)]
        sink = sum(math.exp(xi) for xi in x[:4])
        kbar = k[hh, 4:-1].mean(0)  # the prior is from prefill
        mu = float(q[hh] @ kbar) / math.sqrt(d)
        sigma2 = float(st.query_stat[hh]) * (float(q[hh].norm() * kbar.norm()) / math.sqrt(d)) ** 2
        glob = (n - 4) * math.exp(mu + sigma2 / 2)
        local = sum(math.exp(xi) for xi in x[-5:])
        want = sink / (sink + max(glob, local))
        assert abs(float(got[hh]) - want) < 1e-5


def test_bypass_output_is_exact_for_constant_rest():
    _, k, v, q = random_request(11)
    k[:, 4:] = k[:, 4:5]
    v[:, 4:] = v[:, 4:5]
    params = LfpsParams()
    st = build_state(torch.randn(3, 4, 16), k, v, params)
    torch.testing.assert_close(bypass_output(q, k, v, st, 4), dense(q, k, v), atol=1e-5, rtol=1e-5)


def loop_threshold(xs, lam):
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / len(xs)
    kurt = sum((x - mean) ** 4 for x in xs) / len(xs) / var**2
    return mean + lam * math.sqrt(var) * 3.0 / kurt


def test_candidates_match_loops():
    q_hist, k, v, _ = random_request(12, n=60)
    params = LfpsParams(lam=0.3, history_steps=8)
    st = build_state(q_hist, k, v, params)
    vert, slash = st.vertical, st.slash
    init = initial_candidates(vert, slash, params)
    exp = expand_candidates(init, vert, slash, params)
    h, n = vert.shape
    s, t = params.num_sink, n - 1
    for hh in range(h):
        vs = [float(vert[hh, j]) for j in range(s, n)]
        ss = [float(slash[hh, t - j]) for j in range(s, n)]
        tv, ts = loop_threshold(vs, params.lam), loop_threshold(ss, params.lam)
        want_init = {j for j in range(s, n) if vs[j - s] > tv or ss[j - s] > ts}
        assert want_init == {j for j in range(n) if bool(init[hh, j])}
        assert 0 < len(want_init) < n - s
        mv, ms = sum(vs) / len(vs), sum(ss) / len(ss)
        want = set(want_init)
        for i in want_init:
            for o in params.offsets:
                j = i + o
                if s <= j < n and (float(vert[hh, j]) > mv or float(slash[hh, t - j]) > ms):
                    want.add(j)
        assert want == {j for j in range(n) if bool(exp[hh, j])}


def test_topk_is_exact_within_candidates():
    q_hist, k, v, q = random_request(13, n=80)
    params = LfpsParams(budget=5, lam=0.0, sparsity_threshold=2.0)
    st = build_state(q_hist, k[:, :-1], v[:, :-1], params)
    res = lfps_step(q, k, v, st, params)
    logits = torch.einsum("hd,hnd->hn", q, k)
    for hh in range(k.shape[0]):
        cand = [j for j in range(80) if bool(res.candidates[hh, j])]
        want = set(sorted(cand, key=lambda j: -float(logits[hh, j]))[:5]) | {0, 1, 2, 3}
        assert want == {j for j in range(80) if bool(res.selected[hh, j])}
        att = torch.softmax(logits[hh, sorted(want)] / 4.0, -1)
        torch.testing.assert_close(res.output[hh], att @ v[hh, sorted(want)], atol=1e-5, rtol=1e-5)


def test_exact_limit_equals_full_attention():
    """Thresholds below every score and a budget of all keys: every step is dense attention."""
    q_hist, k, v, _ = random_request(14, n=70)
    params = LfpsParams(budget=10_000, lam=-1e9, sparsity_threshold=2.0)
    n0 = 60
    st = build_state(q_hist, k[:, :n0], v[:, :n0], params)
    for t in range(n0, 70):
        q = torch.randn(3, 16)
        res = lfps_step(q, k[:, : t + 1], v[:, : t + 1], st, params)
        assert bool(res.selected.all())
        torch.testing.assert_close(res.output, dense(q, k[:, : t + 1], v[:, : t + 1]))
        st = res.state


def pattern_request(n, d, vertical, slashes, alpha):
    """Keys/queries whose logits are exactly ``alpha`` at the vertical positions plus ``alpha``
    at the slash distances: q_t = f_t + e, k_j = a * ([j in V] e + sum_d f_{j+d}),
    a = alpha * sqrt(d) (so that the scaled logit is alpha)."""
    basis = torch.linalg.qr(torch.randn(d, d))[0]  # orthonormal columns
    e, f = basis[:, 0], basis[:, 1:]
    alpha = alpha * math.sqrt(d)
    keys = torch.zeros(n, d)
    for j in range(n):
        if j in vertical:
            keys[j] += alpha * e
        for dist in slashes:
            if j + dist < n:
                keys[j] += alpha * f[:, j + dist]
    queries = torch.stack([f[:, t] + e for t in range(n)])
    return queries.unsqueeze(0), keys.unsqueeze(0)


def test_vertical_slash_pattern_recovers_exact_topk():
    """Logits are exactly vertical + slash: every step selects the exact Top-k while scoring
    only a small share of the keys."""
    torch.manual_seed(15)
    n, d, n0 = 420, 448, 400
    vertical, slashes = {10, 37, 52, 200}, {0, 1, 7}
    q, k = pattern_request(n, d, vertical, slashes, alpha=6.0)
    v = torch.randn(1, n, d)
    budget = len(vertical) + len(slashes)
    params = LfpsParams(budget=budget, lam=0.2, history_steps=16)
    st = build_state(q[:, n0 - 16 : n0], k[:, :n0], v[:, :n0], params)
    for t in range(n0, n):
        res = lfps_step(q[:, t], k[:, : t + 1], v[:, : t + 1], st, params)
        assert not bool(res.bypass.any())
        want = {j for j in vertical} | {t - dist for dist in slashes}
        got = {j for j in range(4, t + 1) if bool(res.selected[0, j])}
        assert got == want, (t, got, want)
        recall = recall_vs_exact_topk(q[:, t], k[:, : t + 1], res.selected, budget, 4)
        assert float(recall[0]) == 1.0
        # Each vertical position also lands in the slash table at the distances it was seen
        # from (and each slash in the vertical table), so the candidates grow with the history
        # (here ~150 keys), not with the length: a minority of 400 keys here.
        assert int(res.candidates.sum()) < 0.4 * (t + 1)
        st = res.state
