"""The partition map: which nodes hold each partition, a pure function of the agreed membership.

Every node computes the map itself from the committed membership, so the function must give the
same result everywhere, whatever the order of the member list and whichever fastbroker version
runs it: `tests/test_partitions.py` pins `partition_of` and a whole map, and a change to either
is a change of the cluster protocol.

A key belongs to partition ``xxh3_64(key) % partitions`` (`partition_of`). Each partition has
``min(replication_factor, N)`` distinct replicas among the N members, its primary first.

How the map is computed (``P`` partitions, ``N`` members, ``S = PRIMARY_SLACK = 2``):

1. Rendezvous scores: ``score(p, n) = xxh3_64(n's id in UTF-8, seed=p)``. A pair scores the same
   in every membership, which is what keeps assignments in place when other nodes come and go.
2. Primaries: rendezvous hashing with bounded loads. The (partition, node) pairs are walked from
   the highest score down, and a partition goes to the first node with room, room being
   ``ceil(P/N) + S`` primaries. (Plain rendezvous hashing is not balanced enough: for N = 16,
   P = 256 its busiest node leads about 24 partitions where 16 is fair.)
3. The first follower of a partition is, by definition, its primary in the map of the membership
   without its current primary. So when a member leaves, every partition it led is taken over
   by that partition's first follower, which already holds the data: promotion is guaranteed by
   construction, not likely.
4. Further followers (replication factor 3 and up): the same walk over the pairs, each node
   taking at most ``ceil(P/N) + S`` partitions per rank and ``ceil(P*RF/N) + S`` replicas in all;
   a partition the caps leave short gets the least loaded node that does not hold it yet.

Guaranteed: the map depends only on the set of members; every partition has min(RF, N)
distinct replicas, all members; no node is primary of more than ``ceil(P/N) + 2`` partitions;
when a member leaves (RF >= 2), the new primary of each partition it led was a follower of it.

Measured (`compute_map` with N = 1..16, RF = 1..3, P = 16, 64, 256, 1024, 10 random node-id sets
per point, 3 for P = 1024; "mean/max" over them):

- Movement, adding a node: partitions changing primary / the new node's own primaries:
  1.14/1.86 at P = 256, 1.11/1.34 at P = 1024 (1.0 is ideal: only the newcomer's share moves;
  the rest are cascades of the load caps). Removing a node: partitions changing primary / the
  leaver's own: 1.13/1.91 at P = 256, 1.10/1.44 at P = 1024.
- Balance of all replicas (primary + followers) of the busiest node / the fair P*RF/N:
  RF 3: 1.02/1.05 at P = 256, 1.01/1.01 at P = 1024. RF 2: 1.14/1.38 at P = 256, 1.09/1.21
  at P = 1024, 1.26/1.88 at P = 64 (as few as 4 partitions per node). That is the price of
  the promotion guarantee: step 3 fixes where a leaver's partitions go, and they spread like
  plain rendezvous hashing does. Balancing followers with capped greedy passes instead keeps
  every node within a few replicas of fair, but then only about 90 % (RF 2) and 95 to 98 %
  (RF 3) of a leaver's partitions get a previous follower as primary; the others would come
  up on a node without their data.
- Time (CPython 3.11): P = 256, N = 16, RF = 3 about 3 ms; P = 1024, N = 16 about 14 ms;
  P = 256, N = 128 about 26 ms. Step 3 walks the pairs once per member, stopping once that
  member's partitions are placed (O(P * N^2) at worst); maps are computed only on membership
  changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from xxhash import xxh3_64_intdigest

DEFAULT_PARTITIONS = 256
DEFAULT_REPLICATION_FACTOR = 2

# Extra primaries a node may hold above ceil(P/N) (measured trade-off: see the module docstring).
PRIMARY_SLACK = 2


def partition_of(key: bytes, partitions: int) -> int:
    """The partition of `key`: xxh3-64 of the key modulo the partition count (never change it)."""
    return xxh3_64_intdigest(key) % partitions


@dataclass(frozen=True)
class PartitionMap:
    """Who holds each partition: `replicas[p]` is its primary followed by its followers."""

    version: int
    members: tuple[str, ...]
    partitions: int
    replication_factor: int
    replicas: tuple[tuple[str, ...], ...]

    def primary(self, partition: int) -> str:
        replicas = self.replicas[partition]
        if not replicas:
            raise LookupError("the partition map has no members")
        return replicas[0]

    def followers(self, partition: int) -> tuple[str, ...]:
        return self.replicas[partition][1:]

    def primaries_of(self, node: str) -> list[int]:
        return list(self._roles.get(node, ((), ()))[0])

    def followers_of(self, node: str) -> list[int]:
        return list(self._roles.get(node, ((), ()))[1])

    @cached_property
    def _roles(self) -> dict[str, tuple[list[int], list[int]]]:
        # Computed once per map (maps are immutable); the node code asks per member.
        roles: dict[str, tuple[list[int], list[int]]] = {m: ([], []) for m in self.members}
        for partition, replicas in enumerate(self.replicas):
            for rank, node in enumerate(replicas):
                roles[node][0 if rank == 0 else 1].append(partition)
        return roles

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "partitions": self.partitions,
            "replication_factor": self.replication_factor,
            "members": {
                node: {"primary": list(primary), "follower": list(follower)}
                for node, (primary, follower) in self._roles.items()
            },
        }


def compute_map(
    members: Iterable[str],
    partitions: int = DEFAULT_PARTITIONS,
    replication_factor: int = DEFAULT_REPLICATION_FACTOR,
    version: int = 0,
) -> PartitionMap:
    """The map every node derives from the same membership (order and duplicates ignored)."""
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, not {partitions}")
    if replication_factor < 1:
        raise ValueError(f"replication_factor must be at least 1, not {replication_factor}")
    unique = set(members)
    for node in unique:
        if not isinstance(node, str) or not node:
            raise ValueError(f"node ids must be non-empty strings, not {node!r}")
    nodes = sorted(unique)
    replicas = _assign(nodes, partitions, min(replication_factor, len(nodes)))
    return PartitionMap(
        version=version,
        members=tuple(nodes),
        partitions=partitions,
        replication_factor=replication_factor,
        replicas=tuple(tuple(nodes[n] for n in ranks) for ranks in replicas),
    )


def _assign(nodes: list[str], partitions: int, copies: int) -> list[list[int]]:
    """Per partition, the indexes in `nodes` of its replicas, primary first."""
    count = len(nodes)
    replicas: list[list[int]] = [[] for _ in range(partitions)]
    if count == 0:
        return replicas
    # Rendezvous scores: the same (partition, node) pair scores the same in every membership,
    # which is what keeps assignments in place when other nodes come and go.
    encoded = [node.encode() for node in nodes]
    scores = [xxh3_64_intdigest(node, seed=p) for p in range(partitions) for node in encoded]
    order = sorted(range(partitions * count), key=scores.__getitem__, reverse=True)
    pair_partition = [pair // count for pair in order]
    pair_node = [pair % count for pair in order]

    primaries = _primaries(pair_partition, pair_node, partitions, count, excluded=-1)
    for partition, node in enumerate(primaries):
        replicas[partition].append(node)
    if copies >= 2:
        # The first follower of a partition is, by definition, its primary in the map without
        # its current primary: when that primary leaves, the follower is promoted and already
        # holds the data.
        owned: list[set[int]] = [set() for _ in range(count)]
        for partition, node in enumerate(primaries):
            owned[node].add(partition)
        for node in range(count):
            if owned[node]:
                without = _primaries(
                    pair_partition, pair_node, partitions, count, excluded=node, wanted=owned[node]
                )
                for partition in owned[node]:
                    replicas[partition].append(without[partition])
    # Further followers: balanced greedy over the same scores, capped per rank and in total.
    rank_cap = -(-partitions // count) + PRIMARY_SLACK
    total_cap = -(-partitions * copies // count) + PRIMARY_SLACK
    total = [0] * count
    for ranks in replicas:
        for node in ranks:
            total[node] += 1
    for rank in range(2, copies):
        load = [0] * count
        missing = partitions
        for partition, node in zip(pair_partition, pair_node, strict=True):
            ranks = replicas[partition]
            if (
                len(ranks) == rank
                and load[node] < rank_cap
                and total[node] < total_cap
                and node not in ranks
            ):
                ranks.append(node)
                load[node] += 1
                total[node] += 1
                missing -= 1
                if not missing:
                    break
        if missing:
            # Caps can leave a partition whose only nodes with room already hold it: give it
            # the least loaded node that does not.
            for partition, ranks in enumerate(replicas):
                if len(ranks) == rank:
                    base = partition * count
                    _, _, _, node = min(
                        (total[n], load[n], -scores[base + n], n)
                        for n in range(count)
                        if n not in ranks
                    )
                    ranks.append(node)
                    load[node] += 1
                    total[node] += 1
    return replicas


def _primaries(
    pair_partition: list[int],
    pair_node: list[int],
    partitions: int,
    count: int,
    excluded: int,
    wanted: set[int] | None = None,
) -> list[int]:
    """Primaries by score with at most ceil(P/N) + slack each, N not counting `excluded`.

    Walks the (partition, node) pairs from the highest score down and gives a partition to the
    first node with room: rendezvous hashing with bounded loads. Stops early once every partition
    in `wanted` (default all) has its primary; the others are then left at -1.
    """
    cap = -(-partitions // (count - (excluded >= 0))) + PRIMARY_SLACK
    primary = [-1] * partitions
    load = [0] * count
    missing = partitions if wanted is None else len(wanted)
    for partition, node in zip(pair_partition, pair_node, strict=True):
        if primary[partition] >= 0 or node == excluded or load[node] >= cap:
            continue
        primary[partition] = node
        load[node] += 1
        if wanted is None or partition in wanted:
            missing -= 1
            if not missing:
                break
    return primary


def moved(old: PartitionMap, new: PartitionMap) -> dict[str, int]:
    """What changed from `old` to `new`, for logs and tests: partitions whose primary changed,
    how many of those went to one of their followers, and (partition, node) holdings gained and
    lost. Maps of different partition counts compare as if the missing partitions had no nodes."""
    primaries_changed = promoted = replicas_added = replicas_removed = 0
    for partition in range(max(old.partitions, new.partitions)):
        before = old.replicas[partition] if partition < old.partitions else ()
        after = new.replicas[partition] if partition < new.partitions else ()
        if before[:1] != after[:1]:
            primaries_changed += 1
            if after and after[0] in before[1:]:
                promoted += 1
        replicas_added += len(set(after) - set(before))
        replicas_removed += len(set(before) - set(after))
    return {
        "primaries_changed": primaries_changed,
        "promoted": promoted,
        "replicas_added": replicas_added,
        "replicas_removed": replicas_removed,
    }
