"""One request's attempts at the instances, decided without I/O.

Both data planes (:mod:`prefixroute.server.proxy`, aiohttp; :mod:`prefixroute.server.dataplane`,
raw protocols) send a request and read the answer their own way, and ask an
:class:`Attempts` what each outcome means: another attempt, an error answer of the
router's own, or the instance's answer relayed. Each answer is a :class:`Step` naming
everything a plane then does: the retry reason counted, the upstream error kind, the
instance's health, the log line, the client's status. The rules, in one place:

* retried on another instance (at most ``max_retries`` times) only when the instance
  cannot have started the request: the connection could not be opened, or it was lost
  before the request was written in full;
* a kept-alive connection lost before any byte of an answer (the engine closed it idle
  as the request went out): sent once more, on a new connection, not a health failure;
* lost after the request was sent, or no answer head in time: an error answer (502,
  504; SageMaker's routes 424), never retried (the engine may be generating);
* an unsolicited ``101 Switching Protocols``: never relayed, a 502;
* a 429 or 503 with ``--retry-status``: sent elsewhere when an instance is left
  (:mod:`prefixroute.core.retry_status`);
* anything else: relayed, and the instance counts as healthy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prefixroute.core.retry_status import RetryStatus

__all__ = ["Attempts", "Next", "Step", "STALE_WINDOW_S"]

#: Longest time from sending a request on a kept-alive connection to that connection's
#: failure that counts as the keep-alive race (the engine closed the connection idle as
#: the request went out; its close arrives within a round trip), seconds.
STALE_WINDOW_S = 0.05


class Next(enum.Enum):
    """What a data plane does after an outcome."""

    RETRY = "retry"  # a new attempt (a new lease, excluding Attempts.exclude), if one is left
    TRY_ELSEWHERE = "try_elsewhere"  # a 429/503: an instance not tried yet if there is one, else RELAY
    ERROR = "error"  # answer Step.status (an error of the router's own)
    RELAY = "relay"  # relay the instance's answer


@dataclass(frozen=True, slots=True)
class Step:
    """The decision on one outcome.

    Attributes:
        next: what to do.
        reason: ``prefixroute_retries_total{reason}`` of the next attempt (``connect``,
            ``send``, ``stale_connection``, ``http_429``...), and the request's recorded
            error; ``None`` when not retried.
        error_kind: ``prefixroute_upstream_errors_total{kind}`` to count, or ``None``.
        health: ``"definitive"`` (out of rotation at once), ``"failure"`` (a passive
            failure), ``"success"`` or ``None`` (no health signal).
        count_routed: the instance took the request (``requests_total`` counts it).
        status: with ``ERROR``, the HTTP status of the answer (OpenAI's routes; the
            SageMaker routes answer 424 ``ModelError`` for 502 and 504).
        code: with ``ERROR``, the error code in the answer's body.
        message: with ``ERROR``, the answer's message; else ``""``.
        log: a line to log (no request text in it), or ``""``.
        log_warning: log it as a WARNING (else INFO).
        fresh_connection: the next attempt opens a new connection.
    """

    next: Next
    reason: str | None = None
    error_kind: str | None = None
    health: str | None = None
    count_routed: bool = False
    status: int = 0
    code: str = ""
    message: str = ""
    log: str = ""
    log_warning: bool = True
    fresh_connection: bool = False

    def client_status(self, openai: bool) -> int:
        """The status the client gets for an ``ERROR`` (what ``responses_total`` counts):
        ``status`` on OpenAI's routes, 424 on SageMaker's."""
        return self.status if openai else 424


class Attempts:
    """The attempts of one request.

    Args:
        max_retries: ``--max-retries``.
        retry_status: the router's :class:`~prefixroute.core.retry_status.RetryStatus`.

    Attributes:
        exclude: instances this request must not be sent to again.
        index: the attempt under way, from 0.
    """

    __slots__ = ("max_retries", "retry_status", "exclude", "index", "_stale_retried")

    def __init__(self, max_retries: int, retry_status: RetryStatus) -> None:
        self.max_retries = max_retries
        self.retry_status = retry_status
        self.exclude: set[str] = set()
        self.index = 0
        self._stale_retried = False

    @property
    def left(self) -> int:
        """Retries left after the attempt under way."""
        return self.max_retries - self.index

    def connect_failed(self, instance: str, exc_name: str, timed_out: bool = False) -> Step:
        """No connection to ``instance`` could be opened (nothing was sent). Refused or
        unreachable (``timed_out`` false): out of rotation at once, as the next request
        would fail the same way. Not accepted within the connect timeout: one passive
        failure (out after ``unhealthy_threshold`` in a row, a streak any answer ends), as
        an engine whose listen queue is full under load still answers on the
        connections it has; taking it out at once took every engine of an overloaded
        fleet out of rotation on every replica (Envoy too counts connect failures toward
        ejection rather than ejecting at the first)."""
        self.exclude.add(instance)
        return Step(Next.RETRY, reason="connect", error_kind="connect",
                    health="failure" if timed_out else "definitive",
                    log=f"instance {instance}: connect failed ({exc_name})")

    def lost(self, instance: str, kind: str, sent: bool, reused: bool, after_s: float = 0.0) -> Step:
        """The connection failed before the answer's head (``kind``: ``reset``,
        ``disconnect``, ``timeout``, ``other``); ``sent``: the request was written in full;
        ``reused``: the connection had carried an earlier exchange; ``after_s``: seconds
        from sending the request to the failure. Only a failure within
        :data:`STALE_WINDOW_S` of sending on a reused connection is the keep-alive race
        (the engine closed it idle as the request went out); a later one may be an engine
        that failed while generating, and is not sent again."""
        if reused and after_s <= STALE_WINDOW_S and not self._stale_retried and self.left > 0:
            self._stale_retried = True
            return Step(Next.RETRY, reason="stale_connection", error_kind="stale_connection", log_warning=False,
                        fresh_connection=True,
                        log=f"instance {instance}: a kept-alive connection failed before any answer ({kind}): the "
                            "request is sent again on a new connection")
        if not sent:
            self.exclude.add(instance)
            return Step(Next.RETRY, reason="send", error_kind="send", health="failure",
                        log=f"instance {instance}: connection lost while sending the request ({kind})")
        return Step(Next.ERROR, error_kind=kind, health="failure", count_routed=True, status=502,
                    code="upstream_error", message=f"instance {instance} failed before responding ({kind})",
                    log=f"instance {instance}: failed before responding ({kind})")

    def invalid(self, instance: str, what: str) -> Step:
        """The instance answered with something that is not an HTTP answer to this
        request (an unsolicited ``101``, a malformed head): a 502, never sent again."""
        return Step(Next.ERROR, error_kind="invalid_response", health="failure", count_routed=True, status=502,
                    code="upstream_error", message=f"instance {instance} failed before responding "
                                                   "(invalid_response)",
                    log=f"instance {instance}: invalid HTTP response ({what})")

    def headers_timeout(self, instance: str, timeout_s: float) -> Step:
        """No answer head within ``timeout_s`` of sending."""
        return Step(Next.ERROR, error_kind="headers_timeout", health="failure", count_routed=True, status=504,
                    code="upstream_timeout",
                    message=f"instance {instance} timed out: no response headers within {timeout_s:g} s")

    def answered(self, instance: str, status: int) -> Step:
        """The instance's answer head came, with ``status``."""
        if status < 200:  # an unsolicited 101 (the parsers skip the other 1xx)
            return self.invalid(instance, f"an unsolicited {status} to a request that asked for no protocol change")
        if self.retry_status.retries(status, self.left):
            return Step(Next.TRY_ELSEWHERE, reason=f"http_{status}")
        return RELAY

    def relay(self) -> Step:
        """A 429/503 that no other instance can take: relayed after all."""
        return RELAY


#: The instance's answer is relayed (it took the request, and it is alive).
RELAY = Step(Next.RELAY, health="success", count_routed=True)
