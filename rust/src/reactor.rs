//! The compiled connection layer (issue 18): plain TCP client sockets owned by Rust, on one
//! epoll set whose descriptor the Python event loop watches.
//!
//! The event loop calls `poll` when the set is ready and `drain` once per loop iteration,
//! so Python runs per iteration, not per socket: accepting, reading into the engine,
//! writing its output and closing happen here. What this layer does for a connection is
//! what the uvloop one does (`fastbroker._connection`): a read budget per iteration, reads
//! stopped while the engine holds a connection (or a publisher under memory pressure, or
//! every connection while the store fails), a write buffer whose high mark tells the
//! engine to stop sending, a linger after a close on the broker's initiative so the client
//! reads the last packet, and the socket cap and accept rate at accept.
//!
//! Level-triggered epoll: a socket with bytes left past its budget is ready again at the
//! next iteration without bookkeeping here. Linux only, like the rest of the deployment.
//!
//! In a cluster the same set serves the data links to other nodes once their handshake is
//! done (`links`): batches in and out with no Python per batch.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::broker::{ConnId, Engine, CLOSE_LINGER, CLOSE_NO, FEED_HOLD, FEED_PUBLISHER};
use crate::slots::Slots;

mod links;
pub use links::{LinkStats, DATA_KEEPALIVE};

/// Tokens of listeners have this bit; a connection's token is its engine id.
const LISTENER_TOKEN: u64 = 1 << 63;
/// Accepts per listener per poll: a connect storm leaves room for reads.
const ACCEPTS_PER_POLL: usize = 256;
/// Events taken from the kernel per poll.
const EVENTS_PER_POLL: usize = 1024;
/// One read's size; a connection is read again until its budget is used.
const READ_CHUNK: usize = 64 * 1024;

/// What a connection's end is waiting for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Ending {
    /// Open.
    No,
    /// Close once the write buffer is sent (the client asked, DISCONNECT).
    AfterWrite,
    /// Shut the write side once the buffer is sent, then read and discard until the
    /// client closes or the linger passes (the broker ends it).
    Linger,
    /// Write side shut: waiting for the client's end of stream (or its time in
    /// `Reactor::lingering`).
    Lingering,
}

/// Bytes written to a socket that it did not take yet: boxed, so an idle connection pays
/// one pointer, not an empty vector (memory per connection is what issue 18 measures).
#[derive(Default)]
#[allow(clippy::box_collection)] // the point: one pointer inline, not three words
struct OutBuf(Option<Box<Vec<u8>>>);

impl OutBuf {
    fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |b| b.len())
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn extend(&mut self, data: &[u8]) {
        self.0
            .get_or_insert_with(Default::default)
            .extend_from_slice(data);
    }

    fn as_slice(&self) -> &[u8] {
        self.0.as_deref().map_or(&[], |b| b.as_slice())
    }

    /// Drops the first `n` bytes; the buffer itself once empty.
    fn consume(&mut self, n: usize) {
        if let Some(b) = self.0.as_mut() {
            b.drain(..n);
            if b.is_empty() {
                self.0 = None;
            }
        }
    }
}

struct Socket {
    fd: OwnedFd,
    /// Tells this socket from a later one with the same engine id.
    serial: u64,
    peer: SocketAddr,
    listener: u16,
    out: OutBuf,
    /// The engine holds it (FEED_HOLD) until `take_resumed` lists it.
    held: bool,
    /// A publisher not read while memory is under pressure.
    memory_held: bool,
    /// The engine was told it is not writable (buffer past the high mark).
    paused: bool,
    ending: Ending,
    /// The epoll events it is registered for.
    interest: u32,
}

/// Limits given by the configuration ([limits] and the transport's write buffer).
#[derive(Clone, Copy, Debug)]
pub struct ReactorSettings {
    pub read_budget: usize,
    pub write_high: usize,
    pub linger_ms: u64,
    /// 0: no cap.
    pub max_sockets: usize,
    /// Accepts per second; 0: no rate limit.
    pub connection_rate: f64,
}

/// Client sockets on one epoll set; see the module comment.
pub struct Reactor {
    epoll: OwnedFd,
    listeners: Vec<Option<OwnedFd>>,
    conns: Slots<Socket>,
    count: usize,
    settings: ReactorSettings,
    buf: Vec<u8>,
    events: Vec<libc::epoll_event>,
    memory_pressure: bool,
    /// False while the store fails: nothing is read.
    reading: bool,
    accept_tokens: f64,
    refill_ms: u64,
    /// Sockets refused at accept (cap or rate).
    pub refused: u64,
    /// Sockets served by the other connection layer, counted against the cap.
    pub external_sockets: usize,
    /// The broker stops: ends are logged as its shutdown.
    pub shutting_down: bool,
    /// Sockets ended since `take_closed`: (id, serial, peer, listener), for the access
    /// log, which runs after the end.
    closed: Vec<(ConnId, u64, SocketAddr, u16)>,
    serials: u64,
    /// Sockets lingering: (id, serial, until when).
    lingering: Vec<(ConnId, u64, u64)>,
    /// Data links to other cluster nodes (`links`).
    links: links::Links,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Sends as much of `data` as the socket takes now: the bytes sent, or None when it failed.
fn send_some(fd: RawFd, data: &[u8]) -> Option<usize> {
    let mut sent = 0;
    while sent < data.len() {
        let rest = &data[sent..];
        // SAFETY: writing from a live slice to an open socket.
        let n = unsafe {
            libc::send(
                fd,
                rest.as_ptr() as *const _,
                rest.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            match errno() {
                libc::EINTR => continue,
                libc::EAGAIN => break,
                _ => return None,
            }
        }
        sent += n as usize;
    }
    Some(sent)
}

/// Makes `fd` non-blocking.
fn set_nonblocking(fd: RawFd) {
    // SAFETY: plain fcntl calls on an open descriptor.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

/// Turns Nagle off: small packets (a PUBACK, a one-message batch) go at once.
fn set_nodelay(fd: RawFd) {
    let one: libc::c_int = 1;
    // SAFETY: setting an int option on an open socket.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            &one as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

fn sockaddr_to(addr: &libc::sockaddr_storage) -> SocketAddr {
    match addr.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says this storage holds a sockaddr_in.
            let a = unsafe { &*(addr as *const _ as *const libc::sockaddr_in) };
            SocketAddr::new(
                IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))),
                u16::from_be(a.sin_port),
            )
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this storage holds a sockaddr_in6.
            let a = unsafe { &*(addr as *const _ as *const libc::sockaddr_in6) };
            SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)),
                u16::from_be(a.sin6_port),
            )
        }
        _ => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
    }
}

impl Reactor {
    pub fn new(settings: ReactorSettings) -> std::io::Result<Self> {
        // SAFETY: plain system call; the descriptor is owned below.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Reactor {
            // SAFETY: a fresh descriptor nothing else owns.
            epoll: unsafe { OwnedFd::from_raw_fd(fd) },
            listeners: Vec::new(),
            conns: Slots::new(),
            count: 0,
            settings,
            buf: vec![0; READ_CHUNK],
            events: Vec::with_capacity(EVENTS_PER_POLL),
            memory_pressure: false,
            reading: true,
            accept_tokens: settings.connection_rate,
            refill_ms: 0,
            refused: 0,
            external_sockets: 0,
            shutting_down: false,
            closed: Vec::new(),
            serials: 0,
            lingering: Vec::new(),
            links: links::Links::default(),
        })
    }

    /// The epoll set's descriptor, for the event loop to watch.
    pub fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Connections open here.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Connections open here per listener index.
    pub fn listener_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.listeners.len()];
        for socket in self.conns.values() {
            counts[socket.listener as usize] += 1;
        }
        counts
    }

    pub fn owns(&self, id: ConnId) -> bool {
        self.conns.get(id as usize).is_some()
    }

    /// The peer, listener and serial of `id`: open here, or ended since `take_closed`
    /// (when an ended socket's id is already taken again, the open one).
    pub fn peer(&self, id: ConnId) -> Option<(SocketAddr, u16, u64)> {
        if let Some(s) = self.socket(id) {
            return Some((s.peer, s.listener, s.serial));
        }
        self.closed
            .iter()
            .rev()
            .find(|c| c.0 == id)
            .map(|&(_, serial, peer, listener)| (peer, listener, serial))
    }

    /// The ids ended since the last call.
    pub fn take_closed(&mut self) -> Vec<ConnId> {
        self.closed.drain(..).map(|c| c.0).collect()
    }

    fn socket(&self, id: ConnId) -> Option<&Socket> {
        self.conns.get(id as usize)
    }

    fn ctl(&self, op: i32, fd: RawFd, events: u32, token: u64) -> std::io::Result<()> {
        let mut event = libc::epoll_event { events, u64: token };
        // SAFETY: both descriptors are open; the event is a valid struct.
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut event) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Serves a listening socket (a duplicate of `fd` is kept; it is made non-blocking).
    /// Returns its index.
    pub fn add_listener(&mut self, fd: RawFd) -> std::io::Result<u16> {
        // SAFETY: duplicating a descriptor the caller holds open.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let owned = unsafe { OwnedFd::from_raw_fd(dup) };
        set_nonblocking(dup);
        let index = self.listeners.len() as u16;
        self.ctl(
            libc::EPOLL_CTL_ADD,
            dup,
            libc::EPOLLIN as u32,
            LISTENER_TOKEN | index as u64,
        )?;
        self.listeners.push(Some(owned));
        Ok(index)
    }

    /// Stops accepting on listener `index` (its socket is the caller's to close).
    pub fn close_listener(&mut self, index: u16) {
        if let Some(fd) = self
            .listeners
            .get_mut(index as usize)
            .and_then(Option::take)
        {
            let _ = self.ctl(libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0);
        }
    }

    /// Takes what is ready: accepts, reads into `engine`, writes buffered output, ends
    /// lingering connections. Returns whether the engine may have output now.
    pub fn poll(&mut self, engine: &mut Engine, now: u64) -> bool {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        // SAFETY: the buffer has room for EVENTS_PER_POLL events; the kernel fills `n`.
        let n = unsafe {
            libc::epoll_wait(
                self.epoll.as_raw_fd(),
                events.as_mut_ptr(),
                EVENTS_PER_POLL as i32,
                0,
            )
        };
        if n > 0 {
            // SAFETY: the kernel wrote `n` events.
            unsafe { events.set_len(n as usize) };
        }
        let mut work = false;
        for event in &events {
            let (token, ready) = (event.u64, event.events);
            if token & LISTENER_TOKEN != 0 {
                work |= self.accept((token & !LISTENER_TOKEN) as u16, engine, now);
                continue;
            }
            if token & links::LINK_TOKEN != 0 {
                work |= self.link_ready(token & !links::LINK_TOKEN, ready, engine, now);
                continue;
            }
            let id = token as ConnId;
            if ready & libc::EPOLLOUT as u32 != 0 {
                work |= self.write_ready(id, engine, now);
            }
            let hangup = ready & (libc::EPOLLHUP | libc::EPOLLERR) as u32 != 0;
            if hangup || ready & libc::EPOLLIN as u32 != 0 {
                work |= self.read_ready(id, engine, now, hangup);
            }
        }
        self.events = events;
        work
    }

    fn admit(&mut self, now: u64) -> bool {
        let s = self.settings;
        if s.max_sockets > 0 && self.count + self.external_sockets >= s.max_sockets {
            return false;
        }
        if s.connection_rate > 0.0 {
            let elapsed = now.saturating_sub(self.refill_ms) as f64;
            self.accept_tokens =
                (self.accept_tokens + elapsed * s.connection_rate / 1000.0).min(s.connection_rate);
            self.refill_ms = now;
            if self.accept_tokens < 1.0 {
                return false;
            }
            self.accept_tokens -= 1.0;
        }
        true
    }

    /// Whether a socket of the other connection layer may be served (the shared cap and
    /// rate; that layer counts its refusals).
    pub fn admit_external(&mut self, now: u64) -> bool {
        self.admit(now)
    }

    fn accept(&mut self, index: u16, engine: &mut Engine, now: u64) -> bool {
        let Some(Some(listener)) = self.listeners.get(index as usize) else {
            return false;
        };
        let lfd = listener.as_raw_fd();
        let mut work = false;
        for _ in 0..ACCEPTS_PER_POLL {
            // SAFETY: zeroed storage is a valid sockaddr_storage.
            let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            // SAFETY: the listener is open; addr and len are valid for the call.
            let fd = unsafe {
                libc::accept4(
                    lfd,
                    &mut addr as *mut _ as *mut libc::sockaddr,
                    &mut len,
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                match errno() {
                    libc::EINTR | libc::ECONNABORTED => continue,
                    // EAGAIN, or out of descriptors (EMFILE): the next poll tries again.
                    _ => break,
                }
            }
            // SAFETY: a fresh descriptor nothing else owns; closed when dropped.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            if !self.admit(now) {
                // Refused before the engine sees it: a flood costs an accept and a close.
                self.refused += 1;
                continue;
            }
            set_nodelay(fd);
            let id = engine.open(now);
            let interest = libc::EPOLLIN as u32;
            if self
                .ctl(libc::EPOLL_CTL_ADD, fd, interest, id as u64)
                .is_err()
            {
                engine.closed_because(id, now, Some("connection lost"));
                continue;
            }
            self.serials += 1;
            self.conns.set(
                id as usize,
                Socket {
                    fd: owned,
                    serial: self.serials,
                    peer: sockaddr_to(&addr),
                    listener: index,
                    out: OutBuf::default(),
                    held: false,
                    memory_held: false,
                    paused: false,
                    ending: Ending::No,
                    interest,
                },
            );
            self.count += 1;
            work = true;
        }
        work
    }

    /// Reads `id` up to its budget and feeds the engine. `hangup`: the kernel reports the
    /// socket hung up or failed, which it does whatever the interest: a socket not read
    /// meanwhile (held) is ended, or the level-triggered report would come at every poll.
    fn read_ready(&mut self, id: ConnId, engine: &mut Engine, now: u64, hangup: bool) -> bool {
        let budget = self.settings.read_budget.max(1);
        let mut read = 0;
        loop {
            let Some(socket) = self.conns.get(id as usize) else {
                return false;
            };
            let fd = socket.fd.as_raw_fd();
            let discard = socket.ending != Ending::No;
            if !discard && !self.may_read(socket) {
                if hangup {
                    self.end(id, engine, now, None);
                }
                return hangup;
            }
            // SAFETY: reading into our own buffer from an open socket.
            let n = unsafe { libc::read(fd, self.buf.as_mut_ptr() as *mut _, self.buf.len()) };
            if n == 0 {
                self.end(id, engine, now, None);
                return true;
            }
            if n < 0 {
                match errno() {
                    libc::EAGAIN | libc::EINTR => return read > 0,
                    _ => {
                        self.end(id, engine, now, None);
                        return true;
                    }
                }
            }
            let n = n as usize;
            read += n;
            if discard {
                // Lingering: the rest is read only so the client is not reset.
                if read >= budget {
                    return false;
                }
                continue;
            }
            let flags = engine.feed(id, &self.buf[..n], now);
            if flags != 0 {
                let pressure = self.memory_pressure;
                if let Some(socket) = self.conns.get_mut(id as usize) {
                    if flags & FEED_HOLD != 0 {
                        socket.held = true;
                    }
                    if flags & FEED_PUBLISHER != 0 && pressure {
                        socket.memory_held = true;
                    }
                }
                self.update_interest(id);
            }
            if read >= budget || n < self.buf.len() {
                // The rest, if any, is read at the next iteration (level-triggered).
                return true;
            }
        }
    }

    fn may_read(&self, socket: &Socket) -> bool {
        self.reading && !socket.held && !socket.memory_held
    }

    fn update_interest(&mut self, id: ConnId) {
        let Some(socket) = self.conns.get(id as usize) else {
            return;
        };
        let mut want = 0;
        if socket.ending != Ending::No || self.may_read(socket) {
            want |= libc::EPOLLIN as u32;
        }
        if !socket.out.is_empty() {
            want |= libc::EPOLLOUT as u32;
        }
        if want != socket.interest {
            let fd = socket.fd.as_raw_fd();
            if self.ctl(libc::EPOLL_CTL_MOD, fd, want, id as u64).is_ok() {
                if let Some(socket) = self.conns.get_mut(id as usize) {
                    socket.interest = want;
                }
            }
        }
    }

    /// Writes `data` after what is buffered; returns false when the socket failed.
    fn write(&mut self, id: ConnId, data: &[u8]) -> bool {
        let Some(socket) = self.conns.get_mut(id as usize) else {
            return true;
        };
        if !socket.out.is_empty() {
            socket.out.extend(data);
            return true;
        }
        let Some(sent) = send_some(socket.fd.as_raw_fd(), data) else {
            return false;
        };
        if sent < data.len() {
            socket.out.extend(&data[sent..]);
        }
        true
    }

    /// Sends what is buffered for `id`; ends it when its end waited for that.
    fn write_ready(&mut self, id: ConnId, engine: &mut Engine, now: u64) -> bool {
        let Some(socket) = self.conns.get_mut(id as usize) else {
            return false;
        };
        let Some(sent) = send_some(socket.fd.as_raw_fd(), socket.out.as_slice()) else {
            self.end(id, engine, now, None);
            return true;
        };
        socket.out.consume(sent);
        let mut work = false;
        if socket.paused && socket.out.len() <= self.settings.write_high / 4 {
            socket.paused = false;
            // The engine held this connection's output back; it sends it now.
            engine.set_writable(id, true, now);
            work = true;
        }
        let drained = socket.out.is_empty();
        if drained {
            work |= self.finish_write(id, engine, now);
        }
        self.update_interest(id);
        work
    }

    /// The buffer is empty: an end that waited for it goes on.
    fn finish_write(&mut self, id: ConnId, engine: &mut Engine, now: u64) -> bool {
        let Some(socket) = self.conns.get_mut(id as usize) else {
            return false;
        };
        match socket.ending {
            Ending::AfterWrite => {
                self.end(id, engine, now, None);
                true
            }
            Ending::Linger if self.settings.linger_ms == 0 => {
                self.end(id, engine, now, None);
                true
            }
            Ending::Linger => {
                // SAFETY: shutting the write side of an open socket.
                unsafe { libc::shutdown(socket.fd.as_raw_fd(), libc::SHUT_WR) };
                socket.ending = Ending::Lingering;
                let serial = socket.serial;
                self.lingering
                    .push((id, serial, now + self.settings.linger_ms));
                false
            }
            _ => false,
        }
    }

    /// The socket is closed (dropped) and the engine told.
    fn end(&mut self, id: ConnId, engine: &mut Engine, now: u64, why: Option<&str>) {
        if let Some(socket) = self.conns.take(id as usize) {
            let _ = self.ctl(libc::EPOLL_CTL_DEL, socket.fd.as_raw_fd(), 0, 0);
            self.count -= 1;
            self.closed
                .push((id, socket.serial, socket.peer, socket.listener));
            drop(socket);
            let why = why.or(self.shutting_down.then_some("server shutdown"));
            engine.closed_because(id, now, why);
        }
    }

    /// Writes the engine's output for the sockets here; calls `other` for the rest (the
    /// other connection layer's). Returns whether the engine may have output again.
    pub fn drain(
        &mut self,
        engine: &mut Engine,
        now: u64,
        mut other: impl FnMut(ConnId, &[u8], u8),
    ) -> bool {
        let mut failed: Vec<ConnId> = Vec::new();
        let mut full: Vec<ConnId> = Vec::new();
        let mut ending: Vec<ConnId> = Vec::new();
        let high = self.settings.write_high;
        engine.drain(|id, data, close| {
            let Some(socket) = self.conns.get_mut(id as usize) else {
                other(id, data, close);
                return;
            };
            if socket.ending != Ending::No {
                return;
            }
            if !data.is_empty() && !self.write(id, data) {
                failed.push(id);
                return;
            }
            let Some(socket) = self.conns.get_mut(id as usize) else {
                return;
            };
            if !socket.paused && socket.out.len() > high {
                socket.paused = true;
                full.push(id);
            }
            if close != CLOSE_NO {
                socket.ending = if close == CLOSE_LINGER {
                    Ending::Linger
                } else {
                    Ending::AfterWrite
                };
                ending.push(id);
            } else if !socket.out.is_empty() {
                full.push(id);
            }
        });
        let mut work = false;
        for id in failed {
            self.end(id, engine, now, None);
            work = true;
        }
        for &id in &full {
            if self.socket(id).is_some_and(|s| s.paused) {
                engine.set_writable(id, false, now);
            }
            self.update_interest(id);
        }
        for id in ending {
            if self.socket(id).is_some_and(|s| s.out.is_empty()) {
                work |= self.finish_write(id, engine, now);
            }
            self.update_interest(id);
        }
        work
    }

    /// Connections the engine no longer holds (`take_resumed`) are read again.
    pub fn resume(&mut self, id: ConnId) {
        if let Some(socket) = self.conns.get_mut(id as usize) {
            socket.held = false;
            self.update_interest(id);
        }
    }

    /// Past the memory mark publishers are not read; below it again they are.
    pub fn set_memory_pressure(&mut self, pressure: bool) -> usize {
        self.memory_pressure = pressure;
        if pressure {
            return 0;
        }
        let held: Vec<ConnId> = self
            .ids()
            .filter(|&id| self.socket(id).is_some_and(|s| s.memory_held))
            .collect();
        for &id in &held {
            if let Some(socket) = self.conns.get_mut(id as usize) {
                socket.memory_held = false;
            }
            self.update_interest(id);
        }
        held.len()
    }

    pub fn memory_held(&self) -> usize {
        self.ids()
            .filter(|&id| self.socket(id).is_some_and(|s| s.memory_held))
            .count()
    }

    /// While the store fails nothing is read.
    pub fn set_reading(&mut self, reading: bool) {
        self.reading = reading;
        let ids: Vec<ConnId> = self.ids().collect();
        for id in ids {
            self.update_interest(id);
        }
    }

    fn ids(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.conns.iter().map(|(id, _)| id as ConnId)
    }

    /// Ends the connections whose linger passed. Returns whether any ended.
    pub fn tick(&mut self, engine: &mut Engine, now: u64) -> bool {
        let mut expired = Vec::new();
        self.lingering.retain(|&(id, serial, until)| {
            if until > now {
                return true;
            }
            expired.push((id, serial));
            false
        });
        let mut any = false;
        for (id, serial) in expired {
            // Not one that ended meanwhile and whose id went to a newer socket.
            if self.socket(id).is_some_and(|s| s.serial == serial) {
                self.end(id, engine, now, None);
                any = true;
            }
        }
        any
    }

    /// The broker stops: every connection still open lingers (after its output).
    pub fn linger_all(&mut self, engine: &mut Engine, now: u64) {
        let ids: Vec<ConnId> = self.ids().collect();
        for id in ids {
            if let Some(socket) = self.conns.get_mut(id as usize) {
                if socket.ending == Ending::No {
                    socket.ending = Ending::Linger;
                    if socket.out.is_empty() {
                        self.finish_write(id, engine, now);
                    }
                    self.update_interest(id);
                }
            }
        }
    }

    /// Drops every connection without waiting for its output.
    pub fn abort_all(&mut self, engine: &mut Engine, now: u64, why: Option<&str>) {
        let ids: Vec<ConnId> = self.ids().collect();
        for id in ids {
            self.end(id, engine, now, why);
        }
    }

    /// Drops connection `id` at once (its publisher's batch failed to store).
    pub fn abort(&mut self, id: ConnId, engine: &mut Engine, now: u64) {
        self.end(id, engine, now, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::Config;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    /// MQTT 3.1.1 CONNECT, client id "a", clean session, keep alive 60 s.
    const CONNECT: &[u8] = b"\x10\x0d\x00\x04MQTT\x04\x02\x00\x3c\x00\x01a";
    const CONNACK: &[u8] = b"\x20\x02\x00\x00";

    fn settings() -> ReactorSettings {
        ReactorSettings {
            read_budget: 256 * 1024,
            write_high: 256 * 1024,
            linger_ms: 1000,
            max_sockets: 0,
            connection_rate: 0.0,
        }
    }

    struct Setup {
        reactor: Reactor,
        engine: Engine,
        listener: TcpListener,
        now: u64,
    }

    impl Setup {
        fn new(settings: ReactorSettings) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut reactor = Reactor::new(settings).unwrap();
            reactor.add_listener(listener.as_raw_fd()).unwrap();
            Setup {
                reactor,
                engine: Engine::new(Config::default()),
                listener,
                now: 1_000,
            }
        }

        fn client(&self) -> TcpStream {
            let stream = TcpStream::connect(self.listener.local_addr().unwrap()).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            stream
        }

        /// Polls and flushes as the event loop would, for a moment.
        fn turn(&mut self) {
            let until = Instant::now() + Duration::from_millis(30);
            while Instant::now() < until {
                self.reactor.poll(&mut self.engine, self.now);
                self.reactor.drain(&mut self.engine, self.now, |_, _, _| {
                    panic!("output for a socket the reactor does not own")
                });
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn read_some(stream: &mut TcpStream) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf) {
                Ok(0) | Err(_) => return out,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    }

    #[test]
    fn a_connect_read_by_the_reactor_is_answered_through_it() {
        let mut s = Setup::new(settings());
        let mut client = s.client();
        client.write_all(CONNECT).unwrap();
        s.turn();
        assert_eq!(s.reactor.count(), 1);
        assert_eq!(read_some(&mut client), CONNACK);
        let peer = s.reactor.peer(0).unwrap();
        assert_eq!(peer.0, client.local_addr().unwrap());
    }

    #[test]
    fn a_client_that_closes_is_forgotten_and_the_engine_told() {
        let mut s = Setup::new(settings());
        let mut client = s.client();
        client.write_all(CONNECT).unwrap();
        s.turn();
        assert_eq!(s.engine.stats().clients_connected, 1);
        drop(client);
        s.turn();
        assert_eq!(s.reactor.count(), 0);
        assert_eq!(s.engine.stats().clients_connected, 0);
        // Its details stay readable until taken (the access log runs after the end).
        assert!(s.reactor.peer(0).is_some());
        assert_eq!(s.reactor.take_closed(), vec![0]);
        assert!(s.reactor.peer(0).is_none());
    }

    #[test]
    fn sockets_past_the_cap_are_closed_at_accept() {
        let mut s = Setup::new(ReactorSettings {
            max_sockets: 1,
            ..settings()
        });
        let _first = s.client();
        s.turn();
        let mut second = s.client();
        s.turn();
        assert_eq!(s.reactor.count(), 1);
        assert_eq!(s.reactor.refused, 1);
        assert!(read_some(&mut second).is_empty());
    }

    /// A client whose CONNECT the broker refuses (an unknown protocol level: CONNACK 0x01,
    /// then the broker closes), after it read the CONNACK.
    fn refused_client(s: &mut Setup) -> TcpStream {
        let mut client = s.client();
        client
            .write_all(b"\x10\x0d\x00\x04MQTT\x09\x02\x00\x3c\x00\x01a")
            .unwrap();
        s.turn();
        assert_eq!(read_some(&mut client), b"\x20\x02\x00\x01");
        client
    }

    #[test]
    fn a_connection_the_broker_ends_gets_its_last_packet_and_an_orderly_end() {
        let mut s = Setup::new(settings());
        let mut client = refused_client(&mut s);
        // Lingering: the write side is shut, the socket still read until the client closes.
        let mut buf = [0u8; 1];
        assert_eq!(client.read(&mut buf).unwrap(), 0);
        assert_eq!(s.reactor.count(), 1);
        drop(client);
        s.turn();
        assert_eq!(s.reactor.count(), 0);
    }

    #[test]
    fn a_linger_that_passes_ends_the_socket() {
        let mut s = Setup::new(settings());
        let _client = refused_client(&mut s);
        assert!(!s.reactor.tick(&mut s.engine, s.now + 999));
        assert!(s.reactor.tick(&mut s.engine, s.now + 1_000));
        assert_eq!(s.reactor.count(), 0);
    }

    #[test]
    fn a_held_connection_is_not_read_until_resumed() {
        let mut s = Setup::new(settings());
        let mut client = s.client();
        client.write_all(CONNECT).unwrap();
        s.turn();
        assert_eq!(read_some(&mut client), CONNACK);
        s.reactor.conns.get_mut(0).unwrap().held = true;
        s.reactor.update_interest(0);
        // PINGREQ: not read while held.
        client.write_all(b"\xc0\x00").unwrap();
        s.turn();
        assert!(read_some(&mut client).is_empty());
        s.reactor.resume(0);
        s.turn();
        assert_eq!(read_some(&mut client), b"\xd0\x00");
    }

    #[test]
    fn one_poll_reads_a_socket_up_to_its_budget_and_the_next_reads_on() {
        let mut s = Setup::new(ReactorSettings {
            read_budget: 64 * 1024,
            ..settings()
        });
        let mut client = s.client();
        client.write_all(CONNECT).unwrap();
        s.turn();
        assert_eq!(read_some(&mut client), CONNACK);
        // 1 MiB of QoS 0 publishes to a topic nobody subscribes to.
        let publish = b"\x30\x0f\x00\x03t/a0123456789";
        let flood: Vec<u8> = publish
            .iter()
            .copied()
            .cycle()
            .take(publish.len() * 65_536)
            .collect();
        client.write_all(&flood).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let before = s.engine.stats().bytes_received;
        s.reactor.poll(&mut s.engine, s.now);
        let fed = s.engine.stats().bytes_received - before;
        assert!(
            fed >= 64 * 1024 && fed <= 64 * 1024 + READ_CHUNK as u64,
            "{fed}"
        );
        let total = (CONNECT.len() + flood.len()) as u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.engine.stats().bytes_received < total && Instant::now() < deadline {
            s.turn();
        }
        assert_eq!(s.engine.stats().bytes_received, total);
    }

    #[test]
    fn accepted_sockets_have_nagle_off() {
        let mut s = Setup::new(settings());
        let _client = s.client();
        s.turn();
        let fd = s.reactor.conns.get(0).unwrap().fd.as_raw_fd();
        let mut on: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: reading an int option of an open socket into a local.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                &mut on as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        assert_eq!(rc, 0);
        assert_ne!(on, 0);
    }
}
