"""Sticky sessions: a session id pins its requests to one instance, and every router
replica finds the same instance without talking.

Two ids arrive:

* SageMaker's ``X-Amzn-SageMaker-Session-Id``: ``NEW_SESSION`` asks for a session; the
  answer's ``X-Amzn-SageMaker-New-Session-Id`` names it (``ID; Expires=...``). The id
  the client gets back ends with a *pin tag* naming the instance that served it
  (``<id>-pr<12 hex digits>``, still SageMaker's id pattern), so any replica, knowing
  the instances, reads where the session lives; the container's own id (when the
  container created one) is what reaches the container.
* any other id (a configured header such as ``X-Session-ID``, or a SageMaker id without
  a tag): pinned by rendezvous hashing of the id, the same order on every replica.

A pinned request goes to the session's instance while it is healthy and below the
threshold; otherwise along the session's rendezvous order (``overflow``), as a
``PREFIX_AWARE`` key would.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from functools import lru_cache

import xxhash

from prefixroute.core.routing_text import InvalidRequest

__all__ = ["NEW_SESSION", "SESSION_ID_MAX", "SessionPin", "instance_tag", "parse_session_id", "pin_session_id"]

#: The value that asks SageMaker (and the router) to create a session.
NEW_SESSION = "NEW_SESSION"
#: Longest session id (SageMaker's limit), characters.
SESSION_ID_MAX = 256
#: Longest id taken from a configured (non-SageMaker) session header, characters.
CUSTOM_SESSION_ID_MAX = 1024
_SAGEMAKER_ID = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*")
_TAGGED = re.compile(r"(.+)-pr([0-9a-f]{12})")
_SEED = 0x7365_7373_696F_6E  # "session"


@lru_cache(maxsize=4096)
def instance_tag(instance_id: str) -> str:
    """The 12 hex digits that name ``instance_id`` in a pinned session id."""
    return f"{xxhash.xxh3_64_intdigest(instance_id.encode(), _SEED):016x}"[:12]


@dataclass(frozen=True, slots=True)
class SessionPin:
    """A request's session.

    Attributes:
        key: 64-bit rendezvous key of the id as the client sent it.
        tag: the pin tag in the id (:func:`instance_tag` of its instance), or None.
        upstream_id: the id as the container knows it (the tag removed).
    """

    key: int
    tag: str | None
    upstream_id: str


def parse_session_id(value: str, sagemaker: bool = True) -> SessionPin | None:
    """A session header's value as a :class:`SessionPin`; ``None`` for ``NEW_SESSION``.

    Args:
        value: the header's value.
        sagemaker: ``X-Amzn-SageMaker-Session-Id`` (SageMaker's pattern: letters,
            digits and inner hyphens, at most 256); else a configured header (any
            printable ASCII, at most 1,024 characters).

    Raises:
        InvalidRequest: the value breaks those rules.
    """
    if sagemaker:
        if value == NEW_SESSION:
            return None
        if not 1 <= len(value) <= SESSION_ID_MAX or not _SAGEMAKER_ID.fullmatch(value):
            raise InvalidRequest(f"session id must be {NEW_SESSION} or 1-{SESSION_ID_MAX} letters, digits and "
                                 f"inner hyphens (got {len(value)} characters)")
    elif not 1 <= len(value) <= CUSTOM_SESSION_ID_MAX or not all(" " <= c <= "~" for c in value):
        raise InvalidRequest(f"session id must be 1-{CUSTOM_SESSION_ID_MAX} printable ASCII characters")
    key = xxhash.xxh3_64_intdigest(value.encode(), _SEED)
    tagged = _TAGGED.fullmatch(value)
    if tagged:
        return SessionPin(key, tagged.group(2), tagged.group(1))
    return SessionPin(key, None, value)


def pin_session_id(new_session_header: str | None, instance_id: str) -> str:
    """The ``X-Amzn-SageMaker-New-Session-Id`` value the client gets for a session the
    request created on ``instance_id``: the container's id (``new_session_header``, its
    ``; Expires=...`` kept) or, when the container made none, a random one, followed by
    the instance's pin tag."""
    if new_session_header:
        sid, sep, rest = new_session_header.partition(";")
        sid = sid.strip()
        if sid:
            return f"{sid}-pr{instance_tag(instance_id)}{sep}{rest}"
    return f"{secrets.token_hex(12)}-pr{instance_tag(instance_id)}"
