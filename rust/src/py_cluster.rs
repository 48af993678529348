//! Python bindings of the cluster wire format (`crate::cluster`): `encode_value`,
//! `decode_value`, `encode_frame`, `FrameDecoder` and `FrameError`. Python objects are
//! converted straight to and from the bytes, with no intermediate `Value` tree.

use std::borrow::Cow;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};

use crate::cluster::frame::{finish_frame, start_frame, FrameDecoder, DEFAULT_MAX_FRAME};
use crate::cluster::wire::{decode_with, Build, WireError, Writer, MAX_DEPTH};

create_exception!(
    fastbroker_core,
    FrameError,
    PyValueError,
    "Bytes from a peer are not a valid frame or value: drop the connection."
);

/// Decoding errors: the peer's fault.
impl From<WireError> for PyErr {
    fn from(e: WireError) -> PyErr {
        FrameError::new_err(e.to_string())
    }
}

/// Encoding errors: the caller's fault, a plain ValueError.
fn encode_error(e: WireError) -> PyErr {
    match e {
        WireError::TooDeep => PyValueError::new_err(format!(
            "containers nested deeper than {MAX_DEPTH} (or a container holding itself)"
        )),
        e => PyValueError::new_err(e.to_string()),
    }
}

fn encode_py(obj: &Bound<'_, PyAny>, w: &mut Writer, depth: usize) -> PyResult<()> {
    // bool before int: Python's bool is an int.
    if obj.is_none() {
        w.none();
    } else if let Ok(b) = obj.cast::<PyBool>() {
        w.bool(b.is_true());
    } else if let Ok(i) = obj.cast::<PyInt>() {
        let v: i64 = i
            .extract()
            .map_err(|_| PyValueError::new_err("int out of the i64 range"))?;
        w.int(v);
    } else if let Ok(s) = obj.cast::<PyString>() {
        let s = s
            .to_str()
            .map_err(|_| PyValueError::new_err("str with a lone surrogate is not UTF-8"))?;
        w.str(s);
    } else if let Ok(f) = obj.cast::<PyFloat>() {
        w.float(f.value());
    } else if let Ok(b) = obj.cast::<PyBytes>() {
        w.bytes(b.as_bytes());
    } else if let Ok(b) = obj.cast::<PyByteArray>() {
        w.bytes(&b.to_vec());
    } else if let Ok(l) = obj.cast::<PyList>() {
        let n = l.len();
        w.list(n, depth).map_err(encode_error)?;
        let mut written = 0;
        for item in l.iter() {
            encode_py(&item, w, depth + 1)?;
            written += 1;
        }
        check_count(n, written)?;
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        w.list(t.len(), depth).map_err(encode_error)?;
        for item in t.iter() {
            encode_py(&item, w, depth + 1)?;
        }
    } else if let Ok(d) = obj.cast::<PyDict>() {
        let n = d.len();
        w.dict(n, depth).map_err(encode_error)?;
        let mut written = 0;
        for (k, v) in d.iter() {
            encode_py(&k, w, depth + 1)?;
            encode_py(&v, w, depth + 1)?;
            written += 1;
        }
        check_count(n, written)?;
    } else {
        return Err(PyValueError::new_err(format!(
            "cannot encode a value of type {}",
            obj.get_type().name()?
        )));
    }
    Ok(())
}

/// No Python code runs while a container is encoded, so it cannot change size; checked
/// anyway because a wrong count would corrupt the stream for the peer.
fn check_count(announced: usize, written: usize) -> PyResult<()> {
    if announced == written {
        Ok(())
    } else {
        Err(PyValueError::new_err(
            "container changed size while encoded",
        ))
    }
}

/// Builds Python objects: lists are lists (tuples were encoded as lists too), except as dict
/// keys, where they become tuples so that they can be keys again.
struct PyBuilder<'py> {
    py: Python<'py>,
}

/// A list in a dict key, recursively as tuples.
fn key_form<'py>(k: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    match k.cast_into::<PyList>() {
        Ok(l) => {
            let items = l.iter().map(key_form).collect::<PyResult<Vec<_>>>()?;
            Ok(PyTuple::new(l.py(), items)?.into_any())
        }
        Err(e) => Ok(e.into_inner()),
    }
}

impl<'py> Build for PyBuilder<'py> {
    type Out = Bound<'py, PyAny>;
    type Error = PyErr;

    fn none(&mut self) -> PyResult<Self::Out> {
        Ok(self.py.None().into_bound(self.py))
    }

    fn bool(&mut self, v: bool) -> PyResult<Self::Out> {
        Ok(PyBool::new(self.py, v).to_owned().into_any())
    }

    fn int(&mut self, v: i64) -> PyResult<Self::Out> {
        Ok(v.into_pyobject(self.py)?.into_any())
    }

    fn float(&mut self, v: f64) -> PyResult<Self::Out> {
        Ok(PyFloat::new(self.py, v).into_any())
    }

    fn str(&mut self, v: &str) -> PyResult<Self::Out> {
        Ok(PyString::new(self.py, v).into_any())
    }

    fn bytes(&mut self, v: &[u8]) -> PyResult<Self::Out> {
        Ok(PyBytes::new(self.py, v).into_any())
    }

    fn list(&mut self, items: Vec<Self::Out>) -> PyResult<Self::Out> {
        Ok(PyList::new(self.py, items)?.into_any())
    }

    fn dict(&mut self, pairs: Vec<(Self::Out, Self::Out)>) -> PyResult<Self::Out> {
        let d = PyDict::new(self.py);
        for (k, v) in pairs {
            // A dict in a key is unhashable: well-formed bytes, but no Python value.
            d.set_item(key_form(k)?, v)
                .map_err(|e| FrameError::new_err(format!("unusable dict key: {e}")))?;
        }
        Ok(d.into_any())
    }
}

/// The encoding of one value.
#[pyfunction]
fn encode_value<'py>(py: Python<'py>, value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let mut w = Writer::default();
    encode_py(value, &mut w, 0)?;
    Ok(PyBytes::new(py, &w.buf))
}

/// The value encoded in all of `data`.
#[pyfunction]
fn decode_value<'py>(py: Python<'py>, data: Cow<'_, [u8]>) -> PyResult<Bound<'py, PyAny>> {
    decode_with(&data, &mut PyBuilder { py })
}

/// One whole frame: length, kind, value.
#[pyfunction]
fn encode_frame<'py>(
    py: Python<'py>,
    kind: &Bound<'py, PyAny>,
    value: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let kind: u8 = kind
        .extract()
        .map_err(|_| PyValueError::new_err("kind must be an int in 0..255"))?;
    let mut w = Writer::default();
    let start = start_frame(&mut w, kind);
    encode_py(value, &mut w, 0)?;
    finish_frame(&mut w, start).map_err(encode_error)?;
    Ok(PyBytes::new(py, &w.buf))
}

// The default of `FrameDecoder.__new__` below is this constant, written out.
const _: () = assert!(DEFAULT_MAX_FRAME == 16_777_216);

/// Incremental frame decoder over one connection; see `fastbroker_core.pyi`.
#[pyclass(name = "FrameDecoder", module = "fastbroker_core")]
pub struct PyFrameDecoder {
    inner: FrameDecoder,
    /// A broken stream stays broken: later feeds raise the same message.
    failed: Option<String>,
}

#[pymethods]
impl PyFrameDecoder {
    #[new]
    // A literal (16 MiB) so that the Python signature shows it.
    #[pyo3(signature = (max_frame = 16_777_216))]
    fn new(max_frame: usize) -> PyResult<Self> {
        if max_frame == 0 {
            return Err(PyValueError::new_err("max_frame must be at least 1"));
        }
        Ok(PyFrameDecoder {
            inner: FrameDecoder::new(max_frame),
            failed: None,
        })
    }

    fn feed<'py>(&mut self, py: Python<'py>, data: Cow<'_, [u8]>) -> PyResult<Bound<'py, PyList>> {
        if let Some(msg) = &self.failed {
            return Err(FrameError::new_err(msg.clone()));
        }
        self.inner.extend(&data);
        let out = PyList::empty(py);
        let mut builder = PyBuilder { py };
        loop {
            let frame = match self.inner.next_raw() {
                Ok(None) => return Ok(out),
                Ok(Some((kind, body))) => decode_with(body, &mut builder).map(|v| (kind, v)),
                Err(e) => Err(e.into()),
            };
            match frame {
                Ok(kind_value) => out.append(kind_value)?,
                Err(e) => {
                    self.failed = Some(e.value(py).to_string());
                    return Err(e);
                }
            }
        }
    }

    #[getter]
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }

    fn take_buffered<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.take_buffered())
    }
}

/// Adds `FrameError`, `FrameDecoder`, `encode_value`, `decode_value` and `encode_frame`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FrameError", m.py().get_type::<FrameError>())?;
    m.add_class::<PyFrameDecoder>()?;
    m.add_function(wrap_pyfunction!(encode_value, m)?)?;
    m.add_function(wrap_pyfunction!(decode_value, m)?)?;
    m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
    Ok(())
}
