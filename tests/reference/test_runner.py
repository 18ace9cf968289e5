from __future__ import annotations

import copy

import pytest
import torch

from redknot.headmap import HeadMap, HeadMapError, ModelShape, synthetic_map
from redknot.reference import LayerHooks, ReferenceKV, ReferenceRunner, UnsupportedModelError

from .conftest import ARCHS, tiny_model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_head_global_equals_hugging_face(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(1))
    runner = ReferenceRunner(model)
    for head_map in (None, HeadMap.every_head_global(runner.shape, window=4, sink=1)):
        out = runner.forward(ids, head_map=head_map, logits_rows="all")
        torch.testing.assert_close(out.logits, hf_logits(model, ids), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_window_covering_the_prompt_makes_local_equal_global(arch):
    model = tiny_model(arch)
    runner = ReferenceRunner(model)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(2))
    dense = runner.forward(ids, logits_rows="all").logits
    for window, sink in ((200, 0), (500, 64), (150, 60)):  # sink + window >= prompt also covers
        local = synthetic_map(runner.shape, 0.0, window=window, sink=sink)
        out = runner.forward(ids, head_map=local, logits_rows="all").logits
        torch.testing.assert_close(out, dense, atol=2e-5, rtol=1e-4)
    narrow = synthetic_map(runner.shape, 0.0, window=16, sink=4)
    assert (
        runner.forward(ids, head_map=narrow, logits_rows="all").logits - dense
    ).abs().max() > 1e-3


def test_cached_decoding_equals_full_recompute():
    model = tiny_model("llama")
    runner = ReferenceRunner(model)
    hm = synthetic_map(runner.shape, 0.5, window=8, sink=2, seed=3)
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(3))
    gen = runner.generate(ids, head_map=hm, max_new_tokens=12)
    assert gen.prompt_len == 60 and len(gen.tokens) == 12
    full = torch.cat((ids, torch.tensor(gen.tokens[:-1])))
    logits = runner.forward(full, head_map=hm, logits_rows="all").logits
    assert logits[59:].argmax(-1).tolist() == gen.tokens
    torch.testing.assert_close(gen.first_logits, logits[59], atol=2e-5, rtol=1e-4)
    # chunked prefill through `past` equals one forward
    first = runner.forward(ids[:37], head_map=hm)
    rest = runner.forward(ids[37:], head_map=hm, past=first.kv, logits_rows="all")
    torch.testing.assert_close(rest.logits, logits[37:60], atol=2e-5, rtol=1e-4)
    assert rest.kv.length == 60


def test_map_of_another_model_is_refused():
    runner = ReferenceRunner(tiny_model("llama"))
    other = HeadMap.every_head_global(ModelShape("LlamaForCausalLM", 4, 2, 4, 16))
    with pytest.raises(HeadMapError, match="num_layers"):
        runner.forward([1, 2, 3], head_map=other)


def test_sliding_window_model_is_refused():
    import transformers as tf

    config = tf.MistralConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=16,
    )
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ReferenceRunner(tf.MistralForCausalLM(config))


class _Promote(LayerHooks):
    def head_classes(self, layer, classes):
        return "G" * len(classes)


def test_head_classes_hook_promotes_heads():
    runner = ReferenceRunner(tiny_model("llama"))
    ids = torch.randint(0, 128, (120,), generator=torch.Generator().manual_seed(4))
    local = synthetic_map(runner.shape, 0.0, window=8, sink=2)
    promoted = runner.forward(ids, head_map=local, hooks=_Promote(), logits_rows="all").logits
    torch.testing.assert_close(promoted, runner.forward(ids, logits_rows="all").logits)


class _ReuseLayer0(LayerHooks):
    """Replace the segment's layer-0 KV by its standalone KV, re-aligned to its new place."""

    def __init__(self, alone: ReferenceKV, start: int):
        self.alone, self.start, self.calls = alone, start, 0

    def edit_kv(self, ctx, keys, values):
        if ctx.layer != 0:
            return keys, values
        self.calls += 1
        n = self.alone.length
        src = torch.arange(n)
        dst = src + self.start
        keys, values = keys.clone(), values.clone()
        keys[:, self.start : self.start + n] = ctx.model.rope.realign(self.alone.keys[0], src, dst)
        values[:, self.start : self.start + n] = self.alone.values[0]
        return keys, values


def test_edit_kv_with_realigned_cached_keys():
    """Layer-0 KV depends only on token and position: a standalone segment's KV, re-aligned,
    is exactly the in-context KV, so substituting it changes nothing. Deeper layers differ."""
    runner = ReferenceRunner(tiny_model("llama3-rope"))
    gen = torch.Generator().manual_seed(5)
    prefix, segment = torch.randint(0, 128, (45,), generator=gen), torch.randint(
        0, 128, (30,), generator=gen
    )
    alone = runner.forward(segment).kv
    plain = runner.forward(torch.cat((prefix, segment)), logits_rows="all")
    hooks = _ReuseLayer0(alone, 45)
    reused = runner.forward(torch.cat((prefix, segment)), hooks=hooks, logits_rows="all")
    assert hooks.calls == 1
    torch.testing.assert_close(reused.logits, plain.logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(
        reused.kv.keys[0][:, 45:], plain.kv.keys[0][:, 45:], atol=2e-5, rtol=1e-4
    )
    deep = plain.kv.keys[2][:, 45:] - alone.realigned(runner.model.rope, 0, 45).keys[2]
    assert deep.abs().max() > 1e-3


class _Rows(LayerHooks):
    def __init__(self, attention=None, ffn=None):
        self.attention, self.ffn, self.seen = attention, ffn, []

    def attention_rows(self, ctx):
        return self.attention

    def ffn_rows(self, ctx, probe):
        return self.ffn

    def after_layer(self, ctx, hidden, probe):
        self.seen.append(hidden.clone())


def test_ffn_rows_skip_the_ffn_like_a_zeroed_mlp():
    model = tiny_model("qwen2")
    ids = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(6))
    runner = ReferenceRunner(model)
    everything = runner.forward(
        ids, hooks=_Rows(torch.arange(50), torch.arange(50)), logits_rows="all"
    )
    torch.testing.assert_close(everything.logits, runner.forward(ids, logits_rows="all").logits)
    skipped = runner.forward(
        ids, hooks=_Rows(ffn=torch.zeros(0, dtype=torch.int64)), logits_rows="all"
    )
    no_mlp = copy.deepcopy(model)
    with torch.no_grad():
        for layer in no_mlp.model.layers:
            layer.mlp.down_proj.weight.zero_()
    torch.testing.assert_close(skipped.logits, hf_logits(no_mlp, ids), atol=2e-5, rtol=1e-4)


def test_rows_outside_attention_and_ffn_keep_the_residual():
    model = tiny_model("llama", layers=2)
    runner = ReferenceRunner(model)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(7))
    rows = torch.tensor([3, 10, 39])
    hooks = _Rows(attention=rows, ffn=rows)
    runner.forward(ids, hooks=hooks)
    embedded = model.model.embed_tokens(ids)
    others = torch.ones(40, dtype=torch.bool)
    others[rows] = False
    for hidden in hooks.seen:
        torch.testing.assert_close(hidden[others], embedded[others])
        assert (hidden[rows] - embedded[rows]).abs().max() > 1e-4
    # a selected row sees the same thing as in the full forward at the first layer
    full = _Rows()
    runner.forward(ids, hooks=full)
    torch.testing.assert_close(hooks.seen[0][rows], full.seen[0][rows], atol=1e-5, rtol=1e-5)


def test_probe_statistics_match_hugging_face_attentions():
    model = tiny_model("llama")
    runner = ReferenceRunner(model)
    ids = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(8))
    window, sink, last = 20, 4, 6
    dense = HeadMap.every_head_global(runner.shape, window=window, sink=sink)
    out = runner.forward(ids, head_map=dense, probe_last=last, keep_probs=True, probe_edge=5)
    with torch.no_grad():
        attentions = model(ids[None], output_attentions=True).attentions
    for layer, probe in enumerate(out.probes):
        probs = attentions[layer][0, :, -last:].float()  # [Hq, last, T]
        torch.testing.assert_close(probe.probs, probs, atol=1e-5, rtol=1e-4)
        for h in range(probs.shape[0]):
            outside = edge = 0.0
            for r in range(last):
                p = 90 - last + r
                outside += sum(float(probs[h, r, j]) for j in range(sink, p - window + 1))
                edge += sum(
                    float(probs[h, r, j]) for j in range(max(sink, p - window + 1), p - window + 6)
                )
            assert abs(float(probe.outside_mass[h]) - outside / last) < 1e-5
            assert abs(float(probe.edge_mass[h]) - edge / last) < 1e-5
        torch.testing.assert_close(probe.key_mass, probs.sum(1), atol=1e-5, rtol=1e-4)
