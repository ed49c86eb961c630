"""The router's own chained block keys, computed from token ids.

An engine's block hashes cannot be reproduced (vLLM seeds them with a random
``NONE_HASH``), so the router keys every block by a hash of its own, computed from the
token ids the events carry and, for a request, from the token ids the router's
tokenizer gives (:mod:`prefixroute.core.model_tokenizer`): equal token prefixes get equal
keys on every router replica, whatever the engines' seeds.

Definition (blocks of ``block_size`` tokens; only full blocks have a key)::

    key_0 = xxh3_64(u64le(root) + u64le(t_0) ... u64le(t_{B-1}), seed=BLOCK_KEY_SEED)
    key_i = xxh3_64(u64le(key_{i-1}) + u64le(tokens of block i), seed=BLOCK_KEY_SEED)

where ``root`` is :func:`chain_root` of the LoRA adapter (a block of an adapter never
matches the base model's, as in vLLM, whose block hashes include the adapter's name),
and a block's other extra hash inputs (multimodal hashes, cache salt) are folded in by
:func:`block_keys`' ``extras`` so that such a block matches no plain-text request.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

__all__ = ["BLOCK_KEY_SEED", "chain_root", "block_keys", "pack_token_ids"]

#: Seed of every block key (fixed: keys agree across router processes and restarts).
BLOCK_KEY_SEED = 0x6B76_2D65_7665_6E74  # "kv-event"
_ROOT_BASE = xxhash.xxh3_64_intdigest(b"prefixroute/kv-block-root", BLOCK_KEY_SEED)


def chain_root(lora_name: str | None = None) -> int:
    """The parent key of a chain's first block: the base model's, or a LoRA adapter's."""
    if not lora_name:
        return _ROOT_BASE
    return xxhash.xxh3_64_intdigest(b"lora\0" + lora_name.encode("utf-8", "surrogatepass"), BLOCK_KEY_SEED)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as unsigned 64-bit little-endian integers.

    Raises:
        ValueError: an id is not an integer in ``[0, 2**64)``.
    """
    try:
        return struct.pack(f"<{len(token_ids)}Q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**64): {exc}") from None


def block_keys(token_ids: Sequence[int] | bytes, block_size: int, parent: int, num_blocks: int | None = None,
               extras: Sequence[object] | None = None) -> list[int]:
    """The keys of the full blocks of ``token_ids``, chained from ``parent``.

    Args:
        token_ids: token ids, or their :func:`pack_token_ids` bytes.
        block_size: tokens per block (>= 1).
        parent: the key of the block before the first (:func:`chain_root` for a
            sequence's first block).
        num_blocks: keys to compute (default: every full block).
        extras: per block, extra hash inputs other than the LoRA name (``None`` or an
            empty entry: none), folded into that block's key.
    Returns:
        Unsigned 64-bit keys, one per full block.
    Raises:
        ValueError: a token id out of range, ``block_size`` < 1, or fewer tokens than
            ``num_blocks`` blocks.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    data = token_ids if isinstance(token_ids, (bytes, bytearray)) else pack_token_ids(token_ids)
    step = block_size * 8
    full = len(data) // step
    n = full if num_blocks is None else num_blocks
    if n > full:
        raise ValueError(f"{n} blocks of {block_size} tokens need {n * block_size} token ids, got {len(data) // 8}")
    view = memoryview(data)
    digest = xxhash.xxh3_64_intdigest
    seed = BLOCK_KEY_SEED
    out = []
    h = parent
    for i in range(n):
        block = view[i * step:(i + 1) * step]
        if extras is not None and extras[i]:
            h = digest(h.to_bytes(8, "little") + block + repr(tuple(extras[i])).encode(), seed)
        else:
            h = digest(h.to_bytes(8, "little") + block, seed)
        out.append(h)
    return out
