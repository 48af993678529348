//! Bytes -> packets. The fixed header is parsed in place; once the whole packet is buffered it
//! is split off as one `Bytes` and every byte field is a slice of it (no copy).

use bytes::{Buf, Bytes, BytesMut};

use super::props::{self, CTX_CONNACK, CTX_CONNECT, CTX_PUBLISH, CTX_SUBACK, CTX_SUBSCRIBE};
use super::props::{CTX_UNSUBACK, CTX_UNSUBSCRIBE, WILL};
use super::*;

type Result<T> = std::result::Result<T, DecodeError>;

const TRUNCATED: DecodeError = DecodeError::Malformed("field runs past the end of the packet");

/// Cursor over `buf[pos..end]`, one packet (or one property block) of a frozen buffer.
pub(super) struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
    end: usize,
}

impl<'a> Reader<'a> {
    #[inline]
    pub(super) fn remaining(&self) -> usize {
        self.end - self.pos
    }

    #[inline]
    fn advance(&mut self, n: usize) -> Result<usize> {
        if self.remaining() < n {
            return Err(TRUNCATED);
        }
        let at = self.pos;
        self.pos += n;
        Ok(at)
    }

    #[inline]
    pub(super) fn u8(&mut self) -> Result<u8> {
        let at = self.advance(1)?;
        Ok(self.buf[at])
    }

    #[inline]
    pub(super) fn u16(&mut self) -> Result<u16> {
        let at = self.advance(2)?;
        Ok(u16::from_be_bytes([self.buf[at], self.buf[at + 1]]))
    }

    #[inline]
    pub(super) fn u32(&mut self) -> Result<u32> {
        let at = self.advance(4)?;
        let b = &self.buf[at..at + 4];
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Variable byte integer: at most 4 bytes, so at most 268,435,455.
    pub(super) fn varint(&mut self) -> Result<u32> {
        let mut v = 0u32;
        for i in 0..4 {
            let b = self.u8()?;
            v |= u32::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError::Malformed(
            "variable byte integer longer than 4 bytes",
        ))
    }

    /// A sub-reader over the next `n` bytes, which this reader skips.
    pub(super) fn take(&mut self, n: usize) -> Result<Reader<'a>> {
        let at = self.advance(n)?;
        Ok(Reader {
            buf: self.buf,
            pos: at,
            end: at + n,
        })
    }

    #[inline]
    fn bytes(&mut self, n: usize) -> Result<Bytes> {
        let at = self.advance(n)?;
        Ok(self.buf.slice(at..at + n))
    }

    /// Binary data: 2-byte length, then the bytes.
    #[inline]
    pub(super) fn binary(&mut self) -> Result<Bytes> {
        let n = self.u16()? as usize;
        self.bytes(n)
    }

    /// A UTF-8 string field as a slice of the packet, validated.
    fn str_slice(&mut self) -> Result<&'a str> {
        let n = self.u16()? as usize;
        let at = self.advance(n)?;
        let buf: &'a Bytes = self.buf;
        check_utf8(&buf[at..at + n])
    }

    /// A topic name (string without wildcards) as a zero-copy `Bytes`.
    #[inline]
    fn topic_name(&mut self) -> Result<Bytes> {
        let n = self.u16()? as usize;
        let at = self.advance(n)?;
        check_topic_name(&self.buf[at..at + n])?;
        Ok(self.buf.slice(at..at + n))
    }

    pub(super) fn string(&mut self) -> Result<String> {
        self.str_slice().map(String::from)
    }

    fn rest(&mut self) -> &'a [u8] {
        let at = self.pos;
        self.pos = self.end;
        let buf: &'a Bytes = self.buf;
        &buf[at..self.end]
    }

    fn finish(&self) -> Result<()> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(DecodeError::Malformed(
                "unexpected bytes at the end of the packet",
            ))
        }
    }
}

/// MQTT strings: valid UTF-8 (which already excludes surrogates) without U+0000.
#[inline]
fn check_utf8(b: &[u8]) -> Result<&str> {
    let s = std::str::from_utf8(b).map_err(|_| DecodeError::Malformed("invalid UTF-8 string"))?;
    if b.contains(&0) {
        return Err(DecodeError::Malformed("U+0000 in a string"));
    }
    Ok(s)
}

/// `check_utf8` and no wildcard, in one pass over the usual all-ASCII name (three otherwise:
/// this runs for every PUBLISH).
#[inline]
fn check_topic_name(b: &[u8]) -> Result<()> {
    // Flags non-ASCII, U+0000, '+' and '#' (0x23 | 8 == 0x2B); no early exit, so it
    // vectorises. Anything flagged takes the full checks, which name the error.
    let mut flagged = false;
    for &c in b {
        flagged |= c.wrapping_sub(1) >= 0x7f || c | 8 == b'+';
    }
    if flagged {
        check_utf8(b)?;
        if has_wildcard(b) {
            return Err(DecodeError::TopicNameInvalid);
        }
    }
    Ok(())
}

/// Rejects a fixed-header first byte whose type or flags no packet can have.
fn check_first_byte(ptype: u8, flags: u8, protocol: Protocol) -> Result<()> {
    match ptype {
        0 => Err(DecodeError::Malformed("reserved packet type 0")),
        15 if protocol == Protocol::V311 => Err(DecodeError::Malformed(
            "reserved packet type 15 in MQTT 3.1.1",
        )),
        3 => match flags >> 1 & 3 {
            3 => Err(DecodeError::Malformed("PUBLISH with QoS 3")),
            0 if flags & 0b1000 != 0 => Err(DecodeError::Malformed("QoS 0 PUBLISH with DUP")),
            _ => Ok(()),
        },
        6 | 8 | 10 if flags != 0b0010 => Err(DecodeError::Malformed("reserved flags must be 0010")),
        6 | 8 | 10 => Ok(()),
        _ if flags != 0 => Err(DecodeError::Malformed("reserved flags must be 0000")),
        _ => Ok(()),
    }
}

pub(super) fn decode(
    buf: &mut BytesMut,
    protocol: Protocol,
    max_packet_size: usize,
) -> Result<Option<Packet>> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    let (ptype, flags) = (first >> 4, first & 0x0f);
    check_first_byte(ptype, flags, protocol)?;

    let mut remaining = 0usize;
    let mut header = 1;
    loop {
        let Some(&b) = buf.get(header) else {
            return Ok(None);
        };
        remaining |= usize::from(b & 0x7f) << (7 * (header - 1));
        header += 1;
        if b & 0x80 == 0 {
            break;
        }
        if header == 5 {
            return Err(DecodeError::Malformed(
                "remaining length longer than 4 bytes",
            ));
        }
    }
    let size = header + remaining;
    if size > max_packet_size {
        return Err(DecodeError::TooLarge { size });
    }
    if buf.len() < size {
        return Ok(None);
    }
    let packet = buf.split_to(size).freeze();
    let v5 = protocol == Protocol::V5;
    if ptype == 3 {
        return Ok(Some(Packet::Publish(publish(packet, header, flags, v5)?)));
    }
    let mut r = Reader {
        buf: &packet,
        pos: header,
        end: size,
    };
    let p = match ptype {
        1 => connect(&mut r)?,
        2 => Packet::ConnAck(connack(&mut r, v5)?),
        4 => Packet::PubAck(ack(&mut r, v5, ptype as usize)?),
        5 => Packet::PubRec(ack(&mut r, v5, ptype as usize)?),
        6 => Packet::PubRel(ack(&mut r, v5, ptype as usize)?),
        7 => Packet::PubComp(ack(&mut r, v5, ptype as usize)?),
        8 => Packet::Subscribe(subscribe(&mut r, v5)?),
        9 => Packet::SubAck(suback(&mut r, v5)?),
        10 => Packet::Unsubscribe(unsubscribe(&mut r, v5)?),
        11 => Packet::UnsubAck(unsuback(&mut r, v5)?),
        12 => {
            r.finish()?;
            Packet::PingReq
        }
        13 => {
            r.finish()?;
            Packet::PingResp
        }
        14 => {
            let (reason_code, properties) = reason_and_props(&mut r, v5, 14)?;
            Packet::Disconnect(Disconnect {
                reason_code,
                properties,
            })
        }
        _ => {
            // 15, only reached in MQTT 5 (check_first_byte).
            let (reason_code, properties) = reason_and_props(&mut r, v5, 15)?;
            Packet::Auth(Auth {
                reason_code,
                properties,
            })
        }
    };
    Ok(Some(p))
}

#[inline]
fn pkid(r: &mut Reader<'_>) -> Result<u16> {
    match r.u16()? {
        0 => Err(DecodeError::Protocol("packet identifier 0")),
        id => Ok(id),
    }
}

/// CONNECT and will properties, which stay inline.
#[inline]
fn props_if(r: &mut Reader<'_>, v5: bool, ctx: usize) -> Result<Properties> {
    if v5 {
        props::read(r, ctx)
    } else {
        Ok(Properties::default())
    }
}

#[inline]
fn boxed_props_if(r: &mut Reader<'_>, v5: bool, ctx: usize) -> Result<Option<Box<Properties>>> {
    if v5 {
        props::read_boxed(r, ctx)
    } else {
        Ok(None)
    }
}

fn has_wildcard(topic: &[u8]) -> bool {
    topic.iter().any(|&b| b == b'+' || b == b'#')
}

fn connect(r: &mut Reader<'_>) -> Result<Packet> {
    // A wrong name is "not MQTT we speak", not a broken stream: the server answers it with a
    // CONNACK (0x01 / 0x84) instead of just closing.
    let name_len = r.u16()? as usize;
    if r.bytes(name_len)?.as_ref() != b"MQTT" {
        return Err(DecodeError::UnsupportedProtocol);
    }
    let protocol = match r.u8()? {
        4 => Protocol::V311,
        5 => Protocol::V5,
        _ => return Err(DecodeError::UnsupportedProtocol),
    };
    let v5 = protocol == Protocol::V5;
    let flags = r.u8()?;
    if flags & 0x01 != 0 {
        return Err(DecodeError::Malformed("reserved CONNECT flag set"));
    }
    let will_flag = flags & 0x04 != 0;
    let will_qos = flags >> 3 & 3;
    let will_retain = flags & 0x20 != 0;
    let has_password = flags & 0x40 != 0;
    let has_username = flags & 0x80 != 0;
    if !will_flag && (will_qos != 0 || will_retain) {
        return Err(DecodeError::Malformed(
            "will QoS or retain without will flag",
        ));
    }
    let Some(will_qos) = QoS::from_u8(will_qos) else {
        return Err(DecodeError::Malformed("will QoS 3"));
    };
    if !v5 && has_password && !has_username {
        return Err(DecodeError::Malformed("password without user name"));
    }
    let keep_alive = r.u16()?;
    let properties = props_if(r, v5, CTX_CONNECT)?;
    let client_id = r.string()?;
    let will = if will_flag {
        let properties = props_if(r, v5, WILL)?;
        let topic = r.string()?;
        if has_wildcard(topic.as_bytes()) {
            return Err(DecodeError::TopicNameInvalid);
        }
        let payload = r.binary()?;
        Some(LastWill {
            topic,
            payload,
            qos: will_qos,
            retain: will_retain,
            properties,
        })
    } else {
        None
    };
    let username = if has_username {
        Some(r.string()?)
    } else {
        None
    };
    let password = if has_password {
        Some(r.binary()?)
    } else {
        None
    };
    r.finish()?;
    Ok(Packet::Connect(Box::new(Connect {
        protocol,
        clean_start: flags & 0x02 != 0,
        keep_alive,
        client_id,
        will,
        username,
        password,
        properties,
    })))
}

/// 3.1.1 CONNACK return codes 0..=5 as MQTT 5 reason codes; `connack_code_v311` maps back.
const V311_CONNACK_TO_V5: [u8; 6] = [0x00, 0x84, 0x85, 0x88, 0x86, 0x87];

fn connack(r: &mut Reader<'_>, v5: bool) -> Result<ConnAck> {
    let ack_flags = r.u8()?;
    if ack_flags & 0xfe != 0 {
        return Err(DecodeError::Malformed("reserved CONNACK flags set"));
    }
    let code = r.u8()?;
    let reason_code = if v5 {
        code
    } else {
        *V311_CONNACK_TO_V5
            .get(code as usize)
            .ok_or(DecodeError::Malformed("reserved CONNACK return code"))?
    };
    let properties = boxed_props_if(r, v5, CTX_CONNACK)?;
    r.finish()?;
    Ok(ConnAck {
        session_present: ack_flags & 1 != 0,
        reason_code,
        properties,
    })
}

/// The hot path. Forced inline: as a call, returning the `Publish` costs a copy and ~5% of
/// the decode time.
#[inline(always)]
fn publish(packet: Bytes, header: usize, flags: u8, v5: bool) -> Result<Publish> {
    let qos = match flags >> 1 & 3 {
        0 => QoS::AtMostOnce,
        1 => QoS::AtLeastOnce,
        _ => QoS::ExactlyOnce, // 3 was rejected with the first byte
    };
    let mut r = Reader {
        buf: &packet,
        pos: header,
        end: packet.len(),
    };
    let topic = r.topic_name()?;
    let pkid = if qos == QoS::AtMostOnce {
        0
    } else {
        pkid(&mut r)?
    };
    let properties = boxed_props_if(&mut r, v5, CTX_PUBLISH)?;
    // An empty topic is only the MQTT 5 "use the topic alias" form; the engine resolves it.
    if topic.is_empty() && properties.as_ref().is_none_or(|p| p.topic_alias.is_none()) {
        return Err(DecodeError::Protocol(
            "empty topic name without topic alias",
        ));
    }
    // The payload is the packet's tail: reuse the packet's own handle instead of slicing
    // (one reference-count increment and decrement less per message).
    let at = r.pos;
    let mut payload = packet;
    payload.advance(at);
    Ok(Publish {
        dup: flags & 0b1000 != 0,
        qos,
        retain: flags & 1 != 0,
        topic,
        pkid,
        properties,
        payload,
    })
}

/// Reason code and properties that MQTT 5 lets a sender leave out at the end of the packet.
fn reason_and_props(
    r: &mut Reader<'_>,
    v5: bool,
    ctx: usize,
) -> Result<(u8, Option<Box<Properties>>)> {
    if !v5 || r.remaining() == 0 {
        r.finish()?;
        return Ok((0, None));
    }
    let reason = r.u8()?;
    let properties = if r.remaining() == 0 {
        None
    } else {
        props::read_boxed(r, ctx)?
    };
    r.finish()?;
    Ok((reason, properties))
}

fn ack(r: &mut Reader<'_>, v5: bool, ctx: usize) -> Result<Ack> {
    let pkid = pkid(r)?;
    let (reason_code, properties) = reason_and_props(r, v5, ctx)?;
    Ok(Ack {
        pkid,
        reason_code,
        properties,
    })
}

fn subscribe(r: &mut Reader<'_>, v5: bool) -> Result<Subscribe> {
    let pkid = pkid(r)?;
    let properties = boxed_props_if(r, v5, CTX_SUBSCRIBE)?;
    let mut filters = Vec::new();
    while r.remaining() > 0 {
        let filter = r.string()?;
        let opts = r.u8()?;
        let reserved = if v5 { 0xc0 } else { 0xfc };
        if opts & reserved != 0 {
            return Err(DecodeError::Malformed(
                "reserved subscription option bits set",
            ));
        }
        let qos = QoS::from_u8(opts & 3).ok_or(DecodeError::Malformed("subscription QoS 3"))?;
        let retain_handling = opts >> 4 & 3;
        if retain_handling == 3 {
            // MQTT 5 3.8.3.1: "a Protocol Error to send a Retain Handling value of 3".
            return Err(DecodeError::Protocol("retain handling 3"));
        }
        filters.push(SubscribeFilter {
            filter,
            qos,
            no_local: opts & 0x04 != 0,
            retain_as_published: opts & 0x08 != 0,
            retain_handling,
        });
    }
    if filters.is_empty() {
        return Err(DecodeError::Protocol("SUBSCRIBE without topic filters"));
    }
    Ok(Subscribe {
        pkid,
        filters,
        properties,
    })
}

fn suback(r: &mut Reader<'_>, v5: bool) -> Result<SubAck> {
    let pkid = pkid(r)?;
    let properties = boxed_props_if(r, v5, CTX_SUBACK)?;
    let reason_codes = r.rest().to_vec();
    // 3.1.1 defines only these; the encoder folds 5.0 failure codes into 0x80 for 3.1.1.
    if !v5 && reason_codes.iter().any(|&c| !matches!(c, 0 | 1 | 2 | 0x80)) {
        return Err(DecodeError::Malformed("reserved SUBACK return code"));
    }
    Ok(SubAck {
        pkid,
        reason_codes,
        properties,
    })
}

fn unsubscribe(r: &mut Reader<'_>, v5: bool) -> Result<Unsubscribe> {
    let pkid = pkid(r)?;
    let properties = boxed_props_if(r, v5, CTX_UNSUBSCRIBE)?;
    let mut filters = Vec::new();
    while r.remaining() > 0 {
        filters.push(r.string()?);
    }
    if filters.is_empty() {
        return Err(DecodeError::Protocol("UNSUBSCRIBE without topic filters"));
    }
    Ok(Unsubscribe {
        pkid,
        filters,
        properties,
    })
}

fn unsuback(r: &mut Reader<'_>, v5: bool) -> Result<UnsubAck> {
    let pkid = pkid(r)?;
    if !v5 {
        r.finish()?;
        return Ok(UnsubAck {
            pkid,
            reason_codes: Vec::new(),
            properties: None,
        });
    }
    let properties = props::read_boxed(r, CTX_UNSUBACK)?;
    Ok(UnsubAck {
        pkid,
        reason_codes: r.rest().to_vec(),
        properties,
    })
}

/// A property block (length prefix included) read on its own: the stored form of a message's
/// or will's properties. `will` selects the will-properties context, else PUBLISH's.
pub(super) fn properties(data: &Bytes, will: bool) -> Result<Properties> {
    let mut r = Reader {
        buf: data,
        pos: 0,
        end: data.len(),
    };
    let ctx = if will { WILL } else { CTX_PUBLISH };
    let p = props::read(&mut r, ctx)?;
    if r.remaining() != 0 {
        return Err(DecodeError::Malformed("bytes after the properties"));
    }
    Ok(p)
}
