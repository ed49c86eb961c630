"""Periodic scrape of every instance's ``/metrics``: the engines' own prefix-cache
counters and queue lengths (SPEC §4: "backend cache-hit rate scraped from the engines").

Read per instance (summed over label sets, e.g. several ``model_name`` values), under
vLLM's names or, when those are absent, SGLang's (``--enable-metrics``):

* prompt tokens looked up in the prefix cache: ``vllm:prefix_cache_queries_total``;
  SGLang ``sglang:prompt_tokens_total``
* of which found (cached): ``vllm:prefix_cache_hits_total``; SGLang
  ``sglang:cached_tokens_total``
* requests the engine is running: ``vllm:num_requests_running``; SGLang
  ``sglang:num_running_reqs``
* requests queued in the engine: ``vllm:num_requests_waiting``; SGLang
  ``sglang:num_queue_reqs``

and, for LoRA sticky sets, vLLM's ``vllm:lora_requests_info`` gauge (the series with the
latest timestamp value): the adapters in ``running_lora_adapters`` and
``waiting_lora_adapters`` (comma-separated) are loaded there, and ``max_lora`` is the
engine's adapter slots (:meth:`prefixroute.core.catalog.ModelCatalog.set_lora_info`).

Older vLLM releases name the counters ``vllm:gpu_prefix_cache_queries_total`` and
``vllm:gpu_prefix_cache_hits_total``; they are used when the new names are absent.
SGLang counts a request's prompt and cached tokens when it finishes (its
``cached_tokens_total`` is labelled by ``cache_source``: device, host, storage, all
summed; releases before it have only ``sglang:cache_hit_rate``, a gauge of the last
batches, not read: the hit rate is then unknown). The hit rate of either engine is
``hits / queries`` since the engine started.

The text is parsed (:mod:`prefixroute.server.exposition`: plain lines directly, any
other page by ``prometheus_client``'s parser) after keeping only the lines of
these families (a vLLM ``/metrics`` page has hundreds of histogram lines; parsing them
all would hold the event loop for milliseconds). The page is read whole, in as many reads
as it arrives in (at most 16 MiB: a larger one is a failed scrape), asked for uncompressed
(gzip or deflate is decoded if sent anyway); a page over 256 KB is parsed in a thread. A failed scrape keeps the last values,
marks the instance's scrape as failed, and is not a health failure. A counter series
missing from a page, or not a count there, keeps its last known value, and the counters
read are the sums of those (:meth:`BackendStats.after`): they go back only when the
engine restarts.

**Engine restarts.** An engine restarted on the same URL starts with an empty prefix
cache, and its counters start again from zero. A scrape that finds a series of the
prompt-token counter (or of the cached-token counter) lower than at the last successful
scrape counts a restart (a counter reset, as Prometheus' ``resets()`` reads one: series by
series, so a label set that stops being exported, a second ``model_name`` no longer
served, is not a restart; a series missing or not a count keeps its last known value for
that comparison; when no series is in both scrapes, the engine came back with other
labels, the sums are compared) and tells every variant
that has the instance (:meth:`prefixroute.core.pool.VariantPool.forget_cache`) and
``prefixroute_backend_restarts_seen{instance}`` counts it:
``CACHE_AWARE`` then empties its view of that instance's cache instead of routing
follow-ups to an instance that no longer holds their prefix. A restart goes unseen when
the engine exports neither counter, or when by the next scrape it has already counted
more tokens than before it stopped (scrapes every ``--metrics-scrape-interval``
seconds, 10 by default, against minutes for an engine to load a model).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping

import aiohttp

from prefixroute.server.exposition import samples

if TYPE_CHECKING:
    from prefixroute.server.state import RouterState

__all__ = ["BackendStats", "parse_engine_metrics", "scrape_instance", "scrape_all", "scrape_loop"]

log = logging.getLogger("prefixroute.server.scrape")

# Each tuple: the names of one figure, the first present is used (a page is one engine's).
_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries", "sglang:prompt_tokens")
_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits", "sglang:cached_tokens")
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_LORA = "vllm:lora_requests_info"
_FAMILIES = (*_QUERIES, *_HITS, *_RUNNING, *_WAITING, *_KV_USAGE)
_COUNTERS = (_QUERIES, _HITS)
#: Most series of one counter no longer exported whose last values are kept apart, per
#: instance (past it the earliest are folded into one sum): an engine whose label sets
#: churn cannot grow the marks.
_MAX_VANISHED_SERIES = 64

#: One series of a counter: its name (without ``_total``) and its sorted label pairs.
Series = tuple[str, tuple[tuple[str, str], ...]]
_MAX_METRICS_BYTES = 16 * 1024 * 1024
#: Pages longer than this are parsed in a thread: a few MiB of lines of the families
#: read took seconds of the event loop's time (prometheus-client's parser is Python).
_PARSE_IN_THREAD_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class BackendStats:
    """What one instance's ``/metrics`` said at its last successful scrape.

    Attributes:
        prefix_cache_queries: prompt tokens looked up since the engine started, or ``None``
            if the engine does not export the counter.
        prefix_cache_hits: prompt tokens found in the prefix cache, or ``None``.
        requests_running: requests running in the engine, or ``None``.
        requests_waiting: requests waiting in the engine, or ``None``.
        kv_usage: fraction 0-1 of the engine's KV cache in use
            (``vllm:kv_cache_usage_perc``, older ``vllm:gpu_cache_usage_perc``, SGLang's
            ``sglang:token_usage``), or ``None``.
        scraped_at: ``time.time()`` of the scrape, seconds.
        ok: whether the latest scrape succeeded (the values are from the last one that did).
        restarts: engine restarts seen so far by this process (counter resets between
            two successful scrapes; set by :func:`scrape_all`, 0 from
            :func:`parse_engine_metrics`).
        counter_series: this scrape's value of each series of the prompt-token and
            cached-token counters (the valid ones), ``{}`` when there were none.
        counter_unknown: the series of those counters on this page whose value is not
            a count (NaN, negative, infinite): there, but their value unknown.
        counter_found: each counter's series as the latest scrape that had any of them
            found them (a series there but unknown with its last known value) (carried across scrapes that lack the counter); ``None``: this
            scrape's own.
        counter_marks: the latest known value of each series seen since the engine
            started under the names it exports (as last found), kept across scrapes
            that lack it (what the counters are summed from); past
            :data:`_MAX_VANISHED_SERIES` series no longer among those last found, the
            earliest are folded into one per name (one that comes back after that is
            counted anew: label sets churning that much are not an engine's);
            ``None``: this scrape's own values.
        lora_adapters: the adapters ``vllm:lora_requests_info`` names running or
            waiting (loaded), or ``None`` when the engine does not export it.
        max_lora: its ``max_lora`` (adapter slots), or ``None``.
    """

    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    scraped_at: float = 0.0
    ok: bool = False
    restarts: int = 0
    counter_series: Mapping[Series, float] = field(default_factory=dict)
    counter_unknown: frozenset[Series] = frozenset()
    counter_found: Mapping[Series, float] | None = None
    counter_marks: Mapping[Series, float] | None = None
    kv_usage: float | None = None
    lora_adapters: tuple[str, ...] | None = None
    max_lora: int | None = None

    @property
    def series_marks(self) -> Mapping[Series, float]:
        """Each counter series' last known value (see ``counter_marks``)."""
        return self.counter_series if self.counter_marks is None else self.counter_marks

    @property
    def series_found(self) -> Mapping[Series, float]:
        """Each counter's series as last found (see ``counter_found``)."""
        return self.counter_series if self.counter_found is None else self.counter_found

    @property
    def marks(self) -> tuple[float | None, float | None]:
        """``(queries, hits)`` as last known: each counter's series marks summed, under
        the name the engine exported last (``None`` for a counter never seen)."""
        return _total(self.series_marks, _QUERIES, self.series_found), \
            _total(self.series_marks, _HITS, self.series_found)

    @property
    def hit_rate(self) -> float | None:
        """``hits / queries`` since the engine started (cached prompt tokens / prompt
        tokens), or ``None`` before the first query."""
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def engine_load(self) -> int | None:
        """``running + waiting`` as the engine reports it, or ``None`` if unknown."""
        if self.requests_running is None and self.requests_waiting is None:
            return None
        return int((self.requests_running or 0) + (self.requests_waiting or 0))

    def reset_since(self, earlier: "BackendStats") -> bool:
        """Whether a counter went back between ``earlier`` and this scrape: the engine
        restarted. For each counter (prompt tokens, cached tokens), under each of its
        names this scrape has and ``earlier`` knew: a series in both that is lower now
        than its last known value; or, when no series is in both (the engine came back
        with other labels), the sum of this scrape's series lower than the sum of the
        counter's series last found under that name. A counter under no name in both (an engine
        now exporting another release's names) compares the sums under the first name
        each side has."""
        old, new, found = earlier.series_marks, self.counter_series, earlier.series_found
        for names in _COUNTERS:
            compared = False
            for name in names:
                old_n = {k: v for k, v in old.items() if k[0] == name}
                new_n = {k: v for k, v in new.items() if k[0] == name}
                if not old_n or not new_n:
                    continue
                compared = True
                common = old_n.keys() & new_n.keys()
                if common:
                    if any(new_n[k] < old_n[k] for k in common):
                        return True
                elif sum(new_n.values()) < sum(v for k, v in found.items() if k[0] == name):
                    return True  # (other labels: not against the kept values of vanished label sets)
            if not compared:
                before, now = _total(found, names), _total(new, names)
                if before is not None and now is not None and now < before:
                    return True
        return False

    def after(self, earlier: "BackendStats") -> "BackendStats":
        """This scrape, carrying on from ``earlier`` (the instance's previous one): its
        restart count (plus one if :meth:`reset_since`), each counter's series as last
        found, and the counter series' last known values (a series this scrape
        lacks keeps ``earlier``'s, unless the engine restarted), whose sums are its
        ``prefix_cache_queries`` and ``prefix_cache_hits``: a label set that stops being
        exported, or a counter missing from one page, leaves the counters as they were
        instead of lower (or unknown)."""
        if self.reset_since(earlier):
            return replace(self, restarts=earlier.restarts + 1, counter_marks=None, counter_found=None)
        now, known = self.counter_series, earlier.series_marks
        unknown = [k for k in self.counter_unknown if k in known]  # (one never known: as if absent)
        found = dict(earlier.series_found)
        for names in _COUNTERS:  # a counter found now replaces what was found of it, whatever its names
            if any(k[0] in names for k in now) or any(k[0] in names for k in unknown):
                found = {k: v for k, v in found.items() if k[0] not in names}
        found.update({k: known[k] for k in unknown})
        found.update(now)
        marks = {**known, **now}
        names: set[str] = set()  # the names the engine exports (a name it no longer does: its values go)
        for family in _COUNTERS:
            names |= {k[0] for k in found if k[0] in family} or {k[0] for k in marks if k[0] in family}
        marks = {k: v for k, v in marks.items() if k[0] in names}
        # Vanished: not among the series as last found (one missing from a page is not).
        for family in _COUNTERS:
            gone = [k for k in marks if k[0] in family and k not in found and k[1] != _FOLDED]
            for k in gone[: max(0, len(gone) - _MAX_VANISHED_SERIES)]:  # label sets churning: fold the earliest
                folded = (k[0], _FOLDED)
                marks[folded] = marks.get(folded, 0.0) + marks.pop(k)
        return replace(self, restarts=earlier.restarts, counter_found=found, counter_marks=marks,
                       prefix_cache_queries=_total(marks, _QUERIES, found), prefix_cache_hits=_total(marks, _HITS, found))


#: The label set standing for the sum of the series folded together (no engine's).
_FOLDED: tuple[tuple[str, str], ...] = (("", "folded"),)


def _total(series: Mapping[Series, float], names: tuple[str, ...],
           latest: Mapping[Series, float] | None = None) -> float | None:
    """The sum of ``series`` under one of ``names``: the first of them in ``latest``
    (the names the engine exported last), else the first that has any series; ``None``
    if none has."""
    present = {k[0] for k in latest} if latest else set()
    order = [n for n in names if n in present] + [n for n in names if n not in present]
    for name in order:
        values = [v for k, v in series.items() if k[0] == name]
        if values:
            return sum(values)
    return None


def _wanted(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and (
            parts[2].removesuffix("_total") in _FAMILIES or parts[2] == _LORA)
    return line.startswith(_FAMILIES) or line.startswith(_LORA)


def parse_engine_metrics(text: str, scraped_at: float = 0.0) -> BackendStats:
    """The :class:`BackendStats` in a Prometheus text exposition. A figure any of whose
    samples is NaN, infinite or negative is unknown (``None``), as if not exported.

    Raises:
        ValueError: the relevant lines are not valid exposition format.
    """
    kept = "\n".join(line for line in text.splitlines() if _wanted(line)) + "\n"
    sums: dict[str, float] = {}
    bad: set[str] = set()
    series: dict[Series, float] = {}
    unknown: set[Series] = set()
    lora: tuple[float, dict[str, str]] | None = None
    for sample_name, labels, value in samples(kept):
        if sample_name == _LORA:
            if lora is None or value >= lora[0]:  # the latest (its value is a timestamp)
                lora = (value, labels)
            continue
        name = sample_name.removesuffix("_total")
        if not 0.0 <= value < math.inf:  # NaN, infinite or negative: not a count, the figure stays unknown
            bad.add(name)
            if (name in _QUERIES or name in _HITS) and not sample_name.endswith("_created"):
                unknown.add((name, tuple(sorted(labels.items()))))
        elif name in _FAMILIES and not sample_name.endswith(("_created", "_bucket", "_sum", "_count")):
            sums[name] = sums.get(name, 0.0) + value
            if name in _QUERIES or name in _HITS:
                series[(name, tuple(sorted(labels.items())))] = value
    for name in bad:
        sums.pop(name, None)

    def first(names: tuple[str, ...]) -> float | None:
        return next((sums[n] for n in names if n in sums), None)

    adapters: tuple[str, ...] | None = None
    max_lora: int | None = None
    if lora is not None:
        labels = lora[1]
        names = [n.strip() for key in ("running_lora_adapters", "waiting_lora_adapters")
                 for n in labels.get(key, "").split(",")]
        adapters = tuple(dict.fromkeys(n for n in names if n))
        slots = labels.get("max_lora", "").strip()
        max_lora = int(slots) if slots.isdigit() and int(slots) > 0 else None
    return BackendStats(first(_QUERIES), first(_HITS), first(_RUNNING), first(_WAITING), scraped_at, True,
                        counter_series=series, counter_unknown=frozenset(unknown), kv_usage=first(_KV_USAGE),
                        lora_adapters=adapters, max_lora=max_lora)


async def scrape_instance(session: aiohttp.ClientSession, instance_id: str, timeout_s: float) -> BackendStats | None:
    """Scrape ``instance_id/metrics`` once; ``None`` on any failure."""
    try:
        # identity: the upstream session does not decompress, and prometheus-client's
        # own servers (SGLang's /metrics among them) gzip a page when they may.
        async with session.get(instance_id + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s),
                               headers={"Accept": "text/plain", "Accept-Encoding": "identity"}) as resp:
            if resp.status != 200:
                return None
            coding = resp.headers.get("Content-Encoding", "identity").strip().lower()
            if coding not in ("identity", "", "gzip", "x-gzip", "deflate"):
                raise ValueError(f"metrics page in an unknown coding: {coding}")
            inflate = zlib.decompressobj(47 if coding != "deflate" else 15) \
                if coding not in ("identity", "") else None  # (47: gzip or zlib header)
            parts: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_any():  # the whole page, as many reads as it takes
                if inflate is not None:
                    chunk = inflate.decompress(chunk, _MAX_METRICS_BYTES + 1 - size)
                size += len(chunk)
                if size > _MAX_METRICS_BYTES:
                    raise ValueError(f"metrics page over {_MAX_METRICS_BYTES} bytes")
                parts.append(chunk)
        text = b"".join(parts).decode("utf-8", "replace")
        if len(text) > _PARSE_IN_THREAD_BYTES:  # (a big page: the event loop keeps serving meanwhile)
            return await asyncio.to_thread(parse_engine_metrics, text, time.time())
        return parse_engine_metrics(text, time.time())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, OverflowError, zlib.error) as exc:
        log.debug("metrics scrape of %s failed: %s", instance_id, type(exc).__name__)
        return None


async def scrape_all(state: "RouterState") -> dict[str, BackendStats]:
    """Scrape every configured instance once, concurrently, and store the results in
    ``state.backend_stats`` (and each pool instance's ``engine_load``). An instance
    whose counters went back (it restarted) has its learned cache view forgotten
    (:meth:`RouterState.engine_restarted`)."""
    session = state.session
    if session is None:
        return {}
    ids = state.instance_ids()
    generations = [state.catalog.generation(i) for i in ids]
    results = await asyncio.gather(
        *(scrape_instance(session, i, state.settings.metrics_scrape_timeout_s) for i in ids))
    stats = state.backend_stats
    lora_changed = False
    for gone in [i for i in stats if i not in ids]:
        del stats[gone]
    for instance_id, got in zip(ids, results):
        old = stats.get(instance_id)
        if got is None:
            got = BackendStats(ok=False) if old is None else replace(old, ok=False)
        elif old is not None:
            got = got.after(old)
            if got.restarts > old.restarts:
                state.engine_restarted(instance_id)
        stats[instance_id] = got
    for instance_id, got, generation in zip(ids, results, generations):
        if got is not None and got.lora_adapters is not None:
            lora_changed = state.catalog.set_lora_info(instance_id, got.lora_adapters, got.max_lora,
                                                       generation) or lora_changed
    if lora_changed:
        state.models_changed()
    state.publish_engine_load()
    return dict(stats)


async def scrape_loop(state: "RouterState") -> None:
    """Run :func:`scrape_all` every ``settings.metrics_scrape_interval_s`` seconds,
    starting at once. Cancel the task to stop it."""
    interval = state.settings.metrics_scrape_interval_s
    while True:
        try:
            await scrape_all(state)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop scraping
            log.exception("metrics scrape round failed")
        await asyncio.sleep(interval)
