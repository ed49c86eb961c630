"""The fleet's KV-cache state from engine events, and the question a routing policy asks it.

:class:`PreciseCacheView` holds one :class:`~.stream.InstanceStream` (and its
:class:`~.index.InstanceIndex`) per instance and the fleet's
:class:`~.index.SharedIndex`. A policy asks, for a request's token ids, how many leading
tokens each instance holds and where (:meth:`PreciseCacheView.holdings`), and whether an
instance's state can be trusted right now (:meth:`PreciseCacheView.mode`): when it is
``approximate`` the policy falls back to its own learned state for that instance.

Sans-I/O and cheap to ask: building a request's keys is one xxh3 pass per block
(:meth:`PreciseCacheView.request_keys`, once per request); a holding is dictionary
lookups, per instance, along the chain.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixroute.core.kvevents.byte_index import ByteIndex
from prefixroute.core.kvevents.chain import block_keys, chain_root
from prefixroute.core.kvevents.index import CPU_UNIT, InstanceIndex, SharedIndex
from prefixroute.core.kvevents.stream import InstanceStream, Mode, StreamSettings

if TYPE_CHECKING:
    from prefixroute.core.token_bytes import TokenBytes

__all__ = ["PrefixHolding", "InstanceStatus", "PreciseCacheView"]

_GPU_MASK = CPU_UNIT - 1


@dataclass(frozen=True, slots=True)
class PrefixHolding:
    """The leading tokens of a request one instance can skip prefilling, by where they are.

    Counted as the emulated engine (and vLLM with a KV connector) loads them: the longest
    run of leading blocks on the GPU, then the run that continues it in the CPU tier,
    then the run that continues that in the shared tier. Tokens, multiples of the block
    size.

    Attributes:
        gpu_tokens: leading tokens on the instance's GPU.
        cpu_tokens: the next tokens, in its CPU tier.
        shared_tokens: the next tokens, in the shared tier.
    """

    gpu_tokens: int = 0
    cpu_tokens: int = 0
    shared_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Tokens held in any tier (the prefix the instance would not prefill)."""
        return self.gpu_tokens + self.cpu_tokens + self.shared_tokens


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """What the status output shows of one instance's stream.

    Attributes:
        instance: the instance (base URL).
        mode: ``"precise"`` or ``"approximate"``.
        reason: why, in a few words.
        connected: the stream's connection is up.
        blocks: blocks held (GPU and CPU copies of distinct keys).
        next_seq: the sequence number expected next, or ``None``.
        messages, gaps, replays, replays_failed, resets, restarts: counts since start-up.
        orphaned, malformed_messages, malformed_events, unknown_events: counts since start-up.
        last_message_age_s: seconds since the last message, or ``None``.
        last_reset: why the state was last reset (an engine restart, a failed replay...),
            or ``None``; last_reset_age_s: how long ago, seconds.
    """

    instance: str
    mode: str
    reason: str
    connected: bool
    blocks: int
    next_seq: int | None
    messages: int
    gaps: int
    replays: int
    replays_failed: int
    resets: int
    restarts: int
    orphaned: int
    malformed_messages: int
    malformed_events: int
    unknown_events: int
    last_message_age_s: float | None
    last_reset: str | None = None
    last_reset_age_s: float | None = None


class PreciseCacheView:
    """Every instance's state from its events, and the shared tier's.

    Args:
        block_size: the engines' KV block size, tokens (vLLM: 16 on CUDA by default).
        stream_settings: how streams repair gaps (:class:`~.stream.StreamSettings`).
        shared_tier_max_blocks: most shared-tier blocks remembered.
    Raises:
        ValueError: ``block_size`` < 1.
    """

    def __init__(self, block_size: int = 16, stream_settings: StreamSettings | None = None,
                 shared_tier_max_blocks: int = 10_000_000) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.stream_settings = stream_settings or StreamSettings()
        self.shared = SharedIndex(shared_tier_max_blocks)
        self._streams: dict[str, InstanceStream] = {}
        #: The held blocks by their bytes (:meth:`match_bytes`), or ``None`` (:meth:`use_token_bytes`).
        self.byte_index: ByteIndex | None = None

    def use_token_bytes(self, token_bytes: "TokenBytes | None") -> None:
        """Index held blocks by their bytes with ``token_bytes`` (``None``: stop), so
        that requests can be matched without tokenizing (:meth:`match_bytes`). Blocks
        already held when it starts are indexed as they are stored again; a table equal
        to the one in use keeps the index as it is."""
        current = self.byte_index
        if current is not None and token_bytes is not None and (
                token_bytes is current.token_bytes or token_bytes.table == current.token_bytes.table):
            return  # the same tokenizer (a reload that changed something else): the index stays
        bx = self.byte_index = ByteIndex(token_bytes, self.block_size) if token_bytes is not None else None
        self.shared.byte_index = bx
        for stream in self._streams.values():
            stream.index.byte_index = bx
            if bx is not None:  # what is held already: counted (not indexed until stored again)
                for key in stream.index.held:
                    bx.ref(key, None)
        if bx is not None:
            for key in self.shared.held:
                bx.ref(key, None)

    def match_bytes(self, data: bytes, lora_name: str | None = None) -> tuple[Sequence[int], Sequence[int]] | None:
        """The router keys of a prompt's leading blocks that some instance holds, and
        where each ends in ``data``, found from its bytes
        (:meth:`~.byte_index.ByteIndex.walk`); ``None`` when blocks are not indexed by
        bytes."""
        bx = self.byte_index
        return None if bx is None else bx.walk(data, chain_root(lora_name))

    # -- membership ---------------------------------------------------------------------

    def add_instance(self, instance: str, settings: StreamSettings | None = None) -> InstanceStream:
        """Start tracking an instance (no-op if tracked); returns its stream."""
        stream = self._streams.get(instance)
        if stream is None:
            index = InstanceIndex(self.block_size, self.shared)
            index.byte_index = self.byte_index
            stream = InstanceStream(instance, index, settings or self.stream_settings)
            self._streams[instance] = stream
        return stream

    def remove_instance(self, instance: str) -> None:
        """Stop tracking an instance and forget its state (no-op if unknown)."""
        stream = self._streams.pop(instance, None)
        if stream is not None:
            stream.index.clear()

    def stream(self, instance: str) -> InstanceStream | None:
        """The instance's stream, or ``None`` when it is not tracked."""
        return self._streams.get(instance)

    @property
    def instances(self) -> list[str]:
        """The tracked instances, in the order they were added."""
        return list(self._streams)

    # -- the policy's questions ---------------------------------------------------------

    def mode(self, instance: str) -> Mode:
        """``PRECISE`` when the instance's state is trusted now, else ``APPROXIMATE``
        (an untracked instance is approximate)."""
        stream = self._streams.get(instance)
        return stream.mode if stream is not None else Mode.APPROXIMATE

    def precise_flags(self, instances: Sequence[str]) -> list[bool]:
        """``[mode(i) is PRECISE for i in instances]`` (one pass, for a decision's candidates)."""
        get, precise = self._streams.get, Mode.PRECISE
        return [(s := get(i)) is not None and s.mode is precise for i in instances]

    def request_keys(self, token_ids: Sequence[int], lora_name: str | None = None) -> list[int]:
        """The router keys of a request's full blocks (see :mod:`.chain`).

        Args:
            token_ids: the prompt's token ids, as the engine computes them
                (:meth:`prefixroute.core.model_tokenizer.ModelTokenizer.request_token_ids`).
            lora_name: the LoRA adapter the request runs on, ``None`` for the base model.
        Raises:
            ValueError: a token id outside ``[0, 2**64)``.
        """
        return block_keys(token_ids, self.block_size, chain_root(lora_name))

    def holdings(self, keys: Sequence[int], instances: Iterable[str] | None = None) -> dict[str, PrefixHolding]:
        """How many leading tokens of a request each instance holds, per tier.

        Args:
            keys: the request's block keys (:meth:`request_keys`).
            instances: the instances to answer for (default: every tracked one); an
                untracked instance gets an empty holding.
        Returns:
            instance -> :class:`PrefixHolding`. Whatever an instance's mode; ask
            :meth:`mode` whether to trust it. The caller caps it as the engine does
            (vLLM always computes a prompt's last token).
        """
        bs = self.block_size
        n = len(keys)
        shared = self.shared.held
        out: dict[str, PrefixHolding] = {}
        for instance in (self._streams if instances is None else instances):
            stream = self._streams.get(instance)
            if stream is None:
                out[instance] = PrefixHolding()
                continue
            held = stream.index.held
            i = 0
            while i < n and held.get(keys[i], 0) & _GPU_MASK:
                i += 1
            gpu = i
            while i < n and held.get(keys[i], 0) >= CPU_UNIT:
                i += 1
            cpu = i
            if shared:
                while i < n and keys[i] in shared:
                    i += 1
            out[instance] = PrefixHolding(gpu * bs, (cpu - gpu) * bs, (i - cpu) * bs)
        return out

    def lora_name(self, model: object) -> str | None:
        """The LoRA adapter a request naming ``model`` runs on: ``model`` itself when
        some instance's events stored blocks of an adapter of that name, else ``None``
        (the base model; an adapter no engine has stored a block of matches nothing
        either way)."""
        return model if isinstance(model, str) and model in self.shared.lora_names else None

    def any_precise(self) -> bool:
        """Whether any tracked instance is in precise mode now."""
        return any(s.mode is Mode.PRECISE for s in self._streams.values())

    def holds(self, instance: str, key: int) -> bool:
        """Whether the instance holds the block ``key`` on its GPU."""
        stream = self._streams.get(instance)
        return stream is not None and bool(stream.index.held.get(key, 0) & _GPU_MASK)

    # -- status -------------------------------------------------------------------------

    def status(self, now: float) -> list[InstanceStatus]:
        """One :class:`InstanceStatus` per tracked instance; ``now`` on the clock the
        driver passes with messages."""
        out = []
        for instance, s in self._streams.items():
            c, k = s.counts, s.index.counters
            age = None if s.last_message_at is None else max(0.0, now - s.last_message_at)
            reset = s.last_reset
            out.append(InstanceStatus(instance, s.mode.value, s.reason, s.connected, len(s.index), s.expected,
                                      c.messages, c.gaps, c.replays, c.replays_failed, c.resets, c.restarts,
                                      k.orphaned, k.malformed_messages, k.malformed_events, k.unknown_events, age,
                                      None if reset is None else reset[0],
                                      None if reset is None else max(0.0, now - reset[1])))
        return out
