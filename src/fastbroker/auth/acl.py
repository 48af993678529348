"""The ACL file: which topics each client may publish to, subscribe to and receive.

Mosquitto-like, allow-only (what no rule grants is denied; there is no ``deny``, so the rules
of a client are a plain union and their order never matters)::

    # rules before any user/client line apply to everyone
    topic read $SYS/#
    user alice                     # rules for username alice
    topic readwrite sensors/alice/#
    client sensor-*                # rules for client ids matching the fnmatch glob
    topic publish devices/%c/telemetry
    pattern readwrite users/%u/#   # applies to everyone, wherever it is written

Rights: publish (= write), subscribe, read (= receive), readwrite (all three), joined with
commas. ``%c`` is the client id and ``%u`` the username. The file is parsed once (at start and
on SIGHUP); ``Acl.permissions_for`` runs once per connect, and the engine enforces the rules.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

from fastbroker.config import ConfigError

PUBLISH = 1
SUBSCRIBE = 2
READ = 4

RIGHTS = {
    "publish": PUBLISH,
    "write": PUBLISH,
    "subscribe": SUBSCRIBE,
    "read": READ,
    "readwrite": PUBLISH | SUBSCRIBE | READ,
}
PLACEHOLDER = re.compile(r"%[cu]")
# Inline comments on user/client lines; topic lines are split into words instead, as "#" is
# also the multi-level wildcard.
TRAILING_COMMENT = re.compile(r"\s+#.*$")
# A substituted value with these would change what the filter matches: a client id "a/#"
# must not turn "devices/%c/x" into a wildcard, nor "x/y" reach another client's subtree.
UNSAFE_IN_VALUE = re.compile(r"[+#/\x00]")
MAX_FILTER_BYTES = 65_535


class AclError(ConfigError):
    """An ACL file that cannot be read or has a bad line; one line naming file:line."""


def parse_rights(word: str) -> int:
    """The mask of ``publish``, ``subscribe,read``...; ValueError if a word is unknown."""
    mask = 0
    for part in word.split(","):
        part = part.strip().lower()
        if part == "deny":
            raise ValueError("'deny' is not supported: rules only allow (leave the topic out)")
        if part not in RIGHTS:
            raise ValueError(f"unknown right {part!r} (known: {', '.join(RIGHTS)})")
        mask |= RIGHTS[part]
    return mask


def check_filter(topic_filter: str) -> None:
    """ValueError unless ``topic_filter`` is a valid MQTT topic filter."""
    if not topic_filter:
        raise ValueError("empty topic filter")
    if len(topic_filter.encode("utf-8", "surrogatepass")) > MAX_FILTER_BYTES:
        raise ValueError("topic filter longer than 65535 bytes")
    if "\x00" in topic_filter:
        raise ValueError("topic filter contains U+0000")
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != len(levels) - 1):
            raise ValueError(f"'#' must be a whole last level in {topic_filter!r}")
        if "+" in level and level != "+":
            raise ValueError(f"'+' must be a whole level in {topic_filter!r}")


def substitute(topic_filter: str, client_id: str, username: str | None) -> str | None:
    """``topic_filter`` with ``%c`` and ``%u`` replaced, or None when the rule cannot apply
    (no username for ``%u``, or a value that would widen the rule)."""
    if "%" not in topic_filter:
        return topic_filter
    failed = False

    def value(match: re.Match[str]) -> str:
        nonlocal failed
        text = client_id if match[0] == "%c" else username
        if not text or UNSAFE_IN_VALUE.search(text):
            failed = True
            return ""
        return text

    result = PLACEHOLDER.sub(value, topic_filter)
    return None if failed else result


@dataclass(frozen=True, slots=True)
class Rule:
    mask: int
    topic_filter: str


@dataclass(slots=True)
class Block:
    """The rules under one ``user`` or ``client`` line (or the global ones before any)."""

    kind: str  # "all", "user" or "client"
    name: str
    rules: list[Rule] = field(default_factory=list)

    def applies(self, username: str | None, client_id: str) -> bool:
        if self.kind == "all":
            return True
        if self.kind == "user":
            return username == self.name
        return fnmatch.fnmatchcase(client_id, self.name)


class Acl:
    """The parsed rules of one ACL file."""

    def __init__(self, path: Path | str, blocks: list[Block], patterns: list[Rule]) -> None:
        self.path = Path(path)
        self.blocks = blocks
        self.patterns = patterns

    @classmethod
    def load(cls, path: Path | str) -> Acl:
        path = Path(path)
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as error:
            raise AclError(f"{path}: cannot read ACL file: {error.strerror}") from None
        except UnicodeDecodeError:
            raise AclError(f"{path}: ACL file is not UTF-8 text") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str = "<acl>") -> Acl:
        current = Block("all", "")
        blocks = [current]
        patterns: list[Rule] = []
        for number, line in enumerate(text.splitlines(), start=1):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            keyword, _, rest = stripped.partition(" ")
            keyword = keyword.lower()
            try:
                if keyword in ("user", "client"):
                    name = TRAILING_COMMENT.sub("", rest).strip()
                    if not name:
                        raise ValueError(f"{keyword} needs a name")
                    current = Block(keyword, name)
                    blocks.append(current)
                elif keyword in ("topic", "pattern"):
                    rule = parse_rule(rest)
                    (patterns if keyword == "pattern" else current.rules).append(rule)
                else:
                    raise ValueError(
                        f"unknown keyword {keyword!r} (known: topic, pattern, user, client)"
                    )
            except ValueError as error:
                raise AclError(f"{source}:{number}: {error}") from None
        return cls(source, [b for b in blocks if b.rules], patterns)

    def permissions_for(self, username: str | None, client_id: str) -> list[tuple[int, str]]:
        """Every (rights mask, filter) granted to this client, for fastbroker_core.Permissions;
        empty when nothing applies (the client may then do nothing)."""
        granted: dict[str, int] = {}

        def add(rule: Rule) -> None:
            concrete = substitute(rule.topic_filter, client_id, username)
            if concrete is not None:
                granted[concrete] = granted.get(concrete, 0) | rule.mask

        for block in self.blocks:
            if block.applies(username, client_id):
                for rule in block.rules:
                    add(rule)
        for rule in self.patterns:
            add(rule)
        return [(mask, topic_filter) for topic_filter, mask in granted.items()]


def parse_rule(rest: str) -> Rule:
    """``[RIGHTS] FILTER [# comment]`` (rights default to readwrite, as in mosquitto)."""
    words = rest.split()
    if not words:
        raise ValueError("expected [RIGHTS] TOPIC-FILTER")
    first = words[0].lower().split(",")[0]
    # A second word that is no comment means the first are rights (so a typo is named).
    rights_given = len(words) >= 2 and not words[1].startswith("#")
    if rights_given or first in RIGHTS or first == "deny":
        mask = parse_rights(words[0])
        if len(words) < 2 or (words[1].startswith("#") and len(words[1]) > 1):
            raise ValueError(f"expected a topic filter after {words[0]!r}")
        topic_filter, extra = words[1], words[2:]
    else:
        mask, topic_filter, extra = RIGHTS["readwrite"], words[0], words[1:]
    if extra and not extra[0].startswith("#"):
        raise ValueError(f"unexpected {' '.join(extra)!r} after the topic filter")
    # Checked with the placeholders filled by a harmless value: "%c" itself is a valid level.
    check_filter(PLACEHOLDER.sub("x", topic_filter))
    return Rule(mask, topic_filter)
