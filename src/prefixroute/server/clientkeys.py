"""Client API keys: who may call the inference routes, and with which limits.

Off unless configured. Keys come from a YAML (or JSON) file (``--api-keys-file``)
and/or the environment (``PREFIXROUTE_API_KEYS``); the file is re-read on SIGHUP (and
``POST /admin/reload``). A request presents its key as ``Authorization: Bearer KEY``
(what the ``openai`` client sends) or ``x-api-key: KEY`` (for clients that sign
``Authorization`` themselves, as boto3 does); ``x-api-key`` wins when both are there.

File::

    Keys:
      - Name: team-a                 # shown in logs and metrics; the key never is
        Key: sk-team-a-5d1c...       # the secret itself, or:
        # KeySha256: 9f86d0...       # its SHA-256 in hex: the file then holds no secret
        Tenant: acme                 # optional: keys of one tenant share its limits too
        RequestsPerSecond: 20        # optional per-key limits
        Burst: 40
        MaxConcurrent: 8
    Tenants:
      - Name: acme
        RequestsPerSecond: 100
        MaxConcurrent: 32
    Defaults:                        # limits of keys that set none (those from the environment too)
      RequestsPerSecond: 10
      MaxConcurrent: 4

Environment: ``PREFIXROUTE_API_KEYS="name1:key1,name2:key2"`` (a bare ``key`` is named
``env-1``, ``env-2``... in order).

Comparison is in constant time: the key presented is hashed (SHA-256) and looked up by
digest, and the digest found is compared with :func:`hmac.compare_digest`; how long a
check takes tells nothing about how much of a key was right. Keys are never logged,
forwarded to the engines (the header that carried one is dropped) or shown; the admin
API keeps its own token.

Limits (:mod:`.limits`) are per router process: with ``serve --workers N`` each worker
enforces them on the requests it serves.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefixroute.core.config import ConfigError, parse_model
from prefixroute.server.limits import Admission, Limits, LimitState, Refusal, admit

__all__ = ["ApiKey", "KeysConfig", "ClientAuth", "Identity", "load_keys", "ENV_VAR", "presented_key"]

log = logging.getLogger("prefixroute.server")

#: The environment variable holding keys: ``name:key,name:key`` (or bare keys).
ENV_VAR = "PREFIXROUTE_API_KEYS"


class _LimitFields(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    rate: float | None = Field(default=None, alias="RequestsPerSecond", gt=0, le=1e6)
    burst: int | None = Field(default=None, alias="Burst", ge=1, le=10_000_000)
    max_concurrent: int | None = Field(default=None, alias="MaxConcurrent", ge=1, le=1_000_000)

    def limits(self) -> Limits:
        return Limits(self.rate, self.burst, self.max_concurrent)


class ApiKey(_LimitFields):
    """One key: its name, its secret (or the secret's SHA-256), its tenant and limits."""

    name: str = Field(alias="Name", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:@/-]+$")
    key: str | None = Field(default=None, alias="Key", min_length=8, max_length=512, repr=False)
    key_sha256: str | None = Field(default=None, alias="KeySha256", pattern=r"^[0-9a-fA-F]{64}$")
    tenant: str | None = Field(default=None, alias="Tenant", min_length=1, max_length=64)

    @model_validator(mode="after")
    def _one_secret(self) -> "ApiKey":
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of Key and KeySha256")
        if self.key is not None and (not self.key.isprintable() or self.key != self.key.strip()):
            raise ValueError("Key must be printable, without surrounding spaces")
        return self

    @property
    def digest(self) -> bytes:
        """SHA-256 of the key (32 bytes)."""
        if self.key is not None:
            return hashlib.sha256(self.key.encode()).digest()
        assert self.key_sha256 is not None
        return bytes.fromhex(self.key_sha256)

    @property
    def has_limits(self) -> bool:
        return not (self.rate is None and self.burst is None and self.max_concurrent is None)


class _Tenant(_LimitFields):
    name: str = Field(alias="Name", min_length=1, max_length=64)


class KeysConfig(BaseModel):
    """A validated keys file (see the module docstring)."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    keys: tuple[ApiKey, ...] = Field(default=(), alias="Keys")
    tenants: tuple[_Tenant, ...] = Field(default=(), alias="Tenants")
    defaults: _LimitFields = Field(default_factory=_LimitFields, alias="Defaults")

    @model_validator(mode="after")
    def _unique(self) -> "KeysConfig":
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError(f"Keys: duplicate Name {sorted({n for n in names if names.count(n) > 1})}")
        digests = [k.digest for k in self.keys]
        if len(set(digests)) != len(digests):
            raise ValueError("Keys: the same key is given twice")
        tenants = [t.name for t in self.tenants]
        if len(set(tenants)) != len(tenants):
            raise ValueError(f"Tenants: duplicate Name {sorted({n for n in tenants if tenants.count(n) > 1})}")
        return self


def _env_keys(value: str) -> list[dict[str, Any]]:
    out = []
    for i, item in enumerate(p.strip() for p in value.split(",")):
        if not item:
            continue
        name, sep, key = item.partition(":")
        if not sep:
            name, key = f"env-{i + 1}", item
        out.append({"Name": name.strip(), "Key": key.strip()})
    return out


def load_keys(path: str | None, environ: Mapping[str, str] = os.environ) -> KeysConfig | None:
    """The keys of ``path`` and of ``$PREFIXROUTE_API_KEYS``, validated; ``None`` when
    neither gives any (keys off).

    Raises:
        ConfigError: the file cannot be read, is not valid YAML (the message names the
            file and line), or a field is invalid (the message names the field).
    """
    data: dict[str, Any] = {}
    if path:
        import yaml

        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read API keys file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(f"API keys file {path}{where}: not valid YAML "
                              f"({getattr(exc, 'problem', None) or exc})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"API keys file {path}: must be a mapping with a 'Keys' list")
        data = dict(loaded or {})
    env = environ.get(ENV_VAR, "")
    if env.strip():
        data["Keys"] = [*(data.get("Keys") or []), *_env_keys(env)]
    if not data.get("Keys"):
        if path:
            raise ConfigError(f"API keys file {path}: no keys (a 'Keys' list is needed)")
        return None
    where = f"API keys file {path}" if path else ENV_VAR
    try:
        return parse_model(KeysConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def presented_key(headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(key, header name)`` a request presents: ``x-api-key``, else the credentials of
    ``Authorization: Bearer``; ``(None, None)`` for neither."""
    key = headers.get("x-api-key")
    if key is not None:
        return key.strip(), "x-api-key"
    auth = headers.get("Authorization")
    if auth is not None:
        scheme, _, cred = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and cred.strip():
            return cred.strip(), "authorization"
    return None, None


@dataclass(slots=True)
class Identity:
    """A key a request was admitted with: its name and tenant, and the header that
    carried it (dropped before the request goes to an engine)."""

    name: str
    tenant: str | None
    header: str


class ClientAuth:
    """The keys in force, the limit state of each key and tenant, and per-key counts.

    Args:
        config: the validated keys.
        on_outcome: called with ``(client name or "unknown", tenant or "", outcome)``
            for each decision (``admitted``, ``unauthorized``, ``rate_limited``,
            ``concurrency_limited``, ``tenant_rate_limited``,
            ``tenant_concurrency_limited``): the metrics.
        clock: the monotonic clock (seconds).
    """

    def __init__(self, config: KeysConfig, on_outcome: Any = None, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._on_outcome = on_outcome or (lambda *a: None)
        self._key_states: dict[str, LimitState] = {}
        self._tenant_states: dict[str, LimitState] = {}
        self.config = config
        self._apply(config)

    def _apply(self, config: KeysConfig) -> None:
        now = self._clock()
        defaults = config.defaults.limits()
        tenants = {t.name: t.limits() for t in config.tenants}
        self._by_digest = {k.digest: k for k in config.keys}
        keys: dict[str, LimitState] = {}
        for k in config.keys:
            limits = k.limits() if k.has_limits else defaults
            state = self._key_states.get(k.name)
            if state is None:
                state = LimitState(limits, now)
            else:
                state.set_limits(limits, now)
            keys[k.name] = state
        tstates: dict[str, LimitState] = {}
        for k in config.keys:
            if k.tenant is not None and k.tenant not in tstates:
                limits = tenants.get(k.tenant, Limits())
                state = self._tenant_states.get(k.tenant)
                if state is None:
                    state = LimitState(limits, now)
                else:
                    state.set_limits(limits, now)
                tstates[k.tenant] = state
        self._key_states, self._tenant_states = keys, tstates
        self.config = config

    def reload(self, config: KeysConfig) -> str:
        """Adopt new keys; the limit state of keys and tenants that stay is kept.
        Returns what changed, for the log (names only)."""
        old = {k.name: k for k in self.config.keys}
        new = {k.name: k for k in config.keys}
        added = sorted(set(new) - set(old))
        removed = sorted(set(old) - set(new))
        changed = sorted(n for n in set(old) & set(new) if old[n] != new[n])
        self._apply(config)
        parts = [f"{len(new)} key(s)"]
        for label, names in (("added", added), ("removed", removed), ("changed", changed)):
            if names:
                parts.append(f"{label} {', '.join(names)}")
        if self.config.tenants or self.config.defaults.limits() != Limits():
            parts.append(f"{len(config.tenants)} tenant limit(s)")
        return "; ".join(parts)

    def identify(self, headers: Mapping[str, str]) -> Identity | str:
        """The key ``headers`` present, or why not: ``missing`` or ``wrong``."""
        given, header = presented_key(headers)
        if given is None or header is None:
            self._on_outcome("unknown", "", "unauthorized")
            return "missing"
        digest = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
        entry = self._by_digest.get(digest)
        # The digest found (or a constant) compared in constant time, whichever it is.
        if not hmac.compare_digest(entry.digest if entry is not None else b"\0" * 32, digest) or entry is None:
            self._on_outcome("unknown", "", "unauthorized")
            return "wrong"
        return Identity(entry.name, entry.tenant, header)

    def admit(self, who: Identity) -> Admission | Refusal:
        """Admit one request of ``who`` now, or say why not (see :func:`limits.admit`)."""
        key = self._key_states[who.name]
        tenant = self._tenant_states.get(who.tenant) if who.tenant is not None else None
        result = admit(key, tenant, self._clock())
        self._on_outcome(who.name, who.tenant or "", result.outcome if isinstance(result, Refusal) else "admitted")
        return result

    def in_flight(self) -> Iterable[tuple[str, str, int]]:
        """``(name, tenant, requests in flight)`` of every key."""
        tenants = {k.name: k.tenant or "" for k in self.config.keys}
        return [(name, tenants.get(name, ""), s.in_flight) for name, s in self._key_states.items()]
