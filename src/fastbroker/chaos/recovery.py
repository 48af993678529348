"""How long each fault of a run hurt, from the history alone: what an operator asks after a
node died or a split healed ("how long until the cluster was whole, and how long were
clients without service?"). Not anomalies: figures, per fault and per kind of fault.

The nemesis records a fault as an ``info`` record with the node and ``seconds`` (how long
it lasts), its end as ``start``, ``resume``, ``heal``, ``join`` or ``space`` for that node,
then ``converged`` (``after``: seconds from the end until every node was a member with the
same map and every data link up) or ``not_converged``. For each fault, over the window from the
fault to the cluster whole again:

- ``whole_after``: seconds from the fault's end until the cluster was whole (None: it was
  not within the runner's wait);
- ``publish_gap``: the longest time any one publisher went without an acknowledged publish
  (a publisher on an unaffected node shows its ordinary interval);
- ``receive_gap``: the longest time any one subscriber went without receiving a message
  (subscribers also move between nodes on their own: a move is a short gap too);
- ``connect_wait``: the longest a client waited for a successful CONNACK.

A gap runs from the client's last success before the fault, and up to the window's end at
most (silence after the cluster is whole again is no longer the fault's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from fastbroker.chaos.history import Op

ENDS = frozenset({"start", "resume", "heal", "join", "space"})
WHOLE = frozenset({"converged", "not_converged"})


@dataclass
class Recovery:
    fault: str
    node: str
    at: float
    lasted: float
    whole_after: float | None
    publish_gap: float
    receive_gap: float
    connect_wait: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest interval between consecutive `times` (sorted) that overlaps
    [`start`, `end`], from the last time before `start` and counted up to `end` at most
    (after the cluster is whole again, silence is no longer the fault's)."""
    before = [t for t in times if t <= start]
    inside = [t for t in times if start < t <= end]
    previous = before[-1] if before else start
    longest = 0.0
    for t in inside:
        longest = max(longest, t - previous)
        previous = t
    return max(longest, end - previous)


def measure(ops: Iterable[Op]) -> list[Recovery]:
    ops = list(ops)
    acked: dict[str, list[float]] = defaultdict(list)
    received: dict[str, list[float]] = defaultdict(list)
    waits: list[tuple[float, float]] = []
    for op in ops:
        if op.f == "publish" and op.type == "ok":
            acked[op.process].append(op.t)
        elif op.f == "receive":
            received[op.process].append(op.t)
        elif op.f == "connect" and op.type == "ok" and "waited" in op.value:
            waits.append((op.t, float(op.value["waited"])))
    found: list[Recovery] = []
    nemesis = [op for op in ops if op.process == "nemesis"]
    for i, op in enumerate(nemesis):
        if "seconds" not in op.value or op.f in ENDS | WHOLE:
            continue
        node = str(op.value.get("node", ""))
        end = next(
            (e for e in nemesis[i + 1 :] if e.f in ENDS and e.value.get("node") in (node, None)),
            None,
        )
        if end is None:
            continue
        whole = next((w for w in nemesis[i + 1 :] if w.f in WHOLE and w.index > end.index), None)
        until = whole.t if whole is not None else end.t
        whole_after = None
        if whole is not None and whole.f == "converged":
            whole_after = round(float(whole.value.get("after", whole.t - end.t)), 3)

        def worst(
            series: dict[str, list[float]], start: float = op.t, stop: float = until
        ) -> float:
            gaps = [longest_gap(times, start, stop) for times in series.values() if times]
            return round(max(gaps, default=0.0), 3)

        connect_wait = max((w for t, w in waits if op.t <= t <= until), default=0.0)
        found.append(
            Recovery(
                fault=op.f,
                node=node,
                at=round(op.t, 3),
                lasted=round(end.t - op.t, 3),
                whole_after=whole_after,
                publish_gap=worst(acked),
                receive_gap=worst(received),
                connect_wait=round(connect_wait, 3),
            )
        )
    return found


def by_kind(found: list[Recovery]) -> dict[str, dict[str, object]]:
    """Per kind of fault: how many, and the worst of each figure (None if the cluster was
    not whole again after one of them within the runner's wait)."""
    kinds: dict[str, list[Recovery]] = defaultdict(list)
    for r in found:
        kinds[r.fault].append(r)
    summary: dict[str, dict[str, object]] = {}
    for kind, rs in sorted(kinds.items()):
        wholes = [r.whole_after for r in rs]
        summary[kind] = {
            "count": len(rs),
            "whole_after_max": None if None in wholes else max(w for w in wholes if w is not None),
            "publish_gap_max": max(r.publish_gap for r in rs),
            "receive_gap_max": max(r.receive_gap for r in rs),
            "connect_wait_max": max(r.connect_wait for r in rs),
        }
    return summary


def table(found: list[Recovery]) -> list[str]:
    """Lines for the terminal: one per fault, then one per kind (the worst)."""
    if not found:
        return []
    lines = ["recovery (s): fault node at lasted whole_after publish_gap receive_gap connect_wait"]

    def show(value: object) -> str:
        return "-" if value is None else f"{value}"

    for r in found:
        figures = (r.at, r.lasted, r.whole_after, r.publish_gap, r.receive_gap, r.connect_wait)
        lines.append(f"  {r.fault} {r.node} " + " ".join(show(v) for v in figures))
    lines.append(
        "recovery by kind (worst, s): kind count whole_after publish_gap receive_gap connect_wait"
    )
    for kind, s in by_kind(found).items():
        figures = (
            s["whole_after_max"],
            s["publish_gap_max"],
            s["receive_gap_max"],
            s["connect_wait_max"],
        )
        lines.append(f"  {kind} {s['count']} " + " ".join(show(v) for v in figures))
    return lines
