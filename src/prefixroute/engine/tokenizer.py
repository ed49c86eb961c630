"""Deterministic, prefix-stable tokenization for the emulated engine.

The rule (no vocabulary, no model download, identical on every machine):

* A **text** prompt is encoded to UTF-8 (lone surrogates passed through) and split into
  4-byte chunks, one token per chunk; the last chunk may be 1–3 bytes. A chunk of
  ``n`` bytes ``b`` has the token id ``int.from_bytes(b, "little") + (n << 32)``. The
  length marker ``n << 32`` makes ids injective: ``"a"`` and ``"a\\0"`` differ.
* A prompt given as a **list of token ids** is used as is: one token per id.

Properties (tested):

* **Prefix stability.** If a prefix of a text has a UTF-8 length that is a multiple
  of 4 bytes, its tokens are exactly the first tokens of the whole text. Real BPE
  tokenizers only approximately have this property; the cache model relies on it.
* **About 4 characters per token** on English (ASCII) text, as with Llama-3's
  tokenizer on English prose; a 32,000-character prompt is 8,000 tokens.

Speed: the engine never builds the list of token ids of a text prompt. A prompt is a
:class:`TokenizedPrompt` whose ``payload`` holds ``token_bytes`` bytes per token, so a
KV block of 16 tokens is a 64-byte slice that is hashed directly (about 0.3 ms for a
32,000-character prompt including block hashing, measured on one core). Text tokens
take 4 bytes (the last chunk is padded with ``0xFF``, a byte that never occurs in
UTF-8, so padding cannot collide with real text); token-id prompts take 8 bytes per
id (unsigned little-endian).

The emulated model "generates" :data:`OUTPUT_WORDS`, each exactly one 4-byte token,
so the generated text tokenizes back to exactly as many tokens as were generated.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import xxhash

__all__ = [
    "TEXT_TOKEN_BYTES",
    "ID_TOKEN_BYTES",
    "OUTPUT_WORDS",
    "TokenizedPrompt",
    "tokenize",
    "tokenize_text",
    "from_token_ids",
    "encode",
    "count_tokens",
    "decode",
    "output_token_id",
    "token_payload",
]

#: Bytes of UTF-8 per text token (and per payload slot of a text token).
TEXT_TOKEN_BYTES = 4
#: Payload bytes per token of a prompt given as token ids (unsigned 64-bit LE).
ID_TOKEN_BYTES = 8
_PAD = b"\xff"  # never valid in UTF-8

#: Words the emulated model emits: each is exactly 4 ASCII bytes, i.e. one token.
OUTPUT_WORDS: tuple[str, ...] = (
    " the", " and", " for", " are", " but", " not", " you", " all",
    " any", " can", " had", " her", " was", " one", " our", " out",
    " day", " get", " has", " him", " his", " how", " man", " new",
    " now", " old", " see", " two", " way", " who", " its", " say",
)
_WORD_IDS: tuple[int, ...] = tuple(
    int.from_bytes(w.encode(), "little") + (TEXT_TOKEN_BYTES << 32) for w in OUTPUT_WORDS
)


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """A prompt as the engine sees it: a count of tokens and a token-aligned payload.

    Attributes:
        payload: ``num_tokens * token_bytes`` bytes; token ``i`` is
            ``payload[i*token_bytes:(i+1)*token_bytes]``. For text, the UTF-8 bytes
            padded with ``0xFF`` to a multiple of 4; for token ids, 8 bytes per id.
        token_bytes: bytes per token in ``payload``: 4 (text) or 8 (token ids).
        num_tokens: number of prompt tokens.
    """

    payload: bytes
    token_bytes: int
    num_tokens: int

    @property
    def is_text(self) -> bool:
        """True for a text prompt, False for a prompt given as token ids."""
        return self.token_bytes == TEXT_TOKEN_BYTES


def tokenize_text(text: str) -> TokenizedPrompt:
    """Tokenize a text prompt (``ceil(utf8_bytes / 4)`` tokens); never copies more than once."""
    data = text.encode("utf-8", "surrogatepass")
    rem = len(data) % TEXT_TOKEN_BYTES
    if rem:
        data += _PAD * (TEXT_TOKEN_BYTES - rem)
    return TokenizedPrompt(data, TEXT_TOKEN_BYTES, len(data) // TEXT_TOKEN_BYTES)


def from_token_ids(token_ids: Sequence[int]) -> TokenizedPrompt:
    """Wrap a prompt given as token ids (used as is: one token per id).

    Raises:
        ValueError: an id is not an integer in ``[0, 2**64)``.
    """
    try:
        payload = struct.pack(f"<{len(token_ids)}Q", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**64): {exc}") from None
    return TokenizedPrompt(payload, ID_TOKEN_BYTES, len(token_ids))


def tokenize(prompt: str | Sequence[int] | TokenizedPrompt) -> TokenizedPrompt:
    """Tokenize a text, wrap a token-id list, or pass a :class:`TokenizedPrompt` through.

    Raises:
        ValueError: a token id is out of range (see :func:`from_token_ids`).
    """
    if isinstance(prompt, TokenizedPrompt):
        return prompt
    if isinstance(prompt, str):
        return tokenize_text(prompt)
    return from_token_ids(prompt)


def count_tokens(text: str) -> int:
    """Number of tokens of ``text``: ``ceil(len(UTF-8 bytes) / 4)``."""
    return -(-len(text.encode("utf-8", "surrogatepass")) // TEXT_TOKEN_BYTES)


def encode(text: str) -> list[int]:
    """The token ids of ``text`` under the 4-byte-chunk rule (see module docstring).

    Slower than :func:`tokenize_text`; for tests, tools and clients that want ids.
    """
    data = text.encode("utf-8", "surrogatepass")
    full = len(data) // TEXT_TOKEN_BYTES
    marker = TEXT_TOKEN_BYTES << 32
    ids = [v + marker for v in struct.unpack_from(f"<{full}I", data)]
    tail = data[full * TEXT_TOKEN_BYTES :]
    if tail:
        ids.append(int.from_bytes(tail, "little") + (len(tail) << 32))
    return ids


def decode(token_ids: Sequence[int]) -> str:
    """Text of token ids produced by :func:`encode` (invalid UTF-8 becomes U+FFFD).

    Raises:
        ValueError: an id carries no valid length marker (it is not a text token).
    """
    parts = []
    for tid in token_ids:
        n = tid >> 32
        if not 1 <= n <= TEXT_TOKEN_BYTES:
            raise ValueError(f"token id {tid} is not a text token of this tokenizer")
        parts.append((tid & 0xFFFF_FFFF).to_bytes(n, "little"))
    return b"".join(parts).decode("utf-8", "replace")


def output_token_id(seed: int, index: int, vocabulary: Sequence[int] | None = None) -> int:
    """The ``index``-th (0-based) token the emulated model generates for a request.

    Deterministic in ``(seed, index)``; the engine derives ``seed`` from the prompt, so
    the same prompt always gets the same answer (like greedy decoding).
    Returns one of ``vocabulary`` (a non-empty sequence of token ids), by default one
    of the ids of :data:`OUTPUT_WORDS`.
    """
    h = xxhash.xxh3_64_intdigest(index.to_bytes(8, "little"), seed)
    words = _WORD_IDS if vocabulary is None else vocabulary
    return words[h % len(words)]


def token_payload(token_id: int, token_bytes: int) -> bytes:
    """Payload bytes that append generated token ``token_id`` to a sequence.

    ``token_bytes`` is the sequence's :attr:`TokenizedPrompt.token_bytes`: a generated
    word is its 4 UTF-8 bytes in a text sequence and its 8-byte id in a token-id one.
    """
    if token_bytes == TEXT_TOKEN_BYTES:
        return (token_id & 0xFFFF_FFFF).to_bytes(TEXT_TOKEN_BYTES, "little")
    return token_id.to_bytes(ID_TOKEN_BYTES, "little")
