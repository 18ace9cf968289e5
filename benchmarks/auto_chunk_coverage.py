"""How much of a reordered RAG prompt automatic chunks can serve: the chunker alone, no server.

    python benchmarks/auto_chunk_coverage.py

For documents of L tokens (random token ids) and ``--redknot-auto-chunk-tokens N``: a prompt of
six documents under a 50-token head and before a 40-token question, then the same documents
shuffled under another head; prints the fraction of the second prompt's document tokens that lie
in chunks the first prompt marked (what the second request could take from the store, before
the reuse gate decides), averaged over three seeds. The loss is the chunks that straddle a
document's edges; it does not depend on the tokenizer or the model (docs/auto_segments.md).
"""

from __future__ import annotations

import argparse
import random

from redknot.api.auto import AutoSegments
from redknot.api.options import AutoSegmentsOption

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-tokens", type=int, nargs="+", default=[1000, 2000, 4000])
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()
    print("| document tokens | " + " | ".join(f"N = {n}" for n in args.chunk_tokens) + " |")
    print("| --- |" + " --- |" * len(args.chunk_tokens))
    for length in args.doc_tokens:
        row = [f"{coverage(length, n):.2f}" for n in args.chunk_tokens]
        print(f"| {length} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
