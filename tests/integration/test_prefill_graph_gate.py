"""SGLang's prefill CUDA graph and segment reuse's per-request rows.

A captured prefill graph replays the rows of its capture; the layer schedule and the token
policies change the rows each layer computes from request to request. redknot's hook on
``PrefillCudaGraphRunner.can_run_graph`` sends exactly the extend batches that reuse segments
under such a schedule to the eager path, and leaves every other batch to SGLang's own gate.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.attention import test_skipped_cached as toy


def _world_reusing(rpi: int):
    from redknot.segcache.reuse import SegmentUse

    n = toy.NEW + toy.SEG + toy.QUESTION
    world, _, _, _, entry, _ = toy.world_with_stored_segment(toy.CLASSES, 3, n)
    world.pool.cache.segments.acquire(entry)
    world.pool.segment_reads[rpi] = [SegmentUse(toy.NEW, entry, prompt_len=n)]
    return world


def _batch(*rpis: int):
    return SimpleNamespace(req_pool_indices=torch.tensor(rpis, dtype=torch.int64))


def test_rows_vary_only_for_batches_that_reuse_under_a_schedule_or_policy():
    from redknot.attention.token_policy import TokenPolicy
    from redknot.config import RedknotConfig

    world = _world_reusing(rpi=2)
    runner = world.runner
    layers = runner.layout.num_layers
    assert runner.dense_layers == layers and runner.policy is None
    assert not runner.rows_vary(_batch(2)), "every layer dense, no policy: the rows are fixed"
    runner.dense_layers = 1
    assert runner.rows_vary(_batch(2))
    assert runner.rows_vary(_batch(0, 2, 5)), "one reusing request makes the batch eager"
    assert not runner.rows_vary(_batch(0, 5)), "requests without segment reads replay"
    runner.dense_layers = layers
    runner.policy = TokenPolicy.of(RedknotConfig(policy="epic"))
    assert runner.rows_vary(_batch(2)) and not runner.rows_vary(_batch(3))
    world.pool.segment_reads.clear()
    assert not runner.rows_vary(_batch(2)), "nothing reused: every batch may replay"


def test_hook_sends_reusing_batches_to_the_eager_path_and_defers_otherwise(sglang_plugins):
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        PrefillCudaGraphRunner,
    )

    sglang_plugins.verify()  # the hook is applied (verify checks every hook of HOOKS)
    graph = PrefillCudaGraphRunner.__new__(PrefillCudaGraphRunner)  # no capture: only the gate
    # SGLang's own gate, reduced to "this shape replays"
    graph._has_inactive_dp_rank = lambda fb: False
    graph.can_replay_locally = lambda **kw: True
    graph.enable_lora = graph._capture_chunked_prefix = False
    fb = SimpleNamespace(
        global_num_tokens_cpu=None, batch_size=1, input_ids=[1, 2, 3], input_embeds=None,
        replace_embeds=None, extend_prefix_lens_cpu=[0], capture_hidden_mode=None,
        return_logprob=False, forward_mode=SimpleNamespace(is_target_verify=lambda: False),
    )  # fmt: skip
    verdicts = []

    def backend(eager: bool):
        return SimpleNamespace(needs_eager_extend=lambda batch: verdicts.append(batch) or eager)

    graph.model_runner = SimpleNamespace(attn_backend=backend(eager=True))
    assert graph.can_run_graph(fb) is False
    graph.model_runner = SimpleNamespace(attn_backend=backend(eager=False))
    assert graph.can_run_graph(fb) is True
    assert verdicts == [fb, fb]
    graph.model_runner = SimpleNamespace(attn_backend=object())  # another backend: SGLang alone
    assert graph.can_run_graph(fb) is True
    graph.can_replay_locally = lambda **kw: False
    graph.model_runner = SimpleNamespace(attn_backend=backend(eager=False))
    assert graph.can_run_graph(fb) is False, "SGLang's own verdict stands"
