"""Partial splits, decided from what pings say (fastbroker.cluster.reach): which of two
members cut apart while a third hears both steps aside, and that clean splits, stale pings
and hostile ones make no node step aside."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastbroker.cluster.reach import (
    alive_members,
    confirm_after_ms,
    cut_apart,
    heard_through,
    note_ping,
    parse_reach,
    parse_relayed,
    ping_fields,
    suspect_after_ms,
)

SUSPECT = 1250
NOW = 100_000


LONG = 60_000


@dataclass
class View:
    last_seen: int
    reach: dict[str, tuple[int, int]] = field(default_factory=dict)
    relayed: dict[str, frozenset[str]] = field(default_factory=dict)
    heard_since: int = NOW - LONG


def mesh(own: str, members: list[str], cut: set[frozenset[str]], silent_for: int) -> dict:
    """The views `own` holds of its peers' pings: links in `cut` have been silent for
    `silent_for` ms, every other link answers every 100 ms."""

    def hears(a: str, b: str) -> bool:
        return frozenset((a, b)) not in cut

    def reach(a: str) -> dict[str, tuple[int, int]]:
        return {
            b: ((50, LONG) if hears(a, b) else (silent_for, LONG))
            for b in members
            if b != a and (hears(a, b) or silent_for < SUSPECT)
        }

    views = {}
    for peer in members:
        if peer == own:
            continue
        if hears(own, peer):
            relayed = {m: frozenset(reach(m)) for m in reach(peer) if m != own}
            views[peer] = View(NOW - 50, reach(peer), relayed)
        else:
            views[peer] = View(NOW - silent_for)
    return views


def step_aside_for(own: str, members: list[str], views: dict, now: int, since: int, suspect: int):
    """(the member, a node that hears it) if `own` is the one of two cut apart that steps
    aside, as the node decides from `cut_apart`; else None."""
    found = cut_apart(own, members, views, now, since, suspect)
    return next(((member, through) for member, through, aside in found if aside), None)


def decide(own: str, members: list[str], cut: set[frozenset[str]], silent_for: int = 3000):
    views = mesh(own, members, cut, silent_for)
    return step_aside_for(own, members, views, NOW, 0, SUSPECT)


def test_the_default_settings_suspect_a_partial_split_well_before_the_failure_timeout():
    assert suspect_after_ms(5000, 150) == 900
    assert suspect_after_ms(5000, 100) == 600
    assert suspect_after_ms(20_000, 150) == 2000
    assert confirm_after_ms(150) == 300


def test_of_two_members_cut_apart_while_a_third_hears_both_the_one_that_sorts_last_steps_aside():
    three = ["n1", "n2", "n3"]
    cut = {frozenset(("n1", "n2"))}
    assert decide("n2", three, cut) == ("n1", "n3")
    assert decide("n1", three, cut) is None
    # The bridge hears everyone.
    assert decide("n3", three, cut) is None


def test_both_members_cut_apart_know_it_and_the_bridge_is_cut_from_none():
    """Each of the two cuts its data link to the other (the one that does not step aside
    too: its engine would find the silent link down only at the failure timeout)."""
    three = ["n1", "n2", "n3"]
    cut = {frozenset(("n1", "n2"))}

    def cuts(own: str) -> list[tuple[str, str, bool]]:
        return cut_apart(own, three, mesh(own, three, cut, 3000), NOW, 0, SUSPECT)

    assert cuts("n1") == [("n2", "n3", False)]
    assert cuts("n2") == [("n1", "n3", True)]
    assert cuts("n3") == []
    clean = {frozenset(("n1", "n2")), frozenset(("n1", "n3"))}
    assert cut_apart("n2", three, mesh("n2", three, clean, 3000), NOW, 0, SUSPECT) == []


def test_a_member_is_alive_while_this_node_or_one_it_hears_hears_it():
    """What the engine is told (`cluster_peer_alive`): in a partial split each of the two
    cut apart is alive for the other through the bridge; in a clean split the node alone
    is alive for nobody, nor is anyone for it."""
    three = ["n1", "n2", "n3"]

    def alive(own: str, cut: set[frozenset[str]]) -> set[str]:
        return alive_members(own, three, mesh(own, three, cut, 3000), NOW, SUSPECT)

    partial = {frozenset(("n1", "n2"))}
    assert alive("n1", partial) == {"n2", "n3"}
    assert alive("n2", partial) == {"n1", "n3"}
    assert alive("n3", partial) == {"n1", "n2"}
    clean = {frozenset(("n1", "n2")), frozenset(("n1", "n3"))}
    assert alive("n2", clean) == {"n3"}
    assert alive("n1", clean) == set()
    # Word through the bridge older than half the suspect time does not count.
    views = {"n1": View(NOW - 3000), "n3": View(NOW - 300, {"n1": (SUSPECT // 2 - 200, LONG)})}
    assert alive_members("n2", three, views, NOW, SUSPECT) == {"n3"}


def test_no_node_steps_aside_in_a_whole_cluster_or_before_the_suspect_time():
    three = ["n1", "n2", "n3"]
    assert all(decide(n, three, set()) is None for n in three)
    cut = {frozenset(("n1", "n2"))}
    assert decide("n2", three, cut, silent_for=SUSPECT - 100) is None


def test_a_clean_split_makes_no_node_step_aside():
    """n1 alone: n2 and n3 lost it at the same moment, so neither hears it through the
    other once the suspect time has passed."""
    three = ["n1", "n2", "n3"]
    cut = {frozenset(("n1", "n2")), frozenset(("n1", "n3"))}
    for own in three:
        assert decide(own, three, cut) is None


def test_a_relayed_ping_older_than_half_the_suspect_time_is_not_taken_as_hearing():
    views = {
        "n1": View(NOW - 3000),
        "n3": View(NOW - 300, {"n1": (SUSPECT // 2 - 200, LONG), "n2": (10, LONG)}),
    }
    assert heard_through("n1", views, "n2", NOW, SUSPECT // 2, NOW - 3000) == []
    assert step_aside_for("n2", ["n1", "n2", "n3"], views, NOW, 0, SUSPECT) is None
    views["n3"].last_seen = NOW - 100
    assert heard_through("n1", views, "n2", NOW, SUSPECT // 2, NOW - 3000) == ["n3"]


def test_links_of_a_clean_split_coming_back_one_at_a_time_are_no_partial_split():
    """At the heal of n2 cut off alone, n2 hears n3 again before n1 (each link finds its
    way back on its own): n3 hears n1, but n2 has heard n3 only since after it lost n1."""
    views = {
        "n1": View(NOW - 4000, heard_since=NOW - LONG),
        "n3": View(NOW - 50, {"n1": (50, LONG), "n2": (50, 300)}, {"n1": frozenset({"n3"})}),
    }
    views["n3"].heard_since = NOW - 300
    assert step_aside_for("n2", ["n1", "n2", "n3"], views, NOW, 0, SUSPECT) is None
    # Nor when n1 starts again after a stop and reaches n3 first: n3 has heard the new n1
    # only since after n2 last heard the old one.
    views["n3"] = View(NOW - 50, {"n1": (50, 300), "n2": (50, LONG)}, {"n1": frozenset({"n3"})})
    assert step_aside_for("n2", ["n1", "n2", "n3"], views, NOW, 0, SUSPECT) is None
    # Heard without a break on both sides since before n2 lost n1: a partial split.
    views["n3"] = View(NOW - 50, {"n1": (50, LONG), "n2": (50, LONG)}, {"n1": frozenset({"n3"})})
    assert step_aside_for("n2", ["n1", "n2", "n3"], views, NOW, 0, SUSPECT) == ("n1", "n3")


def test_the_member_that_hears_fewer_steps_aside_whatever_the_names():
    """Five nodes: n1 reaches only n5; n2, n3 and n4 reach each other and n5. n1 steps
    aside, not the three it is cut off from (which would leave no side with a majority)."""
    five = ["n1", "n2", "n3", "n4", "n5"]
    cut = {frozenset(("n1", m)) for m in ("n2", "n3", "n4")}
    assert decide("n1", five, cut) == ("n2", "n5")
    for own in ("n2", "n3", "n4", "n5"):
        assert decide(own, five, cut) is None


def test_the_other_members_stale_count_of_this_one_does_not_make_both_step_aside():
    """n1's relayed reach still names n2 (its ping was made before it lost n2): neither
    count includes the other member, so n2 still sorts last and alone steps aside."""
    heard = {"n1": (50, LONG), "n2": (50, LONG)}
    views = {
        "n1": View(NOW - 3000),
        "n3": View(NOW - 50, heard, {"n1": frozenset({"n2", "n3"})}),
    }
    assert step_aside_for("n2", ["n1", "n2", "n3"], views, NOW, 0, SUSPECT) == ("n1", "n3")
    views = {
        "n2": View(NOW - 3000),
        "n3": View(NOW - 50, heard, {"n2": frozenset({"n1", "n3"})}),
    }
    assert step_aside_for("n1", ["n1", "n2", "n3"], views, NOW, 0, SUSPECT) is None


def test_a_member_never_heard_counts_from_the_start_or_the_last_map_change():
    views = {"n3": View(NOW - 50, {"n1": (50, LONG)}, {"n1": frozenset({"n3"})})}
    three = ["n1", "n2", "n3"]
    assert step_aside_for("n2", three, views, NOW, NOW - 500, SUSPECT) is None
    assert step_aside_for("n2", three, views, NOW, NOW - 2000, SUSPECT) == ("n1", "n3")
    # Not a member (joining, or removed): it never steps aside.
    assert step_aside_for("n4", three, views, NOW, 0, SUSPECT) is None


def test_a_ping_says_whom_the_node_hears_and_whom_each_of_those_hears():
    views = {
        "n1": View(NOW - 40, {"n3": (30, 900)}, heard_since=NOW - 700),
        "n3": View(NOW - 3000, {"n1": (10, 900)}),
        "n9": View(NOW - 10, {"n1": (10, 900)}),
    }
    fields = ping_fields(views, ["n1", "n2", "n3"], "n2", NOW, SUSPECT)
    assert fields == {"reach": {"n1": [40, 700]}, "relayed": {"n1": ["n3"]}}


def test_a_silence_longer_than_the_break_starts_a_new_stretch_of_hearing():
    view = View(0, heard_since=0)
    note_ping(view, 1000, 500)
    assert (view.heard_since, view.last_seen) == (1000, 1000)
    note_ping(view, 1400, 500)
    assert (view.heard_since, view.last_seen) == (1000, 1400)
    note_ping(view, 2000, 500)
    assert (view.heard_since, view.last_seen) == (2000, 2000)


def test_malformed_reach_in_a_ping_is_dropped_not_trusted():
    assert parse_reach(None) == {}
    assert parse_reach([1, 2]) == {}
    hostile = {"n1": [5, 9], "n2": [-1, 3], "n3": "x", 4: [1, 1], "n4": [True, 1], "n5": [1]}
    hostile["n6"] = [1 << 41, 0]
    hostile["n7"] = 5
    assert parse_reach(hostile) == {"n1": (5, 9)}
    assert parse_relayed({"n1": ["n2", 3, None], "n2": "n3", 5: ["n1"]}) == {
        "n1": frozenset({"n2"})
    }
    assert parse_relayed("x") == {}
