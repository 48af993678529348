//! The receive hot path: MQTT fixed headers parsed by hand, bodies skipped.
//!
//! A [`Scanner`] is fed whatever a `read` returned, in any split, and calls back once per
//! complete packet with the first byte (type and flags), the remaining length and the first
//! [`PEEK`] bytes of the body (fewer if the body is shorter). That is enough for the fields a
//! load generator looks at (packet id of a PUBLISH or PUBACK, the send timestamp at the start
//! of a payload). Nothing is allocated: a body that arrives whole in one read is handed over
//! as a slice of the read buffer; one split across reads has only its first `PEEK` bytes
//! copied into a fixed array, and the rest is skipped by arithmetic.

/// How many body bytes a callback sees at most.
pub const PEEK: usize = 128;

pub const PUBLISH: u8 = 3;
pub const PUBACK: u8 = 4;
#[cfg(test)]
pub const PINGRESP: u8 = 13;
pub const DISCONNECT: u8 = 14;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanError {
    /// A remaining length longer than four bytes: the stream is out of step.
    BadLength,
    /// Packet type 0 (reserved): the stream is out of step.
    BadType,
}

impl std::fmt::Display for ScanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScanError::BadLength => f.write_str("malformed remaining length"),
            ScanError::BadType => f.write_str("reserved packet type 0"),
        }
    }
}

/// The fixed header at the front of `buf`: `(first byte, remaining length, header length)`,
/// or `None` if it has not all arrived.
#[inline]
pub fn fixed_header(buf: &[u8]) -> Result<Option<(u8, usize, usize)>, ScanError> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    if first >> 4 == 0 {
        return Err(ScanError::BadType);
    }
    let mut len = 0usize;
    for i in 1..5 {
        let Some(&b) = buf.get(i) else {
            return Ok(None);
        };
        len |= usize::from(b & 0x7f) << (7 * (i - 1));
        if b & 0x80 == 0 {
            return Ok(Some((first, len, i + 1)));
        }
    }
    Err(ScanError::BadLength)
}

/// Incremental packet splitter; see the module doc.
pub struct Scanner {
    /// A fixed header split across reads.
    hdr: [u8; 5],
    hdr_len: usize,
    /// A body split across reads: its first byte, length, bytes still to skip, first bytes.
    in_body: bool,
    first: u8,
    body_len: usize,
    remaining: usize,
    peek: [u8; PEEK],
    peek_len: usize,
}

impl Default for Scanner {
    fn default() -> Self {
        Self::new()
    }
}

impl Scanner {
    pub fn new() -> Self {
        Scanner {
            hdr: [0; 5],
            hdr_len: 0,
            in_body: false,
            first: 0,
            body_len: 0,
            remaining: 0,
            peek: [0; PEEK],
            peek_len: 0,
        }
    }

    /// Whether the stream stopped exactly on a packet boundary.
    #[cfg(test)]
    pub fn at_boundary(&self) -> bool {
        !self.in_body && self.hdr_len == 0
    }

    /// Feeds the next bytes of the stream; calls `on_packet(first_byte, remaining_length,
    /// body_prefix)` for every packet completed by them, in order.
    #[inline]
    pub fn feed<F: FnMut(u8, usize, &[u8])>(
        &mut self,
        data: &[u8],
        mut on_packet: F,
    ) -> Result<(), ScanError> {
        let mut i = 0;
        if self.in_body {
            i = self.continue_body(data, &mut on_packet);
            if self.in_body {
                return Ok(());
            }
        }
        if self.hdr_len > 0 {
            // Complete the pending header one byte at a time (at most four more).
            loop {
                let Some(&b) = data.get(i) else {
                    return Ok(());
                };
                self.hdr[self.hdr_len] = b;
                self.hdr_len += 1;
                i += 1;
                if let Some((first, len, _)) = fixed_header(&self.hdr[..self.hdr_len])? {
                    self.hdr_len = 0;
                    i = self.start_body(first, len, data, i, &mut on_packet);
                    if self.in_body {
                        return Ok(());
                    }
                    break;
                }
            }
        }
        // Fast path: headers and bodies inside `data`.
        while i < data.len() {
            match fixed_header(&data[i..])? {
                Some((first, len, hlen)) => {
                    let body = i + hlen;
                    if data.len() - body >= len {
                        on_packet(first, len, &data[body..body + len.min(PEEK)]);
                        i = body + len;
                    } else {
                        self.start_body(first, len, data, body, &mut on_packet);
                        return Ok(());
                    }
                }
                None => {
                    let rest = &data[i..];
                    self.hdr[..rest.len()].copy_from_slice(rest);
                    self.hdr_len = rest.len();
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// A header ended at `data[i]`: hands the packet over if its body is all there, else
    /// keeps its prefix and how much is left. Returns where the next packet starts.
    #[inline]
    fn start_body<F: FnMut(u8, usize, &[u8])>(
        &mut self,
        first: u8,
        len: usize,
        data: &[u8],
        i: usize,
        on_packet: &mut F,
    ) -> usize {
        let avail = data.len() - i;
        if avail >= len {
            on_packet(first, len, &data[i..i + len.min(PEEK)]);
            return i + len;
        }
        let p = avail.min(PEEK);
        self.peek[..p].copy_from_slice(&data[i..i + p]);
        self.peek_len = p;
        self.first = first;
        self.body_len = len;
        self.remaining = len - avail;
        self.in_body = true;
        data.len()
    }

    /// Continues a split body with the front of `data`; returns how many bytes it took.
    #[inline]
    fn continue_body<F: FnMut(u8, usize, &[u8])>(
        &mut self,
        data: &[u8],
        on_packet: &mut F,
    ) -> usize {
        let take = self.remaining.min(data.len());
        let want = self.body_len.min(PEEK) - self.peek_len;
        let p = want.min(take);
        self.peek[self.peek_len..self.peek_len + p].copy_from_slice(&data[..p]);
        self.peek_len += p;
        self.remaining -= take;
        if self.remaining == 0 {
            self.in_body = false;
            on_packet(self.first, self.body_len, &self.peek[..self.peek_len]);
        }
        take
    }
}

#[inline]
fn varint(buf: &[u8]) -> Option<(usize, usize)> {
    let mut v = 0usize;
    for (i, &b) in buf.iter().take(4).enumerate() {
        v |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// Offset of the payload in a PUBLISH body (after topic, packet id and, in MQTT 5, the
/// properties), if the prefix reaches that far.
#[inline]
pub fn publish_payload_offset(first: u8, body: &[u8], v5: bool) -> Option<usize> {
    let topic_len = usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]));
    let mut off = 2 + topic_len + if first & 0x06 != 0 { 2 } else { 0 };
    if v5 {
        let (props, n) = varint(body.get(off..)?)?;
        off += n + props;
    }
    Some(off)
}

/// Packet id of a QoS 1/2 PUBLISH, if the prefix reaches it.
#[inline]
pub fn publish_pkid(first: u8, body: &[u8]) -> Option<u16> {
    if first & 0x06 == 0 {
        return None;
    }
    let topic_len = usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]));
    Some(u16::from_be_bytes([
        *body.get(2 + topic_len)?,
        *body.get(3 + topic_len)?,
    ]))
}

/// The little-endian u64 at the start of a PUBLISH payload (the latency scenario's send
/// time), if the prefix reaches it.
#[inline]
pub fn publish_stamp(first: u8, body: &[u8], v5: bool) -> Option<u64> {
    let off = publish_payload_offset(first, body, v5)?;
    let b = body.get(off..off + 8)?;
    Some(u64::from_le_bytes(b.try_into().ok()?))
}

/// Packet id of a PUBACK / PUBREC / PUBREL / PUBCOMP / SUBACK / UNSUBACK body.
#[inline]
pub fn ack_pkid(body: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes([*body.first()?, *body.get(1)?]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbroker_core::codec::{self, Ack, Packet, Protocol, Publish, QoS};

    fn publish(topic: &str, qos: QoS, pkid: u16, payload: &[u8], proto: Protocol) -> Vec<u8> {
        let mut out = Vec::new();
        codec::encode(
            &Packet::Publish(Publish {
                dup: false,
                qos,
                retain: false,
                topic: bytes::Bytes::copy_from_slice(topic.as_bytes()),
                pkid,
                properties: None,
                payload: bytes::Bytes::copy_from_slice(payload),
            }),
            proto,
            &mut out,
        )
        .unwrap();
        out
    }

    fn puback(pkid: u16) -> Vec<u8> {
        let mut out = Vec::new();
        codec::encode(
            &Packet::PubAck(Ack {
                pkid,
                reason_code: 0,
                properties: None,
            }),
            Protocol::V311,
            &mut out,
        )
        .unwrap();
        out
    }

    /// (type, remaining length, pkid if QoS>0 or ack, stamp if present) per packet.
    type Seen = Vec<(u8, usize, Option<u16>, Option<u64>)>;

    fn scan_in_chunks(stream: &[u8], chunk: usize, v5: bool) -> Seen {
        let mut s = Scanner::new();
        let mut seen = Vec::new();
        for part in stream.chunks(chunk) {
            s.feed(part, |first, len, body| {
                let t = first >> 4;
                let (pkid, stamp) = match t {
                    PUBLISH => (publish_pkid(first, body), publish_stamp(first, body, v5)),
                    PUBACK => (ack_pkid(body), None),
                    _ => (None, None),
                };
                seen.push((t, len, pkid, stamp));
            })
            .unwrap();
        }
        assert!(s.at_boundary());
        seen
    }

    #[test]
    fn fixed_header_lengths() {
        assert_eq!(fixed_header(&[]), Ok(None));
        assert_eq!(fixed_header(&[0x30]), Ok(None));
        assert_eq!(fixed_header(&[0x30, 0x00]), Ok(Some((0x30, 0, 2))));
        assert_eq!(fixed_header(&[0x30, 0x7f]), Ok(Some((0x30, 127, 2))));
        assert_eq!(fixed_header(&[0x30, 0x80]), Ok(None));
        assert_eq!(fixed_header(&[0x30, 0x80, 0x01]), Ok(Some((0x30, 128, 3))));
        assert_eq!(
            fixed_header(&[0x30, 0xff, 0xff, 0xff, 0x7f]),
            Ok(Some((0x30, 268_435_455, 5)))
        );
        assert_eq!(
            fixed_header(&[0x30, 0xff, 0xff, 0xff, 0xff]),
            Err(ScanError::BadLength)
        );
        assert_eq!(fixed_header(&[0x00, 0x00]), Err(ScanError::BadType));
    }

    #[test]
    fn every_split_gives_the_same_packets() {
        let stamp = 0x0102_0304_0506_0708u64;
        let mut payload = stamp.to_le_bytes().to_vec();
        payload.resize(300, 0xab); // two-byte remaining length
        let big = vec![7u8; 20_000]; // three-byte remaining length, longer than PEEK
        for proto in [Protocol::V311, Protocol::V5] {
            let v5 = proto == Protocol::V5;
            let mut stream = Vec::new();
            stream.extend(publish("bench/in/00", QoS::AtMostOnce, 0, &payload, proto));
            stream.extend(publish("a", QoS::AtLeastOnce, 4242, &payload, proto));
            stream.extend(puback(7));
            stream.extend([0xd0, 0x00]); // PINGRESP, empty body
            stream.extend(publish("bench/tp", QoS::AtLeastOnce, 65535, &big, proto));
            stream.extend(publish(
                "x",
                QoS::AtMostOnce,
                0,
                &stamp.to_le_bytes(),
                proto,
            ));
            let whole = scan_in_chunks(&stream, stream.len(), v5);
            assert_eq!(whole.len(), 6);
            assert_eq!(whole[0].0, PUBLISH);
            assert_eq!(whole[0].2, None);
            assert_eq!(whole[0].3, Some(stamp));
            assert_eq!(whole[1].2, Some(4242));
            assert_eq!(whole[1].3, Some(stamp));
            assert_eq!(whole[2], (PUBACK, 2, Some(7), None));
            assert_eq!(whole[3], (PINGRESP, 0, None, None));
            assert_eq!(whole[4].2, Some(65535));
            assert_eq!(whole[4].3, Some(0x0707_0707_0707_0707));
            assert_eq!(whole[5].3, Some(stamp));
            for chunk in [1, 2, 3, 4, 5, 7, 64, 127, 128, 129, 1000, 4096] {
                assert_eq!(scan_in_chunks(&stream, chunk, v5), whole, "chunk {chunk}");
            }
        }
    }

    #[test]
    fn counts_a_flood_without_losing_step() {
        let one = publish(
            "bench/in/07",
            QoS::AtMostOnce,
            0,
            &[0u8; 64],
            Protocol::V311,
        );
        let stream: Vec<u8> = one
            .iter()
            .copied()
            .cycle()
            .take(one.len() * 10_000)
            .collect();
        for chunk in [1, 13, 79, 80, 65536, 262_144] {
            let mut s = Scanner::new();
            let mut n = 0u64;
            let mut bytes = 0usize;
            for part in stream.chunks(chunk) {
                s.feed(part, |first, len, _| {
                    assert_eq!(first, 0x30);
                    n += 1;
                    bytes += len;
                })
                .unwrap();
            }
            assert_eq!(n, 10_000, "chunk {chunk}");
            assert_eq!(bytes, (one.len() - 2) * 10_000);
            assert!(s.at_boundary());
        }
    }

    #[test]
    fn partial_packet_is_not_counted() {
        let one = publish("t", QoS::AtMostOnce, 0, &[1u8; 10], Protocol::V311);
        let mut s = Scanner::new();
        let mut n = 0;
        s.feed(&one[..one.len() - 1], |_, _, _| n += 1).unwrap();
        assert_eq!(n, 0);
        assert!(!s.at_boundary());
        s.feed(&one[one.len() - 1..], |_, _, _| n += 1).unwrap();
        assert_eq!(n, 1);
        assert!(s.at_boundary());
    }

    #[test]
    fn garbage_is_an_error() {
        let mut s = Scanner::new();
        assert_eq!(
            s.feed(&[0x30, 0x80, 0x80, 0x80, 0x80, 0x01], |_, _, _| {}),
            Err(ScanError::BadLength)
        );
        let mut s = Scanner::new();
        assert_eq!(
            s.feed(&[0x30, 0x00, 0x00], |_, _, _| {}),
            Err(ScanError::BadType)
        );
        // The bad length split across reads is caught too.
        let mut s = Scanner::new();
        s.feed(&[0x30, 0x80, 0x80], |_, _, _| {}).unwrap();
        assert_eq!(
            s.feed(&[0x80, 0x80], |_, _, _| {}),
            Err(ScanError::BadLength)
        );
    }

    #[test]
    fn field_helpers_refuse_short_prefixes() {
        assert_eq!(publish_pkid(0x32, &[0, 5, b'a']), None);
        assert_eq!(publish_stamp(0x30, &[0, 1, b'a', 1, 2, 3], false), None);
        assert_eq!(ack_pkid(&[1]), None);
        assert_eq!(publish_pkid(0x30, &[0, 1, b'a', 0, 9]), None); // QoS 0 has none
    }
}
