//! Engine tests: clients are byte streams, as on a socket; what the engine writes is decoded
//! with the codec and checked.

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};

use super::{Config, ConnId, Engine};
use crate::codec::{
    self, Ack, Connect, Disconnect, LastWill, Packet, Properties, Protocol, Publish, QoS,
    Subscribe, SubscribeFilter, Unsubscribe,
};

pub(crate) struct Harness {
    pub(crate) e: Engine,
    pub(crate) now: u64,
    protocols: HashMap<ConnId, Protocol>,
    pub(super) rx: HashMap<ConnId, BytesMut>,
    pub(super) closed: Vec<ConnId>,
}

impl Harness {
    pub(crate) fn new() -> Harness {
        Harness::with(Config::default())
    }

    pub(super) fn with(cfg: Config) -> Harness {
        Harness {
            e: Engine::new(cfg),
            now: 1_000_000,
            protocols: HashMap::new(),
            rx: HashMap::new(),
            closed: Vec::new(),
        }
    }

    /// Opens a connection and sends `c`, without waiting for its CONNACK (a cluster node
    /// answers once its claim of the client id is settled).
    pub(super) fn open_connect(&mut self, c: Connect) -> ConnId {
        let id = self.e.open(self.now);
        self.protocols.insert(id, c.protocol);
        self.send(id, Packet::Connect(Box::new(c)));
        id
    }

    /// Declares the protocol of a connection opened without `connect_with`.
    pub(super) fn register(&mut self, id: ConnId, protocol: Protocol) {
        self.protocols.insert(id, protocol);
    }

    pub(super) fn send(&mut self, id: ConnId, p: Packet) {
        let mut buf = Vec::new();
        codec::encode(&p, self.protocols[&id], &mut buf).unwrap();
        self.e.feed(id, &buf, self.now);
    }

    /// Everything the engine wrote to each connection since the last call, decoded.
    pub(super) fn recv(&mut self) -> HashMap<ConnId, Vec<Packet>> {
        let mut raw: Vec<(ConnId, Vec<u8>, u8)> = Vec::new();
        self.e
            .drain(|id, data, close| raw.push((id, data.to_vec(), close)));
        let mut out: HashMap<ConnId, Vec<Packet>> = HashMap::new();
        for (id, data, close) in raw {
            let buf = self.rx.entry(id).or_default();
            buf.extend_from_slice(&data);
            while let Some(p) = codec::decode(buf, self.protocols[&id], usize::MAX).unwrap() {
                out.entry(id).or_default().push(p);
            }
            if close != 0 {
                self.e.closed(id, self.now);
                self.closed.push(id);
            }
        }
        out
    }

    pub(crate) fn recv_one(&mut self, id: ConnId) -> Vec<Packet> {
        self.recv().remove(&id).unwrap_or_default()
    }

    /// Connects; returns the connection and everything it received (CONNACK first).
    pub(super) fn connect_with(&mut self, c: Connect) -> (ConnId, Vec<Packet>) {
        let id = self.e.open(self.now);
        self.protocols.insert(id, c.protocol);
        self.send(id, Packet::Connect(Box::new(c)));
        let got = self.recv_one(id);
        assert!(!got.is_empty(), "no CONNACK");
        (id, got)
    }

    pub(crate) fn connect(&mut self, client_id: &str, protocol: Protocol, clean: bool) -> ConnId {
        let (id, got) = self.connect_with(connect(client_id, protocol, clean));
        match &got[0] {
            Packet::ConnAck(a) => assert_eq!(a.reason_code, 0),
            other => panic!("expected CONNACK, got {other:?}"),
        }
        id
    }

    pub(crate) fn subscribe(&mut self, id: ConnId, filter: &str, qos: QoS) -> Vec<u8> {
        self.subscribe_with(id, filter, qos, Properties::default())
    }

    pub(super) fn subscribe_with(
        &mut self,
        id: ConnId,
        filter: &str,
        qos: QoS,
        props: Properties,
    ) -> Vec<u8> {
        match self.subscribe_recv(id, filter, qos, props).first() {
            Some(Packet::SubAck(a)) => a.reason_codes.clone(),
            other => panic!("expected SUBACK, got {other:?}"),
        }
    }

    /// Subscribes; returns everything the connection received (SUBACK, then any retained).
    pub(super) fn subscribe_recv(
        &mut self,
        id: ConnId,
        filter: &str,
        qos: QoS,
        props: Properties,
    ) -> Vec<Packet> {
        self.send(
            id,
            Packet::Subscribe(Subscribe {
                pkid: 1,
                filters: vec![sub_filter(filter, qos)],
                properties: props.into_boxed(),
            }),
        );
        self.recv_one(id)
    }

    pub(crate) fn publish(
        &mut self,
        id: ConnId,
        topic: &str,
        payload: &str,
        qos: QoS,
        retain: bool,
    ) {
        self.send(
            id,
            Packet::Publish(publish(
                topic,
                payload,
                qos,
                retain,
                if qos == QoS::AtMostOnce { 0 } else { 7 },
            )),
        );
    }
}

pub(super) fn connect(client_id: &str, protocol: Protocol, clean: bool) -> Connect {
    Connect {
        protocol,
        clean_start: clean,
        keep_alive: 60,
        client_id: client_id.to_string(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    }
}

fn sub_filter(filter: &str, qos: QoS) -> SubscribeFilter {
    SubscribeFilter {
        filter: filter.to_string(),
        qos,
        no_local: false,
        retain_as_published: false,
        retain_handling: 0,
    }
}

pub(super) fn publish_packet(
    topic: &str,
    payload: &str,
    qos: QoS,
    retain: bool,
    pkid: u16,
) -> Publish {
    publish(topic, payload, qos, retain, pkid)
}

fn publish(topic: &str, payload: &str, qos: QoS, retain: bool, pkid: u16) -> Publish {
    Publish {
        dup: false,
        qos,
        retain,
        topic: Bytes::copy_from_slice(topic.as_bytes()),
        pkid,
        properties: None,
        payload: Bytes::copy_from_slice(payload.as_bytes()),
    }
}

pub(crate) fn publishes(packets: &[Packet]) -> Vec<&Publish> {
    packets
        .iter()
        .filter_map(|p| match p {
            Packet::Publish(p) => Some(p),
            _ => None,
        })
        .collect()
}

#[test]
fn qos0_batch_of_publishes_in_one_feed_reaches_subscriber() {
    let mut h = Harness::new();
    let sub = h.connect("sub", Protocol::V5, true);
    h.subscribe(sub, "t/+", QoS::AtMostOnce);
    let publ = h.connect("pub", Protocol::V311, true);
    let mut buf = Vec::new();
    for i in 0..100 {
        let p = publish(&format!("t/{i}"), "x", QoS::AtMostOnce, false, 0);
        codec::encode(&Packet::Publish(p), Protocol::V311, &mut buf).unwrap();
    }
    // Any split of the stream gives the same result.
    let (a, b) = buf.split_at(333);
    h.e.feed(publ, a, h.now);
    h.e.feed(publ, b, h.now);
    let got = h.recv_one(sub);
    let pubs = publishes(&got);
    assert_eq!(pubs.len(), 100);
    assert_eq!(&pubs[42].topic[..], b"t/42");
}

#[test]
fn overlapping_subscriptions_give_one_copy_at_highest_qos_with_all_identifiers() {
    let mut h = Harness::new();
    let sub = h.connect("sub", Protocol::V5, true);
    let p1 = Properties {
        subscription_identifiers: vec![1],
        ..Default::default()
    };
    h.subscribe_with(sub, "a/#", QoS::AtMostOnce, p1);
    let p2 = Properties {
        subscription_identifiers: vec![2],
        ..Default::default()
    };
    h.subscribe_with(sub, "a/+", QoS::AtLeastOnce, p2);
    let publ = h.connect("pub", Protocol::V5, true);
    h.publish(publ, "a/b", "hi", QoS::ExactlyOnce, false);
    let got = h.recv_one(sub);
    let pubs = publishes(&got);
    assert_eq!(pubs.len(), 1);
    assert_eq!(pubs[0].qos, QoS::AtLeastOnce);
    let mut ids = pubs[0].props().subscription_identifiers.clone();
    ids.sort();
    assert_eq!(ids, vec![1, 2]);
}

#[test]
fn qos1_window_respects_client_receive_maximum() {
    let mut h = Harness::new();
    let mut c = connect("sub", Protocol::V5, true);
    c.properties.receive_maximum = Some(2);
    let (sub, _) = h.connect_with(c);
    h.subscribe(sub, "q", QoS::AtLeastOnce);
    let publ = h.connect("pub", Protocol::V5, true);
    for _ in 0..5 {
        h.publish(publ, "q", "m", QoS::AtLeastOnce, false);
    }
    let got = h.recv_one(sub);
    let pubs = publishes(&got);
    assert_eq!(pubs.len(), 2, "only the window goes out");
    let first = pubs[0].pkid;
    h.send(
        sub,
        Packet::PubAck(Ack {
            pkid: first,
            reason_code: 0,
            properties: None,
        }),
    );
    assert_eq!(
        publishes(&h.recv_one(sub)).len(),
        1,
        "one ack frees one slot"
    );
}

#[test]
fn qos2_inbound_resend_before_pubrel_is_not_delivered_twice() {
    let mut h = Harness::new();
    let sub = h.connect("sub", Protocol::V311, true);
    h.subscribe(sub, "q2", QoS::ExactlyOnce);
    let publ = h.connect("pub", Protocol::V311, true);
    h.publish(publ, "q2", "once", QoS::ExactlyOnce, false);
    let mut again = publish("q2", "once", QoS::ExactlyOnce, false, 7);
    again.dup = true;
    h.send(publ, Packet::Publish(again));
    let all = h.recv();
    assert_eq!(publishes(&all[&sub]).len(), 1);
    let recs = all[&publ]
        .iter()
        .filter(|p| matches!(p, Packet::PubRec(_)))
        .count();
    assert_eq!(recs, 2);
    h.send(
        publ,
        Packet::PubRel(Ack {
            pkid: 7,
            reason_code: 0,
            properties: None,
        }),
    );
    assert!(matches!(
        h.recv_one(publ)[0],
        Packet::PubComp(Ack { pkid: 7, .. })
    ));
    // After PUBREL the id is free again: a new message with it is delivered.
    h.publish(publ, "q2", "twice", QoS::ExactlyOnce, false);
    assert_eq!(publishes(&h.recv()[&sub]).len(), 1);
}

#[test]
fn persistent_session_queues_offline_and_resends_inflight_with_dup() {
    let mut h = Harness::new();
    let sub = h.connect("p", Protocol::V311, false);
    h.subscribe(sub, "s", QoS::AtLeastOnce);
    let publ = h.connect("pub", Protocol::V311, true);
    h.publish(publ, "s", "inflight", QoS::AtLeastOnce, false);
    assert_eq!(publishes(&h.recv()[&sub]).len(), 1);
    h.e.closed(sub, h.now); // gone without acking
    h.publish(publ, "s", "queued", QoS::AtLeastOnce, false);
    h.publish(publ, "s", "qos0 not kept", QoS::AtMostOnce, false);
    h.recv();
    let (_, got) = h.connect_with(connect("p", Protocol::V311, false));
    match &got[0] {
        Packet::ConnAck(a) => assert!(a.session_present),
        other => panic!("{other:?}"),
    }
    let pubs = publishes(&got);
    assert_eq!(
        pubs.len(),
        2,
        "the unacked one again and the queued one; QoS 0 not kept"
    );
    assert!(pubs[0].dup && &pubs[0].payload[..] == b"inflight");
    assert!(!pubs[1].dup && &pubs[1].payload[..] == b"queued");
}

#[test]
fn retained_set_replace_delete_and_sent_on_subscribe() {
    let mut h = Harness::new();
    let publ = h.connect("pub", Protocol::V5, true);
    h.publish(publ, "r/1", "a", QoS::AtMostOnce, true);
    h.publish(publ, "r/1", "b", QoS::AtMostOnce, true);
    h.publish(publ, "r/2", "c", QoS::AtMostOnce, true);
    h.publish(publ, "r/2", "", QoS::AtMostOnce, true);
    let sub = h.connect("sub", Protocol::V5, true);
    let got = h.subscribe_recv(sub, "r/#", QoS::AtLeastOnce, Properties::default());
    assert!(matches!(got[0], Packet::SubAck(_)), "SUBACK comes first");
    let pubs = publishes(&got);
    assert_eq!(pubs.len(), 1);
    assert_eq!(&pubs[0].payload[..], b"b");
    assert!(pubs[0].retain);
    assert_eq!(pubs[0].qos, QoS::AtMostOnce);
}

#[test]
fn will_published_on_abnormal_close_not_after_disconnect() {
    let mut h = Harness::new();
    let sub = h.connect("sub", Protocol::V5, true);
    h.subscribe(sub, "will/#", QoS::AtMostOnce);
    let will = LastWill {
        topic: "will/a".into(),
        payload: Bytes::from_static(b"gone"),
        qos: QoS::AtMostOnce,
        retain: false,
        properties: Properties::default(),
    };
    let mut c = connect("a", Protocol::V5, true);
    c.will = Some(will.clone());
    let (a, _) = h.connect_with(c.clone());
    h.e.closed(a, h.now);
    assert_eq!(publishes(&h.recv_one(sub)).len(), 1);

    let (b, _) = h.connect_with(c);
    h.send(
        b,
        Packet::Disconnect(Disconnect {
            reason_code: 0,
            properties: None,
        }),
    );
    assert!(publishes(&h.recv().remove(&sub).unwrap_or_default()).is_empty());
}

#[test]
fn will_delay_waits_and_is_cancelled_by_resume() {
    let mut h = Harness::new();
    let sub = h.connect("sub", Protocol::V5, true);
    h.subscribe(sub, "w", QoS::AtMostOnce);
    let will_props = Properties {
        will_delay_interval: Some(5),
        ..Default::default()
    };
    let mut c = connect("d", Protocol::V5, false);
    c.properties.session_expiry_interval = Some(100);
    c.will = Some(LastWill {
        topic: "w".into(),
        payload: Bytes::from_static(b"late"),
        qos: QoS::AtMostOnce,
        retain: false,
        properties: will_props,
    });
    let (a, _) = h.connect_with(c.clone());
    h.e.closed(a, h.now);
    h.now += 3000;
    h.e.tick(h.now);
    assert!(!h.recv().contains_key(&sub), "not before the delay");
    h.now += 3000;
    h.e.tick(h.now);
    assert_eq!(publishes(&h.recv_one(sub)).len(), 1, "after the delay");

    // Reconnecting within the delay cancels it.
    let (b, _) = h.connect_with(c.clone());
    h.e.closed(b, h.now);
    h.now += 1000;
    let _ = h.connect_with(c);
    h.now += 10_000;
    h.e.tick(h.now);
    assert!(!h.recv().contains_key(&sub));
}

#[test]
fn takeover_disconnects_old_connection_with_0x8e() {
    let mut h = Harness::new();
    let old = h.connect("same", Protocol::V5, false);
    let id = h.e.open(h.now);
    h.protocols.insert(id, Protocol::V5);
    h.send(
        id,
        Packet::Connect(Box::new(connect("same", Protocol::V5, false))),
    );
    let all = h.recv();
    match &all[&old][..] {
        [Packet::Disconnect(d)] => assert_eq!(d.reason_code, 0x8E),
        other => panic!("{other:?}"),
    }
    assert!(h.closed.contains(&old));
    assert!(matches!(all[&id][0], Packet::ConnAck(_)));
}

#[test]
fn keepalive_and_connect_timeouts_close() {
    let mut h = Harness::new();
    let mut c = connect("k", Protocol::V5, true);
    c.keep_alive = 2;
    let (k, _) = h.connect_with(c);
    let silent = h.e.open(h.now);
    h.protocols.insert(silent, Protocol::V311);
    h.now += 2900;
    h.e.tick(h.now);
    assert!(h.recv().is_empty(), "1.45 x keepalive is still fine");
    h.now += 200;
    h.e.tick(h.now);
    let all = h.recv();
    match &all[&k][..] {
        [Packet::Disconnect(d)] => assert_eq!(d.reason_code, 0x8D),
        other => panic!("{other:?}"),
    }
    h.now += 10_000;
    h.e.tick(h.now);
    h.recv();
    assert!(h.closed.contains(&silent));
}

#[test]
fn keepalive_counts_whole_packets_not_bytes() {
    // A packet trickled in a byte a second (slowloris) is no control packet: keep alive
    // (2 s, so 3 s of grace) closes the connection before the packet is complete.
    let mut h = Harness::new();
    let mut c = connect("trickle", Protocol::V311, true);
    c.keep_alive = 2;
    let (k, _) = h.connect_with(c);
    let mut bytes = Vec::new();
    let p = publish("t/slow", "0123456789", QoS::AtMostOnce, false, 0);
    codec::encode(&Packet::Publish(p), Protocol::V311, &mut bytes).unwrap();
    for byte in &bytes[..bytes.len() - 1] {
        h.now += 1000;
        h.e.feed(k, std::slice::from_ref(byte), h.now);
        h.e.tick(h.now);
        h.recv();
    }
    assert!(
        h.closed.contains(&k),
        "a trickled packet kept the connection alive"
    );
}

#[test]
fn shared_subscription_delivers_each_message_to_one_member() {
    let mut h = Harness::new();
    let a = h.connect("a", Protocol::V5, true);
    let b = h.connect("b", Protocol::V5, true);
    h.subscribe(a, "$share/g/job", QoS::AtMostOnce);
    h.subscribe(b, "$share/g/job", QoS::AtMostOnce);
    let publ = h.connect("pub", Protocol::V5, true);
    for _ in 0..10 {
        h.publish(publ, "job", "j", QoS::AtMostOnce, false);
    }
    let all = h.recv();
    let na = publishes(&all[&a]).len();
    let nb = publishes(&all[&b]).len();
    assert_eq!(na + nb, 10);
    assert_eq!(na, 5);
}

#[test]
fn topic_alias_both_ways() {
    let mut h = Harness::new();
    let mut c = connect("sub", Protocol::V5, true);
    c.properties.topic_alias_maximum = Some(5);
    let (sub, _) = h.connect_with(c);
    h.subscribe(sub, "long/topic", QoS::AtMostOnce);
    let publ = h.connect("pub", Protocol::V5, true);
    let mut p = publish("long/topic", "1", QoS::AtMostOnce, false, 0);
    p.props_mut().topic_alias = Some(3);
    h.send(publ, Packet::Publish(p));
    let mut p = publish("", "2", QoS::AtMostOnce, false, 0);
    p.props_mut().topic_alias = Some(3);
    h.send(publ, Packet::Publish(p));
    let got = h.recv_one(sub);
    let pubs = publishes(&got);
    assert_eq!(pubs.len(), 2);
    assert_eq!(&pubs[0].topic[..], b"long/topic");
    assert_eq!(pubs[0].props().topic_alias, Some(1));
    assert!(pubs[1].topic.is_empty());
    assert_eq!(pubs[1].props().topic_alias, Some(1));
    // Alias above the maximum: DISCONNECT 0x94.
    let mut p = publish("x", "3", QoS::AtMostOnce, false, 0);
    p.props_mut().topic_alias = Some(11);
    h.send(publ, Packet::Publish(p));
    match &h.recv_one(publ)[..] {
        [Packet::Disconnect(d)] => assert_eq!(d.reason_code, 0x94),
        other => panic!("{other:?}"),
    }
}

#[test]
fn message_expiry_drops_and_forwards_remaining_time() {
    let mut h = Harness::new();
    let mut c = connect("off", Protocol::V5, false);
    c.properties.session_expiry_interval = Some(1000);
    let (off, _) = h.connect_with(c.clone());
    h.subscribe(off, "e", QoS::AtLeastOnce);
    h.e.closed(off, h.now);
    let publ = h.connect("pub", Protocol::V5, true);
    let mut p = publish("e", "short", QoS::AtLeastOnce, false, 1);
    p.props_mut().message_expiry_interval = Some(2);
    h.send(publ, Packet::Publish(p));
    let mut p = publish("e", "long", QoS::AtLeastOnce, false, 2);
    p.props_mut().message_expiry_interval = Some(60);
    h.send(publ, Packet::Publish(p));
    h.recv();
    h.now += 5000;
    let (_, got) = h.connect_with(c);
    let pubs = publishes(&got);
    assert_eq!(pubs.len(), 1);
    assert_eq!(&pubs[0].payload[..], b"long");
    assert_eq!(pubs[0].props().message_expiry_interval, Some(55));
}

#[test]
fn client_maximum_packet_size_skips_large_messages() {
    let mut h = Harness::new();
    let mut c = connect("small", Protocol::V5, true);
    c.properties.maximum_packet_size = Some(64);
    let (sub, _) = h.connect_with(c);
    h.subscribe(sub, "m", QoS::AtMostOnce);
    let publ = h.connect("pub", Protocol::V5, true);
    h.publish(publ, "m", &"x".repeat(100), QoS::AtMostOnce, false);
    h.publish(publ, "m", "ok", QoS::AtMostOnce, false);
    let got = h.recv_one(sub);
    let pubs = publishes(&got);
    assert_eq!(pubs.len(), 1);
    assert_eq!(&pubs[0].payload[..], b"ok");
}

#[test]
fn slow_consumer_queue_is_bounded() {
    let cfg = Config {
        max_queued_messages: 10,
        ..Config::default()
    };
    let mut h = Harness::with(cfg);
    let sub = h.connect("slow", Protocol::V311, true);
    h.subscribe(sub, "f", QoS::AtMostOnce);
    h.e.set_writable(sub, false, h.now);
    let publ = h.connect("pub", Protocol::V311, true);
    for _ in 0..100 {
        h.publish(publ, "f", "x", QoS::AtMostOnce, false);
    }
    assert!(!h.recv().contains_key(&sub));
    assert_eq!(h.e.queued_count(), 10);
    h.e.set_writable(sub, true, h.now);
    assert_eq!(publishes(&h.recv_one(sub)).len(), 10);
}

#[test]
fn resumed_long_queue_is_sent_a_budget_per_drain_in_order() {
    let cfg = Config {
        max_queued_messages: 1_000_000,
        ..Config::default()
    };
    let mut h = Harness::with(cfg);
    let sub = h.connect("slow", Protocol::V311, true);
    h.subscribe(sub, "f", QoS::AtMostOnce);
    h.e.set_writable(sub, false, h.now);
    let publ = h.connect("pub", Protocol::V311, true);
    // About 3.5 budgets' worth of 1 KiB messages.
    let n = 3 * super::router::PUMP_BUDGET / 1000 + 300;
    let payload = "x".repeat(1000);
    for i in 0..n {
        h.publish(
            publ,
            "f",
            &format!("{i:06}{payload}"),
            QoS::AtMostOnce,
            false,
        );
    }
    h.recv();
    h.e.set_writable(sub, true, h.now);
    let mut got = Vec::new();
    let mut drains = 0;
    loop {
        let mut bytes = 0;
        h.e.drain(|id, data, _| {
            if id == sub {
                bytes += data.len();
                h.rx.entry(id).or_default().extend_from_slice(data);
            }
        });
        let buf = h.rx.entry(sub).or_default();
        while let Some(p) = codec::decode(buf, Protocol::V311, usize::MAX).unwrap() {
            if let Packet::Publish(p) = p {
                got.push(String::from_utf8(p.payload[..6].to_vec()).unwrap());
            }
        }
        assert!(
            bytes < super::router::PUMP_BUDGET + 2048,
            "one drain carried {bytes} bytes"
        );
        if !h.e.has_output() {
            break;
        }
        drains += 1;
    }
    assert!(drains >= 3, "the queue went out in {drains} extra drains");
    let want: Vec<String> = (0..n).map(|i| format!("{i:06}")).collect();
    assert_eq!(got, want);
    assert_eq!(h.e.queued_count(), 0);
}

#[test]
fn packet_before_connect_closes_silently() {
    let mut h = Harness::new();
    let id = h.e.open(h.now);
    h.protocols.insert(id, Protocol::V311);
    h.send(id, Packet::PingReq);
    assert!(!h.recv().contains_key(&id));
    assert!(h.closed.contains(&id));
}

#[test]
fn denied_subscription_gets_not_authorized() {
    let cfg = Config {
        denied_subscriptions: vec!["secret/#".into()],
        ..Config::default()
    };
    let mut h = Harness::with(cfg);
    let a = h.connect("a", Protocol::V5, true);
    h.send(
        a,
        Packet::Subscribe(Subscribe {
            pkid: 3,
            filters: vec![
                sub_filter("secret/+/x", QoS::AtLeastOnce),
                sub_filter("open/#", QoS::AtLeastOnce),
            ],
            properties: None,
        }),
    );
    match &h.recv_one(a)[..] {
        [Packet::SubAck(s)] => assert_eq!(s.reason_codes, vec![0x87, 1]),
        other => panic!("{other:?}"),
    }
    let b = h.connect("b", Protocol::V311, true);
    assert_eq!(h.subscribe(b, "secret/x", QoS::AtMostOnce), vec![0x80]);
}

#[test]
fn unsubscribe_reports_missing_subscription() {
    let mut h = Harness::new();
    let a = h.connect("a", Protocol::V5, true);
    h.subscribe(a, "u", QoS::AtMostOnce);
    h.send(
        a,
        Packet::Unsubscribe(Unsubscribe {
            pkid: 2,
            filters: vec!["u".into(), "v".into()],
            properties: None,
        }),
    );
    match &h.recv_one(a)[..] {
        [Packet::UnsubAck(u)] => assert_eq!(u.reason_codes, vec![0x00, 0x11]),
        other => panic!("{other:?}"),
    }
    assert_eq!(h.e.subscription_count(), 0);
}

#[test]
fn per_client_state_stays_small() {
    // An idle connection's Conn + Session is most of the broker's memory per client (issue
    // 18: no more RSS per idle connection than Mosquitto's, about 750 bytes): keep large
    // optional parts such as the will boxed, and what few sessions use in SessionRare.
    let conn = std::mem::size_of::<super::state::Conn>();
    let session = std::mem::size_of::<super::state::Session>();
    assert!(
        conn <= 192 && session <= 208,
        "Conn {conn} B, Session {session} B"
    );
}

#[test]
fn full_queues_answer_quota_exceeded_in_mqtt5() {
    let mut h = Harness::with(Config {
        max_queued_messages: 1,
        ..Config::default()
    });
    let sub = h.connect("sub", Protocol::V311, false);
    h.subscribe(sub, "t", QoS::AtLeastOnce);
    h.e.closed(sub, h.now);
    let (publ, _) = h.connect_with(connect("pub", Protocol::V5, true));
    let codes = |h: &mut Harness| -> Vec<u8> {
        h.recv_one(publ)
            .iter()
            .filter_map(|p| match p {
                Packet::PubAck(a) | Packet::PubRec(a) => Some(a.reason_code),
                _ => None,
            })
            .collect()
    };
    h.publish(publ, "t", "fits", QoS::AtLeastOnce, false);
    assert_eq!(codes(&mut h), vec![0]);
    h.publish(publ, "t", "full", QoS::AtLeastOnce, false);
    assert_eq!(codes(&mut h), vec![0x97]);
    h.publish(publ, "t", "full", QoS::ExactlyOnce, false);
    assert_eq!(codes(&mut h), vec![0x97]);
    // The refused QoS 2 id is free again: the same id is accepted as a new message later.
    h.publish(publ, "nobody", "x", QoS::ExactlyOnce, false);
    assert_eq!(codes(&mut h), vec![0x10]);
}

#[test]
fn a_stop_with_a_server_reference_sends_mqtt5_clients_there_with_0x9c() {
    for (reference, code) in [(Some("lb.example:1883"), 0x9C), (None, 0x8B)] {
        let mut h = Harness::new();
        let v5 = h.connect("v5", Protocol::V5, true);
        let v311 = h.connect("v311", Protocol::V311, true);
        h.recv();
        let now = h.now;
        h.e.close_all("server shutting down", reference, now);
        let all = h.recv();
        match &all[&v5][..] {
            [Packet::Disconnect(d)] => {
                assert_eq!(d.reason_code, code);
                let named = d
                    .properties
                    .as_ref()
                    .and_then(|p| p.server_reference.clone());
                assert_eq!(named.as_deref(), reference);
            }
            other => panic!("{other:?}"),
        }
        // MQTT 3.1.1 has no DISCONNECT from the server: the connection just closes.
        assert!(all.get(&v311).is_none_or(Vec::is_empty));
    }
}
