//! The stored form of durable broker state (sans-I/O: the engine produces records, the
//! caller's store writes and reads them).
//!
//! - `envelope`: version, checksum and compression around every value.
//! - `records`: the keys (kind, then client id or topic) and record bodies.
//! - `wire`: the integer and byte-string encoding the bodies are made of.

pub mod envelope;
pub mod records;
pub(crate) mod wire;

pub use wire::BodyError;
