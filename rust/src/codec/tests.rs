//! Codec tests: round trips of every packet type for both versions, decoding at every split
//! point, one test per malformed case, and proptest round trips.

use super::*;
use bytes::{Bytes, BytesMut};

const MAX: usize = 268_435_460;

fn s(v: &str) -> String {
    v.to_string()
}

fn enc(p: &Packet, proto: Protocol) -> Vec<u8> {
    let mut out = Vec::new();
    encode(p, proto, &mut out).expect("encode");
    out
}

fn dec(bytes: &[u8], proto: Protocol) -> Result<Option<Packet>, DecodeError> {
    let mut buf = BytesMut::from(bytes);
    decode(&mut buf, proto, MAX)
}

fn dec_err(bytes: &[u8], proto: Protocol) -> DecodeError {
    dec(bytes, proto).expect_err("should not decode")
}

fn roundtrip(p: &Packet, proto: Protocol) {
    let bytes = enc(p, proto);
    let mut buf = BytesMut::from(&bytes[..]);
    let got = decode(&mut buf, proto, MAX)
        .expect("decode")
        .expect("whole packet");
    assert_eq!(&got, p, "{proto:?} round trip of {p:?}");
    assert!(buf.is_empty());
    // Re-encoding gives the same bytes: the encoding is canonical.
    assert_eq!(enc(&got, proto), bytes);
}

/// Fixed header + body.
fn raw(first: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    let mut n = body.len();
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(b);
            break;
        }
        out.push(b | 0x80);
    }
    out.extend_from_slice(body);
    out
}

fn mqtt_str(v: &[u8]) -> Vec<u8> {
    let mut out = (v.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(v);
    out
}

/// A CONNECT with the given name, level, flags and the rest of the packet after keep alive.
fn connect_raw(name: &[u8], level: u8, flags: u8, rest: &[u8]) -> Vec<u8> {
    let mut body = mqtt_str(name);
    body.push(level);
    body.push(flags);
    body.extend_from_slice(&[0, 60]);
    body.extend_from_slice(rest);
    raw(0x10, &body)
}

/// A v5 PUBLISH QoS 0 to "t" with the given raw property block contents.
fn publish_with_props(props: &[u8]) -> Vec<u8> {
    let mut body = mqtt_str(b"t");
    body.push(props.len() as u8);
    body.extend_from_slice(props);
    body.extend_from_slice(b"payload");
    raw(0x30, &body)
}

/// A v5 CONNACK with the given raw property block contents.
fn connack_with_props(props: &[u8]) -> Vec<u8> {
    let mut body = vec![0, 0, props.len() as u8];
    body.extend_from_slice(props);
    raw(0x20, &body)
}

/// A v5 CONNECT (no will) with the given raw property block contents.
fn connect_with_props(props: &[u8]) -> Vec<u8> {
    let mut rest = vec![props.len() as u8];
    rest.extend_from_slice(props);
    rest.extend_from_slice(&mqtt_str(b"cid"));
    connect_raw(b"MQTT", 5, 0x02, &rest)
}

fn user_props() -> Vec<(String, String)> {
    vec![(s("k"), s("v")), (s("k"), s("v2")), (s("é"), s(""))]
}

fn message_props() -> Properties {
    Properties {
        payload_format_indicator: Some(1),
        message_expiry_interval: Some(3600),
        content_type: Some(s("text/plain")),
        response_topic: Some(s("reply/here")),
        correlation_data: Some(Bytes::from_static(b"\x00\x01corr")),
        user_properties: user_props(),
        ..Default::default()
    }
}

fn ack_props() -> Properties {
    Properties {
        reason_string: Some(s("because")),
        user_properties: user_props(),
        ..Default::default()
    }
}

fn sample_connect(proto: Protocol) -> Packet {
    let v5 = proto == Protocol::V5;
    let props = if v5 {
        Properties {
            session_expiry_interval: Some(120),
            authentication_method: Some(s("SCRAM-SHA-1")),
            authentication_data: Some(Bytes::from_static(b"client-first")),
            request_problem_information: Some(0),
            request_response_information: Some(1),
            receive_maximum: Some(20),
            topic_alias_maximum: Some(10),
            user_properties: user_props(),
            maximum_packet_size: Some(1 << 20),
            ..Default::default()
        }
    } else {
        Properties::default()
    };
    let will_props = if v5 {
        Properties {
            will_delay_interval: Some(30),
            ..message_props()
        }
    } else {
        Properties::default()
    };
    Packet::Connect(Box::new(Connect {
        protocol: proto,
        clean_start: true,
        keep_alive: 60,
        client_id: s("client-1"),
        will: Some(LastWill {
            topic: s("clients/1/status"),
            payload: Bytes::from_static(b"offline"),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: will_props,
        }),
        username: Some(s("user")),
        password: Some(Bytes::from_static(b"\x00secret\xff")),
        properties: props,
    }))
}

/// Every packet type with as many properties as it may carry (none for 3.1.1).
fn samples(proto: Protocol) -> Vec<Packet> {
    let v5 = proto == Protocol::V5;
    let p = |props: Properties| if v5 { props.into_boxed() } else { None };
    let ack = |pkid: u16, reason: u8| Ack {
        pkid,
        reason_code: if v5 { reason } else { 0 },
        properties: p(ack_props()),
    };
    let mut v = vec![
        sample_connect(proto),
        Packet::Connect(Box::new(Connect {
            protocol: proto,
            clean_start: false,
            keep_alive: 0,
            client_id: String::new(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        })),
        Packet::ConnAck(ConnAck {
            session_present: true,
            reason_code: 0,
            properties: p(Properties {
                session_expiry_interval: Some(0),
                assigned_client_identifier: Some(s("auto-123")),
                server_keep_alive: Some(30),
                authentication_method: Some(s("SCRAM-SHA-1")),
                authentication_data: Some(Bytes::from_static(b"server-final")),
                response_information: Some(s("resp/")),
                server_reference: Some(s("other:1883")),
                reason_string: Some(s("welcome")),
                receive_maximum: Some(65535),
                topic_alias_maximum: Some(100),
                maximum_qos: Some(1),
                retain_available: Some(0),
                user_properties: user_props(),
                maximum_packet_size: Some(268_435_460),
                wildcard_subscription_available: Some(1),
                subscription_identifier_available: Some(0),
                shared_subscription_available: Some(1),
                ..Default::default()
            }),
        }),
        Packet::ConnAck(ConnAck {
            session_present: false,
            reason_code: 0x86,
            properties: None,
        }),
        Packet::Publish(Publish {
            dup: true,
            qos: QoS::ExactlyOnce,
            retain: true,
            topic: Bytes::from_static("a/b/ü".as_bytes()),
            pkid: 65535,
            properties: p(Properties {
                subscription_identifiers: vec![1, 300, 268_435_455],
                topic_alias: Some(7),
                ..message_props()
            }),
            payload: Bytes::from_static(b"\x00\x01\x02 hello"),
        }),
        Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: Bytes::from_static(b"t"),
            pkid: 0,
            properties: None,
            payload: Bytes::new(),
        }),
        Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtLeastOnce,
            retain: false,
            topic: Bytes::from_static(b"big"),
            pkid: 1,
            properties: None,
            payload: Bytes::from(vec![0xab; 200_000]),
        }),
        Packet::PubAck(ack(1, 0x10)),
        Packet::PubRec(ack(2, 0x80)),
        Packet::PubRel(ack(3, 0x92)),
        Packet::PubComp(ack(4, 0)),
        Packet::PubAck(Ack {
            pkid: 9,
            reason_code: 0,
            properties: None,
        }),
        Packet::Subscribe(Subscribe {
            pkid: 10,
            filters: vec![
                SubscribeFilter {
                    filter: s("a/+/c"),
                    qos: QoS::AtMostOnce,
                    no_local: v5,
                    retain_as_published: v5,
                    retain_handling: if v5 { 2 } else { 0 },
                },
                SubscribeFilter {
                    filter: s("#"),
                    qos: QoS::ExactlyOnce,
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: if v5 { 1 } else { 0 },
                },
            ],
            properties: p(Properties {
                subscription_identifiers: vec![42],
                user_properties: user_props(),
                ..Default::default()
            }),
        }),
        Packet::SubAck(SubAck {
            pkid: 10,
            reason_codes: if v5 {
                vec![0, 1, 2, 0x80, 0x87, 0xa2]
            } else {
                vec![0, 1, 2, 0x80]
            },
            properties: p(ack_props()),
        }),
        Packet::Unsubscribe(Unsubscribe {
            pkid: 11,
            filters: vec![s("a/+/c"), s("x")],
            properties: p(Properties {
                user_properties: user_props(),
                ..Default::default()
            }),
        }),
        Packet::UnsubAck(UnsubAck {
            pkid: 11,
            reason_codes: if v5 { vec![0, 0x11] } else { vec![] },
            properties: p(ack_props()),
        }),
        Packet::PingReq,
        Packet::PingResp,
        Packet::Disconnect(Disconnect {
            reason_code: if v5 { 0x04 } else { 0 },
            properties: p(Properties {
                session_expiry_interval: Some(10),
                server_reference: Some(s("elsewhere")),
                ..ack_props()
            }),
        }),
        Packet::Disconnect(Disconnect {
            reason_code: 0,
            properties: None,
        }),
    ];
    if v5 {
        v.push(Packet::Auth(Auth {
            reason_code: 0x18,
            properties: Some(Box::new(Properties {
                authentication_method: Some(s("SCRAM-SHA-1")),
                authentication_data: Some(Bytes::from_static(b"data")),
                ..ack_props()
            })),
        }));
        v.push(Packet::Auth(Auth {
            reason_code: 0,
            properties: None,
        }));
        // Topic alias instead of a topic.
        v.push(Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtLeastOnce,
            retain: false,
            topic: Bytes::new(),
            pkid: 5,
            properties: Some(Box::new(Properties {
                topic_alias: Some(3),
                ..Default::default()
            })),
            payload: Bytes::from_static(b"x"),
        }));
    }
    v
}

#[test]
fn roundtrip_every_packet_v5() {
    let all = samples(Protocol::V5);
    let types: std::collections::BTreeSet<u8> = all.iter().map(Packet::type_code).collect();
    assert_eq!(types.len(), 15);
    for p in &all {
        roundtrip(p, Protocol::V5);
    }
}

#[test]
fn roundtrip_every_packet_v311() {
    let all = samples(Protocol::V311);
    let types: std::collections::BTreeSet<u8> = all.iter().map(Packet::type_code).collect();
    assert_eq!(types.len(), 14);
    for p in &all {
        roundtrip(p, Protocol::V311);
    }
}

#[test]
fn connect_ignores_connection_protocol() {
    // A CONNECT carries its own level: decoding with the other protocol gives the same packet.
    let c5 = sample_connect(Protocol::V5);
    assert_eq!(dec(&enc(&c5, Protocol::V311), Protocol::V311), Ok(Some(c5)));
    let c4 = sample_connect(Protocol::V311);
    assert_eq!(dec(&enc(&c4, Protocol::V5), Protocol::V5), Ok(Some(c4)));
}

#[test]
fn known_encodings() {
    let ping = enc(&Packet::PingReq, Protocol::V5);
    assert_eq!(ping, [0xc0, 0]);
    let ack = Packet::PubAck(Ack {
        pkid: 0x0102,
        reason_code: 0,
        properties: None,
    });
    assert_eq!(enc(&ack, Protocol::V5), [0x40, 2, 1, 2]);
    assert_eq!(enc(&ack, Protocol::V311), [0x40, 2, 1, 2]);
    let rel = Packet::PubRel(Ack {
        pkid: 7,
        reason_code: 0x92,
        properties: None,
    });
    assert_eq!(enc(&rel, Protocol::V5), [0x62, 3, 0, 7, 0x92]);
    let disc = Packet::Disconnect(Disconnect {
        reason_code: 0x8e,
        properties: None,
    });
    assert_eq!(enc(&disc, Protocol::V5), [0xe0, 1, 0x8e]);
    assert_eq!(enc(&disc, Protocol::V311), [0xe0, 0]);
    let connack = Packet::ConnAck(ConnAck {
        session_present: false,
        reason_code: 0x87,
        properties: None,
    });
    assert_eq!(enc(&connack, Protocol::V5), [0x20, 3, 0, 0x87, 0]);
    assert_eq!(enc(&connack, Protocol::V311), [0x20, 2, 0, 5]);
    let publish = Packet::Publish(Publish {
        dup: true, // dropped: QoS 0
        qos: QoS::AtMostOnce,
        retain: true,
        topic: Bytes::from_static(b"a/b"),
        pkid: 0,
        properties: None,
        payload: Bytes::from_static(b"hi"),
    });
    assert_eq!(
        enc(&publish, Protocol::V5),
        [0x31, 8, 0, 3, b'a', b'/', b'b', 0, b'h', b'i']
    );
    assert_eq!(
        enc(&publish, Protocol::V311),
        [0x31, 7, 0, 3, b'a', b'/', b'b', b'h', b'i']
    );
    let suback = Packet::SubAck(SubAck {
        pkid: 1,
        reason_codes: vec![1, 0x87],
        properties: None,
    });
    assert_eq!(enc(&suback, Protocol::V311), [0x90, 4, 0, 1, 1, 0x80]);
}

#[test]
fn encode_appends() {
    let mut out = vec![0xee];
    encode(&Packet::PingResp, Protocol::V5, &mut out).unwrap();
    encode(&Packet::PingReq, Protocol::V311, &mut out).unwrap();
    assert_eq!(out, [0xee, 0xd0, 0, 0xc0, 0]);
}

/// Decodes everything `buf` holds, in order.
fn drain(buf: &mut BytesMut, proto: Protocol, out: &mut Vec<Packet>) {
    while let Some(p) = decode(buf, proto, MAX).expect("valid stream") {
        out.push(p);
    }
}

#[test]
fn every_split_point_gives_the_same_packets() {
    for proto in [Protocol::V311, Protocol::V5] {
        // Small packets only (the 200 kB one would make this quadratic test slow).
        let packets: Vec<Packet> = samples(proto)
            .into_iter()
            .filter(|p| enc(p, proto).len() < 1000)
            .collect();
        let mut stream = Vec::new();
        for p in &packets {
            encode(p, proto, &mut stream).unwrap();
        }
        for split in 0..=stream.len() {
            let mut buf = BytesMut::from(&stream[..split]);
            let mut got = Vec::new();
            drain(&mut buf, proto, &mut got);
            let before = buf.clone();
            buf.extend_from_slice(&stream[split..]);
            assert!(before.len() <= buf.len());
            drain(&mut buf, proto, &mut got);
            assert_eq!(got, packets, "split at {split}");
            assert!(buf.is_empty());
        }
        // One byte at a time.
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for &b in &stream {
            buf.extend_from_slice(&[b]);
            drain(&mut buf, proto, &mut got);
        }
        assert_eq!(got, packets);
    }
}

#[test]
fn incomplete_leaves_buffer_untouched() {
    let bytes = enc(&sample_connect(Protocol::V5), Protocol::V5);
    for n in 0..bytes.len() {
        let mut buf = BytesMut::from(&bytes[..n]);
        assert_eq!(decode(&mut buf, Protocol::V5, MAX), Ok(None));
        assert_eq!(&buf[..], &bytes[..n]);
    }
}

#[test]
fn decoded_fields_share_the_buffer() {
    let p = Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: false,
        topic: Bytes::from_static(b"zero/copy"),
        pkid: 1,
        properties: Some(Box::new(Properties {
            correlation_data: Some(Bytes::from_static(b"corr")),
            ..Default::default()
        })),
        payload: Bytes::from(vec![7u8; 4096]),
    });
    let mut buf = BytesMut::with_capacity(8192);
    let mut bytes = Vec::new();
    encode(&p, Protocol::V5, &mut bytes).unwrap();
    buf.extend_from_slice(&bytes);
    let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
    let Some(Packet::Publish(got)) = decode(&mut buf, Protocol::V5, MAX).unwrap() else {
        panic!("not a publish");
    };
    for field in [
        &got.payload,
        &got.topic,
        got.props().correlation_data.as_ref().unwrap(),
    ] {
        assert!(range.contains(&(field.as_ptr() as usize)), "copied field");
    }
}

#[test]
fn publish_properties_are_none_when_there_are_none() {
    let mut v311 = mqtt_str(b"t");
    v311.extend_from_slice(b"payload");
    for (bytes, proto) in [
        (publish_with_props(&[]), Protocol::V5),
        (raw(0x30, &v311), Protocol::V311),
    ] {
        let Ok(Some(Packet::Publish(p))) = dec(&bytes, proto) else {
            panic!("{proto:?} publish decodes");
        };
        assert_eq!(p.properties, None);
        assert!(p.props().is_empty());
        assert_eq!(&p.payload[..], b"payload");
    }
    let Ok(Some(Packet::Publish(mut p))) = dec(&publish_with_props(&[0x01, 1]), Protocol::V5)
    else {
        panic!("publish with a property decodes");
    };
    assert_eq!(p.props().payload_format_indicator, Some(1));
    // Some of empty properties encodes like None.
    p.properties = None;
    let none = enc(&Packet::Publish(p.clone()), Protocol::V5);
    p.properties = Some(Box::default());
    assert_eq!(enc(&Packet::Publish(p), Protocol::V5), none);
    assert_eq!(Properties::default().into_boxed(), None);
}

// ---- fixed header and sizes ----

#[test]
fn remaining_length_of_five_bytes_is_malformed() {
    for bytes in [
        &[0x30, 0xff, 0xff, 0xff, 0xff][..],
        &[0x30, 0x80, 0x80, 0x80, 0x80, 0x01][..],
    ] {
        assert!(matches!(
            dec_err(bytes, Protocol::V5),
            DecodeError::Malformed(_)
        ));
    }
    // Four bytes are fine (and incomplete here).
    assert_eq!(dec(&[0x30, 0xff, 0xff, 0xff, 0x7f], Protocol::V5), Ok(None));
}

#[test]
fn too_large_is_reported_before_the_body() {
    // 3 bytes of header announcing 200 bytes of body, none of which has arrived.
    let mut buf = BytesMut::from(&[0x30, 0xc8, 0x01][..]);
    assert_eq!(
        decode(&mut buf, Protocol::V5, 100),
        Err(DecodeError::TooLarge { size: 203 })
    );
    assert_eq!(DecodeError::TooLarge { size: 203 }.reason_code(), 0x95);
    // Exactly the maximum is allowed.
    let mut buf = BytesMut::from(&[0xc0, 0x00][..]);
    assert_eq!(decode(&mut buf, Protocol::V5, 2), Ok(Some(Packet::PingReq)));
    let mut buf = BytesMut::from(&[0x30, 0x01][..]);
    assert_eq!(
        decode(&mut buf, Protocol::V5, 2),
        Err(DecodeError::TooLarge { size: 3 })
    );
}

#[test]
fn reserved_packet_types_are_malformed() {
    assert!(matches!(
        dec_err(&[0x00, 0x00], Protocol::V5),
        DecodeError::Malformed(_)
    ));
    assert!(matches!(
        dec_err(&[0xf0, 0x00], Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn fixed_header_flags() {
    for (first, proto) in [
        (0x60, Protocol::V5),   // PUBREL needs 0010
        (0x80, Protocol::V5),   // SUBSCRIBE
        (0xa0, Protocol::V311), // UNSUBSCRIBE
        (0x42, Protocol::V5),   // PUBACK needs 0000
        (0x12, Protocol::V5),   // CONNECT
        (0xc1, Protocol::V311), // PINGREQ
        (0xe8, Protocol::V5),   // DISCONNECT
        (0xf1, Protocol::V5),   // AUTH
    ] {
        let bytes = raw(first, &[0, 1]);
        assert!(
            matches!(dec_err(&bytes, proto), DecodeError::Malformed(_)),
            "{first:#x}"
        );
    }
    // The error comes from the first byte alone.
    assert!(matches!(
        dec_err(&[0x60], Protocol::V5),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn publish_qos3_is_malformed() {
    let body = [&mqtt_str(b"t")[..], &[0, 1]].concat();
    assert!(matches!(
        dec_err(&raw(0x36, &body), Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn publish_qos0_with_dup_is_malformed() {
    let body = mqtt_str(b"t");
    assert!(matches!(
        dec_err(&raw(0x38, &body), Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn trailing_bytes_are_malformed() {
    for (bytes, proto) in [
        (raw(0xc0, &[0]), Protocol::V5),
        (raw(0xd0, &[0]), Protocol::V311),
        (raw(0x40, &[0, 1, 0]), Protocol::V311),
        (raw(0xe0, &[0]), Protocol::V311),
        (raw(0x40, &[0, 1, 0, 0, 9]), Protocol::V5),
        (raw(0x20, &[0, 0, 0, 1]), Protocol::V5),
    ] {
        assert!(
            matches!(dec_err(&bytes, proto), DecodeError::Malformed(_)),
            "{bytes:?}"
        );
    }
}

#[test]
fn truncated_fields_are_malformed() {
    // PUBLISH whose topic length runs past the packet.
    let bytes = raw(0x30, &[0, 10, b'a']);
    assert!(matches!(
        dec_err(&bytes, Protocol::V5),
        DecodeError::Malformed(_)
    ));
    // Property length past the end.
    let bytes = raw(0x30, &[0, 1, b't', 5, 1]);
    assert!(matches!(
        dec_err(&bytes, Protocol::V5),
        DecodeError::Malformed(_)
    ));
}

// ---- CONNECT ----

fn connect_rest_v311() -> Vec<u8> {
    mqtt_str(b"cid")
}

#[test]
fn connect_wrong_protocol_name() {
    let bytes = connect_raw(b"MQIsdp", 3, 0x02, &connect_rest_v311());
    assert_eq!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::UnsupportedProtocol
    );
    let bytes = connect_raw(b"MQTX", 4, 0x02, &connect_rest_v311());
    assert_eq!(
        dec_err(&bytes, Protocol::V5),
        DecodeError::UnsupportedProtocol
    );
}

#[test]
fn connect_wrong_protocol_level() {
    for level in [0, 3, 6, 0x84] {
        let bytes = connect_raw(b"MQTT", level, 0x02, &connect_rest_v311());
        assert_eq!(
            dec_err(&bytes, Protocol::V5),
            DecodeError::UnsupportedProtocol
        );
    }
    assert_eq!(DecodeError::UnsupportedProtocol.reason_code(), 0x84);
}

#[test]
fn connect_reserved_flag() {
    let bytes = connect_raw(b"MQTT", 4, 0x03, &connect_rest_v311());
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn connect_will_qos_without_will_flag() {
    let bytes = connect_raw(b"MQTT", 4, 0x08, &connect_rest_v311());
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn connect_will_retain_without_will_flag() {
    let bytes = connect_raw(b"MQTT", 4, 0x20, &connect_rest_v311());
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn connect_will_qos3() {
    let rest = [mqtt_str(b"cid"), mqtt_str(b"wt"), mqtt_str(b"wp")].concat();
    let bytes = connect_raw(b"MQTT", 4, 0x04 | 0x18, &rest);
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn connect_will_topic_wildcard() {
    let rest = [mqtt_str(b"cid"), mqtt_str(b"w/#"), mqtt_str(b"wp")].concat();
    let bytes = connect_raw(b"MQTT", 4, 0x04, &rest);
    assert_eq!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::TopicNameInvalid
    );
}

#[test]
fn connect_password_without_username() {
    let rest = [mqtt_str(b"cid"), mqtt_str(b"pw")].concat();
    let bytes = connect_raw(b"MQTT", 4, 0x40, &rest);
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Malformed(_)
    ));
    // MQTT 5 allows it.
    let rest = [&[0u8][..], &mqtt_str(b"cid"), &mqtt_str(b"pw")].concat();
    let bytes = connect_raw(b"MQTT", 5, 0x40, &rest);
    let Ok(Some(Packet::Connect(c))) = dec(&bytes, Protocol::V311) else {
        panic!("v5 password without user name should decode");
    };
    assert_eq!(c.username, None);
    assert_eq!(c.password.as_deref(), Some(&b"pw"[..]));
}

#[test]
fn connect_client_id_invalid_utf8() {
    let bytes = connect_raw(b"MQTT", 4, 0x02, &mqtt_str(b"a\xffb"));
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Malformed(_)
    ));
    // A UTF-16 surrogate encoded in UTF-8 form is not valid UTF-8 either.
    let bytes = connect_raw(b"MQTT", 4, 0x02, &mqtt_str(b"\xed\xa0\x80"));
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn connect_client_id_nul() {
    let bytes = connect_raw(b"MQTT", 4, 0x02, &mqtt_str(b"a\x00b"));
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn user_property_nul_is_malformed() {
    let props = [&[0x26][..], &mqtt_str(b"k"), &mqtt_str(b"\x00")].concat();
    assert!(matches!(
        dec_err(&publish_with_props(&props), Protocol::V5),
        DecodeError::Malformed(_)
    ));
}

// ---- PUBLISH ----

#[test]
fn publish_topic_wildcards() {
    for topic in [&b"a/+"[..], b"#", b"a/b#"] {
        let bytes = raw(0x30, &mqtt_str(topic));
        assert_eq!(
            dec_err(&bytes, Protocol::V311),
            DecodeError::TopicNameInvalid
        );
        assert_eq!(DecodeError::TopicNameInvalid.reason_code(), 0x90);
    }
}

#[test]
fn publish_topic_name_checks_match_their_definition() {
    // Every byte value at the start, middle and end of topics of several lengths (the check
    // is vectorised, with a scalar tail), against the plain rules.
    for len in [1usize, 3, 18, 40, 70] {
        for pos in [0, len / 2, len - 1] {
            for b in 0..=255u8 {
                let mut topic = vec![b'a'; len];
                topic[pos] = b;
                let expected = match std::str::from_utf8(&topic) {
                    Err(_) => Some(0x81),
                    Ok(_) if topic.contains(&0) => Some(0x81),
                    Ok(_) if topic.contains(&b'+') || topic.contains(&b'#') => Some(0x90),
                    Ok(_) => None,
                };
                let got = dec(&raw(0x30, &mqtt_str(&topic)), Protocol::V311);
                match expected {
                    None => assert!(matches!(got, Ok(Some(_))), "{topic:?}: {got:?}"),
                    Some(code) => assert_eq!(got.unwrap_err().reason_code(), code, "{topic:?}"),
                }
            }
        }
    }
    let Ok(Some(Packet::Publish(p))) = dec(
        &raw(0x30, &mqtt_str("ü/😀/\u{7f}".as_bytes())),
        Protocol::V311,
    ) else {
        panic!("multi-byte UTF-8 topic decodes");
    };
    assert_eq!(&p.topic[..], "ü/😀/\u{7f}".as_bytes());
    // A malformed string is reported before a wildcard in it.
    for topic in [&b"\xed\xa0\x80/+"[..], b"a/\x00/#"] {
        assert!(matches!(
            dec_err(&raw(0x30, &mqtt_str(topic)), Protocol::V311),
            DecodeError::Malformed(_)
        ));
    }
}

#[test]
fn publish_empty_topic_v311() {
    let bytes = raw(0x30, &[0, 0, b'x']);
    assert!(matches!(
        dec_err(&bytes, Protocol::V311),
        DecodeError::Protocol(_)
    ));
}

#[test]
fn publish_empty_topic_without_alias_v5() {
    let bytes = raw(0x30, &[0, 0, 0, b'x']);
    let e = dec_err(&bytes, Protocol::V5);
    assert!(matches!(e, DecodeError::Protocol(_)));
    assert_eq!(e.reason_code(), 0x82);
    // With an alias it is the engine's to resolve.
    let bytes = raw(0x30, &[0, 0, 3, 0x23, 0, 1, b'x']);
    let Ok(Some(Packet::Publish(p))) = dec(&bytes, Protocol::V5) else {
        panic!("alias publish should decode");
    };
    assert!(p.topic.is_empty());
    assert_eq!(p.props().topic_alias, Some(1));
}

#[test]
fn publish_pkid_zero() {
    let body = [&mqtt_str(b"t")[..], &[0, 0]].concat();
    assert!(matches!(
        dec_err(&raw(0x32, &body), Protocol::V311),
        DecodeError::Protocol(_)
    ));
}

// ---- packet identifiers, SUBSCRIBE, UNSUBSCRIBE ----

#[test]
fn ack_pkid_zero() {
    for (first, proto) in [
        (0x40, Protocol::V5),
        (0x50, Protocol::V311),
        (0x62, Protocol::V5),
        (0x70, Protocol::V311),
    ] {
        let bytes = raw(first, &[0, 0]);
        assert!(
            matches!(dec_err(&bytes, proto), DecodeError::Protocol(_)),
            "{first:#x}"
        );
    }
    assert!(matches!(
        dec_err(&raw(0x90, &[0, 0, 0, 0]), Protocol::V5),
        DecodeError::Protocol(_)
    ));
    assert!(matches!(
        dec_err(&raw(0xb0, &[0, 0]), Protocol::V311),
        DecodeError::Protocol(_)
    ));
}

#[test]
fn subscribe_pkid_zero() {
    let body = [&[0, 0][..], &mqtt_str(b"a"), &[1]].concat();
    assert!(matches!(
        dec_err(&raw(0x82, &body), Protocol::V311),
        DecodeError::Protocol(_)
    ));
}

#[test]
fn unsubscribe_pkid_zero() {
    let body = [&[0, 0][..], &mqtt_str(b"a")].concat();
    assert!(matches!(
        dec_err(&raw(0xa2, &body), Protocol::V311),
        DecodeError::Protocol(_)
    ));
}

#[test]
fn subscribe_without_filters() {
    assert!(matches!(
        dec_err(&raw(0x82, &[0, 1]), Protocol::V311),
        DecodeError::Protocol(_)
    ));
    assert!(matches!(
        dec_err(&raw(0x82, &[0, 1, 0]), Protocol::V5),
        DecodeError::Protocol(_)
    ));
}

#[test]
fn unsubscribe_without_filters() {
    assert!(matches!(
        dec_err(&raw(0xa2, &[0, 1]), Protocol::V311),
        DecodeError::Protocol(_)
    ));
    assert!(matches!(
        dec_err(&raw(0xa2, &[0, 1, 0]), Protocol::V5),
        DecodeError::Protocol(_)
    ));
}

fn subscribe_v5(opts: u8) -> Vec<u8> {
    raw(0x82, &[&[0, 1, 0][..], &mqtt_str(b"a/b"), &[opts]].concat())
}

#[test]
fn subscribe_options_reserved_bits() {
    for opts in [0x40, 0x80] {
        assert!(matches!(
            dec_err(&subscribe_v5(opts), Protocol::V5),
            DecodeError::Malformed(_)
        ));
    }
}

#[test]
fn subscribe_options_qos3() {
    assert!(matches!(
        dec_err(&subscribe_v5(0x03), Protocol::V5),
        DecodeError::Malformed(_)
    ));
    let body = [&[0, 1][..], &mqtt_str(b"a"), &[3]].concat();
    assert!(matches!(
        dec_err(&raw(0x82, &body), Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

#[test]
fn subscribe_options_retain_handling3() {
    assert!(matches!(
        dec_err(&subscribe_v5(0x30), Protocol::V5),
        DecodeError::Protocol(_)
    ));
    // 2 is fine, with every other option set.
    let Ok(Some(Packet::Subscribe(s))) = dec(&subscribe_v5(0x2e), Protocol::V5) else {
        panic!("valid options");
    };
    let f = &s.filters[0];
    assert_eq!(
        (f.qos, f.no_local, f.retain_as_published, f.retain_handling),
        (QoS::ExactlyOnce, true, true, 2)
    );
}

#[test]
fn subscribe_v311_upper_bits() {
    for opts in [0x04, 0x10, 0x80] {
        let body = [&[0, 1][..], &mqtt_str(b"a"), &[opts]].concat();
        assert!(matches!(
            dec_err(&raw(0x82, &body), Protocol::V311),
            DecodeError::Malformed(_)
        ));
    }
}

// ---- MQTT 5 short forms ----

#[test]
fn v5_ack_short_forms() {
    for (first, bytes) in [
        (0x40u8, &[0u8, 5][..]),
        (0x50, &[0, 5, 0x10]),
        (0x70, &[0, 5, 0x10, 0]),
    ] {
        let Ok(Some(p)) = dec(&raw(first, bytes), Protocol::V5) else {
            panic!("short ack {bytes:?}");
        };
        let a = match p {
            Packet::PubAck(a) | Packet::PubRec(a) | Packet::PubComp(a) => a,
            other => panic!("{other:?}"),
        };
        assert_eq!(a.pkid, 5);
        assert_eq!(a.reason_code, if bytes.len() > 2 { 0x10 } else { 0 });
        assert_eq!(a.properties, None);
    }
}

#[test]
fn v5_disconnect_and_auth_empty() {
    assert_eq!(
        dec(&[0xe0, 0], Protocol::V5),
        Ok(Some(Packet::Disconnect(Disconnect {
            reason_code: 0,
            properties: None
        })))
    );
    assert_eq!(
        dec(&[0xf0, 0], Protocol::V5),
        Ok(Some(Packet::Auth(Auth {
            reason_code: 0,
            properties: None
        })))
    );
    assert_eq!(
        dec(&[0xe0, 1, 0x8e], Protocol::V5),
        Ok(Some(Packet::Disconnect(Disconnect {
            reason_code: 0x8e,
            properties: None
        })))
    );
}

// ---- properties ----

fn assert_protocol(bytes: &[u8]) {
    let e = dec_err(bytes, Protocol::V5);
    assert!(matches!(e, DecodeError::Protocol(_)), "{bytes:?}: {e:?}");
}

#[test]
fn property_flags_must_be_0_or_1() {
    assert_protocol(&publish_with_props(&[0x01, 2])); // payload format indicator
    assert_protocol(&connect_with_props(&[0x17, 2])); // request problem information
    assert_protocol(&connect_with_props(&[0x19, 2])); // request response information
    for id in [0x24, 0x25, 0x28, 0x29, 0x2a] {
        assert_protocol(&connack_with_props(&[id, 2]));
        // 1 is fine
        assert!(dec(&connack_with_props(&[id, 1]), Protocol::V5).is_ok());
    }
}

#[test]
fn receive_maximum_zero() {
    assert_protocol(&connect_with_props(&[0x21, 0, 0]));
    assert_protocol(&connack_with_props(&[0x21, 0, 0]));
}

#[test]
fn maximum_packet_size_zero() {
    assert_protocol(&connect_with_props(&[0x27, 0, 0, 0, 0]));
}

#[test]
fn subscription_identifier_zero() {
    assert_protocol(&publish_with_props(&[0x0b, 0]));
    let body = [&[0, 1, 2, 0x0b, 0][..], &mqtt_str(b"a"), &[0]].concat();
    assert_protocol(&raw(0x82, &body));
}

#[test]
fn topic_alias_zero_decodes_for_the_engine_to_refuse() {
    let Ok(Some(Packet::Publish(p))) = dec(&publish_with_props(&[0x23, 0, 0]), Protocol::V5) else {
        panic!("alias 0 decodes");
    };
    assert_eq!(p.props().topic_alias, Some(0));
}

#[test]
fn varint_property_too_long() {
    let e = dec_err(
        &publish_with_props(&[0x0b, 0xff, 0xff, 0xff, 0xff, 0x01]),
        Protocol::V5,
    );
    assert!(matches!(e, DecodeError::Malformed(_)), "{e:?}");
    // The largest 4-byte value is fine.
    let Ok(Some(Packet::Publish(p))) = dec(
        &publish_with_props(&[0x0b, 0xff, 0xff, 0xff, 0x7f]),
        Protocol::V5,
    ) else {
        panic!("max subscription identifier");
    };
    assert_eq!(p.props().subscription_identifiers, [268_435_455]);
}

#[test]
fn duplicate_property() {
    assert_protocol(&publish_with_props(&[0x01, 0, 0x01, 1]));
    assert_protocol(&connack_with_props(&[0x24, 0, 0x24, 0]));
    // Subscription identifier twice in SUBSCRIBE.
    let body = [&[0, 1, 4, 0x0b, 1, 0x0b, 2][..], &mqtt_str(b"a"), &[0]].concat();
    assert_protocol(&raw(0x82, &body));
}

#[test]
fn repeatable_properties() {
    let up = [&[0x26][..], &mqtt_str(b"k"), &mqtt_str(b"v")].concat();
    let props = [&up[..], &up, &[0x0b, 1, 0x0b, 2]].concat();
    let Ok(Some(Packet::Publish(p))) = dec(&publish_with_props(&props), Protocol::V5) else {
        panic!("repeated user property / subscription identifier in PUBLISH");
    };
    assert_eq!(p.props().user_properties.len(), 2);
    assert_eq!(p.props().subscription_identifiers, [1, 2]);
}

#[test]
fn property_not_allowed_in_packet_is_malformed() {
    // MQTT 5 2.2.2.2: an identifier not valid for the packet type makes it malformed.
    for bytes in [
        connect_with_props(&[0x23, 0, 1]),       // topic alias in CONNECT
        publish_with_props(&[0x11, 0, 0, 0, 1]), // session expiry in PUBLISH
        connack_with_props(&[0x01, 0]),          // payload format in CONNACK
        connect_with_props(&[0x18, 0, 0, 0, 1]), // will delay outside will properties
    ] {
        assert_malformed_v5(&bytes);
    }
}

fn assert_malformed_v5(bytes: &[u8]) {
    let e = dec_err(bytes, Protocol::V5);
    assert!(matches!(e, DecodeError::Malformed(_)), "{bytes:?}: {e:?}");
}

#[test]
fn unknown_property_is_malformed() {
    for id in [0x00, 0x04, 0x2b, 0x7f, 0x80] {
        let e = dec_err(&publish_with_props(&[id, 0]), Protocol::V5);
        assert!(matches!(e, DecodeError::Malformed(_)), "{id:#x}: {e:?}");
    }
}

#[test]
fn will_properties_context() {
    // Will delay in will properties is fine; topic alias is not.
    let will = |props: &[u8]| {
        let rest = [
            &[0u8][..],
            &mqtt_str(b"cid"),
            &[props.len() as u8],
            props,
            &mqtt_str(b"w"),
            &mqtt_str(b"p"),
        ]
        .concat();
        connect_raw(b"MQTT", 5, 0x04, &rest)
    };
    let Ok(Some(Packet::Connect(c))) = dec(&will(&[0x18, 0, 0, 0, 9]), Protocol::V5) else {
        panic!("will delay");
    };
    assert_eq!(c.will.unwrap().properties.will_delay_interval, Some(9));
    assert_malformed_v5(&will(&[0x23, 0, 1]));
}

#[test]
fn v311_connack_return_codes() {
    for code in 0u8..=5 {
        let Ok(Some(Packet::ConnAck(c))) = dec(&[0x20, 2, 0, code], Protocol::V311) else {
            panic!("code {code}");
        };
        assert_eq!(connack_code_v311(c.reason_code), code);
    }
    assert!(matches!(
        dec_err(&[0x20, 2, 0, 6], Protocol::V311),
        DecodeError::Malformed(_)
    ));
    assert!(matches!(
        dec_err(&[0x20, 2, 2, 0], Protocol::V311),
        DecodeError::Malformed(_)
    ));
}

// ---- encode errors ----

#[test]
fn encode_string_too_long() {
    let long = "x".repeat(65_536);
    let p = Packet::Unsubscribe(Unsubscribe {
        pkid: 1,
        filters: vec![long.clone()],
        properties: None,
    });
    let mut out = vec![1, 2, 3];
    assert!(matches!(
        encode(&p, Protocol::V311, &mut out),
        Err(EncodeError::TooLong(_))
    ));
    assert_eq!(out, [1, 2, 3], "nothing written on error");
    let p = Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtMostOnce,
        retain: false,
        topic: Bytes::from(long.clone()),
        pkid: 0,
        properties: None,
        payload: Bytes::new(),
    });
    assert!(encode(&p, Protocol::V5, &mut out).is_err());
    let p = Packet::Disconnect(Disconnect {
        reason_code: 0,
        properties: Some(Box::new(Properties {
            user_properties: vec![(s("k"), long)],
            ..Default::default()
        })),
    });
    assert!(encode(&p, Protocol::V5, &mut out).is_err());
    assert_eq!(out, [1, 2, 3]);
    // 65,535 is fine.
    let p = Packet::Unsubscribe(Unsubscribe {
        pkid: 1,
        filters: vec!["x".repeat(65_535)],
        properties: None,
    });
    roundtrip(&p, Protocol::V311);
}

#[test]
fn encode_packet_too_long() {
    // calloc'd zeroes: the pages are never touched, since encode fails before writing.
    let payload = Bytes::from(vec![0u8; 268_435_456]);
    let p = Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtMostOnce,
        retain: false,
        topic: Bytes::from_static(b"t"),
        pkid: 0,
        properties: None,
        payload,
    });
    let mut out = Vec::new();
    assert!(matches!(
        encode(&p, Protocol::V311, &mut out),
        Err(EncodeError::TooLong(_))
    ));
    assert!(out.is_empty());
}

// ---- proptest ----

mod proptests {
    use super::*;
    use proptest::collection::vec;
    use proptest::option::of;
    use proptest::prelude::*;

    fn string() -> impl Strategy<Value = String> {
        "[^\\x00]{0,6}"
    }

    fn topic() -> impl Strategy<Value = String> {
        "[^\\x00+#]{1,12}"
    }

    fn binary() -> impl Strategy<Value = Bytes> {
        vec(any::<u8>(), 0..8).prop_map(Bytes::from)
    }

    fn qos() -> impl Strategy<Value = QoS> {
        (0u8..3).prop_map(|q| QoS::from_u8(q).unwrap())
    }

    fn flag() -> impl Strategy<Value = Option<u8>> {
        of(0u8..2)
    }

    fn nonzero16() -> impl Strategy<Value = Option<u16>> {
        of(1u16..)
    }

    prop_compose! {
        fn any_props()(
            a in (flag(), of(any::<u32>()), of(string()), of(string()), of(binary()),
                  vec(1u32..=268_435_455, 0..3), of(any::<u32>()), of(string())),
            b in (of(any::<u16>()), of(string()), of(binary()), flag(), of(any::<u32>()),
                  flag(), of(string()), of(string())),
            c in (of(string()), nonzero16(), of(any::<u16>()), nonzero16(), flag(), flag(),
                  vec((string(), string()), 0..3), of(1u32..)),
            d in (flag(), flag(), flag()),
        ) -> Properties {
            Properties {
                payload_format_indicator: a.0,
                message_expiry_interval: a.1,
                content_type: a.2,
                response_topic: a.3,
                correlation_data: a.4,
                subscription_identifiers: a.5,
                session_expiry_interval: a.6,
                assigned_client_identifier: a.7,
                server_keep_alive: b.0,
                authentication_method: b.1,
                authentication_data: b.2,
                request_problem_information: b.3,
                will_delay_interval: b.4,
                request_response_information: b.5,
                response_information: b.6,
                server_reference: b.7,
                reason_string: c.0,
                receive_maximum: c.1,
                topic_alias_maximum: c.2,
                topic_alias: c.3,
                maximum_qos: c.4,
                retain_available: c.5,
                user_properties: c.6,
                maximum_packet_size: c.7,
                wildcard_subscription_available: d.0,
                subscription_identifier_available: d.1,
                shared_subscription_available: d.2,
            }
        }
    }

    /// Keeps only the properties `ctx` (a packet type, 16 = will) may carry.
    fn restrict(p: Properties, ctx: usize, proto: Protocol) -> Properties {
        if proto == Protocol::V311 {
            return Properties::default();
        }
        macro_rules! keep {
            ($($field:ident: $($c:literal)|+;)*) => {
                Properties {
                    $($field: if matches!(ctx, $($c)|+) { p.$field } else { Default::default() },)*
                }
            };
        }
        let mut r = keep! {
            payload_format_indicator: 3 | 16;
            message_expiry_interval: 3 | 16;
            content_type: 3 | 16;
            response_topic: 3 | 16;
            correlation_data: 3 | 16;
            subscription_identifiers: 3 | 8;
            session_expiry_interval: 1 | 2 | 14;
            assigned_client_identifier: 2;
            server_keep_alive: 2;
            authentication_method: 1 | 2 | 15;
            authentication_data: 1 | 2 | 15;
            request_problem_information: 1;
            will_delay_interval: 16;
            request_response_information: 1;
            response_information: 2;
            server_reference: 2 | 14;
            reason_string: 2 | 4 | 5 | 6 | 7 | 9 | 11 | 14 | 15;
            receive_maximum: 1 | 2;
            topic_alias_maximum: 1 | 2;
            topic_alias: 3;
            maximum_qos: 2;
            retain_available: 2;
            user_properties: 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10 | 11 | 14 | 15 | 16;
            maximum_packet_size: 1 | 2;
            wildcard_subscription_available: 2;
            subscription_identifier_available: 2;
            shared_subscription_available: 2;
        };
        if ctx == 8 {
            r.subscription_identifiers.truncate(1);
        }
        r
    }

    fn packet(proto: Protocol) -> impl Strategy<Value = Packet> {
        let v5 = proto == Protocol::V5;
        let props = move |ctx: usize| any_props().prop_map(move |p| restrict(p, ctx, proto));
        let reason = move || {
            if v5 {
                any::<u8>().boxed()
            } else {
                Just(0u8).boxed()
            }
        };
        let pkid = || 1u16..;
        let will = (topic(), binary(), qos(), any::<bool>(), props(16)).prop_map(
            |(topic, payload, qos, retain, properties)| LastWill {
                topic,
                payload,
                qos,
                retain,
                properties,
            },
        );
        let connect = (
            any::<bool>(),
            any::<u16>(),
            string(),
            of(will),
            of(string()),
            of(binary()),
            props(1),
        )
            .prop_map(
                move |(
                    clean_start,
                    keep_alive,
                    client_id,
                    will,
                    username,
                    password,
                    properties,
                )| {
                    // 3.1.1 forbids a password without a user name.
                    let password = if v5 || username.is_some() {
                        password
                    } else {
                        None
                    };
                    Packet::Connect(Box::new(Connect {
                        protocol: proto,
                        clean_start,
                        keep_alive,
                        client_id,
                        will,
                        username,
                        password,
                        properties,
                    }))
                },
            );
        let connack_reason = if v5 {
            any::<u8>().boxed()
        } else {
            prop::sample::select(vec![0u8, 0x84, 0x85, 0x88, 0x86, 0x87]).boxed()
        };
        let connack = (any::<bool>(), connack_reason, props(2)).prop_map(
            |(session_present, reason_code, properties)| {
                Packet::ConnAck(ConnAck {
                    session_present,
                    reason_code,
                    properties: properties.into_boxed(),
                })
            },
        );
        let publish = (
            any::<bool>(),
            qos(),
            any::<bool>(),
            topic(),
            pkid(),
            props(3),
            binary(),
        )
            .prop_map(|(dup, qos, retain, topic, pkid, properties, payload)| {
                let q0 = qos == QoS::AtMostOnce;
                Packet::Publish(Publish {
                    dup: dup && !q0,
                    qos,
                    retain,
                    topic: Bytes::from(topic),
                    pkid: if q0 { 0 } else { pkid },
                    properties: properties.into_boxed(),
                    payload,
                })
            });
        let ack = move |ctx: usize| {
            (pkid(), reason(), props(ctx)).prop_map(|(pkid, reason_code, properties)| Ack {
                pkid,
                reason_code,
                properties: properties.into_boxed(),
            })
        };
        let filter = (string(), qos(), any::<bool>(), any::<bool>(), 0u8..3).prop_map(
            move |(filter, qos, no_local, rap, rh)| SubscribeFilter {
                filter,
                qos,
                no_local: no_local && v5,
                retain_as_published: rap && v5,
                retain_handling: if v5 { rh } else { 0 },
            },
        );
        let subscribe =
            (pkid(), vec(filter, 1..4), props(8)).prop_map(|(pkid, filters, properties)| {
                Packet::Subscribe(Subscribe {
                    pkid,
                    filters,
                    properties: properties.into_boxed(),
                })
            });
        let suback_codes = if v5 {
            vec(any::<u8>(), 0..4).boxed()
        } else {
            vec(prop::sample::select(vec![0u8, 1, 2, 0x80]), 0..4).boxed()
        };
        let suback =
            (pkid(), suback_codes, props(9)).prop_map(|(pkid, reason_codes, properties)| {
                Packet::SubAck(SubAck {
                    pkid,
                    reason_codes,
                    properties: properties.into_boxed(),
                })
            });
        let unsubscribe =
            (pkid(), vec(string(), 1..4), props(10)).prop_map(|(pkid, filters, properties)| {
                Packet::Unsubscribe(Unsubscribe {
                    pkid,
                    filters,
                    properties: properties.into_boxed(),
                })
            });
        let unsuback_codes = if v5 {
            vec(any::<u8>(), 0..4).boxed()
        } else {
            Just(Vec::new()).boxed()
        };
        let unsuback =
            (pkid(), unsuback_codes, props(11)).prop_map(|(pkid, reason_codes, properties)| {
                Packet::UnsubAck(UnsubAck {
                    pkid,
                    reason_codes,
                    properties: properties.into_boxed(),
                })
            });
        let disconnect = (reason(), props(14)).prop_map(|(reason_code, properties)| {
            Packet::Disconnect(Disconnect {
                reason_code,
                properties: properties.into_boxed(),
            })
        });
        let auth = (reason(), props(15)).prop_map(|(reason_code, properties)| {
            Packet::Auth(Auth {
                reason_code,
                properties: properties.into_boxed(),
            })
        });
        let mut choices = vec![
            connect.boxed(),
            connack.boxed(),
            publish.boxed(),
            ack(4).prop_map(Packet::PubAck).boxed(),
            ack(5).prop_map(Packet::PubRec).boxed(),
            ack(6).prop_map(Packet::PubRel).boxed(),
            ack(7).prop_map(Packet::PubComp).boxed(),
            subscribe.boxed(),
            suback.boxed(),
            unsubscribe.boxed(),
            unsuback.boxed(),
            Just(Packet::PingReq).boxed(),
            Just(Packet::PingResp).boxed(),
            disconnect.boxed(),
        ];
        if v5 {
            choices.push(auth.boxed());
        }
        prop::strategy::Union::new(choices)
    }

    fn protocol() -> impl Strategy<Value = Protocol> {
        prop_oneof![Just(Protocol::V311), Just(Protocol::V5)]
    }

    fn stream() -> impl Strategy<Value = (Protocol, Vec<Packet>, usize)> {
        protocol().prop_flat_map(|proto| (Just(proto), vec(packet(proto), 1..6), any::<usize>()))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn roundtrip_any_packet((proto, p) in protocol().prop_flat_map(|pr| (Just(pr), packet(pr)))) {
            roundtrip(&p, proto);
        }

        #[test]
        fn stream_split_anywhere((proto, packets, split) in stream()) {
            let mut bytes = Vec::new();
            for p in &packets {
                encode(p, proto, &mut bytes).unwrap();
            }
            let split = split % (bytes.len() + 1);
            let mut buf = BytesMut::from(&bytes[..split]);
            let mut got = Vec::new();
            drain(&mut buf, proto, &mut got);
            buf.extend_from_slice(&bytes[split..]);
            drain(&mut buf, proto, &mut got);
            prop_assert_eq!(got, packets);
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in vec(any::<u8>(), 0..64), v5 in any::<bool>()) {
            let proto = if v5 { Protocol::V5 } else { Protocol::V311 };
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(p)) = decode(&mut buf, proto, MAX) {
                let mut out = Vec::new();
                encode(&p, proto, &mut out).unwrap();
                let again = decode(&mut BytesMut::from(&out[..]), proto, MAX).unwrap().unwrap();
                prop_assert_eq!(again, p);
            }
        }
    }
}

#[test]
fn encode_publish_from_parts_matches_encode_of_the_same_publish() {
    let base = Properties {
        content_type: Some("text/plain".into()),
        user_properties: vec![("k".into(), "v".into())],
        ..Default::default()
    };
    for protocol in [Protocol::V311, Protocol::V5] {
        for (topic, alias) in [
            (&b"a/b"[..], None),
            (&b"a/b"[..], Some(3)),
            (&b""[..], Some(3)),
        ] {
            if topic.is_empty() && protocol == Protocol::V311 {
                continue; // 3.1.1 has no aliases, so no empty topics
            }
            let mut whole = base.clone();
            whole.message_expiry_interval = Some(42);
            whole.topic_alias = alias;
            whole.subscription_identifiers = vec![1, 300];
            let packet = Packet::Publish(Publish {
                dup: true,
                qos: QoS::AtLeastOnce,
                retain: true,
                topic: Bytes::copy_from_slice(topic),
                pkid: 9,
                properties: whole.into_boxed(),
                payload: Bytes::from_static(b"payload"),
            });
            let mut expected = Vec::new();
            encode(&packet, protocol, &mut expected).unwrap();
            let mut got = Vec::new();
            let parts = PublishOut {
                dup: true,
                qos: QoS::AtLeastOnce,
                retain: true,
                topic,
                pkid: 9,
                properties: Some(&base),
                message_expiry: Some(42),
                topic_alias: alias,
                subscription_ids: &[1, 300],
                payload: b"payload",
            };
            encode_publish(&parts, protocol, &mut got).unwrap();
            // Same packet, though the properties may come in another order.
            let mut a = BytesMut::from(&expected[..]);
            let mut b = BytesMut::from(&got[..]);
            assert_eq!(
                decode(&mut a, protocol, usize::MAX).unwrap(),
                decode(&mut b, protocol, usize::MAX).unwrap()
            );
            assert_eq!(expected.len(), got.len());
        }
    }
}
