//! Output to a client held until the session state it makes the client act on is copied
//! (docs/cluster-sessions.md): a QoS 2 PUBLISH or a PUBREL to a client of a persistent
//! session leaves only once every other owner that is up holds the flight record that
//! says it was sent (acknowledgements wait for `ack_replicas - 1` of them). Otherwise a
//! home SIGKILLed right after could leave copies that say "queued" for a message the
//! client took (sent again under a new packet id: twice), or "awaiting PUBREC" for one it
//! completed, and the new home could give another message a packet id the client still
//! holds as awaiting PUBREL (taken as a repeat: lost).
//! Everything written to the connection after the held packet waits with it, so order is
//! kept. QoS 0 and 1 need no wait (a repeated QoS 1 message is allowed). Owners out of
//! reach are waited for on the side of a split that does not act (`cluster_authority`).

use std::collections::{HashMap, HashSet};

use super::cluster::PeerId;
use super::state::SessionId;
use super::{ConnId, Engine};
use crate::codec::QoS;

/// Where the copies queued after a moment start, in `replicas.waits` and `gate_waits`.
#[derive(Clone, Copy)]
pub(super) struct WaitMark {
    acks: usize,
    gates: usize,
}

/// Output of one connection held from `from` on until its copies are acknowledged.
struct Gate {
    /// The connection's serial (ids are reused).
    serial: u64,
    from: usize,
    waits: Vec<(PeerId, u64)>,
}

#[derive(Default)]
pub(super) struct Gates {
    held: HashMap<ConnId, Gate>,
}

impl Gates {
    /// The bytes of connection `id` (of `serial`) that may be written now, if it is held.
    pub(super) fn open_len(&self, id: ConnId, serial: u64) -> Option<usize> {
        if self.held.is_empty() {
            return None;
        }
        self.held
            .get(&id)
            .filter(|g| g.serial == serial)
            .map(|g| g.from)
    }

    /// The first `n` bytes of connection `id`'s output were written: the held part moves.
    pub(super) fn written(&mut self, id: ConnId, n: usize) {
        if let Some(g) = self.held.get_mut(&id) {
            g.from -= n.min(g.from);
        }
    }

    pub(super) fn drop_conn(&mut self, id: ConnId) {
        if !self.held.is_empty() {
            self.held.remove(&id);
        }
    }
}

impl Engine {
    /// Where the copies queued from now on start (`gate_output`).
    pub(super) fn wait_mark(&self) -> WaitMark {
        WaitMark {
            acks: self.replicas.waits.len(),
            gates: self.replicas.gate_waits.len(),
        }
    }

    /// What connection `cid` got from byte `from` of its output on waits for the copies
    /// queued since `mark`, if any were: on every other owner in reach, not only the
    /// `ack_replicas - 1` an acknowledgement waits for. In a partial split (docs/chaos.md)
    /// a home sent QoS 2 with one owner's word while the other, its link silent, kept a
    /// copy without the flight, and served that copy later: the client got it twice.
    pub(super) fn gate_output(&mut self, cid: ConnId, from: usize, mark: WaitMark) {
        let gates = mark.gates.min(self.replicas.gate_waits.len());
        let mut new: Vec<(PeerId, u64)> = self.replicas.gate_waits.drain(gates..).collect();
        new.extend_from_slice(self.replicas.waits.get(mark.acks..).unwrap_or_default());
        if new.is_empty() {
            return;
        }
        let Some(serial) = self.conn(cid).map(|c| c.serial) else {
            return;
        };
        let gate = self.gates.held.entry(cid).or_insert_with(|| Gate {
            serial,
            from,
            waits: Vec::new(),
        });
        if gate.serial != serial {
            *gate = Gate {
                serial,
                from,
                waits: Vec::new(),
            };
        }
        gate.from = gate.from.min(from);
        gate.waits.extend(new);
    }

    /// Session `sid` resumed on connection `cid`, which got its QoS 2 flows again from
    /// byte `from` on. On the side of a split that does not act, the owners out of reach
    /// may lack the flight records of those flows (written as the split began, or held
    /// when the client left): the copy a version on the other side is made of would send
    /// again what the client completes here. So they wait, as when first sent, until every
    /// owner has acknowledged what was queued for it so far.
    pub(super) fn gate_resumed(&mut self, sid: SessionId, cid: ConnId, from: usize) {
        let qos2 = self.session(sid).is_some_and(|s| {
            s.inflight
                .iter()
                .any(|f| f.delivery.qos == QoS::ExactlyOnce)
        });
        if !qos2 || self.gates_pass_down_owners() {
            return;
        }
        let client = self.session(sid).expect("checked").client_id.clone();
        let mark = self.wait_mark();
        for p in self.replicas.other_owners(&client) {
            let seq = self.cluster.last_reliable(p);
            if seq != 0 {
                self.replicas.waits.push((p, seq));
            }
        }
        self.gate_output(cid, from, mark);
        self.release_gates();
    }

    /// Connections whose copies are acknowledged (or whose owners went down, on the side of
    /// a split that acts: `cluster_authority`) write again, unless their session waits for
    /// the word of a node back from a split (it may have a newer version, made from a copy
    /// the acknowledgement just brought up to date: the client would get this twice).
    pub(super) fn release_gates(&mut self) {
        if self.gates.held.is_empty() {
            return;
        }
        let acts = self.gates_pass_down_owners();
        let waiting: HashSet<ConnId> = if !self.any_unconfirmed() {
            HashSet::new()
        } else {
            self.gates
                .held
                .keys()
                .copied()
                .filter(|&id| {
                    self.conn(id)
                        .and_then(|c| c.session)
                        .is_some_and(|sid| self.unconfirmed(sid))
                })
                .collect()
        };
        let mut open = Vec::new();
        let cluster = &self.cluster;
        self.gates.held.retain(|&id, g| {
            g.waits.retain(|&(p, seq)| {
                if acts {
                    cluster.awaits(p, seq)
                } else {
                    cluster.awaits_even_down(p, seq)
                }
            });
            if g.waits.is_empty() && !waiting.contains(&id) {
                open.push(id);
                false
            } else {
                true
            }
        });
        for id in open {
            self.mark_dirty(id);
        }
    }
}
