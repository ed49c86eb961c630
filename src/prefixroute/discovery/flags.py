"""``prefixroute serve`` flags for discovery of a single variant's instances.

For one endpoint with one production variant (the ``--backend`` case) without a YAML
file; a fleet of several variants puts ``Discovery:`` on each variant in ``--config``.
"""

from __future__ import annotations

import argparse
from typing import Any

from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig, parse_model
from prefixroute.core.discovery_config import DiscoveryConfig

__all__ = ["configure_discovery_flags", "discovery_from_args", "uses_discovery", "single_with_discovery"]

_FLAGS = {"dns": "--dns", "dns_record_type": "--dns-record-type", "dns_port": "--dns-port",
          "dns_interval": "--dns-interval", "dns_server": "--dns-server", "k8s_service": "--k8s-service",
          "k8s_selector": "--k8s-selector", "k8s_namespace": "--k8s-namespace", "k8s_port_name": "--k8s-port-name",
          "kubeconfig": "--kubeconfig"}


def configure_discovery_flags(p: argparse.ArgumentParser) -> None:
    """Add the discovery flags to ``serve``'s parser."""
    g = p.add_argument_group(
        "discovery (instead of, or as well as, --backend: instances come and go without a restart)")
    g.add_argument("--dns", metavar="NAME",
                   help="resolve NAME's records for the instances, e.g. a headless Service "
                        "vllm.llm.svc.cluster.local; re-resolved every --dns-interval (sooner when the TTL runs "
                        "out); a failed resolution keeps the last good set")
    g.add_argument("--dns-record-type", choices=("A", "AAAA", "A+AAAA", "SRV"), default=None, type=str.upper,
                   help="records to read: A, AAAA, A+AAAA (both), or SRV (carry the ports; e.g. "
                        "_http._tcp.vllm.llm.svc.cluster.local) (default: A)")
    g.add_argument("--dns-port", type=int, metavar="PORT",
                   help="the instances' port with A/AAAA records (required with them)")
    g.add_argument("--dns-interval", type=float, metavar="SECONDS",
                   help="seconds between resolutions, 1-3600 (default: 10)")
    g.add_argument("--dns-server", action="append", metavar="IP[:PORT]", default=None,
                   help="DNS server to ask, repeatable (default: the system's, from /etc/resolv.conf)")
    g.add_argument("--k8s-service", metavar="NAME",
                   help="use the ready endpoints of Kubernetes Service NAME (its EndpointSlices: list, then "
                        "watch); needs RBAC get/list/watch on endpointslices (deploy/kubernetes/rbac.yaml)")
    g.add_argument("--k8s-selector", metavar="SELECTOR",
                   help="instead of --k8s-service: EndpointSlices matching this label selector, e.g. "
                        "app=vllm,model=llama (slices carry their Service's labels)")
    g.add_argument("--k8s-namespace", metavar="NS",
                   help="the Service's namespace (default: the router pod's own, else the kubeconfig "
                        "context's, else default)")
    g.add_argument("--k8s-port-name", metavar="NAME",
                   help="the Service port to send requests to (default: its only port)")
    g.add_argument("--kubeconfig", metavar="PATH",
                   help="kubeconfig file (default: the in-cluster service account, else $KUBECONFIG or "
                        "~/.kube/config)")


def uses_discovery(args: argparse.Namespace) -> bool:
    """Whether any discovery flag was given."""
    return any(getattr(args, dest, None) is not None for dest in _FLAGS)


def discovery_from_args(args: argparse.Namespace) -> DiscoveryConfig:
    """The ``Discovery`` settings from the flags.

    Raises:
        ConfigError: both DNS and Kubernetes flags, a flag of one without its main
            flag, or invalid values.
    """
    dns_given = [f for d, f in _FLAGS.items() if d.startswith("dns") and getattr(args, d, None) is not None]
    k8s_given = [f for d, f in _FLAGS.items() if not d.startswith("dns") and getattr(args, d, None) is not None]
    if dns_given and k8s_given:
        raise ConfigError(f"use either DNS ({', '.join(dns_given)}) or Kubernetes ({', '.join(k8s_given)}) "
                          "discovery, not both")
    data: dict[str, Any]
    if dns_given:
        if args.dns is None:
            raise ConfigError(f"{', '.join(dns_given)} need --dns NAME")
        dns: dict[str, Any] = {"Name": args.dns}
        for dest, key in (("dns_record_type", "RecordType"), ("dns_port", "Port"), ("dns_interval", "IntervalSeconds"),
                          ("dns_server", "Nameservers")):
            if getattr(args, dest) is not None:
                dns[key] = getattr(args, dest)
        data = {"DNS": dns}
    else:
        if args.k8s_service is None and args.k8s_selector is None:
            raise ConfigError(f"{', '.join(k8s_given)} need --k8s-service NAME or --k8s-selector SELECTOR")
        k8s: dict[str, Any] = {}
        for dest, key in (("k8s_service", "Service"), ("k8s_selector", "LabelSelector"),
                          ("k8s_namespace", "Namespace"), ("k8s_port_name", "PortName"), ("kubeconfig", "Kubeconfig")):
            if getattr(args, dest) is not None:
                k8s[key] = getattr(args, dest)
        data = {"Kubernetes": k8s}
    return parse_model(DiscoveryConfig, data, "Discovery")


def single_with_discovery(instances: list[str], routing: RoutingConfig, discovery: DiscoveryConfig,
                          endpoint: str, variant: str) -> FleetConfig:
    """One endpoint, one variant whose instances come from ``discovery`` (``instances``
    are used until its first answer).

    Raises:
        ConfigError: invalid instance URLs or names.
    """
    return parse_model(FleetConfig, {"Endpoints": [{"EndpointName": endpoint, "ProductionVariants": [
        {"VariantName": variant, "Instances": list(instances), "RoutingConfig": routing,
         "Discovery": discovery}]}]})
