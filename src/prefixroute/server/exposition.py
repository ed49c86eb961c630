"""The samples of a Prometheus text exposition, read fast when the lines are plain.

:func:`samples` gives ``(name, labels, value)`` for every sample line of a page, as
``prometheus_client``'s parser (``text_string_to_metric_families``) reads them, in less
time: :func:`prefixroute.server.scrape.parse_engine_metrics` as a whole takes 2.3x less
on a page of the families it reads and 1.7x less on a vLLM-sized page
(``python bench/scrape_parse.py``, docs/PERFORMANCE.md), and every router replica reads
every engine's page twice a second in the benchmarks.

Only the common form is read here: a metric name, label
pairs ``name="value"`` separated by commas (``\\\\``, ``\\"`` and ``\\n`` escapes),
a value and an optional timestamp separated by spaces; ``# HELP`` and ``# TYPE`` lines
with an unquoted name. Anything else on the page (a quoted metric name, a tab, a
duplicate label, an OpenMetrics exemplar, a value the parser would refuse) sends the
whole page to ``prometheus_client``, which reads it or raises ``ValueError`` as it
always did.

One difference is kept on purpose: that parser renames the samples of a ``counter``
family declared without the ``_total`` suffix (``x`` becomes ``x_total``); here names
are as written. :func:`prefixroute.server.scrape.parse_engine_metrics` removes the
suffix from every name it reads, so both give it the same figures (tested), but for
``vllm:lora_requests_info`` declared a counter (vLLM declares it a gauge): read here, its
renamed sample was not found through the parser.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["samples"]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_PAIR = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
_SAMPLE = re.compile(rf"({_NAME})(?:\{{((?:{_PAIR}(?:,{_PAIR})*)?)\}})? +([^ ]+)(?: +([^ ]+))?")
_PAIRS = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_COMMENT = re.compile(rf"# +(?:HELP|TYPE) +{_NAME}(?: .*)?|#(?! *(?:HELP|TYPE)(?: |$)).*")
_TYPE = re.compile(rf"# +TYPE +{_NAME} +[^ ]+.*")
_HELP = re.compile(rf"# +HELP +{_NAME}(?: .*)?")
_ESCAPE = re.compile(r'\\[\\n"]')
_ESCAPES = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}

Sample = tuple[str, dict[str, str], float]


def _number(text: str) -> float | None:
    """A value as the parser reads one (``int``, else ``float``; no ``_``), or None."""
    if "_" in text:
        return None
    try:
        whole = int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None
    try:
        return float(whole)
    except OverflowError:  # (an int beyond a float: the parser's path decides)
        return None


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(0)], value) if "\\" in value else value


def _plain(lines: list[str]) -> list[Sample] | None:
    """Every sample of ``lines`` in the common form, or None at the first line that is not."""
    out: list[Sample] = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        if "\t" in line:
            return None
        if line[0] == "#":
            # The parser splits a comment at any white space and reads HELP or TYPE as its
            # second word: anything but the plain forms (quotes, other white space, a word
            # glued to the #) is its to read.
            if '"' in line or not line.isascii() or not _COMMENT.fullmatch(line):
                return None
            parts = line.split(None, 3)
            if len(parts) >= 2 and parts[1] in ("HELP", "TYPE") and not (
                    parts[0] == "#" and (_HELP if parts[1] == "HELP" else _TYPE).fullmatch(line)):
                return None  # (e.g. a TYPE line without a type: the parser raises)
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            return None
        name, pairs, value_text, stamp = m.groups()
        value = _number(value_text)
        if value is None or (stamp is not None and _number(stamp) is None):
            return None
        labels: dict[str, str] = {}
        if pairs:
            found = _PAIRS.findall(pairs)
            for key, raw in found:
                labels[key] = _unescape(raw)
            if len(labels) != len(found) or any(key.startswith("__") for key in labels):
                return None  # (a duplicate or a reserved name: the parser's verdict)
        out.append((name, labels, value))
    return out


def samples(text: str) -> list[Sample]:
    """``(name, labels, value)`` of every sample of the exposition ``text``, in order.

    Raises:
        ValueError: ``text`` is not valid exposition format (``prometheus_client``'s
            verdict).
    """
    plain = _plain(text.split("\n"))  # (lines end at a newline alone, as the parser reads them)
    if plain is not None:
        return plain
    return [(s.name, dict(s.labels), float(s.value)) for family in text_string_to_metric_families(text)
            for s in family.samples]
