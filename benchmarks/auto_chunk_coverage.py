"""How much of a reordered RAG prompt automatic chunks can serve: the chunker alone, no server.

    python benchmarks/auto_chunk_coverage.py

For documents of L tokens (random token ids) and ``--redknot-auto-chunk-tokens N``: a prompt of
six documents under a 50-token head and before a 40-token question, then the same documents
shuffled under another head; prints the fraction of the second prompt's document tokens that lie
in chunks the first prompt marked (what the second request could take from the store, before
the reuse gate decides), averaged over three seeds. The loss is the chunks that straddle a
document's edges; it does not depend on the tokenizer or the model (docs/auto_segments.md).

    python benchmarks/auto_chunk_coverage.py --stream --chunk-tokens 256

replays a stream of RAG prompts instead (``--pool`` documents of ``--doc-range`` tokens, each
prompt ``--per-prompt`` of them in random order under a head of its own and before a question)
through a store that keeps a chunk at its second miss, as ``--redknot-auto-capture-after 2``
does, and prints the share of prompt tokens after ``--warmup`` prompts that lie in stored
chunks; beside it, the same with ``--redknot-auto-segments cdc-edges``, which learns
documents' edges from repeats (``redknot.api.edges``). A missed chunk that straddles two
documents ends at the same content-defined cut of the second document wherever that document
appears, so two such chunks ending in the same ``WINDOW`` tokens (the chunker's hash window)
share the second document's head as their longest common suffix; likewise their longest common
prefix is the first document's tail when they start at the same cut. An edge of at least the
chunker's minimum learned that way is stored and later chunks that end (start) with it are cut
so that it is a segment of its own. Both use the server's code (``AutoSegments``); the figures
bound what the store could serve: capture timing and the reuse gate are not modelled.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from redknot.api.auto import AutoSegments
from redknot.api.options import AutoSegmentsOption
from redknot.eval.compose import serve_prompt

VOCAB = (1000, 100_000)


def _prompt(rng: random.Random, docs: list, order: list[int], question: list[int]) -> list[int]:
    """A 50-token head of its own, the documents in ``order``, the question."""
    head = [rng.randrange(*VOCAB) for _ in range(50)]
    return head + [t for i in order for t in docs[i]] + question


def coverage(doc_tokens: int, chunk_tokens: int, seeds: int = 3, num_docs: int = 6) -> float:
    auto = AutoSegments(AutoSegmentsOption(enabled=True, chunk_tokens=chunk_tokens))
    served = total = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        docs = [[rng.randrange(*VOCAB) for _ in range(doc_tokens)] for _ in range(num_docs)]
        question = [rng.randrange(*VOCAB) for _ in range(40)]
        first = _prompt(rng, docs, list(range(num_docs)), question)
        stored = {tuple(first[a:b]) for a, b in auto.spans(first)}
        order = list(range(num_docs))
        rng.shuffle(order)
        second = _prompt(rng, docs, order, question)
        served += sum(b - a for a, b in auto.spans(second) if tuple(second[a:b]) in stored)
        total += doc_tokens * num_docs
    return served / total


def stream_coverage(
    doc_range: tuple[int, int], chunk_tokens: int, pool: int, per_prompt: int, prompts: int,
    warmup: int, edges: bool, seed: int = 0,
) -> float:  # fmt: skip
    """Share of prompt tokens after ``warmup`` prompts served from the store (docstring), with
    the server's chunking (``AutoSegments``, and its ``cdc-edges`` learning when ``edges``)."""
    option = AutoSegmentsOption(enabled=True, chunk_tokens=chunk_tokens, edges=edges)
    auto = AutoSegments(option)
    rng = random.Random(seed)
    docs = [[rng.randrange(*VOCAB) for _ in range(rng.randint(*doc_range))] for _ in range(pool)]
    misses: dict[tuple, int] = {}
    stored: set[tuple] = set()
    served = total = 0
    for k in range(prompts):
        order = rng.sample(range(pool), per_prompt)
        question = [rng.randrange(*VOCAB) for _ in range(40)]
        prompt = _prompt(rng, docs, order, question)
        hit = serve_prompt(auto, prompt, stored, misses)  # the capture path's store, modelled
        if k >= warmup:
            served += hit
            total += len(prompt)
    return served / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-tokens", type=int, nargs="+", default=[1000, 2000, 4000])
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--stream", action="store_true", help="a stream of prompts (docstring)")
    parser.add_argument("--doc-range", type=int, nargs=2, default=[1000, 4000])
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--per-prompt", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--out", default=None, help="--stream: also write the rows as JSON")
    args = parser.parse_args()
    if args.stream:
        print("| chunk tokens | served, chunks | served, chunks and learned edges |")
        print("| --- | --- | --- |")
        rows = []
        for n in args.chunk_tokens:
            sizes = (tuple(args.doc_range), n, args.pool, args.per_prompt, args.prompts)
            row = [stream_coverage(*sizes, args.warmup, e) for e in (False, True)]
            print(f"| {n} | {row[0]:.3f} | {row[1]:.3f} |")
            rows.append({"chunk_tokens": n, "served_chunks": round(row[0], 4),
                         "served_chunks_and_edges": round(row[1], 4)})  # fmt: skip
        if args.out:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import serving_common as common

            params = {k: getattr(args, k) for k in ("doc_range", "pool", "per_prompt", "prompts",
                                                    "warmup")}  # fmt: skip
            common.write_json(args.out, common.record(params=params, rows=rows))
        return
    print("| document tokens | " + " | ".join(f"N = {n}" for n in args.chunk_tokens) + " |")
    print("| --- |" + " --- |" * len(args.chunk_tokens))
    for length in args.doc_tokens:
        row = [f"{coverage(length, n):.2f}" for n in args.chunk_tokens]
        print(f"| {length} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
