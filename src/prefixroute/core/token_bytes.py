"""What each token of a model's vocabulary stands for, in bytes: token ids -> exact text.

Precise mode can match a request against the engines' blocks without tokenizing it
(:mod:`prefixroute.core.kvevents.byte_index`) when the engines' token ids render back to
exactly the bytes of the text they were computed from. That holds for byte-level BPE
tokenizers (GPT-2's scheme, used by Llama 3, Qwen, Mistral Nemo, the bundled ``tiny``):
every vocabulary entry is a run of bytes written with GPT-2's byte-to-character map, and
an added token (``<|begin_of_text|>``...) stands for its own text. A tokenizer with a
normalizer (Qwen's NFC) renders the *normalized* text: requests are normalized the same
way before they are matched (:attr:`TokenBytes.normalize`). It does not hold for
SentencePiece tokenizers that put a ``▁`` before the first word, nor for a normalizer that
changes the special tokens; :meth:`TokenBytes.build` checks it on probe texts (every
special token, accents composed and decomposed, CJK, emoji, runs of spaces, line ends) and
returns ``None`` when a rendering differs, and the router then tokenizes requests
(:mod:`prefixroute.core.precise_keys`).

Sans-I/O; built once per loaded tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixroute.core.model_tokenizer import ModelTokenizer

__all__ = ["TokenBytes"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_PROBES = ("Hello world. It's 12,345 apples; naïve café — \"quoted\" (x) a  b\tc\n\nNext line: "
           "don't stop-gap 3.14 ünïcödé 日本語 テキスト 🙂 end.  Two  spaces,\r\nthen  more: x y z 1 2 3 ",
           "  leading spaces\n\n\n\ttabs\t\tand trailing   ", "{\"json\": [1, 2.5, null], \"k\": \"v\"}\n",
           "decomposed: cafe\u0301 n\u0303 A\u030a \uff21\uff22 \u2460 \ufb01 end")


def _byte_level_map() -> dict[str, int]:
    """GPT-2's character -> byte map (the inverse of ``bytes_to_unicode``): printable
    Latin-1 bytes stand for themselves, the others for ``chr(256 + n)`` in order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    out = {chr(b): b for b in keep}
    n = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + n)] = b
            n += 1
    return out


_BYTE_LEVEL = _byte_level_map()


class TokenBytes:
    """Token id -> the bytes it stands for, for one tokenizer whose tokens render to
    exactly their text (module docstring).

    Attributes:
        table: ``table[id]`` is the token's bytes (``None`` for an id no token has).
        completion_prefix: what the post-processor puts before a completions prompt
            (the BOS), rendered: a completions request's bytes begin with it.
        bytes_per_token: the probes' bytes per token (an estimate of a prompt's tokens
            from its length).
        normalize: the tokenizer's normalizer (text -> text), applied to a prompt before
            its bytes are matched, or ``None``.
    """

    __slots__ = ("table", "completion_prefix", "bytes_per_token", "normalize")

    def __init__(self, table: list[bytes | None], completion_prefix: bytes, bytes_per_token: float,
                 normalize: Callable[[str], str] | None = None) -> None:
        self.table = table
        self.completion_prefix = completion_prefix
        self.bytes_per_token = bytes_per_token
        self.normalize = normalize

    @classmethod
    def build(cls, tokenizer: "ModelTokenizer") -> "TokenBytes | None":
        """The table of ``tokenizer``, or ``None`` when its tokens do not render to
        exactly the probe texts (then requests must be tokenized)."""
        tok = tokenizer.tokenizer
        vocab: dict[str, int] = tok.get_vocab(with_added_tokens=False)
        added = tok.get_added_tokens_decoder()
        size = max([*vocab.values(), *added.keys(), -1]) + 1
        table: list[bytes | None] = [None] * size
        byte_level = all(c in _BYTE_LEVEL for s in vocab for c in s)
        for s, i in vocab.items():
            if byte_level:
                table[i] = bytes(_BYTE_LEVEL[c] for c in s)
            else:  # SentencePiece-style: "▁" is a space, "<0x0A>" a byte
                m = _BYTE_FALLBACK.fullmatch(s)
                table[i] = bytes([int(m.group(1), 16)]) if m else s.replace("\u2581", " ").encode("utf-8")
        for i, t in added.items():
            table[i] = t.content.encode("utf-8")
        specials = [t.content for t in added.values() if t.special]
        probes = (*_PROBES, "".join(f"{s} probe {n}: héllo  wörld\n\n" for n, s in enumerate(specials)))
        normalizer = getattr(tok, "normalizer", None)
        out = cls(table, b"", 4.0, normalizer.normalize_str if normalizer is not None else None)
        tokens = 0
        for text in probes:
            ids = tokenizer.encode(text, add_special_tokens=False)
            tokens += len(ids)
            if out.render(ids) != out.text_bytes(text):
                return None
        prefix_ids = tokenizer.encode("", add_special_tokens=True)
        prefix = out.render(prefix_ids)
        if prefix is None or tokenizer.encode(_PROBES[0], add_special_tokens=True)[:len(prefix_ids)] != prefix_ids:
            return None
        out.completion_prefix = prefix
        out.bytes_per_token = sum(len(p.encode("utf-8")) for p in probes) / max(tokens, 1)
        return out

    def text_bytes(self, text: str) -> bytes:
        """The bytes the engine's tokens of ``text`` render to: ``text`` normalized as the
        tokenizer normalizes it, in UTF-8 (a lone surrogate kept as its own bytes: it
        matches nothing)."""
        if self.normalize is not None:
            text = self.normalize(text)
        return text.encode("utf-8", "surrogatepass")

    def render(self, token_ids: Sequence[int]) -> bytes | None:
        """The bytes of ``token_ids`` in order; ``None`` when an id is unknown (out of
        range, negative, not an integer)."""
        table = self.table
        try:
            if token_ids and min(token_ids) < 0:
                return None
            return b"".join([table[i] for i in token_ids])  # type: ignore[misc]
        except (IndexError, TypeError):  # an id past the table, a None entry, not an int
            return None
