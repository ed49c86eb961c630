"""A request's KV block keys in precise mode: its token ids as the engine computes them,
chained into the router's keys, with the work shared between requests.

Precise mode matches requests against the blocks the engines report by token ids: the
request is tokenized with the model's own tokenizer and chat template
(:class:`~prefixroute.core.model_tokenizer.ModelTokenizer`) and its full blocks keyed as
the index keys the engines' blocks (:func:`prefixroute.core.kvevents.chain.block_keys`).
Tokenizing a 24 KB prompt costs milliseconds, so :class:`RequestKeyer` does it piece by
piece and remembers the pieces:

* the prompt text is cut at the tokenizer's special tokens (``<|start_header_id|>``,
  ``<|eot_id|>``...). The ``tokenizers`` library matches those first and tokenizes the
  text between them on its own, so the ids of the whole are the ids of the pieces, in
  order (checked on a probe when the keyer is made; a tokenizer for which it does not
  hold is used whole, without the cache);
* a text piece longer than :data:`CHUNK_CHARS` is cut again into chunks of about that
  length, each ending just before a single space between two other characters (a place
  where the pre-tokenizers of byte-level BPE and SentencePiece models start a new word,
  checked on a probe as above and on the vocabulary, which must have no token holding a
  space after a non-space character; a tokenizer for which it does not hold is not
  chunked).
  A cut depends only on the text before it, so two prompts that begin with the same
  document share its chunks, and a new question after a known document costs one chunk;
* each piece's token ids and the keys of the blocks it completes are cached under the
  chain state it starts from (the key of the last full block and the tokens after it)
  and the piece's xxh3 digest: a document, a system prompt or a conversation's history,
  repeated by later requests, is tokenized and hashed once;
* with ``inline_chars``, a request whose uncached text (the chunk that ends each piece
  aside) is longer than that is not tokenized at all: :class:`TokenizeLater` names its pieces, which the caller tokenizes
  off the request path (:meth:`RequestKeyer.tokenize_pieces`, safe on another thread:
  the ``tokenizers`` library releases the GIL) and hands back (:meth:`RequestKeyer.learn`);
  the request is routed on the learned view meanwhile. The first request naming a new
  24 KB document then costs no 5-10 ms tokenization on the event loop.

Sans-I/O: a computation over a loaded tokenizer. Not thread-safe (one keyer per event
loop or process).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from prefixroute.core.chat_skeleton import ChatSkeletons
from prefixroute.core.kvevents.chain import block_keys, chain_root
from prefixroute.core.model_tokenizer import ModelTokenizer
from prefixroute.core.routing_text import completion_prompt

if TYPE_CHECKING:
    from prefixroute.core.kvevents.view import PreciseCacheView
    from prefixroute.core.token_bytes import TokenBytes

__all__ = ["RequestKeyer", "TokenizeLater", "DEFAULT_CACHE_PIECES", "CHUNK_CHARS"]

#: Pieces (chain state + text) whose ids and keys a keyer remembers, least recently used
#: forgotten first. A piece costs its token ids and keys: about 10 bytes a token.
DEFAULT_CACHE_PIECES = 4096
#: Characters after which a long text piece is cut at the next safe place (a single space
#: between two non-space characters): about 250 tokens of English, 0.1-0.2 ms to tokenize.
CHUNK_CHARS = 1024
_PROBE = ("Hello world. It's 12,345 apples; naïve café — \"quoted\" (x) a  b\tc\n\nNext line: "
          "don't stop-gap 3.14 ünïcödé 日本語 テキスト 🙂 end.  Two  spaces,\r\nthen  more: x y z 1 2 3 ")


class TokenizeLater(Exception):
    """A request's uncached text is longer than ``inline_chars``
    (:meth:`RequestKeyer.keys`): tokenize ``pieces`` off the request path
    (:meth:`RequestKeyer.tokenize_pieces`), then :meth:`RequestKeyer.learn` them.

    Attributes:
        pieces: the uncached text pieces, each once, in prompt order.
        chars: their length, characters.
    """

    def __init__(self, pieces: tuple[str, ...], chars: int) -> None:
        super().__init__(f"{len(pieces)} prompt pieces ({chars} characters) to tokenize")
        self.pieces = pieces
        self.chars = chars


class RequestKeyer:
    """Request -> (the keys of its full KV blocks, its prompt tokens).

    Args:
        tokenizer: the model's tokenizer and chat template (the engines').
        block_size: the engines' KV block size, tokens (>= 1).
        cache_pieces: pieces remembered (0: none; every request tokenized whole).
        chunk_chars: a text piece is cut into chunks of about this many characters
            (0: not cut; see the module docstring).

    Raises:
        ValueError: ``block_size`` < 1 or ``cache_pieces`` < 0.
    """

    def __init__(self, tokenizer: ModelTokenizer, block_size: int, cache_pieces: int = DEFAULT_CACHE_PIECES,
                 chunk_chars: int = CHUNK_CHARS) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if cache_pieces < 0:
            raise ValueError(f"cache_pieces must be >= 0, got {cache_pieces}")
        if chunk_chars < 0:
            raise ValueError(f"chunk_chars must be >= 0, got {chunk_chars}")
        self.chunk_chars = chunk_chars
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.cache_pieces = cache_pieces
        self._cache: OrderedDict[tuple, tuple[list[int], int, tuple[int, ...], int]] = OrderedDict()
        self._ids: dict[str, int] = {}
        # a piece's token ids wherever it occurs (its chain keys depend on what precedes it;
        # its ids do not): the template's short pieces after a new question are not
        # tokenized again
        self._piece_ids: OrderedDict[tuple[int, int], list[int]] = OrderedDict()
        self._split: re.Pattern[str] | None = None
        self._prefix: list[int] = []  # what the post-processor puts before a completions prompt
        self.hits = 0
        self.misses = 0
        #: Requests whose pieces were handed to the caller to tokenize (:class:`TokenizeLater`).
        self.deferred = 0
        #: With a :class:`~prefixroute.core.token_bytes.TokenBytes`, requests are matched by
        #: their bytes (:meth:`match_bytes`) instead of tokenized; ``None``: tokenized.
        self.token_bytes: TokenBytes | None = None
        #: Requests matched by bytes.
        self.byte_matched = 0
        #: The chat template applied by substitution, once per conversation shape.
        self.skeletons = ChatSkeletons(tokenizer)
        if cache_pieces:
            self._prepare()

    def _prepare(self) -> None:
        tok = self.tokenizer
        specials = {}
        for t in tok.tokenizer.get_added_tokens_decoder().values():
            if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized):
                specials[t.content] = tok.tokenizer.token_to_id(t.content)
        if not specials:
            return
        pattern = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        prefix = tok.encode("", add_special_tokens=True)
        probe_text = "".join(f"{s} probe {i}: héllo  wörld\n\n" for i, s in enumerate(specials))
        self._split, self._ids, self._prefix = pattern, specials, prefix
        whole = tok.encode(probe_text, add_special_tokens=False)
        pieces = self._pieces_ids(probe_text)
        with_bos = tok.encode(probe_text, add_special_tokens=True)
        if whole != pieces or with_bos != prefix + pieces:
            self._split = None  # the pieces would not add up to the whole: tokenize whole
            return
        if self.chunk_chars:
            probe = _PROBE * 3
            chunks = _chunks(probe, 1)  # a cut at every place one may fall
            ids = [i for c in chunks for i in tok.encode(c, add_special_tokens=False)]
            if len(chunks) < 20 or ids != tok.encode(probe, add_special_tokens=False) or \
                    _joins_across_space(tok.tokenizer.get_vocab()):
                self.chunk_chars = 0  # this tokenizer joins words across such a cut: pieces whole

    def _pieces_ids(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._split.split(text):  # type: ignore[union-attr]
            if not piece:
                continue
            sid = self._ids.get(piece)
            out.extend([sid] if sid is not None else self.tokenizer.encode(piece, add_special_tokens=False))
        return out

    def _pieces(self, text: str) -> tuple[list[str], set[int]]:
        """``text`` cut at the special tokens, and long pieces cut into chunks; and the
        indices of the chunks that end a piece (where a new question usually is)."""
        cs = self.chunk_chars
        out: list[str] = []
        ends: set[int] = set()
        for piece in self._split.split(text):  # type: ignore[union-attr]
            if not piece:
                continue
            if cs and len(piece) > cs and piece not in self._ids:
                out.extend(_chunks(piece, cs))
            else:
                out.append(piece)
            ends.add(len(out) - 1)
        return out, ends

    # -- requests ------------------------------------------------------------------------

    def keys(self, payload: Mapping[str, Any], chat: bool, lora_name: str | None = None, *,
             inline_chars: int | None = None) -> tuple[list[int], int]:
        """The keys of a request's full KV blocks and its prompt's token count.

        Args:
            payload: the OpenAI request (chat or completions).
            chat: ``/v1/chat/completions`` (the template applied), else completions.
            lora_name: the LoRA adapter the request runs on (``None``: the base model).
            inline_chars: most characters of not yet tokenized text this call may
                tokenize (``None``: no limit). Applies to a tokenizer whose prompts are
                cut into pieces (the module docstring); others are tokenized whole.
        Raises:
            TokenizeLater: the request has more uncached text than ``inline_chars``.
            prefixroute.core.keys.InvalidRequest: a request the tokenizer cannot render
                (no chat template, a malformed prompt).
        """
        tok = self.tokenizer
        root = chain_root(lora_name)
        if chat:
            text = self.skeletons.render(payload)
            prefix: list[int] = []
        else:
            prompt = completion_prompt(payload)
            if not isinstance(prompt, str):  # token ids, used as given
                ids = list(prompt)
                return block_keys(ids, self.block_size, root), len(ids)
            text = prompt
            prefix = self._prefix
        if self._split is None:
            ids = tok.encode(text, add_special_tokens=not chat)
            return block_keys(ids, self.block_size, root), len(ids)
        return self._keys_of(text, prefix, root, inline_chars)

    def match_bytes(self, payload: Mapping[str, Any], chat: bool, view: "PreciseCacheView",
                    lora_name: str | None = None) -> tuple[Sequence[int], int]:
        """A request's keys by its bytes, without tokenizing it: the keys of its leading
        blocks some instance holds (:meth:`~prefixroute.core.kvevents.view.PreciseCacheView.match_bytes`)
        and its prompt tokens, those blocks' plus an estimate of the rest (its bytes over
        the fleet's bytes per token, :meth:`~prefixroute.core.kvevents.byte_index.ByteIndex.bytes_per_token`).
        A completions prompt given as token ids is keyed from them, whole.

        Raises:
            ValueError: no :attr:`token_bytes`, or ``view`` does not index blocks by bytes.
            prefixroute.core.keys.InvalidRequest: a request the template cannot render.
        """
        tb, bx = self.token_bytes, view.byte_index
        if tb is None or bx is None:
            raise ValueError("this keyer or view does not match by bytes")
        if chat:
            data = tb.text_bytes(self.skeletons.render(payload))
        else:
            prompt = completion_prompt(payload)
            if not isinstance(prompt, str):  # token ids, used as given
                ids = list(prompt)
                return block_keys(ids, self.block_size, chain_root(lora_name)), len(ids)
            data = tb.completion_prefix + tb.text_bytes(prompt)
        self.byte_matched += 1
        keys, ends = bx.walk(data, chain_root(lora_name))
        matched = ends[-1] if ends else 0
        rest = len(data) - matched
        return keys, len(keys) * self.block_size + (int(rest / bx.bytes_per_token() + 0.5) if rest else 0)

    def tokenize_pieces(self, pieces: Sequence[str]) -> list[list[int]]:
        """The token ids of each piece of a :class:`TokenizeLater`. Reads no cache:
        safe to call on another thread while the keyer serves requests."""
        encode = self.tokenizer.encode
        return [encode(p, add_special_tokens=False) for p in pieces]

    def learn(self, pieces: Sequence[str], ids: Sequence[list[int]]) -> None:
        """Remember the token ids of ``pieces`` (:meth:`tokenize_pieces`' answer); on the
        thread that calls :meth:`keys`."""
        digest = xxhash.xxh3_64_intdigest
        piece_ids = self._piece_ids
        for piece, piece_ids_of in zip(pieces, ids):
            piece_ids[(digest(piece.encode("utf-8", "surrogatepass")), len(piece))] = piece_ids_of
            if len(piece_ids) > self.cache_pieces:
                piece_ids.popitem(last=False)

    def _keys_of(self, text: str, prefix: list[int], root: int,
                 inline_chars: int | None = None) -> tuple[list[int], int]:
        bs = self.block_size
        cache = self._cache
        parent, carry = root, tuple(prefix)
        keys: list[int] = []
        total = len(prefix)
        if len(carry) >= bs:  # (a post-processor prefix of a block or more)
            full = len(carry) // bs
            keys = block_keys(list(carry[: full * bs]), bs, parent)
            parent, carry = keys[-1], carry[full * bs:]
        digest = xxhash.xxh3_64_intdigest
        piece_ids = self._piece_ids
        specials = self._ids
        texts, ends = self._pieces(text)
        pieces = [(p, (digest(p.encode("utf-8", "surrogatepass")), len(p))) for p in texts]
        if inline_chars is not None:
            self._maybe_defer(pieces, ends, parent, carry, inline_chars)
        for piece, pk in pieces:
            ck = (parent, carry, *pk)
            hit = cache.get(ck)
            if hit is not None:
                cache.move_to_end(ck)
                if pk in piece_ids:  # (its ids stay as long as its keys: see inline_chars)
                    piece_ids.move_to_end(pk)
                self.hits += 1
                new, parent, carry, n = hit
            else:
                self.misses += 1
                sid = self._ids.get(piece)
                if sid is not None:
                    ids = [sid]
                else:
                    cached = piece_ids.get(pk)
                    if cached is None:
                        ids = self.tokenizer.encode(piece, add_special_tokens=False)
                        piece_ids[pk] = ids
                        if len(piece_ids) > self.cache_pieces:
                            piece_ids.popitem(last=False)
                    else:
                        piece_ids.move_to_end(pk)
                        ids = cached
                n = len(ids)
                run = list(carry) + ids
                full = len(run) // bs
                new = block_keys(run[: full * bs], bs, parent) if full else []
                if new:
                    parent = new[-1]
                carry = tuple(run[full * bs:])
                cache[ck] = (new, parent, carry, n)
                if len(cache) > self.cache_pieces:
                    cache.popitem(last=False)
            keys.extend(new)
            total += n
        return keys, total

    def _maybe_defer(self, pieces: list[tuple[str, tuple[int, int]]], ends: set[int], parent: int,
                     carry: tuple[int, ...], inline_chars: int) -> None:
        """Raise :class:`TokenizeLater` when the request's new text is more than
        ``inline_chars``. New: past the chain's cached run (:attr:`_cache`), and neither a
        special token nor a piece whose ids are known. The chunk that ends a piece is
        not counted (in a prompt sent as one piece, it is where each request's new
        question is: deferring it would defer every such request), nor is a request with
        more new pieces than half the cache holds (learning them would evict them)."""
        cache, piece_ids, specials = self._cache, self._piece_ids, self._ids
        start = len(pieces)
        for i, (_, pk) in enumerate(pieces):  # the cached run: nothing to tokenize
            hit = cache.get((parent, carry, *pk))
            if hit is None:
                start = i
                break
            parent, carry = hit[1], hit[2]
        missing: dict[str, None] = {}
        chars = 0
        for i in range(start, len(pieces)):
            piece, pk = pieces[i]
            if piece in specials or pk in piece_ids or piece in missing:
                continue
            missing[piece] = None
            if i not in ends:
                chars += len(piece)
        if chars > inline_chars and len(missing) <= self.cache_pieces // 2:
            self.deferred += 1
            raise TokenizeLater(tuple(missing), sum(map(len, missing)))

    def stats(self) -> dict[str, int]:
        """Pieces cached, cache hits and misses, requests deferred and requests matched by
        bytes since start, and the chat template's renders (``template_*``:
        :meth:`ChatSkeletons.stats`)."""
        sk = self.skeletons.stats()
        return {"pieces": len(self._cache), "hits": self.hits, "misses": self.misses, "deferred": self.deferred,
                "byte_matched": self.byte_matched, "template_shapes": sk["shapes"],
                "template_substituted": sk["hits"], "template_rendered": sk["renders"],
                "template_mismatches": sk["mismatches"]}


#: A space (as a byte-level or SentencePiece vocabulary writes it: " ", "Ġ", "▁") after a
#: character that is not whitespace (nor the separator of the joined vocabulary).
_JOINED_SPACE = re.compile("[^\\s\x00\u0120\u0109\u010a\u010d\u010b\u010c\u2581][ \u0120\u2581]")


def _joins_across_space(vocab: Mapping[str, int]) -> bool:
    """Whether a token of ``vocab`` holds a space after a non-space character (a word
    joined to the next across the space where :func:`_chunks` cuts)."""
    return _JOINED_SPACE.search("\x00".join(vocab)) is not None


def _chunks(piece: str, size: int) -> list[str]:
    """``piece`` cut after every ``size`` characters at the next single space between two
    non-space characters (the cut goes before the space, which starts the next word).
    Where a cut falls depends only on the text up to the character after it."""
    out: list[str] = []
    n = len(piece)
    start = 0
    pos = size
    find = piece.find
    while pos < n - 1:
        c = find(" ", pos, n - 1)
        if c < 0:
            break
        if piece[c - 1].isspace() or piece[c + 1].isspace():
            pos = c + 1
            continue
        out.append(piece[start:c])
        start = c
        pos = c + size
    out.append(piece[start:])
    return out
