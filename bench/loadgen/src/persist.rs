//! Stored-session scenarios: `fill` puts COUNT QoS 1 messages in an offline persistent
//! session (the set-up of a start-up benchmark, not timed by the broker comparison), `drain`
//! resumes that session and times the delivery of COUNT messages.
//!
//! Same design as the message scenarios: one thread per connection, blocking sockets with a
//! 100 ms timeout, pre-encoded PUBLISH patched in place (`run::windowed`), subscribers that
//! only scan fixed headers and PUBACK in one write per read (`run::SubState`).

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastbroker_core::codec::Protocol;

use crate::cli::Opts;
use crate::json::Obj;
use crate::mqtt::{self, Session};
use crate::net::{self, POLL};
use crate::run::{self, CpuWindow, PubStats, Shared, SubState, Timeline, READ_BUF};
use crate::scan::Scanner;
use crate::stream::Stream;

/// `drain` gives up when nothing arrived for this long (a broker that lost messages would
/// otherwise keep it waiting for the whole time limit).
const DRAIN_IDLE: Duration = Duration::from_secs(10);
/// SO_RCVLOWAT of the draining subscriber.
const DRAIN_LOWAT: usize = 32 * 1024;

fn subscriber_id(o: &Opts) -> Result<&str, String> {
    o.persistent_subscriber.as_deref().ok_or_else(|| {
        format!(
            "{}: --persistent-subscriber ID is required",
            o.scenario.name()
        )
    })
}

/// Sends DISCONNECT and waits (up to `timeout`) for the broker to close the connection, so the
/// session is offline before anything is published to it.
fn disconnect_and_wait(stream: &mut Stream, timeout: Duration) -> Result<(), String> {
    stream
        .set_write_timeout(Some(timeout))
        .and_then(|_| stream.write_all(&mqtt::DISCONNECT))
        .and_then(|_| stream.flush())
        .map_err(|e| format!("sending DISCONNECT failed: {e}"))?;
    let deadline = Instant::now() + timeout;
    stream
        .set_read_timeout(Some(POLL))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if net::is_timeout(&e) => {}
            // A reset after DISCONNECT is a close too.
            Err(_) => return Ok(()),
        }
        if Instant::now() >= deadline {
            return Err("the broker did not close the connection after DISCONNECT".into());
        }
    }
}

/// Messages for publisher `i` of `n` so that they add up to `count`.
fn quota(count: usize, n: usize, i: usize) -> u64 {
    (count / n + usize::from(i < count % n)) as u64
}

pub fn run_fill(o: &Opts) -> Result<Obj, String> {
    let addr = net::resolve(&o.host, o.port)?;
    let timeout = Duration::from_secs_f64(o.connect_timeout);
    let pid = std::process::id();
    let id = subscriber_id(o)?;
    let prefix = &o.topic_prefix;
    eprintln!(
        "fastbroker-loadgen: fill: persistent subscriber {id:?}, then {} QoS 1 message(s) from {} publisher(s) -> {addr}",
        o.count, o.publishers
    );
    let mut s = mqtt::open_with(addr, None, id, o.protocol, Session::Persistent, timeout)
        .map_err(|e| format!("subscriber: {e}"))?;
    let resumed = s.session_present;
    s.subscribe(&[(format!("{prefix}/in/+"), 1)], timeout)
        .map_err(|e| format!("subscriber: {e}"))?;
    disconnect_and_wait(&mut s.stream, timeout).map_err(|e| format!("subscriber: {e}"))?;
    drop(s);

    let mut pubs = Vec::with_capacity(o.publishers);
    for i in 0..o.publishers {
        let c = mqtt::open(addr, None, &format!("fbl-{pid}-p{i}"), o.protocol, timeout)
            .map_err(|e| format!("publisher {i}: {e}"))?;
        let t = mqtt::publish_template(
            &format!("{prefix}/in/{i:02}"),
            1,
            &vec![0x5a; o.payload],
            o.protocol,
        )?;
        pubs.push((c, t));
    }
    eprintln!("fastbroker-loadgen: fill: subscriber offline, publishers connected, publishing");

    let shared = Arc::new(Shared::default());
    // No warm-up: everything from t0 on counts, and the time limit ends it.
    let tl = Timeline::new(0.0, o.time_limit);
    let cpu = CpuWindow::start();
    let mut threads = Vec::new();
    for (i, (c, t)) in pubs.into_iter().enumerate() {
        let (inflight, q) = (o.inflight, quota(o.count, o.publishers, i));
        match run::spawn(format!("publisher {i}"), &shared, move |sh| {
            run::windowed(c, &t, tl, inflight, q, sh)
        }) {
            Ok(h) => threads.push(h),
            Err(e) => shared.fail(e),
        }
    }
    let stats: Vec<PubStats> = threads
        .into_iter()
        .filter_map(|h| h.join().ok().flatten())
        .collect();
    let fill_s = tl.t0.elapsed().as_secs_f64();
    let (pct, wall) = cpu.finish();
    if let Some(e) = shared.error() {
        return Err(e);
    }
    if stats.len() != o.publishers {
        return Err("a worker thread panicked".into());
    }
    let sent: u64 = stats.iter().map(|s| s.total_sent).sum();
    let acked: u64 = stats.iter().map(|s| s.total_acked).sum();
    let rejected: u64 = stats.iter().map(|s| s.rejected).sum();
    if acked < o.count as u64 {
        return Err(format!(
            "time limit: {acked} of {} messages acknowledged after {:.1} s",
            o.count, o.time_limit
        ));
    }
    let mut r = Obj::new();
    r.set("scenario", "fill")
        .set("params", run::params(o))
        .set("published", sent)
        .set("acked", acked)
        .set("fill_s", fill_s)
        .set("acked_per_s", acked as f64 / fill_s)
        .set("session_present", resumed);
    if rejected > 0 {
        r.set("puback_errors", rejected);
    }
    let backoffs: u32 = stats.iter().map(|s| s.lowat_backoffs).sum();
    if backoffs > 0 {
        r.set("lowat_backoffs", backoffs);
    }
    run::set_cpu(&mut r, pct, wall);
    Ok(r)
}

pub fn run_drain(o: &Opts) -> Result<Obj, String> {
    let addr = net::resolve(&o.host, o.port)?;
    let timeout = Duration::from_secs_f64(o.connect_timeout);
    let id = subscriber_id(o)?;
    let count = o.count as u64;
    eprintln!(
        "fastbroker-loadgen: drain: persistent subscriber {id:?} -> {addr}, {count} message(s)"
    );
    let t_connect = Instant::now();
    let mut c = mqtt::open_with(addr, None, id, o.protocol, Session::Persistent, timeout)
        .map_err(|e| format!("subscriber: {e}"))?;
    let connack_s = t_connect.elapsed().as_secs_f64();
    if !c.session_present {
        return Err(format!(
            "the broker has no stored session for {id:?} (CONNACK session present = 0)"
        ));
    }
    let cpu = CpuWindow::start();
    c.stream
        .set_read_timeout(Some(POLL))
        .and_then(|_| c.stream.set_write_timeout(Some(POLL)))
        .map_err(|e| e.to_string())?;
    let mut st = SubState {
        scanner: Scanner::new(),
        acks: Vec::with_capacity(64 * 1024),
        hist: None,
        v5: c.proto == Protocol::V5,
        ack: true,
    };
    // Woken for 32 KiB, or for what is still to come if less (a PUBLISH of these messages
    // takes at least payload + 6 bytes), so the last messages are not left waiting for the
    // read timeout; halved if the broker keeps less outstanding.
    let min_pkt = (o.payload + 6) as u64;
    let mark = |left: u64| {
        usize::try_from(left.saturating_mul(min_pkt)).map_or(DRAIN_LOWAT, |b| b.min(DRAIN_LOWAT))
    };
    let mut lowat =
        net::Lowat::new(c.stream.tcp(), mark(count)).map_err(|e| format!("SO_RCVLOWAT: {e}"))?;
    let deadline = t_connect + Duration::from_secs_f64(o.time_limit);
    let grace = deadline + Duration::from_secs(1);
    let pending = std::mem::take(&mut c.pending);
    let mut received = st.chunk(&pending, false, 0)?;
    let mut first_s = (received > 0).then_some(connack_s);
    let (mut reads, mut bytes) = (0u64, pending.len() as u64);
    let mut buf = vec![0u8; READ_BUF];
    let mut last_data = Instant::now();
    while received < count {
        match c.stream.read(&mut buf) {
            Ok(0) => {
                return Err(format!(
                    "broker closed the connection after {received} of {count} messages"
                ))
            }
            Ok(n) => {
                last_data = Instant::now();
                reads += 1;
                bytes += n as u64;
                received += st.chunk(&buf[..n], false, 0)?;
                lowat.after_read(c.stream.tcp(), n);
                lowat.cap(c.stream.tcp(), mark(count.saturating_sub(received)));
                if first_s.is_none() && received > 0 {
                    first_s = Some(t_connect.elapsed().as_secs_f64());
                }
            }
            Err(e) if net::is_timeout(&e) => {}
            Err(e) => return Err(format!("read failed: {e}")),
        }
        if !st.acks.is_empty() && received < count {
            let w = net::write_until(&mut c.stream, &st.acks, grace)
                .map_err(|e| format!("sending PUBACKs failed: {e}"))?;
            if w < st.acks.len() {
                return Err("PUBACKs blocked past the time limit".into());
            }
            st.acks.clear();
        }
        let now = Instant::now();
        if received < count && now >= deadline {
            return Err(format!(
                "time limit: {received} of {count} messages after {:.1} s",
                o.time_limit
            ));
        }
        if received < count && now.duration_since(last_data) >= DRAIN_IDLE {
            return Err(format!(
                "{received} of {count} messages, then nothing for {} s",
                DRAIN_IDLE.as_secs()
            ));
        }
    }
    let drain_s = t_connect.elapsed().as_secs_f64();
    let (pct, wall) = cpu.finish();
    // The last PUBACKs, then go offline (the session stays).
    let _ = net::write_until(&mut c.stream, &st.acks, grace);
    let _ = net::write_until(&mut c.stream, &mqtt::DISCONNECT, grace);
    let mut r = Obj::new();
    r.set("scenario", "drain")
        .set("params", run::params(o))
        .set("received", received)
        .set("connack_s", connack_s)
        .set("first_message_s", first_s.unwrap_or(drain_s))
        .set("drain_s", drain_s)
        .set("delivered_per_s", received as f64 / drain_s)
        .set("session_present", true);
    if reads > 0 {
        r.set("subscriber_bytes_per_read", bytes as f64 / reads as f64);
    }
    if lowat.backoffs > 0 {
        r.set("lowat_backoffs", lowat.backoffs);
    }
    run::set_cpu(&mut r, pct, wall);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas_add_up() {
        for (count, n) in [(1_000_000, 8), (10, 3), (2, 5), (7, 7)] {
            let q: Vec<u64> = (0..n).map(|i| quota(count, n, i)).collect();
            assert_eq!(q.iter().sum::<u64>(), count as u64);
            assert!(q.iter().max().unwrap() - q.iter().min().unwrap() <= 1);
        }
    }
}
