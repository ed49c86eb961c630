"""The OpenAI-compatible routes a router relays, and what each one is keyed on.

Sans-I/O. Every route is routed by its body's ``model`` (:mod:`prefixroute.core.selection`)
and, for the prefix-aware strategies, by a key from its own input, under the same rules
as chat and completions (:mod:`prefixroute.core.keys`): :func:`keyed_view` turns a body
into the chat or completions body whose key is the route's.

=================  ===================================================================
route              routing text (its first PrefixLength characters form the key)
=================  ===================================================================
chat/completions   the rendered messages (:func:`prefixroute.core.routing_text.render_chat_text`)
completions        the prompt (the first one of a batch)
embeddings         the input (the first one of a batch); ``messages`` as chat
responses          ``instructions`` as a system message, then ``input`` (a string, or
                   items rendered as chat messages; other items as canonical JSON)
rerank             the query, then the documents in order
score              ``text_1`` (``queries``), then ``text_2`` (``documents``)
tokenize           ``messages`` as chat, else ``prompt``
detokenize         the ``tokens``
anything else      nothing: routed by model only (the strategy's keyless fallback)
=================  ===================================================================

Sources for the request shapes: the OpenAI API reference (embeddings, responses) and
vLLM's OpenAI-compatible server (``/v1/rerank`` and ``/v1/score`` with ``query`` /
``documents`` and ``text_1`` / ``text_2``, ``/tokenize`` and ``/detokenize``).
"""

from __future__ import annotations

import enum
from typing import Any, Mapping

import orjson

from prefixroute.core.routing_text import InvalidRequest, completion_prompt

__all__ = ["OpenAIRoute", "keyed_view", "scoped_model", "route_for_path", "TENANT_FIELDS"]

#: Body fields that name a tenant (:func:`prefixroute.core.keys.openai_tenant`); a view keeps them.
TENANT_FIELDS = ("prompt_cache_key", "cache_salt")


class OpenAIRoute(enum.Enum):
    """An OpenAI-compatible route: its path on the instance, whether it streams."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"
    RERANK = "/v1/rerank"
    SCORE = "/v1/score"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"
    #: Any other path under ``/v1``: relayed to an instance of the named model.
    OTHER = "/v1/*"

    @property
    def path(self) -> str:
        """The path on the instance (``OTHER``: the request's own)."""
        return self.value

    @property
    def chat(self) -> bool:
        """Whether it is ``/v1/chat/completions``."""
        return self is OpenAIRoute.CHAT

    @property
    def streams(self) -> bool:
        """Whether ``stream: true`` makes it answer with server-sent events."""
        return self in _STREAMING


_STREAMING = frozenset({OpenAIRoute.CHAT, OpenAIRoute.COMPLETIONS, OpenAIRoute.RESPONSES})
_BY_TAIL = {r.value.removeprefix("/v1"): r for r in OpenAIRoute if r.value.startswith("/v1/") and r.value != "/v1/*"}


def route_for_path(tail: str) -> OpenAIRoute | None:
    """The route of a path after its API prefix: ``/v1/embeddings`` -> ``EMBEDDINGS``,
    ``/tokenize`` -> ``TOKENIZE``, any other ``/v1/...`` -> ``OTHER``, else ``None``."""
    if tail in ("/tokenize", "/detokenize"):
        return OpenAIRoute.TOKENIZE if tail == "/tokenize" else OpenAIRoute.DETOKENIZE
    if not tail.startswith("/v1/"):
        return None
    return _BY_TAIL.get(tail[3:], OpenAIRoute.OTHER)


def _prompt_field(value: Any, field: str) -> Any:
    """``value`` checked as a completions ``prompt`` is, the error naming ``field``."""
    try:
        completion_prompt({"prompt": value})
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc).replace("'prompt'", f"'{field}'")) from None
    return value


def _base(payload: Mapping[str, Any]) -> dict[str, Any]:
    view: dict[str, Any] = {"model": payload.get("model", "")}
    for f in TENANT_FIELDS:
        if f in payload:
            view[f] = payload[f]
    return view


def _text_of(value: Any, what: str) -> str:
    """A document or query given as a string or an object with ``text`` (vLLM and the
    rerank APIs accept both); other parts as canonical JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"]
    if isinstance(value, (dict, list)):
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    raise InvalidRequest(f"{what} must be a string or an object")


def _joined(*parts: Any, what: str) -> str:
    out: list[str] = []
    for part in parts:
        if part is None:
            continue
        items = part if isinstance(part, list) else [part]
        out += [_text_of(x, what) for x in items]
    return "\n".join(out)


_RESPONSE_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _response_message(item: Any) -> dict[str, Any]:
    """One ``input`` item of a Responses request as a chat message."""
    if isinstance(item, str):
        return {"role": "user", "content": item}
    if not isinstance(item, dict):
        raise InvalidRequest("each 'input' item must be a string or an object")
    role = item.get("role")
    if isinstance(role, str) and item.get("type", "message") == "message":
        content = item.get("content")
        if isinstance(content, list):
            parts: list[Any] = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in _RESPONSE_PARTS:
                    parts.append({"type": "text", "text": part.get(_RESPONSE_PARTS[part["type"]], "")})
                elif isinstance(part, dict) and part.get("type") == "input_image":
                    parts.append({"type": "image_url", "image_url": {"url": part.get("image_url") or
                                                                     part.get("file_id") or ""}})
                else:
                    parts.append(part)
            content = parts
        return {"role": role, "content": content}
    kind = item.get("type")
    shown = {k: v for k, v in item.items() if k != "id"}  # ids are per response, not prompt
    return {"role": str(kind or "item"), "content": orjson.dumps(shown, option=orjson.OPT_SORT_KEYS).decode()}


def keyed_view(payload: Mapping[str, Any], route: OpenAIRoute) -> tuple[Mapping[str, Any] | None, bool]:
    """The chat or completions body whose routing key is ``route``'s for ``payload``:
    ``(view, chat)``; ``(None, False)`` for a route keyed on nothing (``OTHER``).
    Chat and completions bodies are returned as they are.

    Raises:
        InvalidRequest: a field the route's key needs has the wrong type.
    """
    if route is OpenAIRoute.CHAT:
        return payload, True
    if route is OpenAIRoute.COMPLETIONS:
        return payload, False
    if route is OpenAIRoute.OTHER:
        return None, False
    view = _base(payload)
    if route is OpenAIRoute.EMBEDDINGS:
        if "messages" in payload and "input" not in payload:
            view["messages"] = payload["messages"]
            return view, True
        if "input" not in payload:
            raise InvalidRequest("'input' is required")
        view["prompt"] = _prompt_field(payload["input"], "input")
        return view, False
    if route is OpenAIRoute.TOKENIZE:
        if "messages" in payload:
            view["messages"] = payload["messages"]
            return view, True
        view["prompt"] = payload.get("prompt")
        return view, False
    if route is OpenAIRoute.DETOKENIZE:
        tokens = payload.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidRequest("'tokens' must be a list of token ids")
        view["prompt"] = tokens if tokens else ""  # (vLLM takes an empty list: an empty text)
        return view, False
    if route is OpenAIRoute.RESPONSES:
        messages: list[Any] = []
        instructions = payload.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise InvalidRequest("'instructions' must be a string")
            messages.append({"role": "system", "content": instructions})
        given = payload.get("input")
        if given is None:
            raise InvalidRequest("'input' is required")
        if isinstance(given, list):
            messages += [_response_message(item) for item in given]
        else:
            messages.append(_response_message(given))
        view["messages"] = messages
        if payload.get("tools"):
            view["tools"] = payload["tools"]
        return view, True
    if route is OpenAIRoute.RERANK:
        if "query" not in payload or "documents" not in payload:
            raise InvalidRequest("'query' and 'documents' are required")
        if not isinstance(payload["documents"], list):
            raise InvalidRequest("'documents' must be a list")
        view["prompt"] = _joined(payload["query"], payload["documents"], what="'query' and each document")
        return view, False
    # SCORE: vLLM's text_1/text_2 (newer releases also take queries/documents)
    first = payload.get("text_1", payload.get("queries"))
    second = payload.get("text_2", payload.get("documents"))
    if first is None or second is None:
        raise InvalidRequest("'text_1' and 'text_2' are required")
    view["prompt"] = _joined(first, second, what="'text_1' and 'text_2'")
    return view, False


def scoped_model(view: Mapping[str, Any], component: str | None) -> Mapping[str, Any]:
    """``view`` with an inference component folded into its model, so that identical
    prompts to two components never share a routing key (a copy of the mapping when
    ``component`` is set; ``view`` itself otherwise)."""
    if not component:
        return view
    model = view.get("model", "")
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string")
    return {**view, "model": f"{model}\0inference-component={component}"}
