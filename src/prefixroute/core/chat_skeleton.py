"""A chat template applied by substitution: rendered once per conversation shape.

Rendering a model's Jinja chat template costs about 25 µs a request in Python
(:func:`prefixroute.core.chat_template.render_chat_prompt`), more than the rest of
precise mode's matching for a short prompt. Most templates treat a message's content as
an opaque string placed between fixed markers (``<|start_header_id|>user<|end_header_id|>``
... ``<|eot_id|>``), so the prompt of a conversation is the template's text for its
*shape* (each message's role, whether the generation prompt is added) with the contents
put in their places. :class:`ChatSkeletons` renders a shape seen a second time with a
sentinel in place of each content (a private-use character pair that no request's
content holds), cuts the output at the sentinels and, for that request and later ones
of that shape, joins the pieces with the real contents.

What could make the two differ, and what guards it:

* a template that reads the content (splits it, searches it, tests it, measures it,
  serializes it: ``'</think>' in message.content``, ``content.split(...)``,
  ``content | length``, ``content | tojson``): such a template is found in its source
  when the keyer is made (:func:`reads_content`), and every request is rendered whole;
* a template that transforms the content's edges (``| trim``, ``.strip()``,
  ``.lstrip('\\n')``): the exact white space a content begins and ends with is part of
  the shape, and for each such content the sentinel is rendered again with that white
  space around it, which shows whether the template keeps it (substituted as it is) or
  strips it all (substituted stripped, as Python's ``str.strip`` and Jinja's ``trim``
  do); anything in between (a partial strip) renders the shape whole. A content of white
  space only, or an empty one, is rendered as itself;
* a template that repeats, drops or reorders a content: the sentinels are not each
  found once, in order, and the shape is rendered whole;
* anything else: the first use of a skeleton and every :data:`VERIFY_EVERY`-th use of
  it after are also rendered whole and compared, and a shape whose substitution ever
  differs is rendered whole from then on (counted in :attr:`ChatSkeletons.mismatches`).

A request with anything else the template reads (``tools``, ``chat_template_kwargs``,
a message field other than ``role`` and ``content``, content parts other than text, a
role over :data:`MAX_ROLE_CHARS` characters, more than :data:`MAX_MESSAGES` messages) is
rendered whole. The prompt text only steers routing (the request is forwarded as
received), so a substitution that differed would cost a worse placement, never a wrong
answer; the checks keep even that rare. A shape seen once costs one render, as before;
skeletons hold at most :data:`SKELETON_BYTES` of template text.

Sans-I/O; not thread-safe (one per event loop).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixroute.core.chat_template import render_chat_prompt
from prefixroute.core.routing_text import InvalidRequest, part_texts

if TYPE_CHECKING:
    from prefixroute.core.model_tokenizer import ModelTokenizer

__all__ = ["ChatSkeletons", "reads_content", "SKELETON_SHAPES", "SKELETON_BYTES", "VERIFY_EVERY",
           "MAX_ROLE_CHARS", "MAX_MESSAGES"]

#: Shapes remembered (seen once, or with a skeleton), least recently used forgotten first:
#: a conversation of n turns has n shapes, one per length.
SKELETON_SHAPES = 1024

#: Template text the skeletons hold, at most (characters; past it the least recently used go).
SKELETON_BYTES = 8 * 1024 * 1024

#: A skeleton's first use and every this-many-th use after are also rendered whole and
#: compared: about 0.4 µs a request of checking at 25 µs a render.
VERIFY_EVERY = 64

#: Roles longer than this (characters), and conversations of more messages, are rendered whole.
MAX_ROLE_CHARS = 64
MAX_MESSAGES = 512

#: Edge white space (characters, each end) and white-space-only contents longer than this
#: are rendered whole.
_MAX_EDGE_CHARS = 16
#: Contents with edge white space a shape may have (each costs a render when it is built).
_MAX_EDGE_SLOTS = 8

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points: the sentinels' brackets

_BAD = None  # a shape rendered whole

# What a template does with a content beyond placing it (or trimming it): a method call, an
# index or slice, a membership test, a comparison, a filter other than trim.
_CONTENT = r"""content(?:['"]\s*\])?"""
_READS_CONTENT = re.compile(
    _CONTENT + r"""\s*(?:\.\s*\w+\s*\(|\[|==|!=|<|>|\|\s*(?!trim\b)\w)"""
    r"""|\bin\s+(?:[\w.]*(?:\[\s*['"]\w+['"]\s*\])*[.\[]\s*['"]?)?content\b""")


def reads_content(template_source: str) -> bool:
    """Whether a chat template reads a message's content beyond placing it (a method call
    on it, an index or slice, ``in``, a comparison, a filter other than ``trim``): its
    requests are then rendered whole. A heuristic on the template's text, looking for
    the word ``content`` (an alias made with ``set`` is not seen; the checks are the
    backstop)."""
    return _READS_CONTENT.search(template_source) is not None


class _Skeleton:
    __slots__ = ("pieces", "strip", "uses", "size")

    def __init__(self, pieces: list[str], strip: tuple[bool, ...] | None) -> None:
        self.pieces = pieces  # the text around the sentinel contents, len = slots + 1
        self.strip = strip  # per slot: the template strips that content (None: none)
        self.uses = 0
        self.size = sum(map(len, pieces))


class ChatSkeletons:
    """A model's chat template applied by substitution (module docstring).

    Args:
        tokenizer: the model's tokenizer (its ``chat_template``, BOS and EOS texts).
        shapes: shapes remembered, at most (0: every request rendered whole).
        verify_every: a skeleton's first use and every this-many-th use after are
            checked against a whole render (0: only the first).
        max_bytes: template text held by the skeletons, at most (characters).

    Attributes:
        enabled: ``False`` when the template reads contents (:func:`reads_content`) or
            there is none: every request is rendered whole.
        hits: requests rendered by substitution.
        renders: requests rendered whole (a shape not cacheable, seen once, failed or checked).
        mismatches: checks whose substitution differed from the whole render (the
            shape is rendered whole from then on).

    Raises:
        ValueError: a negative ``shapes``, ``verify_every`` or ``max_bytes``.
    """

    def __init__(self, tokenizer: "ModelTokenizer", shapes: int = SKELETON_SHAPES, verify_every: int = VERIFY_EVERY,
                 max_bytes: int = SKELETON_BYTES) -> None:
        if shapes < 0 or verify_every < 0 or max_bytes < 0:
            raise ValueError("shapes, verify_every and max_bytes must be >= 0")
        self.tokenizer = tokenizer
        self.shapes = shapes
        self.verify_every = verify_every
        self.max_bytes = max_bytes
        self.enabled = bool(shapes and tokenizer.chat_template and not reads_content(tokenizer.chat_template))
        # shape -> skeleton, _BAD (rendered whole) or _SEEN (seen once: rendered whole)
        self._skeletons: OrderedDict[tuple, Any] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.renders = 0
        self.mismatches = 0

    def __len__(self) -> int:
        """Shapes remembered (seen once, with a skeleton, or rendered whole)."""
        return len(self._skeletons)

    def render(self, payload: Mapping[str, Any]) -> str:
        """The prompt text of a chat request, as
        :meth:`prefixroute.core.model_tokenizer.ModelTokenizer.render_chat` gives it.

        Raises:
            prefixroute.core.routing_text.InvalidRequest: as ``render_chat`` (a
                malformed request, a model without a chat template).
        """
        tok = self.tokenizer
        shaped = _shape(payload) if self.enabled else None
        if shaped is None:
            self.renders += 1
            return tok.render_chat(payload)
        shape, contents = shaped
        skeletons = self._skeletons
        sk = skeletons.get(shape, _UNSEEN)
        if sk is _UNSEEN:  # seen once: rendered whole, remembered
            self._remember(shape, _SEEN)
            self.renders += 1
            return tok.render_chat(payload)
        skeletons.move_to_end(shape)
        if sk is _SEEN:  # seen twice: worth a skeleton
            sk = self._build(shape)
            self._remember(shape, sk)
        if sk is _BAD:
            self.renders += 1
            return tok.render_chat(payload)
        pieces, strip = sk.pieces, sk.strip
        parts = [pieces[0]]
        i = 1
        for c, (_, kind, _, _) in zip(contents, shape[1]):
            if kind == _SLOT:
                parts.append(c.strip() if strip is not None and strip[i - 1] else c)
                parts.append(pieces[i])
                i += 1
        text = "".join(parts)
        uses = sk.uses
        sk.uses = uses + 1
        if uses == 0 or (self.verify_every and uses % self.verify_every == 0):
            self.renders += 1
            whole = tok.render_chat(payload)
            if whole != text:
                self.mismatches += 1
                self._remember(shape, _BAD)
            return whole
        self.hits += 1
        return text

    def _remember(self, shape: tuple, value: Any) -> None:
        skeletons = self._skeletons
        old = skeletons.get(shape)
        if isinstance(old, _Skeleton):
            self._bytes -= old.size
        skeletons[shape] = value
        if isinstance(value, _Skeleton):
            self._bytes += value.size
        while skeletons and (len(skeletons) > self.shapes or self._bytes > self.max_bytes):
            _, gone = skeletons.popitem(last=False)
            if isinstance(gone, _Skeleton):
                self._bytes -= gone.size

    def _build(self, shape: tuple) -> _Skeleton | None:
        """Render ``shape`` with sentinels and cut it at them; ``None`` when they are not
        each found once, in order, or a content's edge white space is neither kept nor
        stripped whole (or the template refuses the shape)."""
        plain = self._pieces(shape, -1)
        if plain is None:
            return _BAD
        strip: list[bool] = []
        slot = 0
        for k, (_, kind, lead, trail) in enumerate(shape[1]):
            if kind != _SLOT:
                continue
            if lead or trail:
                # Rendered again with this content's own edge white space around its
                # sentinel: kept as it is, or stripped whole, or the shape is rendered whole.
                padded = self._pieces(shape, k)
                if padded is None:
                    return _BAD
                kept = list(plain)
                kept[slot] += lead
                kept[slot + 1] = trail + kept[slot + 1]
                if padded == kept:
                    strip.append(False)
                elif padded == plain:
                    strip.append(True)
                else:
                    return _BAD
            else:
                strip.append(False)
            slot += 1
        return _Skeleton(plain, tuple(strip) if any(strip) else None)

    def _pieces(self, shape: tuple, padded: int) -> list[str] | None:
        """The template's text for ``shape`` cut at the contents' sentinels (message
        ``padded``'s with its edge white space around it); ``None`` when the sentinels
        are not each found once, in order."""
        tok = self.tokenizer
        add_generation_prompt, roles = shape
        messages = []
        sentinels = []
        for k, (role, kind, lead, trail) in enumerate(roles):
            if kind != _SLOT:
                messages.append({"role": role, "content": lead})  # (empty, or white space only: as itself)
                continue
            s = f"{_OPEN}{len(sentinels)}{_CLOSE}"
            sentinels.append(s)
            messages.append({"role": role, "content": f"{lead}{s}{trail}" if k == padded else s})
        try:
            text = render_chat_prompt(tok.chat_template, {"messages": messages,
                                                         "add_generation_prompt": add_generation_prompt},
                                      bos_token=tok.bos_token, eos_token=tok.eos_token)
        except ValueError:  # (InvalidRequest: the template refuses this shape; the whole render says why)
            return None
        if text.count(_OPEN) != len(sentinels) or len(text) > _MAX_SKELETON_CHARS:
            return None  # a sentinel repeated or dropped; a template that makes too much text
        pieces = []
        at = 0
        for s in sentinels:
            j = text.find(s, at)
            if j < 0:
                return None  # reordered
            pieces.append(text[at:j])
            at = j + len(s)
        pieces.append(text[at:])
        return pieces

    def stats(self) -> dict[str, int]:
        """``{"shapes", "hits", "renders", "mismatches"}`` since start."""
        return {"shapes": len(self._skeletons), "hits": self.hits, "renders": self.renders,
                "mismatches": self.mismatches}


_UNSEEN = object()
_SEEN = object()
_SLOT, _LITERAL = 0, 1  # a content substituted, or rendered as itself (empty, white space only)
#: One skeleton's template text, at most (characters).
_MAX_SKELETON_CHARS = 256 * 1024


def _shape(payload: Mapping[str, Any]) -> tuple[tuple, list[str]] | None:
    """``((add_generation_prompt, ((role, kind, lead, trail), ...)), contents)`` of a
    request the skeletons can render, else ``None`` (rendered whole: which also raises
    the errors of a malformed request). ``lead`` and ``trail``: a substituted content's
    edge white space; a literal content's text in ``lead``."""
    if payload.get("tools") or payload.get("chat_template_kwargs"):
        return None
    agp = payload.get("add_generation_prompt", True)
    if agp is not True and agp is not False:
        return None
    messages = payload.get("messages")
    if type(messages) is not list or not messages or len(messages) > MAX_MESSAGES:
        return None
    roles = []
    contents = []
    edges = 0
    for m in messages:
        if type(m) is not dict or len(m) != 2:
            return None
        role = m.get("role")
        c = m.get("content")
        if type(role) is not str or len(role) > MAX_ROLE_CHARS or _OPEN in role:
            return None
        if type(c) is not str:
            if type(c) is not list:
                return None
            c = _text_parts(c)
            if c is None:
                return None
        if _OPEN in c or _CLOSE in c:
            return None
        core = c.strip()
        if not core:  # empty or white space only: rendered as itself
            if len(c) > _MAX_EDGE_CHARS:
                return None
            roles.append((role, _LITERAL, c, ""))
        elif len(core) == len(c):
            roles.append((role, _SLOT, "", ""))
        else:
            start = len(c) - len(c.lstrip())
            lead, trail = c[:start], c[start + len(core):]
            edges += 1
            if len(lead) > _MAX_EDGE_CHARS or len(trail) > _MAX_EDGE_CHARS or edges > _MAX_EDGE_SLOTS:
                return None
            roles.append((role, _SLOT, lead, trail))
        contents.append(c)
    return (agp, tuple(roles)), contents


class _NotText(Exception):
    pass


def _not_text(part: Mapping[str, Any]) -> str:
    raise _NotText


def _text_parts(parts: list[Any]) -> str | None:
    """Text parts joined as the template sees them (``"\\n"``, as
    :func:`prefixroute.core.chat_template.chat_messages` joins them), or ``None`` when a
    part is not text or is malformed (rendered whole: refused, or given its media
    stand-in, there)."""
    try:
        return "\n".join(part_texts(parts, _not_text))
    except (_NotText, InvalidRequest):
        return None
