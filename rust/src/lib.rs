//! fastbroker-core: the compiled data plane of fastbroker.
//!
//! - `codec`: sans-I/O MQTT 3.1.1 / 5.0 packet codec.
//! - `topics`: topic validation, the subscription index and the retained-message tree.
//! - `broker`: the sans-I/O broker engine (sessions, routing, QoS flows).
//! - `cluster`: the inter-node wire format (frames of self-describing values).
//! - `ws`: the WebSocket frame codec (MQTT over WebSocket).
//! - `reactor`: the compiled connection layer (client sockets and cluster data links on one
//!   epoll set).
//! - `slots`: tables of values by small integer id, in pages that never move.
//! - `py`: the PyO3 module `fastbroker_core` (feature `python`).

pub mod broker;
pub mod cluster;
pub mod codec;
#[cfg(feature = "python")]
mod py;
#[cfg(feature = "python")]
mod py_cluster;
#[cfg(feature = "python")]
mod py_codec;
#[cfg(all(feature = "python", target_os = "linux"))]
mod py_reactor;
#[cfg(feature = "python")]
mod py_ws;
#[cfg(target_os = "linux")]
pub mod reactor;
pub mod slots;
pub mod store;
pub mod topics;
pub mod ws;
