"""The fleet's held blocks by the bytes they stand for: a request matched without tokenizing it.

Tokenizing a request costs milliseconds for a long prompt, and each router replica would
tokenize each document the first time it sees it. But an engine's events carry every
block's token ids, and with a byte-level tokenizer (:class:`prefixroute.core.token_bytes.TokenBytes`)
token ids render to exactly the bytes of the text they came from. So :class:`ByteIndex`
keeps, for every block some instance holds (any tier), the hash of its bytes under its
parent's key; a request's prompt bytes (the chat template applied) are then walked block
by block from the chain's root (:meth:`ByteIndex.walk`): at each step the lengths of the
held children of the current block are tried (a few: a block of 16 tokens is 16-100
bytes), and the one whose bytes follow in the prompt is the next block. The walk gives
the router keys of the prompt's leading blocks that some instance holds, which
:meth:`prefixroute.core.kvevents.view.PreciseCacheView.holdings` reads per instance,
exactly as for keys computed from token ids; the text no engine holds is never
tokenized.

Definition::

    byte_key(block) = xxh3_64(u64le(key of its parent) + bytes of its tokens, seed=BLOCK_KEY_SEED)

Where two held children of one block both follow in the prompt (one's bytes a prefix of
the other's: a chain the engine tokenized differently, such as a sampled answer), each is
followed and the deeper chain kept (at most :data:`MAX_BRANCHES` such forks a walk).
What it may get wrong, and which way: a prompt whose tokenization where it leaves a held
chain differs from the chain's (a word cut by a block boundary, continued differently):
the walk may count one block the engine would not reuse. Blocks with extra hash inputs
(a media hash, a cache salt) are counted but not indexed: no request's bytes say them.

Every holder of a block (an instance's GPU or CPU tier, the shared tier) is counted,
indexed or not, so that one holder letting a block go never hides it from the others;
a block is forgotten with its last holder. Two blocks with the same parent and the same
bytes (tokenized differently) are both kept. Memory: about 300 bytes per distinct block
held anywhere in the fleet (three dictionary entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from prefixroute.core.kvevents.chain import BLOCK_KEY_SEED

if TYPE_CHECKING:
    from prefixroute.core.token_bytes import TokenBytes

__all__ = ["ByteIndex"]


class ByteIndex:
    """Held blocks by (parent key, bytes); see the module docstring.

    Args:
        token_bytes: the engines' tokenizer's token -> bytes table.
        block_size: the engines' KV block size, tokens.

    Attributes:
        tokens_indexed, bytes_indexed: totals over the blocks indexed since start (the
            fleet's bytes per token, :meth:`bytes_per_token`).
    """

    def __init__(self, token_bytes: "TokenBytes", block_size: int) -> None:
        self.token_bytes = token_bytes
        self.block_size = block_size
        self._by_bytes: dict[int, int] = {}  # byte key -> router key
        self._more: dict[int, list[int]] = {}  # byte key -> the other keys with those bytes (rare)
        # router key -> [holders, byte key (None: not indexed), parent key, byte length]
        self._info: dict[int, list] = {}
        self._lengths: dict[int, dict[int, int]] = {}  # parent key -> {child's byte length: children}
        self.tokens_indexed = 0
        self.bytes_indexed = 0

    def __len__(self) -> int:
        """Distinct blocks held (indexed or not)."""
        return len(self._info)

    def ref(self, key: int, parent: int | None, token_ids: Sequence[int] | None = None, start: int = 0) -> None:
        """One more holder of the block ``key``, whose tokens are
        ``token_ids[start:start + block_size]`` and whose parent is ``parent``; without
        token ids (or ids that render to nothing known) it is counted, not indexed, until
        a holder that has them comes."""
        self.ref_blocks(token_ids, [(key, parent, start)])

    def ref_blocks(self, token_ids: Sequence[int] | None, blocks: Sequence[tuple[int, int | None, int]],
                   indexable: int | None = None) -> None:
        """:meth:`ref` for several blocks of one event: ``blocks`` are ``(key, parent,
        start)`` (the block's tokens are ``token_ids[start:start + block_size]``), the ids
        rendered once for all of them (what an event costs: one lookup per token for the
        blocks new to the index, a count for the others). Blocks starting at or past
        ``indexable`` (a token offset) are counted, not indexed."""
        info_of = self._info
        bs = self.block_size
        parts: list | None = None
        digest, seed = xxhash.xxh3_64_intdigest, BLOCK_KEY_SEED
        for key, parent, start in blocks:
            info = info_of.get(key)
            if info is not None:
                info[0] += 1
                if info[1] is not None:
                    continue
            if token_ids is None or parent is None or (indexable is not None and start >= indexable):
                if info is None:
                    info_of[key] = [1, None, parent, 0]
                continue
            if parts is None:
                table = self.token_bytes.table
                try:
                    parts = [table[i] for i in token_ids] if min(token_ids, default=0) >= 0 else []
                except (IndexError, TypeError):  # an id the vocabulary lacks: none of them indexed
                    parts = []
            chunk = parts[start:start + bs]
            if len(chunk) != bs or None in chunk:
                if info is None:
                    info_of[key] = [1, None, parent, 0]
                continue
            data = b"".join(chunk)
            bkey = digest(parent.to_bytes(8, "little") + data, seed)
            n = len(data)
            if info is None:
                info_of[key] = [1, bkey, parent, n]
            else:  # held before without its tokens: indexed now
                info[1:] = [bkey, parent, n]
            other = self._by_bytes.setdefault(bkey, key)
            if other != key:
                self._more.setdefault(bkey, []).append(key)
            lengths = self._lengths.get(parent)
            if lengths is None:
                self._lengths[parent] = {n: 1}
            else:
                lengths[n] = lengths.get(n, 0) + 1
            self.tokens_indexed += bs
            self.bytes_indexed += n

    def unref(self, key: int) -> None:
        """One holder fewer of ``key`` (the last: the block is forgotten); an unknown key
        is ignored."""
        info = self._info.get(key)
        if info is None:
            return
        info[0] -= 1
        if info[0] > 0:
            return
        del self._info[key]
        _, bkey, parent, n = info
        if bkey is None:
            return
        more = self._more.get(bkey)
        if self._by_bytes.get(bkey) == key:
            if more:
                self._by_bytes[bkey] = more.pop()
            else:
                del self._by_bytes[bkey]
        elif more and key in more:
            more.remove(key)
        if more is not None and not more:
            del self._more[bkey]
        lengths = self._lengths.get(parent)
        if lengths is not None:
            left = lengths.get(n, 0) - 1
            if left > 0:
                lengths[n] = left
            else:
                lengths.pop(n, None)
                if not lengths:
                    del self._lengths[parent]

    def clear(self) -> None:
        """Forget every block."""
        self._by_bytes.clear()
        self._more.clear()
        self._info.clear()
        self._lengths.clear()

    def bytes_per_token(self) -> float:
        """Bytes per token of the blocks indexed so far (the probes' figure before any)."""
        if self.tokens_indexed:
            return self.bytes_indexed / self.tokens_indexed
        return self.token_bytes.bytes_per_token

    def walk(self, data: bytes, root: int) -> tuple[list[int], list[int]]:
        """The prompt's leading blocks some instance holds.

        Args:
            data: the prompt's bytes as the engine's tokens render them (the chat
                template applied; a completions prompt after
                :attr:`~prefixroute.core.token_bytes.TokenBytes.completion_prefix`).
            root: the chain's root (:func:`prefixroute.core.kvevents.chain.chain_root`
                of the request's LoRA adapter).
        Returns:
            ``(keys, ends)``: the router keys of the leading held blocks, and where each
            ends in ``data`` (bytes); where the held chain forks inside the prompt, the
            deeper branch.
        """
        keys: list[int] = []
        ends: list[int] = []
        self._walk(data, root, 0, keys, ends, [MAX_BRANCHES])
        return keys, ends

    def _walk(self, data: bytes, parent: int, pos: int, keys: list[int], ends: list[int], budget: list[int]) -> None:
        lengths_of = self._lengths.get
        by_bytes = self._by_bytes.get
        digest = xxhash.xxh3_64_intdigest
        seed = BLOCK_KEY_SEED
        n = len(data)
        while True:
            lengths = lengths_of(parent)
            if not lengths:
                return
            head = parent.to_bytes(8, "little")
            found: list[tuple[int, int]] = []
            for length in lengths:
                end = pos + length
                if end <= n:
                    bkey = digest(head + data[pos:end], seed)
                    key = by_bytes(bkey)
                    if key is not None:
                        found.append((key, end))
                        more = self._more.get(bkey)
                        if more:
                            found.extend((k, end) for k in more)
            if not found:
                return
            if len(found) > 1 and budget[0] > 0:  # a fork: follow each, keep the deeper
                budget[0] -= 1
                best: tuple[list[int], list[int]] = ([], [])
                for key, end in found:
                    k2, e2 = [key], [end]
                    self._walk(data, key, end, k2, e2, budget)
                    if len(k2) > len(best[0]):
                        best = (k2, e2)
                keys.extend(best[0])
                ends.extend(best[1])
                return
            key, end = found[0]
            keys.append(key)
            ends.append(end)
            parent, pos = key, end


#: Forks (two held children whose bytes both follow in the prompt) a walk follows both
#: ways; past them it takes the first.
MAX_BRANCHES = 8
