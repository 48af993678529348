//! Engine tests of authentication, permissions, limits and interception (see also
//! tests/test_engine_auth.py, which drives the same paths through the Python binding).

use std::sync::Arc;

use bytes::Bytes;

use super::acl::{Permissions, PUBLISH, READ, SUBSCRIBE};
use super::tests::{connect, publish_packet, publishes, Harness};
use super::{Config, ConnId, Verdict, FEED_HOLD, FEED_PUBLISHER};
use crate::codec::{self, Packet, Protocol, QoS};

fn perms(rules: &[(u8, &str)]) -> Option<Arc<Permissions>> {
    let rules = rules.iter().map(|(r, f)| (*r, f.to_string())).collect();
    Some(Arc::new(Permissions::new(rules).unwrap()))
}

fn bytes_of(packets: &[Packet], protocol: Protocol) -> Vec<u8> {
    let mut out = Vec::new();
    for p in packets {
        codec::encode(p, protocol, &mut out).unwrap();
    }
    out
}

/// Opens a connection and sends CONNECT; with `auth_required` nothing comes back yet.
fn open(h: &mut Harness, client_id: &str) -> ConnId {
    open_with(h, connect(client_id, Protocol::V5, true))
}

fn open_with(h: &mut Harness, c: crate::codec::Connect) -> ConnId {
    let id = h.e.open(h.now);
    h.register(id, c.protocol);
    h.send(id, Packet::Connect(Box::new(c)));
    id
}

fn connack_code(packets: &[Packet]) -> u8 {
    match packets.first() {
        Some(Packet::ConnAck(a)) => a.reason_code,
        other => panic!("expected CONNACK, got {other:?}"),
    }
}

#[test]
fn connect_waits_for_auth_done_and_permissions_apply() {
    let mut h = Harness::with(Config {
        auth_required: true,
        ..Config::default()
    });
    let sub = open(&mut h, "sub");
    h.e.take_auth_requests();
    h.e.auth_done(sub, 0, perms(&[(7, "#")]), h.now, None, None, None);
    assert_eq!(connack_code(&h.recv_one(sub)), 0);
    assert_eq!(h.subscribe(sub, "#", QoS::AtLeastOnce), vec![1]);

    let pub_ = open(&mut h, "pub");
    assert!(
        h.recv_one(pub_).is_empty(),
        "no CONNACK before the decision"
    );
    let reqs = h.e.take_auth_requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!((reqs[0].conn, reqs[0].kind), (pub_, "connect"));
    h.e.auth_done(
        pub_,
        0,
        perms(&[(PUBLISH, "ok/#")]),
        h.now,
        None,
        None,
        None,
    );
    assert_eq!(connack_code(&h.recv_one(pub_)), 0);

    h.send(
        pub_,
        Packet::Publish(publish_packet("no/1", "x", QoS::AtLeastOnce, true, 3)),
    );
    h.send(
        pub_,
        Packet::Publish(publish_packet("ok/1", "y", QoS::AtLeastOnce, false, 4)),
    );
    let got = h.recv();
    let acks: Vec<(u16, u8)> = got[&pub_]
        .iter()
        .map(|p| match p {
            Packet::PubAck(a) => (a.pkid, a.reason_code),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(acks, vec![(3, 0x87), (4, 0)]);
    let delivered = publishes(&got[&sub]);
    assert_eq!(delivered.len(), 1);
    assert_eq!(&delivered[0].topic[..], b"ok/1");
    assert_eq!(h.e.retained_count(), 0);
    assert_eq!(h.e.stats().publish_denied, 1);
}

#[test]
fn rate_limited_publisher_is_held_then_resumed_in_order() {
    let mut h = Harness::with(Config {
        max_publish_rate: 4,
        ..Config::default()
    });
    let sub = h.connect("sub", Protocol::V5, true);
    h.subscribe(sub, "t", QoS::AtMostOnce);
    let pub_ = h.connect("pub", Protocol::V5, true);
    let packets: Vec<Packet> = (0..10)
        .map(|i| {
            Packet::Publish(publish_packet(
                "t",
                &i.to_string(),
                QoS::AtMostOnce,
                false,
                0,
            ))
        })
        .collect();
    let flags = h.e.feed(pub_, &bytes_of(&packets, Protocol::V5), h.now);
    assert_eq!(flags, FEED_HOLD | FEED_PUBLISHER);
    let mut payloads: Vec<String> = Vec::new();
    let collect = |h: &mut Harness, into: &mut Vec<String>| {
        for p in publishes(&h.recv_one(sub)) {
            into.push(String::from_utf8(p.payload.to_vec()).unwrap());
        }
    };
    collect(&mut h, &mut payloads);
    assert_eq!(payloads.len(), 4);
    h.now += 1000;
    h.e.tick(h.now);
    collect(&mut h, &mut payloads);
    assert_eq!(payloads.len(), 8);
    assert!(!h.e.has_resumed());
    h.now += 500;
    h.e.tick(h.now);
    collect(&mut h, &mut payloads);
    assert_eq!(h.e.take_resumed(), vec![pub_]);
    let want: Vec<String> = (0..10).map(|i| i.to_string()).collect();
    assert_eq!(payloads, want);
}

#[test]
fn intercepted_qos2_is_acknowledged_on_release_only_once() {
    let mut h = Harness::with(Config {
        intercept: true,
        ..Config::default()
    });
    let sub = h.connect("sub", Protocol::V5, true);
    h.subscribe(sub, "#", QoS::ExactlyOnce);
    let pub_ = h.connect("pub", Protocol::V5, true);
    let mut p = publish_packet("a", "x", QoS::ExactlyOnce, false, 5);
    h.send(pub_, Packet::Publish(p.clone()));
    p.dup = true;
    h.send(pub_, Packet::Publish(p));
    assert!(
        h.recv().is_empty(),
        "nothing acknowledged or routed before release"
    );
    let taken = h.e.take_intercepted();
    assert_eq!(taken.len(), 1);
    h.e.release(
        taken[0].ticket,
        Verdict::Route,
        Some("b"),
        Some(Bytes::from_static(b"y")),
        h.now,
    );
    let got = h.recv();
    assert!(matches!(&got[&pub_][..], [Packet::PubRec(a)] if a.pkid == 5 && a.reason_code == 0));
    let delivered = publishes(&got[&sub]);
    assert_eq!(delivered.len(), 1);
    assert_eq!(
        (&delivered[0].topic[..], &delivered[0].payload[..]),
        (&b"b"[..], &b"y"[..])
    );
}

#[test]
fn late_answer_about_a_closed_connection_never_reaches_its_successor() {
    let mut h = Harness::with(Config {
        auth_required: true,
        ..Config::default()
    });
    let first = open(&mut h, "a");
    assert_eq!(h.e.take_auth_requests().len(), 1);
    h.e.closed(first, h.now);
    let second = open(&mut h, "b");
    assert_ne!(first, second, "the id waits for its answer");
    h.e.auth_done(first, 0, None, h.now, None, None, None);
    assert!(h.recv().is_empty());
    assert_eq!(h.e.open(h.now), first, "free once answered");
}

#[test]
fn read_check_follows_the_permissions_of_a_resumed_session() {
    let mut h = Harness::with(Config {
        auth_required: true,
        ..Config::default()
    });
    let pub_ = open(&mut h, "pub");
    h.e.take_auth_requests();
    h.e.auth_done(pub_, 0, None, h.now, None, None, None);
    h.recv();
    let mut c = connect("sub", Protocol::V5, false);
    c.properties.session_expiry_interval = Some(600);
    let sub = open_with(&mut h, c.clone());
    h.e.take_auth_requests();
    h.e.auth_done(sub, 0, None, h.now, None, None, None);
    h.recv();
    h.subscribe(sub, "#", QoS::AtLeastOnce);
    h.e.closed(sub, h.now);
    // Back with fewer rights: the old "#" subscription now reads "a/#" only.
    let sub = open_with(&mut h, c);
    h.e.take_auth_requests();
    let rights = perms(&[(SUBSCRIBE | READ, "a/#")]);
    h.e.auth_done(sub, 0, rights, h.now, None, None, None);
    assert!(matches!(&h.recv_one(sub)[0], Packet::ConnAck(a) if a.session_present));
    h.publish(pub_, "b/1", "x", QoS::AtLeastOnce, false);
    h.publish(pub_, "a/1", "x", QoS::AtLeastOnce, false);
    let got = h.recv_one(sub);
    let topics: Vec<&[u8]> = publishes(&got).iter().map(|p| &p.topic[..]).collect();
    assert_eq!(topics, vec![&b"a/1"[..]]);
}
