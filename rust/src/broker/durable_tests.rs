//! Durable state through a restart: the engine's store operations applied to an in-memory
//! ordered map (what RocksDB is to it), then a new engine rebuilt from that map.

use std::collections::BTreeMap;

use bytes::Bytes;

use super::tests::{connect, publishes, Harness};
use super::*;
use crate::codec::{Ack, LastWill, Packet, Protocol, QoS};

pub(super) type Disk = BTreeMap<Vec<u8>, Vec<u8>>;

pub(super) fn durable() -> Config {
    Config {
        durable: true,
        ..Config::default()
    }
}

pub(super) fn sync(h: &mut Harness, disk: &mut Disk) {
    for (k, v) in h.e.take_store_ops() {
        match v {
            Some(v) => {
                disk.insert(k, v);
            }
            None => {
                disk.remove(&k);
            }
        }
    }
}

pub(super) fn restart(disk: &Disk, now: u64) -> (Harness, RestoreSummary) {
    restart_with(disk, now, durable())
}

/// `restart` with this engine config.
pub(super) fn restart_with(disk: &Disk, now: u64, cfg: Config) -> (Harness, RestoreSummary) {
    let mut h = Harness::with(cfg);
    h.now = now;
    h.e.set_wall_clock(now, now);
    let recs: Vec<(&[u8], &[u8])> = disk
        .iter()
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect();
    assert!(h.e.restore(&recs).is_empty());
    let summary = h.e.finish_restore(now);
    (h, summary)
}

#[test]
fn queued_and_inflight_qos1_survive_a_restart_in_order() {
    let mut disk = Disk::new();
    let mut h = Harness::with(durable());
    h.e.set_wall_clock(h.now, h.now);
    let sub = h.connect("sub", Protocol::V311, false);
    h.subscribe(sub, "t/#", QoS::AtLeastOnce);
    let publ = h.connect("pub", Protocol::V311, true);
    h.publish(publ, "t/1", "one", QoS::AtLeastOnce, false);
    h.publish(publ, "t/2", "two", QoS::AtLeastOnce, false);
    sync(&mut h, &mut disk);
    // "one" and "two" went out unacknowledged; "three" is queued while offline.
    assert_eq!(publishes(&h.recv_one(sub)).len(), 2);
    h.e.closed(sub, h.now);
    h.publish(publ, "t/3", "three", QoS::AtLeastOnce, false);
    sync(&mut h, &mut disk);
    h.recv();

    let (mut h, summary) = restart(&disk, h.now + 5000);
    assert_eq!(summary.sessions, 1);
    assert_eq!(summary.inflight, 2);
    assert_eq!(summary.messages, 1);
    let (sub, got) = h.connect_with(connect("sub", Protocol::V311, false));
    let ps = publishes(&got);
    let payloads: Vec<&[u8]> = ps.iter().map(|p| &p.payload[..]).collect();
    assert_eq!(payloads, vec![&b"one"[..], b"two", b"three"]);
    assert!(ps[0].dup && ps[1].dup && !ps[2].dup);
    // Acknowledged messages are deleted from the store.
    let ids: Vec<u16> = ps.iter().map(|p| p.pkid).collect();
    for pkid in ids {
        h.send(
            sub,
            Packet::PubAck(Ack {
                pkid,
                reason_code: 0,
                properties: None,
            }),
        );
    }
    let mut disk2 = disk.clone();
    sync(&mut h, &mut disk2);
    assert!(
        disk2.keys().all(|k| k[0] == b's'),
        "left: {:?}",
        disk2.keys()
    );
    // The subscription survived too.
    let publ = h.connect("pub", Protocol::V311, true);
    h.publish(publ, "t/4", "four", QoS::AtLeastOnce, false);
    assert_eq!(publishes(&h.recv_one(sub)).len(), 1);
}

#[test]
fn qos2_state_survives_a_restart_both_ways_without_a_second_delivery() {
    let mut disk = Disk::new();
    let mut h = Harness::with(durable());
    h.e.set_wall_clock(h.now, h.now);
    let mut c = connect("sub", Protocol::V5, false);
    c.properties.session_expiry_interval = Some(3600);
    let (sub, _) = h.connect_with(c);
    h.subscribe(sub, "q", QoS::ExactlyOnce);
    // Make the sessions outlive their connections (MQTT 5: session expiry).
    let mut c = connect("pub", Protocol::V5, false);
    c.properties.session_expiry_interval = Some(3600);
    let (publ, _) = h.connect_with(c);
    h.publish(publ, "q", "m", QoS::ExactlyOnce, false);
    let got = h.recv();
    let pkid_out = publishes(&got[&sub])[0].pkid;
    // Subscriber: PUBREC; broker answers PUBREL; then the broker dies before PUBCOMP.
    h.send(
        sub,
        Packet::PubRec(Ack {
            pkid: pkid_out,
            reason_code: 0,
            properties: None,
        }),
    );
    assert!(matches!(h.recv_one(sub)[..], [Packet::PubRel(_)]));
    sync(&mut h, &mut disk);

    let (mut h, _) = restart(&disk, h.now + 1000);
    // The publisher resends its QoS 2 PUBLISH (no PUBREL yet): acknowledged, not delivered.
    let mut c = connect("pub", Protocol::V5, false);
    c.properties.session_expiry_interval = Some(3600);
    let (publ, _) = h.connect_with(c);
    let mut c = connect("sub", Protocol::V5, false);
    c.properties.session_expiry_interval = Some(3600);
    let (sub, got) = h.connect_with(c);
    // The subscriber gets the PUBREL again, never the message again.
    assert!(publishes(&got).is_empty());
    assert!(got
        .iter()
        .any(|p| matches!(p, Packet::PubRel(a) if a.pkid == pkid_out)));
    h.publish(publ, "q", "m", QoS::ExactlyOnce, false);
    let got = h.recv();
    assert!(
        !got.contains_key(&sub),
        "delivered twice: {:?}",
        got.get(&sub)
    );
    assert!(got[&publ].iter().any(|p| matches!(p, Packet::PubRec(_))));
}

#[test]
fn retained_messages_and_a_will_of_a_live_connection_survive() {
    let mut disk = Disk::new();
    let mut h = Harness::with(durable());
    h.e.set_wall_clock(h.now, h.now);
    let publ = h.connect("pub", Protocol::V311, true);
    h.publish(publ, "r/1", "kept", QoS::AtLeastOnce, true);
    h.publish(publ, "r/2", "gone", QoS::AtMostOnce, true);
    h.publish(publ, "r/2", "", QoS::AtMostOnce, true);
    let mut c = connect("dev", Protocol::V311, false);
    c.will = Some(LastWill {
        topic: "status/dev".into(),
        payload: Bytes::from_static(b"offline"),
        qos: QoS::AtLeastOnce,
        retain: true,
        properties: Properties::default(),
    });
    h.connect_with(c);
    sync(&mut h, &mut disk);

    // The broker dies under the live connection: the will goes out at restart.
    let (mut h, summary) = restart(&disk, h.now + 1000);
    assert_eq!(summary.retained, 1);
    let (watcher, _) = h.connect_with(connect("w", Protocol::V311, true));
    let ps = h.subscribe_recv(watcher, "#", QoS::AtLeastOnce, Properties::default());
    let mut topics: Vec<Vec<u8>> = publishes(&ps).iter().map(|p| p.topic.to_vec()).collect();
    topics.sort();
    assert_eq!(topics, vec![b"r/1".to_vec(), b"status/dev".to_vec()]);
}

#[test]
fn damaged_records_are_reported_and_never_delivered() {
    let mut disk = Disk::new();
    let mut h = Harness::with(durable());
    h.e.set_wall_clock(h.now, h.now);
    let sub = h.connect("sub", Protocol::V311, false);
    h.subscribe(sub, "t", QoS::AtLeastOnce);
    h.e.closed(sub, h.now);
    let publ = h.connect("pub", Protocol::V311, true);
    h.publish(publ, "t", "good", QoS::AtLeastOnce, false);
    h.publish(publ, "t", "bad", QoS::AtLeastOnce, false);
    sync(&mut h, &mut disk);
    // Flip one byte in the stored payload of the second message.
    let (key, value) = disk
        .iter_mut()
        .filter(|(k, _)| k[0] == b'm')
        .nth(1)
        .expect("two messages stored");
    let key = key.clone();
    let last = value.len() - 20;
    value[last] ^= 0x40;

    let mut h2 = Harness::with(durable());
    let recs: Vec<(&[u8], &[u8])> = disk
        .iter()
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect();
    let bad = h2.e.restore(&recs);
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].0, key);
    assert!(bad[0].1.contains("checksum"), "{}", bad[0].1);
    h2.e.finish_restore(h2.now);
    let (_, got) = h2.connect_with(connect("sub", Protocol::V311, false));
    let payloads: Vec<Vec<u8>> = publishes(&got).iter().map(|p| p.payload.to_vec()).collect();
    assert_eq!(payloads, vec![b"good".to_vec()]);
}

#[test]
fn clean_sessions_and_qos0_write_nothing() {
    let mut h = Harness::with(durable());
    let sub = h.connect("sub", Protocol::V311, true);
    h.subscribe(sub, "t", QoS::AtLeastOnce);
    let durable_sub = h.connect("keep", Protocol::V311, false);
    h.subscribe(durable_sub, "t", QoS::AtMostOnce);
    h.e.take_store_ops();
    let publ = h.connect("pub", Protocol::V311, true);
    h.publish(publ, "t", "x", QoS::AtLeastOnce, false);
    h.publish(publ, "t", "y", QoS::AtMostOnce, false);
    assert!(h.e.take_store_ops().is_empty());
}

#[test]
fn a_session_that_ends_leaves_nothing_on_disk() {
    let mut disk = Disk::new();
    let mut h = Harness::with(durable());
    let sub = h.connect("sub", Protocol::V311, false);
    h.subscribe(sub, "t", QoS::AtLeastOnce);
    h.e.closed(sub, h.now);
    let publ = h.connect("pub", Protocol::V311, true);
    for _ in 0..5 {
        h.publish(publ, "t", "x", QoS::AtLeastOnce, false);
    }
    sync(&mut h, &mut disk);
    assert!(disk.len() >= 6);
    // Reconnecting with a clean session ends the old one.
    h.connect("sub", Protocol::V311, true);
    sync(&mut h, &mut disk);
    assert!(disk.is_empty(), "left: {:?}", disk.keys());
}

#[test]
fn expired_messages_of_offline_sessions_leave_the_store() {
    let mut disk = Disk::new();
    let mut h = Harness::with(durable());
    h.e.set_wall_clock(h.now, h.now);
    let sub = h.connect("sub", Protocol::V311, false);
    h.subscribe(sub, "t", QoS::AtLeastOnce);
    h.e.closed(sub, h.now);
    let (publ, _) = h.connect_with(connect("pub", Protocol::V5, true));
    let mut p = super::tests::publish_packet("t", "short-lived", QoS::AtLeastOnce, false, 3);
    p.properties = Properties {
        message_expiry_interval: Some(5),
        ..Properties::default()
    }
    .into_boxed();
    h.send(publ, Packet::Publish(p));
    h.publish(publ, "t", "kept", QoS::AtLeastOnce, false);
    sync(&mut h, &mut disk);
    assert_eq!(disk.keys().filter(|k| k[0] == b'm').count(), 2);
    h.now += 60_000;
    h.e.tick(h.now);
    sync(&mut h, &mut disk);
    assert_eq!(disk.keys().filter(|k| k[0] == b'm').count(), 1);
    let (_, got) = h.connect_with(connect("sub", Protocol::V311, false));
    let payloads: Vec<Vec<u8>> = publishes(&got).iter().map(|p| p.payload.to_vec()).collect();
    assert_eq!(payloads, vec![b"kept".to_vec()]);
}

#[test]
fn retained_count_and_size_limits_keep_delivering() {
    let mut h = Harness::with(Config {
        max_retained_messages: 2,
        max_retained_size: 10,
        ..durable()
    });
    let watcher = h.connect("w", Protocol::V311, true);
    h.subscribe(watcher, "#", QoS::AtMostOnce);
    let publ = h.connect("pub", Protocol::V311, true);
    h.publish(publ, "a", "1", QoS::AtMostOnce, true);
    h.publish(publ, "b", "2", QoS::AtMostOnce, true);
    h.publish(publ, "c", "3", QoS::AtMostOnce, true);
    h.publish(publ, "a", "replaced", QoS::AtMostOnce, true);
    h.publish(publ, "b", "far too large", QoS::AtMostOnce, true);
    // All five were delivered live.
    assert_eq!(publishes(&h.recv_one(watcher)).len(), 5);
    assert_eq!(h.e.retained_count(), 2);
    let late = h.connect("late", Protocol::V311, true);
    let got = h.subscribe_recv(late, "#", QoS::AtMostOnce, Properties::default());
    let mut kept: Vec<(Vec<u8>, Vec<u8>)> = publishes(&got)
        .iter()
        .map(|p| (p.topic.to_vec(), p.payload.to_vec()))
        .collect();
    kept.sort();
    assert_eq!(
        kept,
        vec![
            (b"a".to_vec(), b"replaced".to_vec()),
            (b"b".to_vec(), b"2".to_vec())
        ]
    );
}
