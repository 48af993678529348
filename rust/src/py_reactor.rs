//! `fastbroker_core.Reactor`: the compiled connection layer (crate::reactor) for Python.

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::py::PyEngine;
use crate::reactor::{Reactor, ReactorSettings};

/// Plain TCP client sockets served in Rust; see `fastbroker_core.pyi`.
#[pyclass(name = "Reactor", module = "fastbroker_core", unsendable)]
pub struct PyReactor {
    inner: Reactor,
}

#[pymethods]
impl PyReactor {
    #[new]
    #[pyo3(signature = (read_budget, write_high, linger_ms, max_sockets=0, connection_rate=0.0))]
    fn new(
        read_budget: usize,
        write_high: usize,
        linger_ms: u64,
        max_sockets: usize,
        connection_rate: f64,
    ) -> PyResult<Self> {
        let settings = ReactorSettings {
            read_budget,
            write_high,
            linger_ms,
            max_sockets,
            connection_rate,
        };
        let inner = Reactor::new(settings).map_err(|e| PyOSError::new_err(e.to_string()))?;
        Ok(PyReactor { inner })
    }

    fn fileno(&self) -> i32 {
        self.inner.fd()
    }

    fn add_listener(&mut self, fd: i32) -> PyResult<u16> {
        self.inner
            .add_listener(fd)
            .map_err(|e| PyOSError::new_err(e.to_string()))
    }

    fn close_listener(&mut self, index: u16) {
        self.inner.close_listener(index)
    }

    fn poll(&mut self, mut engine: PyRefMut<'_, PyEngine>, now_ms: u64, external: usize) -> bool {
        self.inner.external_sockets = external;
        self.inner.poll(&mut engine.inner, now_ms)
    }

    /// (the other layer's output as Engine.drain gives it, whether to flush again).
    fn drain<'py>(
        &mut self,
        py: Python<'py>,
        mut engine: PyRefMut<'_, PyEngine>,
        now_ms: u64,
    ) -> PyResult<(Bound<'py, PyList>, bool)> {
        let list = PyList::empty(py);
        let mut err = None;
        let again = self
            .inner
            .drain(&mut engine.inner, now_ms, |id, data, close| {
                if let Err(e) = list.append((id, PyBytes::new(py, data), close)) {
                    err.get_or_insert(e);
                }
            });
        match err {
            Some(e) => Err(e),
            None => Ok((list, again)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn adopt_link(
        &mut self,
        fd: i32,
        peer: u16,
        initial: &[u8],
        max_frame: usize,
        mut engine: PyRefMut<'_, PyEngine>,
        now_ms: u64,
    ) -> PyResult<u64> {
        self.inner
            .adopt_link(fd, peer, initial, max_frame, &mut engine.inner, now_ms)
            .map_err(|e| PyOSError::new_err(e.to_string()))
    }

    fn link_write(
        &mut self,
        link: u64,
        data: &[u8],
        frames: u64,
        mut engine: PyRefMut<'_, PyEngine>,
    ) -> bool {
        self.inner.link_write(link, data, frames, &mut engine.inner)
    }

    fn link_close(&mut self, link: u64, abort: bool, mut engine: PyRefMut<'_, PyEngine>) {
        self.inner.link_close(link, abort, &mut engine.inner)
    }

    fn link_buffered(&self, link: u64) -> usize {
        self.inner.link_buffered(link)
    }

    fn link_stats(&self, link: u64) -> Option<(u64, u64, u64, u64, u64)> {
        self.inner.link_stats(link).map(|s| {
            (
                s.bytes_in,
                s.bytes_out,
                s.frames_in,
                s.frames_out,
                s.last_read_ms,
            )
        })
    }

    fn take_ended_links(&mut self) -> Vec<(u64, String)> {
        self.inner.take_ended_links()
    }

    fn drain_cluster<'py>(
        &mut self,
        py: Python<'py>,
        mut engine: PyRefMut<'_, PyEngine>,
    ) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        let mut err = None;
        self.inner.drain_cluster(&mut engine.inner, |peer, frame| {
            if let Err(e) = list.append((peer, PyBytes::new(py, frame))) {
                err.get_or_insert(e);
            }
        });
        match err {
            Some(e) => Err(e),
            None => Ok(list),
        }
    }

    fn owns(&self, conn: u32) -> bool {
        self.inner.owns(conn)
    }

    /// ((host, port), listener index, serial) of a connection open here or just ended, or
    /// None.
    fn peer(&self, conn: u32) -> Option<((String, u16), u16, u64)> {
        self.inner.peer(conn).map(|(addr, listener, serial)| {
            ((addr.ip().to_string(), addr.port()), listener, serial)
        })
    }

    fn take_closed(&mut self) -> Vec<u32> {
        self.inner.take_closed()
    }

    fn resume(&mut self, conn: u32) {
        self.inner.resume(conn)
    }

    fn set_memory_pressure(&mut self, pressure: bool) -> usize {
        self.inner.set_memory_pressure(pressure)
    }

    fn memory_held(&self) -> usize {
        self.inner.memory_held()
    }

    fn set_reading(&mut self, reading: bool) {
        self.inner.set_reading(reading)
    }

    fn tick(&mut self, mut engine: PyRefMut<'_, PyEngine>, now_ms: u64) -> bool {
        self.inner.tick(&mut engine.inner, now_ms)
    }

    fn linger_all(&mut self, mut engine: PyRefMut<'_, PyEngine>, now_ms: u64) {
        self.inner.shutting_down = true;
        self.inner.linger_all(&mut engine.inner, now_ms)
    }

    fn abort_all(&mut self, mut engine: PyRefMut<'_, PyEngine>, now_ms: u64) {
        self.inner.abort_all(&mut engine.inner, now_ms, None)
    }

    fn abort(&mut self, conn: u32, mut engine: PyRefMut<'_, PyEngine>, now_ms: u64) {
        self.inner.abort(conn, &mut engine.inner, now_ms)
    }

    fn admit_external(&mut self, now_ms: u64, external: usize) -> bool {
        self.inner.external_sockets = external;
        self.inner.admit_external(now_ms)
    }

    fn listener_counts(&self) -> Vec<usize> {
        self.inner.listener_counts()
    }

    #[getter]
    fn count(&self) -> usize {
        self.inner.count()
    }

    #[getter]
    fn refused(&self) -> u64 {
        self.inner.refused
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyReactor>()
}
