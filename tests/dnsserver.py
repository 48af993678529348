"""A small authoritative DNS server on 127.0.0.1 for the discovery tests (dnspython), in the
test's own event loop (DnsServer) or in a thread of its own (ThreadedDnsServer)."""

from __future__ import annotations

import asyncio
import threading

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class DnsServer(asyncio.DatagramProtocol):
    """A small authoritative DNS server on 127.0.0.1 whose records the test edits live."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}
        self.glue = False  # put the SRV targets' A/AAAA records in the additional section
        self.servfail = False
        self.queries: list[tuple[str, str]] = []
        self.transport: asyncio.DatagramTransport | None = None

    async def start(self, port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: self, local_addr=("127.0.0.1", port)
        )
        return int(transport.get_extra_info("sockname")[1])

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def stop(self) -> None:
        assert self.transport is not None
        self.transport.close()

    def set(self, name: str, rdtype: str, *values: str) -> None:
        if values:
            self.records[(name, rdtype)] = list(values)
        else:
            self.records.pop((name, rdtype), None)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text().lower()
        rdtype = dns.rdatatype.to_text(question.rdtype)
        self.queries.append((name, rdtype))
        values = self.records.get((name, rdtype))
        if self.servfail:
            response.set_rcode(dns.rcode.SERVFAIL)
        elif values:
            response.answer.append(dns.rrset.from_text(question.name, 5, "IN", rdtype, *values))
            if rdtype == "SRV" and self.glue:
                for value in values:
                    target = value.split()[3].lower()
                    for address_type in ("A", "AAAA"):
                        if addresses := self.records.get((target, address_type)):
                            glue = dns.rrset.from_text(target, 5, "IN", address_type, *addresses)
                            response.additional.append(glue)
        elif not any(known == name for known, _ in self.records):
            response.set_rcode(dns.rcode.NXDOMAIN)
        assert self.transport is not None
        self.transport.sendto(response.to_wire(), addr)


class ThreadedDnsServer:
    """DnsServer on its own event loop in a thread, for tests that are not async."""

    def __init__(self) -> None:
        self.server = DnsServer()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    def __enter__(self) -> ThreadedDnsServer:
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(5)
        return self

    def set(self, name: str, rdtype: str, *values: str) -> None:
        self.loop.call_soon_threadsafe(self.server.set, name, rdtype, *values)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.server.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
