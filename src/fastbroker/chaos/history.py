"""The history a fault-injection run records: one JSON object per line, in the order things
happened (as Jepsen's histories: the checker reads only this).

Every record has ``t`` (seconds since the run began), ``process`` (who did it: a client's
name, or ``"nemesis"``), ``type`` and ``f`` (what), and ``value``:

- ``type``: ``"invoke"`` (an operation begins), ``"ok"`` (it completed), ``"fail"`` (it
  certainly did not happen: e.g. a PUBACK with an error reason code), ``"info"`` (its outcome
  is unknown: e.g. the connection dropped before the acknowledgement; also used for
  observations and for the nemesis).
- ``f`` and its ``value``:

  ==============  ==========================================================================
  ``connect``     ``{"client", "node", "clean": bool, "will": {"topic", "id"} | null}``;
                  ok adds ``"session_present"``. A persistent client connects with
                  ``clean`` false and keeps its session for the whole run.
  ``subscribe``   ``{"client", "filter", "qos"}``
  ``unsubscribe`` ``{"client", "filter"}``
  ``publish``     ``{"client", "topic", "qos", "retain", "id"}``: ``id`` is unique in the
                  run (the payload carries it); an empty ``id`` with ``retain`` deletes.
  ``receive``     ``{"client", "topic", "qos", "id", "retain", "dup"}`` (type ``info``): a
                  message a client received.
  ``retained``    ``{"node", "topic", "id"}`` (type ``info``, after the final heal): the
                  retained message a node holds for a topic (``id`` null: none).
  ``sessions``    ``{"client", "nodes": [...]}`` (type ``info``, after the final heal): the
                  nodes that hold a session of that client id.
  ``dropped``     ``{"client", "count"}`` (type ``info``): messages the broker counted as
                  dropped for that client's session (its queue limit).
  ``degraded``    ``{"node", "count", "destroyed": bool}`` (type ``info``): acknowledgements
                  a node gave with fewer copies than ``ack_replicas`` (issue 10), and whether
                  that node's data was then destroyed.
  ==============  ==========================================================================

  The nemesis's records are kept as they are: a fault (``kill``, ``split``, ``disk``...,
  with ``node`` and ``seconds``), its end (``start``, ``resume``, ``heal``, ``join``,
  ``space``), then ``converged`` (``after``: seconds until the cluster was whole again) or
  ``not_converged``; the recovery figures are made from them (``recovery.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

TYPES = frozenset({"invoke", "ok", "fail", "info"})


class HistoryError(ValueError):
    """A history that cannot be read: the line and what is wrong with it."""


@dataclass(frozen=True)
class Op:
    """One record of a history (see the module's docstring)."""

    index: int
    t: float
    process: str
    type: str
    f: str
    value: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        record = {
            "t": self.t,
            "process": self.process,
            "type": self.type,
            "f": self.f,
            "value": self.value,
        }
        return json.dumps(record, separators=(",", ":"), sort_keys=True)


def parse(lines: Iterable[str]) -> Iterator[Op]:
    """The records of a history, numbered in order; blank lines are skipped."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise HistoryError(f"line {number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise HistoryError(f"line {number}: not a JSON object")
        try:
            t = float(record["t"])
            process = str(record["process"])
            kind = str(record["type"])
            f = str(record["f"])
        except (KeyError, TypeError, ValueError) as error:
            raise HistoryError(f"line {number}: missing or bad field {error}") from None
        value = record.get("value", {})
        if kind not in TYPES:
            raise HistoryError(f"line {number}: type {kind!r} is not one of {sorted(TYPES)}")
        if not isinstance(value, dict):
            raise HistoryError(f"line {number}: value is not a JSON object")
        yield Op(number, t, process, kind, f, value)


def read(path: str | Path) -> list[Op]:
    with open(path, encoding="utf-8") as lines:
        return list(parse(lines))


class Recorder:
    """Appends records to a history file as they happen (flushed per record, so a run that
    is killed leaves every record made so far)."""

    def __init__(self, out: TextIO, start: float) -> None:
        self.out = out
        self.start = start
        self.count = 0

    def record(self, now: float, process: str, kind: str, f: str, **value: Any) -> None:
        if kind not in TYPES:
            raise ValueError(f"type {kind!r} is not one of {sorted(TYPES)}")
        op = Op(self.count, round(now - self.start, 6), process, kind, f, value)
        self.out.write(op.to_json() + "\n")
        self.out.flush()
        self.count += 1
