"""Trace replay: Mooncake traces and prefixroute's own request traces.

Two JSONL formats, one request per line, detected from the first line:

**Mooncake** (Qin et al., "Mooncake: A KVCache-centric Disaggregated Architecture for LLM
Serving", FAST 2025; traces published with the paper)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` is milliseconds since the first request; lengths are tokens; ``hash_ids``
name successive 512-token blocks of the prompt (the last one may be partial), and two
requests share leading ids exactly as far as their prompts share a prefix.

**prefixroute** (written by ``prefixroute serve --record-trace PATH``,
:mod:`prefixroute.server.trace`)::

    {"format": "prefixroute-trace/2", "timestamp": 1718000000.123, "endpoint": "default",
     "variant": "AllTraffic", "api": "openai-chat", "scope": "meta-llama/Llama-3.1-70B-Instruct",
     "tenant": "", "instance": "http://10.0.0.5:8000", "decision": "affinity",
     "unit": "chars", "length": 32114, "block": 64, "digests": "base64...", "max_tokens": 16}

``timestamp`` is Unix seconds at arrival; ``length`` is the routing text's length in
``unit`` (characters of the text the OpenAI API keys on, bytes of a native body, token
ids of a token prompt); ``digests`` are **chained** xxh3-64 digests of successive
``block``-unit blocks of that text (the last may be partial), packed as 8-byte
little-endian integers and base64-encoded (about 0.17 bytes of trace per character of
routing text): digest ``i`` covers blocks ``0..i``, so two requests share digest ``i``
exactly when their first ``64 (i + 1)`` characters are equal. Version 1 lines, still
read, had the same digests as a list of 16-hex-digit strings under ``blocks`` (twice
the size). ``tenant`` is a digest of the tenant id ("" for none). No prompt text is ever
stored.

Replay in the simulator (:class:`TraceWorkload`): every record is a one-turn session at
its recorded time. What is exact and what is approximated:

* routing keys for a ``PrefixLength`` that is a multiple of 64 characters (prefixroute)
  or of 2,048 characters = 512 tokens (Mooncake) are exact; other lengths are rounded
  up to the end of their block (requests that differ after the cut but inside that
  block get different keys);
* engine KV blocks of 16 tokens are exact for prefixroute traces of text (64 characters
  = 16 tokens of the emulated tokenizer) and for Mooncake (512 = 32 × 16); the
  characters of the engine's chat template after the routing text are not modelled;
* a trace records prompts, not answers: a conversation's next turn contains the previous
  answer, which the replayed engine generated as synthetic blocks, so those blocks miss
  (the real engine would hit them). Multi-turn hit rates are therefore a lower bound.
"""

from __future__ import annotations

import array
import base64
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import orjson
import xxhash

from prefixroute.engine.core import HashedPrompt
from prefixroute.workloads.session import Session, Turn

__all__ = [
    "TRACE_FORMAT",
    "TRACE_BLOCK",
    "MOONCAKE_BLOCK_TOKENS",
    "TraceError",
    "chained_block_digests",
    "pack_digests",
    "unpack_digests",
    "make_trace_record",
    "TraceRecord",
    "TraceWorkload",
    "load_trace",
]

#: The ``format`` field of prefixroute trace lines.
TRACE_FORMAT = "prefixroute-trace/2"
#: Units (characters, bytes or token ids) per digested block of a prefixroute trace.
TRACE_BLOCK = 64
#: Tokens per ``hash_ids`` block of a Mooncake trace.
MOONCAKE_BLOCK_TOKENS = 512
#: Characters per token when a PrefixLength (characters) is applied to a token trace.
_CHARS_PER_TOKEN = 4
_TRACE_SEED = 0x7472_6163_65  # "trace": seed of the first block's digest
_MOONCAKE_SEED = 0x6D6F_6F6E_6361_6B65  # "mooncake"
_KEY_SEED = 0x7072_6566_6978
_MIX = 0x9E37_79B9_7F4A_7C15  # 2^64 / golden ratio: spreads block indices over 64 bits
_MASK = (1 << 64) - 1
_GENERATION_CHARS = len("<|assistant|>\n")  # the emulated engine's chat generation prompt
_digest = xxhash.xxh3_64_intdigest


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


def chained_block_digests(data: bytes | str, block: int = TRACE_BLOCK) -> list[int]:
    """Chained xxh3-64 digests of successive ``block``-unit blocks of ``data``.

    ``str`` is cut in characters (each block UTF-8 encoded), ``bytes`` in bytes. Digest
    ``i`` = ``xxh3_64(block_i, seed=digest_{i-1})`` (seed of block 0: a fixed constant),
    so it identifies the whole prefix up to block ``i``. Empty data gives ``[]``.
    """
    out: list[int] = []
    h = _TRACE_SEED
    for start in range(0, len(data), block):
        chunk = data[start : start + block]
        h = _digest(chunk.encode("utf-8", "surrogatepass") if isinstance(chunk, str) else chunk, h)
        out.append(h)
    return out


def pack_digests(digests: Sequence[int]) -> str:
    """``digests`` (64-bit) as base64 of 8-byte little-endian integers (version 2 lines)."""
    return base64.b64encode(b"".join(d.to_bytes(8, "little") for d in digests)).decode("ascii")


def unpack_digests(text: str) -> array.array:
    """The inverse of :func:`pack_digests`. Raises ``ValueError`` if ``text`` is not
    base64 of a whole number of 8-byte integers."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 8:
        raise ValueError(f"digests: {len(raw)} bytes is not a whole number of 8-byte digests")
    out = array.array("Q")
    out.frombytes(raw)
    if sys.byteorder == "big":
        out.byteswap()
    return out


def make_trace_record(
    *, timestamp: float, endpoint: str, variant: str, api: str, scope: str, tenant: str,
    instance: str, decision: str, routing_data: bytes | str | Sequence[int], max_tokens: int | None,
) -> dict[str, Any]:
    """One prefixroute trace line as a dict (the recorder serialises it with orjson).

    Args:
        timestamp: Unix seconds at arrival.
        endpoint, variant: names of the endpoint and production variant.
        api: ``openai-chat``, ``openai-completions`` or ``native``.
        scope: what scopes the key besides the tenant (the model; the endpoint name on
            the native API).
        tenant: the tenant id or "" (stored as a digest).
        instance, decision: where the router sent it and why ("" if it never got there).
        routing_data: the text the key is cut from (characters), the raw body (bytes)
            or the token ids of a token prompt.
        max_tokens: the request's ``max_tokens``/``max_completion_tokens``, or None.
    """
    if isinstance(routing_data, str):
        unit, data = "chars", routing_data
    elif isinstance(routing_data, (bytes, bytearray)):
        unit, data = "bytes", bytes(routing_data)
    else:
        unit = "tokens"
        data = b"".join((t & _MASK).to_bytes(8, "little") for t in routing_data)
    block = TRACE_BLOCK * (8 if unit == "tokens" else 1)  # 64 token ids of 8 bytes each
    return {
        "format": TRACE_FORMAT,
        "timestamp": round(timestamp, 6),
        "endpoint": endpoint,
        "variant": variant,
        "api": api,
        "scope": scope,
        "tenant": f"{_digest(tenant.encode()):016x}" if tenant else "",
        "instance": instance,
        "decision": decision,
        "unit": unit,
        "length": len(routing_data),
        "block": TRACE_BLOCK,
        "digests": pack_digests(chained_block_digests(data, block)),
        "max_tokens": max_tokens,
    }


# -- prompts ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _DigestPrompt:
    """A prefixroute trace record's prompt: chained digests of 64-unit blocks."""

    num_tokens: int
    length: int  # in units (characters, bytes or token ids)
    digests: array.array
    scope: str
    tenant: str
    units_per_token: int = _CHARS_PER_TOKEN  # 1 for token-id prompts

    @property
    def routing_units(self) -> int:
        return self.length

    @property
    def token_ids(self) -> bool:
        return self.units_per_token == 1

    def engine_prompt(self, block_tokens: int) -> HashedPrompt:
        d = self.digests
        units = block_tokens * self.units_per_token
        want = self.num_tokens // block_tokens
        full = min(self.length // units, want)
        if units % TRACE_BLOCK == 0:
            m = units // TRACE_BLOCK
            hashes = [d[(j + 1) * m - 1] for j in range(full)]
        else:  # approximate: the digest of the 64-unit block holding the engine block's end
            hashes = []
            for j in range(full):
                i = ((j + 1) * units) // TRACE_BLOCK - 1
                hashes.append(((d[i] if i >= 0 else _TRACE_SEED) ^ ((j + 1) * _MIX)) & _MASK)
        # Blocks past the routing text (the chat template's generation prompt): the last
        # digest covers the text's tail, so it identifies them.
        tail = d[-1] if len(d) else _TRACE_SEED
        hashes += [((tail ^ ((j + 1) * _MIX)) & _MASK) ^ _TRACE_SEED for j in range(full, want)]
        return HashedPrompt(self.num_tokens, hashes, d[-1] if len(d) else 0)

    def routing_key(self, prefix_length: int) -> int:
        d = self.digests
        if not len(d):
            tail = 0
        elif prefix_length >= self.length:
            tail = d[-1]
        else:
            tail = d[math.ceil(prefix_length / TRACE_BLOCK) - 1]
        data = b"".join((self.scope.encode(), b"\0", self.tenant.encode(), b"\0", tail.to_bytes(8, "little")))
        return _digest(data, _KEY_SEED)


@dataclass(frozen=True, slots=True)
class _MooncakePrompt:
    """A Mooncake record's prompt: chained ids of 512-token blocks."""

    num_tokens: int
    chain: array.array  # chained hash of hash_ids[0..b] for each block b
    model: str

    @property
    def routing_units(self) -> int:
        return self.num_tokens * _CHARS_PER_TOKEN  # characters, as routing_key counts them

    token_ids = False

    def engine_prompt(self, block_tokens: int) -> HashedPrompt:
        c = self.chain
        full = self.num_tokens // block_tokens
        last = len(c) - 1
        hashes = [(c[min(((j + 1) * block_tokens - 1) // MOONCAKE_BLOCK_TOKENS, last)] ^ ((j + 1) * _MIX)) & _MASK
                  for j in range(full)]
        return HashedPrompt(self.num_tokens, hashes, c[-1] if len(c) else 0)

    def routing_key(self, prefix_length: int) -> int:
        c = self.chain
        tokens = math.ceil(prefix_length / _CHARS_PER_TOKEN)
        b = min(math.ceil(tokens / MOONCAKE_BLOCK_TOKENS), len(c)) - 1
        tail = c[b] if b >= 0 else 0
        return _digest(self.model.encode() + b"\0\0" + tail.to_bytes(8, "little"), _KEY_SEED)


# -- records and workload -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One replayable request.

    Attributes:
        arrival_s: seconds after the trace's first request (before any speed-up).
        prompt: the simulator's view of its prompt.
        output_tokens: tokens to generate.
        instance: the instance the recording router chose ("" for Mooncake).
        group: a label for reports: which first block it starts with (-1 if none).
    """

    arrival_s: float
    prompt: Any
    output_tokens: int
    instance: str = ""
    group: int = -1


class TraceSession(Session):
    """A trace record replayed as a one-turn session."""

    __slots__ = ("record", "start_s", "group", "num_turns")

    def __init__(self, record: TraceRecord, start_s: float) -> None:
        self.record = record
        self.start_s = start_s
        self.group = record.group
        self.num_turns = 1

    def turn(self, k: int, answers: Sequence[str] | None = None) -> Turn:
        if answers is not None:
            raise NotImplementedError("a trace has no prompt text; replay it in the simulator's fast path")
        return Turn(self.record.prompt, self.record.output_tokens)


@dataclass
class TraceWorkload:
    """A loaded trace, replayed open loop at its recorded times.

    Attributes:
        path: where it was read from.
        format: ``"mooncake"`` or ``"prefixroute"``.
        records: the requests, in arrival order.
        speedup: replay ``speedup`` times faster than recorded (arrivals divided by it).
    """

    path: str
    format: str
    records: list[TraceRecord]
    speedup: float = 1.0

    def describe(self) -> str:
        """One line naming the trace (the ``workload`` JSON field)."""
        span = self.records[-1].arrival_s if self.records else 0.0
        return (f"trace {Path(self.path).name} format={self.format} requests={len(self.records)} "
                f"span_s={span:.0f} speedup={self.speedup:g}")

    @property
    def duration_s(self) -> float:
        """Model seconds from the first to the last arrival, after the speed-up."""
        return self.records[-1].arrival_s / self.speedup if self.records else 0.0

    def instances(self) -> list[str]:
        """Instances named in the trace, in order of first appearance (prefixroute format)."""
        seen: dict[str, None] = {}
        for r in self.records:
            if r.instance:
                seen.setdefault(r.instance, None)
        return list(seen)

    def sessions(self) -> Iterator[Session]:
        """One-turn sessions at the recorded arrival times divided by ``speedup``."""
        for r in self.records:
            yield TraceSession(r, r.arrival_s / self.speedup)


def _group_of(first: int, groups: dict[int, int]) -> int:
    g = groups.get(first)
    if g is None:
        g = groups[first] = len(groups)
    return g


def load_trace(path: str | Path, *, speedup: float = 1.0, default_output_tokens: int = 16,
               model: str = "meta-llama/Llama-3.1-70B-Instruct", limit: int | None = None) -> TraceWorkload:
    """Read a Mooncake or prefixroute JSONL trace (format detected from the first line).

    Args:
        path: the JSONL file.
        speedup: replay this many times faster than recorded (> 0).
        default_output_tokens: output tokens of a prefixroute record without ``max_tokens``.
        model: the model name Mooncake records are keyed under.
        limit: read at most this many records.

    Raises:
        TraceError: unreadable file, a line that is not JSON, missing fields, or no records.
    """
    if not speedup > 0:
        raise TraceError(f"speedup must be > 0, got {speedup}")
    p = Path(path)
    try:
        fh = p.open("rb")
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror or exc}") from None
    records: list[TraceRecord] = []
    groups: dict[int, int] = {}
    fmt = ""
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TraceError(f"{p}:{lineno}: not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{p}:{lineno}: not a JSON object")
            if not fmt:
                if "hash_ids" in obj:
                    fmt = "mooncake"
                elif str(obj.get("format", "")).startswith("prefixroute-trace/"):
                    fmt = "prefixroute"
                else:
                    raise TraceError(f"{p}:{lineno}: neither a Mooncake line (hash_ids) nor a prefixroute "
                                     f"trace line (format {TRACE_FORMAT!r})")
            try:
                rec = (_mooncake_record(obj, model, groups) if fmt == "mooncake"
                       else _prefixroute_record(obj, default_output_tokens, groups))
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{p}:{lineno}: bad {fmt} record ({type(exc).__name__}: {exc})") from None
            records.append(rec)
    if not records:
        raise TraceError(f"{p}: no records")
    records.sort(key=lambda r: r.arrival_s)  # the recorder writes lines as requests end
    t0 = records[0].arrival_s
    if t0:
        records = [TraceRecord(r.arrival_s - t0, r.prompt, r.output_tokens, r.instance, r.group) for r in records]
    return TraceWorkload(str(p), fmt, records, speedup)


def _mooncake_record(obj: dict[str, Any], model: str, groups: dict[int, int]) -> TraceRecord:
    n = int(obj["input_length"])
    out = int(obj["output_length"])
    if n < 1 or out < 0:
        raise ValueError(f"input_length {n} must be >= 1 and output_length {out} >= 0")
    chain = array.array("Q")
    h = _MOONCAKE_SEED
    for hid in obj["hash_ids"]:
        h = _digest(h.to_bytes(8, "little") + int(hid).to_bytes(8, "little", signed=True))
        chain.append(h)
    group = _group_of(chain[0], groups) if chain else -1
    return TraceRecord(float(obj["timestamp"]) / 1000.0, _MooncakePrompt(n, chain, model), max(1, out), "", group)


def _prefixroute_record(obj: dict[str, Any], default_output: int, groups: dict[int, int]) -> TraceRecord:
    length = int(obj["length"])
    if int(obj.get("block", TRACE_BLOCK)) != TRACE_BLOCK:
        raise ValueError(f"block {obj.get('block')} is not {TRACE_BLOCK}")
    digests = (unpack_digests(obj["digests"]) if "digests" in obj  # version 2
               else array.array("Q", (int(d, 16) for d in obj["blocks"])))  # version 1
    unit = obj.get("unit", "chars")
    if unit == "tokens":  # PrefixLength counts token ids on a token prompt, as the router does
        tokens, per_token = max(1, length), 1
    else:
        extra = _GENERATION_CHARS if obj.get("api") == "openai-chat" else 0
        tokens, per_token = max(1, math.ceil((length + extra) / _CHARS_PER_TOKEN)), _CHARS_PER_TOKEN
    max_tokens = obj.get("max_tokens")
    out = int(max_tokens) if isinstance(max_tokens, int) and max_tokens > 0 else default_output
    prompt = _DigestPrompt(tokens, length, digests, str(obj.get("scope", "")), str(obj.get("tenant", "")), per_token)
    group = _group_of(digests[0], groups) if digests else -1
    return TraceRecord(float(obj["timestamp"]), prompt, out, str(obj.get("instance", "")), group)
