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
* each piece's token ids and the keys of the blocks it completes are cached under the
  chain state it starts from (the key of the last full block and the tokens after it)
  and the piece's xxh3 digest: a document, a system prompt or a conversation's history,
  repeated by later requests, is tokenized and hashed once.

Sans-I/O: a computation over a loaded tokenizer. Not thread-safe (one keyer per event
loop or process).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from prefixroute.core.kvevents.chain import block_keys, chain_root
from prefixroute.core.model_tokenizer import ModelTokenizer

__all__ = ["RequestKeyer", "DEFAULT_CACHE_PIECES"]

#: Pieces (chain state + text) whose ids and keys a keyer remembers, least recently used
#: forgotten first. A piece costs its token ids and keys: about 10 bytes a token.
DEFAULT_CACHE_PIECES = 4096


class RequestKeyer:
    """Request -> (the keys of its full KV blocks, its prompt tokens).

    Args:
        tokenizer: the model's tokenizer and chat template (the engines').
        block_size: the engines' KV block size, tokens (>= 1).
        cache_pieces: pieces remembered (0: none; every request tokenized whole).

    Raises:
        ValueError: ``block_size`` < 1 or ``cache_pieces`` < 0.
    """

    def __init__(self, tokenizer: ModelTokenizer, block_size: int, cache_pieces: int = DEFAULT_CACHE_PIECES) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if cache_pieces < 0:
            raise ValueError(f"cache_pieces must be >= 0, got {cache_pieces}")
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

    def _pieces_ids(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self._split.split(text):  # type: ignore[union-attr]
            if not piece:
                continue
            sid = self._ids.get(piece)
            out.extend([sid] if sid is not None else self.tokenizer.encode(piece, add_special_tokens=False))
        return out

    # -- requests ------------------------------------------------------------------------

    def keys(self, payload: Mapping[str, Any], chat: bool, lora_name: str | None = None) -> tuple[list[int], int]:
        """The keys of a request's full KV blocks and its prompt's token count.

        Args:
            payload: the OpenAI request (chat or completions).
            chat: ``/v1/chat/completions`` (the template applied), else completions.
            lora_name: the LoRA adapter the request runs on (``None``: the base model).
        Raises:
            prefixroute.core.keys.InvalidRequest: a request the tokenizer cannot render
                (no chat template, a malformed prompt).
        """
        tok = self.tokenizer
        root = chain_root(lora_name)
        if chat:
            text = tok.render_chat(payload)
            prefix: list[int] = []
        else:
            from prefixroute.core.keys import completion_prompt

            prompt = completion_prompt(payload)
            if not isinstance(prompt, str):  # token ids, used as given
                ids = list(prompt)
                return block_keys(ids, self.block_size, root), len(ids)
            text = prompt
            prefix = self._prefix
        if self._split is None:
            ids = tok.encode(text, add_special_tokens=not chat)
            return block_keys(ids, self.block_size, root), len(ids)
        return self._keys_of(text, prefix, root)

    def _keys_of(self, text: str, prefix: list[int], root: int) -> tuple[list[int], int]:
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
        for piece in self._split.split(text):  # type: ignore[union-attr]
            if not piece:
                continue
            pk = (digest(piece.encode("utf-8", "surrogatepass")), len(piece))
            ck = (parent, carry, *pk)
            hit = cache.get(ck)
            if hit is not None:
                cache.move_to_end(ck)
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

    def stats(self) -> dict[str, int]:
        """Pieces cached, and cache hits and misses since start."""
        return {"pieces": len(self._cache), "hits": self.hits, "misses": self.misses}
