"""Discovery drivers: the I/O side of :mod:`prefixroute.core.discovery`.

- :mod:`.dns`: A/AAAA/SRV records re-resolved at an interval (``dnspython``);
- :mod:`.kubernetes`: a Service's EndpointSlices, list then watch (``kubernetes-asyncio``);
- :mod:`.manager`: runs one source per discovery-managed production variant of a
  router and applies what they find to its live configuration.

Each source calls ``report(instances)`` with the whole current set whenever it learns
it, and ``fail(kind, message)`` when it cannot (the last good set stays in force).
Both drivers need the ``discovery`` extra (``pip install 'prefixroute[discovery]'``).
"""
