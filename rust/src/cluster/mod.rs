//! Inter-node communication of a fastbroker cluster: the wire format of the one TCP
//! connection between each pair of nodes (the control plane driving it is Python).
//!
//! - `wire`: the value encoding ([`Value`], [`Writer`], [`decode_with`]).
//! - `frame`: length-prefixed frames of a kind and a value, and the [`FrameDecoder`].
//! - `batch`: the data plane's batches (route rows, forwarded messages, acknowledgements),
//!   one frame per peer per loop iteration, made and read by the engine.

pub mod batch;
pub mod frame;
pub mod wire;

pub use frame::{encode_frame, FrameDecoder, DEFAULT_MAX_FRAME};
pub use wire::{decode_with, Build, Value, WireError, Writer, MAX_DEPTH};
