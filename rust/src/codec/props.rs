//! MQTT 5 properties: identifiers, which packet types may carry which, duplicate rules, value
//! checks, and the wire form both ways.

use super::decode::Reader;
use super::encode::{binary_len, put_binary, put_str, put_varint, str_len, varint_len, MAX_VARINT};
use super::{DecodeError, EncodeError, Properties};

pub(super) const PAYLOAD_FORMAT_INDICATOR: u8 = 0x01;
pub(super) const MESSAGE_EXPIRY_INTERVAL: u8 = 0x02;
pub(super) const CONTENT_TYPE: u8 = 0x03;
pub(super) const RESPONSE_TOPIC: u8 = 0x08;
pub(super) const CORRELATION_DATA: u8 = 0x09;
pub(super) const SUBSCRIPTION_IDENTIFIER: u8 = 0x0B;
pub(super) const SESSION_EXPIRY_INTERVAL: u8 = 0x11;
pub(super) const ASSIGNED_CLIENT_IDENTIFIER: u8 = 0x12;
pub(super) const SERVER_KEEP_ALIVE: u8 = 0x13;
pub(super) const AUTHENTICATION_METHOD: u8 = 0x15;
pub(super) const AUTHENTICATION_DATA: u8 = 0x16;
pub(super) const REQUEST_PROBLEM_INFORMATION: u8 = 0x17;
pub(super) const WILL_DELAY_INTERVAL: u8 = 0x18;
pub(super) const REQUEST_RESPONSE_INFORMATION: u8 = 0x19;
pub(super) const RESPONSE_INFORMATION: u8 = 0x1A;
pub(super) const SERVER_REFERENCE: u8 = 0x1C;
pub(super) const REASON_STRING: u8 = 0x1F;
pub(super) const RECEIVE_MAXIMUM: u8 = 0x21;
pub(super) const TOPIC_ALIAS_MAXIMUM: u8 = 0x22;
pub(super) const TOPIC_ALIAS: u8 = 0x23;
pub(super) const MAXIMUM_QOS: u8 = 0x24;
pub(super) const RETAIN_AVAILABLE: u8 = 0x25;
pub(super) const USER_PROPERTY: u8 = 0x26;
pub(super) const MAXIMUM_PACKET_SIZE: u8 = 0x27;
pub(super) const WILDCARD_SUBSCRIPTION_AVAILABLE: u8 = 0x28;
pub(super) const SUBSCRIPTION_IDENTIFIER_AVAILABLE: u8 = 0x29;
pub(super) const SHARED_SUBSCRIPTION_AVAILABLE: u8 = 0x2A;

/// Property block contexts: indexes 1..=15 are packet types, `WILL` the will properties of a
/// CONNECT.
pub(super) const WILL: usize = 16;
pub(super) const CTX_CONNECT: usize = 1;
pub(super) const CTX_CONNACK: usize = 2;
pub(super) const CTX_PUBLISH: usize = 3;
pub(super) const CTX_SUBSCRIBE: usize = 8;
pub(super) const CTX_SUBACK: usize = 9;
pub(super) const CTX_UNSUBSCRIBE: usize = 10;
pub(super) const CTX_UNSUBACK: usize = 11;

const fn bit(id: u8) -> u64 {
    1 << id
}

const ACK: u64 = bit(REASON_STRING) | bit(USER_PROPERTY);
const MESSAGE: u64 = bit(PAYLOAD_FORMAT_INDICATOR)
    | bit(MESSAGE_EXPIRY_INTERVAL)
    | bit(CONTENT_TYPE)
    | bit(RESPONSE_TOPIC)
    | bit(CORRELATION_DATA)
    | bit(USER_PROPERTY);

/// Allowed property identifiers per context, one bit per identifier (MQTT 5 table 2-4). All
/// identifiers are below 64, so one `u64` per context is the whole table.
const ALLOWED: [u64; 17] = [
    0, // reserved packet type 0
    bit(SESSION_EXPIRY_INTERVAL)
        | bit(AUTHENTICATION_METHOD)
        | bit(AUTHENTICATION_DATA)
        | bit(REQUEST_PROBLEM_INFORMATION)
        | bit(REQUEST_RESPONSE_INFORMATION)
        | bit(RECEIVE_MAXIMUM)
        | bit(TOPIC_ALIAS_MAXIMUM)
        | bit(USER_PROPERTY)
        | bit(MAXIMUM_PACKET_SIZE),
    bit(SESSION_EXPIRY_INTERVAL)
        | bit(ASSIGNED_CLIENT_IDENTIFIER)
        | bit(SERVER_KEEP_ALIVE)
        | bit(AUTHENTICATION_METHOD)
        | bit(AUTHENTICATION_DATA)
        | bit(RESPONSE_INFORMATION)
        | bit(SERVER_REFERENCE)
        | bit(REASON_STRING)
        | bit(RECEIVE_MAXIMUM)
        | bit(TOPIC_ALIAS_MAXIMUM)
        | bit(MAXIMUM_QOS)
        | bit(RETAIN_AVAILABLE)
        | bit(USER_PROPERTY)
        | bit(MAXIMUM_PACKET_SIZE)
        | bit(WILDCARD_SUBSCRIPTION_AVAILABLE)
        | bit(SUBSCRIPTION_IDENTIFIER_AVAILABLE)
        | bit(SHARED_SUBSCRIPTION_AVAILABLE),
    MESSAGE | bit(SUBSCRIPTION_IDENTIFIER) | bit(TOPIC_ALIAS), // PUBLISH
    ACK,                                                       // PUBACK
    ACK,                                                       // PUBREC
    ACK,                                                       // PUBREL
    ACK,                                                       // PUBCOMP
    bit(SUBSCRIPTION_IDENTIFIER) | bit(USER_PROPERTY),         // SUBSCRIBE
    ACK,                                                       // SUBACK
    bit(USER_PROPERTY),                                        // UNSUBSCRIBE
    ACK,                                                       // UNSUBACK
    0,                                                         // PINGREQ
    0,                                                         // PINGRESP
    bit(SESSION_EXPIRY_INTERVAL) | bit(SERVER_REFERENCE) | ACK, // DISCONNECT
    bit(AUTHENTICATION_METHOD) | bit(AUTHENTICATION_DATA) | ACK, // AUTH
    MESSAGE | bit(WILL_DELAY_INTERVAL),                        // will properties
];

/// Every identifier MQTT 5 defines: anything else is malformed, wherever it appears.
const KNOWN: u64 = ALLOWED[1] | ALLOWED[2] | ALLOWED[3] | ALLOWED[14] | ALLOWED[WILL];

fn flag(r: &mut Reader<'_>, what: &'static str) -> Result<u8, DecodeError> {
    match r.u8()? {
        v @ (0 | 1) => Ok(v),
        _ => Err(DecodeError::Protocol(what)),
    }
}

fn nonzero_u16(r: &mut Reader<'_>, what: &'static str) -> Result<u16, DecodeError> {
    match r.u16()? {
        0 => Err(DecodeError::Protocol(what)),
        v => Ok(v),
    }
}

/// Reads a property block (length + properties) for context `ctx` (a packet type or `WILL`).
pub(super) fn read(r: &mut Reader<'_>, ctx: usize) -> Result<Properties, DecodeError> {
    let len = r.varint()? as usize;
    let mut p = Properties::default();
    if len != 0 {
        read_body(&mut r.take(len)?, ctx, &mut p)?;
    }
    Ok(p)
}

/// Like `read`, boxed, and building nothing for an empty block (most packets).
pub(super) fn read_boxed(
    r: &mut Reader<'_>,
    ctx: usize,
) -> Result<Option<Box<Properties>>, DecodeError> {
    let len = r.varint()? as usize;
    if len == 0 {
        return Ok(None);
    }
    let mut body = r.take(len)?;
    let mut p = Box::<Properties>::default();
    read_body(&mut body, ctx, &mut p)?;
    Ok(Some(p))
}

/// Reads the properties of a block until `r` (the block) is empty.
fn read_body(r: &mut Reader<'_>, ctx: usize, p: &mut Properties) -> Result<(), DecodeError> {
    let allowed = ALLOWED[ctx];
    let mut seen = 0u64;
    while r.remaining() > 0 {
        // Identifiers are variable byte integers, but all defined ones fit in one byte: a
        // byte >= 0x80 starts an identifier that is unknown anyway.
        let id = r.u8()?;
        if id >= 64 || KNOWN & bit(id) == 0 {
            return Err(DecodeError::Malformed("unknown property identifier"));
        }
        // MQTT 5 2.2.2.2: an identifier not valid for the packet type makes it malformed.
        if allowed & bit(id) == 0 {
            return Err(DecodeError::Malformed(
                "property not allowed in this packet",
            ));
        }
        if seen & bit(id) != 0
            && id != USER_PROPERTY
            // Several subscription identifiers: a PUBLISH matching several subscriptions.
            && !(id == SUBSCRIPTION_IDENTIFIER && ctx == CTX_PUBLISH)
        {
            return Err(DecodeError::Protocol("duplicate property"));
        }
        seen |= bit(id);
        match id {
            PAYLOAD_FORMAT_INDICATOR => {
                p.payload_format_indicator = Some(flag(r, "payload format indicator")?)
            }
            MESSAGE_EXPIRY_INTERVAL => p.message_expiry_interval = Some(r.u32()?),
            CONTENT_TYPE => p.content_type = Some(r.string()?),
            RESPONSE_TOPIC => p.response_topic = Some(r.string()?),
            CORRELATION_DATA => p.correlation_data = Some(r.binary()?),
            SUBSCRIPTION_IDENTIFIER => match r.varint()? {
                0 => return Err(DecodeError::Protocol("subscription identifier 0")),
                v => p.subscription_identifiers.push(v),
            },
            SESSION_EXPIRY_INTERVAL => p.session_expiry_interval = Some(r.u32()?),
            ASSIGNED_CLIENT_IDENTIFIER => p.assigned_client_identifier = Some(r.string()?),
            SERVER_KEEP_ALIVE => p.server_keep_alive = Some(r.u16()?),
            AUTHENTICATION_METHOD => p.authentication_method = Some(r.string()?),
            AUTHENTICATION_DATA => p.authentication_data = Some(r.binary()?),
            REQUEST_PROBLEM_INFORMATION => {
                p.request_problem_information = Some(flag(r, "request problem information")?)
            }
            WILL_DELAY_INTERVAL => p.will_delay_interval = Some(r.u32()?),
            REQUEST_RESPONSE_INFORMATION => {
                p.request_response_information = Some(flag(r, "request response information")?)
            }
            RESPONSE_INFORMATION => p.response_information = Some(r.string()?),
            SERVER_REFERENCE => p.server_reference = Some(r.string()?),
            REASON_STRING => p.reason_string = Some(r.string()?),
            RECEIVE_MAXIMUM => p.receive_maximum = Some(nonzero_u16(r, "receive maximum 0")?),
            TOPIC_ALIAS_MAXIMUM => p.topic_alias_maximum = Some(r.u16()?),
            // Alias 0 decodes: the receiver answers it with 0x94 (topic alias invalid).
            TOPIC_ALIAS => p.topic_alias = Some(r.u16()?),
            MAXIMUM_QOS => p.maximum_qos = Some(flag(r, "maximum qos")?),
            RETAIN_AVAILABLE => p.retain_available = Some(flag(r, "retain available")?),
            USER_PROPERTY => {
                let k = r.string()?;
                let v = r.string()?;
                p.user_properties.push((k, v));
            }
            MAXIMUM_PACKET_SIZE => match r.u32()? {
                0 => return Err(DecodeError::Protocol("maximum packet size 0")),
                v => p.maximum_packet_size = Some(v),
            },
            WILDCARD_SUBSCRIPTION_AVAILABLE => {
                p.wildcard_subscription_available =
                    Some(flag(r, "wildcard subscription available")?)
            }
            SUBSCRIPTION_IDENTIFIER_AVAILABLE => {
                p.subscription_identifier_available =
                    Some(flag(r, "subscription identifier available")?)
            }
            SHARED_SUBSCRIPTION_AVAILABLE => {
                p.shared_subscription_available = Some(flag(r, "shared subscription available")?)
            }
            _ => unreachable!("KNOWN covers exactly the identifiers matched above"),
        }
    }
    Ok(())
}

/// Length of the properties themselves (without the length prefix). Checks every length that
/// encoding could overflow, so `write` cannot fail.
pub(super) fn body_len(p: &Properties) -> Result<usize, EncodeError> {
    fn opt_str(s: &Option<String>) -> Result<usize, EncodeError> {
        s.as_ref().map_or(Ok(0), |s| Ok(1 + str_len(s)?))
    }
    fn opt_bin(b: &Option<bytes::Bytes>) -> Result<usize, EncodeError> {
        b.as_ref().map_or(Ok(0), |b| Ok(1 + binary_len(b)?))
    }
    fn opt<T>(v: &Option<T>, size: usize) -> usize {
        if v.is_some() {
            1 + size
        } else {
            0
        }
    }
    let mut n = opt(&p.payload_format_indicator, 1)
        + opt(&p.message_expiry_interval, 4)
        + opt_str(&p.content_type)?
        + opt_str(&p.response_topic)?
        + opt_bin(&p.correlation_data)?
        + opt(&p.session_expiry_interval, 4)
        + opt_str(&p.assigned_client_identifier)?
        + opt(&p.server_keep_alive, 2)
        + opt_str(&p.authentication_method)?
        + opt_bin(&p.authentication_data)?
        + opt(&p.request_problem_information, 1)
        + opt(&p.will_delay_interval, 4)
        + opt(&p.request_response_information, 1)
        + opt_str(&p.response_information)?
        + opt_str(&p.server_reference)?
        + opt_str(&p.reason_string)?
        + opt(&p.receive_maximum, 2)
        + opt(&p.topic_alias_maximum, 2)
        + opt(&p.topic_alias, 2)
        + opt(&p.maximum_qos, 1)
        + opt(&p.retain_available, 1)
        + opt(&p.maximum_packet_size, 4)
        + opt(&p.wildcard_subscription_available, 1)
        + opt(&p.subscription_identifier_available, 1)
        + opt(&p.shared_subscription_available, 1);
    for &id in &p.subscription_identifiers {
        if id > MAX_VARINT {
            return Err(EncodeError::TooLong("subscription identifier"));
        }
        n += 1 + varint_len(id as usize);
    }
    for (k, v) in &p.user_properties {
        n += 1 + str_len(k)? + str_len(v)?;
    }
    Ok(n)
}

/// Length of the whole property block (length prefix included) for a body of `body` bytes.
#[inline]
pub(super) fn block_len(body: usize) -> usize {
    varint_len(body) + body
}

/// Writes the property block: `body` must be `body_len(p)`.
pub(super) fn write(p: Option<&Properties>, body: usize, out: &mut Vec<u8>) {
    put_varint(out, body);
    if let Some(p) = p.filter(|_| body != 0) {
        write_body(p, out);
    }
}

/// Writes the properties set in `p`, without the length in front.
pub(super) fn write_body(p: &Properties, out: &mut Vec<u8>) {
    fn byte(out: &mut Vec<u8>, id: u8, v: Option<u8>) {
        if let Some(v) = v {
            out.extend_from_slice(&[id, v]);
        }
    }
    fn u16p(out: &mut Vec<u8>, id: u8, v: Option<u16>) {
        if let Some(v) = v {
            out.push(id);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
    fn u32p(out: &mut Vec<u8>, id: u8, v: Option<u32>) {
        if let Some(v) = v {
            out.push(id);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
    fn strp(out: &mut Vec<u8>, id: u8, v: &Option<String>) {
        if let Some(v) = v {
            out.push(id);
            put_str(out, v.as_bytes());
        }
    }
    fn binp(out: &mut Vec<u8>, id: u8, v: &Option<bytes::Bytes>) {
        if let Some(v) = v {
            out.push(id);
            put_binary(out, v);
        }
    }
    byte(out, PAYLOAD_FORMAT_INDICATOR, p.payload_format_indicator);
    u32p(out, MESSAGE_EXPIRY_INTERVAL, p.message_expiry_interval);
    strp(out, CONTENT_TYPE, &p.content_type);
    strp(out, RESPONSE_TOPIC, &p.response_topic);
    binp(out, CORRELATION_DATA, &p.correlation_data);
    for &id in &p.subscription_identifiers {
        out.push(SUBSCRIPTION_IDENTIFIER);
        put_varint(out, id as usize);
    }
    u32p(out, SESSION_EXPIRY_INTERVAL, p.session_expiry_interval);
    strp(
        out,
        ASSIGNED_CLIENT_IDENTIFIER,
        &p.assigned_client_identifier,
    );
    u16p(out, SERVER_KEEP_ALIVE, p.server_keep_alive);
    strp(out, AUTHENTICATION_METHOD, &p.authentication_method);
    binp(out, AUTHENTICATION_DATA, &p.authentication_data);
    byte(
        out,
        REQUEST_PROBLEM_INFORMATION,
        p.request_problem_information,
    );
    u32p(out, WILL_DELAY_INTERVAL, p.will_delay_interval);
    byte(
        out,
        REQUEST_RESPONSE_INFORMATION,
        p.request_response_information,
    );
    strp(out, RESPONSE_INFORMATION, &p.response_information);
    strp(out, SERVER_REFERENCE, &p.server_reference);
    strp(out, REASON_STRING, &p.reason_string);
    u16p(out, RECEIVE_MAXIMUM, p.receive_maximum);
    u16p(out, TOPIC_ALIAS_MAXIMUM, p.topic_alias_maximum);
    u16p(out, TOPIC_ALIAS, p.topic_alias);
    byte(out, MAXIMUM_QOS, p.maximum_qos);
    byte(out, RETAIN_AVAILABLE, p.retain_available);
    for (k, v) in &p.user_properties {
        out.push(USER_PROPERTY);
        put_str(out, k.as_bytes());
        put_str(out, v.as_bytes());
    }
    u32p(out, MAXIMUM_PACKET_SIZE, p.maximum_packet_size);
    byte(
        out,
        WILDCARD_SUBSCRIPTION_AVAILABLE,
        p.wildcard_subscription_available,
    );
    byte(
        out,
        SUBSCRIPTION_IDENTIFIER_AVAILABLE,
        p.subscription_identifier_available,
    );
    byte(
        out,
        SHARED_SUBSCRIPTION_AVAILABLE,
        p.shared_subscription_available,
    );
}
