"""Clusters formed through each discovery mode, with real node processes: a peers file
(edited at runtime), DNS (a test DNS server on loopback whose records change at runtime) and
UDP multicast (inside a network namespace whose loopback carries multicast). No node is given
a seed: discovery alone brings them together."""

from __future__ import annotations

import pytest
from clusters import CLUSTER_PORT, Cluster
from dnsserver import ThreadedDnsServer
from netns import Netns

pytestmark = pytest.mark.timeout(240)

BOUND_S = 30


def test_five_nodes_through_a_peers_file_edited_at_runtime(tmp_path):
    peers = tmp_path / "peers.txt"
    with Cluster(tmp_path) as cluster:
        spec = f"file:{peers}"
        # Three listed, all started together: bootstrap_expect = 3 makes them wait for each
        # other, then the smallest id founds the cluster.
        peers.write_text("# cluster nodes\n" + "\n".join(cluster.seeds(1, 2, 3)) + "\n")
        for i in (1, 2, 3):
            cluster.start(i, discovery=spec, bootstrap_expect=3)
        cluster.wait_converged(["n1", "n2", "n3"], BOUND_S)
        # Two more: listed in the file at runtime, nothing else reconfigured.
        peers.write_text("\n".join(cluster.seeds(1, 2, 3, 4, 5)) + "\n")
        for i in (4, 5):
            cluster.start(i, discovery=spec, bootstrap_expect=3)
        cluster.wait_converged(["n1", "n2", "n3", "n4", "n5"], BOUND_S)


def test_three_then_five_nodes_through_dns_records(tmp_path):
    name = "nodes.fb.test."
    with ThreadedDnsServer() as dns, Cluster(tmp_path) as cluster:
        # A records only: the port is the nodes' own cluster port, the same on every node.
        ips = [cluster.ip(i) for i in (1, 2, 3)]
        dns.set(name, "A", *ips)
        spec = f"dns:{name}@127.0.0.1:{dns.port}"
        for i in (1, 2, 3):
            cluster.start(i, discovery=spec, bootstrap_expect=3)
        cluster.wait_converged(["n1", "n2", "n3"], BOUND_S)
        # A fourth node appears in DNS (SRV this time, which carries the port) and joins.
        dns.set(
            "_fastbroker._tcp." + name,
            "SRV",
            *(f"0 0 {CLUSTER_PORT} n{i}.fb.test." for i in (1, 2, 3, 4)),
        )
        for i in (1, 2, 3, 4):
            dns.set(f"n{i}.fb.test.", "A", cluster.ip(i))
        cluster.start(4, discovery=spec)
        cluster.wait_converged(["n1", "n2", "n3", "n4"], BOUND_S)
        # A fifth, in the records only as its A record (an SRV set replaced at runtime).
        dns.set(
            "_fastbroker._tcp." + name,
            "SRV",
            *(f"0 0 {CLUSTER_PORT} n{i}.fb.test." for i in (1, 2, 3, 4, 5)),
        )
        dns.set("n5.fb.test.", "A", cluster.ip(5))
        cluster.start(5, discovery=spec)
        cluster.wait_converged(["n1", "n2", "n3", "n4", "n5"], BOUND_S)


def test_three_then_five_nodes_through_multicast_in_a_network_namespace(tmp_path):
    why = Netns.unavailable()
    if why is not None:
        pytest.skip(why)
    with Netns() as ns, Cluster(tmp_path, netns=ns) as cluster:
        for i in (1, 2, 3):
            cluster.start(i, discovery="multicast", bootstrap_expect=3)
        cluster.wait_converged(["n1", "n2", "n3"], BOUND_S)
        for i in (4, 5):
            cluster.start(i, discovery="multicast")
        cluster.wait_converged(["n1", "n2", "n3", "n4", "n5"], BOUND_S)
