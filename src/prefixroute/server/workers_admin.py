"""The public admin API of ``prefixroute serve --workers N``, served by the supervisor
(:class:`prefixroute.server.workers.Supervisor` inherits it): a GET is answered from the
workers' admin APIs (``Served`` summed over them, status documents merged), a change
(PUT, ``POST /admin/reload``) goes to every worker and is answered with worker 0's
answer, or 502 if they disagree (the configuration of a worker that took it is then
pushed to the others); ``GET /admin/workers`` lists the workers."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

if TYPE_CHECKING:
    from prefixroute.core.config import FleetConfig
    from prefixroute.server.settings import ServerSettings
    from prefixroute.server.shared_counters import SharedCounters
    from prefixroute.server.workers import _Worker

log = logging.getLogger("prefixroute.server")

#: Timeout of one supervisor -> worker admin call, seconds.
_ADMIN_CALL_TIMEOUT_S = 15.0


class _PublicAdminAPI:
    """The supervisor's public admin API: the aiohttp application and its handlers.
    Mixed into :class:`~prefixroute.server.workers.Supervisor`, whose state it reads."""

    settings: ServerSettings
    port: int
    counters: SharedCounters | None
    _workers: list[_Worker]
    _config_lock: asyncio.Lock
    _call: Callable[..., Awaitable[tuple[int, bytes]]]
    _config_in_force: Callable[[], Awaitable[FleetConfig]]

    def _admin_app(self) -> web.Application:
        from prefixroute.server.admin import ADMIN_MAX_BODY_BYTES, add_status_routes, admin_middlewares
        from prefixroute.server.request_body import close_receiving_on_shutdown

        app = web.Application(client_max_size=ADMIN_MAX_BODY_BYTES,
                              middlewares=admin_middlewares(self.settings.admin_token))
        close_receiving_on_shutdown(app)
        app.router.add_get("/admin/config", self._get_config, allow_head=False)
        app.router.add_get("/admin/workers", self._get_workers, allow_head=False)
        app.router.add_get("/admin/kv-events", self._get_kv_events, allow_head=False)
        app.router.add_put("/admin/config", self._change)
        app.router.add_put("/admin/endpoints/{endpoint}/variants/{variant}/routing", self._change)
        app.router.add_put("/admin/endpoints/{endpoint}/inference-components/{component}/routing", self._change)
        app.router.add_post("/admin/reload", self._change)
        add_status_routes(app, self._get_status)
        return app

    async def _gather(self, method: str, path: str, body: bytes | None = None
                      ) -> list[tuple[_Worker, tuple[int, bytes] | BaseException]]:
        workers = [w for w in self._workers if w.serving]
        results = await asyncio.gather(*(self._call(w, method, path, body) for w in workers), return_exceptions=True)
        return list(zip(workers, results))

    async def _get_config(self, request: web.Request) -> web.Response:
        """``GET /admin/config``: the first live worker's document, ``Served`` summed
        over every worker (``InFlight`` is already the shared count)."""
        from prefixroute.server.errors import json_response

        answers = [(w, r) for w, r in await self._gather("GET", "/admin/config")
                   if not isinstance(r, BaseException) and r[0] == 200]
        if not answers:
            return json_response(503, {"message": "no worker answered"})
        docs = [orjson.loads(r[1]) for _, r in answers]  # type: ignore[index]
        served: dict[tuple[str, str, str], int] = {}
        for doc in docs:
            for key, st in _instance_states(doc):
                served[key] = served.get(key, 0) + int(st.get("Served", 0))
        for key, st in _instance_states(docs[0]):
            st["Served"] = served[key]
        return json_response(200, docs[0])

    async def _get_kv_events(self, request: web.Request) -> web.Response:
        """``GET /admin/kv-events``: each worker's precise-mode status (each worker
        subscribes to the events on its own): ``{"Workers": [{"Worker": i, ...}]}``."""
        from prefixroute.server.errors import json_response

        out = []
        for w, r in await self._gather("GET", "/admin/kv-events"):
            if not isinstance(r, BaseException) and r[0] == 200:
                out.append({"Worker": w.index, **orjson.loads(r[1])})
        if not out:
            return json_response(503, {"message": "no worker answered"})
        return json_response(200, {"Workers": out})

    async def _get_status(self, request: web.Request) -> web.Response:
        """``GET /admin/status.json``: every live worker's status document added up
        (:func:`prefixroute.server.status.merge_documents`)."""
        from prefixroute.server.errors import json_response
        from prefixroute.server.status import STATUS_JSON_PATH, merge_documents

        docs = [orjson.loads(r[1]) for _, r in await self._gather("GET", STATUS_JSON_PATH + "?raw=1")
                if not isinstance(r, BaseException) and r[0] == 200]
        if not docs:
            return json_response(503, {"message": "no worker answered"})
        doc = merge_documents(docs)
        doc["router"]["pid"] = os.getpid()
        return json_response(200, doc)

    async def _get_workers(self, request: web.Request) -> web.Response:
        """``GET /admin/workers``: each worker's pid, state, restarts, requests in
        flight (its column of the shared table), requests served and routing."""
        from prefixroute.server.errors import json_response

        answers = dict(await self._gather("GET", "/admin/config"))
        table = self.counters.table if self.counters is not None else None
        out = []
        for w in self._workers:
            entry: dict[str, Any] = {"Worker": w.index, "Pid": w.pid, "Alive": w.alive, "Listening": w.serving,
                                     "Restarts": w.restarts,
                                     "InFlight": table.worker_total(w.index) if table is not None else 0}
            r = answers.get(w)
            if r is not None and not isinstance(r, BaseException) and r[0] == 200:
                doc = orjson.loads(r[1])
                entry["Served"] = sum(int(st.get("Served", 0)) for _, st in _instance_states(doc))
                entry["RoutingConfigs"] = {f"{e['EndpointName']}/{v['VariantName']}": v["RoutingConfig"]
                                           for e in doc["Endpoints"] for v in e["ProductionVariants"]}
            out.append(entry)
        slots = {"Used": table.in_use if table is not None else 0,
                 "Capacity": table.capacity if table is not None else 0}
        return json_response(200, {"Port": self.port, "Workers": out, "SharedInFlightSlots": slots})

    async def _change(self, request: web.Request) -> web.Response:
        """A change: sent to every worker; worker 0's answer if all agree, else 502
        (and the configuration of the first worker that took the change is pushed to
        the others, so that they agree again)."""
        from prefixroute.server.errors import json_response

        from prefixroute.server.admin import read_admin_body

        # decoded: the workers get it plain (BodyRefused: the middleware)
        body = await read_admin_body(request, self.settings.client_keepalive_timeout_s)
        async with self._config_lock:
            results = await self._gather(request.method, request.path_qs, body)
            if not results:
                return json_response(503, {"message": "no worker is listening"})
            ok: list[tuple[_Worker, tuple[int, bytes]]] = []
            failed: list[str] = []
            for w, r in results:
                if isinstance(r, BaseException):
                    if w.alive:  # a worker that died gets the configuration in force when it restarts
                        failed.append(_call_failure(w.index, r))
                else:
                    ok.append((w, r))
            statuses = {r[0] for _, r in ok}
            if not failed and len(statuses) == 1:
                status, payload = ok[0][1]
                if 200 <= status < 300:
                    await self._config_in_force()
                return web.Response(status=status, body=payload, content_type="application/json")
            detail = "; ".join([f"worker {w.index}: {r[0]}" for w, r in ok] + failed)
            resynced = await self._resync([w for w, r in ok if 200 <= r[0] < 300])
            return json_response(502, {"message": f"the workers did not all take the change ({detail}); "
                                                  + ("the configuration of worker "
                                                     f"{resynced} was applied to every worker" if resynced is not None
                                                     else "their configurations may differ")})

    async def _resync(self, took: list[_Worker]) -> int | None:
        if not took:
            return None
        src = took[0]
        try:
            status, body = await self._call(src, "GET", "/admin/config")
            if status != 200:
                return None
            for w in self._workers:
                if w is not src and w.serving:
                    await self._call(w, "PUT", "/admin/config", body)
            await self._config_in_force()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.error("could not re-synchronise the workers' configurations: %s", exc)
            return None
        return src.index


def _call_failure(index: int, exc: BaseException) -> str:
    """What went wrong with an admin call to worker ``index``, for a 502's message."""
    if isinstance(exc, asyncio.TimeoutError):
        return (f"worker {index}: no answer within {_ADMIN_CALL_TIMEOUT_S:g} s (stuck or overloaded; it may "
                "still apply the change when it answers)")
    return f"worker {index}: {type(exc).__name__}: {exc}" if str(exc) else f"worker {index}: {type(exc).__name__}"


def _instance_states(doc: dict[str, Any]) -> list[tuple[tuple[str, str, str], dict[str, Any]]]:
    return [((e["EndpointName"], v["VariantName"], st["Instance"]), st)
            for e in doc.get("Endpoints", []) for v in e.get("ProductionVariants", [])
            for st in v.get("InstanceStates", [])]
