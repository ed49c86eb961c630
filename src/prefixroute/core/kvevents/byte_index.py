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

What it may get wrong, and which way: two held children of one block whose bytes both
follow in the prompt (one a prefix of the other) -- the first length tried wins, and the
walk may stop a block early; a prompt whose tokenization at the point where it leaves a
held chain differs from the chain's (a word cut by a block boundary, continued
differently) -- the walk may count one block the engine would not reuse. Blocks with
extra hash inputs (a media hash, a cache salt) are not indexed: such requests match
nothing here.

Memory: about 300 bytes per distinct block held anywhere in the fleet (three dictionary
entries). Entries are counted per holder (an instance's GPU or CPU tier, the shared tier)
and go when the last holder drops the block.
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
        self._info: dict[int, list[int]] = {}  # router key -> [holders, byte key, parent key, byte length]
        self._lengths: dict[int, dict[int, int]] = {}  # parent key -> {child's byte length: children}
        self.tokens_indexed = 0
        self.bytes_indexed = 0

    def __len__(self) -> int:
        return len(self._info)

    def ref(self, key: int, parent: int, token_ids: Sequence[int], start: int) -> None:
        """One more holder of the block ``key``, whose tokens are
        ``token_ids[start:start + block_size]`` and whose parent is ``parent`` (the first
        holder indexes it; ids that render to nothing known leave it unindexed)."""
        self.ref_blocks(token_ids, [(key, parent, start)])

    def ref_blocks(self, token_ids: Sequence[int], blocks: Sequence[tuple[int, int, int]]) -> None:
        """:meth:`ref` for several blocks of one event: ``blocks`` are ``(key, parent,
        start)`` (the block's tokens are ``token_ids[start:start + block_size]``), the ids
        rendered once for all of them (what an event costs: one lookup per token for the
        blocks new to the fleet, a count for the others)."""
        info_of = self._info
        bs = self.block_size
        parts: list[bytes | None] | None = None
        digest, seed = xxhash.xxh3_64_intdigest, BLOCK_KEY_SEED
        for key, parent, start in blocks:
            info = info_of.get(key)
            if info is not None:
                info[0] += 1
                continue
            if parts is None:
                table = self.token_bytes.table
                try:
                    parts = [table[i] for i in token_ids]
                except (IndexError, TypeError):  # an id the vocabulary lacks: none of them indexed
                    parts = []
            chunk = parts[start:start + bs]
            if len(chunk) != bs or None in chunk:
                continue
            data = b"".join(chunk)  # type: ignore[arg-type]
            bkey = digest(parent.to_bytes(8, "little") + data, seed)
            n = len(data)
            self._by_bytes[bkey] = key
            info_of[key] = [1, bkey, parent, n]
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
        if self._by_bytes.get(bkey) == key:
            del self._by_bytes[bkey]
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
            ends in ``data`` (bytes).
        """
        lengths_of = self._lengths.get
        by_bytes = self._by_bytes.get
        digest = xxhash.xxh3_64_intdigest
        seed = BLOCK_KEY_SEED
        keys: list[int] = []
        ends: list[int] = []
        parent, pos, n = root, 0, len(data)
        while True:
            lengths = lengths_of(parent)
            if not lengths:
                break
            head = parent.to_bytes(8, "little")
            for length in lengths:
                end = pos + length
                if end <= n:
                    key = by_bytes(digest(head + data[pos:end], seed))
                    if key is not None:
                        break
            else:
                break
            keys.append(key)
            ends.append(end)
            parent, pos = key, end
        return keys, ends
