"""Instance health: active checks, passive detection, and the thresholds between them.

Active checks: ``GET <instance><health_check_path>`` on every instance every
``health_check_interval_s`` seconds (``/health`` for vLLM and SGLang, ``/ping`` for
SageMaker containers). A 2xx answer is a success. 429, and 503 with ``Retry-After``,
mean "alive but busy" (backpressure) and count as neither. Anything else (another
status, refused connection, timeout) is a failure.

Passive detection (:mod:`.proxy` reports what it sees on real requests): a connection
that cannot be opened (refused, unreachable, connect timeout) takes the instance out of
rotation at once, as the next request would fail the same way; a reset or a timeout
after the request was sent counts as one failure (only with active checks on, as
nothing else would bring the instance back). Answers with a status, 4xx, 429 and 5xx
included, are not failures of the instance: they are the model's answers.

:class:`HealthTracker` applies the thresholds: ``unhealthy_threshold`` consecutive
failures take an instance out, ``healthy_threshold`` consecutive successful active
checks put it back. Taking an instance out only removes it from the candidates, so
the prefix assignments of the other instances do not move (rendezvous hashing).
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

__all__ = ["ProbeResult", "HealthTracker", "probe_instance", "check_all", "health_check_loop"]

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

    def _c(self, instance_id: str) -> _Counts:
        c = self._counts.get(instance_id)
        if c is None:
            c = self._counts[instance_id] = _Counts()
        return c

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
            if not self._is(instance_id) and c.successes >= self.healthy_threshold:
                self._set(instance_id, True)
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
        c = self._counts.get(instance_id)
        if c is not None:
            c.failures = 0

    def _fail(self, instance_id: str, c: _Counts) -> None:
        c.successes = 0
        c.failures += 1
        if c.failures >= self.unhealthy_threshold and self._is(instance_id):
            self._set(instance_id, False)


async def probe_instance(session: aiohttp.ClientSession, instance_id: str, path: str,
                         timeout_s: float) -> ProbeResult:
    """``GET instance_id + path`` once, within ``timeout_s`` seconds."""
    try:
        async with session.get(instance_id + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
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
    session = state.session
    if session is None:
        return {}
    s = state.settings
    ids = state.instance_ids()
    results = await asyncio.gather(
        *(probe_instance(session, i, s.health_check_path, s.health_check_timeout_s) for i in ids))
    state.health.forget(set(ids))
    for instance_id, result in zip(ids, results):
        state.health.probe(instance_id, result)
    return dict(zip(ids, results))


async def health_check_loop(state: "RouterState") -> None:
    """Run :func:`check_all` every ``settings.health_check_interval_s`` seconds, forever,
    each round followed by asking every instance for its models
    (:func:`prefixroute.server.models.refresh_models`).

    The first round runs one interval after startup: instances start in rotation, so a
    router launched alongside its engines does not refuse traffic for a whole interval
    because they were still starting (a refused connection takes one out anyway).
    Cancel the task to stop it.
    """
    interval = state.settings.health_check_interval_s
    while True:
        await asyncio.sleep(interval)
        try:
            await check_all(state)
            await refresh_models(state)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop health checking
            log.exception("health check round failed")
