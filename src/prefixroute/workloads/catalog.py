"""The named workloads every comparison runs: ``bench/policy_vs_peers.py``, ``prefixroute
simulate --bench-workload NAME`` and the tests use the same definitions.

Each entry fixes the traffic (a seeded workload), how it is offered (closed-loop users
running sessions back to back, or open-loop Poisson arrivals at a fixed rate), the
session id a client would send (what ``vllm-router``'s ``consistent_hash`` hashes), and
an optional mid-run membership change. The fleet they are sized for is the benchmark's:
4 instances of the emulated engine (Llama-3.1-70B on 8xH100, docs/ENGINE.md) with a
100,000-token KV cache each, smaller than a real instance's so that the documents of the
document workloads do not fit one instance but fit the fleet.

Lengths are tokens of the emulated engine (4 characters each). Sources of the
distributions are in the workload modules; what each entry stands for:

* ``shared-prefix``: RAG, many questions per retrieved document.
* ``multi-turn``: chats with ShareGPT's turn count and message lengths.
* ``long-system-prompt``: every conversation behind one long system prompt.
* ``zipf-hot-groups``: documents of Zipf popularity.
* ``membership-change``: an instance joins at 1/3 of the run and one leaves at 2/3.
* ``hot-prefix``: one document gets 60 % of the traffic, with longer questions, so
  its instance cannot serve it alone.
* ``near-saturation``: open-loop arrivals at 85 % of the fleet's capacity (measured:
  :data:`NEAR_SATURATION_CAPACITY_RPS`) with long uncached questions.
* ``sharegpt-multi-turn``: AWS's second published table: variable-length ShareGPT-style
  chats behind one short system prompt.
* ``agentic``: agent loops whose context grows by tool outputs every step.
* ``images``: short questions about images (hundreds of vision tokens each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from prefixroute.workloads.images import ImageQuestionWorkload
from prefixroute.workloads.multi_turn import MultiTurnWorkload
from prefixroute.workloads.session import Session, Workload
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload

__all__ = ["MembershipPlan", "BenchWorkload", "BENCH_WORKLOADS", "bench_workload", "NEAR_SATURATION_CAPACITY_RPS"]


@dataclass(frozen=True)
class MembershipPlan:
    """Add one instance at ``add_at`` and remove one (the first) at ``remove_at``,
    fractions of the run's duration. The added instance exists from the start but is
    routed to only from ``add_at``; the removed one finishes the requests it has."""

    add_at: float = 1 / 3
    remove_at: float = 2 / 3


@dataclass(frozen=True)
class BenchWorkload:
    """One named workload of the comparisons.

    Attributes:
        name: short name (tables, JSON ``workload`` of each run, ``--workloads``).
        title: what it stands for.
        make: ``seed -> workload`` (``sessions()`` and ``describe()``).
        session_key: the id a client would send for a session (the document of a RAG
            question, the conversation, the agent run, the image): what
            ``vllm-router``'s ``consistent_hash`` hashes (header ``X-Session-ID``).
        users: closed loop with this many users; None = open loop at the workload's
            own Poisson arrival rate (model seconds).
        membership: a mid-run membership change, or None.
    """

    name: str
    title: str
    make: Callable[[int], Workload]
    session_key: Callable[[Session], str]
    users: int | None = 16
    membership: MembershipPlan | None = None

    @property
    def open_loop(self) -> bool:
        """Whether requests arrive at the workload's own times (not when a user is free)."""
        return self.users is None


def _doc_key(s: Any) -> str:
    return f"doc-{s.doc}"


def _conversation_key(s: Any) -> str:
    return f"conversation-{s.index}"


def _image_key(s: Any) -> str:
    return f"image-{s.image}"


def _shared_prefix(seed: int) -> SharedPrefixWorkload:
    # 40 documents of 6,000 tokens (240k tokens) do not fit one instance's 100k-token
    # cache but fit the fleet's 400k: routing decides the hit rate. 64-token answers keep
    # the request rate (and so the CPU the harness itself uses) moderate.
    return SharedPrefixWorkload(groups=40, prefix_tokens=6000, question_tokens=64, output_tokens=64, seed=seed)


def _multi_turn(seed: int) -> MultiTurnWorkload:
    # ShareGPT's turn count and user-message length (workloads.multi_turn); answers (mean
    # 120 tokens, at most 512) and think time (2 s) shortened so that a 40 model-second run
    # holds a few conversations per user. 16 distinct 1,000-token system prompts.
    return MultiTurnWorkload(system_prompts=16, system_tokens=1000, mean_output_tokens=120, think_time_s=2.0,
                             max_turns=12, max_message_tokens=512, seed=seed)


def _long_system_prompt(seed: int) -> MultiTurnWorkload:
    # One 6,000-token system prompt shared by every conversation: a fixed-length key sends
    # them all to one instance; the history after it is each conversation's own.
    return MultiTurnWorkload(system_prompts=1, system_tokens=6000, mean_output_tokens=120, think_time_s=2.0,
                             max_turns=12, max_message_tokens=512, seed=seed)


def _zipf(seed: int) -> SharedPrefixWorkload:
    # Group k has weight 1/(k+1)^1.2: the hottest of 64 documents gets ~30 % of requests.
    return SharedPrefixWorkload(groups=64, prefix_tokens=6000, question_tokens=64, output_tokens=64,
                                popularity="zipf", zipf_s=1.2, seed=seed)


def _hot_prefix(seed: int) -> SharedPrefixWorkload:
    # One document gets 60 % of the requests, 30 others share the rest. The 512-token
    # questions (uncached: 18 ms of prefill each) make 60 % of 32 users' traffic more than
    # one instance serves without a queue: the hot document must live on several.
    return SharedPrefixWorkload(groups=31, prefix_tokens=6000, question_tokens=512, output_tokens=32,
                                popularity="hot", hot_fraction=0.6, seed=seed)


#: Requests per model second the benchmark's fleet (4 instances, 100k-token caches)
#: completes on the near-saturation workload's traffic when it is saturated: the most
#: the simulator measured, closed loop with 256 users, over PREFIX_AWARE with
#: ConcurrencyThreshold 1,024 (66.1 requests/s, 70.7 % hits, the most a request can
#: have cached: 4,000 of 5,500 tokens), CACHE_AWARE (62.9) and LEAST_OUTSTANDING (28.1),
#: requests started after the first 10 s of a 60 s run, 2026-12-04.
NEAR_SATURATION_CAPACITY_RPS = 66.0


def _near_saturation(seed: int) -> SharedPrefixWorkload:
    # 40 documents of 4,000 tokens, each question 1,500 uncached tokens (52 ms of
    # prefill) and a 16-token answer: prefill bound, so offered load is what routing
    # must spread, and a miss (5,500 tokens) costs 3.7 questions' worth of capacity.
    # Open loop at 85 % of the capacity above, reached by a linear ramp over the first
    # 10 model seconds: started cold at 85 %, the first request of every document (a
    # 5,500-token miss) would build a queue that a 40-second run never drains.
    return SharedPrefixWorkload(groups=40, prefix_tokens=4000, question_tokens=1500, output_tokens=16,
                                arrival_rate=0.85 * NEAR_SATURATION_CAPACITY_RPS, ramp_s=10.0, seed=seed)


def _sharegpt_multi_turn(seed: int) -> MultiTurnWorkload:
    # AWS's second table: variable-length ShareGPT-style multi-turn chats (mean 161-token
    # messages, 338-token answers, 3.51 turns, log-normal spread) behind one short
    # system prompt; think time shortened to 3 s and lengths clipped at 1,024 tokens so
    # that a 40 model-second run holds several turns per conversation.
    return MultiTurnWorkload(system_prompts=1, system_tokens=100, think_time_s=3.0, max_turns=12,
                             max_message_tokens=1024, seed=seed)


def _agentic(seed: int) -> MultiTurnWorkload:
    # Agent runs: 4 agents' system prompts of 3,000 tokens (instructions and tool
    # definitions), a 150-token task, then steps whose answer is a tool call (mean 60
    # tokens) and whose next message is the tool's output (mean 700 tokens, log-normal,
    # at most 4,000), after the tool's run time (mean 1 s). Mean 12 steps, at most 30:
    # contexts grow to 10-25k tokens, so a step that loses its instance re-prefills all.
    return MultiTurnWorkload(system_prompts=4, system_tokens=3000, mean_turns=12, max_turns=30,
                             first_user_tokens=150, mean_user_tokens=700, mean_output_tokens=60,
                             max_message_tokens=4000, think_time_s=1.0, max_context_tokens=40_000,
                             turn_role="tool", seed=seed)


def _images(seed: int) -> ImageQuestionWorkload:
    # 100 images of 576 vision tokens with Zipf(0.8) popularity, a 16-token instruction
    # and 12-token questions: the routing text of a request is a few dozen characters
    # plus the image's stand-in.
    return ImageQuestionWorkload(images=100, zipf_s=0.8, image_tokens=576, instruction_tokens=16,
                                 question_tokens=12, output_tokens=32, seed=seed)


BENCH_WORKLOADS: tuple[BenchWorkload, ...] = (
    BenchWorkload("shared-prefix", "long shared-prefix groups (RAG: many questions per document)",
                  _shared_prefix, _doc_key, users=16),
    BenchWorkload("multi-turn", "multi-turn chats, ShareGPT-like lengths", _multi_turn, _conversation_key, users=32),
    BenchWorkload("long-system-prompt", "one 6,000-token system prompt shared by every conversation",
                  _long_system_prompt, _conversation_key, users=32),
    BenchWorkload("zipf-hot-groups", "Zipf-skewed document popularity (s = 1.2)", _zipf, _doc_key, users=16),
    BenchWorkload("membership-change", "shared-prefix groups; an instance added at 1/3 and one removed at 2/3",
                  _shared_prefix, _doc_key, users=16, membership=MembershipPlan()),
    BenchWorkload("hot-prefix", "one document gets 60 % of the requests (512-token questions)",
                  _hot_prefix, _doc_key, users=32),
    BenchWorkload("near-saturation", "open loop at 85 % of the fleet's capacity, 1,500-token questions",
                  _near_saturation, _doc_key, users=None),
    BenchWorkload("sharegpt-multi-turn", "variable-length ShareGPT-style chats behind one short system prompt",
                  _sharegpt_multi_turn, _conversation_key, users=48),
    BenchWorkload("agentic", "agent loops: contexts growing by tool outputs every step",
                  _agentic, _conversation_key, users=16),
    BenchWorkload("images", "short questions about images (576 vision tokens each)", _images, _image_key, users=24),
)


def bench_workload(name: str) -> BenchWorkload:
    """The entry called ``name``.

    Raises:
        KeyError: no such workload; the message lists the known ones.
    """
    for w in BENCH_WORKLOADS:
        if w.name == name:
            return w
    raise KeyError(f"unknown workload {name!r} (known: {', '.join(w.name for w in BENCH_WORKLOADS)})")
