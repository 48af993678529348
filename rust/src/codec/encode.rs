//! Packets -> bytes. Each packet's remaining length is computed first (which also checks every
//! length limit, so nothing is written on error), then the packet is written straight into
//! `out` after a single `reserve`.

use super::props;
use super::*;

type Result<T> = std::result::Result<T, EncodeError>;

/// Largest value of a variable byte integer, and so of a remaining length.
pub(super) const MAX_VARINT: u32 = 268_435_455;

#[inline]
pub(super) fn varint_len(v: usize) -> usize {
    match v {
        0..=0x7f => 1,
        0x80..=0x3fff => 2,
        0x4000..=0x1f_ffff => 3,
        _ => 4,
    }
}

/// Writes `v` (at most `MAX_VARINT`, checked by the caller) as a variable byte integer.
#[inline]
pub(super) fn put_varint(out: &mut Vec<u8>, mut v: usize) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

#[inline]
pub(super) fn str_len(s: &str) -> Result<usize> {
    binary_len(s.as_bytes()).map_err(|_| EncodeError::TooLong("string longer than 65,535 bytes"))
}

#[inline]
pub(super) fn binary_len(b: &[u8]) -> Result<usize> {
    if b.len() > u16::MAX as usize {
        return Err(EncodeError::TooLong("binary data longer than 65,535 bytes"));
    }
    Ok(2 + b.len())
}

/// Length-prefixed bytes (a string or binary data); the length was checked by `str_len`.
#[inline]
pub(super) fn put_str(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u16).to_be_bytes());
    out.extend_from_slice(b);
}

#[inline]
pub(super) fn put_binary(out: &mut Vec<u8>, b: &[u8]) {
    put_str(out, b);
}

/// Checks `remaining` and writes the fixed header after reserving room for the whole packet.
#[inline]
fn header(out: &mut Vec<u8>, first: u8, remaining: usize) -> Result<()> {
    if remaining > MAX_VARINT as usize {
        return Err(EncodeError::TooLong(
            "packet larger than the maximum remaining length",
        ));
    }
    out.reserve(1 + varint_len(remaining) + remaining);
    out.push(first);
    put_varint(out, remaining);
    Ok(())
}

/// Length of the properties (without the length prefix); 0 for none.
#[inline]
fn body_len(p: Option<&Properties>) -> Result<usize> {
    p.map_or(Ok(0), props::body_len)
}

/// Property block size for MQTT 5 (`None` for 3.1.1, which has no properties).
#[inline]
fn props_size(p: Option<&Properties>, v5: bool) -> Result<Option<usize>> {
    if v5 {
        body_len(p).map(Some)
    } else {
        Ok(None)
    }
}

#[inline]
fn block(size: Option<usize>) -> usize {
    size.map_or(0, props::block_len)
}

#[inline]
fn put_props(out: &mut Vec<u8>, p: Option<&Properties>, size: Option<usize>) {
    if let Some(n) = size {
        props::write(p, n, out);
    }
}

pub(super) fn encode(packet: &Packet, protocol: Protocol, out: &mut Vec<u8>) -> Result<()> {
    let v5 = protocol == Protocol::V5;
    match packet {
        Packet::Publish(p) => publish(p, v5, out),
        Packet::PubAck(a) => ack(0x40, a, v5, out),
        Packet::PubRec(a) => ack(0x50, a, v5, out),
        Packet::PubRel(a) => ack(0x62, a, v5, out),
        Packet::PubComp(a) => ack(0x70, a, v5, out),
        Packet::Connect(c) => connect(c, out),
        Packet::ConnAck(c) => connack(c, v5, out),
        Packet::Subscribe(s) => subscribe(s, v5, out),
        Packet::SubAck(s) => suback(s, v5, out),
        Packet::Unsubscribe(u) => unsubscribe(u, v5, out),
        Packet::UnsubAck(u) => unsuback(u, v5, out),
        Packet::PingReq => header(out, 0xc0, 0),
        Packet::PingResp => header(out, 0xd0, 0),
        Packet::Disconnect(_) if !v5 => header(out, 0xe0, 0),
        Packet::Disconnect(d) => {
            reason_and_props(0xe0, d.reason_code, d.properties.as_deref(), v5, out)
        }
        // AUTH does not exist in 3.1.1; if asked anyway it gets the 5.0 form minus properties.
        Packet::Auth(a) => reason_and_props(0xf0, a.reason_code, a.properties.as_deref(), v5, out),
    }
}

/// The hot path: once per delivered message.
fn publish(p: &Publish, v5: bool, out: &mut Vec<u8>) -> Result<()> {
    publish_out(
        &PublishOut {
            dup: p.dup,
            qos: p.qos,
            retain: p.retain,
            topic: &p.topic,
            pkid: p.pkid,
            properties: p.properties.as_deref(),
            message_expiry: None,
            topic_alias: None,
            subscription_ids: &[],
            payload: &p.payload,
        },
        v5,
        out,
    )
}

pub(super) fn publish_out(p: &PublishOut<'_>, v5: bool, out: &mut Vec<u8>) -> Result<()> {
    let mut remaining = binary_len(p.topic)
        .map_err(|_| EncodeError::TooLong("topic longer than 65,535 bytes"))?
        + p.payload.len();
    if p.qos != QoS::AtMostOnce {
        remaining += 2;
    }
    let mut props = 0;
    if v5 {
        if let Some(base) = p.properties {
            props = props::body_len(base)?;
        }
        if p.message_expiry.is_some() {
            props += 5;
        }
        if p.topic_alias.is_some() {
            props += 3;
        }
        for &id in p.subscription_ids {
            props += 1 + varint_len(id as usize);
        }
        remaining += props::block_len(props);
    }
    // DUP only means something with QoS > 0, and a QoS 0 DUP is malformed.
    let dup = p.dup && p.qos != QoS::AtMostOnce;
    let first = 0x30 | (dup as u8) << 3 | (p.qos as u8) << 1 | p.retain as u8;
    header(out, first, remaining)?;
    put_str(out, p.topic);
    if p.qos != QoS::AtMostOnce {
        out.extend_from_slice(&p.pkid.to_be_bytes());
    }
    if v5 {
        put_varint(out, props);
        if let Some(base) = p.properties {
            props::write_body(base, out);
        }
        if let Some(e) = p.message_expiry {
            out.push(props::MESSAGE_EXPIRY_INTERVAL);
            out.extend_from_slice(&e.to_be_bytes());
        }
        if let Some(a) = p.topic_alias {
            out.push(props::TOPIC_ALIAS);
            out.extend_from_slice(&a.to_be_bytes());
        }
        for &id in p.subscription_ids {
            out.push(props::SUBSCRIPTION_IDENTIFIER);
            put_varint(out, id as usize);
        }
    }
    out.extend_from_slice(p.payload);
    Ok(())
}

fn ack(first: u8, a: &Ack, v5: bool, out: &mut Vec<u8>) -> Result<()> {
    if !v5 {
        header(out, first, 2)?;
        out.extend_from_slice(&a.pkid.to_be_bytes());
        return Ok(());
    }
    let body = body_len(a.properties.as_deref())?;
    // Short forms: reason code and property length may be left out (MQTT 5 3.4.2.1).
    let remaining = match (a.reason_code, body) {
        (0, 0) => 2,
        (_, 0) => 3,
        _ => 3 + props::block_len(body),
    };
    header(out, first, remaining)?;
    out.extend_from_slice(&a.pkid.to_be_bytes());
    if remaining > 2 {
        out.push(a.reason_code);
    }
    if remaining > 3 {
        props::write(a.properties.as_deref(), body, out);
    }
    Ok(())
}

/// DISCONNECT and AUTH: reason code and properties, both omitted when 0 / empty.
fn reason_and_props(
    first: u8,
    reason: u8,
    p: Option<&Properties>,
    v5: bool,
    out: &mut Vec<u8>,
) -> Result<()> {
    let body = props_size(p, v5)?.unwrap_or(0);
    let remaining = match (reason, body) {
        (0, 0) => 0,
        (_, 0) => 1,
        _ => 1 + props::block_len(body),
    };
    header(out, first, remaining)?;
    if remaining > 0 {
        out.push(reason);
    }
    if remaining > 1 {
        props::write(p, body, out);
    }
    Ok(())
}

fn connect(c: &Connect, out: &mut Vec<u8>) -> Result<()> {
    // A CONNECT carries its own protocol level, whatever the connection's is.
    let v5 = c.protocol == Protocol::V5;
    let props = props_size(Some(&c.properties), v5)?;
    // name "MQTT", level, flags, keep alive
    let mut remaining = 6 + 1 + 1 + 2 + block(props) + str_len(&c.client_id)?;
    let mut flags = (c.clean_start as u8) << 1;
    let mut will_props = None;
    if let Some(w) = &c.will {
        will_props = props_size(Some(&w.properties), v5)?;
        remaining += block(will_props) + str_len(&w.topic)? + binary_len(&w.payload)?;
        flags |= 0x04 | (w.qos as u8) << 3 | (w.retain as u8) << 5;
    }
    if let Some(u) = &c.username {
        remaining += str_len(u)?;
        flags |= 0x80;
    }
    if let Some(p) = &c.password {
        remaining += binary_len(p)?;
        flags |= 0x40;
    }
    header(out, 0x10, remaining)?;
    put_str(out, b"MQTT");
    out.push(c.protocol.level());
    out.push(flags);
    out.extend_from_slice(&c.keep_alive.to_be_bytes());
    put_props(out, Some(&c.properties), props);
    put_str(out, c.client_id.as_bytes());
    if let Some(w) = &c.will {
        put_props(out, Some(&w.properties), will_props);
        put_str(out, w.topic.as_bytes());
        put_binary(out, &w.payload);
    }
    if let Some(u) = &c.username {
        put_str(out, u.as_bytes());
    }
    if let Some(p) = &c.password {
        put_binary(out, p);
    }
    Ok(())
}

fn connack(c: &ConnAck, v5: bool, out: &mut Vec<u8>) -> Result<()> {
    let props = props_size(c.properties.as_deref(), v5)?;
    header(out, 0x20, 2 + block(props))?;
    out.push(c.session_present as u8);
    out.push(if v5 {
        c.reason_code
    } else {
        connack_code_v311(c.reason_code)
    });
    put_props(out, c.properties.as_deref(), props);
    Ok(())
}

fn subscribe(s: &Subscribe, v5: bool, out: &mut Vec<u8>) -> Result<()> {
    let props = props_size(s.properties.as_deref(), v5)?;
    let mut remaining = 2 + block(props);
    for f in &s.filters {
        remaining += str_len(&f.filter)? + 1;
    }
    header(out, 0x82, remaining)?;
    out.extend_from_slice(&s.pkid.to_be_bytes());
    put_props(out, s.properties.as_deref(), props);
    for f in &s.filters {
        put_str(out, f.filter.as_bytes());
        let mut opts = f.qos as u8;
        if v5 {
            opts |= (f.no_local as u8) << 2
                | (f.retain_as_published as u8) << 3
                | (f.retain_handling & 3) << 4;
        }
        out.push(opts);
    }
    Ok(())
}

fn suback(s: &SubAck, v5: bool, out: &mut Vec<u8>) -> Result<()> {
    let props = props_size(s.properties.as_deref(), v5)?;
    header(out, 0x90, 2 + block(props) + s.reason_codes.len())?;
    out.extend_from_slice(&s.pkid.to_be_bytes());
    put_props(out, s.properties.as_deref(), props);
    if v5 {
        out.extend_from_slice(&s.reason_codes);
    } else {
        // 3.1.1 has one failure code.
        out.extend(s.reason_codes.iter().map(|&c| c.min(0x80)));
    }
    Ok(())
}

fn unsubscribe(u: &Unsubscribe, v5: bool, out: &mut Vec<u8>) -> Result<()> {
    let props = props_size(u.properties.as_deref(), v5)?;
    let mut remaining = 2 + block(props);
    for f in &u.filters {
        remaining += str_len(f)?;
    }
    header(out, 0xa2, remaining)?;
    out.extend_from_slice(&u.pkid.to_be_bytes());
    put_props(out, u.properties.as_deref(), props);
    for f in &u.filters {
        put_str(out, f.as_bytes());
    }
    Ok(())
}

fn unsuback(u: &UnsubAck, v5: bool, out: &mut Vec<u8>) -> Result<()> {
    if !v5 {
        header(out, 0xb0, 2)?;
        out.extend_from_slice(&u.pkid.to_be_bytes());
        return Ok(());
    }
    let body = body_len(u.properties.as_deref())?;
    header(out, 0xb0, 2 + props::block_len(body) + u.reason_codes.len())?;
    out.extend_from_slice(&u.pkid.to_be_bytes());
    props::write(u.properties.as_deref(), body, out);
    out.extend_from_slice(&u.reason_codes);
    Ok(())
}
