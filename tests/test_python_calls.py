"""The publish path does no per-message Python work: the Python-level calls one read costs do
not grow with the number of PUBLISH packets in it.

The broker's connection layer runs in this process under a profiler (sys.setprofile sees every
Python function call and every call Python code makes into C); the engine is wrapped in a proxy
that counts the calls the connection layer makes into it. Clients are raw sockets in a thread.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
from collections import Counter

import fastbroker_core
from layer import Layer

# Plain MQTT 3.1.1 packets, hand-encoded (independent of the broker's codec).
CONNECT_SUB = bytes([0x10, 15, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 0, 0, 3]) + b"sub"
CONNECT_PUB = bytes([0x10, 15, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 0, 0, 3]) + b"pub"
SUBSCRIBE = bytes([0x82, 8, 0, 1, 0, 3]) + b"t/#" + bytes([0])
PAYLOAD = b"x" * 64
PUBLISH = bytes([0x30, 2 + 3 + len(PAYLOAD), 0, 3]) + b"t/a" + PAYLOAD


class CountingEngine:
    """Forwards to the real engine, counting the connection layer's calls into it."""

    def __init__(self, engine: fastbroker_core.Engine) -> None:
        self.engine = engine
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str):
        target = getattr(self.engine, name)

        def counted(*args):
            self.calls[name] += 1
            return target(*args)

        # Cached, so the proxy's own lookups happen once per name, not once per call.
        setattr(self, name, counted)
        return counted


# The proxy's frames are the test's overhead, not the broker's work: its calls are counted in
# CountingEngine.calls instead.
PROXY_CODES = {CountingEngine.__getattr__.__code__}


def is_counted(code) -> bool:
    return code.co_name == "counted" and code.co_filename == __file__


def read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        data += chunk
    return bytes(data)


def measure(n_publishes: int) -> tuple[Counter[str], Counter[str]]:
    """Sends one write of n QoS 0 publishes through a real broker connection layer; returns
    (calls into the engine, profiler events) during that window."""
    engine = CountingEngine(fastbroker_core.Engine({}))
    layer = Layer(engine)
    loop, port = layer.loop, layer.port
    events: Counter[str] = Counter()
    ready = threading.Event()
    done = threading.Event()
    go = threading.Event()
    errors: list[BaseException] = []

    def clients() -> None:
        try:
            sub = socket.create_connection(("127.0.0.1", port), timeout=10)
            pub = socket.create_connection(("127.0.0.1", port), timeout=10)
            sub.sendall(CONNECT_SUB)
            read_exactly(sub, 4)  # CONNACK
            sub.sendall(SUBSCRIBE)
            read_exactly(sub, 5)  # SUBACK
            pub.sendall(CONNECT_PUB)
            read_exactly(pub, 4)
            ready.set()
            go.wait(10)
            pub.sendall(PUBLISH * n_publishes)
            read_exactly(sub, len(PUBLISH) * n_publishes)
            sub.close()
            pub.close()
        except BaseException as error:  # reported by the test thread
            errors.append(error)
        finally:
            ready.set()
            done.set()

    def profiler(frame, event, arg) -> None:
        # The test's own waiting (asyncio.sleep, threading.Event) is not the broker's work.
        code = frame.f_code
        if code.co_name == "run" or any(m in code.co_filename for m in ("asyncio", "threading")):
            return
        caller = frame.f_back
        if code in PROXY_CODES or is_counted(code) or (caller and is_counted(caller.f_code)):
            return  # the proxy's wrapper, and what it calls (the engine: counted apart)
        if event in ("call", "c_call"):
            name = arg.__qualname__ if event == "c_call" else code.co_name
            events[f"{event}:{name}"] += 1

    async def run() -> None:
        while not ready.is_set():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # let setup output flush
        engine.calls.clear()
        sys.setprofile(profiler)
        go.set()
        while not done.is_set():
            await asyncio.sleep(0)
        sys.setprofile(None)

    thread = threading.Thread(target=clients, daemon=True)
    thread.start()
    try:
        loop.run_until_complete(asyncio.wait_for(run(), 20))
    finally:
        sys.setprofile(None)
        thread.join(5)
        layer.close()
    assert not errors, errors
    return engine.calls, events


def python_work(calls: Counter[str], events: Counter[str]) -> int:
    """Python-level calls on the broker's side: calls into the engine, and every other call
    the profiler saw."""
    return sum(calls.values()) + sum(events.values())


def batches(calls: Counter[str]) -> int:
    """What the broker's Python work is paid per: reads (each is one engine.feed) and passes
    of flushing (each runs the control-plane hooks once, starting with has_resumed). How many
    of each there are depends on how TCP split the bytes and how busy the machine is."""
    return calls["feed"] + calls["has_resumed"]


def test_python_calls_per_read_do_not_grow_with_publishes_per_read():
    n = 2000
    small_calls, small_events = measure(1)
    big_calls, big_events = measure(n)
    # Every read is one engine.feed, whatever it holds.
    assert small_calls["feed"] >= 1 and big_calls["feed"] >= 1
    per_batch_small = python_work(small_calls, small_events) / batches(small_calls)
    per_batch_big = python_work(big_calls, big_events) / batches(big_calls)
    print(
        f"\n1 publish: calls {dict(small_calls)} other {dict(small_events)};"
        f"\n{n} publishes: calls {dict(big_calls)} other {dict(big_events)};"
        f"\nper read or flush {per_batch_small:.1f} vs {per_batch_big:.1f}"
    )
    # n publishes arrive in a few reads; per-message Python work would show as thousands of
    # calls. A few calls per read or flush (feed; the hooks, drain, has_output) is the whole
    # cost, so the cost per batch does not grow with the messages in it.
    assert per_batch_big <= per_batch_small + 3, (small_calls, big_calls, big_events)
    assert python_work(big_calls, big_events) < n / 10, (big_calls, big_events)
