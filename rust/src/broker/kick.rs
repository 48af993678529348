//! An administrator ends a client's connection and session: on this node, and through the
//! cluster's batches on every other (`cluster_kick`); or asks whether this node holds one.

use super::Engine;

impl Engine {
    /// Kicks `client_id`: its connection is closed (MQTT 5: DISCONNECT 0x98, administrative
    /// action) and its session discarded, queued messages included. With `cluster`, every
    /// reachable peer does the same. True if this node held a session for it.
    pub fn kick(&mut self, client_id: &str, cluster: bool, now: u64) -> bool {
        self.last_now = now;
        if cluster {
            self.cluster_kick(client_id);
        }
        self.kick_local(client_id, now)
    }

    /// Whether this node holds a session of `client_id` (`Some(connected)`): one that moved
    /// to another node and only relays there does not count. For operators and the fault
    /// suite's final reads (one session per client id across the cluster).
    pub fn session_held(&self, client_id: &str) -> Option<bool> {
        let &sid = self.by_client.get(client_id)?;
        self.session(sid).map(|s| s.conn.is_some())
    }

    /// The will goes as for any end the client did not ask for (MQTT-3.1.2-8).
    pub(super) fn kick_local(&mut self, client_id: &str, now: u64) -> bool {
        let Some(&sid) = self.by_client.get(client_id) else {
            return false;
        };
        let Some((conn, id)) = self.session(sid).map(|s| (s.conn, s.client_id.clone())) else {
            return false;
        };
        if let Some(conn) = conn {
            self.close(conn, Some(0x98), "kicked by an administrator", true, now);
        }
        self.end_session(sid, now);
        self.event("kick", id, String::new());
        true
    }
}
