//! MQTT 3.1.1 / 5.0 packet types shared by the codec, the engine and the Python bindings.
//!
//! One `Properties` struct serves every packet type: the codec checks which property
//! identifiers a packet type may carry (see `codec::props`), so the rest of the code reads a
//! property the same way wherever it comes from.
//!
//! Packets hold it as `Option<Box<Properties>>`, `None` when there are none (most packets):
//! then decoding neither builds nor moves hundreds of bytes, and `Packet` stays small to move.
//! The decoder never gives `Some` of empty properties, so `Properties::into_boxed` builds what
//! it would; the encoder writes `Some` of empty properties like `None`. `props()` reads either
//! form. CONNECT and its will keep theirs inline: the CONNECT is boxed whole.

use bytes::Bytes;

/// Protocol level from CONNECT: 4 = MQTT 3.1.1, 5 = MQTT 5.0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    V311,
    V5,
}

impl Protocol {
    pub fn level(self) -> u8 {
        match self {
            Protocol::V311 => 4,
            Protocol::V5 => 5,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QoS {
    AtMostOnce = 0,
    AtLeastOnce = 1,
    ExactlyOnce = 2,
}

impl QoS {
    pub fn from_u8(v: u8) -> Option<QoS> {
        match v {
            0 => Some(QoS::AtMostOnce),
            1 => Some(QoS::AtLeastOnce),
            2 => Some(QoS::ExactlyOnce),
            _ => None,
        }
    }
}

/// Every MQTT 5 property. `None` / empty means absent. Which of them a packet type may carry
/// is checked by the codec on decode; encode writes whatever is set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Properties {
    pub payload_format_indicator: Option<u8>,          // 0x01
    pub message_expiry_interval: Option<u32>,          // 0x02
    pub content_type: Option<String>,                  // 0x03
    pub response_topic: Option<String>,                // 0x08
    pub correlation_data: Option<Bytes>,               // 0x09
    pub subscription_identifiers: Vec<u32>,            // 0x0B (several only in PUBLISH to a client)
    pub session_expiry_interval: Option<u32>,          // 0x11
    pub assigned_client_identifier: Option<String>,    // 0x12
    pub server_keep_alive: Option<u16>,                // 0x13
    pub authentication_method: Option<String>,         // 0x15
    pub authentication_data: Option<Bytes>,            // 0x16
    pub request_problem_information: Option<u8>,       // 0x17
    pub will_delay_interval: Option<u32>,              // 0x18
    pub request_response_information: Option<u8>,      // 0x19
    pub response_information: Option<String>,          // 0x1A
    pub server_reference: Option<String>,              // 0x1C
    pub reason_string: Option<String>,                 // 0x1F
    pub receive_maximum: Option<u16>,                  // 0x21
    pub topic_alias_maximum: Option<u16>,              // 0x22
    pub topic_alias: Option<u16>,                      // 0x23
    pub maximum_qos: Option<u8>,                       // 0x24
    pub retain_available: Option<u8>,                  // 0x25
    pub user_properties: Vec<(String, String)>,        // 0x26
    pub maximum_packet_size: Option<u32>,              // 0x27
    pub wildcard_subscription_available: Option<u8>,   // 0x28
    pub subscription_identifier_available: Option<u8>, // 0x29
    pub shared_subscription_available: Option<u8>,     // 0x2A
}

/// What `props()` lends when a packet has no properties.
static NO_PROPERTIES: Properties = Properties {
    payload_format_indicator: None,
    message_expiry_interval: None,
    content_type: None,
    response_topic: None,
    correlation_data: None,
    subscription_identifiers: Vec::new(),
    session_expiry_interval: None,
    assigned_client_identifier: None,
    server_keep_alive: None,
    authentication_method: None,
    authentication_data: None,
    request_problem_information: None,
    will_delay_interval: None,
    request_response_information: None,
    response_information: None,
    server_reference: None,
    reason_string: None,
    receive_maximum: None,
    topic_alias_maximum: None,
    topic_alias: None,
    maximum_qos: None,
    retain_available: None,
    user_properties: Vec::new(),
    maximum_packet_size: None,
    wildcard_subscription_available: None,
    subscription_identifier_available: None,
    shared_subscription_available: None,
};

impl Properties {
    pub fn is_empty(&self) -> bool {
        *self == NO_PROPERTIES
    }

    /// The form packets hold them in: `None` when no property is set.
    pub fn into_boxed(self) -> Option<Box<Properties>> {
        if self.is_empty() {
            None
        } else {
            Some(Box::new(self))
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LastWill {
    pub topic: String,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    /// Will properties (MQTT 5): will delay, payload format, message expiry, content type,
    /// response topic, correlation data, user properties.
    pub properties: Properties,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Connect {
    pub protocol: Protocol,
    /// "Clean Session" in 3.1.1, "Clean Start" in 5.0.
    pub clean_start: bool,
    pub keep_alive: u16,
    pub client_id: String,
    pub will: Option<LastWill>,
    pub username: Option<String>,
    pub password: Option<Bytes>,
    pub properties: Properties,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnAck {
    pub session_present: bool,
    /// MQTT 5 reason code; for 3.1.1 the encoder maps it to a 3.1.1 return code
    /// (see `codec::connack_code_v311`).
    pub reason_code: u8,
    pub properties: Option<Box<Properties>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publish {
    pub dup: bool,
    pub qos: QoS,
    pub retain: bool,
    /// Topic name as raw bytes (UTF-8 checked by the decoder). Empty when an MQTT 5 topic
    /// alias stands in for it.
    pub topic: Bytes,
    /// 0 for QoS 0.
    pub pkid: u16,
    pub properties: Option<Box<Properties>>,
    pub payload: Bytes,
}

/// PUBACK, PUBREC, PUBREL, PUBCOMP: packet id, reason code (0 = success) and properties
/// (reason string, user properties).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    pub pkid: u16,
    pub reason_code: u8,
    pub properties: Option<Box<Properties>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscribeFilter {
    pub filter: String,
    pub qos: QoS,
    pub no_local: bool,
    pub retain_as_published: bool,
    /// 0 = send retained on subscribe, 1 = only if the subscription is new, 2 = never.
    pub retain_handling: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subscribe {
    pub pkid: u16,
    pub filters: Vec<SubscribeFilter>,
    /// Subscription identifier (at most one) and user properties.
    pub properties: Option<Box<Properties>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubAck {
    pub pkid: u16,
    /// One per filter: granted QoS 0/1/2 or a failure code (0x80 in 3.1.1; 0x80.. in 5.0).
    pub reason_codes: Vec<u8>,
    pub properties: Option<Box<Properties>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsubscribe {
    pub pkid: u16,
    pub filters: Vec<String>,
    pub properties: Option<Box<Properties>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnsubAck {
    pub pkid: u16,
    /// MQTT 5 only (one per filter); empty for 3.1.1.
    pub reason_codes: Vec<u8>,
    pub properties: Option<Box<Properties>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disconnect {
    pub reason_code: u8,
    pub properties: Option<Box<Properties>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Auth {
    pub reason_code: u8,
    pub properties: Option<Box<Properties>>,
}

/// `props()`, the properties or empty ones, and `props_mut()`, the properties to change
/// (created empty if there were none), for each packet type that holds them boxed.
macro_rules! props_access {
    ($($t:ty),*) => {$(
        impl $t {
            pub fn props(&self) -> &Properties {
                self.properties.as_deref().unwrap_or(&NO_PROPERTIES)
            }

            pub fn props_mut(&mut self) -> &mut Properties {
                self.properties.get_or_insert_default()
            }
        }
    )*};
}

props_access!(
    ConnAck,
    Publish,
    Ack,
    Subscribe,
    SubAck,
    Unsubscribe,
    UnsubAck,
    Disconnect,
    Auth
);

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Packet {
    Connect(Box<Connect>),
    ConnAck(ConnAck),
    Publish(Publish),
    PubAck(Ack),
    PubRec(Ack),
    PubRel(Ack),
    PubComp(Ack),
    Subscribe(Subscribe),
    SubAck(SubAck),
    Unsubscribe(Unsubscribe),
    UnsubAck(UnsubAck),
    PingReq,
    PingResp,
    Disconnect(Disconnect),
    Auth(Auth),
}

impl Packet {
    /// The control packet type number (1 = CONNECT .. 15 = AUTH).
    pub fn type_code(&self) -> u8 {
        match self {
            Packet::Connect(_) => 1,
            Packet::ConnAck(_) => 2,
            Packet::Publish(_) => 3,
            Packet::PubAck(_) => 4,
            Packet::PubRec(_) => 5,
            Packet::PubRel(_) => 6,
            Packet::PubComp(_) => 7,
            Packet::Subscribe(_) => 8,
            Packet::SubAck(_) => 9,
            Packet::Unsubscribe(_) => 10,
            Packet::UnsubAck(_) => 11,
            Packet::PingReq => 12,
            Packet::PingResp => 13,
            Packet::Disconnect(_) => 14,
            Packet::Auth(_) => 15,
        }
    }
}
