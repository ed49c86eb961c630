"""The attempt rules both data planes follow (core/attempts.py), without I/O."""

from prefixroute.core.attempts import RELAY, Attempts, Next
from prefixroute.core.retry_status import RetryStatus


def test_nothing_sent_is_retried_elsewhere_and_the_instance_excluded():
    a = Attempts(2, RetryStatus())
    step = a.connect_failed("i1", "ConnectionRefusedError")
    assert (step.next, step.reason, step.error_kind, step.health) == (Next.RETRY, "connect", "connect", "definitive")
    assert step.log == "instance i1: connect failed (ConnectionRefusedError)" and not step.count_routed
    step = a.lost("i2", "reset", sent=False, reused=False)
    assert (step.next, step.reason, step.health) == (Next.RETRY, "send", "failure")
    assert a.exclude == {"i1", "i2"}


def test_lost_after_sending_is_a_502_never_retried():
    a = Attempts(2, RetryStatus())
    step = a.lost("i1", "disconnect", sent=True, reused=False)
    assert (step.next, step.status, step.code, step.error_kind, step.health) == (
        Next.ERROR, 502, "upstream_error", "disconnect", "failure")
    assert step.count_routed and step.message == "instance i1 failed before responding (disconnect)"
    assert (step.client_status(True), step.client_status(False)) == (502, 424)
    assert a.exclude == set()


def test_a_kept_alive_connection_is_retried_once_on_a_new_one_while_retries_are_left():
    a = Attempts(2, RetryStatus())
    step = a.lost("i1", "reset", sent=True, reused=True)
    assert (step.next, step.reason, step.health, step.fresh_connection) == (Next.RETRY, "stale_connection", None, True)
    assert not step.log_warning and a.exclude == set()
    a.index = 1
    assert a.lost("i1", "reset", sent=True, reused=True).next is Next.ERROR  # once only
    b = Attempts(0, RetryStatus())
    assert b.lost("i1", "reset", sent=True, reused=True).next is Next.ERROR  # no retry left


def test_headers_timeout_and_answers():
    a = Attempts(1, RetryStatus({503}))
    step = a.headers_timeout("i1", 600.0)
    assert (step.next, step.status, step.code, step.message) == (
        Next.ERROR, 504, "upstream_timeout", "instance i1 timed out: no response headers within 600 s")
    assert a.answered("i1", 101).status == 502 and a.answered("i1", 101).error_kind == "invalid_response"
    assert a.answered("i1", 200) is RELAY and RELAY.health == "success" and RELAY.count_routed
    assert a.answered("i1", 429) is RELAY  # not in --retry-status
    step = a.answered("i1", 503)
    assert (step.next, step.reason) == (Next.TRY_ELSEWHERE, "http_503")
    a.index = 1  # the last attempt: relayed
    assert a.answered("i1", 503) is RELAY and a.relay() is RELAY
