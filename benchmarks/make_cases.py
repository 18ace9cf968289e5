"""Make the RAG fidelity case set (``shared/eval/FORMAT.md``), offline and deterministically.

Three kinds, each a few documents (the reusable segments) after a short instruction (the
shared ``system`` prefix), then a question whose answer start is part of the prompt, so that
the first generated token is the answer's first token:

| kind       | documents                                           | question                     |
| ---------- | --------------------------------------------------- | ---------------------------- |
| ``rag``    | one document per town, each with the same kinds of facts (distractors) | a fact of one town |
| ``multihop`` | an object's owner in one document, where people live in others (with distractor people) | the town of the object's owner |
| ``needle`` | prose documents, one holds a secret number          | the number                   |

Text comes from the profiler's word lists (:mod:`redknot.profiler.words`), so the same seed
gives the same cases on every machine. Token counts use the model's tokenizer (``--model``):
every case's composed prompt is at most its target length (``--lengths``, cycled).

    python benchmarks/make_cases.py --out benchmarks/cases/rag_v1.jsonl
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable

from redknot.eval.cases import Case, write_cases
from redknot.eval.compose import compose
from redknot.profiler import words as W
from redknot.profiler.calibration import filler_sentence

VERSION = 1
SYSTEM = "Read the documents below and answer the question at the end.\n\n"
KINDS = ("rag", "multihop", "needle")


def _name(rng: random.Random) -> str:
    return f"{rng.choice(W.FIRST_NAMES)} {rng.choice(W.FAMILY_NAMES)}"


class Writer:
    """Builds documents of a token budget from filler prose and a few facts."""

    def __init__(self, tokenizer, rng: random.Random) -> None:
        self.tokenizer, self.rng = tokenizer, rng

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def document(self, title: str, facts: list[str], budget: int) -> str:
        """``title`` then prose with ``facts`` at random depths, about ``budget`` tokens."""
        used = self.count(title) + sum(self.count(" " + f) for f in facts)
        sentences: list[str] = []
        while True:
            s = filler_sentence(self.rng)
            n = self.count(" " + s)
            if used + n > budget:
                break
            sentences.append(s)
            used += n
        for fact in facts:
            sentences.insert(self.rng.randint(0, len(sentences)), fact)
        return title + " ".join(sentences)


def _answer_start(tokenizer, start: str, answer: str) -> str:
    """Keep a lone space token before the answer in the prompt (SmolLM2 splits it off
    before digits), so that the first generated token is the answer's."""
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    spaced = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    return start + " " if len(space) == 1 and spaced[:1] == space else start


def rag(w: Writer, n_docs: int, budget: int) -> tuple[list[str], str, str, str]:
    rng = w.rng
    towns = rng.sample(W.PLACES, n_docs)
    relation = rng.choice(("mayor", "museum", "bridges"))
    facts, answers = [], []
    for town in towns:
        mayor, obj = _name(rng), f"{rng.choice(W.COLOURS)} {rng.choice(W.OBJECTS)}"
        bridges = str(rng.randint(12, 97))
        facts.append(
            [
                f"The mayor of {town} is {mayor}.",
                f"The museum of {town} keeps a {obj}.",
                f"The town of {town} has {bridges} bridges.",
            ]
        )
        answers.append({"mayor": mayor, "museum": obj, "bridges": bridges}[relation])
    docs = [
        w.document(f"Document {i + 1}: {t}.\n", f, budget)
        for i, (t, f) in enumerate(zip(towns, facts))
    ]
    k = rng.randrange(n_docs)
    town = towns[k]
    question, start = {
        "mayor": (f"Who is the mayor of {town}?", f"The mayor of {town} is"),
        "museum": (f"What does the museum of {town} keep?", f"The museum of {town} keeps a"),
        "bridges": (
            f"How many bridges does {town} have?",
            f"The number of bridges in {town} is",
        ),
    }[relation]
    return docs, question, start, answers[k]


def multihop(w: Writer, n_docs: int, budget: int) -> tuple[list[str], str, str, str]:
    rng = w.rng
    people = []
    while len(people) < 3:
        p = _name(rng)
        if p not in people:
            people.append(p)
    towns = rng.sample(W.PLACES, 3)
    objects = rng.sample([f"{c} {o}" for c in W.COLOURS for o in W.OBJECTS], 2)
    facts: list[list[str]] = [[] for _ in range(n_docs)]
    slots = rng.sample(range(n_docs), min(n_docs, 5))
    facts[slots[0]].append(f"The {objects[0]} belongs to {people[0]}.")
    facts[slots[1 % len(slots)]].append(f"{people[0]} lives in the town of {towns[0]}.")
    facts[slots[2 % len(slots)]].append(f"{people[1]} lives in the town of {towns[1]}.")
    facts[slots[3 % len(slots)]].append(f"The {objects[1]} belongs to {people[1]}.")
    facts[slots[4 % len(slots)]].append(f"{people[2]} lives in the town of {towns[2]}.")
    docs = [w.document(f"Document {i + 1}.\n", f, budget) for i, f in enumerate(facts)]
    question = f"In which town does the owner of the {objects[0]} live?"
    return docs, question, f"The owner of the {objects[0]} lives in the town of", towns[0]


def needle(w: Writer, n_docs: int, budget: int) -> tuple[list[str], str, str, str]:
    rng = w.rng
    who, number = _name(rng), str(rng.randint(10000, 99999))
    k = rng.randrange(n_docs)
    docs = [
        w.document(
            f"Document {i + 1}.\n",
            [f"The secret number of {who} is {number}."] if i == k else [],
            budget,
        )
        for i in range(n_docs)
    ]
    return docs, f"What is the secret number of {who}?", f"The secret number of {who} is", number


MAKERS: dict[str, Callable] = {"rag": rag, "multihop": multihop, "needle": needle}


def make_case(tokenizer, rng: random.Random, kind: str, index: int, length: int) -> Case:
    n_docs = max(3, min(8, length // 700))
    overhead = 120  # system, separators, question
    docs, question, start, answer = MAKERS[kind](
        Writer(tokenizer, rng), n_docs, (length - overhead) // n_docs
    )
    return build_case(tokenizer, kind, index, length, docs, question, start, answer)


def build_case(
    tokenizer, kind: str, index: int, length: int, docs: list[str], question: str, start: str,
    answer: str, **extra,
) -> Case:  # fmt: skip
    """The case of a maker's documents, question and answer (the answer's start ends the
    prompt), refused if its composed prompt exceeds ``length`` tokens."""
    q = f"\n\nQuestion: {question}\nAnswer: {_answer_start(tokenizer, start, answer)}"
    case = Case(
        f"{kind}-{index:03d}",
        tuple(docs),
        q,
        (answer,),
        system=SYSTEM,
        between=("",) + ("\n\n",) * (len(docs) - 1),
        extra={"kind": kind, "target_tokens": length, **extra},
    )
    tokens = len(compose(tokenizer, case).ids)
    if tokens > length:
        raise AssertionError(f"{case.id}: {tokens} tokens > {length}")
    return case


def load_tokenizer(model: str):
    """The tokenizer of ``model`` (a spec of ``redknot.reference.resolve_source``)."""
    from transformers import AutoTokenizer

    from redknot.reference import resolve_source

    source = resolve_source(model)
    return AutoTokenizer.from_pretrained(source.directory, **source.kwargs())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="whose tokenizer counts tokens")
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--lengths", default="2048,3072,4096,2048,3072,6144")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--out", default="benchmarks/cases/rag_v1.jsonl")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(args.seed)
    cases = [
        make_case(
            tokenizer, rng, KINDS[i % len(KINDS)], i, lengths[(i // len(KINDS)) % len(lengths)]
        )
        for i in range(args.count)
    ]
    write_cases(cases, args.out)
    sizes = [len(compose(tokenizer, c).ids) for c in cases]
    print(
        f"wrote {len(cases)} cases to {args.out}: {min(sizes)}-{max(sizes)} tokens "
        f"(mean {sum(sizes) / len(sizes):.0f}), seed {args.seed}, version {VERSION}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
