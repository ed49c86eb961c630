"""Growing a LoRA adapter's sticky set: loading it on another instance (and unloading
another adapter's spare or idle copy there first when its slots are full), with vLLM's
API.

The I/O driver of :func:`prefixroute.core.adapters.plan_load`, used only with the
endpoint's ``LoraAdapters.Autoload`` (opt-in). When a request's adapter has a saturated
sticky set (every instance of it at ``ConcurrencyThreshold``), an empty one, or none of
it healthy, :meth:`LoraManager.grow`:

1. plans a load (:func:`~prefixroute.core.adapters.plan_load`: the least loaded
   instance of the adapter's base model with a free adapter slot, or a copy of another
   adapter to unload there: one idle, no request for it for ``IdleSeconds`` (never merely
   nothing in flight at that instant), or, to place an adapter loaded nowhere, a spare
   copy of an adapter loaded elsewhere too with nothing in flight);
2. takes the adapter to unload out of its sticky set at once, waits until this router
   has no request in flight for it there, and sends ``POST /v1/unload_lora_adapter
   {"lora_name": ...}``;
3. sends ``POST /v1/load_lora_adapter {"lora_name": ..., "lora_path": ...}``; on success
   the adapter joins the instance's sticky set, and the waiting requests are routed
   again within the grown set.

One load per adapter at a time: every request that finds the set saturated while it
runs waits for that same load (so none waits longer than one load), and a client that
leaves does not cancel it. Every load and unload is logged (INFO; a failure WARNING)
and counted (``prefixroute_adapter_loads_total``, ``prefixroute_adapter_unloads_total``,
``prefixroute_adapter_load_seconds``). vLLM answers these routes only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; its errors are 400 or 404 with an OpenAI
error body (``vllm/entrypoints/openai/models/serving.py``). "already been loaded" is
taken as success (another router replica loaded it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import aiohttp
import orjson

from prefixroute.core.adapters import LoadPlan, plan_load
from prefixroute.server.models import control_session

if TYPE_CHECKING:
    from prefixroute.server.proxy import RoutedRequest
    from prefixroute.server.state import RouterState

__all__ = ["LoraManager", "LoadFailed"]

log = logging.getLogger("prefixroute.server.lora")

#: How often an unload waits to see its adapter's last request end, seconds.
_DRAIN_POLL_S = 0.01


class LoadFailed(Exception):
    """An instance refused or failed a load or unload (the message says which and why)."""


class LoraManager:
    """Loads and unloads adapters for one router process (see the module docstring).

    Args:
        state: the router's state (its catalog, tracker, fleet, metrics, HTTP session).
    """

    def __init__(self, state: "RouterState") -> None:
        self.state = state
        self._loads: dict[str, asyncio.Task[bool]] = {}
        self._warned = False

    def autoload_for(self, endpoint: str) -> bool:
        """Whether endpoint ``endpoint`` has ``LoraAdapters.Autoload`` on. Never in a
        worker of ``serve --workers N`` (refused at start; a reload that turns it on
        is not acted on there): a worker does not see the others' requests in flight
        for an adapter, so it could unload one under them."""
        ep = self.state.fleet.endpoints.get(endpoint)
        if ep is None or not ep.config.lora.autoload:
            return False
        if self.state.metrics.multiprocess:
            if not self._warned:
                self._warned = True
                log.warning("LoraAdapters.Autoload is not acted on with --workers N (one router process only)")
            return False
        return True

    async def grow(self, rr: "RoutedRequest", empty: bool) -> bool:
        """Load ``rr``'s adapter where its sticky set can grow (or wait for the load of
        it already under way). ``empty``: the set has no healthy instance (then a spare
        copy of another adapter may be unloaded to make room; a merely saturated set
        takes only free slots and idle copies). Returns whether the adapter is now
        loaded on one more instance; ``False`` when no instance can take it (no free
        slot, no copy that may be unloaded) or the load failed."""
        sel = rr.selection
        assert sel is not None and sel.adapter is not None
        adapter = sel.adapter
        task = self._loads.get(adapter)
        if task is None:
            plan = self._plan(rr, empty)
            if plan is None:
                # (one line per refused request: budgeted, as the router's other refusals)
                self.state.observers.log_budgeted(
                    f"LoRA adapter {adapter}: its sticky set cannot grow (no instance of its base model with a "
                    "free slot or a copy of another adapter that may be unloaded)")
                return False
            task = asyncio.get_running_loop().create_task(self._run(plan, rr.endpoint), name=f"lora-load-{adapter}")
            self._loads[adapter] = task
            task.add_done_callback(lambda _t, a=adapter: self._loads.pop(a, None))
        return await asyncio.shield(task)

    def _plan(self, rr: "RoutedRequest", empty: bool) -> LoadPlan | None:
        state = self.state
        sel = rr.selection
        lora = state.fleet.endpoint(rr.endpoint).config.lora
        declared = lora.path_of(sel.adapter)
        path = declared.path if declared is not None else state.catalog.adapter_root(sel.adapter)
        if path is None:
            return None
        parent = sel.parent or (declared.base_model if declared is not None else None)

        def evictable(name: str) -> bool:  # the router can load it back
            return lora.path_of(name) is not None or state.catalog.adapter_root(name) is not None

        candidates = [i for i in rr.pool.instances if i.healthy]
        plan = plan_load(sel.adapter, path, parent, candidates, state.catalog, state.adapter_tracker,
                         lora.max_adapters_per_instance, evictable, idle_s=lora.idle_after_s, empty=empty)
        if plan is None:
            return None
        tracker = state.adapter_tracker
        tracker.loading[plan.adapter] = plan.instance_id
        if plan.evict is not None:  # out of its sticky set now: no new request goes there for it
            tracker.unloading.add((plan.instance_id, plan.evict))
            state.catalog.adapter_unloading(plan.instance_id, plan.evict)
            state.models_changed()
        return plan

    async def _run(self, plan: LoadPlan, endpoint: str) -> bool:
        state = self.state
        tracker = state.adapter_tracker
        m = state.metrics
        t0 = time.perf_counter()
        timeout = state.fleet.endpoints[endpoint].config.lora.load_timeout_s if endpoint in state.fleet.endpoints \
            else 60.0
        try:
            async with asyncio.timeout(timeout):
                if plan.evict is not None:
                    await self._unload(plan.instance_id, plan.evict)
                await self._post(plan.instance_id, "/v1/load_lora_adapter",
                                 {"lora_name": plan.adapter, "lora_path": plan.path}, already_ok="already been loaded")
        except (LoadFailed, TimeoutError, aiohttp.ClientError, OSError) as exc:
            m.adapter_loads.labels(plan.instance_id, plan.adapter, "failed").inc()
            log.warning("LoRA adapter %s: load on %s failed: %s", plan.adapter, plan.instance_id,
                        str(exc) or type(exc).__name__)
            return False
        finally:
            tracker.loading.pop(plan.adapter, None)
            if plan.evict is not None:
                tracker.unloading.discard((plan.instance_id, plan.evict))
        elapsed = time.perf_counter() - t0
        tracker.loaded(plan.instance_id, plan.adapter)
        state.catalog.adapter_loaded(plan.instance_id, plan.adapter, plan.parent, plan.path)
        state.models_changed()
        m.adapter_loads.labels(plan.instance_id, plan.adapter, "ok").inc()
        m.adapter_load_seconds.labels(plan.instance_id).observe(elapsed)
        log.info("LoRA adapter %s loaded on %s in %.3f s (sticky set: %d instance(s))", plan.adapter,
                 plan.instance_id, elapsed, len(state.catalog.serving(plan.adapter)))
        return True

    async def _unload(self, instance_id: str, adapter: str) -> None:
        """Unload ``adapter`` from ``instance_id`` once this router has no request in
        flight for it there (it already left the sticky set)."""
        tracker = self.state.adapter_tracker
        while tracker.in_flight(instance_id, adapter):
            await asyncio.sleep(_DRAIN_POLL_S)
        try:
            await self._post(instance_id, "/v1/unload_lora_adapter", {"lora_name": adapter},
                             already_ok="cannot be found")
        except (LoadFailed, aiohttp.ClientError, OSError) as exc:
            self.state.metrics.adapter_unloads.labels(instance_id, adapter, "failed").inc()
            log.warning("LoRA adapter %s: unload from %s failed: %s", adapter, instance_id, exc)
            raise LoadFailed(f"the unload of {adapter} to make room failed: {exc}") from None
        tracker.forget(instance_id, adapter)
        self.state.metrics.adapter_unloads.labels(instance_id, adapter, "ok").inc()
        log.info("LoRA adapter %s unloaded from %s (nothing in flight for it there; its slot is needed)", adapter,
                 instance_id)

    async def _post(self, instance_id: str, path: str, body: dict[str, str], already_ok: str) -> None:
        if self.state.session is None:
            raise LoadFailed("the router is not running")
        async with control_session() as session, session.post(
                instance_id + path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
            text = (await resp.content.read(8192)).decode("utf-8", "replace")
        if resp.status == 200:
            return
        message = text
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            data = orjson.loads(text)
            err = data.get("error", data)
            message = str(err.get("message", text))
        if already_ok in message:
            return
        raise LoadFailed(f"{path} answered {resp.status}: {message[:300]}")

    async def close(self) -> None:
        """Wait for loads under way to end (the app's cleanup), at most a few seconds."""
        tasks = list(self._loads.values())
        if tasks:
            with contextlib.suppress(TimeoutError, Exception):
                async with asyncio.timeout(5.0):
                    await asyncio.gather(*tasks, return_exceptions=True)
