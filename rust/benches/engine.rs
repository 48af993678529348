//! The broker engine end to end, without Python: clients connected and subscribed over the
//! wire protocol, then each timed iteration feeds reads of 100 QoS 0 PUBLISH (64-byte
//! payload) and drains the engine's output, the way the network layer drives it.
//!
//! - fan-in: 8 publishers on `bench/pub/N/data`, one subscriber to `bench/#`; each
//!   iteration feeds one 100-publish read per publisher, draining after each (800 deliveries).
//! - fan-out: one publisher on `bench/fanout/data`, 50 subscribers to it; one 100-publish read
//!   and a drain (5,000 deliveries).
//!
//! Throughput is in messages delivered (criterion elements), checked against the bytes
//! drained. Run: `cargo bench --no-default-features --bench engine`.

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use fastbroker_core::broker::{Config, ConnId, Engine};
use fastbroker_core::codec::{
    self, Connect, Packet, Properties, Protocol, Publish, QoS, Subscribe, SubscribeFilter,
};

const PUBLISHES_PER_READ: usize = 100;
const NOW: u64 = 1_000_000;

fn bytes_of(packets: &[Packet], protocol: Protocol) -> Vec<u8> {
    let mut out = Vec::new();
    for p in packets {
        codec::encode(p, protocol, &mut out).expect("encodes");
    }
    out
}

fn publish(topic: &str) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtMostOnce,
        retain: false,
        topic: Bytes::copy_from_slice(topic.as_bytes()),
        pkid: 0,
        // `Default` whatever the field's type (stays valid if it becomes optional).
        properties: Default::default(),
        payload: Bytes::from(vec![0x5a; 64]),
    })
}

/// Everything the engine has to write, as (connection, byte count); fails on a close.
fn drain(engine: &mut Engine) -> Vec<(ConnId, usize)> {
    let mut out = Vec::new();
    engine.drain(|id, data, close| {
        assert!(close == 0, "engine closed connection {id}");
        out.push((id, data.len()));
    });
    out
}

/// Opens a connection and completes CONNECT (and SUBSCRIBE to `filter`, if any).
fn client(engine: &mut Engine, n: usize, protocol: Protocol, filter: Option<&str>) -> ConnId {
    let id = engine.open(NOW);
    let connect = Packet::Connect(Box::new(Connect {
        protocol,
        clean_start: true,
        keep_alive: 0,
        client_id: format!("bench-{n}"),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    }));
    engine.feed(id, &bytes_of(&[connect], protocol), NOW);
    if let Some(filter) = filter {
        let sub = Packet::Subscribe(Subscribe {
            pkid: 1,
            filters: vec![SubscribeFilter {
                filter: filter.to_string(),
                qos: QoS::AtMostOnce,
                no_local: false,
                retain_as_published: false,
                retain_handling: 0,
            }],
            properties: None,
        });
        engine.feed(id, &bytes_of(&[sub], protocol), NOW);
    }
    // CONNACK (and SUBACK) for this client only.
    assert_eq!(drain(engine).len(), 1);
    id
}

/// Bytes of one PUBLISH as a subscriber receives it, to check the deliveries.
fn delivered_size(topic: &str, protocol: Protocol) -> usize {
    let p = publish(topic);
    let out = bytes_of(std::slice::from_ref(&p), protocol);
    let mut buf = BytesMut::from(&out[..]);
    assert_eq!(
        codec::decode(&mut buf, protocol, usize::MAX).unwrap(),
        Some(p)
    );
    out.len()
}

fn name(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::V311 => "v311",
        Protocol::V5 => "v5",
    }
}

fn fan_in(c: &mut Criterion) {
    const PUBLISHERS: usize = 8;
    let mut g = c.benchmark_group("engine/fan_in_8_to_1");
    g.throughput(Throughput::Elements(
        (PUBLISHERS * PUBLISHES_PER_READ) as u64,
    ));
    for protocol in [Protocol::V311, Protocol::V5] {
        let mut engine = Engine::new(Config::default());
        let sub = client(&mut engine, 0, protocol, Some("bench/#"));
        let mut reads = Vec::new();
        for n in 1..=PUBLISHERS {
            let id = client(&mut engine, n, protocol, None);
            let topic = format!("bench/pub/{n}/data");
            let burst = vec![publish(&topic); PUBLISHES_PER_READ];
            reads.push((id, bytes_of(&burst, protocol)));
        }
        let per_message = delivered_size("bench/pub/1/data", protocol);
        let expected = PUBLISHES_PER_READ * per_message;
        g.bench_function(name(protocol), |b| {
            b.iter(|| {
                for (id, read) in &reads {
                    engine.feed(*id, black_box(read), NOW);
                    let mut got = 0;
                    engine.drain(|cid, data, _| {
                        debug_assert_eq!(cid, sub);
                        got += data.len();
                    });
                    assert_eq!(got, expected);
                }
            })
        });
    }
    g.finish();
}

fn fan_out(c: &mut Criterion) {
    const SUBSCRIBERS: usize = 50;
    const TOPIC: &str = "bench/fanout/data";
    let mut g = c.benchmark_group("engine/fan_out_1_to_50");
    g.throughput(Throughput::Elements(
        (SUBSCRIBERS * PUBLISHES_PER_READ) as u64,
    ));
    for protocol in [Protocol::V311, Protocol::V5] {
        let mut engine = Engine::new(Config::default());
        for n in 0..SUBSCRIBERS {
            client(&mut engine, n, protocol, Some(TOPIC));
        }
        let publisher = client(&mut engine, SUBSCRIBERS, protocol, None);
        let read = bytes_of(&vec![publish(TOPIC); PUBLISHES_PER_READ], protocol);
        let expected = SUBSCRIBERS * PUBLISHES_PER_READ * delivered_size(TOPIC, protocol);
        g.bench_function(name(protocol), |b| {
            b.iter(|| {
                engine.feed(publisher, black_box(&read), NOW);
                let mut got = 0;
                let mut conns = 0;
                engine.drain(|_, data, _| {
                    got += data.len();
                    conns += 1;
                });
                assert_eq!((conns, got), (SUBSCRIBERS, expected));
            })
        });
    }
    g.finish();
}

criterion_group!(benches, fan_in, fan_out);
criterion_main!(benches);
