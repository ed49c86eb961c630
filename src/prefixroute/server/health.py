"""Instance health: active checks, passive detection, and the thresholds between them.

Active checks: ``GET <instance><health_check_path>`` on every instance every
``health_check_interval_s`` seconds (``/health`` for vLLM and SGLang, ``/ping`` for
SageMaker containers). A 2xx answer is a success. 429, and 503 with ``Retry-After``,
mean "alive but busy" (backpressure) and count as neither. Anything else (another
status, refused connection, timeout) is a failure.

Passive detection (:mod:`.proxy` reports what it sees on real requests): a connection
that cannot be opened (refused, unreachable) takes the instance out of rotation at once,
as the next request would fail the same way; a connection not accepted within the
connect timeout (an engine whose listen queue is full under load), a reset or a timeout
after the request was sent counts as one failure (only with active checks on, as
nothing else would bring the instance back). Answers with a status, 4xx, 429 and 5xx
included, are not failures of the instance: they are the model's answers.

:class:`HealthTracker` applies the thresholds: ``unhealthy_threshold`` consecutive
failures take an instance out, ``healthy_threshold`` consecutive successful active
checks put it back. Taking an instance out only removes it from the candidates, so
the prefix assignments of the other instances do not move (rendezvous hashing).

An instance not yet seen up (no successful check, no answer to a request since the
router started or since it was configured) is in rotation on trust, as a new server
is in HAProxy: its first failed check takes it out and its first successful one puts
it back, without waiting for either threshold. The first round of checks runs as the
router starts, so an instance that is down at start is known within one check
timeout; :func:`readiness` tells ``/health`` what to answer meanwhile.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import aiohttp

from prefixroute.server.models import refresh_models

if TYPE_CHECKING:
    from prefixroute.server.state import RouterState

__all__ = ["ProbeResult", "HealthTracker", "Readiness", "readiness", "probe_instance", "check_all",
           "health_check_loop"]

log = logging.getLogger("prefixroute.server.health")


class ProbeResult(enum.Enum):
    """Outcome of one active health check."""

    OK = "ok"
    BUSY = "busy"  # 429, or 503 with Retry-After: alive, shedding load
    FAILED = "failed"


@dataclass(slots=True)
class _Counts:
    failures: int = 0  # consecutive
    successes: int = 0  # consecutive, active checks only
    seen_up: bool = False  # a check succeeded or a request was answered since it was configured


class HealthTracker:
    """Consecutive-failure and consecutive-success counting per instance (no I/O).

    Args:
        set_healthy: puts an instance in (``True``) or out of (``False``) rotation.
        is_healthy: whether an instance is in rotation now.
        unhealthy_threshold: consecutive failures that take an instance out.
        healthy_threshold: consecutive successful active checks that put it back.
        active_checks: whether active checks run. Without them nothing would bring an
            instance back, so only a connection that cannot be opened takes one out
            (resets and timeouts of real requests are then only counted).
    """

    def __init__(self, set_healthy: Callable[[str, bool], None], is_healthy: Callable[[str], bool],
                 unhealthy_threshold: int, healthy_threshold: int, active_checks: bool = True) -> None:
        self._set = set_healthy
        self._is = is_healthy
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self.active_checks = active_checks
        self._counts: dict[str, _Counts] = {}
        #: Rounds of active checks completed (:func:`check_all`).
        self.rounds = 0
        #: Set once a round found every production variant with a healthy instance
        #: (:func:`readiness`); it stays set.
        self.ready = not active_checks

    def _c(self, instance_id: str) -> _Counts:
        c = self._counts.get(instance_id)
        if c is None:
            c = self._counts[instance_id] = _Counts()
        return c

    def state(self, instance_id: str) -> tuple[int, int, bool]:
        """``(consecutive failures, consecutive successful checks, seen up)`` of an
        instance (what the status page shows next to its health)."""
        c = self._counts.get(instance_id)
        return (c.failures, c.successes, c.seen_up) if c is not None else (0, 0, False)

    def forget(self, keep: set[str]) -> None:
        """Drop the counts of instances no longer configured."""
        for i in [i for i in self._counts if i not in keep]:
            del self._counts[i]

    def probe(self, instance_id: str, result: ProbeResult) -> None:
        """Record an active check."""
        if result is ProbeResult.BUSY:
            return
        c = self._c(instance_id)
        if result is ProbeResult.OK:
            c.failures = 0
            c.successes += 1
            first = not c.seen_up
            c.seen_up = True
            if not self._is(instance_id) and (first or c.successes >= self.healthy_threshold):
                self._set(instance_id, True)
        elif not c.seen_up:  # never seen up: no threshold to wait for
            c.successes = 0
            c.failures += 1
            if self._is(instance_id):
                self._set(instance_id, False)
        else:
            self._fail(instance_id, c)

    def passive_failure(self, instance_id: str, *, definitive: bool = False) -> None:
        """Record a failure seen on a real request; ``definitive`` (the connection could
        not be opened) takes the instance out at once."""
        c = self._c(instance_id)
        if definitive:
            c.failures = max(c.failures, self.unhealthy_threshold - 1)
        elif not self.active_checks:
            c.failures += 1
            return
        self._fail(instance_id, c)

    def passive_success(self, instance_id: str) -> None:
        """A real request got an answer: the failure streak is over (the instance stays
        out of rotation if it is out, until active checks bring it back)."""
        c = self._c(instance_id)
        c.failures = 0
        c.seen_up = True

    def _fail(self, instance_id: str, c: _Counts) -> None:
        c.successes = 0
        c.failures += 1
        if c.failures >= self.unhealthy_threshold and self._is(instance_id):
            self._set(instance_id, False)


async def probe_instance(session: aiohttp.ClientSession, instance_id: str, path: str,
                         timeout_s: float) -> ProbeResult:
    """``GET instance_id + path`` once, within ``timeout_s`` seconds. :func:`check_all`
    gives a ``session`` whose connections close after each check: a check then proves
    the instance accepts connections, which a pooled keep-alive connection would not,
    and leaves no idle connection in the pool that inference requests use."""
    try:
        async with session.get(instance_id + path, timeout=aiohttp.ClientTimeout(total=timeout_s),
                               headers={"Connection": "close"}) as resp:
            await resp.read()
            if 200 <= resp.status < 300:
                return ProbeResult.OK
            if resp.status == 429 or (resp.status == 503 and "Retry-After" in resp.headers):
                return ProbeResult.BUSY
            return ProbeResult.FAILED
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return ProbeResult.FAILED


async def check_all(state: "RouterState") -> dict[str, ProbeResult]:
    """Probe every configured instance once, concurrently, and record the results.

    Returns:
        ``{instance_url: result}``.
    """
    s = state.settings
    ids = state.instance_ids()
    # A session of the round's own whose connections close after each check (see
    # probe_instance): not the inference pool's.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                     trust_env=False) as session:
        results = await asyncio.gather(
            *(probe_instance(session, i, s.health_check_path, s.health_check_timeout_s) for i in ids))
    tracker = state.health
    tracker.forget(set(ids))
    for instance_id, result in zip(ids, results):
        tracker.probe(instance_id, result)
    tracker.rounds += 1
    if not tracker.ready and not readiness(state).down:
        tracker.ready = True
        log.info("every production variant has a healthy instance: ready")
    return dict(zip(ids, results))


@dataclass(frozen=True, slots=True)
class Readiness:
    """What ``GET /health`` answers (:func:`readiness`).

    Attributes:
        status: ``ok`` (200): every production variant has a healthy instance;
            ``degraded`` (200): some have none (named in ``down``), the others serve
            untargeted traffic; ``starting`` (503): the first round of checks has not
            finished, or since the router started no round has found every variant
            with a healthy instance; ``unavailable`` (503): no instance is healthy.
        down: ``"endpoint/variant"`` of each variant with no healthy instance, in
            configuration order.
        healthy: instances in rotation (an instance in two variants counts twice).
        total: instances configured (counted the same way).
    """

    status: str
    down: tuple[str, ...]
    healthy: int
    total: int

    @property
    def http_status(self) -> int:
        return 200 if self.status in ("ok", "degraded") else 503

    def message(self) -> str:
        """One line for an operator."""
        if self.status == "ok":
            return f"{self.healthy} of {self.total} instances healthy"
        names = ", ".join(self.down)
        if self.status == "starting":
            return ("starting: waiting for the first health checks" if not self.down else
                    f"starting: no healthy instance yet in production variant(s) {names}")
        if self.status == "unavailable":
            return "no instance is healthy"
        return f"degraded: no healthy instance in production variant(s) {names}; the others take the traffic"


def readiness(state: "RouterState") -> Readiness:
    """The router's health as ``/health`` reports it (see :class:`Readiness`).

    Before the first round of active checks has finished, and until a round has found
    every production variant with a healthy instance, the router is ``starting``
    (instances are in rotation on trust until checked, so their flags alone would say
    200 for a fleet that is down). Without active checks it is ready at once.
    """
    healthy = total = 0
    down = []
    for endpoint, pool in state.fleet.all_pools():
        if pool.component:  # a component's copies are its variant's instances, counted there
            continue
        n = sum(1 for inst in pool.instances if inst.healthy)
        healthy += n
        total += len(pool.instances)
        if n == 0:
            down.append(f"{endpoint}/{pool.name}")
    tracker = state.health
    if tracker.active_checks and (tracker.rounds == 0 or not tracker.ready):
        status = "starting"
    elif healthy == 0:
        status = "unavailable"
    else:
        status = "degraded" if down else "ok"
    return Readiness(status, tuple(down), healthy, total)


async def health_check_loop(state: "RouterState") -> None:
    """Run :func:`check_all` at once, then every ``settings.health_check_interval_s``
    seconds, forever, each round followed by asking every instance for its models
    (:func:`prefixroute.server.models.refresh_models`). Cancel the task to stop it.

    The first round runs as the router starts: an instance down at start is out of
    rotation within one check timeout, and one still starting is back at the first
    round that finds it up (its first success is enough: it was never seen up), at most
    one interval later.
    """
    interval = state.settings.health_check_interval_s
    while True:
        try:
            await check_all(state)
            await refresh_models(state)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop health checking
            log.exception("health check round failed")
        await asyncio.sleep(interval)
