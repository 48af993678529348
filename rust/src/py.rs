//! The Python module `fastbroker_core`: the codec (for tests and tools) and the engine.

use std::sync::Arc;

use bytes::Bytes;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};

use crate::broker::{acl, Config, Engine, Permissions, Value, Verdict, THIS_NODE};
use crate::codec::QoS;

/// Allow-only rules of what a connection may do; see `fastbroker_core.pyi`.
#[pyclass(name = "Permissions", module = "fastbroker_core", frozen)]
pub struct PyPermissions {
    inner: Arc<Permissions>,
}

#[pymethods]
impl PyPermissions {
    #[classattr]
    const PUBLISH: u8 = acl::PUBLISH;
    #[classattr]
    const SUBSCRIBE: u8 = acl::SUBSCRIBE;
    #[classattr]
    const READ: u8 = acl::READ;

    #[new]
    fn new(rules: Vec<(i64, String)>) -> PyResult<Self> {
        let mut checked = Vec::with_capacity(rules.len());
        for (rights, filter) in rules {
            let rights = u8::try_from(rights).map_err(|_| {
                PyValueError::new_err(format!(
                    "rights {rights} of rule {filter:?} is not a mask of 1, 2 and 4"
                ))
            })?;
            checked.push((rights, filter));
        }
        let inner = Permissions::new(checked).map_err(PyValueError::new_err)?;
        Ok(PyPermissions {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn rules(&self) -> Vec<(u8, String)> {
        self.inner.rules().to_vec()
    }

    fn allows(&self, right: u8, topic: &str) -> bool {
        self.inner.allows(right, topic.as_bytes())
    }

    fn covers(&self, right: u8, filter: &str) -> bool {
        self.inner.covers(right, filter)
    }

    fn __repr__(&self) -> String {
        format!("Permissions({:?})", self.inner.rules())
    }
}

fn permissions_of(p: Option<PyRef<'_, PyPermissions>>) -> Option<Arc<Permissions>> {
    p.map(|p| p.inner.clone())
}

fn opt_bytes<'py>(py: Python<'py>, b: &Option<Bytes>) -> Option<Bound<'py, PyBytes>> {
    b.as_ref().map(|b| PyBytes::new(py, b))
}

/// The broker engine; see `fastbroker_core.pyi` for the contract.
#[pyclass(name = "Engine", module = "fastbroker_core", unsendable)]
pub struct PyEngine {
    pub(crate) inner: Engine,
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

    fn feed(&mut self, conn: u32, data: &[u8], now_ms: u64) -> u8 {
        self.inner.feed(conn, data, now_ms)
    }

    #[pyo3(signature = (conn, now_ms, reason=None))]
    fn closed(&mut self, conn: u32, now_ms: u64, reason: Option<&str>) {
        self.inner.closed_because(conn, now_ms, reason)
    }

    #[pyo3(signature = (detail, now_ms, server_reference = None))]
    fn close_all(&mut self, detail: &str, now_ms: u64, server_reference: Option<&str>) {
        self.inner.close_all(detail, server_reference, now_ms)
    }

    fn take_resumed(&mut self) -> Vec<u32> {
        self.inner.take_resumed()
    }

    fn has_resumed(&self) -> bool {
        self.inner.has_resumed()
    }

    fn has_auth_requests(&self) -> bool {
        self.inner.has_auth_requests()
    }

    fn auth_requests<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for r in self.inner.take_auth_requests() {
            let item = PyTuple::new(
                py,
                [
                    r.conn.into_pyobject(py)?.into_any(),
                    r.kind.into_pyobject(py)?.into_any(),
                    (&*r.client_id).into_pyobject(py)?.into_any(),
                    r.username.as_deref().into_pyobject(py)?.into_any(),
                    opt_bytes(py, &r.password).into_pyobject(py)?.into_any(),
                    r.protocol_level.into_pyobject(py)?.into_any(),
                    r.auth_method.as_deref().into_pyobject(py)?.into_any(),
                    opt_bytes(py, &r.auth_data).into_pyobject(py)?.into_any(),
                ],
            )?;
            list.append(item)?;
        }
        Ok(list)
    }

    #[pyo3(signature = (conn, reason_code, permissions=None, now_ms=0, auth_method=None,
        auth_data=None, reason=None))]
    #[allow(clippy::too_many_arguments)]
    fn auth_done(
        &mut self,
        conn: u32,
        reason_code: u8,
        permissions: Option<PyRef<'_, PyPermissions>>,
        now_ms: u64,
        auth_method: Option<String>,
        auth_data: Option<Vec<u8>>,
        reason: Option<String>,
    ) {
        self.inner.auth_done(
            conn,
            reason_code,
            permissions_of(permissions),
            now_ms,
            auth_method,
            auth_data.map(Bytes::from),
            reason,
        )
    }

    #[pyo3(signature = (conn, auth_method, auth_data, now_ms))]
    fn auth_continue(
        &mut self,
        conn: u32,
        auth_method: String,
        auth_data: Option<Vec<u8>>,
        now_ms: u64,
    ) {
        self.inner
            .auth_continue(conn, auth_method, auth_data.map(Bytes::from), now_ms)
    }

    #[pyo3(signature = (conn, permissions))]
    fn set_permissions(&mut self, conn: u32, permissions: Option<PyRef<'_, PyPermissions>>) {
        self.inner
            .set_permissions(conn, permissions_of(permissions))
    }

    fn has_intercepted(&self) -> bool {
        self.inner.has_intercepted()
    }

    fn take_intercepted<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for m in self.inner.take_intercepted() {
            let topic = String::from_utf8_lossy(&m.topic);
            list.append((
                m.ticket,
                m.conn,
                &*m.client_id,
                m.username.as_deref(),
                topic,
                PyBytes::new(py, &m.payload),
                m.qos,
                m.retain,
            ))?;
        }
        Ok(list)
    }

    #[pyo3(signature = (ticket, action, topic=None, payload=None, now_ms=0))]
    fn release(
        &mut self,
        ticket: u64,
        action: u8,
        topic: Option<&str>,
        payload: Option<Vec<u8>>,
        now_ms: u64,
    ) -> PyResult<()> {
        let verdict = match action {
            0 => Verdict::Route,
            1 => Verdict::Drop,
            2 => Verdict::Deny,
            _ => return Err(PyValueError::new_err("action must be 0, 1 or 2")),
        };
        self.inner
            .release(ticket, verdict, topic, payload.map(Bytes::from), now_ms);
        Ok(())
    }

    fn has_access_events(&self) -> bool {
        self.inner.has_access_events()
    }

    fn take_access_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (kind, conn, client_id, username, level, code, reason) in
            self.inner.take_access_events()
        {
            list.append((
                kind,
                conn,
                &*client_id,
                username.as_deref(),
                level,
                code,
                reason,
            ))?;
        }
        Ok(list)
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

    // -- the cluster part (crate::broker::cluster) ---------------------------------------

    fn cluster_start(&mut self, epoch: u64, node: &str) {
        self.inner.cluster_start(epoch, node)
    }

    fn cluster_require_map(&mut self) {
        self.inner.cluster_require_map()
    }

    fn cluster_step_aside(&mut self, on: bool, now_ms: u64) {
        self.inner.cluster_step_aside(on, now_ms)
    }

    fn cluster_peer_alive(&mut self, peer: u16, alive: bool) {
        self.inner.cluster_peer_alive(peer, alive)
    }

    fn cluster_store_recovered(&mut self, now_ms: u64) {
        self.inner.cluster_store_recovered(now_ms)
    }

    fn cluster_add_peer(&mut self, name: &str) -> u16 {
        self.inner.cluster_add_peer(name)
    }

    fn cluster_remove_peer(&mut self, peer: u16) {
        self.inner.cluster_remove_peer(peer)
    }

    fn cluster_link(&mut self, peer: u16, up: bool) {
        self.inner.cluster_link(peer, up)
    }

    fn cluster_link_lost(&mut self, peer: u16, silent_ms: u64) {
        self.inner.cluster_link_lost(peer, silent_ms)
    }

    /// This node left the cluster and closed its connections: its sessions go to their
    /// owners (broker::cluster_leave). Returns how many.
    fn cluster_hand_over_all(&mut self, now_ms: u64) -> usize {
        self.inner.cluster_hand_over_all(now_ms)
    }

    /// Sessions this node still relays for after handing them over.
    fn cluster_relays(&self) -> usize {
        self.inner.cluster_relays()
    }

    fn cluster_set_writable(&mut self, peer: u16, writable: bool) {
        self.inner.cluster_set_writable(peer, writable)
    }

    fn cluster_set_protocol(&mut self, peer: u16, version: u16) {
        self.inner.cluster_set_protocol(peer, version)
    }

    /// Ends `client_id`'s connection (DISCONNECT 0x98) and session here and, with `cluster`,
    /// on every reachable peer; true if this node held its session.
    fn kick(&mut self, client_id: &str, cluster: bool, now_ms: u64) -> bool {
        self.inner.kick(client_id, cluster, now_ms)
    }

    /// "connected" or "disconnected" if this node holds a session of `client_id`, else None.
    fn session_state(&self, client_id: &str) -> Option<&'static str> {
        self.inner
            .session_held(client_id)
            .map(|c| if c { "connected" } else { "disconnected" })
    }

    fn has_cluster_output(&self) -> bool {
        self.inner.has_cluster_output()
    }

    fn drain_cluster<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        let mut err = None;
        self.inner.drain_cluster(|peer, frame| {
            if let Err(e) = list.append((peer, PyBytes::new(py, frame))) {
                err.get_or_insert(e);
            }
        });
        match err {
            Some(e) => Err(e),
            None => Ok(list),
        }
    }

    fn has_cluster_loads(&self) -> bool {
        self.inner.has_cluster_loads()
    }

    fn cluster_loads<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (peer, keys) in self.inner.cluster_loads() {
            let keys = PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))?;
            list.append((peer, keys))?;
        }
        Ok(list)
    }

    fn cluster_loaded(
        &mut self,
        peer: u16,
        records: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    ) -> Vec<String> {
        let records: Vec<(&[u8], Option<&[u8]>)> = records
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_deref()))
            .collect();
        self.inner.cluster_loaded(peer, &records)
    }

    /// The partition map: per partition its owners as peer numbers, -1 for this node.
    fn cluster_set_map(&mut self, version: u64, owners: Vec<Vec<i32>>, now_ms: u64) {
        let owners = owners
            .into_iter()
            .map(|o| {
                o.into_iter()
                    .map(|p| u16::try_from(p).unwrap_or(THIS_NODE))
                    .collect()
            })
            .collect();
        self.inner.cluster_set_map(version, owners, now_ms)
    }

    /// The cluster's members as peer numbers, -1 for this node (before the map they own).
    fn cluster_set_members(&mut self, members: Vec<i32>) {
        let members = members
            .into_iter()
            .map(|p| u16::try_from(p).unwrap_or(THIS_NODE))
            .collect();
        self.inner.cluster_set_members(members)
    }

    fn has_copy_loads(&self) -> bool {
        self.inner.has_copy_loads()
    }

    fn copy_loads<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (client, keys) in self.inner.copy_loads() {
            let keys = PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))?;
            list.append((&*client, keys))?;
        }
        Ok(list)
    }

    fn copy_loaded(
        &mut self,
        client_id: &str,
        records: Vec<(Vec<u8>, Option<Vec<u8>>)>,
        now_ms: u64,
    ) -> Vec<String> {
        let records: Vec<(&[u8], Option<&[u8]>)> = records
            .iter()
            .map(|(k, v)| (k.as_slice(), v.as_deref()))
            .collect();
        self.inner.copy_loaded(client_id, &records, now_ms)
    }

    /// Copies of sessions between nodes (broker::cluster_replicas).
    fn replica_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.replica_stats();
        let d = PyDict::new(py);
        d.set_item("copies", s.copies)?;
        d.set_item("ops_out", s.ops_out)?;
        d.set_item("ops_in", s.ops_in)?;
        d.set_item("degraded_acks", s.degraded_acks)?;
        d.set_item("stale_refused", s.stale_refused)?;
        d.set_item("fenced", s.fenced)?;
        d.set_item("claims_served", s.claims_served)?;
        d.set_item("takeovers", s.takeovers)?;
        d.set_item("streamed", s.streamed)?;
        d.set_item("stream_backlog", s.stream_backlog)?;
        d.set_item("taken_elsewhere", s.taken_elsewhere)?;
        d.set_item("released_taken", s.released_taken)?;
        d.set_item("handed_on", s.handed_on)?;
        d.set_item("checks_out", s.checks_out)?;
        Ok(d)
    }

    fn cluster_feed(&mut self, peer: u16, data: &[u8], now_ms: u64) -> PyResult<()> {
        self.inner
            .cluster_feed(peer, data, now_ms)
            .map_err(PyValueError::new_err)
    }

    fn cluster_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (id, name, up, s) in self.inner.cluster_stats() {
            let d = PyDict::new(py);
            d.set_item("peer", id)?;
            d.set_item("node_id", &*name)?;
            d.set_item("up", up)?;
            d.set_item("frames_out", s.frames_out)?;
            d.set_item("frames_in", s.frames_in)?;
            d.set_item("messages_out", s.messages_out)?;
            d.set_item("messages_in", s.messages_in)?;
            d.set_item("bytes_out", s.bytes_out)?;
            d.set_item("bytes_in", s.bytes_in)?;
            d.set_item("resent", s.resent)?;
            d.set_item("dropped", s.dropped)?;
            d.set_item("route_rows", s.rows)?;
            d.set_item("unacked_bytes", s.unacked_bytes)?;
            d.set_item("retained_synced", s.retained_synced)?;
            d.set_item("publisher_holds", s.holds)?;
            d.set_item("spilled_bytes", s.spilled_bytes)?;
            d.set_item("read_back", s.read_back)?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// Claims of client ids between nodes (broker::cluster_sessions).
    fn claim_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.claim_stats();
        let d = PyDict::new(py);
        d.set_item("made", s.made)?;
        d.set_item("timed_out", s.timed_out)?;
        d.set_item("sessions_in", s.sessions_in)?;
        d.set_item("sessions_out", s.sessions_out)?;
        d.set_item("kept_handed", s.kept_handed)?;
        d.set_item("kept_read_back", s.kept_read_back)?;
        d.set_item("kept_waits_timed_out", s.kept_waits_timed_out)?;
        d.set_item("kept_reordered", s.kept_reordered)?;
        d.set_item("relay_waits", s.relay_waits)?;
        d.set_item("relay_waits_timed_out", s.relay_waits_timed_out)?;
        d.set_item("moved_home_lost", s.moved_home_lost)?;
        d.set_item("took_at_old_home", s.took_at_old_home)?;
        d.set_item("taken_told", s.taken_told)?;
        d.set_item("refused_out_of_reach", s.refused_out_of_reach)?;
        let (r, known) = self.inner.registry_stats();
        d.set_item("routed", r.routed)?;
        d.set_item("directed", r.directed)?;
        d.set_item("broadcast", r.broadcast)?;
        d.set_item("asked", r.asked)?;
        d.set_item("registry_clients", known)?;
        Ok(d)
    }

    /// Wills of other nodes' connections held here (broker::cluster_wills).
    fn will_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.will_stats();
        let d = PyDict::new(py);
        d.set_item("held", s.held)?;
        d.set_item("published", s.published)?;
        d.set_item("refused", s.refused)?;
        Ok(d)
    }

    fn cluster_local_rows(&self) -> usize {
        self.inner.cluster_local_rows()
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
        d.set_item("queued_bytes", self.inner.queued_bytes())?;
        d.set_item("publish_denied", s.publish_denied)?;
        d.set_item("subscribe_denied", s.subscribe_denied)?;
        d.set_item("connections_refused", s.connections_refused)?;
        d.set_item("access_events_dropped", s.access_events_dropped)?;
        d.set_item("held_connections", self.inner.held_count())?;
        d.set_item("intercepted_pending", self.inner.intercepted_count())?;
        d.set_item("auth_pending", self.inner.auth_pending_count())?;
        Ok(d)
    }
}

#[pymodule]
fn fastbroker_core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FEED_HOLD", crate::broker::FEED_HOLD)?;
    m.add("FEED_PUBLISHER", crate::broker::FEED_PUBLISHER)?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PyPermissions>()?;
    crate::py_codec::register(m)?;
    crate::py_cluster::register(m)?;
    crate::py_ws::register(m)?;
    #[cfg(target_os = "linux")]
    crate::py_reactor::register(m)?;
    Ok(())
}
