"""Discovery settings of a production variant (``Discovery:`` in the fleet YAML).

Validated once, into frozen models, like the rest of :mod:`prefixroute.core.config`.
Exactly one source per variant::

    Discovery:
      DNS: {Name: vllm.llm.svc.cluster.local, RecordType: A, Port: 8000, IntervalSeconds: 10}

    Discovery:
      Kubernetes: {Namespace: llm, Service: vllm, PortName: http}

Errors: :class:`prefixroute.core.config.ConfigError` through the fleet's validation,
naming the field, the value and what is allowed.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["DnsDiscoveryConfig", "KubernetesDiscoveryConfig", "DiscoveryConfig", "parse_nameserver"]

#: RFC 1123 DNS label, as Kubernetes validates names of Services and namespaces.
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: A DNS name (letters, digits, hyphens, underscores for SRV labels, dots; optional final dot).
_DNS_NAME = re.compile(r"^(?=.{1,253}\.?$)([A-Za-z0-9_]([-A-Za-z0-9_]{0,61}[A-Za-z0-9])?\.)*"
                       r"[A-Za-z0-9_]([-A-Za-z0-9_]{0,61}[A-Za-z0-9])?\.?$")


def parse_nameserver(text: str) -> tuple[str, int]:
    """``10.0.0.10``, ``10.0.0.10:5353``, ``fd00::a``, ``[fd00::a]:5353`` -> ``(ip, port)``.

    Raises:
        ValueError: not an IP address with an optional port 1-65,535.
    """
    t = text.strip()
    host, port = t, 53
    if t.startswith("["):
        host, _, rest = t[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"nameserver {text!r} is not IP or IP:PORT")
            port = int(rest[1:]) if rest[1:].isdigit() else -1
    elif t.count(":") == 1:
        host, _, p = t.partition(":")
        port = int(p) if p.isdigit() else -1
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"nameserver {text!r} is not an IP address (with an optional :PORT)") from None
    if not 1 <= port <= 65_535:
        raise ValueError(f"nameserver {text!r}: port out of range (allowed 1-65,535)")
    return host, port


class DnsDiscoveryConfig(BaseModel):
    """Instances from DNS records, resolved again every ``IntervalSeconds`` (sooner
    when the records' TTL runs out first).

    Attributes:
        name: ``Name``, the DNS name, e.g. ``vllm.llm.svc.cluster.local`` (a headless
            Service's name resolves to its ready pods) or ``_http._tcp.vllm.llm.svc.cluster.local``
            for SRV.
        record_type: ``RecordType``: ``A`` (IPv4), ``AAAA`` (IPv6), ``A+AAAA`` (both) or
            ``SRV`` (records carry ports; targets resolved to A/AAAA).
        port: ``Port`` of every instance with A/AAAA records, 1-65,535; not used with SRV.
        scheme: ``Scheme``, ``http`` or ``https``.
        interval_s: ``IntervalSeconds``, 1-3,600: how often the name is resolved again.
        timeout_s: ``TimeoutSeconds``, 0.1-60: the longest one resolution may take.
        nameservers: ``Nameservers``, e.g. ``["10.96.0.10"]`` or ``["127.0.0.1:5353"]``;
            empty = the system's resolver configuration (``/etc/resolv.conf``).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    name: str = Field(alias="Name")
    record_type: Literal["A", "AAAA", "A+AAAA", "SRV"] = Field(default="A", alias="RecordType")
    port: int | None = Field(default=None, alias="Port", ge=1, le=65_535)
    scheme: Literal["http", "https"] = Field(default="http", alias="Scheme")
    interval_s: float = Field(default=10.0, alias="IntervalSeconds", ge=1.0, le=3_600.0)
    timeout_s: float = Field(default=2.0, alias="TimeoutSeconds", ge=0.1, le=60.0)
    nameservers: tuple[str, ...] = Field(default=(), alias="Nameservers")

    @field_validator("record_type", mode="before")
    @classmethod
    def _v_type(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("name")
    @classmethod
    def _v_name(cls, v: str) -> str:
        if not _DNS_NAME.match(v):
            raise ValueError(f"Name: {v!r} is not a DNS name")
        return v

    @field_validator("nameservers")
    @classmethod
    def _v_ns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for ns in v:
            parse_nameserver(ns)
        return v

    @model_validator(mode="after")
    def _v_port(self) -> "DnsDiscoveryConfig":
        if self.record_type != "SRV" and self.port is None:
            raise ValueError(f"Port: required with RecordType {self.record_type} (the records carry no port)")
        return self


class KubernetesDiscoveryConfig(BaseModel):
    """Instances from the ``EndpointSlice`` objects of a Service (list, then watch).

    Attributes:
        namespace: ``Namespace``; default: the router pod's own namespace (in a
            cluster), else the kubeconfig context's, else ``default``.
        service: ``Service``, the Service's name (its slices carry the label
            ``kubernetes.io/service-name``).
        label_selector: ``LabelSelector``, e.g. ``app=vllm,model=llama``, instead of a
            Service name (slices carry their Service's labels).
        port_name: ``PortName``, the Service port to use; default: the only port.
        scheme: ``Scheme``, ``http`` or ``https``.
        kubeconfig: ``Kubeconfig``, path of a kubeconfig file; default: the in-cluster
            service account, else ``$KUBECONFIG`` or ``~/.kube/config``.
        watch_timeout_s: ``WatchTimeoutSeconds``, 10-3,600: the API server ends each
            watch after this long and the router resumes it from the last
            resourceVersion (a watch that died silently is noticed within this time).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    namespace: str | None = Field(default=None, alias="Namespace")
    service: str | None = Field(default=None, alias="Service")
    label_selector: str | None = Field(default=None, alias="LabelSelector", min_length=1)
    port_name: str | None = Field(default=None, alias="PortName", min_length=1)
    scheme: Literal["http", "https"] = Field(default="http", alias="Scheme")
    kubeconfig: str | None = Field(default=None, alias="Kubeconfig", min_length=1)
    watch_timeout_s: int = Field(default=290, alias="WatchTimeoutSeconds", ge=10, le=3_600)

    @field_validator("namespace", "service")
    @classmethod
    def _v_label(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not _DNS1123_LABEL.match(v)):
            raise ValueError(f"{v!r} is not a valid Kubernetes name (lowercase letters, digits and '-', at most 63)")
        return v

    @model_validator(mode="after")
    def _v_one(self) -> "KubernetesDiscoveryConfig":
        if (self.service is None) == (self.label_selector is None):
            raise ValueError("give exactly one of Service and LabelSelector")
        return self

    @property
    def selector(self) -> str:
        """The label selector sent to the API server."""
        if self.service is not None:
            return f"kubernetes.io/service-name={self.service}"
        assert self.label_selector is not None
        return self.label_selector


class DiscoveryConfig(BaseModel):
    """A production variant's discovery source: exactly one of ``DNS`` and ``Kubernetes``."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    dns: DnsDiscoveryConfig | None = Field(default=None, alias="DNS")
    kubernetes: KubernetesDiscoveryConfig | None = Field(default=None, alias="Kubernetes")

    @model_validator(mode="after")
    def _v_one(self) -> "DiscoveryConfig":
        if (self.dns is None) == (self.kubernetes is None):
            raise ValueError("Discovery: give exactly one source, DNS or Kubernetes")
        return self

    @property
    def source(self) -> str:
        """``dns`` or ``kubernetes`` (the ``source`` label of the discovery metrics)."""
        return "dns" if self.dns is not None else "kubernetes"
