//! The `connections` scenario: open many idle MQTT connections, hold them, close them.
//!
//! One thread drives up to `concurrency` handshakes at a time with nonblocking sockets and
//! epoll (edge-triggered): TCP connect (bound to the next source address), CONNECT when the
//! socket turns writable, CONNACK when it turns readable. A connection that is through is
//! dropped from the epoll set and kept. Then `{"ready": true, ...}` goes to stdout so the
//! harness can measure the broker while the connections sit idle (keep alive 0) for `hold`
//! seconds.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use fastbroker_core::codec::Protocol;

use crate::cli::Opts;
use crate::json::Obj;
use crate::mqtt;
use crate::net;
use crate::run::CpuWindow;

/// Descriptors kept free for everything else (stdio, epoll, libraries).
const FD_RESERVE: u64 = 64;

pub struct Outcome {
    pub result: Obj,
    pub errors: usize,
}

enum Stage {
    /// TCP handshake under way: waiting for writable.
    Connecting,
    /// CONNECT sent: waiting for the CONNACK.
    Connack,
}

struct Pending {
    stream: TcpStream,
    index: usize,
    stage: Stage,
    deadline: Instant,
    buf: [u8; 16],
    len: usize,
}

struct Epoll(OwnedFd);

impl Epoll {
    fn new() -> Result<Epoll, String> {
        // SAFETY: epoll_create1 returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(format!(
                "epoll_create1: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn add(&self, s: &TcpStream, token: u64) -> std::io::Result<()> {
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32,
            u64: token,
        };
        // SAFETY: valid descriptors and a local event struct.
        let r = unsafe {
            libc::epoll_ctl(
                self.0.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                s.as_raw_fd(),
                &mut ev,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    fn remove(&self, s: &TcpStream) {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: valid descriptors and a local event struct (ignored by DEL on new kernels).
        unsafe {
            libc::epoll_ctl(
                self.0.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                s.as_raw_fd(),
                &mut ev,
            );
        }
    }

    fn wait(&self, events: &mut [libc::epoll_event], timeout: Duration) -> usize {
        // SAFETY: `events` is a valid, writable array of its length.
        let n = unsafe {
            libc::epoll_wait(
                self.0.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                timeout.as_millis().min(1000) as libc::c_int,
            )
        };
        n.max(0) as usize
    }
}

/// Advances one handshake on an epoll event: `Some(Ok)` done, `Some(Err)` failed, `None`
/// not yet.
fn advance(p: &mut Pending, events: u32, proto: Protocol, pid: u32) -> Option<Result<(), String>> {
    let client_id = || format!("fbl-{pid}-c{}", p.index);
    if let Stage::Connecting = p.stage {
        if events & (libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0 {
            let e = net::so_error(&p.stream)
                .err()
                .map_or("connection reset".to_string(), |e| e.to_string());
            return Some(Err(format!("TCP connect failed: {e}")));
        }
        if events & libc::EPOLLOUT as u32 == 0 {
            return None;
        }
        if let Err(e) = net::so_error(&p.stream) {
            return Some(Err(format!("TCP connect failed: {e}")));
        }
        let pkt = mqtt::connect_packet(&client_id(), proto);
        match (&p.stream).write(&pkt) {
            Ok(n) if n == pkt.len() => p.stage = Stage::Connack,
            Ok(_) => return Some(Err("CONNECT did not fit in the socket buffer".into())),
            Err(e) => return Some(Err(format!("sending CONNECT failed: {e}"))),
        }
        // A CONNACK can only come later, with an edge of its own.
        return None;
    }
    loop {
        // The fixed header and two body bytes decide; the rest of a long 5.0 CONNACK is
        // read into scratch and dropped.
        let mut scratch = [0u8; 256];
        let into_buf = p.len < p.buf.len();
        let r = if into_buf {
            (&p.stream).read(&mut p.buf[p.len..])
        } else {
            (&p.stream).read(&mut scratch)
        };
        match r {
            Ok(0) => {
                return Some(Err(
                    match mqtt::connack_verdict(&p.buf[..p.len], proto, &client_id()) {
                        Some(Err(e)) => e,
                        _ => "broker closed the connection before CONNACK".into(),
                    },
                ))
            }
            Ok(n) if into_buf => p.len += n,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Some(Err(format!("read failed while waiting for CONNACK: {e}"))),
        }
    }
    mqtt::connack_verdict(&p.buf[..p.len], proto, &client_id())
}

struct Tally {
    connected: Vec<TcpStream>,
    errors: usize,
    first_error: Option<String>,
}

impl Tally {
    fn error(&mut self, index: usize, e: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            eprintln!("fastbroker-loadgen: connections: connection {index}: {e}");
            self.first_error = Some(format!("connection {index}: {e}"));
        }
    }
}

struct Connector {
    addr: SocketAddr,
    sources: Vec<Ipv4Addr>,
    proto: Protocol,
    count: usize,
    concurrency: usize,
    timeout: Duration,
    phase_deadline: Instant,
}

impl Connector {
    fn run(&self) -> Result<Tally, String> {
        let ep = Epoll::new()?;
        let pid = std::process::id();
        let mut slots: Vec<Option<Pending>> = (0..self.concurrency).map(|_| None).collect();
        let mut free: Vec<usize> = (0..self.concurrency).rev().collect();
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 1024];
        let mut tally = Tally {
            connected: Vec::with_capacity(self.count),
            errors: 0,
            first_error: None,
        };
        let mut next = 0usize;
        let mut last_sweep = Instant::now();
        loop {
            // Keep `concurrency` handshakes going.
            let now = Instant::now();
            while next < self.count && now < self.phase_deadline {
                let Some(slot) = free.pop() else { break };
                let index = next;
                next += 1;
                let src =
                    (!self.sources.is_empty()).then(|| self.sources[index % self.sources.len()]);
                let started = net::start_connect(self.addr, src)
                    .and_then(|(s, _)| ep.add(&s, slot as u64).map(|_| s));
                match started {
                    Ok(stream) => {
                        slots[slot] = Some(Pending {
                            stream,
                            index,
                            stage: Stage::Connecting,
                            deadline: now + self.timeout,
                            buf: [0; 16],
                            len: 0,
                        })
                    }
                    Err(e) => {
                        free.push(slot);
                        let what = match src {
                            Some(src) => format!("TCP connect to {} from {src} failed", self.addr),
                            None => format!("TCP connect to {} failed", self.addr),
                        };
                        tally.error(index, format!("{what}: {e}"));
                    }
                }
            }
            if free.len() == self.concurrency
                && (next >= self.count || Instant::now() >= self.phase_deadline)
            {
                break;
            }
            let n = ep.wait(&mut events, Duration::from_millis(50));
            for ev in &events[..n] {
                let (slot, bits) = (ev.u64 as usize, ev.events);
                let Some(p) = slots[slot].as_mut() else {
                    continue;
                };
                if let Some(outcome) = advance(p, bits, self.proto, pid) {
                    let p = slots[slot].take().expect("slot in use");
                    ep.remove(&p.stream);
                    free.push(slot);
                    match outcome {
                        Ok(()) => tally.connected.push(p.stream),
                        Err(e) => tally.error(p.index, e),
                    }
                }
            }
            let now = Instant::now();
            if now.duration_since(last_sweep) >= Duration::from_millis(100) {
                last_sweep = now;
                for (slot, entry) in slots.iter_mut().enumerate() {
                    if entry.as_ref().is_some_and(|p| now >= p.deadline) {
                        let p = entry.take().expect("checked");
                        ep.remove(&p.stream);
                        free.push(slot);
                        let stage = match p.stage {
                            Stage::Connecting => "TCP connect",
                            Stage::Connack => "CONNACK",
                        };
                        tally.error(p.index, format!("timed out waiting for {stage}"));
                    }
                }
            }
        }
        Ok(tally)
    }
}

pub fn run(o: &Opts) -> Result<Outcome, String> {
    let (soft, hard) = net::raise_nofile_limit();
    if o.count as u64 + FD_RESERVE > soft {
        return Err(format!(
            "--count {} needs about {} file descriptors, RLIMIT_NOFILE is {soft} (hard {hard})",
            o.count,
            o.count as u64 + FD_RESERVE
        ));
    }
    let addr = net::resolve(&o.host, o.port)?;
    let count = o.count;
    let concurrency = o.concurrency.min(count);
    eprintln!(
        "fastbroker-loadgen: connections: opening {count} to {addr} from {} source address(es), {concurrency} at a time",
        o.sources.len().max(1)
    );

    let cpu = CpuWindow::start();
    let t0 = Instant::now();
    let connector = Connector {
        addr,
        sources: o.sources.clone(),
        proto: o.protocol,
        count,
        concurrency,
        timeout: Duration::from_secs_f64(o.connect_timeout),
        phase_deadline: t0 + Duration::from_secs_f64(o.connect_phase_timeout),
    };
    let tally = connector.run()?;
    let phase = t0.elapsed().as_secs_f64();
    let (cpu_pct, wall) = cpu.finish();
    let Tally {
        connected: conns,
        errors,
        first_error,
    } = tally;
    let not_tried = count - conns.len() - errors;
    let connected = conns.len();
    if connected == 0 {
        return Err(first_error.unwrap_or_else(|| "no connection opened".into()));
    }
    let connects_per_s = connected as f64 / phase;
    eprintln!(
        "fastbroker-loadgen: connections: {connected} open in {phase:.2} s ({connects_per_s:.0}/s), {errors} errors; holding {} s",
        o.hold
    );

    let mut ready = Obj::new();
    ready
        .set("ready", true)
        .set("scenario", "connections")
        .set("connected", connected)
        .set("errors", errors)
        .set("connects_per_s", connects_per_s);
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{ready}").map_err(|e| format!("stdout: {e}"))?;
        out.flush().map_err(|e| format!("stdout: {e}"))?;
    }

    std::thread::sleep(Duration::from_secs_f64(o.hold));
    let closed_by_broker = conns.iter().filter(|s| net::peer_closed(s)).count();
    if closed_by_broker > 0 {
        eprintln!(
            "fastbroker-loadgen: connections: {closed_by_broker} connection(s) closed by the broker during the hold"
        );
    }
    let t_close = Instant::now();
    for s in &conns {
        // Nonblocking already; a full buffer just loses the goodbye.
        let _ = (&*s).write(&mqtt::DISCONNECT);
    }
    drop(conns);
    let close_s = t_close.elapsed().as_secs_f64();

    let mut p = Obj::new();
    p.set("host", o.host.as_str())
        .set("port", o.port)
        .set(
            "protocol",
            if o.protocol == Protocol::V5 {
                "5"
            } else {
                "3.1.1"
            },
        )
        .set("count", count)
        .set("sources", o.sources_spec.as_str())
        .set("hold_s", o.hold)
        .set("concurrency", concurrency);
    if let Some(u) = &o.username {
        p.set("username", u.as_str())
            .set("password", o.password.is_some());
    }
    let mut r = Obj::new();
    r.set("scenario", "connections")
        .set("params", p)
        .set("duration_s", phase)
        .set("connected", connected)
        .set("errors", errors)
        .set("not_attempted", not_tried)
        .set("connects_per_s", connects_per_s)
        .set("connect_phase_s", phase)
        .set("closed_by_broker", closed_by_broker)
        .set("hold_s", o.hold)
        .set("close_s", close_s);
    if let Some(e) = first_error {
        r.set("first_error", e);
    }
    crate::run::set_cpu(&mut r, cpu_pct, wall);
    Ok(Outcome {
        result: r,
        errors: errors + closed_by_broker + not_tried,
    })
}
