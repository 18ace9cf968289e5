"""The reuse gate (redknot.costmodel.gate): its decision at the exact limits, on the shipped
H100 record and the 8B shape, and its wiring into redknot.segcache.reuse.start."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from redknot.config import RedknotConfig, RedknotConfigError
from redknot.costmodel.gate import Decision, ReuseGate, work_of
from redknot.costmodel.model import ModelCosts, PromptWork, Recovery, ReuseCostModel
from redknot.costmodel.record import FALLBACK, RECORDS_DIR, CostRecord, record_for
from redknot.headmap import ModelShape, synthetic_map
from redknot.pool.layout import HeadLayout

CFG_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072,
}  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]
H100 = CostRecord.read(RECORDS_DIR / f"{FALLBACK}.json")


def model_of(policy: str, record: CostRecord = H100, dense_layers: int | None = None):
    shape = ModelShape.from_hf_config(CFG_8B)
    layout = HeadLayout.from_head_map(synthetic_map(shape, 0.125, window=256, sink=64))
    dense = shape.num_layers if dense_layers is None else dense_layers
    rec = Recovery(policy, shape.num_layers, dense)
    return ReuseCostModel(ModelCosts.of(CFG_8B, layout), rec, record)


def prompt(segment: int, n: int, question: int = 64) -> PromptWork:
    return PromptWork(n * segment + question, 0, tuple((i * segment, segment) for i in range(n)))


GRID = [prompt(s, n) for s in (64, 256, 1024, 4096) for n in (1, 4, 8)]


@pytest.mark.parametrize("policy", ["redknot", "epic", "cacheblend", "sparsex", "naive"])
def test_never_reuses_when_it_cannot_pay(policy):
    """Every reuse decision is one the model predicts at most 1 - margin of recomputing, and
    every refusal one it predicts slower than that: the decision cannot pick the slower way."""
    gate = ReuseGate(model_of(policy, dense_layers=8 if policy == "redknot" else None))
    for work in GRID:
        d = gate.decide(work)
        bound = (1 - H100.margin) * d.plain_ms
        assert (d.reuse_ms <= bound) == d.reuse, (work, d)
        assert d.reuse == gate.model.choose([work])[0][0]  # the batch rule agrees


def test_refuses_when_reuse_has_no_saving():
    """Reuse whose host cost exceeds anything the GPU can save is never served, at any size."""
    costly = replace(H100, host_ms={**H100.host_ms, "held": 1e3, "full": 1e3, "schedule": 1e3})
    gate = ReuseGate(model_of("epic", costly))
    assert not any(gate.decide(w).reuse for w in GRID + [prompt(8192, 8)])
    assert gate.min_segment_tokens(8192) is None


def test_reuses_when_it_clearly_pays():
    """Free host paths: a policy that computes a few rows per segment pays from a few
    thousand tokens on, and at 64K it is taken by every token policy."""
    free = replace(H100, host_ms=dict.fromkeys(H100.host_ms, 0.0), choose_ms={}, plan_ms=0.0,
                   plan_ms_per_ktok=0.0)  # fmt: skip
    for policy in ("epic", "naive", "cacheblend", "sparsex"):
        assert ReuseGate(model_of(policy, free)).decide(prompt(8192, 8)).reuse, policy


def test_no_hit_is_never_reuse():
    d = ReuseGate(model_of("epic")).decide(PromptWork(4096))
    assert not d.reuse and "no stored segment" in d.reason


def test_h100_record_matches_the_measured_baseline_regime():
    """At 82e8dc6 on an H100 (26-baseline; points are whole prompts of 8 segments): redknot at
    1024x8 was 2.6x slower than recomputing, EPIC at 8192x8 3.6x faster. The record's gate
    takes the measured side."""
    assert not ReuseGate(model_of("redknot", dense_layers=8)).decide(prompt(120, 8)).reuse
    assert ReuseGate(model_of("epic")).decide(prompt(1016, 8)).reuse


def test_break_even_functions_are_consistent():
    gate = ReuseGate(model_of("epic"))
    seg = gate.min_segment_tokens(8192)
    assert seg is not None and 1 <= seg <= 8192 - 64
    n = (8192 - 64) // seg
    assert gate.model.pays(prompt(seg, n))
    size = gate.break_even_prompt_tokens(1024)
    assert size is not None and (size - 64) % 1024 == 0
    assert gate.model.pays(prompt(1024, (size - 64) // 1024))
    if size > 1024 + 64:
        assert not gate.model.pays(prompt(1024, (size - 64) // 1024 - 1))


def test_work_of_drops_what_the_prefix_covers():
    w = work_of(5000, 1500, [(1000, 1000), (3000, 1000), (4500, 1000)])
    assert w.computed == 3500 and w.prefix == 1500
    assert w.segments == ((0, 500), (1500, 1000), (3000, 500))


def test_record_fallback_is_said(tmp_path):
    record, why = record_for("Some Other GPU")
    assert record.device == H100.device and "no record measured on 'Some Other GPU'" in why
    path = tmp_path / "r.json"
    path.write_text(json.dumps(H100.to_json()))
    assert "--redknot-cost-record" in record_for("x", str(path))[1]


def test_config_rejects_bad_gate_and_record(tmp_path):
    with pytest.raises(RedknotConfigError, match="reuse-gate"):
        RedknotConfig(all_global=True, reuse_gate="sometimes")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(RedknotConfigError, match="cost-record"):
        RedknotConfig(all_global=True, cost_record=str(bad))


class _Gate:
    def __init__(self, reuse: bool, hopeless: bool = False) -> None:
        self.reuse, self.seen, self.recomputed = reuse, [], 0
        self.answer = Decision(False, 9.0, 2.0, "no hit pays") if hopeless else None

    def hopeless(self, prompt_len, prefix_len):
        return self.answer

    def count_recomputed(self):
        self.recomputed += 1

    def count_ignored(self):
        self.recomputed += 1

    def decide(self, work):
        self.seen.append(work)
        return Decision(self.reuse, 1.0, 2.0, "test")


def _start(monkeypatch, gate, hit: bool = True, prefix: int = 0, forged: bool = False):
    """``reuse.start`` of one request marking tokens [10, 110) against a fake store, after an
    exact-prefix hit of ``prefix`` tokens (``forged``: the mark's id is not its tokens'); what
    it did: (cache, req, store calls, whether each id check ran: segments_of's ``verify``
    argument, then True for each ``check_ids``)."""
    from redknot.api import marks
    from redknot.segcache import reuse

    entry = SimpleNamespace(num_tokens=100, namespace="n")
    calls = []
    segments = SimpleNamespace(
        find_ids=lambda keys: [
            calls.append(("lookup", *key)) or (7 if hit else None) for key in keys
        ],
        entry_of=lambda serial: calls.append(("entry", serial)) or entry,
        acquire=lambda e: calls.append(("acquire", e)),
        release=lambda e: calls.append(("release", e)),
    )  # fmt: skip
    cache = SimpleNamespace(
        segments=segments, pool=SimpleNamespace(segment_reads={}, reuse_gate=gate)
    )
    mark = SimpleNamespace(namespace="n", start=10, end=110, num_tokens=100, segment_id="0" * 32)
    verified = []

    def check_ids(ids, given):
        verified.append(True)
        if forged:
            raise marks.SegmentMarkError("segment 0 id is not the id of its tokens")

    monkeypatch.setattr(marks, "registration_of", lambda req: None)
    monkeypatch.setattr(
        marks, "segments_of", lambda req, verify=True: verified.append(verify) or [mark]
    )
    monkeypatch.setattr(marks, "check_ids", check_ids)
    req = SimpleNamespace(sampling_params=object(), origin_input_ids=list(range(300)), rid="r",
                          req_pool_idx=3, prefix_indices=range(prefix))  # fmt: skip
    reuse.start(cache, req)
    report = req.customized_info[reuse.REPORT_KEY][0] if hasattr(req, "customized_info") else None
    return cache, report, calls, verified, entry


@pytest.mark.parametrize("pays", [True, False])
def test_start_applies_the_gate(monkeypatch, pays):
    """A refused request holds no segment and reads none (computed as without reuse), and its
    marks' ids are not hashed against its tokens; a reused one's are, before it holds them."""
    gate = _Gate(pays)
    cache, report, calls, verified, entry = _start(monkeypatch, gate)
    assert verified == ([False, True] if pays else [False])
    assert gate.seen[0].segments == ((10, 100),) and gate.seen[0].computed == 300
    assert (3 in cache.pool.segment_reads) == pays
    # a refused request's hit is looked up, never made into an entry
    read = [("entry", 7), ("acquire", entry)]
    assert calls == [("lookup", "n", "0" * 32, 100)] + (read if pays else [])
    assert report["gate"]["decision"] == ("reuse" if pays else "recompute")
    assert report["reused_tokens"] == (100 if pays else 0)
    assert report["segments_hit"] == 1


@pytest.mark.parametrize("pays", [True, False])
def test_a_forged_id_is_never_read(monkeypatch, caplog, pays):
    """An id that is not its tokens' (set by an ``sgl.Engine`` caller, past the HTTP checks):
    a request the gate would reuse ignores its marks (said in the log, no report, nothing held
    or read, counted as served without reuse); one it recomputes reads nothing and reports its
    lookups as any recomputed request (its ids are never checked)."""
    gate = _Gate(pays)
    with caplog.at_level("WARNING", logger="redknot"):
        cache, report, calls, verified, _ = _start(monkeypatch, gate, forged=True)
    assert not cache.pool.segment_reads
    assert ("acquire" in {c[0] for c in calls}) is False
    if pays:
        assert verified == [False, True] and report is None and gate.recomputed == 1
        assert "ignored" in caplog.text and "not the id of its tokens" in caplog.text
    else:
        assert verified == [False] and report["segments_hit"] == 1
        assert report["gate"]["decision"] == "recompute" and "ignored" not in caplog.text


@pytest.mark.parametrize("prefix, held", [(110, False), (200, False), (109, True)])
def test_a_segment_inside_the_exact_prefix_hit_is_not_held(monkeypatch, prefix, held):
    """A hit that lies wholly inside the request's exact-prefix hit reads nothing: it is
    counted a hit but not held, asks the gate nothing, and leaves the request without reads
    (its extend then runs as one that reuses nothing); one token past the hit is reused."""
    gate = _Gate(True)
    cache, report, calls, _, entry = _start(monkeypatch, gate, prefix=prefix)
    assert report["segments_hit"] == 1
    assert (3 in cache.pool.segment_reads) == held
    read = [("entry", 7), ("acquire", entry)]
    assert calls == [("lookup", "n", "0" * 32, 100)] + (read if held else [])
    assert len(gate.seen) == int(held)
    assert report["reused_tokens"] == (110 - prefix if held else 0)
    assert report["segments"] == ([{"namespace": "n", "start": 10, "tokens": 100}] if held else [])


@pytest.mark.parametrize("hit", [True, False])
def test_a_prompt_no_hit_can_pay_for_is_looked_up_but_not_verified(monkeypatch, hit):
    """When the gate finds reuse hopeless for the prompt's size, the marks' ids are not hashed
    against the tokens, segments are counted (looked up) but never held, and the answer says
    why; a request with a hit counts as served without reuse."""
    gate = _Gate(True, hopeless=True)
    cache, report, calls, verified, _ = _start(monkeypatch, gate, hit=hit)
    assert verified == [False] and gate.seen == []  # no per-hit decision either
    assert calls == [("lookup", "n", "0" * 32, 100)] and not cache.pool.segment_reads
    assert report["segments_hit"] == int(hit) and report["reused_tokens"] == 0
    assert gate.recomputed == int(hit)
    if hit:
        assert report["gate"] == {"decision": "recompute", "reuse_ms": 9.0, "recompute_ms": 2.0,
                                  "reason": "no hit pays"}  # fmt: skip
    else:
        assert "gate" not in report


@pytest.mark.parametrize("policy", ["redknot", "epic", "cacheblend", "sparsex", "naive"])
def test_hopeless_agrees_with_decide_on_every_hit_set(policy):
    """``hopeless`` answers only where ``decide`` recomputes whatever the hits, and it answers
    wherever the reuse floor exceeds recomputing: checked on a grid of sizes and hit sets."""
    for record in (H100, replace(H100, host_ms={**H100.host_ms, "full": 40.0, "held": 40.0,
                                                "schedule": 40.0})):  # fmt: skip
        gate = ReuseGate(model_of(policy, record, 8 if policy == "redknot" else None))
        floor = gate.model.reuse_floor_ms()
        for segment, n in ((64, 1), (256, 4), (1024, 8), (4096, 8), (8192, 4)):
            work = prompt(segment, n)
            answer = gate.hopeless(work.computed, 0)
            plain = gate.model.batch_ms([work], [False])
            assert (answer is not None) == (floor > (1 - record.margin) * plain)
            if answer is None:
                continue
            assert answer.reuse is False and answer.plain_ms == pytest.approx(plain)
            for k in range(1, n + 1):  # any subset of the segments hit: still recomputed
                sub = PromptWork(work.computed, 0, work.segments[:k])
                assert not gate.decide(sub).reuse
                assert gate.model.batch_ms([sub], [True]) >= floor


def test_hopeless_prompts_under_the_shipped_record_on_smollm2():
    """SmolLM2's shape on the H100 record: reuse never pays at its context length, and the
    gate says so without any hit; the 8B shape's long prompts are not hopeless."""
    cfg = json.loads((ROOT / "benchmarks/models/smollm2-135m-instruct/config.json").read_text())
    shape = ModelShape.from_hf_config(cfg)
    layout = HeadLayout.from_head_map(synthetic_map(shape, 1.0, window=256, sink=64))
    rec = Recovery("cacheblend", shape.num_layers, shape.num_layers)
    gate = ReuseGate(ReuseCostModel(ModelCosts.of(cfg, layout), rec, H100))
    assert gate.min_segment_tokens(8192) is None
    assert all(gate.hopeless(n) is not None for n in (512, 2048, 8192))
    assert ReuseGate(model_of("cacheblend")).hopeless(32768) is None


@pytest.mark.parametrize("policy", ["epic", "cacheblend"])
def test_recomputed_up_to_is_the_last_hopeless_prompt_length(policy):
    """The binary search's answer against every length: every prompt up to it is hopeless
    (from scratch and after any exact-prefix hit), none just above it is."""
    for host in (1.0, 3.0, 40.0):
        record = replace(H100, host_ms={**H100.host_ms, "full": host, "held": host})
        gate = ReuseGate(model_of(policy, record))
        for limit in (600, 5000):
            n = gate.recomputed_up_to(limit)
            assert 0 <= n <= limit
            assert all(gate.hopeless(m) is not None for m in range(1, n + 1, 7))
            assert all(gate.hopeless(n, p) is not None for p in (0, 1, n // 2, n - 1))
            if n < limit:
                assert gate.hopeless(n + 1) is None


def test_the_gate_control_op_says_how_long_a_recomputed_prompt_can_be():
    from redknot.api.auto import gate_state

    gate = ReuseGate(model_of("cacheblend"))
    pool = SimpleNamespace(reuse_gate=gate)
    cache = SimpleNamespace(segments=SimpleNamespace(enabled=True), pool=pool)
    scheduler = SimpleNamespace(tree_cache=cache, model_config=SimpleNamespace(context_len=32768))
    state = gate_state(scheduler)
    assert state["context_len"] == 32768 and state["gate"] and state["store_enabled"]
    assert state["recompute_up_to"] == gate.recomputed_up_to(32768) < 32768
    del scheduler.model_config  # a scheduler without a model config: nothing is claimed
    assert gate_state(scheduler)["recompute_up_to"] == 0


def test_the_h200_record_is_shipped_and_its_gate_chose_the_faster_way_where_measured():
    """The H200's record is found by its device name, and the server's gate with it takes, at
    every point of the TTFTs it was fitted on, the decision the record's provenance lists, which
    was the faster way there (reuse against flashinfer's recompute, measured side by side)
    wherever the runs agree which way is faster. The record is fitted on runs of both point
    orders, and a point two runs measured on opposite sides of recomputing (at most two) has a
    decision right for one of them."""
    from benchmarks.reuse_cost import variant_model

    record, why = record_for("NVIDIA H200")
    assert record.device == "NVIDIA H200" and "shipped record of this device" in why
    inputs = record.provenance["inputs"]
    assert all((ROOT / i["path"]).is_file() for i in inputs), "the record's inputs are in git"
    measured = {}
    for i in inputs:
        for name, var in json.loads((ROOT / i["path"]).read_text())["variants"].items():
            measured |= {(name, key): row for key, row in var["points"].items()}
    chosen = record.provenance["decisions"]
    faster = {}  # (variant, point) -> whether reuse was measured faster, in each run
    for d in chosen:
        faster.setdefault((d["variant"], d["point"]), set()).add(d["reuse_ms"] < d["flashinfer_ms"])
    contested = {key for key, ways in faster.items() if len(ways) == 2}
    assert len(chosen) >= 12 and len(contested) <= 2, contested
    assert all(d["right"] for d in chosen if (d["variant"], d["point"]) not in contested)
    for key in contested:
        assert any(d["right"] for d in chosen if (d["variant"], d["point"]) == key), key
    for d in chosen:
        costs, recovery, _, _ = variant_model(d["variant"], CFG_8B, None)
        gate = ReuseGate(ReuseCostModel(costs, recovery, record))
        row = measured[d["variant"], d["point"]]
        per = row["length"] // row["segments"]
        segs = tuple((1 + i * per, per) for i in range(row["segments"]))
        work = PromptWork(row["prompt_tokens"], 0, segs)
        assert gate.decide(work).reuse == (d["gate"] == "reuse"), d


def _forward_ms_layer_by_layer(model: ReuseCostModel, parts) -> float:
    """:meth:`ReuseCostModel.forward_ms` as it reads, every layer's GPU time computed afresh."""
    r = model.record
    reused = sum(w.reused for w, layers in parts if layers and layers[0].kind != "plain")
    host = r.plan_ms + r.plan_ms_per_ktok * reused / 1024 if reused else 0.0
    gpu = host
    for layer in range(model.costs.num_layers):
        works = [(w, layers[layer]) for w, layers in parts]
        kinds = {lw.kind for _, lw in works}
        kind = next(k for k in ("schedule", "held", "full", "plain") if k in kinds)
        start = max(gpu, host)
        host += model.layer_host_ms(kind) + sum(r.choose_ms.get(lw.choose, 0.0) for _, lw in works)
        gpu = max(start + model._gpu_ms(layer, works), host)
        if kind == "schedule" or any(lw.choose for _, lw in works):
            host = max(host, gpu)
    return max(host, gpu)


@pytest.mark.parametrize("policy", ["redknot", "cacheblend", "epic", "sparsex"])
def test_forward_time_with_alike_layers_computed_once_is_the_layer_by_layer_time(policy):
    # a map whose global heads differ between layers, and a layer schedule: layers alike and not
    from redknot.costmodel.model import layer_plan

    shape = ModelShape.from_hf_config(CFG_8B)
    layout = HeadLayout.from_head_map(synthetic_map(shape, 0.3, window=256, sink=64))
    assert len({layout.num_global(i) for i in range(layout.num_layers)}) > 1
    costs = ModelCosts.of(CFG_8B, layout)
    model = ReuseCostModel(costs, Recovery(policy, shape.num_layers, 8), H100)
    works = [prompt(512, 8), PromptWork(3000, 1000, ((0, 1000), (1500, 700))), PromptWork(700)]
    for reuse in ([True, True, False], [False, False, False], [True, False, True]):
        parts = [(w, layer_plan(model.recovery, w, u)) for w, u in zip(works, reuse)]
        assert model.forward_ms(parts) == pytest.approx(_forward_ms_layer_by_layer(model, parts))


def test_gate_remembers_a_layouts_reuse_time_and_decides_as_the_model():
    gate = ReuseGate(model_of("cacheblend"))
    work = prompt(128, 8)
    first = gate.decide(work)
    assert first.reuse_ms == pytest.approx(gate.model.batch_ms([work], [True]))
    hits = gate._reuse_ms.cache_info().hits  # the cache is shared by every gate of the process
    assert gate.decide(work) == first and gate._reuse_ms.cache_info().hits == hits + 1


@pytest.mark.parametrize("scale", [1.0, 1.24, 2.0])
def test_a_reuse_that_computes_every_row_is_never_predicted_faster_than_recomputing(scale):
    """A record that puts more host time in a plain layer than in a ``full`` one (a fit whose
    small plain prompts were GPU-bound: the H200's, 0.744 against 0.269 ms before its refit)
    must not make a reuse that computes every row look faster than recomputing: a ``full``
    layer issues at least a plain layer's work. With the record scaled to a slower host, the
    1/8 map with every layer dense (each one ``full``) was predicted faster at small prompts."""
    from redknot.costmodel.model import layer_plan

    skewed = replace(H100, host_ms={**H100.host_ms, "plain": 0.75, "full": 0.27}).scaled(scale)
    model = model_of("redknot", skewed)
    assert {lw.kind for lw in layer_plan(model.recovery, GRID[0], True)} == {"full"}
    assert model.layer_host_ms("full") == pytest.approx(0.75 * scale)
    assert model.layer_host_ms("held") == skewed.host_ms["held"]  # other paths as recorded
    for work in GRID:
        assert model.batch_ms([work], [True]) >= model.batch_ms([work], [False]), work
        assert not ReuseGate(model).decide(work).reuse
