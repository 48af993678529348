//! Arbitrary bytes as a data-plane batch from a peer node (`Engine::cluster_feed`), into an
//! engine with a local subscriber to every topic and rows of its own to announce. It must
//! never panic; a batch it refuses must change nothing (the peer's rows, the local
//! subscriber's output); what it accepts must leave the engine able to drain, for the
//! subscriber and for the peer, as a real caller would.

#![no_main]

use fastbroker_core::broker::{Config, Engine};
use fastbroker_core::codec::{encode, Connect, Packet, Properties, Protocol, QoS, Subscribe, SubscribeFilter};
use libfuzzer_sys::fuzz_target;

fn packet(p: Packet) -> Vec<u8> {
    let mut out = Vec::new();
    encode(&p, Protocol::V5, &mut out).expect("encodes");
    out
}

fuzz_target!(|data: &[u8]| {
    let mut e = Engine::new(Config::default());
    e.cluster_start(1, "fuzz");
    let peer = e.cluster_add_peer("peer");
    e.cluster_link(peer, true);
    let conn = e.open(0);
    e.feed(
        conn,
        &packet(Packet::Connect(Box::new(Connect {
            protocol: Protocol::V5,
            clean_start: true,
            keep_alive: 60,
            client_id: "sub".into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        }))),
        0,
    );
    e.feed(
        conn,
        &packet(Packet::Subscribe(Subscribe {
            pkid: 1,
            filters: vec![SubscribeFilter {
                filter: "#".into(),
                qos: QoS::ExactlyOnce,
                no_local: false,
                retain_as_published: true,
                retain_handling: 0,
            }],
            properties: None,
        })),
        0,
    );
    e.drain(|_, _, _| {});
    e.drain_cluster(|_, _| {});
    let before = e.cluster_stats();
    match e.cluster_feed(peer, data, 1) {
        Err(_) => {
            let after = e.cluster_stats();
            assert_eq!(before[0].3.rows, after[0].3.rows, "a refused batch changed rows");
            assert_eq!(before[0].3.messages_in, after[0].3.messages_in);
            assert!(!e.has_output(), "a refused batch produced output");
        }
        Ok(()) => {
            e.drain(|_, _, _| {});
            e.drain_cluster(|_, _| {});
        }
    }
});
