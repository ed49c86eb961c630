"""Envoy bootstrap configurations for prefixroute's endpoint picker, and for Envoy alone.

:func:`picker_bootstrap` is what the Gateway API Inference Extension sets up around
an Endpoint Picker (FIELD.md §2), static so that a plain ``envoy -c`` runs it:

1. ``envoy.filters.http.header_mutation`` strips any client-sent
   ``x-gateway-destination-endpoint`` (a client must not pick an arbitrary address);
2. ``envoy.filters.http.ext_proc`` calls the picker over gRPC (HTTP/2 cluster
   ``prefixroute_epp``) with the fewest messages that route on the body: request
   headers SEND, request body ``BUFFERED`` (Envoy holds the body and sends it whole in
   one message; the picker's answer to it sets the destination header), response
   headers SEND, response body ``NONE``, response trailers SEND (so that Envoy keeps
   the stream open until the HTTP stream ends: the picker's end of the in-flight
   lease), and ``allow_mode_override`` (the picker asks for the response body of the
   answers it reframes or times: :mod:`prefixroute.epp.exchange`); three messages each
   way for a whole answer. Envoy buffers up to ``max_body_bytes`` +
   :data:`BODY_BUFFER_MARGIN` of a body (``request_body_buffer_limit``), so that the
   picker answers 413 itself. ``failure_mode_allow`` is the fail-open (``True``) /
   fail-closed (``False``) setting for when the picker cannot be reached or fails; the
   ``envoy.lb`` namespace of the picker's dynamic metadata is accepted;
3. the route with the picker's header goes to an ``ORIGINAL_DST`` cluster keyed on
   that header (``original_dst_lb_config.use_http_header``); a request without it (the
   picker was skipped: fail-open) goes to ``fleet_round_robin``, the pool's instances
   in round robin, so fail-open still serves (without prefix affinity);
4. the picker's cluster is health-checked with the standard gRPC health protocol every
   second (service ``envoy.service.ext_proc.v3.ExternalProcessor``: SERVING while the
   picker runs; with no healthy instance it answers 503 itself, as ``serve`` does)
   with no panic routing: a picker known to be down
   is not tried, and the request goes on at once (fail-open) or gets 500 at once
   (fail-closed), instead of after a failed connection. As Envoy holds the request
   body, a picker that fails before its answer to the body does not lose the request:
   fail-open sends it on in round robin (with the body ``FULL_DUPLEX_STREAMED``, as
   before, Envoy kept no copy and answered 500 in both modes). An answer under way when
   the picker dies goes on with fail-open; with fail-closed Envoy cuts it (its ext_proc
   stream stays open until it ends).

Request body ``BUFFERED_PARTIAL`` would not do: Envoy 1.40 sends such a body on to the
router before it clears the route cache, so a body that arrives after the headers'
answer goes to the route chosen without the picker's header.

:func:`round_robin_bootstrap` is Envoy alone over the same instances (the baseline of
``bench/gateway.py``).

References: Envoy API v3 ``extensions.filters.http.ext_proc.v3.ExternalProcessor``,
``config.cluster.v3.Cluster.OriginalDstLbConfig``; the Inference Extension's EPP
protocol (header and ``envoy.lb`` metadata ``x-gateway-destination-endpoint``).
"""

from __future__ import annotations

from typing import Any, Sequence

import yaml

from prefixroute.server.settings import DEFAULT_MAX_BODY_BYTES

__all__ = ["picker_bootstrap", "round_robin_bootstrap", "to_yaml", "DESTINATION_HEADER", "METADATA_NAMESPACE",
           "BODY_BUFFER_MARGIN"]

#: ``picker_bootstrap``'s body modes (``--envoy-body-mode``).
BODY_MODES = ("buffered", "full-duplex")
#: The header (and ``envoy.lb`` metadata key) naming the picked ``ip:port``.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: The dynamic metadata namespace Envoy's load balancing reads.
METADATA_NAMESPACE = "envoy.lb"
#: Bytes Envoy buffers of a request body beyond the picker's ``--max-body-size``.
BODY_BUFFER_MARGIN = 1 << 20


def _hcm(http_filters: list[dict[str, Any]], routes: list[dict[str, Any]], access_log_path: str | None,
         body_buffer_bytes: int | None = None) -> dict[str, Any]:
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        # LLM answers stream for minutes: no stream-level idle cut below the engines' own.
        "stream_idle_timeout": "600s",
        "request_timeout": "0s",
        "route_config": {"name": "gateway", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": [*http_filters, {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    if body_buffer_bytes is not None:
        hcm["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"] = body_buffer_bytes
    if access_log_path:
        hcm["access_log"] = [{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": access_log_path,
                "log_format": {"json_format": {
                    "status": "%RESPONSE_CODE%", "path": "%REQ(:PATH)%", "upstream": "%UPSTREAM_HOST%",
                    "header": f"%REQ({DESTINATION_HEADER})%",
                    "metadata": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{DESTINATION_HEADER})%",
                    "flags": "%RESPONSE_FLAGS%", "details": "%RESPONSE_CODE_DETAILS%"}}}}]
    return hcm


def _listener(port: int, hcm: dict[str, Any], host: str) -> dict[str, Any]:
    return {"name": "gateway", "address": {"socket_address": {"address": host, "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def _static_cluster(name: str, instances: Sequence[tuple[str, int]], http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name, "type": "STATIC", "connect_timeout": "5s", "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in instances]}]},
        # Engines hold a request for its whole generation: no per-host connection cap.
        "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                             "max_requests": 100000}]},
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


def _admin(admin_port: int) -> dict[str, Any]:
    return {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}


def picker_bootstrap(listen_port: int, picker: tuple[str, int], instances: Sequence[tuple[str, int]], *,
                     fail_open: bool = False, admin_port: int = 9901, listen_host: str = "0.0.0.0",
                     access_log_path: str | None = None, message_timeout_s: float = 30.0,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     body_mode: str = "buffered") -> dict[str, Any]:
    """Envoy in front of ``instances`` with prefixroute's picker at ``picker``.

    Args:
        listen_port: the gateway's port.
        picker: ``(host, port)`` of ``prefixroute epp``'s gRPC listener.
        instances: ``(ip, port)`` of the pool, for the fail-open route (round robin).
        fail_open: Envoy's ``failure_mode_allow``: when the picker cannot be reached (or
            fails mid-stream) the request goes on without it (round robin) instead of
            an error (500, Envoy's default for a failed external processor).
        admin_port: Envoy's admin listener (loopback).
        access_log_path: a JSON access log (status, upstream, the header and the
            ``envoy.lb`` metadata Envoy saw), or ``None``.
        message_timeout_s: how long Envoy waits for each picker answer.
        max_body_bytes: the picker's ``--max-body-size``: Envoy buffers request bodies
            up to :data:`BODY_BUFFER_MARGIN` more (``request_body_buffer_limit``), so
            that the picker sees every body it accepts, and answers 413 to the larger
            ones itself (only a body without Content-Length over the buffer gets Envoy's
            own 413).
        body_mode: ``"buffered"`` (the request body ``BUFFERED``, the response body only
            when the picker asks for it: three messages each way for a whole answer) or
            ``"full-duplex"`` (both bodies ``FULL_DUPLEX_STREAMED`` with trailers SEND,
            the Inference Extension's own setting: the picker re-sends every chunk; about
            twice the messages).

    Raises:
        ValueError: an unknown ``body_mode``.
    """
    if body_mode not in BODY_MODES:
        raise ValueError(f"body_mode must be one of {', '.join(BODY_MODES)}, got {body_mode!r}")
    duplex = body_mode == "full-duplex"
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "prefixroute_epp"}, "timeout": "30s"},
            "failure_mode_allow": fail_open,
            "message_timeout": f"{message_timeout_s:g}s",
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
                "response_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "NONE",
                "request_trailer_mode": "SEND" if duplex else "SKIP", "response_trailer_mode": "SEND"},
            # the picker asks for the response body (STREAMED) when it reframes it or times
            # its first event, and skips the request body of a request it passes through
            "allow_mode_override": True,
            "metadata_options": {"receiving_namespaces": {"untyped": [METADATA_NAMESPACE]}},
        }}
    strip = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION_HEADER}]}}}
    routes = [
        {"match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
         "route": {"cluster": "picked_endpoint", "timeout": "0s", "idle_timeout": "600s"}},
        {"match": {"prefix": "/"},
         "route": {"cluster": "fleet_round_robin", "timeout": "0s", "idle_timeout": "600s"}},
    ]
    picked = {"name": "picked_endpoint", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
              "connect_timeout": "5s",
              "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
              "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                                   "max_requests": 100000}]}}
    epp = _static_cluster("prefixroute_epp", [picker], http2=True)
    epp["health_checks"] = [{"timeout": "1s", "interval": "1s", "unhealthy_threshold": 1, "healthy_threshold": 1,
                             "no_traffic_interval": "1s",
                             "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}}]
    epp["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    return {
        "admin": _admin(admin_port),
        "static_resources": {
            "listeners": [_listener(listen_port, _hcm([strip, ext_proc], routes, access_log_path,
                                                      max_body_bytes + BODY_BUFFER_MARGIN), listen_host)],
            "clusters": [picked, _static_cluster("fleet_round_robin", instances), epp],
        },
    }


def round_robin_bootstrap(listen_port: int, instances: Sequence[tuple[str, int]], *, admin_port: int = 9901,
                          listen_host: str = "0.0.0.0", access_log_path: str | None = None) -> dict[str, Any]:
    """Envoy alone: round robin over ``instances`` (no picker)."""
    routes = [{"match": {"prefix": "/"},
               "route": {"cluster": "fleet_round_robin", "timeout": "0s", "idle_timeout": "600s"}}]
    return {
        "admin": _admin(admin_port),
        "static_resources": {
            "listeners": [_listener(listen_port, _hcm([], routes, access_log_path), listen_host)],
            "clusters": [_static_cluster("fleet_round_robin", instances)],
        },
    }


def to_yaml(bootstrap: dict[str, Any]) -> str:
    """The bootstrap as YAML text for ``envoy -c``."""
    return yaml.safe_dump(bootstrap, sort_keys=False, default_flow_style=False)
