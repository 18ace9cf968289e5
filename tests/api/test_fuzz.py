"""A seeded slice of ``benchmarks/fuzz_api.py`` (the same generator and classification): no
request may get a 5xx or crash the app, every refusal is a 4xx that names what is wrong, every
adversarial-but-valid request and every good request is served exactly."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("seed, auto", [(7, "off"), (11, "off"), (7, "cdc-docs")])
def test_fuzz_slice(http_app, smollm_tokenizer, server_args, seed, auto):
    """``auto``: the server's automatic segments (unmarked prompts chunked, looked up and
    captured, long unmarked prompts among the cases)."""
    from benchmarks.fuzz_api import fuzz

    report = fuzz(http_app, smollm_tokenizer, server_args, seed=seed, cases=100, auto=auto)
    assert (report["auto_chunks"] > 0) == (auto != "off")
    examples = json.dumps(report["examples"], indent=1, ensure_ascii=True)[:4000]
    assert report["cases"] >= 100 and report["chat"]
    assert report["count_5xx"] == 0 and report["crashes"] == 0, examples
    assert report["count_4xx_unclear"] == 0 and report["accepted_bad"] == 0, examples
    assert report["wrong_answers"] == 0 and report["store_invariant_failures"] == 0, examples
    assert report["good_requests_sent"] >= 5
    assert report["good_requests_ok"] == report["good_requests_sent"], examples
    # the slice reaches both refusals and served requests, and the store
    assert report["count_4xx"] > 0 and report["adversarial_valid_ok"] > 0
    assert report["store_after"]["hits"] > 0 and report["store_after"]["misses"] > 0
