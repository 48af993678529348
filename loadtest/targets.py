"""Parse ``--host``: ``mqtt://host:port``, or a comma-separated list of nodes."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883
SCHEMES = {"mqtt": False, "tcp": False, "mqtts": True, "ssl": True}


@dataclass(frozen=True)
class Node:
    host: str
    port: int
    tls: bool = False

    @property
    def name(self) -> str:
        """``host:port``, the ``node`` field of the records."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_node(text: str, default_tls: bool = False) -> Node:
    text = text.strip()
    tls = default_tls
    if "://" in text:
        scheme, text = text.split("://", 1)
        if scheme.lower() not in SCHEMES:
            raise ValueError(f"unsupported scheme {scheme!r} (use mqtt:// or mqtts://)")
        tls = SCHEMES[scheme.lower()]
    text = text.rstrip("/")
    if not text:
        raise ValueError("empty host")
    port = DEFAULT_TLS_PORT if tls else DEFAULT_PORT
    if text.startswith("["):  # [ipv6]:port
        host, _, rest = text[1:].partition("]")
        if rest.startswith(":"):
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = int(port_text)
    else:
        host = text
    if not host or not 0 < port < 65536:
        raise ValueError(f"bad node {text!r}")
    return Node(host, port, tls)


def parse_hosts(spec: str | None) -> list[Node]:
    """``mqtt://a:1883,b:1884,mqtts://c`` -> nodes; the first scheme applies to later bare items."""
    if not spec:
        return [Node("127.0.0.1", DEFAULT_PORT)]
    nodes: list[Node] = []
    tls = False
    for item in spec.split(","):
        if not item.strip():
            continue
        node = parse_node(item, default_tls=tls)
        tls = node.tls
        nodes.append(node)
    if not nodes:
        raise ValueError(f"no node in {spec!r}")
    return nodes
