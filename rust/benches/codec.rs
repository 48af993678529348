//! Codec micro-benchmarks: decode and encode of a QoS 0 PUBLISH with a 64-byte payload on
//! topic "bench/sensors/0042", for MQTT 3.1.1 and 5.0.
//!
//! Decode is measured as the engine uses it: a `BytesMut` read buffer holding many packets
//! back to back, decoded until empty (refilled outside the timed part), plus the one packet
//! per buffer case. Throughput is in packets (criterion elements).
//!
//! Run: `cargo bench --no-default-features --bench codec`.

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use fastbroker_core::codec::{self, Packet, Protocol, Publish, QoS};

/// Packets per read buffer in the batched decode and encode cases.
const BATCH: usize = 1000;
const MAX_PACKET: usize = 16 * 1024 * 1024;

fn publish() -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtMostOnce,
        retain: false,
        topic: Bytes::from_static(b"bench/sensors/0042"),
        pkid: 0,
        // `Default` whatever the field's type (stays valid if it becomes optional).
        properties: Default::default(),
        payload: Bytes::from((0..64u8).collect::<Vec<u8>>()),
    })
}

fn name(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::V311 => "v311",
        Protocol::V5 => "v5",
    }
}

fn encoded(packet: &Packet, protocol: Protocol, count: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..count {
        codec::encode(packet, protocol, &mut out).expect("encodes");
    }
    out
}

fn decode(c: &mut Criterion) {
    let packet = publish();
    for protocol in [Protocol::V311, Protocol::V5] {
        let mut g = c.benchmark_group(format!("codec/decode/{}", name(protocol)));

        let one = encoded(&packet, protocol, 1);
        // Check once, outside the timed part, that the stream decodes to what was encoded.
        let mut check = BytesMut::from(&one[..]);
        let got = codec::decode(&mut check, protocol, MAX_PACKET).expect("decodes");
        assert_eq!(got.as_ref(), Some(&packet));
        assert!(check.is_empty());

        // One packet per read buffer: includes the first split of a fresh buffer.
        g.throughput(Throughput::Elements(1));
        g.bench_function("single", |b| {
            b.iter_batched(
                || BytesMut::from(&one[..]),
                |mut buf| {
                    let p = codec::decode(&mut buf, protocol, MAX_PACKET);
                    black_box(p.expect("valid").expect("whole packet"));
                    buf
                },
                BatchSize::SmallInput,
            )
        });

        // Many packets in one read buffer, decoded until it is empty (the engine's loop).
        let stream = encoded(&packet, protocol, BATCH);
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_function(format!("x{BATCH}"), |b| {
            b.iter_batched(
                || BytesMut::from(&stream[..]),
                |mut buf| {
                    let mut n = 0usize;
                    while let Some(p) =
                        codec::decode(&mut buf, protocol, MAX_PACKET).expect("valid")
                    {
                        black_box(&p);
                        n += 1;
                    }
                    assert_eq!(n, BATCH);
                    buf
                },
                BatchSize::LargeInput,
            )
        });
        g.finish();
    }
}

fn encode(c: &mut Criterion) {
    let packet = publish();
    for protocol in [Protocol::V311, Protocol::V5] {
        let mut g = c.benchmark_group(format!("codec/encode/{}", name(protocol)));

        // One packet into a reused output buffer (the engine's per-connection `out`).
        let mut out = Vec::with_capacity(256);
        g.throughput(Throughput::Elements(1));
        g.bench_function("single", |b| {
            b.iter(|| {
                out.clear();
                codec::encode(black_box(&packet), protocol, &mut out).expect("encodes");
                black_box(out.len())
            })
        });

        // Many packets appended to one output buffer, as a fan-out burst fills it.
        let mut out = Vec::with_capacity(BATCH * 128);
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_function(format!("x{BATCH}"), |b| {
            b.iter(|| {
                out.clear();
                for _ in 0..BATCH {
                    codec::encode(black_box(&packet), protocol, &mut out).expect("encodes");
                }
                black_box(out.len())
            })
        });
        g.finish();
    }
}

criterion_group!(benches, decode, encode);
criterion_main!(benches);
