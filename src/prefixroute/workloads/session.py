"""What every workload hands to its drivers: sessions of turns, in two forms.

A **session** is what one client does: it starts at ``start_s`` (model seconds from the
start of the run) and sends ``num_turns`` requests one after another, each after the
previous one's answer plus a think time. A shared-prefix question is a session of one
turn; a chat conversation is a session of several; a trace record is one turn at its
recorded time.

Each turn exists in two forms:

* :meth:`Session.turn` — the **simulator's** form: a :class:`SimPrompt` (the engine's
  view as KV block hashes, the router's view as a routing key for any PrefixLength) and
  the number of output tokens. No text is built (:mod:`prefixroute.workloads.prompt`).
* :meth:`Session.body` — the **HTTP** form: the OpenAI chat-completions body a client
  sends, given the texts of the previous answers (a real client resends them).

Drivers: :mod:`prefixroute.sim` (virtual clock), :mod:`prefixroute.demo.loadgen` (real
HTTP). Workloads: :mod:`.shared_prefix`, :mod:`.multi_turn`, :mod:`.traces`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol, Sequence

from prefixroute.engine.core import HashedPrompt
from prefixroute.workloads.prompt import PromptChain, Segment

__all__ = ["SimPrompt", "ChainPrompt", "TextChatPrompt", "Turn", "Session", "Workload"]


class SimPrompt(Protocol):
    """A prompt as the simulator needs it.

    Attributes:
        num_tokens: prompt length in tokens of the emulated engine.
        routing_units: length of the routing text in the units ``routing_key`` counts
            (what ``CACHE_AWARE``'s blocks cut; :func:`prefixroute.sim.blocks.prompt_blocks`).
        token_ids: those units are token ids (a token-id trace), not characters or bytes.
    """

    num_tokens: int
    routing_units: int
    token_ids: bool

    def engine_prompt(self, block_tokens: int) -> HashedPrompt | str:
        """What :meth:`prefixroute.engine.core.EngineCore.add_request` gets."""

    def routing_key(self, prefix_length: int) -> int:
        """The routing key for a ``PrefixLength`` (characters, or bytes for native traces)."""


@dataclass(frozen=True, slots=True)
class ChainPrompt:
    """A segment-chain prompt (fast path) followed by a known answer.

    Attributes:
        chain: the prompt as the engine sees it (generation prompt included).
        answer: the segment standing for the answer the model will generate, when a
            later prompt contains it (a conversation's next turn), else None.
        model: the ``model`` field (part of the routing key).
        tenant: the tenant id (``prompt_cache_key``), "" for none.
        routing_tail: characters at the end of ``chain`` that the router does not see
            (the engine's generation prompt, after the rendered messages).
    """

    chain: PromptChain
    answer: Segment | None = None
    model: str = ""
    tenant: str = ""
    routing_tail: int = 0

    @property
    def num_tokens(self) -> int:
        return self.chain.num_tokens

    @property
    def routing_units(self) -> int:
        return self.chain.chars - self.routing_tail

    token_ids = False

    def engine_prompt(self, block_tokens: int) -> HashedPrompt:
        return self.chain.hashed_prompt(self.answer, block_tokens)

    def routing_key(self, prefix_length: int) -> int:
        return self.chain.routing_key(prefix_length, self.model, self.tenant)


class TextChatPrompt:
    """The exact (slow) path: a chat body rendered and tokenized as the HTTP drivers do.

    The engine prompt is :func:`prefixroute.engine.server.chat_prompt_text` with the
    default engine's image tokens (what the emulated server builds) and the key is
    :func:`prefixroute.core.keys.openai_routing_key` (what the router computes). Used to
    check the fast path against the real one.
    """

    __slots__ = ("body", "text", "num_tokens")

    def __init__(self, body: Mapping[str, Any]) -> None:
        from prefixroute.engine.model import EngineConfig
        from prefixroute.engine.server import chat_prompt_text
        from prefixroute.engine.tokenizer import count_tokens

        self.body = body
        self.text = chat_prompt_text(body, EngineConfig().image_tokens)
        self.num_tokens = count_tokens(self.text)

    def engine_prompt(self, block_tokens: int) -> str:
        return self.text

    def routing_key(self, prefix_length: int) -> int:
        from prefixroute.core.keys import openai_routing_key

        return openai_routing_key(self.body, True, prefix_length)


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session in the simulator's form.

    Attributes:
        prompt: the prompt (:class:`ChainPrompt`, :class:`TextChatPrompt`, a trace prompt).
        output_tokens: tokens the model generates (``max_tokens``; the emulator ignores EOS).
    """

    prompt: SimPrompt
    output_tokens: int


class Session(ABC):
    """One client's requests: ``num_turns`` turns starting at ``start_s``.

    Attributes:
        start_s: arrival of the first turn, model seconds from the run's start (open loop;
            a closed-loop driver ignores it).
        group: what the session belongs to, for reports (document, system prompt...), or -1.
        num_turns: turns in the session, >= 1.
    """

    start_s: float
    group: int
    num_turns: int

    @abstractmethod
    def turn(self, k: int, answers: Sequence[str] | None = None) -> Turn:
        """Turn ``k`` (0-based) in the simulator's form.

        Args:
            k: the turn.
            answers: None for the fast path; the texts of answers 0..k-1 for the exact
                text path (raises ``NotImplementedError`` where a workload has no text).
        """

    def body(self, k: int, answers: Sequence[str]) -> dict[str, Any]:
        """Turn ``k`` as an OpenAI chat-completions body, given the previous answers' texts.

        Raises:
            NotImplementedError: the workload has no text (trace replay).
        """
        raise NotImplementedError(f"{type(self).__name__} has no text form")

    def think_s(self, k: int) -> float:
        """Model seconds between the end of turn ``k - 1`` and the start of turn ``k`` (k >= 1)."""
        return 0.0


class Workload(Protocol):
    """A seeded source of sessions (the same sessions for the same parameters)."""

    def describe(self) -> str:
        """One line naming the workload and its parameters (SPEC §7 ``workload``)."""

    def sessions(self) -> Iterator[Session]:
        """Sessions in order of ``start_s``; may be endless (drivers stop by time)."""
