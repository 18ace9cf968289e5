"""Eq. 4 (score tables), the priors and Eq. 10 (decayed update) against loops."""

from __future__ import annotations

import math

import torch

from redknot.lfps import LfpsParams, build_state, lfps_step


def loop_tables(queries, keys, params):
    """Eq. 4 by loops: V[j] and S[t - j] accumulate c * gamma^(m-1-i) * a_i[j] / 2."""
    h_count, m, dim = queries.shape
    n = keys.shape[1]
    g, s = params.decay, params.num_sink
    c = (1 - g) / (1 - g**m)
    vert = torch.zeros(h_count, n, dtype=torch.float64)
    slash = torch.zeros(h_count, n, dtype=torch.float64)
    for h in range(h_count):
        for i in range(m):
            t = n - m + i
            xs = [float(queries[h, i] @ keys[h, j]) / math.sqrt(dim) for j in range(s, t + 1)]
            top = max(xs)
            es = [math.exp(x - top) for x in xs]
            z = sum(es)
            for j, e in zip(range(s, t + 1), es):
                w = c * g ** (m - 1 - i) * 0.5 * e / z
                vert[h, j] += w
                slash[h, t - j] += w
    return vert, slash


def test_tables_match_loops():
    torch.manual_seed(1)
    h, n, d, m = 3, 23, 8, 6
    q, k, v = torch.randn(h, m, d), torch.randn(h, n, d), torch.randn(h, n, d)
    params = LfpsParams(history_steps=m)
    st = build_state(q, k, v, params)
    vert, slash = loop_tables(q, k, params)
    torch.testing.assert_close(st.vertical.double(), vert, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(st.slash.double(), slash, atol=1e-6, rtol=1e-5)
    assert torch.all(st.vertical[:, : params.num_sink] == 0)
    torch.testing.assert_close(st.vertical.sum(-1), torch.full((h,), 0.5))


def test_history_steps_keeps_last_rows():
    torch.manual_seed(2)
    h, n, d = 2, 30, 8
    q, k, v = torch.randn(h, 10, d), torch.randn(h, n, d), torch.randn(h, n, d)
    params = LfpsParams(history_steps=4)
    st = build_state(q, k, v, params)
    vert, _ = loop_tables(q[:, -4:], k, params)
    torch.testing.assert_close(st.vertical.double(), vert, atol=1e-6, rtol=1e-5)


def test_priors():
    torch.manual_seed(3)
    h, n, d = 2, 20, 8
    q, k, v = torch.randn(h, 5, d), torch.randn(h, n, d), torch.randn(h, n, d)
    params = LfpsParams(num_sink=4)
    st = build_state(q, k, v, params)
    for hh in range(h):
        torch.testing.assert_close(st.mean_key[hh], k[hh, 4:].mean(0))
        torch.testing.assert_close(st.mean_value[hh], v[hh, 4:].mean(0))
        ql = q[hh, -1].tolist()
        mean = sum(ql) / d
        var = sum((x - mean) ** 2 for x in ql) / d
        assert abs(float(st.query_stat[hh]) - var / sum(x * x for x in ql)) < 1e-6


def test_decayed_update_matches_loop():
    torch.manual_seed(4)
    h, n, d = 3, 40, 8
    q, k, v = torch.randn(h, 8, d), torch.randn(h, n, d), torch.randn(h, n, d)
    params = LfpsParams(budget=6, lam=0.0, sparsity_threshold=2.0, history_steps=8)
    st = build_state(q, k[:, :-1], v[:, :-1], params)
    qt = torch.randn(h, d)
    res = lfps_step(qt, k, v, st, params)
    g, s, t = params.decay, params.num_sink, n - 1
    for hh in range(h):
        chosen = [j for j in range(s, n) if bool(res.selected[hh, j])]
        assert len(chosen) == 6
        xs = {j: float(qt[hh] @ k[hh, j]) / math.sqrt(d) for j in chosen}
        z = sum(math.exp(x) for x in xs.values())
        for j in range(n):
            old_v = float(st.vertical[hh, j]) if j < n - 1 else 0.0
            old_s = float(st.slash[hh, j]) if j < n - 1 else 0.0
            a_j = 0.5 * math.exp(xs[j]) / z if j in xs else 0.0
            a_d = 0.5 * math.exp(xs[t - j]) / z if (t - j) in xs else 0.0
            assert abs(float(res.state.vertical[hh, j]) - (g * old_v + (1 - g) * a_j)) < 1e-6
            assert abs(float(res.state.slash[hh, j]) - (g * old_s + (1 - g) * a_d)) < 1e-6


def test_bypass_heads_keep_tables():
    torch.manual_seed(5)
    h, n, d = 2, 30, 8
    q, k, v = torch.randn(h, 4, d), torch.randn(h, n, d), torch.randn(h, n, d)
    params = LfpsParams(budget=4, sparsity_threshold=-1.0)  # every head bypasses
    st = build_state(q, k[:, :-1], v[:, :-1], params)
    res = lfps_step(torch.randn(h, d), k, v, st, params)
    assert bool(res.bypass.all())
    torch.testing.assert_close(res.state.vertical[:, :-1], st.vertical)
    torch.testing.assert_close(res.state.slash[:, :-1], st.slash)
    assert not bool(res.selected.any()) and not bool(res.candidates.any())
