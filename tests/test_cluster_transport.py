"""The node-to-node transport in one process: real TCP links on loopback between Transport
objects, the handshake (cluster name, secret, protocol version), batching, de-duplication of
simultaneous dials, reconnection, fault injection, and hostile peers."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import fastbroker_core
import pytest
import uvloop

from fastbroker.cluster import transport as tr
from fastbroker.cluster.transport import Transport, parse_address

pytestmark = pytest.mark.timeout(60)


class Peer:
    """A Transport plus what it received."""

    def __init__(self, node_id: str, *, secret: bytes = b"s", cluster: str = "c", **kw: Any):
        self.node_id = node_id
        self.received: list[tuple[str, int, Any]] = []
        self.ups: list[str] = []
        self.downs: list[str] = []
        self.transport = Transport(
            asyncio.get_running_loop(),
            node_id=node_id,
            cluster_name=cluster,
            secret=secret,
            advertise="",
            on_message=lambda peer, kind, value: self.received.append((peer, kind, value)),
            on_peer_up=self.ups.append,
            on_peer_down=self.downs.append,
            **kw,
        )
        self.address: tuple[str, int] = ("", 0)

    async def listen(self) -> Peer:
        self.address = await self.transport.listen("127.0.0.1", 0)
        self.transport.advertise = f"127.0.0.1:{self.address[1]}"
        return self

    def dial(self, other: Peer) -> None:
        self.transport.set_targets({other.address})
        self.transport.maintain()


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


def run(coro) -> None:
    # The broker runs on uvloop, whose transports differ from asyncio's in small ways.
    uvloop.run(coro)


def test_parse_address():
    assert parse_address("h:1") == ("h", 1)
    assert parse_address("[::1]:7883") == ("::1", 7883)
    assert parse_address("h", 5) == ("h", 5)
    for bad in ("h", ":1", "h:0", "h:x", "[::1", "h:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)


def test_handshake_messages_and_batching():
    async def main() -> None:
        a, b = await Peer("a").listen(), await Peer("b").listen()
        a.dial(b)
        await until(lambda: a.ups == ["b"] and b.ups == ["a"])
        link = a.transport.links["b"]
        writes = link.writes
        for i in range(500):
            assert a.transport.send("b", 20, {"i": i, "blob": b"x" * 10})
        await until(lambda: len(b.received) == 500)
        assert [v["i"] for _, _, v in b.received] == list(range(500))
        assert all(p == "a" and k == 20 for p, k, _ in b.received)
        # 500 frames queued in one loop iteration went out in one write.
        assert link.writes == writes + 1
        assert link.version == tr.PROTOCOL_MAX
        await a.transport.close()
        await until(lambda: b.downs == ["a"])
        await b.transport.close()

    run(main())


def test_wrong_secret_and_wrong_cluster_are_refused():
    async def main() -> None:
        b = await Peer("b").listen()
        for bad in (Peer("a", secret=b"other"), Peer("a", cluster="x")):
            await bad.listen()
            bad.dial(b)
            await asyncio.sleep(0.5)
            assert bad.ups == [] and b.ups == []
            assert not b.transport.links and not bad.transport.links
            await bad.transport.close()
        await b.transport.close()

    run(main())


def test_nodes_of_different_clusters_are_refused_and_a_node_in_none_yet_is_not():
    async def main() -> None:
        b = await Peer("b").listen()
        b.transport.cluster_id = lambda: "new"
        old = await Peer("a").listen()
        old.transport.cluster_id = lambda: "old"
        old.dial(b)
        await asyncio.sleep(0.5)
        assert old.ups == [] and b.ups == []
        await old.transport.close()
        # A fresh node (no cluster yet) links, to join.
        fresh = await Peer("c").listen()
        fresh.dial(b)
        await until(lambda: fresh.ups == ["b"] and "c" in b.ups)
        for p in (fresh, b):
            await p.transport.close()

    run(main())


def test_protocol_version_negotiated():
    async def main() -> None:
        new = await Peer("new", protocol_max=tr.PROTOCOL_MAX + 1).listen()
        old = await Peer("old", protocol_max=2).listen()
        new.dial(old)
        await until(lambda: new.ups and old.ups)
        assert new.transport.links["old"].version == 2
        assert old.transport.links["new"].version == 2
        for p in (new, old):
            await p.transport.close()

    run(main())


@pytest.mark.parametrize(
    ("versions", "node"),
    # A future node; one of the release before the data plane, which cannot carry routes
    # and forwarded messages.
    [([tr.PROTOCOL_MAX + 1, tr.PROTOCOL_MAX + 2], "future"), ([1, 1], "old")],
)
def test_no_common_version_is_refused_with_a_reason(versions, node):
    async def main() -> None:
        b = await Peer("b").listen()
        reader, writer = await asyncio.open_connection(*b.address)
        hello = {
            "magic": tr.MAGIC,
            "versions": versions,
            "cluster": "c",
            "node": node,
            "address": "",
            "nonce": b"n" * 16,
        }
        writer.write(fastbroker_core.encode_frame(tr.HELLO, hello))
        decoder = fastbroker_core.FrameDecoder()
        frames: list[tuple[int, Any]] = []
        while True:
            data = await asyncio.wait_for(reader.read(65536), 5)
            if not data:
                break
            frames += decoder.feed(data)
        kinds = [k for k, _ in frames]
        assert kinds == [tr.HELLO, tr.REJECT]
        theirs = f"{versions[0]}-{versions[1]}"
        reason = f"no common protocol version: ours 2-{tr.PROTOCOL_MAX}, theirs {theirs}"
        assert frames[1][1]["reason"] == reason
        writer.close()
        assert not b.ups
        await b.transport.close()

    run(main())


def test_simultaneous_dials_leave_one_link():
    async def main() -> None:
        a, b = await Peer("a").listen(), await Peer("b").listen()
        a.dial(b)
        b.dial(a)
        await until(lambda: "b" in a.transport.links and "a" in b.transport.links)
        await asyncio.sleep(0.5)
        la, lb = a.transport.links["b"], b.transport.links["a"]
        # Both ends kept the same TCP connection: the one dialled by "a".
        assert la.dialled is not None and lb.dialled is None
        assert la.transport.get_extra_info("sockname") == lb.transport.get_extra_info("peername")
        assert a.transport.send("b", 30, "hi")
        await until(lambda: b.received == [("a", 30, "hi")])
        for p in (a, b):
            await p.transport.close()

    run(main())


def test_reconnects_after_the_peer_restarts():
    async def main() -> None:
        a, b = await Peer("a").listen(), await Peer("b").listen()
        a.dial(b)
        await until(lambda: "b" in a.transport.links)
        port = b.address[1]
        await b.transport.close()
        await until(lambda: a.downs == ["b"])
        for _ in range(5):  # fails while b is away, backing off
            a.transport.maintain()
            await asyncio.sleep(0.05)
        b2 = Peer("b")
        b2.address = await b2.transport.listen("127.0.0.1", port)
        for _ in range(200):
            a.transport.maintain()
            if "b" in a.transport.links:
                break
            await asyncio.sleep(0.05)
        assert "b" in a.transport.links and a.ups == ["b", "b"]
        for p in (a, b2):
            await p.transport.close()

    run(main())


def test_block_cuts_and_refuses_then_heals():
    async def main() -> None:
        a, b = await Peer("a").listen(), await Peer("b").listen()
        a.dial(b)
        await until(lambda: "b" in a.transport.links)
        a.transport.block({"b"})
        await until(lambda: "a" not in b.transport.links)
        for _ in range(20):
            a.transport.maintain()
            await asyncio.sleep(0.05)
        assert "b" not in a.transport.links and not a.transport.send("b", 30, 1)
        a.transport.block(set())
        for _ in range(200):
            a.transport.maintain()
            if "b" in a.transport.links:
                break
            await asyncio.sleep(0.05)
        assert "b" in a.transport.links
        for p in (a, b):
            await p.transport.close()

    run(main())


def test_garbage_and_silence_are_dropped(monkeypatch):
    monkeypatch.setattr(tr, "HANDSHAKE_TIMEOUT_S", 0.5)

    async def main() -> None:
        b = await Peer("b").listen()
        loop = asyncio.get_running_loop()
        # A bad value tag, a 2 GiB frame, a frame cut short then silence.
        for junk in (b"\x00\x00\x00\x03\x01\xff\xff", b"\x7f\xff\xff\xff", bytes(range(64))):
            sock = socket.create_connection(b.address)
            sock.setblocking(False)
            await loop.sock_sendall(sock, junk)
            # Closed by b: reading ends (after its HELLO) instead of hanging.
            while await asyncio.wait_for(loop.sock_recv(sock, 65536), 5):
                pass
            sock.close()
        assert not b.transport.links and not b.ups
        await b.transport.close()

    run(main())


def test_a_stranger_cannot_splice_two_handshakes():
    """Without the secret, a stranger connects to a and b, tells each it is the other (with
    the other's nonce) and hands each one's AUTH to the other: both must refuse."""

    async def main() -> None:
        a, b = await Peer("a").listen(), await Peer("b").listen()
        (ra, wa), (rb, wb) = (
            await asyncio.open_connection(*a.address),
            await asyncio.open_connection(*b.address),
        )
        da, db = fastbroker_core.FrameDecoder(), fastbroker_core.FrameDecoder()

        async def next_frame(reader, decoder, pending):
            while not pending:
                data = await asyncio.wait_for(reader.read(65536), 5)
                if not data:
                    return None
                pending += decoder.feed(data)
            return pending.pop(0)

        pa: list = []
        pb: list = []
        hello_a = (await next_frame(ra, da, pa))[1]
        hello_b = (await next_frame(rb, db, pb))[1]
        wa.write(fastbroker_core.encode_frame(tr.HELLO, hello_b))  # "I am b" to a
        wb.write(fastbroker_core.encode_frame(tr.HELLO, hello_a))  # "I am a" to b
        auth_a = await next_frame(ra, da, pa)
        auth_b = await next_frame(rb, db, pb)
        assert auth_a[0] == tr.AUTH and auth_b[0] == tr.AUTH
        wa.write(fastbroker_core.encode_frame(tr.AUTH, auth_b[1]))
        wb.write(fastbroker_core.encode_frame(tr.AUTH, auth_a[1]))
        refusals = [await next_frame(ra, da, pa), await next_frame(rb, db, pb)]
        assert [k for k, _ in refusals] == [tr.REJECT, tr.REJECT]
        assert all("authentication failed" in v["reason"] for _, v in refusals)
        assert not a.ups and not b.ups
        for w in (wa, wb):
            w.close()
        for p in (a, b):
            await p.transport.close()

    run(main())


def test_a_stranger_cannot_send_much_before_authenticating():
    async def main() -> None:
        b = await Peer("b").listen()
        reader, writer = await asyncio.open_connection(*b.address)
        # One frame announcing 1 MiB: under the frame limit, over the unauthenticated budget.
        writer.write(b"\x00\x10\x00\x00" + b"\x01" + b"\x07" * 200_000)
        closed = False
        try:
            while await asyncio.wait_for(reader.read(65536), 5):
                pass
            closed = True
        except ConnectionResetError:
            closed = True
        assert closed and not b.ups
        writer.close()
        await b.transport.close()

    run(main())


def test_control_frames_do_not_wait_behind_a_full_data_link():
    """Each pair keeps a data link beside the control link: with 40 MiB of data stuck
    (the peer stops reading it), a control frame still arrives at once."""

    async def main() -> None:
        writable: list[tuple[str, bool]] = []
        data_ups: dict[str, list[str]] = {"a": [], "b": []}
        a = await Peer(
            "a",
            on_data_up=data_ups["a"].append,
            on_writable=lambda peer, w: writable.append((peer, w)),
        ).listen()
        b = await Peer("b", on_data_up=data_ups["b"].append).listen()
        a.dial(b)
        await until(lambda: a.ups == ["b"] and b.ups == ["a"])
        # The node with the smaller id dials the data link on its next tick.
        a.transport.maintain()
        b.transport.maintain()
        await until(lambda: data_ups == {"a": ["b"], "b": ["a"]})
        assert len(a.transport.data_links) == 1 and len(b.transport.data_links) == 1
        b.transport.data_links["a"].transport.pause_reading()
        blob = fastbroker_core.encode_frame(tr.DATA_FRAME, b"x" * (1 << 20))
        for _ in range(40):
            a.transport.data_links["b"].write_frames(blob, 1)
        assert ("b", False) in writable
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert a.transport.send("b", 16, {"ping": 1})
        await until(lambda: ("a", 16, {"ping": 1}) in b.received, 2.0)
        assert loop.time() - started < 0.5
        # The data arrives once read again, all of it.
        b.transport.data_links["a"].transport.resume_reading()
        await until(lambda: sum(k == tr.DATA_FRAME for _, k, _ in b.received) == 40, 10.0)
        # A data frame on the control link, or a control frame on the data link, is refused.
        a.transport.links["b"].send(tr.DATA_FRAME, b"x")
        await until(lambda: b.downs == ["a"])
        assert "b" not in a.transport.data_links or a.transport.data_links["b"].closed
        for p in (a, b):
            await p.transport.close()

    run(main())


def test_a_data_link_that_goes_silent_is_dialled_again_while_its_control_link_stays():
    """Idle data links keep each other alive with keepalives; one whose peer sends nothing
    on it any more (a half-open connection) is closed after the idle timeout and dialled
    again, without taking the control link down."""

    async def main() -> None:
        data_ups: dict[str, list[str]] = {"a": [], "b": []}
        a = await Peer("a", on_data_up=data_ups["a"].append).listen()
        b = await Peer("b", on_data_up=data_ups["b"].append).listen()
        for p in (a, b):
            p.transport.idle_timeout_s = 0.4
        a.dial(b)
        await until(lambda: a.ups == ["b"] and b.ups == ["a"])
        control = a.transport.links["b"]
        b_silent = False

        async def ticks(seconds: float, done=lambda: False) -> None:
            # What the node's tick does: maintain, and pings on the control links.
            end = asyncio.get_running_loop().time() + seconds
            while asyncio.get_running_loop().time() < end and not done():
                a.transport.maintain()
                if not b_silent:
                    b.transport.maintain()
                a.transport.send("b", 16, "ping")
                b.transport.send("a", 16, "ping")
                await asyncio.sleep(0.05)

        await ticks(3.0, lambda: data_ups == {"a": ["b"], "b": ["a"]})
        assert data_ups == {"a": ["b"], "b": ["a"]}
        data = a.transport.data_links["b"]
        assert data.version == tr.PROTOCOL_MAX
        await ticks(1.2)
        # Idle for three idle timeouts: kept up by keepalives alone.
        assert a.transport.data_links.get("b") is data and not data.closed
        assert not any(k == tr.DATA_KEEPALIVE for _, k, _ in a.received + b.received)
        b_silent = True
        await ticks(2.0, lambda: data.closed)
        assert data.closed
        b_silent = False
        await ticks(5.0, lambda: len(data_ups["a"]) == 2)
        assert data_ups["a"] == ["b", "b"]
        again = a.transport.data_links["b"]
        assert again is not data
        await ticks(1.0)
        assert a.transport.data_links.get("b") is again and not again.closed
        assert a.transport.links["b"] is control and not control.closed
        for p in (a, b):
            await p.transport.close()

    run(main())


async def ticks(a: Peer, b: Peer, seconds: float, done=lambda: False) -> None:
    """Both transports' ticks every 50 ms, for `seconds` or until `done()`."""
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end and not done():
        a.transport.maintain()
        b.transport.maintain()
        await asyncio.sleep(0.05)


async def linked_with_data(**a_kw: Any) -> tuple[Peer, Peer]:
    """Peers "a" (with `a_kw`) and "b", their control link up and a's data link up once."""
    ups: list[str] = []
    on_data_up = a_kw.pop("on_data_up")

    def up(peer: str) -> None:
        ups.append(peer)
        on_data_up(peer)

    a = await Peer("a", on_data_up=up, **a_kw).listen()
    b = await Peer("b").listen()
    a.dial(b)
    await until(lambda: a.ups == ["b"] and b.ups == ["a"])
    await ticks(a, b, 3.0, lambda: ups == ["b"])
    assert ups == ["b"]
    return a, b


async def both_with_data() -> tuple[Peer, Peer, dict[str, list[str]]]:
    """Peers "a" and "b", their control link up and the data link up at both ends once;
    the data links each saw come up."""
    data_ups: dict[str, list[str]] = {"a": [], "b": []}
    a = await Peer("a", on_data_up=data_ups["a"].append).listen()
    b = await Peer("b", on_data_up=data_ups["b"].append).listen()
    a.dial(b)
    await until(lambda: a.ups == ["b"] and b.ups == ["a"])
    await ticks(a, b, 3.0, lambda: data_ups == {"a": ["b"], "b": ["a"]})
    assert data_ups == {"a": ["b"], "b": ["a"]}
    return a, b, data_ups


def test_a_silent_data_link_with_a_full_write_buffer_is_redialled_at_once():
    """Found by the fault suite (one heal in about 100): a data link found silent in a split
    while it still had batches buffered was closed, but a close waits for the buffer to
    drain before the link counts as lost, so it stayed registered and was not redialled
    until the peer's RST after the heal, 5 s later. Here the peer stops reading, so the
    buffer never drains; the silent link is aborted and dialled again at once."""

    async def main() -> None:
        data_ups: list[str] = []
        data_downs: list[str] = []
        a, b = await linked_with_data(on_data_up=data_ups.append, on_data_down=data_downs.append)
        b.transport.data_links["a"].transport.pause_reading()
        link = a.transport.data_links["b"]
        chunk = b"x" * 65536
        for _ in range(400):
            link.send_now(tr.DATA_KEEPALIVE, chunk)
            if link.transport.get_write_buffer_size() > 0:
                break
            await asyncio.sleep(0)
        assert link.transport.get_write_buffer_size() > 0
        a.transport.idle_timeout_s = 60.0
        link.last_received -= 120.0
        started = asyncio.get_running_loop().time()
        await ticks(a, b, 2.0, lambda: len(data_ups) == 2)
        assert data_downs == ["b"] and data_ups == ["b", "b"]
        assert asyncio.get_running_loop().time() - started < 1.5
        for p in (a, b):
            await p.transport.close()

    run(main())


def test_a_data_dial_left_hanging_by_a_split_does_not_hold_up_the_data_link_once_back():
    """Found by the fault suite: a data link found silent 50 ms before its control link was
    dialled again in that gap, and the dial's SYNs were dropped by the split; the control
    link came back after the heal, but the data link only once that dial had timed out
    (5 s), and meanwhile the node took its peers for dead. Here the dial goes to a listener
    whose accept queue is full (the kernel drops the SYNs)."""

    async def main() -> None:
        data_ups: list[str] = []
        a, b = await linked_with_data(on_data_up=data_ups.append)
        full = socket.socket()
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        filling = []
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(full.getsockname())
            except BlockingIOError:
                pass
            filling.append(s)
        real = a.transport.data_address
        a.transport.data_address = lambda link: full.getsockname()
        a.transport.data_links["b"].close("silent")
        await ticks(a, b, 1.0, lambda: "b" in a.transport.data_dialling)
        hanging = a.transport.data_dialling["b"]
        await asyncio.sleep(0.3)
        assert not hanging.done()
        a.transport.links["b"].close("silent")
        a.transport.data_address = real
        started = asyncio.get_running_loop().time()
        await ticks(a, b, 4.0, lambda: len(data_ups) == 2)
        assert data_ups == ["b", "b"]
        assert asyncio.get_running_loop().time() - started < 2.0
        assert hanging.cancelled()
        for s in [*filling, full]:
            s.close()
        for p in (a, b):
            await p.transport.close()

    run(main())


def test_data_links_stay_refused_while_any_cause_holds_and_the_control_link_stays_up():
    """A failing store and a partial split each close the data links and refuse new ones;
    the links come back only once neither holds (the store recovering while the node still
    steps aside must not open them), and the control link stays up throughout."""

    async def main() -> None:
        a, b, data_ups = await both_with_data()
        a.transport.refuse_data("this node's store is failing")
        a.transport.refuse_data("partial split: cut off from c", cause="partial split")
        await until(lambda: "b" not in a.transport.data_links)
        a.transport.refuse_data(None)
        assert a.transport.data_refused == "partial split: cut off from c"
        await ticks(a, b, 1.0)
        assert "b" not in a.transport.data_links and data_ups["a"] == ["b"]
        assert "b" in a.transport.links and a.downs == []
        a.transport.refuse_data(None, cause="partial split")
        assert a.transport.data_refused is None
        await ticks(a, b, 5.0, lambda: data_ups["a"] == ["b", "b"])
        assert data_ups["a"] == ["b", "b"]
        for p in (a, b):
            await p.transport.close()

    run(main())


def test_a_data_link_cut_for_one_peer_closes_at_once_and_is_refused_until_lifted():
    """A node cut apart from a peer in a partial split closes the data link to it at once
    (aborted: it is silent anyway) and refuses the peer's redials, whichever end dials,
    while its control link stays up; lifted, the data link comes back."""

    async def main() -> None:
        a, b, data_ups = await both_with_data()
        # b is the end that does not dial ("a" sorts first): a's redials are refused.
        b.transport.cut_data("a", "partial split: cut off from a")
        await until(lambda: "a" not in b.transport.data_links)
        await ticks(a, b, 1.0)
        assert "a" not in b.transport.data_links and data_ups["b"] == ["a"]
        assert "b" in a.transport.links and "a" in b.transport.links
        assert a.downs == [] and b.downs == []
        b.transport.cut_data("a", None)
        await ticks(a, b, 5.0, lambda: data_ups["b"] == ["a", "a"])
        assert data_ups["b"] == ["a", "a"]
        # The dialling end cut: it does not dial.
        count = len(data_ups["a"])
        a.transport.cut_data("b", "partial split: cut off from b")
        await until(lambda: "b" not in a.transport.data_links)
        await ticks(a, b, 1.0)
        assert "b" not in a.transport.data_links and len(data_ups["a"]) == count
        assert "b" not in a.transport.data_dialling
        for p in (a, b):
            await p.transport.close()

    run(main())
