"""Shared-prefix workload: groups of requests that share a long document or system prompt.

The RAG / templated-assistant case of SPEC §1: each group has one long prefix (a
retrieved document behind a short instruction), and each request of the group asks a
unique question about it. Seeded, so two runs (or two strategies) see the same traffic.

Lengths are in **tokens** of the emulated engine's tokenizer (4 UTF-8 bytes per token,
:mod:`prefixroute.engine.tokenizer`); the text is ASCII, so 1 token = 4 characters.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["SharedPrefixWorkload", "WorkloadRequest", "CHARS_PER_TOKEN"]

#: Characters per token of the emulated engine's tokenizer on ASCII text.
CHARS_PER_TOKEN = 4

_WORDS = (
    "cache prefix token router engine latency batch decode prefill block memory queue "
    "request instance model tensor kernel shard replica stream budget vector matrix "
    "policy affinity overflow tenant variant endpoint metric trace sample window layer "
    "attention context history document answer question system user assistant"
).split()


def _text(rng: random.Random, chars: int) -> str:
    """Pseudo-random ASCII words, exactly ``chars`` characters long."""
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        index: position in the workload (0-based).
        group: the prefix group it belongs to.
        body: the OpenAI chat-completions JSON body (a dict, ``stream`` not set).
        prompt_tokens: approximate prompt length in tokens (prefix + question).
    """

    index: int
    group: int
    body: dict[str, Any]
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class SharedPrefixWorkload:
    """Seeded generator of shared-prefix chat requests.

    Attributes:
        groups: number of distinct prefixes (documents).
        prefix_tokens: length of each group's prefix, tokens (the reference case is 8,000).
        question_tokens: length of each request's unique question, tokens.
        output_tokens: ``max_tokens`` of each request.
        popularity: ``"uniform"`` or ``"zipf"`` choice of group per request.
        zipf_s: Zipf exponent when ``popularity == "zipf"`` (group k has weight 1/k^s).
        model: the ``model`` field of every request.
        seed: seeds the texts and the group sequence.
    """

    groups: int = 40
    prefix_tokens: int = 8000
    question_tokens: int = 64
    output_tokens: int = 16
    popularity: str = "uniform"
    zipf_s: float = 1.0
    model: str = "meta-llama/Llama-3.1-70B-Instruct"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.prefix_tokens < 1 or self.question_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prefix_tokens, question_tokens and output_tokens must be >= 1")
        if self.popularity not in ("uniform", "zipf"):
            raise ValueError(f"popularity must be 'uniform' or 'zipf', got {self.popularity!r}")

    def describe(self) -> str:
        """One line naming the workload and its parameters (the ``workload`` JSON field)."""
        pop = self.popularity if self.popularity == "uniform" else f"zipf(s={self.zipf_s})"
        return (
            f"shared-prefix groups={self.groups} prefix_tokens={self.prefix_tokens} "
            f"question_tokens={self.question_tokens} output_tokens={self.output_tokens} "
            f"popularity={pop} seed={self.seed}"
        )

    def prefixes(self) -> list[str]:
        """The system text of each group: a short instruction then a unique document."""
        rng = random.Random(f"prefix-{self.seed}")
        head = "Answer the user's question using only the document below.\n\nDocument:\n"
        body_chars = max(0, self.prefix_tokens * CHARS_PER_TOKEN - len(head))
        return [head + _text(rng, body_chars) for _ in range(self.groups)]

    def requests(self, count: int) -> Iterator[WorkloadRequest]:
        """The first ``count`` requests (the same ones for the same parameters)."""
        prefixes = self.prefixes()
        rng = random.Random(f"requests-{self.seed}")
        weights = None
        if self.popularity == "zipf":
            weights = [1.0 / (k + 1) ** self.zipf_s for k in range(self.groups)]
        q_chars = self.question_tokens * CHARS_PER_TOKEN
        for i in range(count):
            g = rng.choices(range(self.groups), weights=weights)[0] if weights else rng.randrange(self.groups)
            question = f"Question {i}: " + _text(rng, max(1, q_chars - 12 - len(str(i))))
            body = {
                "model": self.model,
                "messages": [
                    {"role": "system", "content": prefixes[g]},
                    {"role": "user", "content": question},
                ],
                "max_tokens": self.output_tokens,
            }
            yield WorkloadRequest(i, g, body, self.prefix_tokens + self.question_tokens)
