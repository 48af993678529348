"""fastbroker: a performance-first MQTT broker (Rust engine, asyncio/uvloop control plane)."""

__version__ = "0.1.0"
