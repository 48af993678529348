//! The Python module `fastbroker_core`: the codec (for tests and tools) and the engine.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString};

use crate::broker::{Config, Engine, Value};
use crate::codec::QoS;

/// The broker engine; see `fastbroker_core.pyi` for the contract.
#[pyclass(name = "Engine", module = "fastbroker_core", unsendable)]
pub struct PyEngine {
    inner: Engine,
}

fn config_value(key: &str, v: &Bound<'_, PyAny>) -> PyResult<Value> {
    // bool before int: Python's bool is an int.
    if v.is_instance_of::<PyBool>() {
        Ok(Value::Bool(v.extract()?))
    } else if v.is_instance_of::<PyInt>() {
        v.extract::<i64>()
            .map(Value::Int)
            .map_err(|_| PyValueError::new_err(format!("{key}: integer out of range")))
    } else if v.is_instance_of::<PyString>() {
        Ok(Value::Str(v.extract()?))
    } else if let Ok(items) = v.extract::<Vec<String>>() {
        Ok(Value::List(items))
    } else {
        Err(PyValueError::new_err(format!(
            "{key}: unsupported value type"
        )))
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (config=None))]
    fn new(config: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut cfg = Config::default();
        if let Some(config) = config {
            for (k, v) in config.iter() {
                let key: String = k.extract()?;
                let value = config_value(&key, &v)?;
                cfg.set(&key, value).map_err(PyValueError::new_err)?;
            }
        }
        Ok(PyEngine {
            inner: Engine::new(cfg),
        })
    }

    fn open(&mut self, now_ms: u64) -> u32 {
        self.inner.open(now_ms)
    }

    fn feed(&mut self, conn: u32, data: &[u8], now_ms: u64) {
        self.inner.feed(conn, data, now_ms)
    }

    fn closed(&mut self, conn: u32, now_ms: u64) {
        self.inner.closed(conn, now_ms)
    }

    fn set_writable(&mut self, conn: u32, writable: bool, now_ms: u64) {
        self.inner.set_writable(conn, writable, now_ms)
    }

    fn tick(&mut self, now_ms: u64) {
        self.inner.tick(now_ms)
    }

    fn publish(
        &mut self,
        topic: &str,
        payload: &[u8],
        qos: u8,
        retain: bool,
        now_ms: u64,
    ) -> PyResult<()> {
        let qos =
            QoS::from_u8(qos).ok_or_else(|| PyValueError::new_err("qos must be 0, 1 or 2"))?;
        if !crate::topics::valid_topic_name(topic.as_bytes()) {
            return Err(PyValueError::new_err(format!(
                "invalid topic name {topic:?}"
            )));
        }
        self.inner.publish(topic, payload, qos, retain, now_ms);
        Ok(())
    }

    fn has_output(&self) -> bool {
        self.inner.has_output()
    }

    fn drain<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        let mut err = None;
        self.inner.drain(|id, data, close| {
            let item = (id, PyBytes::new(py, data), close);
            if let Err(e) = list.append(item) {
                err.get_or_insert(e);
            }
        });
        match err {
            Some(e) => Err(e),
            None => Ok(list),
        }
    }

    fn set_wall_clock(&mut self, wall_ms: u64, now_ms: u64) {
        self.inner.set_wall_clock(wall_ms, now_ms)
    }

    fn has_store_ops(&self) -> bool {
        self.inner.has_store_ops()
    }

    fn take_store_ops<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (key, value) in self.inner.take_store_ops() {
            let key = PyBytes::new(py, &key);
            match value {
                Some(v) => list.append((key, PyBytes::new(py, &v)))?,
                None => list.append((key, py.None()))?,
            }
        }
        Ok(list)
    }

    fn store_failed(&mut self, now_ms: u64) -> Vec<u32> {
        self.inner.store_failed(now_ms)
    }

    fn restore<'py>(
        &mut self,
        py: Python<'py>,
        records: Vec<(Vec<u8>, Vec<u8>)>,
    ) -> PyResult<Bound<'py, PyList>> {
        let refs: Vec<(&[u8], &[u8])> = records
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_slice()))
            .collect();
        let list = PyList::empty(py);
        for (key, why) in self.inner.restore(&refs) {
            list.append((PyBytes::new(py, &key), why))?;
        }
        Ok(list)
    }

    fn finish_restore<'py>(
        &mut self,
        py: Python<'py>,
        now_ms: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.finish_restore(now_ms);
        let d = PyDict::new(py);
        d.set_item("sessions", s.sessions)?;
        d.set_item("messages", s.messages)?;
        d.set_item("inflight", s.inflight)?;
        d.set_item("retained", s.retained)?;
        d.set_item("orphans", s.orphans)?;
        d.set_item("expired_sessions", s.expired_sessions)?;
        Ok(d)
    }

    fn events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (kind, client, detail) in self.inner.take_events() {
            list.append((kind, &*client, detail))?;
        }
        Ok(list)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("clients_connected", s.clients_connected)?;
        d.set_item("sessions", self.inner.session_count())?;
        d.set_item("subscriptions", self.inner.subscription_count())?;
        d.set_item("retained", self.inner.retained_count())?;
        d.set_item("messages_received", s.messages_received)?;
        d.set_item("messages_sent", s.messages_sent)?;
        d.set_item("bytes_received", s.bytes_received)?;
        d.set_item("bytes_sent", s.bytes_sent)?;
        d.set_item("publish_dropped", s.publish_dropped)?;
        d.set_item("inflight", self.inner.inflight_count())?;
        d.set_item("queued", self.inner.queued_count())?;
        Ok(d)
    }
}

#[pymodule]
fn fastbroker_core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyEngine>()?;
    crate::py_codec::register(m)?;
    crate::py_cluster::register(m)?;
    Ok(())
}
