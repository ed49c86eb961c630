"""Configuration errors: :class:`ConfigError` and the formatting of pydantic's
validation errors into one readable message (``path.to.Field: problem`` clauses, capped
at :data:`MAX_ERROR_CLAUSES`; a YAML file's line numbers added). Re-exported by
:mod:`prefixroute.core.config`."""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel, ValidationError

__all__ = ["ConfigError", "MAX_ERROR_CLAUSES", "format_validation_error", "parse_model"]


class ConfigError(ValueError):
    """Invalid configuration; the message names the field, the value and what is allowed."""


#: Problems a configuration error names (:func:`format_validation_error`); the rest are
#: counted. A list of 10,000 wrong items would otherwise make a message of 10,000
#: clauses, logged whole on a reload.
MAX_ERROR_CLAUSES = 10


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with ``...``
    (a huge value, repeated in a YAML file by aliases, must not be quoted whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dupes(items: Sequence[Any]) -> str:
    """The repeated ones of ``items``, at most ten, for an error message (a list of
    10,000 instances with one repeat must not be quoted whole)."""
    seen: set[Any] = set()
    repeated: list[Any] = []
    for x in items:
        if x in seen and x not in repeated:
            repeated.append(x)
        seen.add(x)
    shown = ", ".join(_shown(x, 80) for x in repeated[:10])
    return shown + (f" (and {len(repeated) - 10:,} more)" if len(repeated) > 10 else "")


def _with_lines(message: str, text: str, source: str) -> str:
    """``message`` (clauses ``path.to.Field: problem`` joined by ``; ``) with the file
    named and each clause's line in it (the line of the deepest part of its path found
    in the YAML document), e.g. ``fleet.yaml line 9: Endpoints.0...: problem``."""
    import yaml

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        root = None
    clauses = message.split("; ")
    out = []
    for clause in clauses:
        path, sep, _ = clause.partition(": ")
        node = root
        line = node.start_mark.line + 1 if node is not None and sep else None
        for part in path.split(".") if sep else ():
            child = None
            if isinstance(node, yaml.MappingNode):
                child = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
            elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
                child = node.value[int(part)]
            if child is None:
                break
            node = child
            line = node.start_mark.line + 1
        out.append(f"line {line}: {clause}" if line is not None else clause)
    return f"{source} " + "; ".join(out) if out and out[0].startswith("line ") else f"{source}: " + "; ".join(out)


def format_validation_error(exc: ValidationError, root: str = "") -> str:
    """One clause per problem, ``path.to.Field: message``, joined by ``; ``; at most
    :data:`MAX_ERROR_CLAUSES`, then ``... and N more problems``."""
    errors = exc.errors()
    locs = [tuple(str(p) for p in e.get("loc", ())) for e in errors]
    lines = []
    for err, loc in zip(errors, locs):
        kind = err.get("type")
        # pydantic also reports a container as too short when its items failed; the
        # item errors are the useful ones.
        if kind == "too_short" and any(o[: len(loc)] == loc and len(o) > len(loc) for o in locs):
            continue
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        parts = list(loc)
        if kind == "value_error":
            # Our validators' messages start with the qualified field name
            # ("PrefixAwareRoutingConfig.PrefixLength: ..."); keep only the path above it.
            qualifier = msg.split(":", 1)[0].split(".") if ":" in msg else []
            if qualifier and parts[-len(qualifier):] == qualifier:
                parts = parts[: -len(qualifier)]
            elif qualifier and parts and parts[-1] == qualifier[-1]:
                parts = parts[:-1]
        elif kind == "missing":
            msg = "is required"
        elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long"):
            msg = f"{msg} (got {_shown(err.get('input'))})"
        elif kind in ("model_type", "dict_type", "model_attributes_type", "tuple_type", "list_type"):
            expected = "a list" if kind in ("tuple_type", "list_type") else "a mapping"
            msg = f"must be {expected} (got {type(err.get('input')).__name__} {_shown(err.get('input'))})"
        elif kind == "extra_forbidden":
            msg = f"is not a known setting (value {_shown(err.get('input'))})"
        path = ".".join(p for p in (root, *parts) if p)
        if kind == "value_error":
            lines.append(f"{path}.{msg}" if path and ":" in msg else (f"{path}: {msg}" if path else msg))
        else:
            lines.append(f"{path}: {msg}" if path else msg)
    if len(lines) > MAX_ERROR_CLAUSES:
        more = len(lines) - MAX_ERROR_CLAUSES
        lines = [*lines[:MAX_ERROR_CLAUSES], f"... and {more:,} more problem{'s' if more > 1 else ''}"]
    return "; ".join(lines)


def parse_model(cls: type[BaseModel], data: Any, root: str = "") -> Any:
    """``cls.model_validate(data)`` with :class:`ConfigError` instead of pydantic's error."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, root)) from None
