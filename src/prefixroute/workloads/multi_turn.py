"""Multi-turn chat workload: synthetic conversations with ShareGPT-like lengths.

Each conversation starts at a Poisson arrival time, picks one of ``system_prompts``
shared system prompts (many conversations share one), and runs ``n`` turns. Turn ``k``'s
prompt is the system prompt + the whole history (every earlier user message and the
model's answer to it) + the new user message; the next turn is sent a think time after
the answer ends. So a conversation's prompt grows every turn, and each turn's prompt
begins with the previous turn's prompt and answer, which the engine has cached, if the
turn lands on the same instance.

Length distributions (tokens of the emulated tokenizer, 4 characters each):

* turns per conversation: geometric with mean :data:`SHAREGPT_MEAN_TURNS` = 3.51, the
  mean of ShareGPT (94,145 conversations, 330,239 turns: Yan et al., "ShareChat: A
  Dataset of Chatbot Conversations in the Wild", arXiv:2512.17843, Table 1), capped
  at ``max_turns``;
* user message and answer lengths: log-normal with the means of ShareGPT measured by the
  vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model Serving
  with PagedAttention", SOSP 2023, Fig. 11: mean input 161.31 tokens, mean output
  337.99 tokens); the spread ``sigma = 1.0`` (median = mean / e^0.5) is our choice for
  the long right tail both histograms show; lengths are clipped to 1..2,048 tokens as
  the vLLM benchmark's ShareGPT filter does for long sequences;
* think time between turns: exponential with mean ``think_time_s`` (no public source
  for ShareGPT; 10 s by default, our choice);
* a conversation ends early when its prompt would pass ``max_context_tokens``.

Character lengths are chosen so every prompt is a multiple of 4 bytes: the model's
answer (whole 4-byte tokens) then starts on a token boundary and the next turn's
tokenization extends the previous turn's exactly, as with a real BPE tokenizer, so the
answer's KV blocks are reused by the next turn (engine/tokenizer.py explains why this
needs 4-byte alignment here).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from prefixroute.workloads.prompt import CHARS_PER_TOKEN, PromptChain, Segment, content_id
from prefixroute.workloads.session import ChainPrompt, Session, TextChatPrompt, Turn
from prefixroute.workloads.shared_prefix import text_of_length

__all__ = [
    "MultiTurnWorkload",
    "Conversation",
    "SHAREGPT_MEAN_TURNS",
    "SHAREGPT_MEAN_INPUT_TOKENS",
    "SHAREGPT_MEAN_OUTPUT_TOKENS",
]

#: Mean turns per ShareGPT conversation (Yan et al. 2025, arXiv:2512.17843, Table 1).
SHAREGPT_MEAN_TURNS = 3.51
#: Mean ShareGPT prompt (user message) length, tokens (Kwon et al. 2023, Fig. 11).
SHAREGPT_MEAN_INPUT_TOKENS = 161.31
#: Mean ShareGPT answer length, tokens (Kwon et al. 2023, Fig. 11).
SHAREGPT_MEAN_OUTPUT_TOKENS = 337.99

# Character lengths of the chat rendering (core.routing_text.render_chat_text) and of the
# engine's generation prompt (engine.server.GENERATION_PROMPT).
_SYSTEM_WRAP = len("<|system|>\n") + len("\n")  # 12
_FIRST_USER_WRAP = len("<|user|>\n") + len("\n") + len("<|assistant|>\n")  # 24
_NEXT_USER_WRAP = len("\n") + _FIRST_USER_WRAP  # 25: "\n" closes the previous answer
_GENERATION = len("<|assistant|>\n")  # 14: the end of a prompt the router does not route on


def _lognormal_tokens(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


@dataclass(frozen=True, slots=True)
class MultiTurnWorkload:
    """Seeded generator of multi-turn chat conversations (see module docstring).

    Attributes:
        conversation_rate: new conversations per model second (Poisson).
        system_prompts: distinct system prompts; each conversation picks one uniformly.
        system_tokens: length of each system prompt, tokens.
        mean_turns: mean turns per conversation (geometric), >= 1.
        max_turns: most turns of one conversation.
        mean_user_tokens: mean user-message length, tokens (log-normal).
        mean_output_tokens: mean answer length (``max_tokens``), tokens (log-normal).
        length_sigma: sigma of both log-normal length distributions.
        max_message_tokens: clip of one message or answer, tokens.
        think_time_s: mean model seconds between an answer and the next turn (exponential).
        max_context_tokens: a conversation ends before a turn whose prompt plus answer
            would exceed this many tokens.
        model: the ``model`` field of every request.
        seed: seeds everything.
        first_user_tokens: mean length of the first message (log-normal), tokens; None
            = ``mean_user_tokens``. An agent's task is short, its tool outputs long.
        turn_role: the role of the messages of turns after the first: ``"user"`` (a
            chat) or ``"tool"`` (an agent loop: the model's answer is a tool call and the
            next message the tool's output, sent back after ``think_time_s`` — the
            tool's run time). ``<|tool|>`` renders in as many characters as ``<|user|>``.

    Raises:
        ValueError: on construction, for non-positive rates, counts or lengths.
    """

    conversation_rate: float = 0.5
    system_prompts: int = 1
    system_tokens: int = 1000
    mean_turns: float = SHAREGPT_MEAN_TURNS
    max_turns: int = 20
    mean_user_tokens: float = SHAREGPT_MEAN_INPUT_TOKENS
    mean_output_tokens: float = SHAREGPT_MEAN_OUTPUT_TOKENS
    length_sigma: float = 1.0
    max_message_tokens: int = 2048
    think_time_s: float = 10.0
    max_context_tokens: int = 32_768
    model: str = "meta-llama/Llama-3.1-70B-Instruct"
    seed: int = 0
    first_user_tokens: float | None = None
    turn_role: str = "user"
    _system_chains: dict[int, PromptChain] = field(default_factory=dict, init=False, repr=False, compare=False)
    _system_texts: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.conversation_rate > 0:
            raise ValueError(f"conversation_rate must be > 0 per second, got {self.conversation_rate}")
        for name in ("system_prompts", "system_tokens", "max_turns", "max_message_tokens", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mean_turns < 1:
            raise ValueError(f"mean_turns must be >= 1, got {self.mean_turns}")
        if not (self.mean_user_tokens >= 1 and self.mean_output_tokens >= 1):
            raise ValueError("mean_user_tokens and mean_output_tokens must be >= 1")
        if self.length_sigma < 0 or self.think_time_s < 0:
            raise ValueError("length_sigma and think_time_s must be >= 0")
        if self.first_user_tokens is not None and not self.first_user_tokens >= 1:
            raise ValueError(f"first_user_tokens must be >= 1 or None, got {self.first_user_tokens}")
        if self.turn_role not in ("user", "tool"):
            raise ValueError(f"turn_role must be 'user' or 'tool', got {self.turn_role!r}")

    def describe(self) -> str:
        """One line naming the workload and its parameters (the ``workload`` JSON field)."""
        return (
            f"{'agentic' if self.turn_role == 'tool' else 'multi-turn'} conversation_rate={self.conversation_rate:g}/s "
            f"system_prompts={self.system_prompts} "
            f"system_tokens={self.system_tokens} mean_turns={self.mean_turns:g} max_turns={self.max_turns} "
            + (f"first_user_tokens={self.first_user_tokens:g} " if self.first_user_tokens is not None else "")
            + f"mean_{'tool' if self.turn_role == 'tool' else 'user'}_tokens={self.mean_user_tokens:g} "
            f"mean_output_tokens={self.mean_output_tokens:g} "
            f"sigma={self.length_sigma:g} think_time_s={self.think_time_s:g} seed={self.seed}"
        )

    def _system_chars(self) -> int:
        # content length = 1 (mod 4): with the 12 wrapper characters and a first user
        # message of 3 (mod 4) characters plus its 24, the first prompt is 0 (mod 4).
        return self.system_tokens * CHARS_PER_TOKEN + 1

    def system_text(self, k: int) -> str:
        """System prompt ``k``'s text."""
        text = self._system_texts.get(k)
        if text is None:
            text = text_of_length(random.Random(f"mt-system-{self.seed}-{k}"), self._system_chars())
            self._system_texts[k] = text
        return text

    def _system_chain(self, k: int) -> PromptChain:
        chain = self._system_chains.get(k)
        if chain is None:
            seg = Segment(content_id("mt-system", self.seed, k, self.system_tokens), _SYSTEM_WRAP + self._system_chars())
            chain = PromptChain.of(seg)
            self._system_chains[k] = chain
        return chain

    def conversation(self, index: int, start_s: float = 0.0) -> "Conversation":
        """Conversation ``index`` (its content does not depend on the arrival process)."""
        rng = random.Random(f"mt-conversation-{self.seed}-{index}")
        system = rng.randrange(self.system_prompts)
        p = 1.0 / self.mean_turns
        turns = 1
        while turns < self.max_turns and rng.random() >= p:
            turns += 1
        users: list[int] = []
        outputs: list[int] = []
        thinks: list[float] = []
        context = self.system_tokens
        first_mean = self.mean_user_tokens if self.first_user_tokens is None else self.first_user_tokens
        for t in range(turns):
            u = _lognormal_tokens(rng, first_mean if t == 0 else self.mean_user_tokens, self.length_sigma, 1,
                                  self.max_message_tokens)
            o = _lognormal_tokens(rng, self.mean_output_tokens, self.length_sigma, 1, self.max_message_tokens)
            think = rng.expovariate(1.0 / self.think_time_s) if self.think_time_s > 0 else 0.0
            if t > 0 and context + u + o + 10 > self.max_context_tokens:
                break
            context += u + o + 10
            users.append(u)
            outputs.append(o)
            thinks.append(think)
        return Conversation(self, index, start_s, system, users, outputs, thinks)

    def sessions(self) -> Iterator["Conversation"]:
        """Endless conversations starting as a Poisson process of rate ``conversation_rate``."""
        arrivals = random.Random(f"mt-arrivals-{self.seed}")
        t = 0.0
        index = 0
        while True:
            t += arrivals.expovariate(self.conversation_rate)
            yield self.conversation(index, t)
            index += 1


class Conversation(Session):
    """One conversation: the same system prompt, growing history, think time between turns.

    Attributes:
        index: the conversation's number in its workload.
        system: which system prompt it uses (its ``group``).
        user_tokens: each turn's user-message length, tokens.
        output_tokens: each turn's answer length (``max_tokens``), tokens.
    """

    def __init__(self, workload: MultiTurnWorkload, index: int, start_s: float, system: int,
                 user_tokens: list[int], output_tokens: list[int], thinks: list[float]) -> None:
        self.workload = workload
        self.index = index
        self.start_s = start_s
        self.system = system
        self.group = system
        self.user_tokens = user_tokens
        self.output_tokens = output_tokens
        self._thinks = thinks
        self.num_turns = len(user_tokens)
        self._chains: list[PromptChain] = []  # prompt of turn k followed by its answer

    def think_s(self, k: int) -> float:
        return self._thinks[k]

    def _user_chars(self, k: int) -> int:
        return self.user_tokens[k] * CHARS_PER_TOKEN - 1  # 3 (mod 4), see _system_chars

    def user_text(self, k: int) -> str:
        """Turn ``k``'s user message."""
        wl = self.workload
        return text_of_length(random.Random(f"mt-user-{wl.seed}-{self.index}-{k}"), self._user_chars(k))

    def _answer(self, k: int) -> Segment:
        wl = self.workload
        return Segment(content_id("mt-answer", wl.seed, self.index, k), self.output_tokens[k] * CHARS_PER_TOKEN)

    def prompt_chain(self, k: int) -> PromptChain:
        """Turn ``k``'s engine prompt as segments: system, then per earlier turn its user
        message and answer, then the new user message and the generation prompt."""
        wl = self.workload
        if k == 0:
            parent = wl._system_chain(self.system)
            wrap = _FIRST_USER_WRAP
        else:
            while len(self._chains) < k:
                j = len(self._chains)
                self._chains.append(self.prompt_chain(j).extend(self._answer(j)))
            parent = self._chains[k - 1]
            wrap = _NEXT_USER_WRAP
        seg = Segment(content_id("mt-user", wl.seed, self.index, k), wrap + self._user_chars(k))
        return parent.extend(seg)

    def turn(self, k: int, answers: Sequence[str] | None = None) -> Turn:
        if answers is not None:
            return Turn(TextChatPrompt(self.body(k, answers)), self.output_tokens[k])
        answer = self._answer(k) if k + 1 < self.num_turns else None
        return Turn(ChainPrompt(self.prompt_chain(k), answer, self.workload.model, routing_tail=_GENERATION),
                    self.output_tokens[k])

    def body(self, k: int, answers: Sequence[str]) -> dict[str, Any]:
        """Turn ``k``'s chat body; ``answers`` are the texts of answers 0..k-1 as received.

        Raises:
            ValueError: fewer than ``k`` answers.
        """
        if len(answers) < k:
            raise ValueError(f"turn {k} needs the {k} previous answers, got {len(answers)}")
        wl = self.workload
        messages: list[dict[str, str]] = [{"role": "system", "content": wl.system_text(self.system)}]
        for j in range(k):
            messages.append(self._message(j))
            messages.append({"role": "assistant", "content": answers[j]})
        messages.append(self._message(k))
        return {"model": wl.model, "messages": messages, "max_tokens": self.output_tokens[k]}

    def _message(self, k: int) -> dict[str, str]:
        """Turn ``k``'s message: the user's, or (an agent loop, ``k >= 1``) the output of
        the tool the previous answer called."""
        if k and self.workload.turn_role == "tool":
            return {"role": "tool", "tool_call_id": f"call-{self.index}-{k}", "content": self.user_text(k)}
        return {"role": "user", "content": self.user_text(k)}
