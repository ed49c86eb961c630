"""``prefixroute epp``: the endpoint picker behind Envoy (Gateway API Inference Extension).

- :mod:`.exchange`: one ext_proc stream as a state machine (no I/O);
- :mod:`.server`: the gRPC service, gRPC health, ``/metrics``;
- :mod:`.envoy_config`: Envoy bootstraps (with the picker; round robin alone);
- :mod:`.cli`: the command.

Needs the ``epp`` extra (``grpcio``, ``grpcio-health-checking``, ``xds-protos``).
"""
