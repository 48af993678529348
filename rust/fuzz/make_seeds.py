"""Writes the hand-made seed inputs of the `decode` and `engine_feed` fuzz targets.

Valid MQTT 3.1.1 and 5.0 sessions (CONNECT, SUBSCRIBE, PUBLISH QoS 0/1/2, PUBREL, ...,
DISCONNECT), built with tests/rawmqtt.py, which is written from the specification and not
from fastbroker's codec. The fuzzer starts from these and mutates them; `ci/fuzz.sh` and
`cargo fuzz cmin` keep the corpus small. Run from anywhere:

    python rust/fuzz/make_seeds.py
"""

from __future__ import annotations

import sys
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(FUZZ_DIR.parent.parent / "tests"))

import rawmqtt as m  # noqa: E402  (found through the path set just above)

V3, V5 = 4, 5


# ---- engine_feed operations (the layout is documented in fuzz_targets/engine_feed.rs) ----


def feed(conn: int, data: bytes, piece: int = 4095) -> bytes:
    """Feeds `data` to connection `conn` in pieces of at most `piece` bytes."""
    out = bytearray()
    for at in range(0, len(data), piece):
        chunk = data[at : at + piece]
        out.append(conn | ((len(chunk) >> 8) << 2))
        out.append(len(chunk) & 0xFF)
        out += chunk
    return bytes(out)


def wait(ms: int) -> bytes:
    """Moves the clock about `ms` forward, in steps of at most 255 * 64 ms, each a tick."""
    steps = max(1, ms // 64)
    out = bytearray()
    while steps:
        step = min(255, steps)
        out += bytes([0x80, step])
        steps -= step
    return bytes(out)


def caller(arg: int, conn: int = 0) -> bytes:
    """A caller action (kind 3): see `Harness::caller` in engine_feed.rs."""
    return bytes([0xC0 | (arg << 2) | conn])


def peer_close(conn: int) -> bytes:
    return caller(0, conn)


def unwritable(conn: int) -> bytes:
    return caller(1, conn)


def writable(conn: int) -> bytes:
    return caller(2, conn)


STORE_FAILED = caller(3)
AUTH_ACCEPT, AUTH_ACCEPT_RESTRICTED, AUTH_REFUSE, AUTH_CONTINUE = (caller(a) for a in (4, 5, 6, 7))
ROUTE, DROP, DENY, ROUTE_REWRITTEN, ROUTE_INVALID = (caller(a) for a in (8, 9, 10, 11, 12))

# The two control bytes (fuzz_targets/engine_feed.rs, `config`): limits, then features.
SMALL_PACKETS, DURABLE, SMALL_QUEUES = 1, 2, 4
AUTH, INTERCEPT, PUBLISH_RATE, MAX_CONNECTIONS, SMALL_AUTH_BUFFER = 1, 2, 4, 8, 16


def header(limits: int = 0, features: int = 0) -> bytes:
    return bytes([limits, features])


def qos_session(p: int, cid: str) -> bytes:
    """CONNECT, SUBSCRIBE to what it publishes, PUBLISH QoS 0/1/2, the acks both ways,
    PINGREQ, UNSUBSCRIBE, DISCONNECT: every packet a client sends, in order."""
    v5 = p == V5
    props = {m.SESSION_EXPIRY_INTERVAL: 0, m.RECEIVE_MAXIMUM: 10} if v5 else None
    pub_props = [(m.USER_PROPERTY, ("k", "v")), (m.MESSAGE_EXPIRY_INTERVAL, 60)] if v5 else None
    return b"".join(
        [
            m.connect(cid, protocol=p, keepalive=30, props=props),
            m.subscribe(
                1,
                [("a/#", 2), ("+/b", 1)],
                protocol=p,
                props={m.SUBSCRIPTION_IDENTIFIER: 7} if v5 else None,
            ),
            m.publish("a/b", b"zero", protocol=p, props=pub_props),
            m.publish("a/b", b"one", qos=1, packet_id=2, protocol=p),
            m.publish("a/c", b"two", qos=2, packet_id=3, protocol=p, retain=True),
            m.pubrel(3, protocol=p),
            # The broker's own deliveries to this subscriber (its ids start at 1).
            m.puback(1, protocol=p),
            m.pubrec(2, protocol=p),
            m.pubcomp(2, protocol=p),
            m.pingreq(),
            m.unsubscribe(4, ["a/#"], protocol=p),
            m.disconnect(protocol=p),
        ]
    )


def engine_seeds() -> dict[str, bytes]:
    seeds: dict[str, bytes] = {}
    for p, tag in ((V3, "v311"), (V5, "v5")):
        session = qos_session(p, f"c-{tag}")
        seeds[f"session_{tag}"] = header() + feed(0, session)
        # The same session one to three bytes at a time: every split point of the decoder.
        seeds[f"session_{tag}_split"] = header() + b"".join(
            feed(0, session[at : at + 1 + at % 3]) for at in _split_points(len(session))
        )
        seeds[f"session_{tag}_small_limits"] = header(SMALL_PACKETS | SMALL_QUEUES) + feed(
            0, session
        )

    # Two clients: a v5 subscriber and a 3.1.1 publisher with a will, whose socket dies.
    sub5 = m.connect(
        "sub",
        protocol=V5,
        props={m.TOPIC_ALIAS_MAXIMUM: 4, m.MAXIMUM_PACKET_SIZE: 1000},
    ) + m.subscribe(1, [("t/#", 0x02 | 0x04 | 0x08), ("$share/g/t/x", 1)], protocol=V5)
    pub3 = (
        m.connect("pub", protocol=V3, will_topic="t/will", will_payload=b"gone", will_qos=1)
        + m.publish("t/x", b"r", qos=1, retain=True, packet_id=1)
        + m.publish("t/y", b"q2", qos=2, packet_id=2)
        + m.pubrel(2)
    )
    seeds["two_clients_will"] = (
        header()
        + feed(0, sub5)
        + feed(1, pub3)
        + peer_close(1)
        + feed(0, m.puback(1, protocol=V5) + m.puback(2, protocol=V5))
        + wait(1000)
    )

    # A persistent 5.0 session with a will delay: offline queueing, the store's ops and a
    # failed store write, then the session resumed.
    persist = m.connect(
        "keep",
        protocol=V5,
        clean=False,
        props={m.SESSION_EXPIRY_INTERVAL: 600},
        will_topic="w",
        will_props={m.WILL_DELAY_INTERVAL: 5},
    ) + m.subscribe(1, [("q/#", 1)], protocol=V5)
    seeds["persistent_v5"] = (
        header(DURABLE)
        + feed(0, persist)
        + peer_close(0)
        + feed(1, m.connect("other", protocol=V5) + m.publish("q/1", b"x", qos=1, protocol=V5))
        + STORE_FAILED
        + feed(2, m.connect("keep", protocol=V5, clean=False))
        + feed(2, m.puback(1, protocol=V5))
        + wait(10_000)
    )

    # Session takeover: the same client id on two connections, a slow consumer in between.
    seeds["takeover_v311"] = (
        header()
        + feed(0, m.connect("same", clean=False) + m.subscribe(1, [("#", 1)]))
        + unwritable(0)
        + feed(
            1,
            m.connect("x")
            + b"".join(m.publish(f"n/{i}", b"p", qos=1, packet_id=i + 1) for i in range(5)),
        )
        + feed(2, m.connect("same", clean=False))
        + writable(0)
        + feed(2, m.disconnect())
    )

    # Keepalive and connect timeouts, and a 5.0 topic alias.
    seeds["timeouts_v5"] = (
        header()
        + feed(0, m.connect("ka", protocol=V5, keepalive=1))
        + feed(1, m.connect("al", protocol=V5)[:5])
        + feed(
            3,
            m.connect("alias", protocol=V5)
            + m.publish("x/y", b"1", protocol=V5, props={m.TOPIC_ALIAS: 1})
            + m.publish("", b"2", protocol=V5, props={m.TOPIC_ALIAS: 1}),
        )
        + wait(5000)
    )
    seeds.update(feature_seeds())
    return seeds


def feature_seeds() -> dict[str, bytes]:
    """Sessions through the caller-driven features: authentication answers, interception
    verdicts, the publish rate and connection limits."""
    seeds: dict[str, bytes] = {}
    auth_packet = m.packet(
        m.AUTH,
        0,
        bytes([0x18])
        + m.properties({m.AUTHENTICATION_METHOD: "SCRAM", m.AUTHENTICATION_DATA: b"client"}),
    )
    enhanced = m.connect(
        "scram",
        protocol=V5,
        username="u",
        password=b"p",
        props={m.AUTHENTICATION_METHOD: "SCRAM", m.AUTHENTICATION_DATA: b"first"},
    )
    restricted_use = (
        m.subscribe(1, [("r/#", 1), ("b/#", 1)], protocol=V5)
        + m.publish("a/x", b"ok", qos=1, packet_id=2, protocol=V5)
        + m.publish("b/x", b"denied", qos=1, packet_id=3, protocol=V5)
    )
    seeds["auth_enhanced_v5"] = (
        header(features=AUTH)
        + feed(0, enhanced)
        + AUTH_CONTINUE
        + feed(0, auth_packet)
        + AUTH_ACCEPT_RESTRICTED
        + feed(0, restricted_use)
        + feed(1, m.connect("plain", protocol=V5, username="v", password=b"w"))
        + AUTH_ACCEPT
        + feed(1, m.publish("r/y", b"to the reader", qos=1, protocol=V5))
    )
    seeds["auth_refused_v311"] = (
        header(features=AUTH | SMALL_AUTH_BUFFER)
        + feed(0, m.connect("who", username="x", password=b"y") + m.publish("a", bytes(64)))
        + AUTH_REFUSE
        + feed(1, m.connect("gone", username="x", password=b"y"))
        + peer_close(1)
        + AUTH_ACCEPT
    )
    publishes = b"".join(
        m.publish(f"a/{i}", b"m", qos=i % 3, packet_id=i + 1, protocol=V5) + m.pubrel(i + 1)
        for i in range(6)
    )
    seeds["intercept_v5"] = (
        header(features=INTERCEPT)
        + feed(0, m.connect("i", protocol=V5) + m.subscribe(1, [("#", 2)], protocol=V5))
        + feed(0, publishes)
        + ROUTE
        + DROP
        + feed(1, m.connect("j") + m.publish("a/z", b"n", qos=1))
        + DENY
        + ROUTE_REWRITTEN
        + ROUTE_INVALID
    )
    seeds["rate_and_connection_limits"] = (
        header(features=PUBLISH_RATE | MAX_CONNECTIONS)
        + feed(0, m.connect("r1") + b"".join(m.publish("q", b"x") for _ in range(8)))
        + feed(1, m.connect("r2", protocol=V5))
        + feed(2, m.connect("r3", protocol=V5))
        + wait(2000)
        + feed(0, m.pingreq())
    )
    return seeds


def _split_points(n: int) -> list[int]:
    points, at = [], 0
    while at < n:
        points.append(at)
        at += 1 + at % 3
    return points


def decode_seeds() -> dict[str, bytes]:
    """One stream per version with every client packet; the first byte (even) selects the
    large maximum."""
    return {
        f"session_{tag}": b"\x00" + qos_session(p, "d") for p, tag in ((V3, "v311"), (V5, "v5"))
    }


# ---- cluster_batch: data-plane batches (layout in rust/src/cluster/batch.rs) ----


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def _batch(items: list[bytes], seq: int = 1, ack: int = 0) -> bytes:
    header = b"\x01\x00" + (7).to_bytes(8, "little") + seq.to_bytes(8, "little")
    header += (1).to_bytes(8, "little") + ack.to_bytes(8, "little")
    return header + _field(len(items).to_bytes(4, "little") + b"".join(items))


def _message(
    topic: bytes, payload: bytes, flags: int, expiry: int | None = None, groups: tuple = ()
) -> bytes:
    # A retained message carries its stamp (clock, node) and flag 0x10.
    stamp = b""
    if flags & 0b100:
        flags |= 0b1_0000
        stamp = (5 << 16).to_bytes(8, "little") + (9).to_bytes(8, "little")
    expiry_field = b"\x00" if expiry is None else b"\x01" + expiry.to_bytes(8, "little")
    # Properties block as the codec encodes it: a user property ("k", "v").
    props = b"\x07\x26\x00\x01k\x00\x01v"
    body = _field(topic) + _field(payload) + _field(props)
    body += len(groups).to_bytes(4, "little") + b"".join(_field(g) for g in groups)
    return b"\x05" + bytes([flags]) + stamp + expiry_field + body


def cluster_batch_seeds() -> dict[str, bytes]:
    """Route rows (snapshot, add, remove, resync), messages of every QoS, retained (stamped),
    with expiry and properties, a retained set, an acknowledgement-only batch, and the items
    of sessions across nodes (kick, claim, claim answer, copies)."""
    snapshot = b"\x01" + (1).to_bytes(8, "little") + (2).to_bytes(4, "little")
    snapshot += _field(b"a/+/c") + _field(b"#")
    add = b"\x02" + (2).to_bytes(8, "little") + _field(b"x/y")
    remove = b"\x03" + (3).to_bytes(8, "little") + _field(b"#")
    return {
        "routes": _batch([snapshot, add, remove, b"\x04"]),
        "messages": _batch(
            [
                _message(b"t/0", b"zero", 0),
                _message(b"t/1", b"one", 1, 60_000),
                _message(b"t/2", b"two", 2),
                _message(b"r/1", b"kept", 0b101),
                _message(b"s/1", b"shared", 0b1001, groups=(b"$share/g/s/#",)),
            ]
        ),
        # A peer's retained set as sent on link up: kept only (plain off), a tombstone,
        # then "retained set sent".
        "retained_set": _batch(
            [_message(b"r/1", b"kept", 0b1100), _message(b"r/2", b"", 0b1100), b"\x06"]
        ),
        "ack_only": _batch([], seq=0, ack=3),
        # Sessions across nodes: a kick, a claim of the local subscriber's id, and an
        # answer handing a session over (one record, as the store seals it: not a valid
        # envelope here, which the restore path must refuse without harm).
        "sessions": _batch(
            [
                b"\x07" + _field(b"sub"),
                b"\x08" + _field(b"sub") + (9).to_bytes(8, "little") * 2 + b"\x00",
                b"\x09"
                + _field(b"dev")
                + (9).to_bytes(8, "little") * 2
                + (1).to_bytes(4, "little")
                + _field(b"s\x00\x03dev")
                + _field(b"sealed?"),
            ]
        ),
        # Copies of a session homed on the peer (protocol 4): a put and a delete of its
        # records, a version check, a fence naming where the session lives, the peer's
        # "installed" marker and its "safe" acknowledgement.
        "copies": _batch(
            [
                b"\x0b"
                + (4).to_bytes(8, "little")
                + (9).to_bytes(8, "little") * 2
                + _field(b"s\x00\x03dev")
                + b"\x01"
                + _field(b"sealed?"),
                b"\x0b"
                + (4).to_bytes(8, "little")
                + (9).to_bytes(8, "little") * 2
                + _field(b"m\x00\x03dev" + (1).to_bytes(8, "big"))
                + b"\x00",
                b"\x0c" + _field(b"dev") + (3).to_bytes(8, "little") * 2,
                b"\x0d" + _field(b"sub") + (99).to_bytes(8, "little") * 2 + _field(b"peer"),
                b"\x0e" + _field(b"dev"),
                b"\x0f" + (1).to_bytes(8, "little") + (1).to_bytes(8, "little"),
            ]
        ),
        # Passed on by a node the session left, with the node each came from (protocol
        # 15): a session message and the end of a hand-over.
        "handed_on": _batch(
            [
                b"\x21"
                + (77).to_bytes(8, "little")
                + b"\x0a"
                + _field(b"dev")
                + b"\x01\x00"
                + (0).to_bytes(4, "little")
                + _message(b"t/1", b"one", 1),
                b"\x21" + (77).to_bytes(8, "little") + b"\x1e" + _field(b"dev"),
            ]
        ),
    }


def main() -> None:
    for target, seeds in (
        ("engine_feed", engine_seeds()),
        ("decode", decode_seeds()),
        ("cluster_batch", cluster_batch_seeds()),
    ):
        folder = FUZZ_DIR / "corpus" / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            (folder / name).write_bytes(data)
        print(f"{target}: {len(seeds)} seeds in {folder}")


if __name__ == "__main__":
    main()
