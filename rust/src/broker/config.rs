//! Engine settings: the `[mqtt]` table of the TOML config, checked once at start.

/// Limits and features of the broker engine. Defaults suit a production broker on one node.
#[derive(Clone, Debug)]
pub struct Config {
    /// Largest packet accepted from a client, fixed header included (0x95 above it).
    pub max_packet_size: u32,
    /// Largest keepalive a client may use, in seconds. MQTT 5 clients asking for more (or for
    /// none) are told this value as Server Keep Alive; 3.1.1 clients asking for more are
    /// refused (CONNACK 2), as 3.1.1 has no way to tell them. 65535 = no limit.
    pub max_keepalive: u16,
    /// How many QoS 1/2 PUBLISH a client may have unacknowledged towards the broker.
    pub receive_maximum: u16,
    /// Cap on unacknowledged QoS 1/2 PUBLISH the broker sends one client (also bounded by the
    /// client's own Receive Maximum).
    pub max_inflight: u16,
    /// Per-session queue bound (messages) for an offline or slow client; QoS 0 is dropped
    /// first.
    pub max_queued_messages: usize,
    /// Per-session queue bound (payload bytes); 0 = no byte bound.
    pub max_queued_bytes: usize,
    /// Topic aliases a client may use towards the broker.
    pub topic_alias_maximum: u16,
    /// Whether the broker assigns topic aliases on the way out when the client allows them.
    pub outgoing_topic_aliases: bool,
    pub maximum_qos: u8,
    pub retain_available: bool,
    /// Cap on a session's expiry interval, in seconds (u32::MAX = never expires).
    pub max_session_expiry: u32,
    /// A connection that has not sent CONNECT after this many ms is closed.
    pub connect_timeout_ms: u64,
    /// Filters clients may not subscribe to (SUBACK 0x80 in 3.1.1, 0x87 in 5.0).
    pub denied_subscriptions: Vec<String>,
    pub max_client_id_len: usize,
    /// Broker version string, for `$SYS` and logs.
    pub version: String,
    /// Most retained messages kept (0 = no limit): past it, a retained PUBLISH to a new topic
    /// is delivered but not retained.
    pub max_retained_messages: usize,
    /// Largest payload kept as a retained message (0 = no limit besides the packet size).
    pub max_retained_size: usize,
    /// Whether persistent sessions and retained messages are stored (`take_store_ops`).
    pub durable: bool,
    /// Stored values longer than this are compressed (0 = never).
    pub compress_above: usize,
    /// Every CONNECT waits for the caller's decision (`auth_requests` / `auth_done`).
    pub auth_required: bool,
    /// Most connections in the Active state (0 = no limit); a CONNECT beyond is refused
    /// with 0x97 (3.1.1: 3).
    pub max_connections: usize,
    /// PUBLISH packets per second one connection may send (0 = no limit; burst = the rate):
    /// past it the connection is held, not refused.
    pub max_publish_rate: u32,
    /// Bytes a connection waiting for authentication may buffer before it is held.
    pub max_conn_buffer: usize,
    /// Client publishes wait for the caller's decision (`take_intercepted` / `release`).
    pub intercept: bool,
    /// Intercepted publishes of one connection pending release before it is held.
    pub max_intercepted: usize,
    /// Bytes of a down peer node's queue kept in memory when the queue is stored; past it
    /// the newest batches are only in the store, read back when the link is up.
    pub cluster_outbox_memory: usize,
    /// Nodes that must hold a QoS 1/2 message for a persistent session (this one and its
    /// copies) before it is acknowledged.
    pub cluster_ack_replicas: u8,
    /// A peer down this long (ms; the failure timeout) has its sessions taken over by the
    /// owners of their copies; 0: never.
    pub cluster_takeover_ms: u64,
    /// Both sides of a split act on what both hold (deliver past owners out of reach, serve
    /// copies): QoS 2 may then reach a client that crosses the split twice. Off: only the
    /// side with the majority does (`cluster_authority`).
    pub cluster_minority_acts: bool,
    /// Batches for a peer that is down or backed up are zstd-compressed. Off for links that
    /// never lack bandwidth (between the workers of one node), where it would only cost CPU.
    pub cluster_compress: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_packet_size: 16 * 1024 * 1024,
            max_keepalive: 65535,
            receive_maximum: 1024,
            max_inflight: 1024,
            max_queued_messages: 1000,
            max_queued_bytes: 0,
            topic_alias_maximum: 10,
            outgoing_topic_aliases: true,
            maximum_qos: 2,
            retain_available: true,
            max_session_expiry: u32::MAX,
            connect_timeout_ms: 10_000,
            denied_subscriptions: Vec::new(),
            max_client_id_len: 65535,
            version: String::new(),
            max_retained_messages: 1_000_000,
            max_retained_size: 0,
            durable: false,
            compress_above: 4096,
            auth_required: false,
            max_connections: 0,
            max_publish_rate: 0,
            max_conn_buffer: 1 << 20,
            intercept: false,
            max_intercepted: 64,
            cluster_outbox_memory: 64 << 20,
            cluster_ack_replicas: 2,
            cluster_takeover_ms: 0,
            cluster_minority_acts: false,
            cluster_compress: true,
        }
    }
}

/// A typed config value, so the binding layer can hand over settings without knowing them.
pub enum Value {
    Int(i64),
    Bool(bool),
    Str(String),
    List(Vec<String>),
}

impl Config {
    /// Sets one key; the error names the key and what it must be.
    pub fn set(&mut self, key: &str, value: Value) -> Result<(), String> {
        fn int(key: &str, v: &Value, min: i64, max: i64) -> Result<i64, String> {
            match v {
                Value::Int(i) if *i >= min && *i <= max => Ok(*i),
                _ => Err(format!("{key} must be an integer from {min} to {max}")),
            }
        }
        fn boolean(key: &str, v: &Value) -> Result<bool, String> {
            match v {
                Value::Bool(b) => Ok(*b),
                _ => Err(format!("{key} must be true or false")),
            }
        }
        match key {
            "max_packet_size" => self.max_packet_size = int(key, &value, 16, 268_435_460)? as u32,
            "max_keepalive" => self.max_keepalive = int(key, &value, 1, 65535)? as u16,
            "receive_maximum" => self.receive_maximum = int(key, &value, 1, 65535)? as u16,
            "max_inflight" => self.max_inflight = int(key, &value, 1, 65535)? as u16,
            "max_queued_messages" => {
                self.max_queued_messages = int(key, &value, 0, i64::MAX)? as usize
            }
            "max_queued_bytes" => self.max_queued_bytes = int(key, &value, 0, i64::MAX)? as usize,
            "topic_alias_maximum" => self.topic_alias_maximum = int(key, &value, 0, 65535)? as u16,
            "outgoing_topic_aliases" => self.outgoing_topic_aliases = boolean(key, &value)?,
            "maximum_qos" => self.maximum_qos = int(key, &value, 0, 2)? as u8,
            "retain_available" => self.retain_available = boolean(key, &value)?,
            "max_session_expiry" => {
                self.max_session_expiry = int(key, &value, 0, u32::MAX as i64)? as u32
            }
            "connect_timeout_ms" => {
                self.connect_timeout_ms = int(key, &value, 1, 86_400_000)? as u64
            }
            "max_client_id_len" => self.max_client_id_len = int(key, &value, 1, 65535)? as usize,
            "denied_subscriptions" => match value {
                Value::List(filters) => {
                    if let Some(bad) = filters.iter().find(|f| !crate::topics::valid_filter(f)) {
                        return Err(format!("{key}: {bad:?} is not a valid topic filter"));
                    }
                    self.denied_subscriptions = filters;
                }
                _ => return Err(format!("{key} must be a list of topic filters")),
            },
            "max_retained_messages" => {
                self.max_retained_messages = int(key, &value, 0, i64::MAX)? as usize
            }
            "max_retained_size" => self.max_retained_size = int(key, &value, 0, i64::MAX)? as usize,
            "durable" => self.durable = boolean(key, &value)?,
            "compress_above" => self.compress_above = int(key, &value, 0, i64::MAX)? as usize,
            "auth_required" => self.auth_required = boolean(key, &value)?,
            "max_connections" => self.max_connections = int(key, &value, 0, i64::MAX)? as usize,
            "max_publish_rate" => {
                self.max_publish_rate = int(key, &value, 0, u32::MAX as i64)? as u32
            }
            "max_conn_buffer" => self.max_conn_buffer = int(key, &value, 0, i64::MAX)? as usize,
            "intercept" => self.intercept = boolean(key, &value)?,
            "max_intercepted" => {
                self.max_intercepted = int(key, &value, 1, u32::MAX as i64)? as usize
            }
            "cluster_outbox_memory" => {
                self.cluster_outbox_memory = int(key, &value, 0, i64::MAX)? as usize
            }
            "cluster_ack_replicas" => self.cluster_ack_replicas = int(key, &value, 1, 16)? as u8,
            "cluster_takeover_ms" => {
                self.cluster_takeover_ms = int(key, &value, 0, i64::MAX)? as u64
            }
            "cluster_minority_acts" => self.cluster_minority_acts = boolean(key, &value)?,
            "cluster_compress" => self.cluster_compress = boolean(key, &value)?,
            "version" => match value {
                Value::Str(s) => self.version = s,
                _ => return Err(format!("{key} must be a string")),
            },
            _ => return Err(format!("unknown setting {key:?}")),
        }
        Ok(())
    }
}
