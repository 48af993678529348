//! Python bindings of the codec: `CodecError`, `Decoder` and `encode_packet`, with packets as
//! dicts (keys documented in `fastbroker_core.pyi`). Meant for tests and tools, not the data
//! path, so clarity wins over speed here.

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};
use pyo3::create_exception;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::codec::{
    self, Ack, Auth, ConnAck, Connect, DecodeError, Disconnect, EncodeError, LastWill, Packet,
    Properties, Protocol, Publish, QoS, SubAck, Subscribe, SubscribeFilter, UnsubAck, Unsubscribe,
};

create_exception!(
    fastbroker_core,
    CodecError,
    PyValueError,
    "The byte stream is not valid MQTT; ``reason_code`` is the MQTT 5 reason code."
);

fn codec_error(py: Python<'_>, e: &DecodeError) -> PyErr {
    let msg = match e {
        DecodeError::Malformed(why) => format!("malformed packet: {why}"),
        DecodeError::Protocol(why) => format!("protocol error: {why}"),
        DecodeError::TooLarge { size } => {
            format!("packet of {size} bytes is over the maximum packet size")
        }
        DecodeError::UnsupportedProtocol => "unsupported protocol name or level".to_string(),
        DecodeError::TopicNameInvalid => "topic name contains a wildcard".to_string(),
    };
    let err = CodecError::new_err(msg);
    if let Err(set) = err.value(py).setattr("reason_code", e.reason_code()) {
        return set;
    }
    err
}

fn protocol_from(level: u8) -> PyResult<Protocol> {
    match level {
        4 => Ok(Protocol::V311),
        5 => Ok(Protocol::V5),
        _ => Err(PyValueError::new_err(
            "protocol must be 4 (MQTT 3.1.1) or 5",
        )),
    }
}

fn type_name(p: &Packet) -> &'static str {
    match p {
        Packet::Connect(_) => "connect",
        Packet::ConnAck(_) => "connack",
        Packet::Publish(_) => "publish",
        Packet::PubAck(_) => "puback",
        Packet::PubRec(_) => "pubrec",
        Packet::PubRel(_) => "pubrel",
        Packet::PubComp(_) => "pubcomp",
        Packet::Subscribe(_) => "subscribe",
        Packet::SubAck(_) => "suback",
        Packet::Unsubscribe(_) => "unsubscribe",
        Packet::UnsubAck(_) => "unsuback",
        Packet::PingReq => "pingreq",
        Packet::PingResp => "pingresp",
        Packet::Disconnect(_) => "disconnect",
        Packet::Auth(_) => "auth",
    }
}

/// The int and str properties, by field name: one list drives both directions.
macro_rules! scalar_props {
    ($($f:ident),* $(,)?) => {
        fn scalar_props_to_dict(p: &Properties, d: &Bound<'_, PyDict>) -> PyResult<()> {
            $(if let Some(v) = &p.$f {
                d.set_item(stringify!($f), v)?;
            })*
            Ok(())
        }

        /// Sets property `key` from `v`; false if `key` is not a scalar property.
        fn scalar_prop_from_py(
            p: &mut Properties,
            key: &str,
            v: &Bound<'_, PyAny>,
        ) -> PyResult<bool> {
            match key {
                $(stringify!($f) => p.$f = Some(v.extract().map_err(|e| keyed(key, e))?),)*
                _ => return Ok(false),
            }
            Ok(true)
        }
    };
}

scalar_props!(
    payload_format_indicator,
    message_expiry_interval,
    content_type,
    response_topic,
    session_expiry_interval,
    assigned_client_identifier,
    server_keep_alive,
    authentication_method,
    request_problem_information,
    will_delay_interval,
    request_response_information,
    response_information,
    server_reference,
    reason_string,
    receive_maximum,
    topic_alias_maximum,
    topic_alias,
    maximum_qos,
    retain_available,
    maximum_packet_size,
    wildcard_subscription_available,
    subscription_identifier_available,
    shared_subscription_available,
);

/// Names the dict key in a conversion error, keeping the error's type (TypeError,
/// OverflowError...).
fn keyed(key: &str, e: impl Into<PyErr>) -> PyErr {
    let e: PyErr = e.into();
    Python::attach(|py| {
        let new = PyErr::from_type(e.get_type(py), format!("{key}: {}", e.value(py)));
        new.set_cause(py, Some(e));
        new
    })
}

fn props_to_dict<'py>(py: Python<'py>, p: &Properties) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    if p.is_empty() {
        return Ok(d);
    }
    scalar_props_to_dict(p, &d)?;
    if let Some(b) = &p.correlation_data {
        d.set_item("correlation_data", PyBytes::new(py, b))?;
    }
    if let Some(b) = &p.authentication_data {
        d.set_item("authentication_data", PyBytes::new(py, b))?;
    }
    if !p.subscription_identifiers.is_empty() {
        d.set_item("subscription_identifiers", &p.subscription_identifiers)?;
    }
    if !p.user_properties.is_empty() {
        let pairs = PyList::empty(py);
        for (k, v) in &p.user_properties {
            pairs.append(PyList::new(py, [k, v])?)?;
        }
        d.set_item("user_properties", pairs)?;
    }
    Ok(d)
}

fn bytes_from(key: &str, v: &Bound<'_, PyAny>) -> PyResult<Bytes> {
    let b: Cow<'_, [u8]> = v.extract().map_err(|e| keyed(key, e))?;
    Ok(Bytes::copy_from_slice(&b))
}

fn props_from(v: Option<Bound<'_, PyAny>>) -> PyResult<Properties> {
    let mut p = Properties::default();
    let Some(v) = v else {
        return Ok(p);
    };
    let d = v
        .cast::<PyDict>()
        .map_err(|_| PyTypeError::new_err("properties must be a dict"))?;
    for (k, v) in d.iter() {
        let key: String = k.extract()?;
        if v.is_none() || scalar_prop_from_py(&mut p, &key, &v)? {
            continue;
        }
        match key.as_str() {
            "correlation_data" => p.correlation_data = Some(bytes_from(&key, &v)?),
            "authentication_data" => p.authentication_data = Some(bytes_from(&key, &v)?),
            "subscription_identifiers" => {
                p.subscription_identifiers = v.extract().map_err(|e| keyed(&key, e))?
            }
            "user_properties" => {
                for pair in v.try_iter()? {
                    let pair: Vec<String> = pair?.extract().map_err(|e| keyed(&key, e))?;
                    let [k, v]: [String; 2] = pair.try_into().map_err(|_| {
                        PyValueError::new_err(
                            "user_properties: each item must be a [key, value] pair",
                        )
                    })?;
                    p.user_properties.push((k, v));
                }
            }
            _ => return Err(PyValueError::new_err(format!("unknown property {key:?}"))),
        }
    }
    Ok(p)
}

fn packet_to_dict<'py>(py: Python<'py>, p: &Packet) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("type", type_name(p))?;
    let reason_and_props = |reason: u8, props: &Properties| -> PyResult<()> {
        d.set_item("reason_code", reason)?;
        d.set_item("properties", props_to_dict(py, props)?)
    };
    match p {
        Packet::Connect(c) => {
            d.set_item("protocol", c.protocol.level())?;
            d.set_item("clean_start", c.clean_start)?;
            d.set_item("keep_alive", c.keep_alive)?;
            d.set_item("client_id", &c.client_id)?;
            let will = match &c.will {
                Some(w) => {
                    let wd = PyDict::new(py);
                    wd.set_item("topic", &w.topic)?;
                    wd.set_item("payload", PyBytes::new(py, &w.payload))?;
                    wd.set_item("qos", w.qos as u8)?;
                    wd.set_item("retain", w.retain)?;
                    wd.set_item("properties", props_to_dict(py, &w.properties)?)?;
                    Some(wd)
                }
                None => None,
            };
            d.set_item("will", will)?;
            d.set_item("username", &c.username)?;
            d.set_item(
                "password",
                c.password.as_deref().map(|b| PyBytes::new(py, b)),
            )?;
            d.set_item("properties", props_to_dict(py, &c.properties)?)?;
        }
        Packet::ConnAck(c) => {
            d.set_item("session_present", c.session_present)?;
            reason_and_props(c.reason_code, c.props())?;
        }
        Packet::Publish(p) => {
            d.set_item("dup", p.dup)?;
            d.set_item("qos", p.qos as u8)?;
            d.set_item("retain", p.retain)?;
            // The decoder checked the topic is UTF-8.
            d.set_item("topic", String::from_utf8_lossy(&p.topic))?;
            d.set_item("pkid", p.pkid)?;
            d.set_item("properties", props_to_dict(py, p.props())?)?;
            d.set_item("payload", PyBytes::new(py, &p.payload))?;
        }
        Packet::PubAck(a) | Packet::PubRec(a) | Packet::PubRel(a) | Packet::PubComp(a) => {
            d.set_item("pkid", a.pkid)?;
            reason_and_props(a.reason_code, a.props())?;
        }
        Packet::Subscribe(s) => {
            d.set_item("pkid", s.pkid)?;
            let filters = PyList::empty(py);
            for f in &s.filters {
                let fd = PyDict::new(py);
                fd.set_item("filter", &f.filter)?;
                fd.set_item("qos", f.qos as u8)?;
                fd.set_item("no_local", f.no_local)?;
                fd.set_item("retain_as_published", f.retain_as_published)?;
                fd.set_item("retain_handling", f.retain_handling)?;
                filters.append(fd)?;
            }
            d.set_item("filters", filters)?;
            d.set_item("properties", props_to_dict(py, s.props())?)?;
        }
        Packet::SubAck(s) => {
            d.set_item("pkid", s.pkid)?;
            // A list of ints, not bytes (which is what Vec<u8> would become).
            d.set_item("reason_codes", PyList::new(py, &s.reason_codes)?)?;
            d.set_item("properties", props_to_dict(py, s.props())?)?;
        }
        Packet::Unsubscribe(u) => {
            d.set_item("pkid", u.pkid)?;
            d.set_item("filters", &u.filters)?;
            d.set_item("properties", props_to_dict(py, u.props())?)?;
        }
        Packet::UnsubAck(u) => {
            d.set_item("pkid", u.pkid)?;
            d.set_item("reason_codes", PyList::new(py, &u.reason_codes)?)?;
            d.set_item("properties", props_to_dict(py, u.props())?)?;
        }
        Packet::PingReq | Packet::PingResp => {}
        Packet::Disconnect(x) => reason_and_props(x.reason_code, x.props())?,
        Packet::Auth(x) => reason_and_props(x.reason_code, x.props())?,
    }
    Ok(d)
}

/// Reads packet dicts: missing optional keys and `None` take their defaults.
struct Fields<'a, 'py> {
    d: &'a Bound<'py, PyDict>,
}

impl<'py> Fields<'_, 'py> {
    fn get(&self, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.d.get_item(key)?.filter(|v| !v.is_none()))
    }

    fn req<T: FromPyObjectOwned<'py>>(&self, key: &str) -> PyResult<T> {
        match self.get(key)? {
            Some(v) => v.extract().map_err(|e| keyed(key, e)),
            None => Err(PyValueError::new_err(format!("missing key {key:?}"))),
        }
    }

    fn opt<T: FromPyObjectOwned<'py>>(&self, key: &str) -> PyResult<Option<T>> {
        self.get(key)?
            .map(|v| v.extract().map_err(|e| keyed(key, e)))
            .transpose()
    }

    fn or<T: FromPyObjectOwned<'py>>(&self, key: &str, default: T) -> PyResult<T> {
        Ok(self.opt(key)?.unwrap_or(default))
    }

    fn qos(&self, key: &str) -> PyResult<QoS> {
        QoS::from_u8(self.or(key, 0u8)?)
            .ok_or_else(|| PyValueError::new_err(format!("{key} must be 0, 1 or 2")))
    }

    fn bytes(&self, key: &str) -> PyResult<Option<Bytes>> {
        self.get(key)?.map(|v| bytes_from(key, &v)).transpose()
    }

    fn props(&self) -> PyResult<Properties> {
        props_from(self.get("properties")?)
    }

    fn ack(&self) -> PyResult<Ack> {
        Ok(Ack {
            pkid: self.req("pkid")?,
            reason_code: self.or("reason_code", 0)?,
            properties: self.props()?.into_boxed(),
        })
    }
}

fn packet_from_dict(d: &Bound<'_, PyDict>, protocol: Protocol) -> PyResult<Packet> {
    let f = Fields { d };
    let kind: String = f.req("type")?;
    Ok(match kind.as_str() {
        "connect" => {
            let protocol = match f.opt::<u8>("protocol")? {
                Some(level) => protocol_from(level)?,
                None => protocol,
            };
            let will = match f.get("will")? {
                Some(w) => {
                    let wd = w
                        .cast::<PyDict>()
                        .map_err(|_| PyTypeError::new_err("will must be a dict"))?;
                    let w = Fields { d: wd };
                    Some(LastWill {
                        topic: w.req("topic")?,
                        payload: w.bytes("payload")?.unwrap_or_default(),
                        qos: w.qos("qos")?,
                        retain: w.or("retain", false)?,
                        properties: w.props()?,
                    })
                }
                None => None,
            };
            Packet::Connect(Box::new(Connect {
                protocol,
                clean_start: f.or("clean_start", true)?,
                keep_alive: f.or("keep_alive", 0)?,
                client_id: f.or("client_id", String::new())?,
                will,
                username: f.opt("username")?,
                password: f.bytes("password")?,
                properties: f.props()?,
            }))
        }
        "connack" => Packet::ConnAck(ConnAck {
            session_present: f.or("session_present", false)?,
            reason_code: f.or("reason_code", 0)?,
            properties: f.props()?.into_boxed(),
        }),
        "publish" => {
            let topic = match f.get("topic")? {
                Some(t) if t.is_instance_of::<PyString>() => {
                    Bytes::from(t.extract::<String>()?.into_bytes())
                }
                Some(t) => bytes_from("topic", &t)?,
                None => return Err(PyValueError::new_err("missing key \"topic\"")),
            };
            let qos = f.qos("qos")?;
            Packet::Publish(Publish {
                dup: f.or("dup", false)?,
                qos,
                retain: f.or("retain", false)?,
                topic,
                pkid: if qos == QoS::AtMostOnce {
                    f.or("pkid", 0)?
                } else {
                    f.req("pkid")?
                },
                properties: f.props()?.into_boxed(),
                payload: f.bytes("payload")?.unwrap_or_default(),
            })
        }
        "puback" => Packet::PubAck(f.ack()?),
        "pubrec" => Packet::PubRec(f.ack()?),
        "pubrel" => Packet::PubRel(f.ack()?),
        "pubcomp" => Packet::PubComp(f.ack()?),
        "subscribe" => {
            let mut filters = Vec::new();
            for item in f
                .get("filters")?
                .ok_or_else(|| PyValueError::new_err("missing key \"filters\""))?
                .try_iter()?
            {
                let item = item?;
                let fd = item
                    .cast::<PyDict>()
                    .map_err(|_| PyTypeError::new_err("each subscribe filter must be a dict"))?;
                let sf = Fields { d: fd };
                filters.push(SubscribeFilter {
                    filter: sf.req("filter")?,
                    qos: sf.qos("qos")?,
                    no_local: sf.or("no_local", false)?,
                    retain_as_published: sf.or("retain_as_published", false)?,
                    retain_handling: match sf.or("retain_handling", 0u8)? {
                        rh @ 0..=2 => rh,
                        _ => {
                            return Err(PyValueError::new_err("retain_handling must be 0, 1 or 2"))
                        }
                    },
                });
            }
            Packet::Subscribe(Subscribe {
                pkid: f.req("pkid")?,
                filters,
                properties: f.props()?.into_boxed(),
            })
        }
        "suback" => Packet::SubAck(SubAck {
            pkid: f.req("pkid")?,
            reason_codes: f.req("reason_codes")?,
            properties: f.props()?.into_boxed(),
        }),
        "unsubscribe" => Packet::Unsubscribe(Unsubscribe {
            pkid: f.req("pkid")?,
            filters: f.req("filters")?,
            properties: f.props()?.into_boxed(),
        }),
        "unsuback" => Packet::UnsubAck(UnsubAck {
            pkid: f.req("pkid")?,
            reason_codes: f.or("reason_codes", Vec::new())?,
            properties: f.props()?.into_boxed(),
        }),
        "pingreq" => Packet::PingReq,
        "pingresp" => Packet::PingResp,
        "disconnect" => Packet::Disconnect(Disconnect {
            reason_code: f.or("reason_code", 0)?,
            properties: f.props()?.into_boxed(),
        }),
        "auth" => Packet::Auth(Auth {
            reason_code: f.or("reason_code", 0)?,
            properties: f.props()?.into_boxed(),
        }),
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown packet type {other:?}"
            )))
        }
    })
}

/// Incremental decoder over one byte stream; see `fastbroker_core.pyi`.
#[pyclass(name = "Decoder", module = "fastbroker_core")]
pub struct PyDecoder {
    buf: BytesMut,
    protocol: Protocol,
    max_packet_size: usize,
    /// A broken stream stays broken: later feeds raise the same error.
    failed: Option<DecodeError>,
}

#[pymethods]
impl PyDecoder {
    #[new]
    // Default: the largest MQTT packet (1 + 4 + 268,435,455 bytes); a literal so that the
    // Python signature shows it.
    #[pyo3(signature = (protocol = 5, max_packet_size = 268_435_460))]
    fn new(protocol: u8, max_packet_size: usize) -> PyResult<Self> {
        Ok(PyDecoder {
            buf: BytesMut::new(),
            protocol: protocol_from(protocol)?,
            max_packet_size,
            failed: None,
        })
    }

    fn feed<'py>(&mut self, py: Python<'py>, data: Cow<'_, [u8]>) -> PyResult<Bound<'py, PyList>> {
        if let Some(e) = &self.failed {
            return Err(codec_error(py, e));
        }
        self.buf.extend_from_slice(&data);
        let out = PyList::empty(py);
        loop {
            match codec::decode(&mut self.buf, self.protocol, self.max_packet_size) {
                Ok(Some(p)) => {
                    if let Packet::Connect(c) = &p {
                        self.protocol = c.protocol;
                    }
                    out.append(packet_to_dict(py, &p)?)?;
                }
                Ok(None) => return Ok(out),
                Err(e) => {
                    let err = codec_error(py, &e);
                    self.failed = Some(e);
                    return Err(err);
                }
            }
        }
    }

    #[getter]
    fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The protocol level the decoder currently uses (4 or 5).
    #[getter]
    fn protocol(&self) -> u8 {
        self.protocol.level()
    }
}

/// Encodes one packet dict for protocol 4 or 5.
#[pyfunction]
#[pyo3(signature = (packet, protocol = 5))]
fn encode_packet<'py>(
    py: Python<'py>,
    packet: &Bound<'py, PyDict>,
    protocol: u8,
) -> PyResult<Bound<'py, PyBytes>> {
    let protocol = protocol_from(protocol)?;
    let p = packet_from_dict(packet, protocol)?;
    let mut out = Vec::new();
    codec::encode(&p, protocol, &mut out).map_err(|EncodeError::TooLong(why)| {
        PyValueError::new_err(format!("cannot encode: {why}"))
    })?;
    Ok(PyBytes::new(py, &out))
}

/// Adds `CodecError`, `Decoder` and `encode_packet` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("CodecError", m.py().get_type::<CodecError>())?;
    m.add_class::<PyDecoder>()?;
    m.add_function(wrap_pyfunction!(encode_packet, m)?)?;
    Ok(())
}
