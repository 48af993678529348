"""The ACL file (fastbroker.auth.acl): parsing, per-client rules, substitutions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastbroker.auth.acl import PUBLISH, READ, SUBSCRIBE, Acl, AclError
from fastbroker.config import ConfigError

ALL = PUBLISH | SUBSCRIBE | READ

EXAMPLE = """\
# rules before any user/client line apply to everyone
topic read $SYS/#
user alice                 # rules for username alice
topic readwrite sensors/alice/#
topic subscribe,read alerts/#
client sensor-*            # rules for client ids matching the glob (fnmatch) pattern
topic publish devices/%c/telemetry
pattern readwrite users/%u/#   # like topic, applies to everyone (mosquitto's pattern)
"""


def rules(acl: Acl, username: str | None, client_id: str) -> dict[str, int]:
    granted = acl.permissions_for(username, client_id)
    as_dict = dict((f, m) for m, f in granted)
    assert len(as_dict) == len(granted), "a filter is listed twice"
    return as_dict


def test_documented_example():
    acl = Acl.parse(EXAMPLE)
    assert rules(acl, "alice", "phone") == {
        "$SYS/#": READ,
        "sensors/alice/#": ALL,
        "alerts/#": SUBSCRIBE | READ,
        "users/alice/#": ALL,
    }
    assert rules(acl, "bob", "sensor-17") == {
        "$SYS/#": READ,
        "devices/sensor-17/telemetry": PUBLISH,
        "users/bob/#": ALL,
    }
    # Both blocks apply to alice on a sensor.
    assert rules(acl, "alice", "sensor-1")["devices/sensor-1/telemetry"] == PUBLISH
    # No username: the %u pattern cannot apply; only what applies to everyone is left.
    assert rules(acl, None, "phone") == {"$SYS/#": READ}


def test_no_matching_rule_gives_an_empty_list():
    acl = Acl.parse("user alice\ntopic readwrite a/#\n")
    # Empty, not None: with an ACL file, a client nothing grants may do nothing.
    assert acl.permissions_for("mallory", "x") == []


def test_rights_words_and_combinations():
    acl = Acl.parse(
        "topic publish p\n"
        "topic write w\n"
        "topic subscribe s\n"
        "topic read r\n"
        "topic readwrite rw\n"
        "topic subscribe,read sr\n"
        "topic PUBLISH,Read pr\n"
        "topic just/a/filter\n"
    )
    assert rules(acl, None, "c") == {
        "p": PUBLISH,
        "w": PUBLISH,
        "s": SUBSCRIBE,
        "r": READ,
        "rw": ALL,
        "sr": SUBSCRIBE | READ,
        "pr": PUBLISH | READ,
        # No rights word: readwrite, as in mosquitto.
        "just/a/filter": ALL,
    }


def test_rules_for_the_same_filter_are_merged():
    acl = Acl.parse("topic publish a/#\nuser u\ntopic subscribe a/#\npattern read a/#\n")
    assert acl.permissions_for("u", "c") == [(ALL, "a/#")]


def test_wildcard_filters_and_comments():
    acl = Acl.parse(
        "topic read #\n"
        "topic subscribe +/status # status of every device\n"
        "topic no/rights # readwrite by default\n"
        "   # an indented comment\n"
        "\n"
        "user bob   # trailing comment\n"
        "topic publish bob/#\n"
    )
    assert rules(acl, "bob", "c") == {
        "#": READ,
        "+/status": SUBSCRIBE,
        "no/rights": ALL,
        "bob/#": PUBLISH,
    }


def test_client_globs():
    acl = Acl.parse(
        "client sensor-*\ntopic publish s/%c\n"
        "client cam-??\ntopic publish c/%c\n"
        "client [ab]x\ntopic publish g/%c\n"
    )
    assert rules(acl, None, "sensor-") == {"s/sensor-": PUBLISH}
    assert rules(acl, None, "cam-01") == {"c/cam-01": PUBLISH}
    assert rules(acl, None, "cam-001") == {}
    assert rules(acl, None, "bx") == {"g/bx": PUBLISH}
    assert rules(acl, None, "cx") == {}
    # Case matters: client ids are case-sensitive.
    assert rules(acl, None, "Sensor-1") == {}


def test_user_blocks_match_the_name_exactly():
    acl = Acl.parse("user alice smith\ntopic read a\nuser al*\ntopic read b\n")
    assert rules(acl, "alice smith", "c") == {"a": READ}
    # User names are not globs.
    assert rules(acl, "alfred", "c") == {}
    assert rules(acl, "al*", "c") == {"b": READ}


@pytest.mark.parametrize(
    ("client_id", "username"),
    [
        ("a/#", "u"),  # would become devices/a/#/... : a wildcard
        ("+", "u"),
        ("x/y", "u"),  # would reach into another subtree
        ("ok", "evil/#"),
        ("ok", ""),
        ("ok", None),
        ("bad\x00", "u"),
    ],
)
def test_substituted_values_never_widen_a_rule(client_id, username):
    acl = Acl.parse("pattern readwrite devices/%c/%u/#\ntopic read public/#\n")
    assert rules(acl, username, client_id) == {"public/#": READ}


def test_substitution_inside_a_level_and_repeated():
    acl = Acl.parse("pattern publish t/%u-%c/%c\ntopic read %notaplaceholder/x\n")
    assert rules(acl, "u1", "c1") == {"t/u1-c1/c1": PUBLISH, "%notaplaceholder/x": READ}
    # A value containing "%c" is not substituted again.
    assert rules(acl, "%c", "c1") == {"t/%c-c1/c1": PUBLISH, "%notaplaceholder/x": READ}


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("topic deny secret/#", "'deny' is not supported"),
        ("topic read,deny x", "'deny' is not supported"),
        ("topic read,fly x", "unknown right 'fly'"),
        ("topic read", "expected a topic filter after 'read'"),
        ("topic", "expected [RIGHTS] TOPIC-FILTER"),
        ("topic read a/#/b", "'#' must be a whole last level"),
        ("topic read a/b#", "'#' must be a whole last level"),
        ("topic read a/b+/c", "'+' must be a whole level"),
        ("pattern write devices/%c+/x", "'+' must be a whole level"),
        ("topic read a b", "unexpected 'b'"),
        ("topic fly a/b", "unknown right 'fly'"),
        ("topic a/b c", "unknown right 'a/b'"),
        ("user", "user needs a name"),
        ("client   # only a comment", "client needs a name"),
        ("topics read a", "unknown keyword 'topics'"),
        ("topic read a\x00b", "U+0000"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, why):
    path = tmp_path / "acl"
    path.write_text(f"# ok so far\ntopic read fine/#\n{line}\n")
    with pytest.raises(AclError) as raised:
        Acl.load(path)
    message = str(raised.value)
    assert message.startswith(f"{path}:3: "), message
    assert why in message
    assert "\n" not in message
    assert isinstance(raised.value, ConfigError)


def test_unreadable_files(tmp_path):
    with pytest.raises(AclError, match="cannot read ACL file"):
        Acl.load(tmp_path / "missing")
    (tmp_path / "bin").write_bytes(b"topic read \xff\n")
    with pytest.raises(AclError, match="not UTF-8"):
        Acl.load(tmp_path / "bin")


def test_too_long_filter_is_refused():
    with pytest.raises(AclError, match="longer than 65535"):
        Acl.parse("topic read " + "a" * 65_536)


@given(
    client_id=st.text(min_size=0, max_size=20),
    username=st.one_of(st.none(), st.text(min_size=0, max_size=20)),
)
def test_substitution_property(client_id, username):
    """Whatever the ids, every granted filter is the rule with values that hold no wildcard
    and no level separator: a client can never gain more than its own subtree."""
    acl = Acl.parse("pattern readwrite d/%c/%u/#\ntopic read fixed/+\n")
    granted = rules(acl, username, client_id)
    assert granted.pop("fixed/+") == READ
    for topic_filter in granted:
        levels = topic_filter.split("/")
        assert len(levels) == 4 and levels[0] == "d" and levels[3] == "#"
        assert levels[1] == client_id and levels[2] == username
        assert not set("+#/\x00") & set(client_id + (username or ""))
    if granted == {}:
        assert not client_id or not username or set("+#/\x00") & set(client_id + username)
