//! Python binding of the WebSocket frame codec (`crate::ws`): `WebSocketCodec`, one per
//! connection, called once per socket read and once per batch written.

use std::borrow::Cow;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::ws::{self, Decoder, OP_BINARY};

/// Server-side WebSocket framing of one connection; see `fastbroker_core.pyi`.
#[pyclass(name = "WebSocketCodec", module = "fastbroker_core")]
pub struct PyWebSocketCodec {
    decoder: Decoder,
    payload: Vec<u8>,
    replies: Vec<u8>,
}

#[pymethods]
impl PyWebSocketCodec {
    #[new]
    // Default: the largest MQTT packet; a literal so that the Python signature shows it.
    #[pyo3(signature = (max_message_size = 268_435_460))]
    fn new(max_message_size: u64) -> PyResult<Self> {
        if max_message_size == 0 {
            return Err(PyValueError::new_err("max_message_size must be at least 1"));
        }
        Ok(PyWebSocketCodec {
            decoder: Decoder::new(max_message_size),
            payload: Vec::new(),
            replies: Vec::new(),
        })
    }

    fn decode<'py>(
        &mut self,
        py: Python<'py>,
        data: Cow<'_, [u8]>,
    ) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>, Option<u16>) {
        self.payload.clear();
        self.replies.clear();
        self.payload.reserve(data.len());
        let closed = self
            .decoder
            .decode(&data, &mut self.payload, &mut self.replies);
        let out = (
            PyBytes::new(py, &self.payload),
            PyBytes::new(py, &self.replies),
            closed,
        );
        // A huge read must not pin its buffer for the life of the connection.
        if self.payload.capacity() > 1 << 20 {
            self.payload = Vec::new();
        }
        out
    }

    fn encode<'py>(&self, py: Python<'py>, data: Cow<'_, [u8]>) -> PyResult<Bound<'py, PyBytes>> {
        let head = ws::header_len(data.len());
        // Written straight into the bytes object: one copy of the payload.
        PyBytes::new_with(py, head + data.len(), |buf| {
            let mut header = Vec::with_capacity(head);
            ws::write_header(OP_BINARY, data.len(), &mut header);
            buf[..head].copy_from_slice(&header);
            buf[head..].copy_from_slice(&data);
            Ok(())
        })
    }

    #[pyo3(signature = (code = 1000, reason = ""))]
    fn close_frame<'py>(
        &self,
        py: Python<'py>,
        code: u16,
        reason: &str,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if !ws::valid_close_code(code) {
            return Err(PyValueError::new_err(format!(
                "{code} is not a close code that may be sent"
            )));
        }
        let mut out = Vec::new();
        ws::encode_close(code, reason, &mut out);
        Ok(PyBytes::new(py, &out))
    }

    #[getter]
    fn closed(&self) -> Option<u16> {
        self.decoder.closed()
    }

    #[getter]
    fn buffered(&self) -> usize {
        self.decoder.buffered()
    }
}

/// Adds `WebSocketCodec` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyWebSocketCodec>()?;
    Ok(())
}
