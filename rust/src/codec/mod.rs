//! Sans-I/O MQTT 3.1.1 / 5.0 codec: bytes in, packets out (or "need more bytes"); packets in,
//! bytes out. No sockets, no clocks, no broker state.
//!
//! `decode.rs` and `encode.rs` hold the two directions, `props.rs` the MQTT 5 properties
//! (identifiers, which packet types may carry which, value checks, wire form).

mod decode;
mod encode;
pub mod packet;
mod props;
#[cfg(test)]
mod tests;

pub use packet::*;

use bytes::BytesMut;

/// Why the byte stream could not be decoded. `reason_code()` is the MQTT 5 reason code a server
/// puts in its DISCONNECT (or CONNACK, for a bad CONNECT) before closing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// 0x81: bad remaining length, reserved flag bits, truncated or overlong fields, invalid
    /// UTF-8 or U+0000 in a string, QoS 3, unknown packet type, a property not allowed in
    /// the packet type...
    Malformed(&'static str),
    /// 0x82: duplicate property, packet id 0,
    /// a packet type the receiver must never get...
    Protocol(&'static str),
    /// 0x95: the fixed header announces a packet larger than the allowed maximum.
    TooLarge { size: usize },
    /// CONNECT with an unknown protocol name or level (CONNACK 0x84 in 5.0, 0x01 in 3.1.1).
    UnsupportedProtocol,
    /// 0x90: PUBLISH topic name with a wildcard.
    TopicNameInvalid,
}

impl DecodeError {
    pub fn reason_code(&self) -> u8 {
        match self {
            DecodeError::Malformed(_) => 0x81,
            DecodeError::Protocol(_) => 0x82,
            DecodeError::TooLarge { .. } => 0x95,
            DecodeError::UnsupportedProtocol => 0x84,
            DecodeError::TopicNameInvalid => 0x90,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EncodeError {
    /// A string or binary field longer than 65,535 bytes, or a packet longer than the
    /// largest remaining length (268,435,455).
    TooLong(&'static str),
}

/// Decodes one packet from the front of `buf`.
///
/// - `Ok(Some(p))`: a whole packet was there; its bytes are removed from `buf`. Byte fields
///   (payload, topic, binary properties) share `buf`'s allocation instead of copying.
/// - `Ok(None)`: need more bytes; `buf` is left as it was.
/// - `Err(e)`: the stream is broken; the caller closes the connection.
///
/// `protocol` is the connection's negotiated version (a CONNECT carries its own and ignores
/// it). `max_packet_size` bounds the whole packet (fixed header included) and is checked as
/// soon as the fixed header is complete, before the body has arrived.
pub fn decode(
    buf: &mut BytesMut,
    protocol: Protocol,
    max_packet_size: usize,
) -> Result<Option<Packet>, DecodeError> {
    decode::decode(buf, protocol, max_packet_size)
}

/// Appends `p` as an MQTT 5 property block (length prefix included): how stored records keep
/// a message's or will's properties. `decode_properties` reads it back.
pub fn encode_properties(p: &Properties, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    let body = props::body_len(p)?;
    props::write(Some(p), body, out);
    Ok(())
}

/// Reads a block written by `encode_properties`, checked as PUBLISH (or will) properties.
pub fn decode_properties(data: &[u8], will: bool) -> Result<Properties, DecodeError> {
    decode::properties(&bytes::Bytes::copy_from_slice(data), will)
}

/// Appends the encoding of `packet` for `protocol` to `out`. Properties are written only for
/// MQTT 5. A CONNACK's 5.0 reason code is mapped to the 3.1.1 return code for 3.1.1.
///
/// A CONNECT is written with its own `protocol` field. A QoS 0 PUBLISH never carries DUP. In
/// 3.1.1, SUBACK codes >= 0x80 become 0x80 and ack/DISCONNECT reason codes are dropped. MQTT 5
/// acks, DISCONNECT and AUTH use the short forms when the reason code is 0 and there are no
/// properties. On error nothing is appended.
pub fn encode(packet: &Packet, protocol: Protocol, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    encode::encode(packet, protocol, out)
}

/// A PUBLISH to encode from borrowed parts: a broker sends one message to many subscribers,
/// each with its own packet id, alias, remaining expiry and subscription identifiers, without
/// building a `Publish` (and cloning its properties) for each.
pub struct PublishOut<'a> {
    pub dup: bool,
    pub qos: QoS,
    pub retain: bool,
    /// Empty when `topic_alias` stands in for a topic the receiver already knows.
    pub topic: &'a [u8],
    pub pkid: u16,
    /// Properties forwarded as they are; must not hold the three per-delivery ones below.
    pub properties: Option<&'a Properties>,
    pub message_expiry: Option<u32>,
    pub topic_alias: Option<u16>,
    pub subscription_ids: &'a [u32],
    pub payload: &'a [u8],
}

/// Appends a PUBLISH built from parts; properties are written only for MQTT 5. Encodes the
/// same bytes as `encode` of the equivalent `Publish`.
pub fn encode_publish(
    p: &PublishOut<'_>,
    protocol: Protocol,
    out: &mut Vec<u8>,
) -> Result<(), EncodeError> {
    encode::publish_out(p, protocol == Protocol::V5, out)
}

/// The protocol level of a CONNECT at the front of `buf`, if that much of it has arrived: a
/// server answers a CONNECT it cannot decode in the client's own protocol version.
pub fn connect_level(buf: &[u8]) -> Option<u8> {
    if buf.first()? >> 4 != 1 {
        return None;
    }
    let mut i = 1;
    loop {
        let b = *buf.get(i)?;
        i += 1;
        if b & 0x80 == 0 {
            break;
        }
        if i == 5 {
            return None;
        }
    }
    let name_len = usize::from(u16::from_be_bytes([*buf.get(i)?, *buf.get(i + 1)?]));
    buf.get(i + 2 + name_len).copied()
}

/// Maps an MQTT 5 CONNACK reason code to the nearest MQTT 3.1.1 return code (0..5).
pub fn connack_code_v311(reason_v5: u8) -> u8 {
    match reason_v5 {
        0x00 => 0,
        0x84 => 1,               // unsupported protocol version
        0x85 => 2,               // client identifier not valid
        0x88 | 0x89 | 0x97 => 3, // server unavailable / busy / quota
        0x86 => 4,               // bad user name or password
        _ => 5,                  // not authorized, banned and the rest
    }
}
