//! CONNECT: checks, session start or resume, takeover, CONNACK, and resending what the
//! resumed session had in flight.

use std::sync::Arc;

use bytes::Bytes;

use super::auth::AuthState;
use super::state::{AwaitingAck, ConnState, Session, SessionId};
use super::{ConnId, Engine};
use crate::codec::{ConnAck, Connect, DecodeError, Packet, Properties, Protocol};
use crate::topics;

/// A CONNECT that passed the checks, with what they derived, waiting to be accepted.
#[derive(Debug)]
pub struct PendingConnect {
    pub connect: Box<Connect>,
    /// The client id, assigned by the broker when the CONNECT's was empty.
    pub client_id: Arc<str>,
    pub assigned: Option<String>,
    pub keep_alive: u16,
    pub server_keep_alive: Option<u16>,
    pub expiry: u32,
    pub asked_expiry: u32,
}

impl Engine {
    /// A CONNECT that did not decode. MQTT 5 clients get CONNACK with the reason code
    /// (MQTT 5 4.13.1); 3.1.1 ones only hear about an unsupported level (return code 1), any
    /// other malformed CONNECT is just closed (MQTT-4.8.0-1). An unknown level is answered in
    /// 3.1.1 form, which any client can read (MQTT-3.1.2-2).
    pub(super) fn connect_decode_failed(
        &mut self,
        id: ConnId,
        err: DecodeError,
        level: Option<u8>,
    ) {
        let answer = match (level, &err) {
            (Some(5), _) => Some((Protocol::V5, err.reason_code())),
            (_, DecodeError::UnsupportedProtocol) => Some((Protocol::V311, 0x84)),
            _ => None,
        };
        let level = level.unwrap_or(0);
        let access = (
            "refused",
            id,
            Arc::from(""),
            None,
            level,
            answer.map_or(0, |(_, code)| code),
            format!("bad CONNECT: {err:?}"),
        );
        self.stats.connections_refused += 1;
        self.push_access(access);
        if let Some((protocol, reason_code)) = answer {
            self.conn_mut(id).expect("caller checked").protocol = protocol;
            self.send(
                id,
                &Packet::ConnAck(ConnAck {
                    session_present: false,
                    reason_code,
                    properties: None,
                }),
            );
        }
        self.stop_reading_and_close(id);
        self.event(
            "protocol_error",
            Arc::from(""),
            format!("bad CONNECT: {err:?}"),
        );
    }

    /// Refuses a CONNECT with `code` (MQTT 5 reason; mapped for 3.1.1) and closes.
    pub(super) fn refuse(&mut self, id: ConnId, code: u8, why: &str) {
        self.refuse_with(id, code, code, Some(why), why);
    }

    /// Sends CONNACK `wire_code` (with `reason_string` if the client wants problem
    /// information), logs the refusal with `access_code` and closes.
    pub(super) fn refuse_with(
        &mut self,
        id: ConnId,
        wire_code: u8,
        access_code: u8,
        reason_string: Option<&str>,
        why: &str,
    ) {
        let Some(conn) = self.conn(id) else { return };
        let mut properties = Properties::default();
        if conn.protocol == Protocol::V5 && conn.problem_info {
            properties.reason_string = reason_string.map(str::to_string);
        }
        self.send(
            id,
            &Packet::ConnAck(ConnAck {
                session_present: false,
                reason_code: wire_code,
                properties: properties.into_boxed(),
            }),
        );
        self.stats.connections_refused += 1;
        self.access("refused", id, access_code, why);
        self.stop_reading_and_close(id);
        self.event(
            "connect_refused",
            Arc::from(""),
            format!("0x{access_code:02x} {why}"),
        );
    }

    pub(super) fn handle_connect(&mut self, id: ConnId, c: Box<Connect>, now: u64) {
        let v5 = c.protocol == Protocol::V5;
        let props = &c.properties;
        {
            let conn = self.conn_mut(id).expect("caller checked");
            conn.protocol = c.protocol;
            conn.problem_info = props.request_problem_information != Some(0);
            conn.connect_seen = true;
            conn.username = c.username.as_deref().map(Arc::from);
            conn.client_id = Arc::from(c.client_id.as_str());
        }
        let auth_required = self.cfg.auth_required;
        if props.authentication_method.is_some() && !auth_required {
            return self.refuse(id, 0x8C, "no enhanced authentication method is supported");
        }
        let cfg = &self.cfg;
        if c.client_id.len() > cfg.max_client_id_len {
            return self.refuse(id, 0x85, "client identifier too long");
        }
        if c.client_id.is_empty() && !c.clean_start && !v5 {
            // MQTT-3.1.3-8: a 3.1.1 client needs an id to keep a session.
            return self.refuse(id, 0x85, "empty client identifier needs clean session");
        }
        if let Some(will) = &c.will {
            if !topics::valid_topic_name(will.topic.as_bytes()) {
                return self.refuse(id, 0x90, "invalid will topic");
            }
            if will.qos as u8 > self.cfg.maximum_qos {
                return self.refuse(id, 0x9B, "will QoS not supported");
            }
            if will.retain && !self.cfg.retain_available {
                return self.refuse(id, 0x9A, "retain not supported");
            }
        }
        let cfg = &self.cfg;
        // Keepalive: MQTT 5 clients are told the server's value; 3.1.1 clients cannot be,
        // so one asking for more than the maximum is refused (as Mosquitto does).
        let mut keep_alive = c.keep_alive;
        let mut server_keep_alive = None;
        if cfg.max_keepalive < 65535 && (keep_alive == 0 || keep_alive > cfg.max_keepalive) {
            if v5 {
                keep_alive = cfg.max_keepalive;
                server_keep_alive = Some(keep_alive);
            } else if keep_alive > cfg.max_keepalive {
                return self.refuse(id, 0x85, "keepalive above the server maximum");
            }
        }
        // Session expiry: 3.1.1 clean session 0 means "never expires".
        let asked_expiry = if v5 {
            props.session_expiry_interval.unwrap_or(0)
        } else if c.clean_start {
            0
        } else {
            u32::MAX
        };
        let expiry = asked_expiry.min(cfg.max_session_expiry);

        let mut assigned = None;
        let client_id: Arc<str> = if c.client_id.is_empty() {
            self.assigned_ids += 1;
            let name = format!("fb-{:x}-{:x}", now, self.assigned_ids);
            assigned = Some(name.clone());
            Arc::from(name)
        } else {
            Arc::from(c.client_id.as_str())
        };
        self.conn_mut(id).expect("exists").client_id = client_id.clone();
        if self.at_connection_limit(&client_id) {
            return self.refuse(id, 0x97, "max_connections reached");
        }
        let method = c.properties.authentication_method.clone();
        let pending = PendingConnect {
            connect: c,
            client_id,
            assigned,
            keep_alive,
            server_keep_alive,
            expiry,
            asked_expiry,
        };
        if !auth_required {
            return self.accept_connect(id, pending, None, None, now);
        }
        // The caller decides; nothing of the session happens before that.
        let password = pending.connect.password.clone();
        let data = pending.connect.properties.authentication_data.clone();
        let conn = self.conn_mut(id).expect("exists");
        conn.state = ConnState::AwaitAuth;
        conn.auth = Some(Box::new(AuthState {
            pending: Some(Box::new(pending)),
            method: method.clone(),
            reauth: false,
            awaiting_client: false,
        }));
        self.request_auth(id, "connect", password, method, data);
    }

    /// Goes on with a checked (and, if required, authenticated) CONNECT whose client id no
    /// other node holds any more (broker::cluster_sessions): takeover, session start or
    /// resume, CONNACK (with the enhanced-authentication result, if any).
    pub(super) fn accept_connect_here(
        &mut self,
        id: ConnId,
        pending: PendingConnect,
        auth_method: Option<String>,
        auth_data: Option<Bytes>,
        now: u64,
    ) {
        let PendingConnect {
            connect: c,
            client_id,
            assigned,
            keep_alive,
            server_keep_alive,
            expiry,
            asked_expiry,
        } = pending;
        let v5 = c.protocol == Protocol::V5;
        let props = &c.properties;

        // Takeover: the same client id is connected elsewhere.
        let existing = self.by_client.get(&client_id).copied();
        if let Some(sid) = existing {
            if let Some(old) = self.session(sid).and_then(|s| s.conn) {
                // The old connection's will goes as for any abnormal end (MQTT-3.1.4-3).
                self.close(old, Some(0x8E), "session taken over", true, now);
                self.event(
                    "takeover",
                    client_id.clone(),
                    format!("conn {old} replaced by {id}"),
                );
            }
        }
        let existing = self.by_client.get(&client_id).copied();
        let (sid, session_present) = match existing {
            Some(sid) if !c.clean_start => (sid, true),
            Some(sid) => {
                self.end_session(sid, now);
                (self.new_session(client_id.clone()), false)
            }
            None => (self.new_session(client_id.clone()), false),
        };
        {
            let session = self.session_mut(sid).expect("just made");
            session.conn = Some(id);
            session.expiry = expiry;
            session.disconnected_at = None;
            // A resumed session cancels a delayed will (MQTT-3.1.3-9).
            session.take_pending_will();
        }
        let cfg = &self.cfg;
        let mut ack_props = Properties::default();
        if v5 {
            if cfg.receive_maximum < 65535 {
                ack_props.receive_maximum = Some(cfg.receive_maximum);
            }
            if cfg.maximum_qos < 2 {
                ack_props.maximum_qos = Some(cfg.maximum_qos);
            }
            if !cfg.retain_available {
                ack_props.retain_available = Some(0);
            }
            if cfg.max_packet_size < 268_435_460 {
                ack_props.maximum_packet_size = Some(cfg.max_packet_size);
            }
            if cfg.topic_alias_maximum > 0 {
                ack_props.topic_alias_maximum = Some(cfg.topic_alias_maximum);
            }
            if expiry != asked_expiry {
                ack_props.session_expiry_interval = Some(expiry);
            }
            ack_props.server_keep_alive = server_keep_alive;
            ack_props.assigned_client_identifier = assigned;
            ack_props.authentication_method = auth_method;
            ack_props.authentication_data = auth_data;
        }
        {
            let conn = self.conn_mut(id).expect("exists");
            conn.state = ConnState::Active;
            conn.session = Some(sid);
            conn.client_id = client_id.clone();
            conn.keep_alive_ms = u32::from(keep_alive) * 1000;
            conn.client_max_packet = props.maximum_packet_size.unwrap_or(u32::MAX);
            conn.client_receive_max = props.receive_maximum.unwrap_or(65535);
            conn.client_topic_alias_max = props.topic_alias_maximum.unwrap_or(0);
        }
        self.active_conns += 1;
        self.arm_limits(id, now);
        // The resumed session's subscriptions are judged by this connection's permissions.
        self.refresh_read_check(id);
        self.send(
            id,
            &Packet::ConnAck(ConnAck {
                session_present,
                reason_code: 0,
                properties: ack_props.into_boxed(),
            }),
        );
        self.event(
            "connect",
            client_id,
            format!(
                "conn {id} protocol {} clean {} keepalive {keep_alive} expiry {expiry}",
                c.protocol.level(),
                c.clean_start
            ),
        );
        self.access("connect", id, 0, "");
        let will = c.will;
        self.conn_mut(id).expect("exists").will = will.map(Box::new);
        self.copy_will(sid, id, now);
        // Stored before the CONNACK goes out (the caller writes operations before output).
        self.persist_session(sid, now);
        if session_present {
            if self.cluster.any_lagging(now) {
                // Its client may have been on a node cut off from this one meanwhile, which
                // made a version of it: what it gets here is told to that node once the two
                // are in touch (`TakenIds`).
                self.start_recent(sid, now);
            }
            let from = self.conn(id).map_or(0, |c| c.out.len());
            self.resend_inflight(sid, id, now);
            self.gate_resumed(sid, id, from);
        }
        self.pump(sid, now);
    }

    fn new_session(&mut self, client_id: Arc<str>) -> SessionId {
        let sid = self.insert_session(client_id.clone(), Session::new(client_id));
        self.note_arrival(sid);
        sid
    }

    pub(super) fn insert_session(&mut self, client_id: Arc<str>, session: Session) -> SessionId {
        let sid = match self.free_sessions.pop() {
            Some(sid) => {
                self.sessions.set(sid as usize, session);
                sid
            }
            None => self.sessions.push(session) as SessionId,
        };
        self.by_client.insert(client_id.clone(), sid);
        self.registry_note(&client_id);
        sid
    }

    /// After a resume: every unacknowledged PUBLISH again with DUP, every PUBREL again
    /// (MQTT-4.4.0-1), in the original order.
    fn resend_inflight(&mut self, sid: SessionId, id: ConnId, now: u64) {
        let Some(session) = self.session_mut(sid) else {
            return;
        };
        let inflight = std::mem::take(&mut session.inflight);
        for f in inflight.iter() {
            match f.state {
                AwaitingAck::PubComp => {
                    self.send(id, &Packet::PubRel(Engine::ack(f.pkid, 0)));
                }
                _ => {
                    let d = &f.delivery;
                    self.send_publish(id, &d.msg, d.qos, d.retain, &d.sub_ids, f.pkid, true, now);
                }
            }
        }
        // Onward delivery had started, so expiry no longer applies to these (MQTT 5 3.3.2.3.3).
        self.session_mut(sid).expect("exists").inflight = inflight;
    }
}
