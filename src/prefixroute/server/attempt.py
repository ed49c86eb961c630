"""What both data planes do around one attempt: claim an instance among a request's
candidates (:func:`acquire`, :func:`acquire_or_grow`: in-flight leases, held-back
instances skipped, LoRA sticky sets grown), tell the strategy where it went
(:func:`learn_route`), count a request an instance took
(:func:`count_routed`), and apply an attempt's :class:`~prefixroute.core.attempts.Step`
(:func:`apply_step`: the recorded error, upstream errors, passive health, the log line;
:func:`retry_elsewhere` for a 429/503 with ``--retry-status``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

from prefixroute.core.attempts import Next, Step
from prefixroute.core.pool import Decision, Lease, NoHealthyInstance, SetSaturated, VariantPool
from prefixroute.core.strategies import InstanceState
from prefixroute.server.state import RouterState

if TYPE_CHECKING:
    from prefixroute.server.proxy import RoutedRequest

__all__ = ["acquire", "acquire_or_grow", "learn_route", "count_routed", "apply_step", "retry_elsewhere", "client_gone"]

log = logging.getLogger("prefixroute.server.proxy")

#: Fewest seconds between two log lines of :func:`learn_route`'s failures.
LEARN_ERROR_LOG_S = 60.0
_learn_errors = 0
_learn_logged_at = 0.0


def acquire(state: RouterState, rr: RoutedRequest, exclude: set[str] | frozenset[str] = frozenset(),
            refuse_all_busy: bool = True) -> Lease:
    """Decide where ``rr`` goes among its candidates (its selection's: the instances
    serving its model, an adapter's sticky set) and claim an in-flight slot there; a
    request for a LoRA adapter also counts in flight for the adapter on that instance
    (so the adapter is never unloaded under it). ``refuse_all_busy=False``: an adapter's
    saturated set takes the request anyway (its least outstanding instance: after a
    load the request has waited for, it is not refused).

    An instance held back after a retried 429/503 (:mod:`prefixroute.core.retry_status`)
    is skipped while another candidate is left.

    Raises:
        NoHealthyInstance: no healthy, non-excluded candidate.
        SetSaturated: an adapter's sticky set is empty, or every instance of it is at
            ``ConcurrencyThreshold`` (never overflowed to an instance without it).
    """
    if state.retry_status.holds:  # (--retry-status) instances that answered 429/503 lately, while others remain
        held = state.retry_status.held()
        if held and not held <= exclude:
            try:
                return _acquire(state, rr, exclude | held, refuse_all_busy)
            except (NoHealthyInstance, SetSaturated):
                pass  # (a held instance is still better than a refusal of the router's own)
    return _acquire(state, rr, exclude, refuse_all_busy)


def learn_route(pool: VariantPool, instance: InstanceState, blocks: Sequence[int]) -> None:
    """Tell ``pool``'s strategy that a request went to ``instance``
    (:meth:`prefixroute.core.pool.VariantPool.learn`), before the router decides another
    request.

    Args:
        pool: the request's pool (``RoutedRequest.pool``).
        instance: the instance of the request's lease.
        blocks: the request's routing blocks (``RoutedRequest.blocks``: a
            :class:`~prefixroute.core.block_chain.BlockChain` for CACHE_AWARE, empty for
            strategies that keep no view).

    When: over a pooled connection, right after the send (``FrontServer.begin``, and
    ``FrontServer._forward`` for the requests its task sends); when a new connection is
    needed, before the connect; on the aiohttp data plane and in the endpoint picker,
    right after the decision. Never on a later loop turn: requests parsed in one loop
    turn are decided one after the other, and a learning deferred to the next turn left
    the decisions in between blind to each other. Every client of a benchmark starting
    at once (no connection pooled yet) then saw one instance holding their shared system
    prompt, and it got 25 of 48 new conversations (docs/BENCHMARKS.md, "Current").

    Never raises: an exception (our bug) is logged (with its traceback the first time,
    then at most once every :data:`LEARN_ERROR_LOG_S` seconds) and the request goes on,
    its blocks not learnt."""
    try:
        pool.learn(instance, blocks)
    except Exception:
        global _learn_errors, _learn_logged_at
        _learn_errors += 1
        now = time.monotonic()
        if _learn_errors == 1:
            log.exception("learning where a request went failed")
            _learn_logged_at = now
        elif now - _learn_logged_at >= LEARN_ERROR_LOG_S:
            log.error("learning where a request went failed again (%d times so far)", _learn_errors)
            _learn_logged_at = now


def _acquire(state: RouterState, rr: RoutedRequest, exclude: set[str] | frozenset[str],
             refuse_all_busy: bool) -> Lease:
    sel = rr.selection
    if sel is None:
        return rr.pool.acquire(rr.key, exclude, rr.blocks, learn=False, session=rr.session)
    if sel.adapter is None:
        return rr.pool.acquire(rr.key, exclude, rr.blocks, learn=False, session=rr.session, only=sel.only)
    if sel.only is not None and not sel.only:
        raise SetSaturated(f"LoRA adapter {sel.adapter!r} is loaded on no instance of {rr.pool.describe}")
    lease = rr.pool.acquire(rr.key, exclude, rr.blocks, learn=False, session=rr.session, only=sel.only,
                            refuse_all_busy=refuse_all_busy)
    lease.attach(state.adapter_tracker.use(lease.decision.instance.instance_id, sel.adapter))
    return lease


async def acquire_or_grow(state: RouterState, rr: RoutedRequest,
                          exclude: set[str] | frozenset[str] = frozenset()) -> Lease:
    """:func:`acquire`, and when an adapter's sticky set is saturated, empty or down
    and ``LoraAdapters.Autoload`` is on, load the adapter on another instance
    (:mod:`prefixroute.server.lora`: at most one load time, shared by every request
    waiting for that adapter) and decide again within the grown set, where the request
    is then taken even if that set is busy again (it waited one load, no more). A
    saturated set that cannot grow (no free slot, no copy of another adapter idle for
    ``IdleSeconds`` to unload) takes the request within itself, as any pool does when
    every instance is busy (``all_busy``).

    Raises:
        NoHealthyInstance, SetSaturated: as :func:`acquire`, when the set could not grow
            (and, autoload on, when it is empty).
    """
    try:
        return acquire(state, rr, exclude)
    except (SetSaturated, NoHealthyInstance) as exc:
        sel = rr.selection
        lora = state.lora
        if sel is None or sel.adapter is None or lora is None or not lora.autoload_for(rr.endpoint):
            raise
        members = sel.only if sel.only is not None else frozenset(i.instance_id for i in rr.pool.instances)
        empty = not any(i.healthy and i.instance_id in members and i.instance_id not in exclude
                        for i in rr.pool.instances)
        if await lora.grow(rr, empty):
            rr.selection = state.reselect(rr)
            return acquire(state, rr, exclude, refuse_all_busy=False)
        if isinstance(exc, SetSaturated) and not empty:
            return acquire(state, rr, exclude, refuse_all_busy=False)
        raise


def count_routed(state: RouterState, rr: RoutedRequest, decision: Decision) -> None:
    """Count a request an instance took (``requests_total``; per component copy and per
    adapter instance too, when it was for one)."""
    m = state.metrics
    instance = decision.instance.instance_id
    m.requests.labels(rr.endpoint, decision.variant, instance, decision.kind.value).inc()
    component = rr.pool.component
    if component is not None:
        m.component_requests.labels(rr.endpoint, component, instance).inc()
    sel = rr.selection
    if sel is not None and sel.adapter is not None:
        m.adapter_requests.labels(rr.endpoint, sel.adapter, instance).inc()


def client_gone(rr: RoutedRequest) -> bool:
    """Whether the aiohttp request's client connection is closed or closing."""
    request = rr.request
    transport = request.transport if request is not None else None
    return request is not None and (transport is None or transport.is_closing())


async def retry_elsewhere(state: RouterState, rr: RoutedRequest, instance: str, status: int,
                          retry_after: str | bytes | None, exclude: set[str]) -> Lease | None:
    """``instance`` answered ``status`` (429 or 503, ``--retry-status``) with nothing of it
    sent to the client yet: the lease of an instance not tried yet, or ``None`` when none
    is left (the answer is then relayed). Either way the instance is held back from new
    requests for its ``Retry-After`` and logged; with a lease it is excluded from this
    request's next attempts and counted (``upstream_errors_total{kind="http_429"|"http_503"}``;
    a relayed 503 is counted as ``http_5xx`` by the relay, as any)."""
    held_s = state.retry_status.hold(instance, retry_after)
    exclude.add(instance)
    try:
        lease = await acquire_or_grow(state, rr, exclude)
    except (NoHealthyInstance, SetSaturated):
        exclude.discard(instance)
        state.observers.log_budgeted(f"instance {instance} answered {status}, relayed (no other instance left); "
                                     f"held back from new requests for {held_s:g} s")
        return None
    state.metrics.upstream_errors.labels(instance, f"http_{status}").inc()
    state.observers.log_budgeted(f"instance {instance} answered {status}: retried on "
                                 f"{lease.decision.instance.instance_id}; held back from new requests for {held_s:g} s")
    return lease


def apply_step(state: RouterState, rr: RoutedRequest, instance: str, decision: Decision, step: Step) -> None:
    """What an attempt's :class:`~prefixroute.core.attempts.Step` says beyond the answer,
    for both data planes: the request's recorded error, ``upstream_errors_total``,
    ``requests_total``, the instance's passive health, the log line."""
    record = rr.record
    if step.reason is not None:
        record.error = step.reason
    elif step.error_kind is not None:
        record.error = step.error_kind
    if step.error_kind is not None and step.next is not Next.TRY_ELSEWHERE:  # (retry_elsewhere counts those)
        state.metrics.upstream_errors.labels(instance, step.error_kind).inc()
    if step.count_routed:
        count_routed(state, rr, decision)
    health = step.health
    if health == "success":
        state.health.passive_success(instance)
    elif health is not None:
        state.health.passive_failure(instance, definitive=health == "definitive")
    if step.log:
        (log.warning if step.log_warning else log.info)("%s", step.log)
