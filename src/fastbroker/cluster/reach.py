"""Partial splits: which members each node hears, told in its pings, and which node steps
aside when two members stop hearing each other while a third still hears both.

The data plane's rules for splits (docs/cluster-sessions.md, "Splits: one side acts") are
made for clean cuts, where each node reaches either a majority or not. In a partial split
(n1 and n2 cut apart, n3 reaching both) n1 and n2 each reach a majority (themselves and
the bridge), so both would act on the other as dead while it serves on, reachable through
n3: the fault suite lost acknowledged messages that way (docs/chaos.md, "Partial splits").
As SWIM's indirect probe does, a member is taken for gone only when no node in reach still
hears it:

- the leader removes no member that another member it hears still hears
  (`ClusterNode.detect_failures`);
- of two members cut apart while a third hears both, the one that hears fewer members
  (equal: the one whose id sorts last) closes its data links and refuses new ones until
  it hears the other again. That turns the partial split into a clean one (that node
  alone on its side, serving its own clients as a cut-off node does), which the data
  plane handles. Its control links stay up, so it learns when the cut heals, and it does
  not leave the membership.

A partial split is told from the links of a clean split coming back one at a time (at
the heal, or when a stopped node starts again) by continuity: this node lost the member
while it heard the third node without a break, and the third node has heard the member
without a break since before then.

Pure functions of what the pings said; the node calls them each tick.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol


class Heard(Protocol):
    """What this node keeps of a peer's pings (`fastbroker.cluster.node.PeerView`)."""

    last_seen: int
    # Since when this node has heard the peer without a break (`note_ping`).
    heard_since: int
    # Members the peer heard: how long before its ping (ms), and for how long it had
    # heard them without a break then.
    reach: dict[str, tuple[int, int]]
    # For each member the peer heard: the members that one said it hears.
    relayed: dict[str, frozenset[str]]


def suspect_after_ms(failure_timeout_ms: int, heartbeat_ms: int) -> int:
    """How long a member unheard here, while another node hears it, makes a partial split:
    past a few lost pings, well before the failure timeout (when the data plane starts
    acting on a silent peer). Until a node steps aside, the data plane runs on a partial
    mesh (a third node relays between the two), which the fault suite shows is where the
    anomalies left come from: so, as short as pings allow. Half of it is how fresh another
    node's word must be (a ping every heartbeat, each on its way for part of one: three
    heartbeats)."""
    return max(failure_timeout_ms // 10, 6 * heartbeat_ms)


def confirm_after_ms(heartbeat_ms: int) -> int:
    """How long pings must keep showing a partial split before this node steps aside: a
    ping that waited in this node's socket buffer (a busy event loop) reports hearing a
    member later than it did, the next ones do not."""
    return 2 * heartbeat_ms


def note_ping(view: Heard, now: int, break_ms: int) -> None:
    """A ping from the peer of `view` came at `now`: a silence longer than `break_ms`
    before it starts a new stretch of hearing it."""
    if not view.last_seen or now - view.last_seen > break_ms:
        view.heard_since = now
    view.last_seen = now


def reach_of(
    peers: Mapping[str, Heard], members: Iterable[str], own: str, now: int, within_ms: int
) -> dict[str, tuple[int, int]]:
    """The members (other than `own`) heard within `within_ms`: how long ago, and for how
    long without a break."""
    reach = {}
    for member in members:
        view = peers.get(member)
        if member != own and view is not None and view.last_seen:
            age = now - view.last_seen
            if age < within_ms:
                reach[member] = (age, now - view.heard_since)
    return reach


def alive_members(
    own: str, members: Iterable[str], peers: Mapping[str, Heard], now: int, suspect_ms: int
) -> set[str]:
    """The members (other than `own`) this node heard within `suspect_ms`, or that one of
    those said it heard within half that: alive, whatever their data links to this node (a
    partial split, a failing store). A member no node in reach hears is not."""
    ids = set(members)
    alive = set(reach_of(peers, ids, own, now, suspect_ms))
    fresh = suspect_ms // 2
    for peer in list(alive):
        view = peers[peer]
        since_ping = now - view.last_seen
        for member, (age, _) in view.reach.items():
            if member in ids and member != own and age + since_ping < fresh:
                alive.add(member)
    return alive


def ping_fields(
    peers: Mapping[str, Heard], members: Iterable[str], own: str, now: int, within_ms: int
) -> dict[str, Any]:
    """What a ping says of reach: whom this node hears, and whom each of those hears."""
    reach = reach_of(peers, members, own, now, within_ms)
    relayed = {member: sorted(peers[member].reach) for member in reach}
    return {"reach": {m: list(v) for m, v in reach.items()}, "relayed": relayed}


def parse_reach(value: Any) -> dict[str, tuple[int, int]]:
    """A ping's `reach`: member ids to [age, stretch] (ms); anything else (an older node's
    ping, a hostile one) is dropped."""
    if not isinstance(value, dict):
        return {}

    def ms(v: Any) -> bool:
        return type(v) is int and 0 <= v < 1 << 40

    return {
        k: (v[0], v[1])
        for k, v in value.items()
        if isinstance(k, str) and isinstance(v, list) and len(v) == 2 and ms(v[0]) and ms(v[1])
    }


def parse_relayed(value: Any) -> dict[str, frozenset[str]]:
    """A ping's `relayed`: member ids to the member ids they hear; as `parse_reach`."""
    if not isinstance(value, dict):
        return {}
    return {
        k: frozenset(m for m in v if isinstance(m, str))
        for k, v in value.items()
        if isinstance(k, str) and isinstance(v, list)
    }


def heard_through(
    member: str,
    peers: Mapping[str, Heard],
    own: str,
    now: int,
    within_ms: int,
    lost_at: int,
) -> list[str]:
    """The peers that heard `member` within `within_ms` of now, going by their pings, and
    heard it without a break since before `lost_at` (when this node last heard it), while
    this node heard them without a break since then too (see above)."""
    through = []
    for peer, view in peers.items():
        if peer in (own, member) or not view.last_seen or view.heard_since > lost_at:
            continue
        heard = view.reach.get(member)
        if heard is None:
            continue
        age, stretch = heard
        since_ping = now - view.last_seen
        if age + since_ping < within_ms and now - since_ping - stretch <= lost_at:
            through.append(peer)
    return sorted(through)


def cut_apart(
    own: str,
    members: Iterable[str],
    peers: Mapping[str, Heard],
    now: int,
    counted_from: int,
    suspect_ms: int,
) -> list[tuple[str, str, bool]]:
    """Each member this node is cut apart from while another node still hears it: (the
    member, a node that hears it, whether this node is the one of the two that steps aside;
    see above). A member counts as unheard from `counted_from` at the latest (this node's
    start or the last map change)."""
    ids = sorted(members)
    if own not in ids:
        return []
    fresh = suspect_ms // 2
    own_reach = set(reach_of(peers, ids, own, now, suspect_ms))
    found = []
    for member in ids:
        if member == own:
            continue
        view = peers.get(member)
        heard = max(view.last_seen if view is not None else 0, counted_from)
        if now - heard <= suspect_ms:
            continue
        through = heard_through(member, peers, own, now, fresh, heard)
        through = [p for p in through if p in ids]
        if not through:
            continue
        # How many each of the two hears, not counting the other (whose loss each finds at
        # a different moment); the member's as the nodes that hear it relay it, unknown
        # (an older node) as a tie.
        ours = len(own_reach - {member})
        relayed = [peers[p].relayed[member] for p in through if member in peers[p].relayed]
        theirs = max((len(r - {own}) for r in relayed), default=ours)
        steps_aside = ours < theirs or (ours == theirs and own > member)
        found.append((member, through[0], steps_aside))
    return found
