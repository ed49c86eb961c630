"""Short prompts with images: many questions about a pool of images.

The multimodal case the text-only workloads miss: a short shared instruction, one image
and a short question, so the routing text is tiny next to what the engine prefills for
the image (hundreds of vision tokens per image; 576 for LLaVA-1.5's 24 x 24 patches).
An engine caches the image's KV blocks like any prefix, so repeated questions about one
image hit the cache only if they reach the instance that saw it.

Every request of a session is one chat body::

    system: the instruction (shared by all requests)
    user:   [image_url part (https://images.example.com/img-K.jpg), text part: the question]

Images are chosen with Zipf popularity (``zipf_s``) over ``images``; arrivals are a
Poisson process of rate ``arrival_rate`` (open loop) or, in a closed loop, back to back.

The router weighs an image part as ``MediaTokens`` tokens of routing text and the
emulated engine prefills it as ``image_tokens`` tokens
(:func:`prefixroute.core.routing_text.render_chat_text`'s ``media_chars``); in the simulator's
fast path an image is one segment of ``image_tokens x 4`` characters, so both views agree
when the two settings are equal (576 by default).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from prefixroute.workloads.prompt import CHARS_PER_TOKEN, PromptChain, Segment, content_id
from prefixroute.workloads.session import ChainPrompt, Session, TextChatPrompt, Turn
from prefixroute.workloads.shared_prefix import text_of_length

__all__ = ["ImageQuestionWorkload", "ImageQuestion", "IMAGE_URL"]

#: URL of image ``k`` (never fetched by the emulated engine or the router: its text is the identity).
IMAGE_URL = "https://images.example.com/img-{k}.jpg"

_SYSTEM_WRAP = len("<|system|>\n") + len("\n")
_USER_HEAD = len("<|user|>\n")
_GENERATION = len("<|assistant|>\n")


@dataclass(frozen=True, slots=True)
class ImageQuestionWorkload:
    """Seeded generator of short questions about images (see module docstring).

    Attributes:
        images: distinct images.
        zipf_s: Zipf exponent of image popularity (image k has weight 1/(k+1)^s); 0 = uniform.
        image_tokens: prompt tokens one image stands for (engine and simulator).
        instruction_tokens: length of the shared instruction, tokens.
        question_tokens: length of each question, tokens.
        output_tokens: ``max_tokens`` of each request.
        arrival_rate: requests per model second (open loop).
        model: the ``model`` field.
        seed: seeds texts, image choice and arrivals.

    Raises:
        ValueError: on construction, for a non-positive count, length or rate.
    """

    images: int = 100
    zipf_s: float = 0.8
    image_tokens: int = 576
    instruction_tokens: int = 16
    question_tokens: int = 12
    output_tokens: int = 32
    arrival_rate: float = 5.0
    model: str = "meta-llama/Llama-3.1-70B-Instruct"
    seed: int = 0
    _system: dict[int, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("images", "image_tokens", "instruction_tokens", "question_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0, got {self.zipf_s}")
        if not self.arrival_rate > 0:
            raise ValueError(f"arrival_rate must be > 0 requests/s, got {self.arrival_rate}")

    def describe(self) -> str:
        """One line naming the workload and its parameters (the ``workload`` JSON field)."""
        return (f"images images={self.images} zipf_s={self.zipf_s:g} image_tokens={self.image_tokens} "
                f"instruction_tokens={self.instruction_tokens} question_tokens={self.question_tokens} "
                f"output_tokens={self.output_tokens} arrival_rate={self.arrival_rate:g}/s seed={self.seed}")

    def instruction(self) -> str:
        """The instruction every request shares."""
        text = self._system.get(0)
        if text is None:
            text = self._system[0] = text_of_length(random.Random(f"img-instruction-{self.seed}"),
                                                    self.instruction_tokens * CHARS_PER_TOKEN)
        return text

    def question(self, index: int) -> str:
        """Request ``index``'s question."""
        return text_of_length(random.Random(f"img-question-{self.seed}-{index}"),
                              self.question_tokens * CHARS_PER_TOKEN)

    def sessions(self) -> Iterator["ImageQuestion"]:
        """Endless one-turn sessions, Poisson arrivals of rate ``arrival_rate``."""
        rng = random.Random(f"img-requests-{self.seed}")
        arrivals = random.Random(f"img-arrivals-{self.seed}")
        cum = list(itertools.accumulate(1.0 / (k + 1) ** self.zipf_s for k in range(self.images)))
        t = 0.0
        for i in itertools.count():
            t += arrivals.expovariate(self.arrival_rate)
            yield ImageQuestion(self, t, i, rng.choices(range(self.images), cum_weights=cum)[0])

    def _chain(self, image: int, index: int) -> PromptChain:
        system = Segment(content_id("img-instruction", self.seed, self.instruction_tokens),
                         _SYSTEM_WRAP + self.instruction_tokens * CHARS_PER_TOKEN)
        picture = Segment(content_id("image", self.seed, image, self.image_tokens),
                          _USER_HEAD + self.image_tokens * CHARS_PER_TOKEN)
        question = Segment(content_id("img-question", self.seed, index, self.question_tokens),
                           self.question_tokens * CHARS_PER_TOKEN + 1 + _GENERATION)
        return PromptChain.of(system, picture, question)


class ImageQuestion(Session):
    """One question about one image (a one-turn session); its ``group`` is the image."""

    __slots__ = ("workload", "start_s", "index", "image", "group", "num_turns")

    def __init__(self, workload: ImageQuestionWorkload, start_s: float, index: int, image: int) -> None:
        self.workload = workload
        self.start_s = start_s
        self.index = index
        self.image = image
        self.group = image
        self.num_turns = 1

    def turn(self, k: int, answers: Sequence[str] | None = None) -> Turn:
        wl = self.workload
        if answers is not None:
            return Turn(TextChatPrompt(self.body(k, answers)), wl.output_tokens)
        return Turn(ChainPrompt(wl._chain(self.image, self.index), None, wl.model, routing_tail=_GENERATION),
                    wl.output_tokens)

    def body(self, k: int, answers: Sequence[str]) -> dict[str, Any]:
        wl = self.workload
        return {"model": wl.model, "max_tokens": wl.output_tokens, "messages": [
            {"role": "system", "content": wl.instruction()},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": IMAGE_URL.format(k=self.image)}},
                {"type": "text", "text": wl.question(self.index)},
            ]},
        ]}
