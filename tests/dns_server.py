"""A tiny authoritative DNS server on loopback UDP, for discovery tests.

Answers from a table ``(name, type) -> (ttl, [rdata text])`` with dnspython's message
handling: NOERROR with the records, NOERROR with no answer when the name has records
of another type only, NXDOMAIN when it has none. Faults: ``mode = "servfail"`` (every
answer SERVFAIL) or ``"drop"`` (no answer at all: the client times out).
"""

from __future__ import annotations

import asyncio

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class DnsServer(asyncio.DatagramProtocol):
    """Start with :meth:`start`; ``records`` and ``mode`` may change at any time.

    Attributes:
        queries: questions received, as ``(name, type)``.
    """

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], tuple[int, list[str]]] = {}
        self.mode = "ok"
        self.queries: list[tuple[str, str]] = []
        self.transport: asyncio.DatagramTransport | None = None
        self.port = 0

    async def start(self) -> "DnsServer":
        loop = asyncio.get_running_loop()
        self.transport, _ = await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", 0))
        self.port = self.transport.get_extra_info("sockname")[1]
        return self

    def stop(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def set(self, name: str, rdtype: str, rdatas: list[str], ttl: int = 1) -> None:
        """Set the records of ``name`` (absolute, with or without the final dot)."""
        self.records[(name.rstrip(".").lower() + ".", rdtype.upper())] = (ttl, list(rdatas))

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:  # type: ignore[override]
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return
        q = query.question[0]
        name = q.name.to_text().lower()
        rdtype = dns.rdatatype.to_text(q.rdtype)
        self.queries.append((name, rdtype))
        if self.mode == "drop":
            return
        resp = dns.message.make_response(query)
        resp.flags |= dns.flags.AA
        if self.mode == "servfail":
            resp.set_rcode(dns.rcode.SERVFAIL)
        elif (name, rdtype) in self.records:
            ttl, rdatas = self.records[(name, rdtype)]
            if rdatas:
                resp.answer.append(dns.rrset.from_text_list(q.name, ttl, dns.rdataclass.IN, q.rdtype, rdatas))
        elif not any(n == name for n, _ in self.records):
            resp.set_rcode(dns.rcode.NXDOMAIN)
        assert self.transport is not None
        self.transport.sendto(resp.to_wire(), addr)
