"""Shared-prefix workload: groups of requests that share a long document or system prompt.

The RAG / templated-assistant case of SPEC §1: each group has one long prefix (a
retrieved document behind a short instruction), and each request of the group asks a
question about it. Seeded, so two runs (or two strategies, or the simulator and the
HTTP fleet) see the same traffic.

Lengths are in **tokens** of the emulated engine's tokenizer (4 UTF-8 bytes per token,
:mod:`prefixroute.engine.tokenizer`); the text is ASCII, so 1 token = 4 characters.
The reference case of SPEC §1 is 8,000-token prefixes.

Random streams (each seeded from ``seed``, so that changing one knob does not reshuffle
the others): group and question choice per request; Poisson arrival times; the text of
each group's document; the text of each question.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from prefixroute.workloads.prompt import CHARS_PER_TOKEN, PromptChain, Segment, content_id
from prefixroute.workloads.session import ChainPrompt, Session, TextChatPrompt, Turn

__all__ = ["SharedPrefixWorkload", "SharedPrefixSession", "WorkloadRequest", "CHARS_PER_TOKEN", "text_of_length"]

_WORDS = (
    "cache prefix token router engine latency batch decode prefill block memory queue "
    "request instance model tensor kernel shard replica stream budget vector matrix "
    "policy affinity overflow tenant variant endpoint metric trace sample window layer "
    "attention context history document answer question system user assistant"
).split()

_HEAD = "Answer the user's question using only the document below.\n\nDocument:\n"
# Characters the chat rendering adds around each message (core.routing_text.render_chat_text)
# and the engine's generation prompt (engine.server.GENERATION_PROMPT):
_USER_WRAP = len("<|user|>\n") + len("\n")  # 10
_GENERATION = len("<|assistant|>\n")  # 14


def text_of_length(rng: random.Random, chars: int) -> str:
    """Pseudo-random ASCII words, exactly ``chars`` characters long ("" for ``chars <= 0``)."""
    if chars <= 0:
        return ""
    out: list[str] = []
    n = 0  # length of " ".join(out) + 1
    while n <= chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload (the closed-loop demo's form).

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
        question_tokens: length of each request's question, tokens.
        output_tokens: ``max_tokens`` of each request.
        popularity: ``"uniform"``, ``"zipf"`` or ``"hot"`` choice of group per request.
        zipf_s: Zipf exponent when ``popularity == "zipf"`` (group k has weight 1/(k+1)^s).
        hot_fraction: when ``popularity == "hot"``, the share of requests (0-1) that go
            to group 0 (one very hot document); the others share the rest uniformly.
        model: the ``model`` field of every request.
        seed: seeds the texts, the group sequence and the arrival times.
        prompts_per_group: requests each document serves before it is replaced by a new
            one in its group (document churn: a group is a slot of popularity, its
            document changes every ``prompts_per_group`` requests, so that fraction
            of requests meets a document no cache has seen). None (default): each
            group keeps one document forever.
        arrival_rate: mean requests per model second of the open-loop Poisson arrivals
            (:meth:`sessions`); closed-loop drivers ignore it.
        ramp_s: the open-loop arrival rate rises linearly from 0 to ``arrival_rate`` over
            the first ``ramp_s`` model seconds (0: constant from the start). A fleet that
            starts cold at a rate near its capacity builds a queue of first requests
            (every document misses) that it takes the rest of a short run to drain.
        instruction_tokens: length of an instruction block every group shares, placed
            before the documents (a templated assistant's system prompt), tokens; 0 = none.
            A PrefixLength that ends inside it gives every request the same key.

    Raises:
        ValueError: on construction, for a non-positive count, length or rate, or an
            unknown popularity.
    """

    groups: int = 40
    prefix_tokens: int = 8000
    question_tokens: int = 64
    output_tokens: int = 16
    popularity: str = "uniform"
    zipf_s: float = 1.0
    hot_fraction: float = 0.6
    model: str = "meta-llama/Llama-3.1-70B-Instruct"
    seed: int = 0
    prompts_per_group: int | None = None
    arrival_rate: float = 1.0
    instruction_tokens: int = 0
    ramp_s: float = 0.0
    _chains: dict[int, PromptChain] = field(default_factory=dict, init=False, repr=False, compare=False)
    _texts: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.prefix_tokens < 1 or self.question_tokens < 1 or self.output_tokens < 1:
            raise ValueError("prefix_tokens, question_tokens and output_tokens must be >= 1")
        if self.popularity not in ("uniform", "zipf", "hot"):
            raise ValueError(f"popularity must be 'uniform', 'zipf' or 'hot', got {self.popularity!r}")
        if not 0.0 < self.hot_fraction < 1.0:
            raise ValueError(f"hot_fraction must be between 0 and 1 (exclusive), got {self.hot_fraction}")
        if self.popularity == "hot" and self.groups < 2:
            raise ValueError("popularity 'hot' needs at least 2 groups")
        if self.prompts_per_group is not None and self.prompts_per_group < 1:
            raise ValueError(f"prompts_per_group must be >= 1 or None, got {self.prompts_per_group}")
        if self.instruction_tokens < 0:
            raise ValueError(f"instruction_tokens must be >= 0, got {self.instruction_tokens}")
        if not self.arrival_rate > 0:
            raise ValueError(f"arrival_rate must be > 0 requests/s, got {self.arrival_rate}")
        if not self.ramp_s >= 0:
            raise ValueError(f"ramp_s must be >= 0 seconds, got {self.ramp_s}")

    def describe(self) -> str:
        """One line naming the workload and its parameters (the ``workload`` JSON field)."""
        pop = {"uniform": "uniform", "zipf": f"zipf(s={self.zipf_s})",
               "hot": f"hot(group 0: {self.hot_fraction:.0%})"}[self.popularity]
        ppg = "unique" if self.prompts_per_group is None else str(self.prompts_per_group)
        return (
            f"shared-prefix groups={self.groups} prefix_tokens={self.prefix_tokens} "
            f"question_tokens={self.question_tokens} output_tokens={self.output_tokens} "
            f"popularity={pop} seed={self.seed} prompts_per_group={ppg} arrival_rate={self.arrival_rate:g}/s"
            + (f" instruction_tokens={self.instruction_tokens}" if self.instruction_tokens else "")
            + (f" ramp_s={self.ramp_s:g}" if self.ramp_s else "")
        )

    def _instruction(self) -> str:
        if not self.instruction_tokens:
            return ""
        return text_of_length(random.Random(f"instruction-{self.seed}"), self.instruction_tokens * CHARS_PER_TOKEN)

    # -- text --------------------------------------------------------------------------

    def prefix_text(self, doc: int) -> str:
        """The system text of document ``doc`` (group ``g``'s first document is ``g``,
        its ``n``-th is ``g + n * groups``): a short instruction then a unique document
        (``max(len(instruction), prefix_tokens * 4)`` characters)."""
        text = self._texts.get(doc)
        if text is None:
            rng = random.Random(f"prefix-{self.seed}-{doc}")
            body = text_of_length(rng, max(0, self.prefix_tokens * CHARS_PER_TOKEN - len(_HEAD)))
            text = _HEAD + self._instruction() + body
            if len(self._texts) > 4 * self.groups:  # churned documents are not needed again
                self._texts.clear()
            self._texts[doc] = text
        return text

    def prefixes(self) -> list[str]:
        """The system text of every group's first document."""
        return [self.prefix_text(g) for g in range(self.groups)]

    def _question_chars(self, j: int) -> tuple[str, int]:
        head = f"Question {j}: "
        return head, max(1, self.question_tokens * CHARS_PER_TOKEN - 12 - len(str(j)))

    def question_text(self, doc: int, j: int) -> str:
        """Question ``j`` (about ``question_tokens`` tokens), asked about document ``doc``."""
        head, n = self._question_chars(j)
        return head + text_of_length(random.Random(f"question-{self.seed}-{doc}-{j}"), n)

    def _body(self, doc: int, j: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [
                {"role": "system", "content": self.prefix_text(doc)},
                {"role": "user", "content": self.question_text(doc, j)},
            ],
            "max_tokens": self.output_tokens,
        }

    # -- draws -------------------------------------------------------------------------

    def _draws(self) -> Iterator[tuple[int, int, int]]:
        """Endless ``(index, group, document)``; the question is the index."""
        rng = random.Random(f"requests-{self.seed}")
        population = range(self.groups)
        cum = None
        if self.popularity == "zipf":
            cum = list(itertools.accumulate(1.0 / (k + 1) ** self.zipf_s for k in range(self.groups)))
        elif self.popularity == "hot":
            rest = (1.0 - self.hot_fraction) / (self.groups - 1)
            cum = list(itertools.accumulate([self.hot_fraction] + [rest] * (self.groups - 1)))
        ppg = self.prompts_per_group
        served = [0] * self.groups
        for i in itertools.count():
            g = rng.choices(population, cum_weights=cum)[0] if cum else rng.randrange(self.groups)
            doc = g
            if ppg is not None:
                doc = g + (served[g] // ppg) * self.groups
                served[g] += 1
            yield i, g, doc

    def requests(self, count: int) -> Iterator[WorkloadRequest]:
        """The first ``count`` requests as chat bodies (the same ones for the same parameters)."""
        for i, g, doc in itertools.islice(self._draws(), count):
            yield WorkloadRequest(i, g, self._body(doc, i), self.prefix_tokens + self.question_tokens)

    def sessions(self) -> Iterator["SharedPrefixSession"]:
        """Endless one-turn sessions, the same requests as :meth:`requests`, arriving as a
        Poisson process of rate ``arrival_rate`` per model second (first at ``t > 0``),
        rising linearly over the first ``ramp_s`` seconds when set.

        The ramp maps the points of a unit-rate Poisson process through the inverse of the
        cumulative rate ``Λ(t) = λ t² / (2 ramp)`` (``t < ramp``), ``λ (t - ramp / 2)`` after:
        a Poisson process of rate ``λ min(1, t / ramp)``."""
        arrivals = random.Random(f"arrivals-{self.seed}")
        rate, ramp = self.arrival_rate, self.ramp_s
        area = 0.0  # cumulative rate so far
        for i, g, doc in self._draws():
            area += arrivals.expovariate(1.0)
            if ramp and area < rate * ramp / 2:
                t = math.sqrt(2 * ramp * area / rate)
            else:
                t = area / rate + ramp / 2
            yield SharedPrefixSession(self, t, i, g, doc)

    # -- segments ----------------------------------------------------------------------

    def _prefix_chain(self, doc: int) -> PromptChain:
        chain = self._chains.get(doc)
        if chain is None:
            # "<|system|>\n" + the instruction every group shares, then the group's own
            # document + "\n" (the instruction's blocks are common to all groups, as in text).
            head = Segment(content_id("shared-prefix-head", self.seed if self.instruction_tokens else "",
                                      self.instruction_tokens),
                           len("<|system|>\n") + len(_HEAD) + self.instruction_tokens * CHARS_PER_TOKEN)
            body_chars = max(0, self.prefix_tokens * CHARS_PER_TOKEN - len(_HEAD))
            content = (content_id("shared-prefix", self.seed, doc, self.prefix_tokens) if body_chars
                       else content_id("newline"))
            chain = PromptChain.of(head, Segment(content, body_chars + 1))
            if len(self._chains) > 4 * self.groups:  # churned documents are not needed again
                self._chains.clear()
            self._chains[doc] = chain
        return chain

    def _question_segment(self, doc: int, j: int) -> Segment:
        head, n = self._question_chars(j)
        chars = _USER_WRAP + len(head) + n + _GENERATION
        return Segment(content_id("question", self.seed, doc, j, self.question_tokens), chars)


class SharedPrefixSession(Session):
    """One question about one group's document (a one-turn session)."""

    __slots__ = ("workload", "start_s", "index", "group", "doc", "num_turns")

    def __init__(self, workload: SharedPrefixWorkload, start_s: float, index: int, group: int, doc: int) -> None:
        self.workload = workload
        self.start_s = start_s
        self.index = index
        self.group = group
        self.doc = doc
        self.num_turns = 1

    def turn(self, k: int, answers: Sequence[str] | None = None) -> Turn:
        wl = self.workload
        if answers is not None:
            return Turn(TextChatPrompt(self.body(k, answers)), wl.output_tokens)
        chain = wl._prefix_chain(self.doc).extend(wl._question_segment(self.doc, self.index))
        return Turn(ChainPrompt(chain, None, wl.model, routing_tail=_GENERATION), wl.output_tokens)

    def body(self, k: int, answers: Sequence[str]) -> dict[str, Any]:
        return self.workload._body(self.doc, self.index)
