"""A chat template applied by substitution: rendered once per conversation shape.

Rendering a model's Jinja chat template costs about 25 µs a request in Python
(:func:`prefixroute.core.chat_template.render_chat_prompt`), more than the rest of
precise mode's matching for a short prompt. Most templates treat a message's content as
an opaque string placed between fixed markers (``<|start_header_id|>user<|end_header_id|>``
... ``<|eot_id|>``), so the prompt of a conversation is the template's text for its
*shape* (each message's role, whether the generation prompt is added) with the contents
put in their places. :class:`ChatSkeletons` renders each shape once with a sentinel in
place of each content (a private-use character pair that no request's content holds),
cuts the output at the sentinels and, for later requests of that shape, joins the pieces
with the real contents.

What could make the two differ, and what guards it:

* a template that transforms the content: whether a content begins or ends with white
  space is part of the shape, and for such a shape the sentinels are rendered again with
  white space of several kinds on each side, which shows whether the template keeps the
  content as it is or strips it (``| trim``, ``.strip()``: the content is then stripped
  as Python strips it, as Jinja's ``trim`` does) or does something else (the shape is
  rendered whole); any other transformation is caught by the check below;
* a template that reads the content (``startswith('<think>')``, its length, an empty
  content): an empty content is part of the shape (it is rendered as itself); any
  other dependence is caught by the check: the first :data:`VERIFY_FIRST` uses of a
  shape and every :data:`VERIFY_EVERY`-th use after are also rendered whole and
  compared, and a shape whose substitution ever differs is rendered whole from then on
  (counted in :attr:`ChatSkeletons.mismatches`);
* a template that repeats, drops or reorders a content: the sentinels are not each
  found once, in order, and the shape is rendered whole.

A request with anything else the template reads (``tools``, ``chat_template_kwargs``,
a message field other than ``role`` and ``content``, content parts other than text) is
rendered whole. The prompt text only steers routing (the request is forwarded as
received), so a substitution that differed would cost a worse placement, never a wrong
answer; the checks keep even that rare.

Sans-I/O; not thread-safe (one per event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixroute.core.chat_template import render_chat_prompt

if TYPE_CHECKING:
    from prefixroute.core.model_tokenizer import ModelTokenizer

__all__ = ["ChatSkeletons", "SKELETON_SHAPES", "VERIFY_FIRST", "VERIFY_EVERY"]

#: Shapes whose skeleton is kept (least recently used forgotten first): a conversation
#: of n turns has n shapes, one per length. A skeleton is the template's fixed text
#: (a few hundred bytes).
SKELETON_SHAPES = 1024

#: Uses of a new shape's skeleton that are also rendered whole and compared.
VERIFY_FIRST = 2

#: After those, one use in this many (over all shapes) is rendered whole and compared:
#: about 0.4 µs a request of checking at 25 µs a render.
VERIFY_EVERY = 64

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points: the sentinels' brackets
# white space of several kinds (a partial strip, such as ``trim(' ')``, shows)
_PAD_BEFORE, _PAD_AFTER = " \t\n\u3000", "\u3000\n\t "

_BAD = None  # a shape rendered whole


class _Skeleton:
    __slots__ = ("pieces", "strip", "uses")

    def __init__(self, pieces: list[str], strip: tuple[bool, ...] | None = None) -> None:
        self.pieces = pieces  # the text around the non-empty contents, len = slots + 1
        self.strip = strip  # per slot: the template strips that content (None: none)
        self.uses = 0


class ChatSkeletons:
    """A model's chat template applied by substitution (module docstring).

    Args:
        tokenizer: the model's tokenizer (its ``chat_template``, BOS and EOS texts and
            ``media_tokens``).
        shapes: skeletons kept, at most.
        verify_first: uses of a new skeleton checked against a whole render.
        verify_every: after those, one use in this many is checked (0: never).

    Attributes:
        hits: requests rendered by substitution.
        renders: requests rendered whole (a shape not cacheable, new, failed or checked).
        mismatches: checks whose substitution differed from the whole render (the
            shape is rendered whole from then on).
    """

    def __init__(self, tokenizer: "ModelTokenizer", shapes: int = SKELETON_SHAPES, verify_first: int = VERIFY_FIRST,
                 verify_every: int = VERIFY_EVERY) -> None:
        if shapes < 0 or verify_first < 0 or verify_every < 0:
            raise ValueError("shapes, verify_first and verify_every must be >= 0")
        self.tokenizer = tokenizer
        self.shapes = shapes
        self.verify_first = verify_first
        self.verify_every = verify_every
        self._skeletons: OrderedDict[tuple, _Skeleton | None] = OrderedDict()
        self._since_check = 0
        self.hits = 0
        self.renders = 0
        self.mismatches = 0

    def __len__(self) -> int:
        """Shapes known (with a skeleton, or rendered whole)."""
        return len(self._skeletons)

    def render(self, payload: Mapping[str, Any]) -> str:
        """The prompt text of a chat request, as
        :meth:`prefixroute.core.model_tokenizer.ModelTokenizer.render_chat` gives it.

        Raises:
            prefixroute.core.routing_text.InvalidRequest: as ``render_chat`` (a
                malformed request, a model without a chat template).
        """
        tok = self.tokenizer
        shaped = _shape(payload) if self.shapes and tok.chat_template else None
        if shaped is None:
            self.renders += 1
            return tok.render_chat(payload)
        shape, contents = shaped
        skeletons = self._skeletons
        if shape in skeletons:
            sk = skeletons[shape]
            skeletons.move_to_end(shape)
        else:
            sk = skeletons[shape] = self._build(shape)
            if len(skeletons) > self.shapes:
                skeletons.popitem(last=False)
        if sk is None:
            self.renders += 1
            return tok.render_chat(payload)
        pieces, strip = sk.pieces, sk.strip
        parts = [pieces[0]]
        i = 1
        for c in contents:
            if c:
                parts.append(c.strip() if strip is not None and strip[i - 1] else c)
                parts.append(pieces[i])
                i += 1
        text = "".join(parts)
        sk.uses += 1
        self._since_check += 1
        if sk.uses <= self.verify_first or (self.verify_every and self._since_check >= self.verify_every):
            self._since_check = 0
            self.renders += 1
            whole = tok.render_chat(payload)
            if whole != text:
                self.mismatches += 1
                skeletons[shape] = _BAD
            return whole
        self.hits += 1
        return text

    def _build(self, shape: tuple) -> _Skeleton | None:
        """Render ``shape`` with sentinels and cut it at them; ``None`` when they are not
        each found once, in order, or an edge-spaced content's white space is neither
        kept nor stripped (or the template refuses the shape)."""
        roles = shape[1]
        pieces = self._pieces(shape, False)
        if pieces is None or not any(kind == _EDGE_SPACE for _, kind in roles):
            return _Skeleton(pieces) if pieces is not None else _BAD
        # Rendered again with white space of several kinds around each sentinel: where the
        # template keeps it, the pieces around a slot are the plain ones with it; where
        # it strips the content, they are the plain ones.
        padded = self._pieces(shape, True)
        if padded is None or len(padded) != len(pieces):
            return _BAD
        strip = []
        slot = 0
        for _, kind in roles:
            if kind == _EMPTY:
                continue
            if kind == _EDGE_SPACE:
                kept = padded[slot].endswith(_PAD_BEFORE) and padded[slot + 1].startswith(_PAD_AFTER)
                if kept:
                    padded[slot] = padded[slot][:-len(_PAD_BEFORE)]
                    padded[slot + 1] = padded[slot + 1][len(_PAD_AFTER):]
                strip.append(not kept)
            else:
                strip.append(False)
            slot += 1
        if padded != pieces:
            return _BAD
        return _Skeleton(pieces, tuple(strip) if any(strip) else None)

    def _pieces(self, shape: tuple, padded: bool) -> list[str] | None:
        """The template's text for ``shape`` cut at the contents' sentinels (an
        edge-spaced one with :data:`_PAD_BEFORE` and :data:`_PAD_AFTER` around it when
        ``padded``); ``None`` when the sentinels are not each found once, in order."""
        tok = self.tokenizer
        add_generation_prompt, roles = shape
        messages = []
        sentinels = []
        for role, kind in roles:
            if kind == _EMPTY:
                messages.append({"role": role, "content": ""})
            else:
                s = f"{_OPEN}{len(sentinels)}{_CLOSE}"
                sentinels.append(s)
                pad = padded and kind == _EDGE_SPACE
                messages.append({"role": role, "content": f"{_PAD_BEFORE}{s}{_PAD_AFTER}" if pad else s})
        try:
            text = render_chat_prompt(tok.chat_template, {"messages": messages,
                                                         "add_generation_prompt": add_generation_prompt},
                                      bos_token=tok.bos_token, eos_token=tok.eos_token)
        except ValueError:  # (InvalidRequest: the template refuses this shape; the whole render says why)
            return None
        if text.count(_OPEN) != len(sentinels):
            return None  # a sentinel repeated or dropped
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


_PLAIN, _EDGE_SPACE, _EMPTY = 0, 1, 2  # a content's kind in a shape


def _shape(payload: Mapping[str, Any]) -> tuple[tuple, list[str]] | None:
    """``((add_generation_prompt, ((role, kind), ...)), contents)`` of a request the
    skeletons can render, else ``None`` (rendered whole: which also raises the errors
    of a malformed request)."""
    if payload.get("tools") or payload.get("chat_template_kwargs"):
        return None
    agp = payload.get("add_generation_prompt", True)
    if agp is not True and agp is not False:
        return None
    messages = payload.get("messages")
    if type(messages) is not list or not messages:
        return None
    roles = []
    contents = []
    for m in messages:
        if type(m) is not dict or len(m) != 2:
            return None
        role = m.get("role")
        c = m.get("content")
        if type(role) is not str:
            return None
        if type(c) is not str:
            if type(c) is not list:
                return None
            c = _text_parts(c)
            if c is None:
                return None
        if not c:
            kind = _EMPTY
        elif _OPEN in c or _CLOSE in c:
            return None
        else:
            kind = _EDGE_SPACE if c[0].isspace() or c[-1].isspace() else _PLAIN
        roles.append((role, kind))
        contents.append(c)
    return (agp, tuple(roles)), contents


def _text_parts(parts: list[Any]) -> str | None:
    """Text parts joined as the template sees them (``"\\n"``), or ``None`` when a part is
    not text (rendered whole: refused or given its media stand-in there)."""
    out = []
    for p in parts:
        if type(p) is str:
            out.append(p)
        elif type(p) is dict and p.get("type") == "text" and type(p.get("text")) is str:
            out.append(p["text"])
        else:
            return None
    return "\n".join(out)
