"""What ``bench/overhead.py`` measures: its settings (:class:`OverheadSettings`, the full
grid and ``--quick``), the grid's cells, body sizes, and the chat request bodies the
load cycles over (also sent by ``bench/gateway.py``, ``bench/cpu_split.py`` and
``bench/precise_path.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from fast_backend import MODEL


@dataclass(frozen=True)
class OverheadSettings:
    """What one run measures.

    Attributes:
        concurrency: wrk connections per cell (closed loop; threads = min(2, connections)).
        body_sizes: request body sizes per cell, bytes (each body exactly this long).
        streaming: per cell, whether the bodies ask for a stream.
        duration_s: seconds of load per measurement (wrk takes whole seconds).
        rounds: measurements of every (cell, target); the median is reported.
        warmup_s: seconds of load before a cell's first round, per target (0: none).
        instances: ports of the fast backend, the routers' instances.
        backend_port: the fast backend's first port, the others following it; fixed, so
            that the instances' URLs, by which rendezvous hashing places the test
            bodies (PREFIX_AWARE, CACHE_AWARE, the peers' cache-aware policies), are the
            same in every run. 0, or a port in use: free ports chosen by the OS (the
            placement then changes from run to run).
        distinct_bodies: request bodies the load cycles over (distinct system prompts).
        stream_events: SSE events per streamed answer (before ``data: [DONE]``).
        prefix_length: PREFIX_AWARE PrefixLength (characters) and HAProxy's hashed bytes.
        concurrency_threshold: PREFIX_AWARE and CACHE_AWARE ConcurrencyThreshold.
        balance_factor: HAProxy ``hash-balance-factor``.
        workers: ``prefixroute serve --workers`` of the multi-worker row.
        streams: concurrent streams of the streams phase (0: skip it).
        streams_events: SSE events per stream in that phase.
        streams_delay_ms: milliseconds between two events in that phase (20 events
            250 ms apart: each stream lasts about 5 s, longer than opening 2,000 takes
            here, so all are open at once).
        seed: seed of the request bodies.
        paired_direct_up_to: in cells of at most this concurrency, direct is measured
            again right before every router, and that router's added latency is taken
            against it (0: direct once per round, first). At concurrency 1 the added
            latency is a tenth of a millisecond, less than this machine drifts between
            the start and the end of a round.
    """

    concurrency: tuple[int, ...] = (1, 8, 64, 256)
    body_sizes: tuple[int, ...] = (1024, 32 * 1024, 256 * 1024)
    streaming: tuple[bool, ...] = (False, True)
    duration_s: int = 5
    rounds: int = 3
    warmup_s: int = 1
    instances: int = 4
    backend_port: int = 18431
    distinct_bodies: int = 16
    stream_events: int = 8
    prefix_length: int = 4096
    concurrency_threshold: int = 32
    balance_factor: int = 150
    workers: int = 2
    streams: int = 2000
    streams_events: int = 20
    streams_delay_ms: float = 1000.0
    seed: int = 0
    paired_direct_up_to: int = 1


FULL = OverheadSettings()
#: ``--quick``: 2 s measurements, 1 round, no per-cell warm-up, concurrency 1 and 64,
#: 32 KB bodies, streaming and not (a smoke run, not a result).
QUICK = OverheadSettings(concurrency=(1, 64), body_sizes=(32 * 1024,), duration_s=2, rounds=1, warmup_s=0)


@dataclass(frozen=True)
class Cell:
    """One point of the grid."""

    concurrency: int
    body_bytes: int
    stream: bool

    @property
    def name(self) -> str:
        return f"c={self.concurrency} body={_size_name(self.body_bytes)} {'stream' if self.stream else 'plain'}"


def _size_name(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)} MB"
    if n % 1024 == 0:
        return f"{n // 1024} KB"
    return f"{n} B"


def parse_size(text: str) -> int:
    """``"32K"``, ``"32KB"``, ``"1m"`` or ``"1000"`` -> bytes (K = 1024).

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)[bB]?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 1K, 32KB, 262144)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


# -- request bodies ---------------------------------------------------------------------------

_WORDS = ("the", "policy", "customer", "refund", "order", "shipping", "account", "invoice", "warranty", "return",
          "support", "window", "days", "within", "product", "service", "request", "billing", "plan", "tier",
          "escalate", "agent", "ticket", "priority", "region", "contract", "renewal", "discount", "credit", "limit")


def make_bodies(size_bytes: int, stream: bool, count: int = 16, seed: int = 0) -> list[bytes]:
    """``count`` OpenAI chat bodies of exactly ``size_bytes`` bytes each.

    Each has its own system prompt, different from its first characters (so every
    router that keys on a prefix spreads them), padded with seeded ASCII words; the
    bodies for ``stream`` True and False have the same prompts. JSON as ``json.dumps``
    writes it, so a streaming body contains ``"stream": true``.

    Raises:
        ValueError: ``size_bytes`` is too small for the JSON around the prompt.
    """
    import random

    out = []
    for i in range(count):
        head = f"Tenant {i:02d} of {count}: you are the support assistant of shop number {i}. "
        user = f"Question {i}: what does the policy above say about returns?"

        def doc(system: str) -> bytes:
            return json.dumps({"model": MODEL, "messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": user}],
                               "max_tokens": 16, "stream": stream}).encode()

        need = size_bytes - len(doc(head))
        if need < 0:
            raise ValueError(f"a body of {size_bytes} bytes cannot hold a chat request (at least {len(doc(head))})")
        rng = random.Random(f"{seed}-{i}")
        parts, have = [], 0
        while have < need:
            words = " ".join(rng.choices(_WORDS, k=256)) + ". "
            parts.append(words)
            have += len(words)
        body = doc(head + "".join(parts)[:need])
        assert len(body) == size_bytes
        out.append(body)
    return out


def write_bodies(directory: Path, bodies: Sequence[bytes], stem: str) -> list[Path]:
    """Write each body to ``directory/stem-NN.json``; returns the paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, b in enumerate(bodies):
        p = directory / f"{stem}-{i:02d}.json"
        p.write_bytes(b)
        paths.append(p)
    return paths
