"""Per-key and per-tenant limits on request rate and concurrent requests (no I/O).

A :class:`Limits` is the limit of one API key or one tenant: a token bucket for the
rate (``rate`` tokens per second, at most ``burst`` held: the classic token bucket of
network policing, RFC 2697's committed rate and burst size) and a cap on requests in
flight. :class:`LimitState` keeps one key's or tenant's bucket and count;
:func:`admit` checks a key and its tenant together, all or nothing, and returns an
:class:`Admission` to release when the request ends, or the refusal with how long to
wait.

Time is passed in (seconds of a monotonic clock), so the logic is tested without
sleeping. Single-threaded: the router's event loop is the only caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Limits", "LimitState", "Admission", "Refusal", "admit"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Limits of one key or tenant; ``None`` = no limit of that kind.

    Attributes:
        rate: requests per second, sustained (> 0).
        burst: requests admitted at once after a quiet spell (>= 1); default
            ``max(1, ceil(rate))``, one second's worth.
        max_concurrent: requests in flight at once (>= 1).
    """

    rate: float | None = None
    burst: int | None = None
    max_concurrent: int | None = None

    @property
    def capacity(self) -> float:
        """Tokens the bucket holds when full."""
        if self.rate is None:
            return math.inf
        return float(self.burst if self.burst is not None else max(1, math.ceil(self.rate)))

    @property
    def unlimited(self) -> bool:
        return self.rate is None and self.max_concurrent is None


class LimitState:
    """The bucket and in-flight count of one key or tenant."""

    __slots__ = ("limits", "tokens", "stamp", "in_flight")

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.tokens = limits.capacity
        self.stamp = now
        self.in_flight = 0

    def set_limits(self, limits: Limits, now: float) -> None:
        """New limits (a reload): the bucket keeps its tokens, capped at the new
        capacity; requests in flight stay counted."""
        self._refill(now)
        self.limits = limits
        self.tokens = min(self.tokens, limits.capacity)

    def _refill(self, now: float) -> None:
        rate = self.limits.rate
        if rate is not None and now > self.stamp:
            self.tokens = min(self.limits.capacity, self.tokens + (now - self.stamp) * rate)
        self.stamp = max(self.stamp, now)

    def check(self, now: float) -> tuple[str, float] | None:
        """``None`` if one more request fits now, else ``(reason, seconds to wait)``:
        ``rate`` (the bucket holds less than one token) or ``concurrency``."""
        limits = self.limits
        if limits.max_concurrent is not None and self.in_flight >= limits.max_concurrent:
            return "concurrency", 1.0
        if limits.rate is not None:
            self._refill(now)
            if self.tokens < 1.0:
                return "rate", (1.0 - self.tokens) / limits.rate
        return None

    def take(self) -> None:
        """Count one admitted request (after :meth:`check` said it fits)."""
        if self.limits.rate is not None:
            self.tokens -= 1.0
        self.in_flight += 1


class Admission:
    """An admitted request's hold on its key's and tenant's in-flight counts."""

    __slots__ = ("_states",)

    def __init__(self, *states: LimitState) -> None:
        self._states: tuple[LimitState, ...] | None = states

    def release(self) -> None:
        """The request ended. Idempotent."""
        states, self._states = self._states, None
        for s in states or ():
            s.in_flight -= 1


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was not admitted.

    Attributes:
        scope: ``key`` or ``tenant``.
        reason: ``rate`` or ``concurrency``.
        retry_after_s: whole seconds to wait (``Retry-After``), at least 1.
    """

    scope: str
    reason: str
    retry_after_s: int

    @property
    def outcome(self) -> str:
        """The metrics label: ``rate_limited``, ``concurrency_limited``,
        ``tenant_rate_limited`` or ``tenant_concurrency_limited``."""
        return ("tenant_" if self.scope == "tenant" else "") + ("rate_limited" if self.reason == "rate"
                                                                else "concurrency_limited")


def admit(key: LimitState, tenant: LimitState | None, now: float) -> Admission | Refusal:
    """Admit one request of a key (and its tenant) at ``now``, or say why not.

    Both are checked before either is charged: a request the tenant refuses costs the
    key nothing, and the other way round."""
    for scope, state in (("key", key), ("tenant", tenant)):
        if state is None:
            continue
        refused = state.check(now)
        if refused is not None:
            reason, wait = refused
            return Refusal(scope, reason, max(1, math.ceil(wait)))
    key.take()
    if tenant is None:
        return Admission(key)
    tenant.take()
    return Admission(key, tenant)
