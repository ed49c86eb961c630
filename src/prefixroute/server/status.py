"""The live status page of the admin listener: ``GET /admin/status`` and its data.

``GET /admin/status`` is one self-contained HTML page (its CSS and script inline,
nothing fetched from elsewhere: it works on a machine without internet access) that
polls ``GET /admin/status.json`` every second and redraws in place, HAProxy-stats style:
per endpoint, per production variant, per instance: health (and the checks' streak),
requests in flight, request rate and share, decisions by kind, responses by class,
engine prefix-cache hit rate and queue, TTFT percentiles over the last
:data:`~prefixroute.server.livestats.TTFT_SAMPLES` requests, and the recent errors.

The page itself holds no data and is served without the admin token; the JSON needs
it when one is set (the page asks for it once and keeps it for the browser tab).

:func:`status_document` builds the JSON; :func:`merge_documents` adds up the
documents of the workers of ``serve --workers N`` (asked with ``?raw=1``, which adds
each instance's TTFT samples so that the percentiles are computed over all of them).
"""

from __future__ import annotations

import os
import time
from importlib import resources
from typing import TYPE_CHECKING, Any, Iterable

from prefixroute import __version__
from prefixroute.server.health import readiness
from prefixroute.server.livestats import InstanceStats, VariantStats, percentiles

if TYPE_CHECKING:
    from prefixroute.server.state import RouterState

__all__ = ["status_document", "merge_documents", "status_page", "STATUS_PATH", "STATUS_JSON_PATH"]

#: The page and its data, on the admin listener.
STATUS_PATH = "/admin/status"
STATUS_JSON_PATH = "/admin/status.json"


def status_page() -> bytes:
    """The HTML of the status page (package data ``server/status.html``)."""
    return resources.files("prefixroute.server").joinpath("status.html").read_bytes()


def _engine(state: "RouterState", url: str) -> dict[str, Any] | None:
    s = state.backend_stats.get(url)
    if s is None:
        return None
    hit_rate = None
    if s.prefix_cache_queries and s.prefix_cache_hits is not None:
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries
    return {"scrape_ok": s.ok, "scraped_at": s.scraped_at or None, "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits, "cache_hit_rate": hit_rate,
            "requests_running": s.requests_running, "requests_waiting": s.requests_waiting}


def status_document(state: "RouterState", raw: bool = False) -> dict[str, Any]:
    """The live state of the router, for the status page.

    Shape::

        {"router": {"version", "pid", "started", "uptime_s", "data_plane", "health": {"status",
                    "message"}, "health_check_interval_s", "unhealthy_threshold", "healthy_threshold"},
         "time": epoch seconds,
         "endpoints": [{"name", "default": bool, "variants": [
             {"name", "strategy", "routing": {...}, "weight", "healthy", "instance_count", "in_flight",
              "requests", "refused", "retries", "responses": {"2xx": n, ...}, "decisions": {"affinity": n, ...},
              "ttft": {"p50", "p90", "p99", "n"}, "errors": [{"time", "instance", "code", "kind",
              "request_id", "message"?}, ...],
              "instances": [{"url", "state": "up" | "down" | "unchecked", "healthy", "failures",
                             "successes", "in_flight", "served", "requests", "share", "decisions",
                             "responses", "ttft", "bytes_out", "engine": {...} | null}]}]}],
         "unrouted_errors": [...]}

    Times are seconds (TTFT from the request's arrival to the first byte of the answer);
    ``share`` is the instance's fraction of the variant's routed requests since start;
    counts are totals since the process started. ``state`` is ``unchecked`` for an
    instance in rotation on trust, not yet seen up by a check or an answer. ``raw``
    adds ``ttft_samples`` to each variant and instance (for :func:`merge_documents`).
    """
    for account in state.metrics.pending:  # the fast data plane's answers not recorded yet
        account()
    stats = state.observers.stats
    tracker = state.health
    s = state.settings
    health = readiness(state)
    endpoints = []
    for e in state.fleet.config.endpoints:
        ep = state.fleet.endpoints[e.name]
        variants = []
        for v in e.variants:
            pool = ep.pools[v.name]
            vs = stats.variants.get((e.name, v.name)) or VariantStats()
            instances = []
            for inst in pool.instances:
                url = inst.instance_id
                istats = vs.instances.get(url) or InstanceStats()
                failures, successes, seen_up = tracker.state(url)
                idoc = istats.document(raw)
                instances.append({
                    "url": url,
                    "state": "down" if not inst.healthy else ("up" if seen_up or not tracker.active_checks
                                                              else "unchecked"),
                    "healthy": inst.healthy, "failures": failures, "successes": successes,
                    "in_flight": inst.in_flight, "served": inst.served,
                    **idoc,
                    "share": istats.requests / vs.requests if vs.requests else None,
                    "engine": _engine(state, url),
                })
            vdoc: dict[str, Any] = {
                "name": v.name, "strategy": pool.routing.strategy.value, "routing": pool.routing.to_api(),
                "weight": v.weight, "healthy": sum(1 for i in pool.instances if i.healthy),
                "instance_count": len(pool.instances), "in_flight": pool.total_in_flight(),
                "requests": vs.requests, "refused": vs.refused, "retries": vs.retries,
                "responses": dict(vs.responses), "decisions": dict(vs.decisions), "ttft": percentiles(vs.ttft),
                "errors": list(vs.errors), "instances": instances,
            }
            if raw:
                vdoc["ttft_samples"] = list(vs.ttft)
            variants.append(vdoc)
        endpoints.append({"name": e.name, "default": e.name == state.fleet.default_name, "variants": variants})
    now = time.time()
    return {
        "router": {"version": __version__, "pid": os.getpid(), "started": stats.started,
                   "uptime_s": now - stats.started, "data_plane": s.data_plane, "workers": 1,
                   "health": {"status": health.status, "message": health.message()},
                   "health_check_interval_s": s.health_check_interval_s,
                   "unhealthy_threshold": s.unhealthy_threshold, "healthy_threshold": s.healthy_threshold,
                   "trace": state.observers.recorder.stats() if state.observers.recorder is not None else None},
        "time": now,
        "endpoints": endpoints,
        "unrouted_errors": list(stats.unrouted_errors),
    }


def _add_counts(into: dict[str, int], more: dict[str, int]) -> None:
    for k, n in more.items():
        into[k] = into.get(k, 0) + n


def _recent(errors: Iterable[dict[str, Any]], keep: int = 20) -> list[dict[str, Any]]:
    return sorted(errors, key=lambda e: e.get("time") or 0)[-keep:]


def merge_documents(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One status document from those of several workers (each made with ``raw=True``).

    Counts, rates' totals, bytes and errors are added up (the newest errors kept); TTFT
    percentiles are recomputed over every worker's samples; health, in-flight counts
    (read from the shared table, so already the sum over workers) and the engines'
    figures are the first worker's. Raises ``ValueError`` for an empty list.
    """
    if not docs:
        raise ValueError("no status document to merge")
    out = docs[0]
    for doc in docs[1:]:
        for e_out, e in zip(out["endpoints"], doc["endpoints"]):
            if e_out["name"] != e["name"]:
                continue  # a worker mid-reconfiguration: skip what does not line up
            for v_out, v in zip(e_out["variants"], e["variants"]):
                if v_out["name"] != v["name"]:
                    continue
                for key in ("requests", "refused", "retries"):
                    v_out[key] += v[key]
                _add_counts(v_out["responses"], v["responses"])
                _add_counts(v_out["decisions"], v["decisions"])
                v_out["ttft_samples"] = v_out.get("ttft_samples", []) + v.get("ttft_samples", [])
                v_out["errors"] = v_out["errors"] + v["errors"]
                by_url = {i["url"]: i for i in v["instances"]}
                for i_out in v_out["instances"]:
                    i = by_url.get(i_out["url"])
                    if i is None:
                        continue
                    i_out["requests"] += i["requests"]
                    i_out["bytes_out"] += i["bytes_out"]
                    i_out["served"] += i["served"]
                    _add_counts(i_out["responses"], i["responses"])
                    _add_counts(i_out["decisions"], i["decisions"])
                    i_out["ttft_samples"] = i_out.get("ttft_samples", []) + i.get("ttft_samples", [])
        out["unrouted_errors"] = out["unrouted_errors"] + doc["unrouted_errors"]
    for e_out in out["endpoints"]:
        for v_out in e_out["variants"]:
            v_out["ttft"] = percentiles(v_out.pop("ttft_samples", []))
            v_out["errors"] = _recent(v_out["errors"])
            for i_out in v_out["instances"]:
                i_out["ttft"] = percentiles(i_out.pop("ttft_samples", []))
                i_out["share"] = i_out["requests"] / v_out["requests"] if v_out["requests"] else None
    out["unrouted_errors"] = _recent(out["unrouted_errors"])
    out["router"]["workers"] = len(docs)
    return out
