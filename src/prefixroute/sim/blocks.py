"""``CACHE_AWARE``'s chained blocks for the simulator's prompts, which have no text.

The router cuts a request's routing text into blocks on the schedule of
:func:`prefixroute.core.block_chain.block_ends` and hashes each block with everything
before it (:class:`prefixroute.core.block_chain.BlockChain`). A simulated prompt knows
only its length and its routing key for any prefix length (``SimPrompt.routing_key``),
equal exactly when those first units are equal: block ``k``'s hash here is that key for
the block's end, salted with ``k``. Two prompts then share block ``k`` exactly when they
share the text up to its end, as with the router's hashes, and the strategy sees the same
block sizes.

The exact (text) prompts of ``SimConfig.exact_text`` get the router's own hashes
(:func:`prefixroute.core.keys.openai_block_hashes`).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Sequence

from prefixroute.core.block_chain import BlockChain, block_ends
from prefixroute.core.keys import openai_block_hashes

__all__ = ["PromptBlockChain", "prompt_blocks", "prompt_fixed_blocks"]

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads the block index over the bits
_MASK = (1 << 64) - 1


class PromptBlockChain(BlockChain):
    """A :class:`BlockChain` whose block ``k`` hashes as ``key(ends[k] // scale)``
    salted with ``k`` (computed when first read, as the router's are).

    Args:
        key: the prompt's routing key of its first ``n`` units.
        ends: block end offsets, as :class:`BlockChain` takes them.
        unit_shift: as :class:`BlockChain` (1 for token ids, whose ends count 8 per token).
        scale: ``ends`` are ``scale`` x the units ``key`` counts (8 for token ids).
    """

    __slots__ = ("_key", "_scale")

    def __init__(self, key: Callable[[int], int], ends: Sequence[int], unit_shift: int = 0, scale: int = 1,
                 full: int | None = None) -> None:
        super().__init__(b"", 0, ends, unit_shift, full)
        self._key = key
        self._scale = scale

    def _read(self, k: int) -> int:
        h = self._memo[k] = (self._key(self.ends[k] // self._scale) ^ ((k + 1) * _MIX)) & _MASK
        return h

    def prefix_hash(self, end: int, k: int) -> int:
        return (self._key((end << self.unit_shift) // self._scale) ^ ((k + 1) * _MIX)) & _MASK

    def hashes(self) -> list[int]:
        if self._all is None:
            self._all = [self.hash(k) for k in range(len(self.ends))]
        return self._all

    def hashes_from(self, start: int) -> list[int]:
        return self.hashes()[max(start, 0):]


def _ends(length: int, block_size: int, max_length: int) -> tuple[list[int], int]:
    """The block ends of a routing text of ``length`` units cut at ``max_length``: full
    blocks on :func:`block_ends`' schedule, then a partial one for what is left; and how
    many are full."""
    n = min(length, max_length)
    all_ends = block_ends(block_size, max_length)
    full = bisect_right(all_ends, n)
    ends = list(all_ends[:full])
    if n and (not ends or ends[-1] < n):
        ends.append(n)
    return ends, full


def prompt_blocks(prompt: object, block_size: int, max_length: int, media_chars: int = 0) -> BlockChain:
    """The chained blocks the router would compute for ``prompt`` (a ``SimPrompt``) with
    ``BlockSize`` and ``MaxPrefixLength``.

    A prompt with a ``body`` (the exact path) is hashed as the router hashes it; any other
    gives its routing length through ``routing_units`` (characters or bytes) and
    ``token_ids`` (the units are token ids: ``block_size // 4`` of them per block, at most
    ``max_length // 4``, as the router counts a token-id prompt). ``media_chars`` is
    ``MediaTokens x 4`` (for the exact path's image parts).
    """
    body = getattr(prompt, "body", None)
    if body is not None:
        return openai_block_hashes(body, True, block_size, max_length, media_chars=media_chars)
    key = prompt.routing_key  # type: ignore[attr-defined]
    length: int = prompt.routing_units  # type: ignore[attr-defined]
    if getattr(prompt, "token_ids", False):
        per, most = max(1, block_size // 4), max(1, max_length // 4)
        ends, full = _ends(length, per, most)
        return PromptBlockChain(key, [8 * e for e in ends], unit_shift=1, scale=8, full=full)
    ends, full = _ends(length, block_size, max_length)
    return PromptBlockChain(key, ends, full=full)


def prompt_fixed_blocks(prompt: object, block_size: int, most: int) -> BlockChain:
    """``LLMD_REFERENCE``'s blocks for ``prompt``
    (:func:`prefixroute.core.block_chain.fixed_blocks`): full blocks of ``block_size``
    units, at most ``most``, no partial block."""
    body = getattr(prompt, "body", None)
    if body is not None:
        from prefixroute.core.config import RoutingConfig
        from prefixroute.core.keys import openai_route

        return openai_route(body, True, RoutingConfig.build("llmd-reference"))[1]  # type: ignore[return-value]
    length: int = prompt.routing_units  # type: ignore[attr-defined]
    full = min(length // block_size, most)
    return PromptBlockChain(prompt.routing_key, [block_size * (k + 1) for k in range(full)])  # type: ignore[attr-defined]
