//! Session set-up through the project's codec (CONNECT / CONNACK, SUBSCRIBE / SUBACK) and
//! pre-encoding of the PUBLISH packets that the hot loops send unchanged or patch in place.

use std::io::{ErrorKind, Read};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use fastbroker_core::codec::{
    self, Connect, Packet, Properties, Protocol, Publish, QoS, Subscribe, SubscribeFilter,
};

use crate::net;
use crate::scan;
use crate::stream::{self, Stream};

/// Keep alive 0: the broker never times a silent connection out.
pub const KEEP_ALIVE: u16 = 0;
/// DISCONNECT with no reason code: valid for 3.1.1 and 5.0.
pub const DISCONNECT: [u8; 2] = [0xe0, 0x00];

fn qos(q: u8) -> QoS {
    QoS::from_u8(q).unwrap_or(QoS::AtMostOnce)
}

/// Whether a session outlives its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Session {
    /// Clean session (3.1.1) / clean start and session expiry 0 (5.0).
    Clean,
    /// Clean session 0 (3.1.1) / clean start 0 and session expiry 0xFFFFFFFF, never (5.0):
    /// the broker keeps the subscriptions and queues QoS 1/2 messages while it is offline.
    Persistent,
}

pub fn connect_packet(client_id: &str, proto: Protocol) -> Vec<u8> {
    connect_packet_with(client_id, proto, Session::Clean)
}

pub fn connect_packet_with(client_id: &str, proto: Protocol, session: Session) -> Vec<u8> {
    let persistent = session == Session::Persistent;
    let setup = stream::setup();
    let mut out = Vec::new();
    codec::encode(
        &Packet::Connect(Box::new(Connect {
            protocol: proto,
            clean_start: !persistent,
            keep_alive: KEEP_ALIVE,
            client_id: client_id.to_string(),
            will: None,
            username: setup.username.clone(),
            password: setup
                .password
                .as_ref()
                .map(|p| Bytes::copy_from_slice(p.as_bytes())),
            // 5.0: receive maximum and packet size left at their defaults (65,535,
            // unlimited); session expiry 0 unless persistent.
            properties: Properties {
                session_expiry_interval: (persistent && proto == Protocol::V5).then_some(u32::MAX),
                ..Properties::default()
            },
        })),
        proto,
        &mut out,
    )
    .expect("CONNECT encodes");
    out
}

pub fn subscribe_packet(pkid: u16, filters: &[(String, u8)], proto: Protocol) -> Vec<u8> {
    let mut out = Vec::new();
    codec::encode(
        &Packet::Subscribe(Subscribe {
            pkid,
            filters: filters
                .iter()
                .map(|(f, q)| SubscribeFilter {
                    filter: f.clone(),
                    qos: qos(*q),
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: 0,
                })
                .collect(),
            properties: None,
        }),
        proto,
        &mut out,
    )
    .expect("SUBSCRIBE encodes");
    out
}

/// One encoded PUBLISH and where to patch it: `pkid_at` (QoS > 0) and `payload_at`.
pub struct PublishTemplate {
    pub bytes: Vec<u8>,
    pub pkid_at: Option<usize>,
    pub payload_at: usize,
}

pub fn publish_template(
    topic: &str,
    q: u8,
    payload: &[u8],
    proto: Protocol,
) -> Result<PublishTemplate, String> {
    let mut bytes = Vec::new();
    codec::encode(
        &Packet::Publish(Publish {
            dup: false,
            qos: qos(q),
            retain: false,
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            pkid: if q > 0 { 1 } else { 0 },
            properties: None,
            payload: Bytes::copy_from_slice(payload),
        }),
        proto,
        &mut bytes,
    )
    .map_err(|e| format!("cannot encode PUBLISH: {e:?}"))?;
    let (_, _, hlen) = scan::fixed_header(&bytes)
        .ok()
        .flatten()
        .expect("own PUBLISH has a header");
    let pkid_at = (q > 0).then_some(hlen + 2 + topic.len());
    let payload_at = bytes.len() - payload.len();
    Ok(PublishTemplate {
        bytes,
        pkid_at,
        payload_at,
    })
}

/// The message for a CONNACK that refuses: `code` as on the wire (3.1.1 return code or 5.0
/// reason code).
pub fn refusal(client_id: &str, proto: Protocol, code: u8, reason: Option<String>) -> String {
    let why = reason.map(|r| format!(", {r:?}")).unwrap_or_default();
    match proto {
        Protocol::V5 => format!(
            "broker refused the connection of {client_id:?}: CONNACK reason code 0x{code:02x}{why}"
        ),
        Protocol::V311 => {
            let name = match code {
                1 => "unacceptable protocol version",
                2 => "identifier rejected",
                3 => "server unavailable",
                4 => "bad user name or password",
                5 => "not authorized",
                _ => "reserved",
            };
            format!(
                "broker refused the connection of {client_id:?}: CONNACK return code {code} ({name}){why}"
            )
        }
    }
}

/// Verdict on a CONNACK at the front of `buf` without decoding it whole: `None` until the
/// fixed header and the first two body bytes (flags, code) are there.
pub fn connack_verdict(buf: &[u8], proto: Protocol, client_id: &str) -> Option<Result<(), String>> {
    match scan::fixed_header(buf) {
        Ok(None) => None,
        Err(e) => Some(Err(format!("malformed reply to CONNECT: {e}"))),
        Ok(Some((first, len, hlen))) => {
            if first != 0x20 || len < 2 {
                return Some(Err(format!(
                    "expected CONNACK, broker sent packet type {} (length {len})",
                    first >> 4
                )));
            }
            let code = *buf.get(hlen + 1)?;
            Some(if code == 0 {
                Ok(())
            } else {
                Err(refusal(client_id, proto, code, None))
            })
        }
    }
}

/// A connected MQTT client before the hot loop takes its socket over.
pub struct Client {
    pub stream: Stream,
    /// Bytes read past the last set-up packet (to be fed to the hot loop's scanner).
    pub pending: BytesMut,
    pub proto: Protocol,
    /// MQTT 5 CONNACK Receive Maximum: QoS 1 publishes the broker accepts unacknowledged.
    pub receive_maximum: Option<u16>,
    /// CONNACK Session Present: the broker resumed a stored session.
    pub session_present: bool,
}

/// TCP connect (optionally from `src`), CONNECT with a clean session, wait for a successful
/// CONNACK.
pub fn open(
    addr: SocketAddr,
    src: Option<Ipv4Addr>,
    client_id: &str,
    proto: Protocol,
    timeout: Duration,
) -> Result<Client, String> {
    open_with(addr, src, client_id, proto, Session::Clean, timeout)
}

/// [`open`] with a choice of session.
pub fn open_with(
    addr: SocketAddr,
    src: Option<Ipv4Addr>,
    client_id: &str,
    proto: Protocol,
    session: Session,
    timeout: Duration,
) -> Result<Client, String> {
    let deadline = Instant::now() + timeout;
    let tcp = net::connect(addr, src, timeout).map_err(|e| match src {
        Some(src) => format!("TCP connect to {addr} from {src} failed: {e}"),
        None => format!("TCP connect to {addr} failed: {e}"),
    })?;
    let mut stream = stream::wrap(tcp, deadline)?;
    stream
        .set_write_timeout(Some(timeout))
        .and_then(|_| {
            std::io::Write::write_all(&mut stream, &connect_packet_with(client_id, proto, session))
        })
        .and_then(|_| std::io::Write::flush(&mut stream))
        .map_err(|e| format!("sending CONNECT failed: {e}"))?;
    let mut c = Client {
        stream,
        pending: BytesMut::with_capacity(64),
        proto,
        receive_maximum: None,
        session_present: false,
    };
    match c.read_packet(deadline, "CONNACK")? {
        Packet::ConnAck(ack) if ack.reason_code == 0 => {
            c.receive_maximum = ack.properties.as_ref().and_then(|p| p.receive_maximum);
            c.session_present = ack.session_present;
            Ok(c)
        }
        Packet::ConnAck(ack) => {
            let wire = match proto {
                Protocol::V5 => ack.reason_code,
                Protocol::V311 => codec::connack_code_v311(ack.reason_code),
            };
            Err(refusal(
                client_id,
                proto,
                wire,
                ack.properties.and_then(|p| p.reason_string),
            ))
        }
        other => Err(format!(
            "expected CONNACK, broker sent packet type {}",
            other.type_code()
        )),
    }
}

impl Client {
    /// SUBSCRIBE and wait for its SUBACK; every filter must be granted.
    pub fn subscribe(&mut self, filters: &[(String, u8)], timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let pkid = 1;
        self.stream
            .set_write_timeout(Some(timeout))
            .and_then(|_| {
                std::io::Write::write_all(
                    &mut self.stream,
                    &subscribe_packet(pkid, filters, self.proto),
                )
            })
            .and_then(|_| std::io::Write::flush(&mut self.stream))
            .map_err(|e| format!("sending SUBSCRIBE failed: {e}"))?;
        loop {
            match self.read_packet(deadline, "SUBACK")? {
                Packet::SubAck(ack) if ack.pkid == pkid => {
                    if ack.reason_codes.len() != filters.len() {
                        return Err("SUBACK has the wrong number of return codes".into());
                    }
                    for ((f, q), &code) in filters.iter().zip(&ack.reason_codes) {
                        if code >= 0x80 {
                            return Err(format!(
                                "broker refused the subscription to {f:?}: SUBACK code 0x{code:02x}"
                            ));
                        }
                        if code < *q {
                            eprintln!(
                                "fastbroker-loadgen: warning: {f:?} granted QoS {code}, asked {q}"
                            );
                        }
                    }
                    return Ok(());
                }
                // Anything else before the SUBACK (a retained message...) is skipped.
                _ => continue,
            }
        }
    }

    /// Reads until the codec yields one whole packet, or the deadline passes.
    fn read_packet(&mut self, deadline: Instant, what: &str) -> Result<Packet, String> {
        let mut tmp = [0u8; 4096];
        loop {
            match codec::decode(&mut self.pending, self.proto, 1 << 28) {
                Ok(Some(p)) => return Ok(p),
                Ok(None) => {}
                Err(e) => return Err(format!("malformed packet while waiting for {what}: {e:?}")),
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("timed out waiting for {what}"));
            }
            self.stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .map_err(|e| e.to_string())?;
            match self.stream.read(&mut tmp) {
                Ok(0) => return Err(format!("broker closed the connection before {what}")),
                Ok(n) => self.pending.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if net::is_timeout(&e) => {}
                Err(e) => return Err(format!("read failed while waiting for {what}: {e}")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connack_verdicts() {
        let v = |b: &[u8], p| connack_verdict(b, p, "c");
        assert_eq!(v(&[], Protocol::V311), None);
        assert_eq!(v(&[0x20, 0x02, 0x00], Protocol::V311), None);
        assert_eq!(v(&[0x20, 0x02, 0x00, 0x00], Protocol::V311), Some(Ok(())));
        // 5.0 with properties: only the code matters.
        assert_eq!(
            v(
                &[0x20, 0x06, 0x00, 0x00, 0x03, 0x21, 0x00, 0x14],
                Protocol::V5
            ),
            Some(Ok(()))
        );
        let e = v(&[0x20, 0x02, 0x00, 0x05], Protocol::V311)
            .unwrap()
            .unwrap_err();
        assert!(e.contains("return code 5 (not authorized)"), "{e}");
        let e = v(&[0x20, 0x03, 0x00, 0x87, 0x00], Protocol::V5)
            .unwrap()
            .unwrap_err();
        assert!(e.contains("reason code 0x87"), "{e}");
        assert!(v(&[0xd0, 0x00], Protocol::V311).unwrap().is_err());
    }

    #[test]
    fn persistent_connect_keeps_the_session() {
        for proto in [Protocol::V311, Protocol::V5] {
            for (session, clean, expiry) in [
                (Session::Clean, true, None),
                (Session::Persistent, false, Some(u32::MAX)),
            ] {
                let mut buf = BytesMut::from(&connect_packet_with("sub-1", proto, session)[..]);
                match codec::decode(&mut buf, proto, 1 << 20).unwrap().unwrap() {
                    Packet::Connect(c) => {
                        assert_eq!((c.client_id.as_str(), c.clean_start), ("sub-1", clean));
                        let want = if proto == Protocol::V5 { expiry } else { None };
                        assert_eq!(c.properties.session_expiry_interval, want);
                    }
                    p => panic!("{p:?}"),
                }
            }
        }
    }

    #[test]
    fn template_offsets_point_at_pkid_and_payload() {
        for proto in [Protocol::V311, Protocol::V5] {
            let payload = [9u8; 300];
            let mut t = publish_template("bench/in/03", 1, &payload, proto).unwrap();
            let at = t.pkid_at.unwrap();
            t.bytes[at..at + 2].copy_from_slice(&513u16.to_be_bytes());
            t.bytes[t.payload_at..t.payload_at + 8].copy_from_slice(&77u64.to_le_bytes());
            let mut buf = BytesMut::from(&t.bytes[..]);
            match codec::decode(&mut buf, proto, 1 << 20).unwrap().unwrap() {
                Packet::Publish(p) => {
                    assert_eq!(p.pkid, 513);
                    assert_eq!(&p.topic[..], b"bench/in/03");
                    assert_eq!(u64::from_le_bytes(p.payload[..8].try_into().unwrap()), 77);
                    assert_eq!(p.payload.len(), 300);
                }
                p => panic!("{p:?}"),
            }
            let t0 = publish_template("x", 0, &payload, proto).unwrap();
            assert_eq!(t0.pkid_at, None);
            assert_eq!(t0.bytes.len() - t0.payload_at, 300);
        }
    }
}
