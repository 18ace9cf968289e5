"""Make the long case set (``long_v1``, ``shared/eval/FORMAT.md``): 4-8K tokens, 8-16
segments, questions whose answer lies far from the question, offline and deterministically.

Windows of 256-1K tokens matter only when the context is much longer than them; these cases
put the facts a question needs thousands of tokens before it, deep inside a segment, or in two
segments at once:

| kind         | segments                                                        | question                      |
| ------------ | --------------------------------------------------------------- | ----------------------------- |
| ``multihop`` | an object's owner in one segment, where that person lives in another (two distractor chains) | the town of the object's owner |
| ``deepneedle`` | prose; one long segment in the first half holds a secret number at 60-95% of its depth | the number                    |
| ``twofacts`` | two people's secret numbers in two different segments (and distractor numbers) | both numbers, in order (the answer is ``"N1 and N2"``) |
| ``rag``      | one document per town with the same kinds of facts (distractors) | a fact of one town            |

Prompts are plain text, as ``rag_v1`` (``benchmarks/make_cases.py``): a short instruction (the
shared ``system`` prefix), the segments, then the question and the start of its answer, so that
the model's first generated tokens are the answer's. Text comes from the profiler's word lists
(:mod:`redknot.profiler.words`); token counts use the model's tokenizer (``--model``); every
composed prompt is at most its target length (``--lengths``, cycled)::

    python benchmarks/make_long_cases.py --out benchmarks/cases/long_v1.jsonl
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable

from make_cases import Writer, _name, build_case, load_tokenizer

from redknot.eval.cases import Case, write_cases
from redknot.eval.compose import compose
from redknot.profiler import words as W
from redknot.profiler.calibration import filler_sentence

VERSION = 1
KINDS = ("multihop", "deepneedle", "twofacts", "rag")
OVERHEAD = 160  # system prefix, separators, question and answer start


def prose(w: Writer, budget: int) -> list[str]:
    """Filler sentences of about ``budget`` tokens."""
    out, used = [], 0
    while True:
        s = filler_sentence(w.rng)
        n = w.count(" " + s)
        if used + n > budget:
            return out
        out.append(s)
        used += n


def document_at(w: Writer, title: str, fact: str, budget: int, depth: float) -> str:
    """``title``, then prose of about ``budget`` tokens with ``fact`` after ``depth`` of it."""
    sentences = prose(w, budget - w.count(title) - w.count(" " + fact))
    sentences.insert(round(depth * len(sentences)), fact)
    return title + " ".join(sentences)


def budgets(w: Writer, n_docs: int, total: int) -> list[int]:
    """Token budgets of ``n_docs`` documents summing to ``total``, each within 0.6-1.4x of the
    mean."""
    weights = [w.rng.uniform(0.6, 1.4) for _ in range(n_docs)]
    scale = total / sum(weights)
    return [int(x * scale) for x in weights]


def distinct_names(w: Writer, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = _name(w.rng)
        if name not in names:
            names.append(name)
    return names


def multihop(w: Writer, n_docs: int, total: int) -> tuple[list[str], str, str, str]:
    rng = w.rng
    people = distinct_names(w, 3)
    towns = rng.sample(W.PLACES, 3)
    objects = rng.sample([f"{c} {o}" for c in W.COLOURS for o in W.OBJECTS], 3)
    facts: list[list[str]] = [[] for _ in range(n_docs)]
    first = rng.sample(range(n_docs // 2), 1)[0]  # the owner, early
    second = rng.choice([i for i in range(n_docs) if abs(i - first) >= n_docs // 3])
    facts[first].append(f"The {objects[0]} belongs to {people[0]}.")
    facts[second].append(f"{people[0]} lives in the town of {towns[0]}.")
    for k in (1, 2):  # distractor chains, each across two other segments
        a, b = rng.sample([i for i in range(n_docs) if i not in (first, second)], 2)
        facts[a].append(f"The {objects[k]} belongs to {people[k]}.")
        facts[b].append(f"{people[k]} lives in the town of {towns[k]}.")
    docs = [
        w.document(f"Document {i + 1}.\n", f, b)
        for i, (f, b) in enumerate(zip(facts, budgets(w, n_docs, total)))
    ]
    question = f"In which town does the owner of the {objects[0]} live?"
    return docs, question, f"The owner of the {objects[0]} lives in the town of", towns[0]


def deepneedle(w: Writer, n_docs: int, total: int) -> tuple[list[str], str, str, str]:
    rng = w.rng
    who, number = _name(rng), str(rng.randint(10000, 99999))
    sizes = budgets(w, n_docs, total)
    k = rng.randrange(max(1, n_docs // 2))  # in the first half of the prompt
    long = max(sizes)
    sizes[sizes.index(long)], sizes[k] = sizes[k], long  # the longest segment holds it
    fact = f"The secret number of {who} is {number}."
    docs = []
    for i, b in enumerate(sizes):
        title = f"Document {i + 1}.\n"
        if i == k:
            docs.append(document_at(w, title, fact, b, rng.uniform(0.6, 0.95)))
        else:
            docs.append(w.document(title, [], b))
    return docs, f"What is the secret number of {who}?", f"The secret number of {who} is", number


def twofacts(w: Writer, n_docs: int, total: int) -> tuple[list[str], str, str, str]:
    rng = w.rng
    people = distinct_names(w, 4)
    numbers = [str(rng.randint(100, 999)) for _ in people]
    facts: list[list[str]] = [[] for _ in range(n_docs)]
    where = rng.sample(range(n_docs), 4)  # the two asked for first, then two distractors
    for person, number, i in zip(people, numbers, where):
        facts[i].append(f"The secret number of {person} is {number}.")
    docs = [
        w.document(f"Document {i + 1}.\n", f, b)
        for i, (f, b) in enumerate(zip(facts, budgets(w, n_docs, total)))
    ]
    a, b = people[:2]
    question = f"What are the secret numbers of {a} and {b}?"
    return (
        docs,
        question,
        f"The secret numbers of {a} and {b} are",
        f"{numbers[0]} and {numbers[1]}",
    )


def rag(w: Writer, n_docs: int, total: int) -> tuple[list[str], str, str, str]:
    rng = w.rng
    towns = rng.sample(W.PLACES, n_docs)
    names = distinct_names(w, n_docs)
    docs = []
    for i, (town, mayor, b) in enumerate(zip(towns, names, budgets(w, n_docs, total))):
        obj = f"{rng.choice(W.COLOURS)} {rng.choice(W.OBJECTS)}"
        facts = [f"The mayor of {town} is {mayor}.", f"The museum of {town} keeps a {obj}."]
        docs.append(w.document(f"Document {i + 1}: {town}.\n", facts, b))
    k = rng.randrange(n_docs // 2)  # far from the question
    question = f"Who is the mayor of {towns[k]}?"
    return docs, question, f"The mayor of {towns[k]} is", names[k]


MAKERS: dict[str, Callable] = {
    "multihop": multihop,
    "deepneedle": deepneedle,
    "twofacts": twofacts,
    "rag": rag,
}


def make_case(tokenizer, rng: random.Random, kind: str, index: int, length: int) -> Case:
    n_docs = rng.randint(8, min(16, length // 400))
    docs, question, start, answer = MAKERS[kind](Writer(tokenizer, rng), n_docs, length - OVERHEAD)
    return build_case(
        tokenizer, kind, index, length, docs, question, start, answer, set=f"long_v{VERSION}"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="whose tokenizer counts tokens")
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--lengths", default="4300,6144,8000,5120,7168")
    p.add_argument("--seed", type=int, default=2025)
    p.add_argument("--out", default="benchmarks/cases/long_v1.jsonl")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(args.seed)
    cases = [
        make_case(tokenizer, rng, KINDS[i % len(KINDS)], i, lengths[i % len(lengths)])
        for i in range(args.count)
    ]
    write_cases(cases, args.out)
    sizes = [len(compose(tokenizer, c).ids) for c in cases]
    segs = [len(c.segments) for c in cases]
    print(
        f"wrote {len(cases)} cases to {args.out}: {min(sizes)}-{max(sizes)} tokens "
        f"(mean {sum(sizes) / len(sizes):.0f}), {min(segs)}-{max(segs)} segments, "
        f"seed {args.seed}, version {VERSION}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
