//! The message scenarios (fan-in, fan-out, pairs, qos1, latency, throughput) and loopback;
//! the pieces that `persist` (fill, drain) shares with them.
//!
//! One thread per connection with blocking sockets: publishers are flow-controlled by TCP
//! alone (a broker that reads slower slows them down), subscribers block in `read` on a
//! 256 KiB buffer and walk the fixed headers of whatever arrived. Every socket has a 100 ms
//! timeout so every loop looks at the clock and ends by itself.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use fastbroker_core::codec::Protocol;

use crate::cli::{Opts, Scenario};
use crate::hist::Histogram;
use crate::json::Obj;
use crate::mqtt::{self, Client, PublishTemplate, Session};
use crate::net::{self, POLL};
use crate::scan::{self, Scanner};

pub const READ_BUF: usize = 256 * 1024;
/// Pacing granularity of rate-capped (non-latency) publishers.
const TICK: Duration = Duration::from_millis(1);

/// Failure of any thread stops all of them.
#[derive(Default)]
pub struct Shared {
    stop: AtomicBool,
    error: Mutex<Option<String>>,
}

impl Shared {
    pub fn fail(&self, msg: String) {
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            *e = Some(msg);
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    #[inline]
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// `t0` publishing starts, `warm` the measured window starts, `end` everything stops.
#[derive(Clone, Copy)]
pub struct Timeline {
    pub t0: Instant,
    pub warm: Instant,
    pub end: Instant,
}

impl Timeline {
    pub fn new(warmup: f64, duration: f64) -> Timeline {
        let t0 = Instant::now() + Duration::from_millis(200);
        let warm = t0 + Duration::from_secs_f64(warmup);
        Timeline {
            t0,
            warm,
            end: warm + Duration::from_secs_f64(duration),
        }
    }

    #[inline]
    pub fn in_window(&self, now: Instant) -> bool {
        now >= self.warm && now < self.end
    }

    /// Last moment to finish a packet already started, or to flush acks, after `end`.
    pub fn grace(&self) -> Instant {
        self.end + Duration::from_secs(1)
    }
}

/// Sleeps until `t` unless the run is stopped first; false if stopped.
pub fn sleep_until(t: Instant, shared: &Shared) -> bool {
    loop {
        if shared.stopped() {
            return false;
        }
        let left = t.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        thread::sleep(left.min(Duration::from_millis(50)));
    }
}

/// Process CPU share over a window: (percent of one core, wall seconds).
pub struct CpuWindow {
    cpu0: Duration,
    wall0: Instant,
}

impl CpuWindow {
    pub fn start() -> CpuWindow {
        CpuWindow {
            cpu0: net::cpu_time(),
            wall0: Instant::now(),
        }
    }

    pub fn finish(&self) -> (f64, f64) {
        let cpu = net::cpu_time().saturating_sub(self.cpu0).as_secs_f64();
        let wall = self.wall0.elapsed().as_secs_f64();
        (if wall > 0.0 { cpu / wall * 100.0 } else { 0.0 }, wall)
    }
}

pub fn set_cpu(obj: &mut Obj, pct: f64, wall: f64) {
    obj.set("loadgen_cpu_percent", pct)
        .set("loadgen_cores_busy", pct / 100.0)
        .set("measured_wall_s", wall);
}

#[derive(Clone, Copy)]
enum PubMode {
    /// As fast as TCP accepts, in large writes.
    Flood { batch: usize },
    /// `rate` msg/s per publisher from t0 on; `stamp` puts the send time in the payload.
    Paced { rate: f64, stamp: bool },
    /// QoS 1 with up to `inflight` unacknowledged.
    Window { inflight: usize },
}

#[derive(Default)]
struct SubStats {
    window: u64,
    total: u64,
    /// Reads and bytes in the window: how well the broker batches its writes.
    window_reads: u64,
    window_bytes: u64,
    hist: Option<Box<Histogram>>,
    lowat_backoffs: u32,
}

#[derive(Default)]
pub struct PubStats {
    window_sent: u64,
    pub total_sent: u64,
    window_acked: u64,
    pub total_acked: u64,
    pub rejected: u64,
    pub lowat_backoffs: u32,
}

struct Plan {
    /// Topic of each publisher.
    pubs: Vec<String>,
    /// Filter of each subscriber.
    subs: Vec<String>,
    qos: u8,
    mode: PubMode,
    latency: bool,
    /// SO_RCVLOWAT for QoS 0 subscribers (0 = leave it).
    rcvlowat: usize,
    /// Publishers whose messages reach each subscriber (bounds a QoS 1 subscriber's bytes
    /// in flight: feeders * inflight * packet size).
    feeders: usize,
    /// Deliveries expected per publish (for delivery_ratio).
    fanout: f64,
}

fn plan(o: &Opts) -> Plan {
    let p = &o.topic_prefix;
    let qos = o.qos;
    let mode = if qos == 1 {
        PubMode::Window {
            inflight: o.inflight,
        }
    } else if o.scenario == Scenario::Latency {
        PubMode::Paced {
            rate: o.rate,
            stamp: true,
        }
    } else if o.rate > 0.0 {
        let n = match o.scenario {
            Scenario::Pairs => o.pairs,
            Scenario::FanOut => 1,
            _ => o.publishers,
        };
        PubMode::Paced {
            rate: o.rate / n as f64,
            stamp: false,
        }
    } else {
        PubMode::Flood { batch: o.batch }
    };
    let (pubs, subs, fanout) = match o.scenario {
        Scenario::FanIn | Scenario::Qos1 => (
            (0..o.publishers)
                .map(|i| format!("{p}/in/{i:02}"))
                .collect(),
            vec![format!("{p}/in/+")],
            1.0,
        ),
        Scenario::FanOut => (
            vec![format!("{p}/out")],
            (0..o.subscribers).map(|_| format!("{p}/out")).collect(),
            o.subscribers as f64,
        ),
        Scenario::Pairs => (
            (0..o.pairs).map(|i| format!("{p}/pair/{i:02}")).collect(),
            (0..o.pairs).map(|i| format!("{p}/pair/{i:02}")).collect(),
            1.0,
        ),
        Scenario::Latency => (vec![format!("{p}/lat")], vec![format!("{p}/lat")], 1.0),
        Scenario::Throughput => (
            (0..o.publishers).map(|_| format!("{p}/tp")).collect(),
            vec![format!("{p}/tp")],
            1.0,
        ),
        Scenario::Connections | Scenario::Loopback | Scenario::Fill | Scenario::Drain => {
            unreachable!("not a message scenario")
        }
    };
    Plan {
        pubs,
        subs,
        qos,
        mode,
        latency: o.scenario == Scenario::Latency,
        // Not where a message must be seen (latency) or acked (the publishers wait) at once.
        rcvlowat: if qos == 0 && o.scenario != Scenario::Latency {
            o.rcvlowat
        } else {
            0
        },
        feeders: match o.scenario {
            Scenario::FanIn | Scenario::Qos1 | Scenario::Throughput => o.publishers,
            _ => 1,
        },
        fanout,
    }
}

pub fn params(o: &Opts) -> Obj {
    let mut p = Obj::new();
    if o.scenario != Scenario::Loopback {
        let proto = if o.protocol == Protocol::V5 {
            "5"
        } else {
            "3.1.1"
        };
        p.set("host", o.host.as_str())
            .set("port", o.port)
            .set("protocol", proto)
            .set("transport", crate::stream::transport_name());
        if let Some(tls) = crate::stream::negotiated() {
            p.set("tls", tls);
        }
        if let Some(path) = &o.ws_path {
            p.set("ws_path", path.as_str());
        }
        if let Some(u) = &o.username {
            p.set("username", u.as_str())
                .set("password", o.password.is_some());
        }
    }
    p.set("payload", o.payload);
    match o.scenario {
        Scenario::FanIn | Scenario::Qos1 | Scenario::Throughput | Scenario::Fill => {
            p.set("publishers", o.publishers);
        }
        Scenario::FanOut => {
            p.set("subscribers", o.subscribers);
        }
        Scenario::Pairs => {
            p.set("pairs", o.pairs);
        }
        _ => {}
    }
    if o.scenario != Scenario::Loopback {
        p.set("qos", o.qos);
    }
    if o.qos == 1 && o.scenario != Scenario::Drain {
        p.set("inflight", o.inflight);
    }
    if let Some(id) = &o.persistent_subscriber {
        p.set("persistent_subscriber", id.as_str());
    }
    if matches!(o.scenario, Scenario::Fill | Scenario::Drain) {
        p.set("count", o.count).set("time_limit_s", o.time_limit);
        return p;
    }
    if o.rate > 0.0 {
        p.set("rate", o.rate);
    } else if o.scenario != Scenario::Loopback {
        p.set("batch", o.batch);
    }
    if o.qos == 0 && !matches!(o.scenario, Scenario::Latency | Scenario::Loopback) {
        p.set("rcvlowat", o.rcvlowat);
    }
    p.set("warmup_s", o.warmup).set("duration_s", o.duration);
    p
}

pub fn spawn<T: Send + 'static>(
    name: String,
    shared: &Arc<Shared>,
    f: impl FnOnce(&Shared) -> Result<T, String> + Send + 'static,
) -> Result<JoinHandle<Option<T>>, String> {
    let sh = shared.clone();
    let who = name.clone();
    thread::Builder::new()
        .name(name.clone())
        .spawn(move || match f(&sh) {
            Ok(v) => Some(v),
            Err(e) => {
                sh.fail(format!("{who}: {e}"));
                None
            }
        })
        .map_err(|e| format!("cannot start thread {name}: {e}"))
}

/// The addresses of `list` ("HOST:PORT"), or the one of --host and --port.
fn addresses(o: &Opts, list: &[String]) -> Result<Vec<std::net::SocketAddr>, String> {
    if list.is_empty() {
        return Ok(vec![net::resolve(&o.host, o.port)?]);
    }
    list.iter()
        .map(|a| {
            let (h, p) = a.rsplit_once(':').expect("checked by cli");
            net::resolve(h, p.parse().expect("checked by cli"))
        })
        .collect()
}

pub fn run_messages(o: &Opts) -> Result<Obj, String> {
    let plan = plan(o);
    let addr = net::resolve(&o.host, o.port)?;
    let sub_addrs = addresses(o, &o.sub_addrs)?;
    let pub_addrs = addresses(o, &o.pub_addrs)?;
    let timeout = Duration::from_secs_f64(o.connect_timeout);
    let pid = std::process::id();
    let name = o.scenario.name();
    eprintln!(
        "fastbroker-loadgen: {name}: {} subscriber(s), {} publisher(s) -> {addr}",
        plan.subs.len(),
        plan.pubs.len()
    );
    // Everything connected and subscribed before the first PUBLISH.
    let mut subs = Vec::with_capacity(plan.subs.len());
    for (i, f) in plan.subs.iter().enumerate() {
        let (id, session) = match &o.persistent_subscriber {
            Some(id) if i == 0 => (id.clone(), Session::Persistent),
            _ => (format!("fbl-{pid}-s{i}"), Session::Clean),
        };
        let at = sub_addrs[i % sub_addrs.len()];
        let mut c = mqtt::open_with(at, None, &id, o.protocol, session, timeout)
            .map_err(|e| format!("subscriber {i}: {e}"))?;
        if c.session_present {
            eprintln!(
                "fastbroker-loadgen: {name}: warning: the broker resumed a session of {id:?}"
            );
        }
        c.subscribe(&[(f.clone(), plan.qos)], timeout)
            .map_err(|e| format!("subscriber {i}: {e}"))?;
        subs.push(c);
    }
    let mut pubs = Vec::with_capacity(plan.pubs.len());
    for (i, t) in plan.pubs.iter().enumerate() {
        let at = pub_addrs[i % pub_addrs.len()];
        let c = mqtt::open(at, None, &format!("fbl-{pid}-p{i}"), o.protocol, timeout)
            .map_err(|e| format!("publisher {i}: {e}"))?;
        let payload = vec![0x5a; o.payload];
        pubs.push((
            c,
            mqtt::publish_template(t, plan.qos, &payload, o.protocol)?,
        ));
    }
    eprintln!("fastbroker-loadgen: {name}: connected and subscribed, publishing");

    let shared = Arc::new(Shared::default());
    let tl = Timeline::new(o.warmup, o.duration);
    let mut sub_threads = Vec::new();
    let lowat = match plan.mode {
        // A quarter of what can be in flight towards the subscriber, backing off if the
        // broker keeps less outstanding.
        PubMode::Window { inflight } => {
            let pkt = pubs.first().map_or(0, |(_, t)| t.bytes.len());
            (plan.feeders * inflight * pkt / 4).min(32 * 1024)
        }
        _ => plan.rcvlowat,
    };
    for (i, c) in subs.into_iter().enumerate() {
        let (ack, latency) = (plan.qos > 0, plan.latency);
        match spawn(format!("subscriber {i}"), &shared, move |sh| {
            sub_loop(c, tl, ack, latency, lowat, sh)
        }) {
            Ok(h) => sub_threads.push(h),
            Err(e) => shared.fail(e),
        }
    }
    let mut pub_threads = Vec::new();
    for (i, (c, t)) in pubs.into_iter().enumerate() {
        let mode = plan.mode;
        match spawn(format!("publisher {i}"), &shared, move |sh| match mode {
            PubMode::Flood { batch } => flood(c, &t, tl, batch, sh),
            PubMode::Paced { rate, stamp } => paced(c, &t, tl, rate, stamp, sh),
            PubMode::Window { inflight } => windowed(c, &t, tl, inflight, u64::MAX, sh),
        }) {
            Ok(h) => pub_threads.push(h),
            Err(e) => shared.fail(e),
        }
    }

    let mut cpu = None;
    if sleep_until(tl.warm, &shared) {
        let w = CpuWindow::start();
        if sleep_until(tl.end, &shared) {
            cpu = Some(w.finish());
        }
    }
    let sub_stats: Vec<SubStats> = sub_threads
        .into_iter()
        .filter_map(|h| h.join().ok().flatten())
        .collect();
    let pub_stats: Vec<PubStats> = pub_threads
        .into_iter()
        .filter_map(|h| h.join().ok().flatten())
        .collect();
    if let Some(e) = shared.error() {
        return Err(e);
    }
    let (pct, wall) = cpu.ok_or("run stopped early")?;
    if sub_stats.len() != plan.subs.len() || pub_stats.len() != plan.pubs.len() {
        return Err("a worker thread panicked".into());
    }

    let dur = o.duration;
    let published: u64 = pub_stats.iter().map(|s| s.window_sent).sum();
    let delivered: u64 = sub_stats.iter().map(|s| s.window).sum();
    let mut r = Obj::new();
    r.set("scenario", name)
        .set("params", params(o))
        .set("duration_s", dur)
        .set("published_per_s", published as f64 / dur)
        .set("delivered_per_s", delivered as f64 / dur);
    if plan.qos == 1 {
        let acked: u64 = pub_stats.iter().map(|s| s.window_acked).sum();
        r.set("acked_per_s", acked as f64 / dur).set("acked", acked);
        let rejected: u64 = pub_stats.iter().map(|s| s.rejected).sum();
        if rejected > 0 {
            r.set("puback_errors", rejected);
        }
    }
    if plan.latency {
        let mut h = Histogram::new();
        for s in &sub_stats {
            if let Some(sh) = &s.hist {
                h.merge(sh);
            }
        }
        if h.count() == 0 {
            return Err("latency: no message received in the measured window".into());
        }
        r.set("p50_us", h.quantile(0.50))
            .set("p90_us", h.quantile(0.90))
            .set("p99_us", h.quantile(0.99))
            .set("p999_us", h.quantile(0.999))
            .set("max_us", h.max())
            .set("min_us", h.min())
            .set("mean_us", h.mean())
            .set("latency_samples", h.count());
    }
    if o.scenario == Scenario::Throughput {
        r.set("mb_per_s", delivered as f64 * o.payload as f64 / dur / 1e6);
    }
    r.set("published", published)
        .set("delivered", delivered)
        .set(
            "published_total",
            pub_stats.iter().map(|s| s.total_sent).sum::<u64>(),
        )
        .set(
            "delivered_total",
            sub_stats.iter().map(|s| s.total).sum::<u64>(),
        );
    if o.qos == 1 {
        r.set(
            "acked_total",
            pub_stats.iter().map(|s| s.total_acked).sum::<u64>(),
        );
    }
    let reads: u64 = sub_stats.iter().map(|s| s.window_reads).sum();
    if reads > 0 {
        let bytes: u64 = sub_stats.iter().map(|s| s.window_bytes).sum();
        r.set("subscriber_reads_per_s", reads as f64 / dur)
            .set("subscriber_bytes_per_read", bytes as f64 / reads as f64);
    }
    if published > 0 {
        r.set(
            "delivery_ratio",
            delivered as f64 / (published as f64 * plan.fanout),
        );
    }
    let backoffs: u32 = sub_stats.iter().map(|s| s.lowat_backoffs).sum::<u32>()
        + pub_stats.iter().map(|s| s.lowat_backoffs).sum::<u32>();
    if backoffs > 0 {
        // Reads that waited for their timeout before the low-water marks settled.
        r.set("lowat_backoffs", backoffs);
    }
    set_cpu(&mut r, pct, wall);
    Ok(r)
}

/// What a subscriber's reads go through: scanner, pending PUBACKs, latency histogram.
pub struct SubState {
    pub scanner: Scanner,
    pub acks: Vec<u8>,
    pub hist: Option<Box<Histogram>>,
    pub v5: bool,
    pub ack: bool,
}

impl SubState {
    /// Handles one read's bytes; returns the PUBLISH packets completed by them.
    #[inline]
    pub fn chunk(&mut self, data: &[u8], record: bool, now_ns: u64) -> Result<u64, String> {
        let mut n = 0u64;
        let mut bad: Option<String> = None;
        let (acks, hist, v5, ack) = (&mut self.acks, &mut self.hist, self.v5, self.ack);
        self.scanner
            .feed(data, |first, _len, body| match first >> 4 {
                scan::PUBLISH => {
                    n += 1;
                    if ack && first & 0x06 != 0 {
                        match scan::publish_pkid(first, body) {
                            Some(id) => {
                                let [hi, lo] = id.to_be_bytes();
                                acks.extend_from_slice(&[0x40, 0x02, hi, lo]);
                            }
                            None => bad = Some("QoS 1 PUBLISH without packet id".into()),
                        }
                    }
                    if record {
                        if let (Some(h), Some(sent)) =
                            (hist.as_mut(), scan::publish_stamp(first, body, v5))
                        {
                            h.record(now_ns.saturating_sub(sent) / 1000);
                        }
                    }
                }
                scan::DISCONNECT => {
                    bad = Some(format!(
                        "broker sent DISCONNECT (reason 0x{:02x})",
                        body.first().copied().unwrap_or(0)
                    ))
                }
                _ => {}
            })
            .map_err(|e| format!("stream out of step: {e}"))?;
        match bad {
            Some(b) => Err(b),
            None => Ok(n),
        }
    }
}

fn sub_loop(
    mut c: Client,
    tl: Timeline,
    ack: bool,
    latency: bool,
    rcvlowat: usize,
    shared: &Shared,
) -> Result<SubStats, String> {
    c.stream
        .set_read_timeout(Some(POLL))
        .and_then(|_| c.stream.set_write_timeout(Some(POLL)))
        .map_err(|e| e.to_string())?;
    let mut lowat =
        net::Lowat::new(c.stream.tcp(), rcvlowat).map_err(|e| format!("SO_RCVLOWAT: {e}"))?;
    let mut st = SubState {
        scanner: Scanner::new(),
        acks: Vec::with_capacity(64 * 1024),
        hist: latency.then(|| Box::new(Histogram::new())),
        v5: c.proto == Protocol::V5,
        ack,
    };
    let mut stats = SubStats::default();
    let mut buf = vec![0u8; READ_BUF];
    // Bytes that came in behind the SUBACK (before publishing started).
    let pending = std::mem::take(&mut c.pending);
    stats.total += st.chunk(&pending, false, 0)?;
    loop {
        if shared.stopped() {
            break;
        }
        match c.stream.read(&mut buf) {
            Ok(0) => return Err("broker closed the connection".into()),
            Ok(n) => {
                let now = Instant::now();
                if now >= tl.end {
                    break;
                }
                if ack {
                    lowat.after_read(c.stream.tcp(), n);
                }
                let in_win = tl.in_window(now);
                let now_ns = if latency { net::monotonic_ns() } else { 0 };
                let k = st.chunk(&buf[..n], in_win && latency, now_ns)?;
                stats.total += k;
                if in_win {
                    stats.window += k;
                    stats.window_reads += 1;
                    stats.window_bytes += n as u64;
                }
                if !st.acks.is_empty() {
                    let w = net::write_until(&mut c.stream, &st.acks, tl.grace())
                        .map_err(|e| format!("sending PUBACKs failed: {e}"))?;
                    if w < st.acks.len() {
                        break; // past the grace period: the run is over anyway
                    }
                    st.acks.clear();
                }
            }
            Err(e) if net::is_timeout(&e) => {
                if Instant::now() >= tl.end {
                    break;
                }
            }
            Err(e) => return Err(format!("read failed: {e}")),
        }
    }
    let _ = c.stream.write(&mqtt::DISCONNECT);
    stats.hist = st.hist;
    stats.lowat_backoffs = lowat.backoffs;
    Ok(stats)
}

fn check_closed_or_disconnect(
    c: &mut Client,
    scanner: &mut Scanner,
    buf: &mut [u8],
) -> Result<(), String> {
    // Publishers get nothing at QoS 0 unless the broker gives up on them: look without
    // blocking, so an early DISCONNECT or close is reported as such and not as a write error.
    c.stream.set_nonblocking(true).map_err(|e| e.to_string())?;
    let r = c.stream.read(buf);
    c.stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    match r {
        Ok(0) => Err("broker closed the connection".into()),
        Ok(n) => {
            let mut bad = None;
            scanner
                .feed(&buf[..n], |first, _, body| {
                    if first >> 4 == scan::DISCONNECT {
                        bad = Some(format!(
                            "broker sent DISCONNECT (reason 0x{:02x})",
                            body.first().copied().unwrap_or(0)
                        ));
                    }
                })
                .map_err(|e| format!("stream out of step: {e}"))?;
            bad.map_or(Ok(()), Err)
        }
        Err(_) => Ok(()),
    }
}

fn flood(
    mut c: Client,
    t: &PublishTemplate,
    tl: Timeline,
    batch_bytes: usize,
    shared: &Shared,
) -> Result<PubStats, String> {
    let pkt = t.bytes.len();
    let batch = t.bytes.repeat((batch_bytes / pkt).max(1));
    c.stream
        .set_write_timeout(Some(POLL))
        .map_err(|e| e.to_string())?;
    if !sleep_until(tl.t0, shared) {
        return Ok(PubStats::default());
    }
    let (mut off, mut total, mut window) = (0usize, 0u64, 0u64);
    loop {
        if shared.stopped() {
            break;
        }
        match c.stream.write(&batch[off..]) {
            Ok(0) => return Err("connection closed".into()),
            Ok(n) => {
                off += n;
                if off == batch.len() {
                    off = 0;
                }
                total += n as u64;
                let now = Instant::now();
                if tl.in_window(now) {
                    window += n as u64;
                }
                if now >= tl.end {
                    break;
                }
            }
            Err(e) if net::is_timeout(&e) => {
                if Instant::now() >= tl.end {
                    break;
                }
            }
            Err(e) => {
                let mut scratch = [0u8; 512];
                check_closed_or_disconnect(&mut c, &mut Scanner::new(), &mut scratch)?;
                return Err(format!("write failed: {e}"));
            }
        }
    }
    // Finish the packet under way so the broker sees whole packets, then say goodbye.
    let partial = (total % pkt as u64) as usize;
    if partial != 0 {
        let _ = net::write_until(&mut c.stream, &batch[off..off + pkt - partial], tl.grace());
    }
    let _ = net::write_until(&mut c.stream, &mqtt::DISCONNECT, tl.grace());
    Ok(PubStats {
        window_sent: window / pkt as u64,
        total_sent: total / pkt as u64,
        ..PubStats::default()
    })
}

fn paced(
    mut c: Client,
    t: &PublishTemplate,
    tl: Timeline,
    rate: f64,
    stamp: bool,
    shared: &Shared,
) -> Result<PubStats, String> {
    net::set_timer_slack_ns(1_000);
    let pkt = t.bytes.len();
    // At most ~2 ticks worth of messages in one write.
    let kmax = ((rate * 2.0 * TICK.as_secs_f64()) as usize).clamp(16, 65536);
    let mut batch = t.bytes.repeat(kmax);
    let interval_ns = 1e9 / rate;
    c.stream
        .set_write_timeout(Some(POLL))
        .map_err(|e| e.to_string())?;
    if !sleep_until(tl.t0, shared) {
        return Ok(PubStats::default());
    }
    let mut stats = PubStats::default();
    let mut scratch = [0u8; 512];
    let mut scanner = Scanner::new();
    let mut checks = 0u32;
    loop {
        if shared.stopped() {
            break;
        }
        let now = Instant::now();
        if now >= tl.end {
            break;
        }
        // Message i is due at t0 + i * interval.
        let due = (now.duration_since(tl.t0).as_nanos() as f64 / interval_ns) as u64 + 1;
        if due <= stats.total_sent {
            let mut next =
                tl.t0 + Duration::from_nanos((stats.total_sent as f64 * interval_ns) as u64);
            if !stamp {
                // Rate-capped floods go out in ticks of at least 1 ms: a wake-up per message
                // would cost more than the messages.
                next = next.max(now + TICK);
            }
            thread::sleep(next.saturating_duration_since(now).min(POLL));
            continue;
        }
        let k = ((due - stats.total_sent) as usize).min(kmax);
        if stamp {
            let ns = net::monotonic_ns();
            for j in 0..k {
                let at = j * pkt + t.payload_at;
                batch[at..at + 8].copy_from_slice(&ns.to_le_bytes());
            }
        }
        let bytes = k * pkt;
        let w = match net::write_until(&mut c.stream, &batch[..bytes], tl.grace()) {
            Ok(w) => w,
            Err(e) => {
                check_closed_or_disconnect(&mut c, &mut scanner, &mut scratch)?;
                return Err(format!("write failed: {e}"));
            }
        };
        stats.total_sent += (w / pkt) as u64;
        if tl.in_window(now) {
            stats.window_sent += (w / pkt) as u64;
        }
        if w < bytes {
            break; // blocked past the grace period
        }
        checks += 1;
        if checks % 256 == 0 {
            check_closed_or_disconnect(&mut c, &mut scanner, &mut scratch)?;
        }
    }
    let _ = net::write_until(&mut c.stream, &mqtt::DISCONNECT, tl.grace());
    Ok(stats)
}

/// Outstanding QoS 1 packet ids, one bit each.
struct PkidSet {
    bits: Box<[u64; 1024]>,
    next: u16,
}

impl PkidSet {
    fn new() -> PkidSet {
        PkidSet {
            bits: Box::new([0; 1024]),
            next: 1,
        }
    }

    /// A free id (there must be one), marked as in use.
    #[inline]
    fn take(&mut self) -> u16 {
        loop {
            let id = self.next;
            self.next = if id == u16::MAX { 1 } else { id + 1 };
            let (w, b) = (usize::from(id >> 6), id & 63);
            if self.bits[w] & (1 << b) == 0 {
                self.bits[w] |= 1 << b;
                return id;
            }
        }
    }

    /// Frees `id`; false if it was not outstanding.
    #[inline]
    fn release(&mut self, id: u16) -> bool {
        let (w, b) = (usize::from(id >> 6), id & 63);
        let was = self.bits[w] & (1 << b) != 0;
        self.bits[w] &= !(1 << b);
        was
    }
}

/// QoS 1 publisher with up to `inflight_max` unacknowledged, until `tl.end` or until `quota`
/// messages have been sent and acknowledged (u64::MAX: no quota).
pub fn windowed(
    mut c: Client,
    t: &PublishTemplate,
    tl: Timeline,
    inflight_max: usize,
    quota: u64,
    shared: &Shared,
) -> Result<PubStats, String> {
    let pkt = t.bytes.len();
    let pkid_at = t.pkid_at.ok_or("QoS 1 template without packet id")?;
    let inflight_max = match c.receive_maximum {
        Some(m) if usize::from(m) < inflight_max => {
            eprintln!(
                "fastbroker-loadgen: broker Receive Maximum {m} caps --inflight {inflight_max}"
            );
            usize::from(m).max(1)
        }
        _ => inflight_max,
    };
    let mut batch = t.bytes.repeat(inflight_max);
    let mut ids = PkidSet::new();
    let mut inflight = 0usize;
    let mut scanner = Scanner::new();
    let mut rbuf = vec![0u8; READ_BUF];
    c.stream
        .set_read_timeout(Some(POLL))
        .and_then(|_| c.stream.set_write_timeout(Some(POLL)))
        .map_err(|e| e.to_string())?;
    // Wake when half the window has been acknowledged (PUBACKs are 4 bytes or more), so
    // the window is refilled in batches of half of it, not one packet per read.
    let mut lowat = net::Lowat::new(c.stream.tcp(), 4 * (inflight_max / 2))
        .map_err(|e| format!("SO_RCVLOWAT: {e}"))?;
    let mut stats = PubStats::default();
    if !sleep_until(tl.t0, shared) {
        return Ok(stats);
    }
    let pending = std::mem::take(&mut c.pending);
    let mut handle = |data: &[u8], ids: &mut PkidSet| -> Result<(u64, u64), String> {
        let (mut acked, mut rejected) = (0u64, 0u64);
        let mut bad = None;
        scanner
            .feed(data, |first, len, body| match first >> 4 {
                scan::PUBACK => {
                    if let Some(id) = scan::ack_pkid(body) {
                        if ids.release(id) {
                            acked += 1;
                            if len > 2 && body.get(2).is_some_and(|&rc| rc >= 0x80) {
                                rejected += 1;
                            }
                        }
                    }
                }
                scan::DISCONNECT => {
                    bad = Some(format!(
                        "broker sent DISCONNECT (reason 0x{:02x})",
                        body.first().copied().unwrap_or(0)
                    ))
                }
                _ => {}
            })
            .map_err(|e| format!("stream out of step: {e}"))?;
        bad.map_or(Ok((acked, rejected)), Err)
    };
    handle(&pending, &mut ids)?;
    loop {
        if shared.stopped() {
            break;
        }
        let now = Instant::now();
        if now >= tl.end || stats.total_acked >= quota {
            break;
        }
        let left = usize::try_from(quota - stats.total_sent).unwrap_or(usize::MAX);
        let room = (inflight_max - inflight).min(left);
        if room > 0 {
            for j in 0..room {
                let id = ids.take();
                let at = j * pkt + pkid_at;
                batch[at..at + 2].copy_from_slice(&id.to_be_bytes());
            }
            let bytes = room * pkt;
            let w = net::write_until(&mut c.stream, &batch[..bytes], tl.grace())
                .map_err(|e| format!("write failed: {e}"))?;
            if w < bytes {
                break; // blocked past the grace period
            }
            inflight += room;
            stats.total_sent += room as u64;
            if tl.in_window(now) {
                stats.window_sent += room as u64;
            }
        }
        match c.stream.read(&mut rbuf) {
            Ok(0) => return Err("broker closed the connection".into()),
            Ok(n) => {
                let now = Instant::now();
                lowat.after_read(c.stream.tcp(), n);
                let (acked, rejected) = handle(&rbuf[..n], &mut ids)?;
                inflight -= acked as usize;
                stats.total_acked += acked;
                stats.rejected += rejected;
                if tl.in_window(now) {
                    stats.window_acked += acked;
                }
            }
            Err(e) if net::is_timeout(&e) => {}
            Err(e) => return Err(format!("read failed: {e}")),
        }
    }
    let _ = net::write_until(&mut c.stream, &mqtt::DISCONNECT, tl.grace());
    stats.lowat_backoffs = lowat.backoffs;
    Ok(stats)
}

/// No broker: one thread writes `payload`-sized chunks into a loopback TCP connection as fast
/// as it can, another reads them with 256 KiB reads.
pub fn run_loopback(o: &Opts) -> Result<Obj, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    let mut w = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    let (mut r, _) = l.accept().map_err(|e| format!("accept: {e}"))?;
    for s in [&w, &r] {
        s.set_nodelay(true)
            .and_then(|_| s.set_read_timeout(Some(POLL)))
            .and_then(|_| s.set_write_timeout(Some(POLL)))
            .map_err(|e| e.to_string())?;
    }
    let shared = Arc::new(Shared::default());
    let tl = Timeline::new(o.warmup, o.duration);
    let chunk = vec![0xa5u8; o.payload];
    let writer = spawn("loopback writer".into(), &shared, move |sh| {
        let (mut total, mut window) = (0u64, 0u64);
        if !sleep_until(tl.t0, sh) {
            return Ok((0, 0));
        }
        let mut off = 0;
        while !sh.stopped() {
            match w.write(&chunk[off..]) {
                Ok(n) => {
                    off = (off + n) % chunk.len();
                    total += n as u64;
                    let now = Instant::now();
                    if tl.in_window(now) {
                        window += n as u64;
                    }
                    if now >= tl.end {
                        break;
                    }
                }
                Err(e) if net::is_timeout(&e) => {
                    if Instant::now() >= tl.end {
                        break;
                    }
                }
                Err(e) => return Err(format!("write: {e}")),
            }
        }
        Ok((total, window))
    })?;
    let reader = spawn("loopback reader".into(), &shared, move |sh| {
        let mut buf = vec![0u8; READ_BUF];
        let mut window = 0u64;
        while !sh.stopped() {
            match r.read(&mut buf) {
                // The writer stops at the end and closes: its end of stream can come just
                // after this thread's last read before the end.
                Ok(0) if Instant::now() >= tl.end => break,
                Ok(0) => return Err("closed".into()),
                Ok(n) => {
                    let now = Instant::now();
                    if now >= tl.end {
                        break;
                    }
                    if tl.in_window(now) {
                        window += n as u64;
                    }
                }
                Err(e) if net::is_timeout(&e) => {
                    if Instant::now() >= tl.end {
                        break;
                    }
                }
                Err(e) => return Err(format!("read: {e}")),
            }
        }
        Ok(window)
    })?;
    let mut cpu = None;
    if sleep_until(tl.warm, &shared) {
        let w = CpuWindow::start();
        if sleep_until(tl.end, &shared) {
            cpu = Some(w.finish());
        }
    }
    let wr = writer.join().ok().flatten();
    let rd = reader.join().ok().flatten();
    if let Some(e) = shared.error() {
        return Err(e);
    }
    let (pct, wall) = cpu.ok_or("run stopped early")?;
    let ((_, written), read) = (wr.ok_or("writer failed")?, rd.ok_or("reader failed")?);
    let dur = o.duration;
    let mut res = Obj::new();
    res.set("scenario", "loopback")
        .set("params", params(o))
        .set("duration_s", dur)
        .set("mb_per_s", read as f64 / dur / 1e6)
        .set("written_mb_per_s", written as f64 / dur / 1e6)
        .set("bytes", read);
    set_cpu(&mut res, pct, wall);
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pkid_set_wraps_and_skips_outstanding() {
        let mut s = PkidSet::new();
        assert_eq!(s.take(), 1);
        assert_eq!(s.take(), 2);
        assert!(s.release(1));
        assert!(!s.release(1));
        // Take the rest of the id space; 2 is still out, 1 is free again.
        let mut n = 0;
        while s.next != 1 {
            s.take();
            n += 1;
        }
        assert_eq!(n, 65_533);
        assert_eq!(s.take(), 1); // wraps past 65535, skips nothing (1 was free)
        assert!(s.release(2));
        assert_eq!(s.take(), 2);
    }

    #[test]
    fn sub_state_counts_acks_and_latency() {
        let mut st = SubState {
            scanner: Scanner::new(),
            acks: Vec::new(),
            hist: Some(Box::new(Histogram::new())),
            v5: false,
            ack: true,
        };
        let mut t = mqtt::publish_template("bench/lat", 1, &[0u8; 16], Protocol::V311).unwrap();
        let mut stream = Vec::new();
        for (id, sent_ns) in [(10u16, 1_000_000u64), (11, 2_000_000)] {
            let at = t.pkid_at.unwrap();
            t.bytes[at..at + 2].copy_from_slice(&id.to_be_bytes());
            t.bytes[t.payload_at..t.payload_at + 8].copy_from_slice(&sent_ns.to_le_bytes());
            stream.extend_from_slice(&t.bytes);
        }
        let (a, b) = stream.split_at(7);
        assert_eq!(st.chunk(a, true, 5_000_000).unwrap(), 0);
        assert_eq!(st.chunk(b, true, 5_000_000).unwrap(), 2);
        assert_eq!(st.acks, [0x40, 2, 0, 10, 0x40, 2, 0, 11]);
        let h = st.hist.as_ref().unwrap();
        assert_eq!((h.count(), h.min(), h.max()), (2, 3000, 4000));
        assert!(st.chunk(&[0xe0, 0x00], true, 0).is_err());
    }

    #[test]
    fn loopback_runs() {
        let o = crate::cli::parse(
            &"loopback --duration 0.3 --warmup 0.1 --payload 4096"
                .split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let r = run_loopback(&o).unwrap().to_string();
        assert!(r.contains("\"mb_per_s\""), "{r}");
    }
}
