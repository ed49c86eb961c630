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

    byte_key(block) = xxh3_64(bytes of its tokens, seed=key of its parent)

A block is rendered and hashed only when a walk first reaches its parent, or when
:data:`RENDER_AT` children wait under it: until then its token ids wait, packed, under
the parent (an event's ingest is a count and a copy
per block; the blocks no prompt reaches, such as a unique question's later blocks, are
never rendered).

A walk resumes where an earlier walk over the same first bytes was: every
:data:`WALK_CHECKPOINT_BYTES` of a prompt (every :data:`WALK_FIRST_CHECKPOINT_BYTES`
within the first KB) it records the chained hash of the bytes so
far and the keys found so far, so a held document sent again costs a hash per
checkpoint and the walk of its last bytes (:meth:`ByteIndex.walk`).

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

import struct
from bisect import bisect_right
from collections import OrderedDict, deque
from itertools import islice
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from prefixroute.core.kvevents.chain import pack_token_ids

if TYPE_CHECKING:
    from prefixroute.core.token_bytes import TokenBytes

__all__ = ["ByteIndex", "KeyRun"]


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
        # router key -> (holders, byte key (None: not indexed), parent key, byte length):
        # tuples of ints, which the garbage collector stops tracking (a list per held block
        # made every full collection walk them all: a quarter of a busy replica's time)
        self._info: dict[int, tuple] = {}
        self._lengths: dict[int, dict[int, int]] = {}  # parent key -> {child's byte length: children}
        # parent key -> {child key: its token ids packed}: held, not yet rendered (_render)
        self._pending: dict[int, dict[int, bytes]] = {}
        self._unpack = struct.Struct(f"<{block_size}Q").unpack
        self.tokens_indexed = 0
        self.bytes_indexed = 0
        # chained hash of a prompt's first _boundary(i) bytes -> (the
        # walk's path, how many of its blocks end within those bytes): where a walk resumes.
        self._memo: OrderedDict[int, tuple[_WalkPath, int]] = OrderedDict()
        self._memo_blocks = 0  # blocks of the paths the checkpoints hold
        # parents with more than one child indexed or waiting (where a walk may fork)
        self._multi: set[int] = set()
        self._gone: deque[int] = deque(maxlen=GONE_LOG)  # the keys forgotten last
        self._gone_total = 0  # keys forgotten since start
        #: Walks that resumed from a checkpoint of an earlier walk.
        self.walks_resumed = 0

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
                   indexable: int | None = None, packed: bytes | None = None) -> None:
        """:meth:`ref` for several blocks of one event: ``blocks`` are ``(key, parent,
        start)`` (the block's tokens are ``token_ids[start:start + block_size]``;
        ``packed``: the same ids as :func:`~prefixroute.core.kvevents.chain.pack_token_ids`
        bytes, when the caller has them). A block new to the index keeps its packed ids
        under its parent until a walk reaches the parent (:meth:`_render`): a block no
        request's prompt ever reaches (a unique question's later blocks, an answer never
        continued) is never rendered. Blocks starting at or past ``indexable`` (a token
        offset) are counted, not indexed."""
        info_of = self._info
        bs = self.block_size
        pending_of = self._pending
        for key, parent, start in blocks:
            info = info_of.get(key)
            if info is not None:
                info = info_of[key] = (info[0] + 1, *info[1:])
                if info[1] is not None:  # indexed, or waiting to be
                    continue
            if token_ids is None or parent is None or (indexable is not None and start >= indexable):
                if info is None:
                    info_of[key] = (1, None, parent, 0)
                    self._gone.append(key)  # (held, not indexed: as good as gone to a walk's path)
                    self._gone_total += 1
                continue
            if packed is None:
                try:
                    packed = pack_token_ids(token_ids)
                except ValueError:  # an id out of range: none of them indexed
                    packed = b""
            chunk = packed[start * 8:(start + bs) * 8]
            if len(chunk) != bs * 8:
                if info is None:
                    info_of[key] = (1, None, parent, 0)
                    self._gone.append(key)
                    self._gone_total += 1
                continue
            if info is None:
                info_of[key] = (1, _PENDING, parent, 0)
            else:  # held before without its tokens: indexed now
                info_of[key] = (info[0], _PENDING, parent, 0)
            pending = pending_of.get(parent)
            if pending is None:
                pending_of[parent] = {key: chunk}
                if parent in self._lengths:  # (an indexed child and now a waiting one)
                    self._multi.add(parent)
            else:
                self._multi.add(parent)  # (two waiting children at least)
                pending[key] = chunk
                if len(pending) >= RENDER_AT:  # a walk must never meet thousands of them at once
                    self._render(parent)

    def _render(self, parent: int) -> None:
        """Index the children of ``parent`` still waiting (:meth:`ref_blocks`): their
        ids rendered to bytes (one table lookup per token), hashed under ``parent``."""
        pending = self._pending.pop(parent, None)
        if not pending:
            return
        info_of = self._info
        table = self.token_bytes.table
        unpack = self._unpack
        digest = xxhash.xxh3_64_intdigest
        by_bytes, more_of = self._by_bytes, self._more
        lengths = self._lengths.get(parent)
        for key, chunk in pending.items():
            info = info_of[key]
            try:
                parts = [table[i] for i in unpack(chunk)]
            except IndexError:  # an id the vocabulary lacks
                parts = None
            if parts is None or None in parts:
                info_of[key] = (info[0], None, info[2], info[3])  # counted, not indexed
                continue
            data = b"".join(parts)
            bkey = digest(data, parent)
            n = len(data)
            info_of[key] = (info[0], bkey, info[2], n)
            other = by_bytes.setdefault(bkey, key)
            if other != key:
                more_of.setdefault(bkey, []).append(key)
            if lengths is None:
                lengths = self._lengths[parent] = {n: 1}
            else:
                lengths[n] = lengths.get(n, 0) + 1
            self.tokens_indexed += self.block_size
            self.bytes_indexed += n
        self._check_multi(parent)

    def _check_multi(self, parent: int) -> None:
        """Keep ``parent`` in :attr:`_multi` while it has more than one child indexed or waiting."""
        lengths = self._lengths.get(parent)
        children = (sum(lengths.values()) if lengths else 0) + len(self._pending.get(parent, ()))
        if children > 1:
            self._multi.add(parent)
        else:
            self._multi.discard(parent)

    def unref(self, key: int) -> None:
        """One holder fewer of ``key`` (the last: the block is forgotten); an unknown key
        is ignored."""
        info = self._info.get(key)
        if info is None:
            return
        if info[0] > 1:
            self._info[key] = (info[0] - 1, *info[1:])
            return
        del self._info[key]
        self._gone.append(key)
        self._gone_total += 1
        _, bkey, parent, n = info
        if bkey is None:
            return
        if bkey == _PENDING:
            pending = self._pending.get(parent)
            if pending is not None:
                pending.pop(key, None)
                if not pending:
                    del self._pending[parent]
            if parent in self._multi:
                self._check_multi(parent)
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
            if parent in self._multi:
                self._check_multi(parent)

    def clear_checkpoints(self) -> None:
        """Forget where earlier walks were (the blocks stay): the next walks start at the root."""
        self._memo.clear()
        self._memo_blocks = 0

    def clear(self) -> None:
        """Forget every block."""
        self._by_bytes.clear()
        self._more.clear()
        self._info.clear()
        self._lengths.clear()
        self._pending.clear()
        self.clear_checkpoints()
        self._multi.clear()

    def bytes_per_token(self) -> float:
        """Bytes per token of the blocks indexed so far (the probes' figure before any)."""
        if self.tokens_indexed:
            return self.bytes_indexed / self.tokens_indexed
        return self.token_bytes.bytes_per_token

    def walk(self, data: bytes, root: int, *, resume: bool = True) -> tuple["KeyRun", "KeyRun"]:
        """The prompt's leading blocks some instance holds.

        A walk records where it was at every :data:`WALK_CHECKPOINT_BYTES` of the prompt
        (every :data:`WALK_FIRST_CHECKPOINT_BYTES` within the first KB; the chained hash of the bytes so far -> the keys so far, up to the first fork
        it met); a later prompt with the same first bytes resumes from its deepest such
        checkpoint, after checking that the path there is still the one a walk from the
        root would take: every block on it still held by some instance (else it resumes
        before the first one gone), and at every block of it with more than one child
        indexed or waiting, only one child's bytes following in the prompt (else it
        resumes before that block, and the walk follows both branches from there). So a
        resumed walk gives the keys a walk from the root gives; ``resume=False`` walks
        from the root and records nothing.

        Args:
            data: the prompt's bytes as the engine's tokens render them (the chat
                template applied; a completions prompt after
                :attr:`~prefixroute.core.token_bytes.TokenBytes.completion_prefix`).
            root: the chain's root (:func:`prefixroute.core.kvevents.chain.chain_root`
                of the request's LoRA adapter).
        Returns:
            ``(keys, ends)``: the router keys of the leading held blocks, and where each
            ends in ``data`` (bytes); where the held chain forks inside the prompt, the
            deeper branch. Both are :class:`KeyRun` sequences (a resumed path shared,
            not copied).
        """
        keys: list[int] = []  # the blocks past the path resumed from
        ends: list[int] = []
        head: tuple[tuple[int, ...], tuple[int, ...], int] = _NO_HEAD  # (keys, ends, count) resumed from
        n = len(data)
        marks: list[int] = []  # chained hash of data[:_boundary(i)], per whole checkpoint
        parent, pos = root, 0
        first = 0  # the first checkpoint to record
        if n >= WALK_FIRST_CHECKPOINT_BYTES and resume:
            digest = xxhash.xxh3_64_intdigest
            view = memoryview(data)
            seed = root
            off = 0
            for end in _BOUNDARIES:
                if end > n:
                    break
                seed = digest(view[off:end], seed)
                marks.append(seed)
                off = end
            else:
                for end in range(off + WALK_CHECKPOINT_BYTES, n + 1, WALK_CHECKPOINT_BYTES):
                    seed = digest(view[off:end], seed)
                    marks.append(seed)
                    off = end
            if self._memo:
                first, head = self._resume(data, root, marks)
                if head[2]:
                    parent, pos = head[0][head[2] - 1], head[1][head[2] - 1]
        fork = [n + 1]  # where the first fork the walk met is (bytes)
        self._walk(data, parent, pos, keys, ends, [MAX_BRANCHES], fork)
        # The resumed path is shared, not copied: copying its keys costs a memory access
        # per block (their reference counts), 100 µs for 4,000 blocks under load.
        all_keys, all_ends = KeyRun(head[0], head[2], keys), KeyRun(head[1], head[2], ends)
        if len(marks) > first and all_ends:
            self._record(marks, first, all_keys, all_ends, fork[0])
        return all_keys, all_ends

    def _resume(self, data: bytes, root: int, marks: list[int]
                ) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...], int]]:
        """The path of the deepest checkpoint of ``marks`` recorded and how many of its
        blocks to take, cut before the first block no longer held or the first fork (see
        :meth:`walk`), and the first checkpoint the walk is to record (the ones before
        are recorded as they are): ``(first, (keys, ends, count))``."""
        memo, info = self._memo, self._info
        for i in range(len(marks) - 1, -1, -1):
            entry = memo.get(marks[i])
            if entry is None:
                continue
            memo.move_to_end(marks[i])  # (the most recently used, the last forgotten)
            path, recorded = entry
            since = self._gone_total - path.checked
            if since:  # keys forgotten (or held without their tokens) since the path was checked
                index, gone = path.index, self._gone
                if since <= len(gone) and since < 2 * path.valid:  # (the cheaper side: the log or the path)
                    touched = [index[k] for k in islice(reversed(gone), since) if k in index]
                else:  # (more than the log holds, or than the path: every key)
                    touched = range(path.valid)
                for j in sorted(touched):
                    if j >= path.valid:
                        break
                    held = info.get(path.keys[j])
                    if held is None or held[1] is None:
                        path.valid = j  # (a block stored again later is found by the walk from there)
                        break
                path.checked = self._gone_total
            count = self._unforked(data, root, path, min(recorded, path.valid))
            if count:
                self.walks_resumed += 1
            first = i + 1 if count == recorded else _checkpoints_within(path.ends[count - 1] if count else 0)
            return first, (path.keys, path.ends, count)
        return 0, _NO_HEAD

    def _unforked(self, data: bytes, root: int, path: "_WalkPath", count: int) -> int:
        """How many of ``path``'s first ``count`` blocks a walk from the root reaches
        before a fork: the blocks under a parent with several children indexed or
        waiting are checked as the walk would check them."""
        multi = self._multi
        if not count or not multi:
            return count
        if root in multi and self._forks_at(data, root, 0):
            return 0
        keys, ends = path.keys, path.ends  # block j + 1's parent is block j
        if len(multi) * _MULTI_LOOKUP_COST < count:  # (look the fewer up in the other)
            index = path.index
            at = sorted(index[p] for p in multi if p in index)
        else:
            at = [j for j, p in enumerate(keys[:count - 1]) if p in multi]
        for j in at:
            if j >= count - 1:
                break
            if self._forks_at(data, keys[j], ends[j]):
                return j + 1
        return count

    def _forks_at(self, data: bytes, parent: int, pos: int) -> bool:
        """Whether more than one held child of ``parent`` has bytes that follow ``pos`` in ``data``."""
        if parent in self._pending:
            self._render(parent)
        lengths = self._lengths.get(parent)
        if not lengths:
            return False
        digest, by_bytes, more_of = xxhash.xxh3_64_intdigest, self._by_bytes, self._more
        n, found = len(data), 0
        for length in lengths:
            end = pos + length
            if end <= n:
                bkey = digest(data[pos:end], parent)
                if bkey in by_bytes:
                    found += 1 + len(more_of.get(bkey, ()))
                    if found > 1:
                        return True
        return False

    def _record(self, marks: list[int], first: int, keys: "KeyRun", ends: "KeyRun", fork: int) -> None:
        """Remember, for every checkpoint from ``first`` the walk passed before its first
        fork (at byte ``fork``), the keys that end within it."""
        limit = bisect_right(ends, fork)
        if not limit:
            return
        last = ends[limit - 1]
        memo = self._memo
        path: _WalkPath | None = None
        for i in range(first, len(marks)):
            boundary = _boundary(i)
            if last <= boundary:  # (the walk did not pass it before the fork)
                break
            j = bisect_right(ends, boundary)
            if not j:
                continue
            if path is None:
                path = _WalkPath(tuple(keys[:limit]), tuple(ends[:limit]), self._gone_total)
                self._memo_blocks += limit
            old = memo.pop(marks[i], None)
            if old is not None:
                self._forget(old[0])
            memo[marks[i]] = (path, j)
            path.refs += 1
        while memo and (len(memo) > WALK_MEMO_ENTRIES or self._memo_blocks > WALK_MEMO_BLOCKS):
            self._forget(memo.popitem(last=False)[1][0])

    def _forget(self, path: "_WalkPath") -> None:
        path.refs -= 1
        if not path.refs:
            self._memo_blocks -= len(path.keys)

    def _walk(self, data: bytes, parent: int, pos: int, keys: list[int], ends: list[int], budget: list[int],
              fork: list[int]) -> None:
        lengths_of = self._lengths.get
        by_bytes = self._by_bytes.get
        pending = self._pending
        digest = xxhash.xxh3_64_intdigest
        n = len(data)
        while True:
            if parent in pending:
                self._render(parent)
            lengths = lengths_of(parent)
            if not lengths:
                return
            found: list[tuple[int, int]] = []
            for length in lengths:
                end = pos + length
                if end <= n:
                    bkey = digest(data[pos:end], parent)
                    key = by_bytes(bkey)
                    if key is not None:
                        found.append((key, end))
                        more = self._more.get(bkey)
                        if more:
                            found.extend((k, end) for k in more)
            if not found:
                return
            if len(found) > 1 and pos < fork[0]:
                fork[0] = pos
            if len(found) > 1 and budget[0] > 0:  # a fork: follow each, keep the deeper
                budget[0] -= 1
                best: tuple[list[int], list[int]] = ([], [])
                for key, end in found:
                    k2, e2 = [key], [end]
                    self._walk(data, key, end, k2, e2, budget, fork)
                    if len(k2) > len(best[0]):
                        best = (k2, e2)
                keys.extend(best[0])
                ends.extend(best[1])
                return
            key, end = found[0]
            keys.append(key)
            ends.append(end)
            parent, pos = key, end


#: The byte key of a block held with its token ids, not rendered yet (byte keys are >= 0).
_PENDING = -1

_NO_HEAD: tuple[tuple[int, ...], tuple[int, ...], int] = ((), (), 0)


class KeyRun(Sequence):
    """A walk's keys (or byte ends): the first ``shared`` of a recorded path's, not
    copied, then the ones the walk found past them. A read-only sequence of ints: ``len``,
    indexing (negative too), slicing (a list), iteration, ``==`` with a list or tuple."""

    __slots__ = ("head", "shared", "tail")

    def __init__(self, head: Sequence[int], shared: int, tail: list[int]) -> None:
        self.head = head
        self.shared = shared  # how many of head's come first
        self.tail = tail

    def __len__(self) -> int:
        return self.shared + len(self.tail)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return list(self)[i]
        c = self.shared
        if i < 0:
            i += c + len(self.tail)
            if i < 0:
                raise IndexError("KeyRun index out of range")
        if i < c:
            return self.head[i]
        return self.tail[i - c]

    def __iter__(self):  # type: ignore[override]
        yield from islice(self.head, self.shared)
        yield from self.tail

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (KeyRun, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KeyRun({list(self)!r})"

#: Children waiting under one parent that are rendered at once, at ingest (a system prompt
#: with many conversations behind it): the first walk through a parent renders fewer, at
#: most this many, about 2 µs each.
RENDER_AT = 64

#: Forks (two held children whose bytes both follow in the prompt) a walk follows both
#: ways; past them it takes the first.
MAX_BRANCHES = 8

#: Bytes between two checkpoints of a walk (:meth:`ByteIndex.walk`) past the first
#: KB: a prompt whose first k checkpoints' bytes an earlier walk passed resumes where that
#: walk was, so a held document costs a hash per checkpoint and the walk of its last
#: bytes, not a step per block (about 0.6 µs a block: 300 µs for 32 KB).
WALK_CHECKPOINT_BYTES = 1024

#: Within the first KB the checkpoints are this far apart, so that a short prompt (a
#: system prompt and a question) resumes too: at 256, 512, 768 and 1,024 bytes, then every
#: :data:`WALK_CHECKPOINT_BYTES`.
WALK_FIRST_CHECKPOINT_BYTES = 256

_BOUNDARIES = tuple(range(WALK_FIRST_CHECKPOINT_BYTES, WALK_CHECKPOINT_BYTES + 1, WALK_FIRST_CHECKPOINT_BYTES))


def _boundary(i: int) -> int:
    """Where checkpoint ``i`` (from 0) ends in a prompt, bytes."""
    fine = len(_BOUNDARIES)
    return _BOUNDARIES[i] if i < fine else WALK_CHECKPOINT_BYTES * (i - fine + 2)


def _checkpoints_within(pos: int) -> int:
    """How many checkpoints end at or before byte ``pos``."""
    if pos < WALK_CHECKPOINT_BYTES:
        return pos // WALK_FIRST_CHECKPOINT_BYTES
    return len(_BOUNDARIES) + pos // WALK_CHECKPOINT_BYTES - 1

#: Checkpoints remembered (the least recently used forgotten first); a walk's checkpoints
#: share one copy of its path (about 150 bytes a block: the keys are the index's own).
WALK_MEMO_ENTRIES = 16_384

#: How many of a path's keys looking one parent with several children up costs (one
#: dictionary read against one): the cheaper side is looked up in the other.
_MULTI_LOOKUP_COST = 1

#: Keys forgotten (or held again without their tokens) remembered, so that a path need
#: not be checked whole when fewer than this went since its last check (about 3 MB).
GONE_LOG = 65_536

#: Blocks of the paths the checkpoints hold, at most (about 45 MB): past it the least
#: recently used checkpoints are forgotten.
WALK_MEMO_BLOCKS = 300_000


class _WalkPath:
    """The keys and byte ends of one walk, shared by its checkpoints."""

    __slots__ = ("keys", "ends", "index", "refs", "checked", "valid")

    def __init__(self, keys: tuple[int, ...], ends: tuple[int, ...], checked: int) -> None:
        self.keys = keys
        self.ends = ends
        self.index = {k: i for i, k in enumerate(keys)}  # key -> its place in keys
        self.refs = 0
        #: ByteIndex._gone_total when the keys were last checked.
        self.checked = checked
        #: How many of the first keys are held and indexed, as of that check.
        self.valid = len(keys)
