"""Retrying an instance's "not now" answer on another instance (sans-I/O).

An engine that is overloaded or rate-limited answers ``503 Service Unavailable`` or
``429 Too Many Requests``, often with ``Retry-After``. With ``--retry-status 429,503``
(off by default: SageMaker relays such answers) the router does not relay that answer
while it has sent nothing to the client and has a retry left: the request goes to an
instance not tried yet, and the refusing instance is held back from new requests for
its ``Retry-After`` (RFC 9110 §10.2.3: delay-seconds or an HTTP-date), at most
:data:`MAX_HOLD_S`, :data:`DEFAULT_HOLD_S` when the answer names no delay. A held
instance is skipped only while another candidate exists: a request whose every
candidate is held goes where it would have gone. When no other instance is left the
answer is relayed as it came, ``Retry-After`` included.

This module decides; the data planes (:mod:`prefixroute.server.proxy` and
:mod:`prefixroute.server.dataplane`) act on it, so both behave alike.
"""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime
from typing import Callable, Iterable

__all__ = ["RetryStatus", "parse_retry_after", "parse_statuses", "MAX_HOLD_S", "DEFAULT_HOLD_S",
           "RETRYABLE_STATUSES"]

#: Longest hold an answer's ``Retry-After`` can put on an instance, seconds (a larger or
#: far-future value is cut to this: one answer cannot take an instance out for long).
MAX_HOLD_S = 30.0

#: Hold of an instance whose 429/503 names no delay, seconds.
DEFAULT_HOLD_S = 1.0

#: Statuses ``--retry-status`` accepts: the "try again later" answers. Other 4xx/5xx
#: may come after the engine started generating, or are the client's fault.
RETRYABLE_STATUSES = frozenset({429, 503})


def parse_statuses(text: str) -> frozenset[int]:
    """``"429,503"`` -> ``{429, 503}``; ``""`` or ``"none"`` -> empty.

    Raises:
        ValueError: a value is not a number or not in :data:`RETRYABLE_STATUSES`.
    """
    text = text.strip()
    if text.lower() in ("", "none", "off"):
        return frozenset()
    out = set()
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) not in RETRYABLE_STATUSES:
            raise ValueError(f"{part!r} is not a status that may be retried (allowed: 429, 503)")
        out.add(int(part))
    return frozenset(out)


def parse_retry_after(value: str | bytes | None, now_wall: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` value asks to wait, or ``None`` when absent or unreadable.

    Args:
        value: the header's value: delay-seconds (``"5"``) or an HTTP-date
            (``"Fri, 04 Dec 2026 20:00:00 GMT"``), RFC 9110 §10.2.3.
        now_wall: the wall clock (``time.time()``) an HTTP-date is read against.

    Returns:
        seconds >= 0 (a date in the past gives 0).
    """
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    value = value.strip()
    if not value.isascii():  # ("²".isdigit() is true)
        return None
    if value.isdigit():
        return float(int(value)) if len(value) <= 12 else 1e12  # (a huge delay: then held the longest allowed)
    if len(value) > 64:  # (an HTTP date is under 40 characters)
        return None
    try:
        when = parsedate_to_datetime(value)
        if when is None or when.tzinfo is None:
            return None
        now = time.time() if now_wall is None else now_wall
        return max(0.0, when.timestamp() - now)
    except Exception:  # (the parser raises TypeError, ValueError, IndexError, OverflowError... on odd input)
        return None


class RetryStatus:
    """Which answers are retried, and which instances are held back after one.

    Args:
        statuses: the statuses retried (a subset of :data:`RETRYABLE_STATUSES`); empty:
            off, every answer is relayed.
        clock: monotonic seconds (``time.monotonic``; a test passes its own).

    Attributes:
        statuses: as given.
        holds: instance id -> monotonic second its hold ends.
    """

    __slots__ = ("statuses", "holds", "_clock")

    def __init__(self, statuses: Iterable[int] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.statuses = frozenset(statuses)
        bad = self.statuses - RETRYABLE_STATUSES
        if bad:
            raise ValueError(f"statuses {sorted(bad)} may not be retried (allowed: 429, 503)")
        self.holds: dict[str, float] = {}
        self._clock = clock

    def retries(self, status: int, retries_left: int) -> bool:
        """Whether an answer with ``status`` is retried (nothing of it has reached the
        client; ``retries_left`` is what ``--max-retries`` still allows)."""
        return retries_left > 0 and status in self.statuses

    def hold(self, instance: str, retry_after: str | bytes | None) -> float:
        """``instance`` answered a retried status with ``retry_after`` (the header's
        value or ``None``): it is held back from new requests; returns the hold, seconds."""
        asked = parse_retry_after(retry_after)
        hold = DEFAULT_HOLD_S if asked is None else min(asked, MAX_HOLD_S)
        if hold > 0:
            until = self._clock() + hold
            if until > self.holds.get(instance, 0.0):
                self.holds[instance] = until
        return hold

    def held(self) -> frozenset[str]:
        """Instances held back now (expired holds are dropped)."""
        holds = self.holds
        if not holds:
            return frozenset()
        now = self._clock()
        for instance in [i for i, until in holds.items() if until <= now]:
            del holds[instance]
        return frozenset(holds)
