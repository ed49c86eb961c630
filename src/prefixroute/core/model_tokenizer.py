"""A model's own tokenizer and chat template: request -> the token ids the engine computes.

Sans-I/O after loading: :meth:`ModelTokenizer.load` reads the files once (at start-up,
at the edge); every other method is a pure computation. The emulated engine
(``prefixroute emulate --tokenizer``) and the router's precise mode (``prefixroute serve
--tokenizer``) use the same class on the same files, so for the same request they get
the same token ids, which is what lets the router rebuild an engine's KV blocks from
their token ids and match requests against them.

The files are those of a Hugging Face model repository, which vLLM reads:

* ``tokenizer.json``: the ``tokenizers`` library's serialised tokenizer;
* ``tokenizer_config.json``: ``bos_token``, ``eos_token`` (strings, or objects with a
  ``content``) and ``chat_template`` (Jinja text); a ``chat_template.jinja`` file
  beside it, as newer repositories have, wins over the field.

A bundled tokenizer, ``tiny`` (a byte-level BPE of 810 tokens and a Llama 3 style
template, made by ``scripts/make_tiny_tokenizer.py``), stands in for a real model's in
tests and in the emulated fleet.

How vLLM turns a request into token ids, and so how this class does:

* chat: the template is applied (:func:`prefixroute.core.chat_template.render_chat_prompt`)
  and the text tokenized **without** special tokens (the template writes the BOS);
* completions: a string prompt is tokenized **with** special tokens (the tokenizer's
  post-processor adds the BOS); a list of token ids is used as it is.

Requires ``tokenizers`` and ``jinja2`` (the ``precise`` extra).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

from prefixroute.core.chat_template import compile_chat_template, render_chat_prompt
from prefixroute.core.routing_text import InvalidRequest, completion_prompt
from prefixroute.core.kvevents.config import BUNDLED_TOKENIZERS

__all__ = ["BUNDLED_TOKENIZERS", "OUTPUT_VOCABULARY_SIZE", "ModelTokenizer", "load_tokenizer"]

#: Distinct tokens the emulated model draws its output from (:attr:`ModelTokenizer.output_token_ids`).
OUTPUT_VOCABULARY_SIZE = 32
_EXTRA_HINT = "install the precise extra: pip install 'prefixroute[precise]'"


def _special(value: Any) -> str:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@dataclass(frozen=True, eq=False)
class ModelTokenizer:
    """One model's tokenizer and chat template.

    Attributes:
        name: where it came from (``"tiny"`` or the path given).
        tokenizer: the ``tokenizers.Tokenizer``.
        chat_template: the Jinja chat template text, ``""`` when the model has none
            (chat requests are then refused).
        bos_token: beginning-of-sequence token text (``""`` if none).
        eos_token: end-of-sequence token text (``""`` if none).
        output_token_ids: the vocabulary the emulated model generates from: up to
            :data:`OUTPUT_VOCABULARY_SIZE` ids of whole-word tokens (a byte-level ``Ġ``
            and at least two ASCII letters), lowest ids first, so that generated text
            tokenizes back to the same ids in the next turn of a conversation.
        media_tokens: 0 (a text-only model: an image, audio or file part is refused),
            or the tokens' worth of stand-in text such a part becomes (``x 4``
            characters; :func:`prefixroute.core.chat_template.chat_messages`), for an
            emulated multimodal model (``prefixroute emulate --tokenizer-media-tokens``).
    """

    name: str
    tokenizer: Any = field(repr=False)
    chat_template: str = field(default="", repr=False)
    bos_token: str = ""
    eos_token: str = ""
    output_token_ids: tuple[int, ...] = field(default=(), repr=False)
    media_tokens: int = 0

    # -- loading -----------------------------------------------------------------------

    @classmethod
    def load(cls, spec: str | Path, chat_template: str | Path | None = None) -> "ModelTokenizer":
        """Load a tokenizer by bundled name or path.

        Args:
            spec: ``"tiny"`` (bundled), a model directory holding ``tokenizer.json`` (and
                ``tokenizer_config.json``), or a ``tokenizer.json`` file.
            chat_template: a file with the Jinja chat template, replacing the model's.
        Returns:
            The :class:`ModelTokenizer`.
        Raises:
            ValueError: a file is missing or unreadable, not valid JSON, or the chat
                template does not compile. ImportError: the ``precise`` extra is missing.
        """
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ImportError(f"a model tokenizer needs the 'tokenizers' package: {_EXTRA_HINT}") from exc
        text_spec = str(spec)
        if text_spec in BUNDLED_TOKENIZERS:
            base = resources.files("prefixroute") / "data" / f"{text_spec}_tokenizer"
            tok_json = base / "tokenizer.json"
            config_file: Any = base / "tokenizer_config.json"
            template_file: Any = None
        else:
            path = Path(spec)
            if path.is_dir():
                tok_json, config_file, template_file = (path / "tokenizer.json", path / "tokenizer_config.json",
                                                        path / "chat_template.jinja")
            else:
                tok_json, config_file, template_file = path, path.with_name("tokenizer_config.json"), None
        try:
            tokenizer = Tokenizer.from_str(tok_json.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"tokenizer {text_spec!r}: cannot read {tok_json}: {exc.strerror or exc}") from None
        except Exception as exc:  # the Rust library raises its own exception type
            raise ValueError(f"tokenizer {text_spec!r}: {tok_json} is not a valid tokenizer.json: {exc}") from None
        config: dict[str, Any] = {}
        if config_file is not None and config_file.is_file():
            try:
                loaded = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"tokenizer {text_spec!r}: {config_file} is not readable JSON: {exc}") from None
            config = loaded if isinstance(loaded, dict) else {}
        template = config.get("chat_template") or ""
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template", "") for t in template if isinstance(t, dict)
                             and t.get("name") == "default"), "")
        if template_file is not None and template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        if chat_template is not None:
            try:
                template = Path(chat_template).read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"chat template {chat_template}: {exc.strerror or exc}") from None
        if template:
            compile_chat_template(template)  # a syntax error shows at start-up, not per request
        return cls(text_spec, tokenizer, template if isinstance(template, str) else "",
                   _special(config.get("bos_token")), _special(config.get("eos_token")),
                   _output_vocabulary(tokenizer))

    # -- requests ----------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's BOS if ``add_special_tokens``)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``, special tokens skipped unless ``skip_special_tokens`` is
        false (as vLLM's ``/detokenize`` decodes: a BOS shows as its text)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (``Ġworld``), ``""`` for an unknown id."""
        return [self.tokenizer.id_to_token(i) or "" for i in token_ids]

    def render_chat(self, payload: Mapping[str, Any]) -> str:
        """The prompt text of a chat request (see :mod:`prefixroute.core.chat_template`).

        Raises:
            InvalidRequest: a malformed request, or the model has no chat template.
        """
        if not self.chat_template:
            raise InvalidRequest(f"the tokenizer {self.name!r} has no chat template; use /v1/completions")
        return render_chat_prompt(self.chat_template, payload, bos_token=self.bos_token, eos_token=self.eos_token,
                                  media_chars=self.media_tokens * 4)

    def chat_token_ids(self, payload: Mapping[str, Any]) -> list[int]:
        """Token ids of a chat request: the template applied, no special tokens added."""
        return self.encode(self.render_chat(payload), add_special_tokens=False)

    def completion_token_ids(self, payload: Mapping[str, Any]) -> list[int]:
        """Token ids of a completions request: a text prompt tokenized with special
        tokens, token ids as given (a batch: its first prompt).

        Raises:
            InvalidRequest: ``prompt`` is missing or malformed.
        """
        prompt = completion_prompt(payload)
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def request_token_ids(self, payload: Mapping[str, Any], chat: bool) -> list[int]:
        """Token ids of an OpenAI request: :meth:`chat_token_ids` or :meth:`completion_token_ids`.

        Raises:
            InvalidRequest: a malformed request.
        """
        return self.chat_token_ids(payload) if chat else self.completion_token_ids(payload)

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, special ones included."""
        return int(self.tokenizer.get_vocab_size())


def _output_vocabulary(tokenizer: Any) -> tuple[int, ...]:
    vocab: dict[str, int] = tokenizer.get_vocab()
    words = sorted(i for t, i in vocab.items()
                   if t.startswith("\u0120") and len(t) >= 3 and t[1:].isascii() and t[1:].isalpha())
    if not words:  # not a byte-level tokenizer: any non-special token will do
        special = {i for t, i in vocab.items() if t.startswith("<") and t.endswith(">")}
        words = sorted(i for i in vocab.values() if i not in special)
    return tuple(words[:OUTPUT_VOCABULARY_SIZE])


def load_tokenizer(spec: str | None, chat_template: str | None = None) -> ModelTokenizer | None:
    """:meth:`ModelTokenizer.load`, or ``None`` when ``spec`` is ``None`` (the
    emulated engine's built-in 4-byte rule). Errors as :meth:`ModelTokenizer.load`."""
    if spec is None:
        return None
    return ModelTokenizer.load(spec, chat_template)
