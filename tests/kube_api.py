"""An emulated Kubernetes API server for EndpointSlices (list and watch), on loopback.

No cluster runs on these machines; this speaks the part of the API that discovery
uses, as the API server does (Kubernetes API concepts: "Efficient detection of
changes", "Watch bookmarks", "Retrieving large results sets in chunks", "Resource
versions"):

- ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices``: a list
  (``EndpointSliceList`` with ``metadata.resourceVersion``), paged by ``limit`` /
  ``continue`` (a continue token whose version was compacted away answers 410);
  ``labelSelector`` with ``k=v``, ``k==v``, ``k!=v`` and ``k`` terms;
- the same with ``watch=true``: a chunked stream of JSON lines
  ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}`` from
  ``resourceVersion`` (every change after it; ``0`` or none: the current objects as
  ADDED first), ``BOOKMARK`` events when ``allowWatchBookmarks=true``, ended by the
  server after ``timeoutSeconds``; a version older than the compaction point gets one
  ``ERROR`` event carrying a ``Status`` with ``code: 410`` (``Expired``), as the real
  server sends it;
- bearer-token authentication (401 otherwise).

Faults for tests: :meth:`compact` (old versions gone: 410), :meth:`drop_watches`
(connections cut mid-stream), :meth:`outage` (503 to everything, watches cut), and
stopping the listener (connection refused).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (anything but empty, 0,
    f and false, in any case, is true)."""
    return value is not None and value.lower() not in ("", "0", "f", "false")


def parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    """``a=b,c!=d,e`` -> ``[("a", "=", "b"), ("c", "!=", "d"), ("e", "exists", None)]``."""
    out: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            out.append((k.strip(), "!=", v.strip()))
        elif "==" in term:
            k, v = term.split("==", 1)
            out.append((k.strip(), "=", v.strip()))
        elif "=" in term:
            k, v = term.split("=", 1)
            out.append((k.strip(), "=", v.strip()))
        else:
            out.append((term, "exists", None))
    return out


def matches(labels: dict[str, str], selector: list[tuple[str, str, str | None]]) -> bool:
    for k, op, v in selector:
        if op == "exists" and k not in labels:
            return False
        if op == "=" and labels.get(k) != v:
            return False
        if op == "!=" and labels.get(k) == v:
            return False
    return True


@dataclass(eq=False)
class _Watcher:
    namespace: str
    selector: list[tuple[str, str, str | None]]
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    request: web.Request | None = None


class KubeApiEmulator:
    """The emulated API server.

    Args:
        token: the bearer token every request must carry.
        bookmark_interval_s: seconds between BOOKMARK events on a watch that asked for them.

    Attributes:
        requests: ``(watch, query dict)`` of every EndpointSlice request received.
        resource_version: the current resourceVersion (an integer here; opaque to clients).
    """

    def __init__(self, token: str = "emulated-token", bookmark_interval_s: float = 0.5) -> None:
        self.token = token
        self.bookmark_interval_s = bookmark_interval_s
        self.resource_version = 100
        self.compacted = 0  # versions <= this are gone
        self.requests: list[tuple[bool, dict[str, str]]] = []
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._history: list[tuple[int, str, dict[str, Any]]] = []
        self._watchers: set[_Watcher] = set()
        self._outage = False
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ----------------------------------------------------------------

    async def start(self, port: int = 0) -> "KubeApiEmulator":
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port or self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Stop listening (clients get connection refused) and cut every watch."""
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: str, namespace: str = "default") -> str:
        """A kubeconfig file pointing at this server with its token; returns ``path``."""
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "emulated",
               "clusters": [{"name": "emulated", "cluster": {"server": self.url}}],
               "users": [{"name": "router", "user": {"token": self.token}}],
               "contexts": [{"name": "emulated", "context": {"cluster": "emulated", "user": "router",
                                                             "namespace": namespace}}]}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)  # JSON is YAML
        return path

    # -- objects ------------------------------------------------------------------

    def put_slice(self, namespace: str, name: str, service: str, endpoints: list[tuple[str, bool | None]],
                  port: int, port_name: str = "http", labels: dict[str, str] | None = None,
                  address_type: str = "IPv4") -> int:
        """Create or replace a slice; ``endpoints`` are ``(address, ready)`` (``None`` =
        condition unset). Returns the new resourceVersion."""
        key = (namespace, name)
        kind = "MODIFIED" if key in self._objects else "ADDED"
        self.resource_version += 1
        eps = []
        for i, (addr, ready) in enumerate(endpoints):
            cond: dict[str, Any] = {}
            if ready is not None:
                cond = {"ready": ready, "serving": ready, "terminating": not ready}
            eps.append({"addresses": [addr], "conditions": cond, "nodeName": f"node-{i % 3}",
                        "zone": f"zone-{i % 2}", "targetRef": {"kind": "Pod", "namespace": namespace,
                                                               "name": f"{service}-{addr.replace('.', '-')}"}})
        obj = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(self.resource_version),
                            "labels": {"kubernetes.io/service-name": service,
                                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                                       **(labels or {})}},
               "addressType": address_type, "endpoints": eps,
               "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]}
        self._objects[key] = obj
        self._emit(kind, obj)
        return self.resource_version

    def delete_slice(self, namespace: str, name: str) -> int:
        obj = self._objects.pop((namespace, name))
        self.resource_version += 1
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self.resource_version)
        self._emit("DELETED", gone)
        return self.resource_version

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        snapshot = copy.deepcopy(obj)
        self._history.append((self.resource_version, kind, snapshot))
        ns = obj["metadata"]["namespace"]
        for w in list(self._watchers):
            if w.namespace == ns and matches(obj["metadata"].get("labels", {}), w.selector):
                w.queue.put_nowait({"type": kind, "object": snapshot})

    # -- faults -------------------------------------------------------------------

    def compact(self) -> None:
        """Forget the history up to now: a watch or continue token from an older
        version gets 410 Gone."""
        self.compacted = self.resource_version
        self._history.clear()

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream (no final chunk)."""
        for w in list(self._watchers):
            transport = w.request.transport if w.request is not None else None
            if transport is not None:
                transport.abort()
            w.queue.put_nowait(None)
        self._watchers.clear()

    def outage(self, on: bool) -> None:
        """While on: every request gets 503 and open watches are cut."""
        self._outage = on
        if on:
            self.drop_watches()

    @property
    def watch_count(self) -> int:
        return len(self._watchers)

    # -- handlers -----------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        watch = _flag(q.get("watch"))
        self.requests.append((watch, q))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        if self._outage:
            return web.json_response(_status(503, "ServiceUnavailable", "the server is currently unavailable"),
                                     status=503)
        ns = request.match_info["namespace"]
        selector = parse_selector(q.get("labelSelector", ""))
        if watch:
            return await self._watch(request, ns, selector, q)
        return self._list(ns, selector, q)

    def _list(self, ns: str, selector: list[tuple[str, str, str | None]], q: dict[str, str]) -> web.Response:
        limit = int(q.get("limit", "0") or 0)
        if q.get("continue"):
            token = json.loads(base64.b64decode(q["continue"]))
            if token["rv"] <= self.compacted:
                return web.json_response(_status(410, "Expired", "The provided continue parameter is too old"),
                                         status=410)
            rv, start, items = token["rv"], token["start"], token["items"]
        else:
            rv, start = self.resource_version, 0
            items = [copy.deepcopy(o) for (n, _), o in sorted(self._objects.items())
                     if n == ns and matches(o["metadata"].get("labels", {}), selector)]
        page = items[start:start + limit] if limit else items[start:]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit and start + limit < len(items):
            meta["continue"] = base64.b64encode(json.dumps(
                {"rv": rv, "start": start + limit, "items": items}).encode()).decode()
            meta["remainingItemCount"] = len(items) - start - limit
        return web.json_response({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                  "metadata": meta, "items": page})

    async def _watch(self, request: web.Request, ns: str, selector: list[tuple[str, str, str | None]],
                     q: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        rv_text = q.get("resourceVersion", "")
        timeout_s = float(q.get("timeoutSeconds", "1800"))
        bookmarks = _flag(q.get("allowWatchBookmarks"))

        async def send(event: dict[str, Any]) -> None:
            await resp.write(json.dumps(event).encode() + b"\n")

        if rv_text not in ("", "0") and int(rv_text) < self.compacted:
            await send({"type": "ERROR", "object": _status(
                410, "Expired", f"too old resource version: {rv_text} ({self.compacted + 1})")})
            await resp.write_eof()
            return resp
        w = _Watcher(ns, selector, request=request)
        if rv_text in ("", "0"):
            for (n, _), o in sorted(self._objects.items()):
                if n == ns and matches(o["metadata"].get("labels", {}), selector):
                    w.queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(o)})
        else:
            since = int(rv_text)
            for rv, kind, obj in self._history:
                if rv > since and obj["metadata"]["namespace"] == ns and \
                        matches(obj["metadata"].get("labels", {}), selector):
                    w.queue.put_nowait({"type": kind, "object": obj})
        self._watchers.add(w)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        next_bookmark = loop.time() + self.bookmark_interval_s
        try:
            while True:
                now = loop.time()
                if now >= deadline:
                    break
                wait = min(deadline, next_bookmark if bookmarks else deadline) - now
                try:
                    event = await asyncio.wait_for(w.queue.get(), max(0.0, wait))
                except asyncio.TimeoutError:
                    if bookmarks and loop.time() >= next_bookmark:
                        next_bookmark = loop.time() + self.bookmark_interval_s
                        await send({"type": "BOOKMARK", "object": {
                            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                            "metadata": {"resourceVersion": str(self.resource_version)}}})
                    continue
                if event is None:  # dropped: the transport is already aborted
                    return resp
                await send(event)
            await resp.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass  # the client went away
        finally:
            self._watchers.discard(w)
        return resp


@contextlib.asynccontextmanager
async def running(token: str = "emulated-token", bookmark_interval_s: float = 0.5):
    """``async with running() as api:`` a started emulator, stopped on exit."""
    api = await KubeApiEmulator(token, bookmark_interval_s).start()
    try:
        yield api
    finally:
        await api.stop()
