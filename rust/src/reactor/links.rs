//! Data links to other cluster nodes on the reactor's epoll set (issue 15: the hop's cost).
//!
//! A data link's handshake is Python's (fastbroker.cluster.transport); once it is up, its
//! socket is handed here (`adopt_link`). From then on each DATA frame the peer sends is fed
//! to the engine as it is read, and each frame the engine makes for that peer is written in
//! the flush (`drain_cluster`): no Python per batch, and a hop's wakeup serves the client
//! sockets and the link in one poll. Python still sends keepalives (`link_write`), closes
//! links (`link_close`) and learns of ends (`take_ended_links`) and traffic (`link_stats`).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::{errno, send_some, set_nodelay, set_nonblocking, Reactor, READ_CHUNK};
use crate::broker::{Engine, PeerId};
use crate::cluster::batch::DATA_FRAME;
use crate::cluster::{FrameDecoder, Value};

/// Tokens of data links have this bit (and the link's id below it).
pub(super) const LINK_TOKEN: u64 = 1 << 62;
/// The frame kind of a data link's keepalive (transport.py's DATA_KEEPALIVE).
pub const DATA_KEEPALIVE: u8 = 33;
/// The engine is told a link is full past this many buffered bytes, and writable again
/// below `LINK_LOW` (transport.py's DATA_HIGH_WATER and DATA_LOW_WATER).
pub const LINK_HIGH: usize = 4 * 1024 * 1024;
pub const LINK_LOW: usize = 1024 * 1024;
/// Bytes read from one link per poll: a busy peer leaves room for the clients.
const LINK_READ_BUDGET: usize = 1024 * 1024;

/// Traffic of a link since it was adopted (Python adds the handshake's).
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct LinkStats {
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub frames_in: u64,
    pub frames_out: u64,
    /// When it last read anything (the poll's clock, ms).
    pub last_read_ms: u64,
}

struct Link {
    fd: OwnedFd,
    peer: PeerId,
    decoder: FrameDecoder,
    out: Vec<u8>,
    /// The engine was told this peer is not writable.
    paused: bool,
    /// Close once `out` is sent.
    closing: bool,
    interest: u32,
    stats: LinkStats,
}

/// The reactor's data links, by id (never reused, so a stale id names no other link).
#[derive(Default)]
pub(super) struct Links {
    by_id: HashMap<u64, Link>,
    by_peer: HashMap<PeerId, u64>,
    next_id: u64,
    /// Links ended since `take_ended_links`: (id, why; empty for the peer's orderly end).
    ended: Vec<(u64, String)>,
}

impl Reactor {
    /// Serves an established data link to `peer`: `fd` is the reactor's from now on (the
    /// caller gives up its own descriptor of the socket); `initial` is what was read past the
    /// handshake and not yet fed. A link the peer already had here is ended first. Returns
    /// the link's id.
    pub fn adopt_link(
        &mut self,
        fd: RawFd,
        peer: PeerId,
        initial: &[u8],
        max_frame: usize,
        engine: &mut Engine,
        now: u64,
    ) -> std::io::Result<u64> {
        // SAFETY: the caller hands this descriptor over.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        set_nonblocking(fd);
        set_nodelay(fd);
        if let Some(old) = self.links.by_peer.get(&peer).copied() {
            self.end_link(old, engine, "replaced by a new data link");
        }
        self.links.next_id += 1;
        let id = self.links.next_id;
        let interest = libc::EPOLLIN as u32;
        self.ctl(libc::EPOLL_CTL_ADD, fd, interest, LINK_TOKEN | id)?;
        let mut decoder = FrameDecoder::new(max_frame);
        decoder.extend(initial);
        self.links.by_id.insert(
            id,
            Link {
                fd: owned,
                peer,
                decoder,
                out: Vec::new(),
                paused: false,
                closing: false,
                interest,
                stats: LinkStats {
                    last_read_ms: now,
                    ..LinkStats::default()
                },
            },
        );
        self.links.by_peer.insert(peer, id);
        if !initial.is_empty() {
            self.link_frames(id, engine, now);
        }
        Ok(id)
    }

    /// Queues `data` (`frames` whole frames) on link `id` and sends what the socket takes.
    /// False if there is no such link.
    pub fn link_write(&mut self, id: u64, data: &[u8], frames: u64, engine: &mut Engine) -> bool {
        let Some(link) = self.links.by_id.get_mut(&id) else {
            return false;
        };
        link.stats.frames_out += frames;
        self.queue_on_link(id, data);
        self.link_marks(id, engine);
        true
    }

    /// Ends link `id`: at once (`abort`: what is buffered is dropped, the engine resends
    /// its unacknowledged batches on the next link), or once its buffer is sent.
    pub fn link_close(&mut self, id: u64, abort: bool, engine: &mut Engine) {
        let Some(link) = self.links.by_id.get_mut(&id) else {
            return;
        };
        if abort || link.out.is_empty() {
            self.end_link(id, engine, "");
        } else {
            link.closing = true;
        }
    }

    /// Bytes link `id` holds that the socket did not take yet.
    pub fn link_buffered(&self, id: u64) -> usize {
        self.links.by_id.get(&id).map_or(0, |l| l.out.len())
    }

    pub fn link_stats(&self, id: u64) -> Option<LinkStats> {
        self.links.by_id.get(&id).map(|l| l.stats)
    }

    /// Links ended since the last call, and why (empty: the peer closed it).
    pub fn take_ended_links(&mut self) -> Vec<(u64, String)> {
        std::mem::take(&mut self.links.ended)
    }

    /// The engine's frames for its peers: written here for the peers whose link this
    /// reactor serves, handed to `other` for the rest.
    pub fn drain_cluster(&mut self, engine: &mut Engine, mut other: impl FnMut(PeerId, &[u8])) {
        let mut written = Vec::new();
        engine.drain_cluster(|peer, frame| match self.links.by_peer.get(&peer).copied() {
            Some(id) => {
                if let Some(link) = self.links.by_id.get_mut(&id) {
                    link.stats.frames_out += 1;
                }
                self.queue_on_link(id, frame);
                if !written.contains(&id) {
                    written.push(id);
                }
            }
            None => other(peer, frame),
        });
        for id in written {
            self.link_marks(id, engine);
        }
    }

    /// Appends to the link's buffer and sends what the socket takes now.
    fn queue_on_link(&mut self, id: u64, data: &[u8]) {
        let Some(link) = self.links.by_id.get_mut(&id) else {
            return;
        };
        let fd = link.fd.as_raw_fd();
        let sent = if link.out.is_empty() {
            send_some(fd, data)
        } else {
            Some(0)
        };
        match sent {
            Some(n) => {
                link.stats.bytes_out += n as u64;
                link.out.extend_from_slice(&data[n..]);
            }
            // Broken: the read side sees the error and ends it.
            None => link.out.clear(),
        }
    }

    /// After a write: tells the engine when the buffer passed its high mark, watches for
    /// room while anything is buffered.
    fn link_marks(&mut self, id: u64, engine: &mut Engine) {
        let Some(link) = self.links.by_id.get_mut(&id) else {
            return;
        };
        if !link.paused && link.out.len() > LINK_HIGH {
            link.paused = true;
            engine.cluster_set_writable(link.peer, false);
        }
        self.link_interest(id);
    }

    fn link_interest(&mut self, id: u64) {
        let Some(link) = self.links.by_id.get(&id) else {
            return;
        };
        let mut want = libc::EPOLLIN as u32;
        if !link.out.is_empty() {
            want |= libc::EPOLLOUT as u32;
        }
        if want != link.interest {
            let fd = link.fd.as_raw_fd();
            if self
                .ctl(libc::EPOLL_CTL_MOD, fd, want, LINK_TOKEN | id)
                .is_ok()
            {
                if let Some(link) = self.links.by_id.get_mut(&id) {
                    link.interest = want;
                }
            }
        }
    }

    /// An epoll event of link `id`. Returns whether the engine may have output.
    pub(super) fn link_ready(
        &mut self,
        id: u64,
        ready: u32,
        engine: &mut Engine,
        now: u64,
    ) -> bool {
        let mut work = false;
        if ready & libc::EPOLLOUT as u32 != 0 {
            work |= self.link_send(id, engine);
        }
        let hangup = ready & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0;
        if hangup || ready & libc::EPOLLIN as u32 != 0 {
            work |= self.link_read(id, engine, now);
        }
        work
    }

    fn link_send(&mut self, id: u64, engine: &mut Engine) -> bool {
        let Some(link) = self.links.by_id.get(&id) else {
            return false;
        };
        let Some(n) = send_some(link.fd.as_raw_fd(), &link.out) else {
            self.end_link(id, engine, "write failed");
            return true;
        };
        let Some(link) = self.links.by_id.get_mut(&id) else {
            return false;
        };
        link.out.drain(..n);
        link.stats.bytes_out += n as u64;
        let mut work = false;
        if link.paused && link.out.len() < LINK_LOW {
            link.paused = false;
            engine.cluster_set_writable(link.peer, true);
            work = true;
        }
        if link.closing && link.out.is_empty() {
            self.end_link(id, engine, "");
            return work;
        }
        self.link_interest(id);
        work
    }

    fn link_read(&mut self, id: u64, engine: &mut Engine, now: u64) -> bool {
        let mut budget = LINK_READ_BUDGET;
        let mut work = false;
        while budget > 0 {
            let Some(link) = self.links.by_id.get_mut(&id) else {
                return work;
            };
            // SAFETY: reading into the reactor's buffer of READ_CHUNK bytes.
            let n = unsafe {
                libc::read(
                    link.fd.as_raw_fd(),
                    self.buf.as_mut_ptr() as *mut libc::c_void,
                    READ_CHUNK,
                )
            };
            if n < 0 {
                match errno() {
                    libc::EINTR => continue,
                    libc::EAGAIN => return work,
                    e => {
                        let why = format!("read failed: {}", std::io::Error::from_raw_os_error(e));
                        self.end_link(id, engine, &why);
                        return true;
                    }
                }
            }
            if n == 0 {
                self.end_link(id, engine, "");
                return true;
            }
            let n = n as usize;
            budget = budget.saturating_sub(n);
            link.stats.bytes_in += n as u64;
            link.stats.last_read_ms = now;
            link.decoder.extend(&self.buf[..n]);
            work |= self.link_frames(id, engine, now);
        }
        work
    }

    /// Feeds the link's whole frames to the engine; a frame that is not a data link's ends
    /// the link (a broken or hostile peer), as in transport.py.
    fn link_frames(&mut self, id: u64, engine: &mut Engine, now: u64) -> bool {
        let mut work = false;
        loop {
            let Some(link) = self.links.by_id.get_mut(&id) else {
                return work;
            };
            let peer = link.peer;
            let problem = match link.decoder.next_raw() {
                Ok(None) => return work,
                Err(e) => Some(format!("malformed frame: {e}")),
                Ok(Some((kind, value))) => {
                    link.stats.frames_in += 1;
                    match kind {
                        DATA_KEEPALIVE => None,
                        DATA_FRAME => match Value::decode(value) {
                            Ok(Value::Bytes(batch)) => {
                                work = true;
                                engine
                                    .cluster_feed(peer, &batch, now)
                                    .err()
                                    .map(|e| format!("malformed data batch: {e}"))
                            }
                            Ok(_) => Some("data frame without a batch".to_string()),
                            Err(e) => Some(format!("malformed frame: {e}")),
                        },
                        other => Some(format!("frame kind {other} on a data link")),
                    }
                }
            };
            if let Some(why) = problem {
                self.end_link(id, engine, &why);
                return true;
            }
        }
    }

    fn end_link(&mut self, id: u64, engine: &mut Engine, why: &str) {
        let Some(link) = self.links.by_id.remove(&id) else {
            return;
        };
        let _ = self.ctl(libc::EPOLL_CTL_DEL, link.fd.as_raw_fd(), 0, 0);
        if self.links.by_peer.get(&link.peer) == Some(&id) {
            self.links.by_peer.remove(&link.peer);
        }
        if link.paused {
            // The next link starts writable (Python tells the engine the link is down).
            engine.cluster_set_writable(link.peer, true);
        }
        self.links.ended.push((id, why.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::super::ReactorSettings;
    use super::*;
    use crate::broker::tests::{publishes, Harness};
    use crate::cluster::encode_frame;
    use crate::codec::{Packet, Protocol, QoS};
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::IntoRawFd;
    use std::time::{Duration, Instant};

    fn reactor() -> Reactor {
        Reactor::new(ReactorSettings {
            read_budget: 256 * 1024,
            write_high: 256 * 1024,
            linger_ms: 1000,
            max_sockets: 0,
            connection_rate: 0.0,
        })
        .unwrap()
    }

    /// Two connected loopback TCP sockets.
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    /// Two nodes' engines, each with a reactor serving the data link to the other.
    struct Two {
        h: [Harness; 2],
        r: [Reactor; 2],
        links: [u64; 2],
    }

    impl Two {
        fn new() -> Two {
            let mut h = [Harness::new(), Harness::new()];
            let mut r = [reactor(), reactor()];
            let (a, b) = pair();
            let mut links = [0; 2];
            for (i, sock) in [a, b].into_iter().enumerate() {
                h[i].e.cluster_start(100 + i as u64, &format!("node{i}"));
                let peer = h[i].e.cluster_add_peer(&format!("node{}", 1 - i));
                h[i].e.cluster_link(peer, true);
                let now = h[i].now;
                links[i] = r[i]
                    .adopt_link(sock.into_raw_fd(), peer, b"", 1 << 20, &mut h[i].e, now)
                    .unwrap();
            }
            let mut two = Two { h, r, links };
            two.turn();
            two
        }

        /// Polls and flushes both nodes as their event loops would, for a moment.
        fn turn(&mut self) {
            let until = Instant::now() + Duration::from_millis(50);
            while Instant::now() < until {
                for i in 0..2 {
                    let now = self.h[i].now;
                    self.r[i].poll(&mut self.h[i].e, now);
                    self.r[i].drain_cluster(&mut self.h[i].e, |_, _| {
                        panic!("a frame for a peer without a link here")
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    #[test]
    fn a_publish_crosses_an_adopted_link_and_is_acknowledged_through_it() {
        let mut n = Two::new();
        let sub = n.h[1].connect("sub", Protocol::V5, true);
        n.h[1].subscribe(sub, "t/#", QoS::AtLeastOnce);
        n.turn();
        let publisher = n.h[0].connect("pub", Protocol::V5, true);
        n.h[0].publish(publisher, "t/a", "hello", QoS::AtLeastOnce, false);
        n.turn();
        let got = n.h[1].recv_one(sub);
        let got = publishes(&got);
        assert_eq!(got.len(), 1);
        assert_eq!(&got[0].payload[..], b"hello");
        // The PUBACK waited for node 1's acknowledgement, which came back over the link.
        let acks = n.h[0].recv_one(publisher);
        assert!(
            matches!(&acks[..], [Packet::PubAck(a)] if a.reason_code == 0),
            "{acks:?}"
        );
        let stats = n.r[1].link_stats(n.links[1]).unwrap();
        assert!(stats.frames_in >= 2 && stats.bytes_in > 0, "{stats:?}");
        assert!(n.r[0].link_stats(n.links[0]).unwrap().frames_out >= 2);
        assert!(n.r[0].take_ended_links().is_empty());
    }

    #[test]
    fn a_peer_that_closes_or_sends_a_stray_frame_ends_the_link() {
        let mut h = Harness::new();
        h.e.cluster_start(1, "node0");
        let peer = h.e.cluster_add_peer("node1");
        let mut r = reactor();
        // A keepalive is fine; a control frame on a data link is not.
        let (ours, mut theirs) = pair();
        let now = h.now;
        let id = r
            .adopt_link(ours.into_raw_fd(), peer, b"", 1 << 20, &mut h.e, now)
            .unwrap();
        theirs
            .write_all(&encode_frame(DATA_KEEPALIVE, &Value::None).unwrap())
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        r.poll(&mut h.e, now);
        assert!(r.take_ended_links().is_empty());
        assert_eq!(r.link_stats(id).unwrap().frames_in, 1);
        theirs
            .write_all(&encode_frame(1, &Value::Int(7)).unwrap())
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        r.poll(&mut h.e, now);
        assert_eq!(
            r.take_ended_links(),
            vec![(id, "frame kind 1 on a data link".to_string())]
        );
        assert!(r.link_stats(id).is_none());
        // A batch that does not decode: the engine refuses it, the link ends.
        let (ours, mut theirs) = pair();
        let id = r
            .adopt_link(ours.into_raw_fd(), peer, b"", 1 << 20, &mut h.e, now)
            .unwrap();
        let junk = Value::Bytes(vec![0xff; 16]);
        theirs
            .write_all(&encode_frame(DATA_FRAME, &junk).unwrap())
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        r.poll(&mut h.e, now);
        let ended = r.take_ended_links();
        assert!(
            ended.len() == 1 && ended[0].0 == id && ended[0].1.starts_with("malformed data batch"),
            "{ended:?}"
        );
        // An orderly end from the peer: ended with no reason.
        let (ours, theirs) = pair();
        let id = r
            .adopt_link(ours.into_raw_fd(), peer, b"", 1 << 20, &mut h.e, now)
            .unwrap();
        drop(theirs);
        std::thread::sleep(Duration::from_millis(20));
        r.poll(&mut h.e, now);
        assert_eq!(r.take_ended_links(), vec![(id, String::new())]);
    }

    #[test]
    fn bytes_read_past_the_handshake_are_fed_at_adoption() {
        let mut h = Harness::new();
        h.e.cluster_start(1, "node0");
        let peer = h.e.cluster_add_peer("node1");
        let mut r = reactor();
        let (ours, _theirs) = pair();
        let keepalive = encode_frame(DATA_KEEPALIVE, &Value::None).unwrap();
        let mut initial = keepalive.clone();
        initial.extend_from_slice(&keepalive[..2]);
        let now = h.now;
        let id = r
            .adopt_link(ours.into_raw_fd(), peer, &initial, 1 << 20, &mut h.e, now)
            .unwrap();
        assert_eq!(r.link_stats(id).unwrap().frames_in, 1);
        // A second adoption for the same peer replaces the first.
        let (ours2, _theirs2) = pair();
        let id2 = r
            .adopt_link(ours2.into_raw_fd(), peer, b"", 1 << 20, &mut h.e, now)
            .unwrap();
        assert_ne!(id, id2);
        assert_eq!(
            r.take_ended_links(),
            vec![(id, "replaced by a new data link".to_string())]
        );
        assert!(r.link_write(id2, &keepalive, 1, &mut h.e));
        assert!(!r.link_write(id, &keepalive, 1, &mut h.e));
        assert_eq!(r.link_buffered(id2), 0);
        r.link_close(id2, false, &mut h.e);
        assert_eq!(r.take_ended_links(), vec![(id2, String::new())]);
    }
}
