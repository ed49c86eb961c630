"""Prompts without text: chains of content-identified segments (the simulator's fast path).

Building a 32,000-character prompt, tokenizing it and hashing its 500 KV blocks costs
about a millisecond; an hour of traffic at 20 requests/s is 72,000 of them. What the
router and the engine actually compare, though, is only *which* text is equal to which:
the router keys the first ``PrefixLength`` characters, the engine's prefix cache matches
chained hashes of 16-token blocks. Both can be computed from a description of the text
as a sequence of **segments**, each a content id and a length, without the text itself:

* a :class:`Segment` ``(content, chars)`` stands for ``chars`` characters of ASCII text
  (so ``chars / 4`` tokens of the emulated engine's tokenizer,
  :mod:`prefixroute.engine.tokenizer`); two segments with the same content id are the
  same text, and a cut of the first ``n`` characters of a segment is identified by
  ``(content, n)``;
* a :class:`PromptChain` is an immutable prompt: a parent chain plus one segment. Chains
  share their parents, so the hashes of a shared system prompt or of a conversation's
  history are computed once, and every later prompt only hashes its own new blocks.

Equivalence with the text path (tested in ``tests/test_workloads_prompt.py``): for the
workloads of this package, which render chat messages into segments at the exact
character lengths of :func:`prefixroute.core.routing_text.render_chat_text` plus the engine's
generation prompt, two prompts share a block-aligned prefix in segment form exactly when
their texts do, so the engine sees the same cache hits. Routing keys are equal exactly
when the first ``PrefixLength`` characters are equal; their 64-bit *values* differ from
the HTTP router's (they hash content ids, not text), so a key's preferred instance
differs too, which only relabels instances.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
import xxhash

from prefixroute.engine.core import HashedPrompt

__all__ = ["CHARS_PER_TOKEN", "Segment", "PromptChain", "content_id"]

#: Characters per token of the emulated engine's tokenizer on ASCII text (4 bytes a token).
CHARS_PER_TOKEN = 4

_BLOCK_SEED = 0x7365_676D_656E_7473  # "segments": engine block hashes of segment chains
_RUN_SEED = 0x7275_6E73  # "runs": digests of whole segments, for routing keys
_KEY_SEED = 0x7072_6566_6978  # the routing-key seed of prefixroute.core.keys.KEY_SEED
_RUN = struct.Struct("<QII")
_MIX = 0x9E37_79B9_7F4A_7C15  # 2^64 / golden ratio
_MASK = (1 << 64) - 1
_MIXES: list[int] = [0]  # _MIXES[k] = k * _MIX mod 2^64, grown on demand


def _mixes(n: int) -> list[int]:
    """The table of ``k * _MIX mod 2^64`` for ``k <= n`` (shared, grown as needed)."""
    while len(_MIXES) <= n:
        _MIXES.append((len(_MIXES) * _MIX) & _MASK)
    return _MIXES  # content id, offset in the segment, length (characters)
_digest = xxhash.xxh3_64_intdigest


def content_id(*parts: object) -> int:
    """A 64-bit content id from any printable parts, e.g. ``content_id("doc", seed, 7)``.

    Deterministic across processes (xxh3 of the parts joined by NUL, never ``hash()``).
    """
    return _digest("\0".join(str(p) for p in parts).encode())


@dataclass(frozen=True, slots=True)
class Segment:
    """``chars`` characters of text identified by ``content``.

    Attributes:
        content: 64-bit id; equal ids mean equal text (of the same length).
        chars: length in characters, >= 1 (ASCII: bytes too; tokens = chars / 4).
    """

    content: int
    chars: int

    def __post_init__(self) -> None:
        if self.chars < 1:
            raise ValueError(f"a segment has at least 1 character, got {self.chars}")


class PromptChain:
    """An immutable prompt: ``parent`` followed by ``segment`` (``parent`` None = first).

    Build with :meth:`of` and :meth:`extend`. Chains are cheap to extend and share all
    work with their parents: block hashes are computed once per chain node and block
    size.

    Attributes:
        parent: the chain this one extends, or None.
        segment: the last segment.
        start: characters before ``segment``.
        chars: total length in characters.
    """

    __slots__ = ("parent", "segment", "start", "chars", "_run", "_hash_state", "__weakref__")

    def __init__(self, parent: "PromptChain | None", segment: Segment) -> None:
        self.parent = parent
        self.segment = segment
        self.start = parent.chars if parent is not None else 0
        self.chars = self.start + segment.chars
        prev = parent._run if parent is not None else 0
        self._run = _digest(prev.to_bytes(8, "little") + _RUN.pack(segment.content, 0, segment.chars), _RUN_SEED)
        # block_chars -> (own full-block hashes, last full-block hash, tail runs)
        self._hash_state: dict[int, tuple[tuple[int, ...], int, tuple[tuple[int, int, int], ...]]] = {}

    @classmethod
    def of(cls, *segments: Segment) -> "PromptChain":
        """A chain of one or more segments.

        Raises:
            ValueError: no segments.
        """
        if not segments:
            raise ValueError("a prompt has at least one segment")
        chain = cls(None, segments[0])
        return chain.extend(*segments[1:])

    def extend(self, *segments: Segment) -> "PromptChain":
        """This prompt followed by ``segments`` (this one is unchanged)."""
        chain = self
        for seg in segments:
            chain = PromptChain(chain, seg)
        return chain

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens of the emulated tokenizer: ``ceil(chars / 4)``."""
        return -(-self.chars // CHARS_PER_TOKEN)

    def segments(self) -> list[Segment]:
        """All segments, first to last."""
        out = []
        node: PromptChain | None = self
        while node is not None:
            out.append(node.segment)
            node = node.parent
        out.reverse()
        return out

    # -- engine view -------------------------------------------------------------------

    def _state(self, block_chars: int) -> tuple[tuple[int, ...], int, tuple[tuple[int, int, int], ...]]:
        st = self._hash_state.get(block_chars)
        if st is not None:
            return st
        if self.parent is not None:
            _, last, tail = self.parent._state(block_chars)
        else:
            last, tail = _BLOCK_SEED, ()
        seg = self.segment
        content, chars = seg.content, seg.chars
        own: list[int] = []
        runs = list(tail)
        offset = 0
        if runs:  # complete the partial block the parent ended with
            filled = sum(r[2] for r in runs)
            take = min(block_chars - filled, chars)
            runs.append((content, 0, take))
            offset = take
            if filled + take == block_chars:
                last = _digest(last.to_bytes(8, "little") + b"".join(_RUN.pack(*r) for r in runs), _BLOCK_SEED)
                own.append(last)
                runs = []
        whole = (chars - offset) // block_chars
        if whole:
            # Blocks inside this segment: the hash of its k-th whole block is
            # base ^ (k * MIX mod 2^64), base identifying everything before this part of
            # the segment (the last full block's hash), the content and the offset. Each hash still
            # determines everything before it, which the prefix cache relies on.
            base = _digest(last.to_bytes(8, "little") + _RUN.pack(content, offset, 0), _BLOCK_SEED)
            mixes = _mixes(whole)
            own.extend([base ^ m for m in itertools.islice(mixes, 1, whole + 1)])
            last = own[-1]
            offset += whole * block_chars
        if offset < chars and not runs:
            runs.append((content, offset, chars - offset))
        st = (tuple(own), last, tuple(runs))
        self._hash_state[block_chars] = st
        return st

    def block_hashes(self, block_tokens: int = 16) -> list[int]:
        """Chained hashes of the full blocks of ``block_tokens`` tokens (a new list).

        Equal prefixes of whole blocks give equal hashes, as the engine's text hashes do.
        """
        block_chars = block_tokens * CHARS_PER_TOKEN
        parts = []
        node: PromptChain | None = self
        while node is not None:
            own = node._state(block_chars)[0]
            if own:
                parts.append(own)
            node = node.parent
        out: list[int] = []
        for own in reversed(parts):
            out.extend(own)
        return out

    def hashed_prompt(self, answer: Segment | None = None, block_tokens: int = 16) -> HashedPrompt:
        """The engine's view of this prompt, followed by the ``answer`` it will generate.

        Args:
            answer: the segment the model's answer stands for (a conversation's next turn
                contains it), or None when no later prompt contains the answer.
            block_tokens: the engine's ``block_size``.
        """
        chain = self.extend(answer) if answer is not None else self
        return HashedPrompt(self.num_tokens, chain.block_hashes(block_tokens), self._run)

    # -- router view -------------------------------------------------------------------

    def routing_key(self, prefix_chars: int, model: str = "", tenant: str = "") -> int:
        """The routing key of the first ``prefix_chars`` characters (all, if shorter).

        Equal exactly when the first ``prefix_chars`` characters are equal (same
        segments, or same leading part of the segment that is cut), for the same model
        and tenant, as :func:`prefixroute.core.keys.text_routing_key` is for text.
        """
        node = self
        while node.parent is not None and node.start >= prefix_chars:
            node = node.parent
        cut = min(prefix_chars, node.chars) - node.start
        prev = node.parent._run if node.parent is not None else 0
        data = b"".join((model.encode(), b"\0", tenant.encode(), b"\0", prev.to_bytes(8, "little"),
                         _RUN.pack(node.segment.content, 0, cut)))
        return _digest(data, _KEY_SEED)

