"""A CPU stand-in for a redknot SGLang server: SGLang's real HTTP app and redknot's real request
API in front, redknot's real scheduler-side segment code behind, no model.

| layer                      | here                                                          |
| -------------------------- | ------------------------------------------------------------- |
| HTTP app, routes, ASGI     | real: SGLang's FastAPI ``app``, set up by SGLang's own        |
|                            | ``_setup_and_run_http_server`` with redknot's hook            |
| redknot request API        | real: middleware, ``/redknot`` routes, chat hook, namespaces  |
| OpenAI chat serving        | real ``OpenAIServingChat`` (installed by :meth:`CpuServer.    |
|                            | enable_chat`; SGLang builds it in the app's lifespan)         |
| tokenizer manager          | faked (:class:`CpuTokenizerManager`): SGLang's own            |
|                            | ``normalize_batch_and_arguments``, ``SamplingParams``         |
|                            | normalize/verify and the typed msgpack hop of the sampling    |
|                            | params run for real; tokenisation is the tokenizer's; the     |
|                            | context-length and vocabulary checks are SGLang's, restated   |
| control path               | real ``redknot.api.control`` both ends, through SGLang's      |
|                            | msgpack codec and its ``FanOutCommunicator`` (one request in  |
|                            | flight at a time); the scheduler's dispatcher is a call       |
| scheduler                  | faked (:class:`CpuScheduler`): no batching, no radix cache;   |
|                            | per prompt it calls redknot's real ``registration.start`` /   |
|                            | ``reuse.start``, ``plan_writes`` / ``plan_reads``, the        |
|                            | segment region's ``write`` / ``read`` and ``finish``, on a    |
|                            | real ``SegmentStore`` over a real ``RedknotKVPool`` region    |
| model forward              | faked: the K/V written for a registration are random          |
| engine time                | none by default; with ``step_us_per_token`` an                |
|                            | :class:`EngineClock` (one forward step at a time, chunked     |
|                            | prefill, control requests answered between steps)            |
"""

from __future__ import annotations

import asyncio
import copy
import json
import types
import weakref
from collections import deque
from itertools import count
from pathlib import Path
from typing import Any

import torch

from redknot.config import RedknotConfig
from redknot.integration.capture_order import CAPTURE_STEP_FRACTION, CAPTURE_STEP_TOKENS
from tests.api.conftest import FakeTokenizerManager

AUTO_CAPTURE_IN_PLACE: str = RedknotConfig.__dataclass_fields__["auto_capture_in_place"].default

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
}


def write_model_dir(directory: Path) -> Path:
    """A Llama-shaped model directory (config only: ``--load-format dummy``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def make_server_args(model_dir: Path) -> Any:
    """Server arguments of a redknot server on the CPU (SGLang's plugins loaded first)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    from redknot.integration import plugin

    plugin.verify()
    args = ["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu"]
    return prepare_server_args(args + ["--attention-backend", "redknot", "--redknot-all-global"])


def setup_http_app(server_args: Any) -> Any:
    """SGLang's real FastAPI app, set up by SGLang's own ``_setup_and_run_http_server`` (with
    redknot's hook) around a fake tokenizer manager; uvicorn is not started."""
    from sglang.srt.entrypoints import http_server

    run, logs = http_server.uvicorn.run, http_server.set_uvicorn_logging_configs
    http_server.uvicorn.run = lambda *a, **k: None
    http_server.set_uvicorn_logging_configs = lambda *a, **k: None
    try:
        http_server._setup_and_run_http_server(
            server_args, FakeTokenizerManager(None), None, None, [{}], None
        )
    finally:
        http_server.uvicorn.run, http_server.set_uvicorn_logging_configs = run, logs
    return http_server.app


class CpuScheduler:
    """The scheduler's segment state (``tree_cache.segments`` and the pool's segment region) and
    what the scheduler does with one request, in the order SGLang's scheduler calls redknot's
    hooks: slot allocation (``start``), the extends of the prompt (plan, write, read), request
    end (``finish``).

    ``hold(n)`` keeps the next ``n`` requests running until :meth:`finish_running`: a reader
    keeps its segment references; a registration has computed only the first half of its
    prompt (its write job open), and finishes it then, or is aborted.

    ``exact_prefix``: a model of SGLang's radix cache for the replay: a prompt's longest prefix
    (whole blocks of ``PREFIX_BLOCK`` tokens, at least one token left to compute) that an
    earlier served prompt began with is its ``prefix_indices`` (no K/V behind it: only the
    length is read) and is not computed. Off: no exact-prefix hit ever."""

    PAGE_TOKENS = 4
    PREFIX_BLOCK = 16

    def __init__(
        self,
        region_tokens: int = 2048,
        slots: int = 256,
        namespace_fraction: float = 1.0,
        exact_prefix: bool = False,
    ):
        from redknot.headmap import ModelShape, synthetic_map
        from redknot.pool.kv_pool import RedknotKVPool
        from redknot.pool.layout import HeadLayout
        from redknot.pool.segment_region import bytes_per_segment_token, plan_segments
        from redknot.segcache.store import SegmentStore

        self.shape = ModelShape(
            "LlamaForCausalLM", num_layers=2, num_kv_heads=4, num_attention_heads=8, head_dim=8
        )
        layout = HeadLayout.from_head_map(synthetic_map(self.shape, 0.25, window=8, sink=2))
        per_token = bytes_per_segment_token(layout, torch.float32, "local")
        budget = 2 * region_tokens * per_token  # half of it is the region
        plan = plan_segments([layout], torch.float32, budget, 0.5, "local", self.PAGE_TOKENS)
        self.pool = RedknotKVPool(
            64,
            1,
            torch.float32,
            layout,
            num_rings=4,
            num_snapshots=1,
            device="cpu",
            segment_plan=plan,
        )
        self.store = SegmentStore.for_pool(self.pool, namespace_fraction=namespace_fraction)
        self.tree_cache = types.SimpleNamespace(segments=self.store, pool=self.pool)
        self.pool.cache = self.tree_cache
        self._free_slots = list(range(slots - 1, 0, -1))
        self._hold = 0
        self.last_prefix = 0  # the last prompt's exact-prefix hit (SGLang's cached_tokens)
        self.running: dict[int, tuple[int, int]] = {}  # slot -> (tokens computed, prompt tokens)
        self._gen = torch.Generator().manual_seed(0)
        # rid -> the request's customized_info (SGLang puts each key into meta_info)
        self.customized_info: dict[str, dict] = {}
        self.exact_prefix = exact_prefix
        self._prefixes: set[int] = set()  # chained hashes of the served prompts' whole blocks

    def _chain(self, ids: list[int]):
        """(tokens, hash) of each whole block prefix of ``ids``, shortest first."""
        b, h = self.PREFIX_BLOCK, 0
        for end in range(b, len(ids) + 1, b):
            h = hash((h, tuple(ids[end - b : end])))
            yield end, h

    def prefix_of(self, ids: list[int]) -> int:
        """The exact-prefix hit of ``ids`` (0 without ``exact_prefix``)."""
        if not self.exact_prefix:
            return 0
        best = 0
        for end, h in self._chain(ids):
            if end >= len(ids) or h not in self._prefixes:
                break
            best = end
        return best

    def _remember(self, ids: list[int]) -> None:
        if self.exact_prefix:
            self._prefixes.update(h for _, h in self._chain(ids))

    def hold(self, n: int = 1) -> None:
        self._hold += n

    def serve(self, rid: str, ids: list[int], sampling_params: Any) -> int:
        """Run one prompt; the number of its tokens that read cached segment K/V."""
        from redknot.segcache import registration, reuse

        rpi = self._free_slots.pop()
        held = self._hold > 0
        req = types.SimpleNamespace(
            rid=rid, origin_input_ids=ids, sampling_params=sampling_params, req_pool_idx=rpi
        )
        prefix = 0 if held or registration.is_registration(req) else self.prefix_of(ids)
        req.prefix_indices = range(prefix)  # only its length is read
        registration.start(self.tree_cache, req)
        reuse.start(self.tree_cache, req)
        self.customized_info[rid] = getattr(req, "customized_info", None) or {}
        n = len(ids)
        first = n // 2 if held and rpi in self.pool.segment_jobs and n > 1 else n
        cached = self._extend(rpi, prefix, first - prefix)
        if held:
            self._hold -= 1
            self.running[rpi] = (first, n)
        else:
            self._finish(rpi)
        self._remember(ids)
        self.last_prefix = prefix
        return prefix + cached

    def finish_running(self, *, complete: bool = True) -> None:
        """End the held requests; ``complete=False`` aborts those with tokens left to compute."""
        for rpi, (done, n) in sorted(self.running.items()):
            if complete and done < n:
                self._extend(rpi, done, n - done)
            self._finish(rpi)
        self.running.clear()

    def _extend(self, rpi: int, prefix: int, length: int) -> int:
        """One extend of ``length`` tokens after ``prefix``: the backend's plans, then the
        region writes (random K/V: the model forward) and reads; the tokens read."""
        from redknot.segcache import registration, reuse

        heads, dim = self.shape.num_kv_heads, self.shape.head_dim
        writes = registration.plan_writes(self.pool, [rpi], [prefix], [length], "cpu")
        reads = reuse.plan_reads(self.pool, [rpi], [prefix], [length], "cpu")
        for layer in range(self.shape.num_layers):
            if writes is not None:
                k, v = torch.randn(2, length, heads, dim, generator=self._gen)
                self.pool.segments.write(
                    layer, writes.rows_gpu, k[writes.tokens_gpu], v[writes.tokens_gpu]
                )
            if reads is not None:
                self.pool.segments.read(layer, reads.rows_gpu)
        return 0 if reads is None else len(reads.tokens_gpu)

    def _finish(self, rpi: int) -> None:
        from redknot.segcache import registration, reuse

        registration.finish(self.pool, rpi)
        reuse.finish(self.tree_cache, rpi)
        self._free_slots.append(rpi)


class EngineClock:
    """A GPU engine's time on the stand-in, so that what overlaps on a real server overlaps here
    (a capture runs while later requests wait, a control request waits for the step under way).

    One forward step at a time, as SGLang's scheduler: a step continues the prompt whose prefill
    is under way (chunked prefill), then takes the waiting prompts in arrival order up to
    ``chunk_tokens`` tokens, holding captures on miss back while a user prompt waits or is
    under way (and letting only one step of captures start, ``StepRule``) as redknot's
    scheduler hook does (``redknot.integration.capture_order``; ``captures_yield=False``: plain
    arrival order, SGLang without the hook). A step lasts ``us_per_token`` microseconds per
    token it computes; a prompt is served (its store effects happen) when its last token is
    computed. A control request is answered at the end of the step under way (at once when the
    engine is idle), as the scheduler reads its requests at the top of its loop. Decode steps
    are not modelled."""

    def __init__(
        self,
        us_per_token: float,
        chunk_tokens: int = 8192,
        captures_yield: bool = True,
        capture_step_tokens: int = CAPTURE_STEP_TOKENS,
        capture_step_fraction: float = CAPTURE_STEP_FRACTION,
    ):
        from redknot.integration.capture_order import StepRule

        self.us_per_token, self.chunk_tokens = us_per_token, chunk_tokens
        self.captures_yield, self.capture_step_tokens = captures_yield, capture_step_tokens
        self.step_rule = StepRule(capture_step_tokens, capture_step_fraction)
        self._waiting: deque[list] = deque()  # [tokens left, future, capture, started, tokens]
        self._boundary: list[asyncio.Future] = []
        self._task: asyncio.Task | None = None

    async def prefill(self, tokens: int, capture: bool = False) -> None:
        """Return once a prompt of ``tokens`` tokens has been computed."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append([max(tokens, 1), done, capture, False, max(tokens, 1)])
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        await done

    async def between_steps(self) -> None:
        """Return at the end of the step under way (at once when idle)."""
        if self._task is None or self._task.done():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._boundary.append(waiter)
        await waiter

    def _step_order(self) -> list[list]:
        from redknot.integration.capture_order import split_queue

        started = [item for item in self._waiting if item[3]]
        rest = [item for item in self._waiting if not item[3]]
        if self.captures_yield:
            in_flight = any(not item[2] for item in started)  # a user prompt's next chunk
            rest, _ = split_queue(
                rest, lambda item: item[2], lambda item: item[0], self.step_rule.tokens(),
                in_flight,
            )  # fmt: skip
            if rest and not rest[0][2]:  # the user prompts (split_queue never mixes the two)
                for item in rest:
                    self.step_rule.saw_user(id(item), item[4])
        return started + rest

    async def _run(self) -> None:
        while self._waiting:
            room, finished = self.chunk_tokens, []
            for item in self._step_order():
                take = min(item[0], room)
                item[0] -= take
                item[3] = True
                room -= take
                if item[0] == 0:
                    finished.append(item)
                if room == 0:
                    break
            await asyncio.sleep((self.chunk_tokens - room) * self.us_per_token * 1e-6)
            for item in finished:
                self._waiting.remove(item)
                item[1].set_result(None)
            waiters, self._boundary = self._boundary, []
            for waiter in waiters:
                waiter.set_result(None)
        for waiter in self._boundary:
            waiter.set_result(None)
        self._boundary = []


def _custom_flag(obj: Any, key: str) -> bool:
    """Whether a request object's (first) sampling params set redknot's ``key`` flag."""
    sp = obj.sampling_params
    sp = sp[0] if isinstance(sp, list) and sp else sp
    custom = sp.get("custom_params") if isinstance(sp, dict) else None
    return isinstance(custom, dict) and bool(custom.get(key, False))


def _is_registration(obj: Any) -> bool:
    """A registration (client or capture): it takes no exact-prefix hit, as redknot's radix
    cache gives it none."""
    from redknot.api.marks import KEY_REGISTER

    return _custom_flag(obj, KEY_REGISTER)


def _is_capture(obj: Any) -> bool:
    from redknot.api.marks import KEY_CAPTURE

    return _custom_flag(obj, KEY_CAPTURE)


class CpuTokenizerManager(FakeTokenizerManager):
    """A tokenizer manager in front of a :class:`CpuScheduler`; ``received`` holds a copy of
    every request object as it reached the tokenizer manager (before SGLang normalises it),
    captures on miss included; ``last`` is the last one that is not a capture."""

    def __init__(
        self,
        tokenizer: Any,
        scheduler: CpuScheduler,
        clock: EngineClock | None = None,
        **kwargs: Any,
    ):
        from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

        from redknot.api import control

        super().__init__(tokenizer, **kwargs)
        self.store = scheduler.store
        self.scheduler = scheduler
        self.clock = clock
        self._rids = count()

        from sglang.srt.managers.communicator import FanOutCommunicator

        answering: set[asyncio.Task] = set()
        by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        def make() -> FanOutCommunicator:
            def send(req):  # the zmq hop both ways, through SGLang's msgpack codec
                async def answer():
                    if clock is not None:
                        await clock.between_steps()
                    out = control.handle(scheduler, msgpack_decode(msgpack_encode(req)))
                    comm.handle_recv(msgpack_decode(msgpack_encode(out)))

                task = asyncio.ensure_future(answer())
                answering.add(task)
                task.add_done_callback(answering.discard)

            comm = FanOutCommunicator(send, 1)
            return comm

        async def communicator(req):
            """SGLang's communicator, as the launcher's: one control request in flight at a
            time (one per event loop: a test client may run each request in its own)."""
            loop = asyncio.get_running_loop()
            comm = by_loop.get(loop)
            if comm is None:
                comm = by_loop[loop] = make()
            return await comm(req)

        self.redknot_segments_communicator = communicator

    @property
    def last(self):
        return [obj for obj in self.received if not _is_capture(obj)][-1]

    @property
    def captures(self) -> list:
        """Every captured segment's registration (``input_ids``, ``sampling_params``), one
        per segment: a capture batch (one request of several prompts) is split, and so is a
        prompt of several consecutive segments (each then the prompt up to its end: what it is
        computed after, then it, with its one mark)."""
        from redknot.api.marks import decode_marks, encode_marks

        prompts = []
        for obj in filter(_is_capture, self.received):
            if isinstance(obj.sampling_params, list):
                prompts += zip(obj.input_ids, obj.sampling_params, strict=True)
            else:
                prompts.append((obj.input_ids, obj.sampling_params))
        out = []
        for ids, sp in prompts:
            for mark in decode_marks(sp["custom_params"], ids):
                one = {**sp, "custom_params": encode_marks([mark], register=True, capture=True)}
                out.append(types.SimpleNamespace(input_ids=ids[: mark.end], sampling_params=one))
        return out

    async def generate_request(self, obj: Any, request: Any = None):
        self.received.append(copy.deepcopy(obj))
        obj.normalize_batch_and_arguments()
        subs = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        if self.clock is not None:
            outs = await asyncio.gather(*(self._timed(sub) for sub in subs))
        else:
            outs = [self._serve_one(sub) for sub in subs]
        yield outs[0] if obj.is_single else outs

    async def _timed(self, obj: Any) -> dict:
        """``_serve_one`` once the engine clock has computed the prompt."""
        ids = obj.input_ids
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.encode(obj.text)
        ids = list(ids or ())
        prefix = 0 if _is_registration(obj) else self.scheduler.prefix_of(ids)
        await self.clock.prefill(len(ids) - prefix, capture=_is_capture(obj))
        return self._serve_one(obj)

    def _serve_one(self, obj: Any) -> dict:
        import msgspec
        from sglang.srt.sampling.sampling_params import SamplingParams

        if obj.input_ids is not None:
            ids = list(obj.input_ids)
        elif self.tokenizer is None:
            raise ValueError(
                "The engine initialized with skip_tokenizer_init=True cannot accept text"
            )
        else:
            ids = list(self.tokenizer.encode(obj.text))
        if len(ids) >= self.context_len:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )
        if ids and max(ids) >= self.model_config.vocab_size:
            raise ValueError(
                f"The input_ids contains values greater than the vocab size "
                f"({self.model_config.vocab_size})."
            )
        params = SamplingParams(**obj.sampling_params)
        params.normalize(self.tokenizer)
        params.verify(self.model_config.vocab_size)
        # what the scheduler decodes (SGLang sends sampling params inside its typed IPC messages)
        params = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
        rid = obj.rid or f"r{next(self._rids)}"
        read = self.scheduler.serve(rid, ids, params)  # exact-prefix hit + segment tokens read
        prefix = self.scheduler.last_prefix
        meta = {k: list(v) for k, v in self.scheduler.customized_info.pop(rid, {}).items()}
        return {
            "text": " ok",
            "output_ids": [0],
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(ids),
                "completion_tokens": 1,
                "cached_tokens": prefix,  # SGLang's: the exact-prefix hit only
                "standin_read_tokens": read,  # the stand-in's: that and the segment tokens read
                "weight_version": "default",
                **meta,  # as SGLang's tokenizer manager: one value per output token
            },
        }


class CpuServer:
    """A :class:`CpuScheduler` and :class:`CpuTokenizerManager` behind a fresh ``SegmentApi``,
    made current in ``app``."""

    def __init__(
        self,
        app: Any,
        tokenizer: Any,
        *,
        context_len: int = 2048,
        region_tokens: int = 1024,
        namespaces: str | None = None,
        chat: str = "off",
        server_args: Any = None,
        vocab_size: int | None = None,
        capture: str = "on",
        namespace_fraction: float = 1.0,
        auto_segments: str = "off",
        auto_chunk_tokens: int = 256,
        auto_capture_after: int = 2,
        auto_capture_context: int = 64,
        auto_capture_in_place: str = AUTO_CAPTURE_IN_PLACE,
        step_us_per_token: float = 0.0,
        captures_yield: bool = True,
        capture_step_tokens: int = CAPTURE_STEP_TOKENS,
        exact_prefix: bool = False,
    ):
        from sglang.srt.entrypoints import http_server

        from redknot.api.namespaces import NamespaceRegistry
        from redknot.api.options import AutoSegmentsOption, ChatSegments
        from redknot.api.server import install
        from redknot.api.service import SegmentApi

        vocab = vocab_size or (len(tokenizer) if tokenizer is not None else 512)
        self.app = app
        self.scheduler = CpuScheduler(
            region_tokens, namespace_fraction=namespace_fraction, exact_prefix=exact_prefix
        )
        self.store = self.scheduler.store
        clock = None
        if step_us_per_token > 0:
            clock = EngineClock(
                step_us_per_token,
                captures_yield=captures_yield,
                capture_step_tokens=capture_step_tokens,
            )
        self.tm = CpuTokenizerManager(
            tokenizer, self.scheduler, clock, context_len=context_len, vocab_size=vocab
        )
        self.api = SegmentApi(
            self.tm,
            chat=ChatSegments.parse(chat),
            namespaces=NamespaceRegistry.from_option(namespaces),
            capture=capture == "on",
            auto=AutoSegmentsOption.parse(
                auto_segments, auto_chunk_tokens, auto_capture_after, auto_capture_context
            ),
            in_place=auto_capture_in_place == "on",
        )
        install(app, self.api)
        http_server._global_state.tokenizer_manager = self.tm
        if chat != "off":
            self.enable_chat(server_args)

    def record_control_ops(self) -> list[str]:
        """From now on, the op of every control request the HTTP side sends to the scheduler is
        appended to the returned list."""
        ops: list[str] = []
        send = self.tm.redknot_segments_communicator

        async def recorded(req):
            ops.append(req.op)
            return await send(req)

        self.tm.redknot_segments_communicator = recorded
        return ops

    def enable_chat(self, server_args: Any) -> None:
        """The app's ``OpenAIServingChat`` over this tokenizer manager (see :func:`serving_chat`)."""
        self.app.state.openai_serving_chat = serving_chat(self.tm, server_args)


def serving_chat(tm: Any, server_args: Any) -> Any:
    """SGLang's ``OpenAIServingChat`` over the stand-in tokenizer manager ``tm``, with the
    tokenizer's own Jinja chat template; ``server_args``: the app's (:func:`make_server_args`)."""
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat

    tm.server_args = server_args
    tm.model_config.is_multimodal = False
    tm.model_config.get_default_sampling_params = dict
    tm.request_logger = types.SimpleNamespace(log_requests=False)
    templates = types.SimpleNamespace(
        chat_template_name=None,
        jinja_template_content_format="string",
        reasoning_config=None,
        force_reasoning=False,
    )
    return OpenAIServingChat(tm, templates)
