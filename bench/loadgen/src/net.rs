//! Sockets and process plumbing: source-bound connects, time-bounded writes, CPU time,
//! file-descriptor limit, timer slack.

use std::io::{self, ErrorKind, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// How long one blocking socket call may wait before a loop looks at the clock again.
pub const POLL: Duration = Duration::from_millis(100);

pub fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}:{port}: {e}"))?;
    addrs
        .next()
        .ok_or_else(|| format!("{host}:{port} resolves to no address"))
}

/// Raises the soft RLIMIT_NOFILE to the hard limit; returns (soft, hard) as they end up.
pub fn raise_nofile_limit() -> (u64, u64) {
    // SAFETY: getrlimit / setrlimit write to / read from a local struct.
    unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return (0, 0);
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
        (r.rlim_cur, r.rlim_max)
    }
}

/// User + system CPU time of the whole process (all threads) so far.
pub fn cpu_time() -> Duration {
    // SAFETY: getrusage fills a zeroed local struct.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut ru) != 0 {
            return Duration::ZERO;
        }
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
        };
        tv(ru.ru_utime) + tv(ru.ru_stime)
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the send time a latency payload carries (little-endian
/// u64 in its first 8 bytes) and the receive time it is compared with.
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills a local timespec (vDSO, no system call).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Timer slack of the calling thread (default 50 µs), so paced sleeps wake on time.
pub fn set_timer_slack_ns(ns: u64) {
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, ns as libc::c_ulong, 0, 0, 0);
    }
}

fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data, large and aligned enough for both families.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: see above.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: see above.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Starts a nonblocking TCP connect to `dst`, from source address `src` if given (bound
/// before connect, the port chosen at connect time so that every source address has the
/// whole ephemeral range per destination). TCP_NODELAY is set. Returns the nonblocking
/// socket and whether it is already connected; if not, it becomes writable when the
/// handshake ends (then see [`so_error`]).
pub fn start_connect(dst: SocketAddr, src: Option<Ipv4Addr>) -> io::Result<(TcpStream, bool)> {
    let family = match (dst, src) {
        (SocketAddr::V4(_), _) => libc::AF_INET,
        (SocketAddr::V6(_), None) => libc::AF_INET6,
        (SocketAddr::V6(_), Some(_)) => {
            return Err(io::Error::new(
                ErrorKind::InvalidInput,
                "source addresses are IPv4, the broker address is IPv6",
            ))
        }
    };
    // SAFETY: plain socket calls on a descriptor owned by `fd` (closed on every error path),
    // with pointers to local, correctly sized sockaddr / int values.
    unsafe {
        let raw = libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        );
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(raw);
        let one: libc::c_int = 1;
        let int_len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        libc::setsockopt(
            raw,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&one as *const libc::c_int).cast(),
            int_len,
        );
        if let Some(src) = src {
            // Best effort (Linux >= 4.2): without it bind picks the port, limiting each
            // source address to one ephemeral range for all destinations together.
            libc::setsockopt(
                raw,
                libc::IPPROTO_IP,
                libc::IP_BIND_ADDRESS_NO_PORT,
                (&one as *const libc::c_int).cast(),
                int_len,
            );
            let (sa, salen) = sockaddr(SocketAddr::V4(SocketAddrV4::new(src, 0)));
            if libc::bind(raw, (&sa as *const libc::sockaddr_storage).cast(), salen) != 0 {
                let e = io::Error::last_os_error();
                return Err(io::Error::new(e.kind(), format!("bind to {src}: {e}")));
            }
        }
        let (da, dalen) = sockaddr(dst);
        let done = libc::connect(raw, (&da as *const libc::sockaddr_storage).cast(), dalen) == 0;
        if !done {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINPROGRESS) {
                return Err(e);
            }
        }
        Ok((TcpStream::from(fd), done))
    }
}

/// The pending error of a socket (the outcome of a nonblocking connect).
pub fn so_error(s: &TcpStream) -> io::Result<()> {
    match s.take_error()? {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Blocking TCP connect with a timeout, optionally from source address `src` (see
/// [`start_connect`]). TCP_NODELAY is set; the stream is blocking.
pub fn connect(dst: SocketAddr, src: Option<Ipv4Addr>, timeout: Duration) -> io::Result<TcpStream> {
    let (s, done) = start_connect(dst, src)?;
    if !done {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(ErrorKind::TimedOut, "connect timed out"));
            }
            let mut pfd = libc::pollfd {
                fd: s.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: poll on one local pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r > 0 {
                break;
            }
        }
        so_error(&s)?;
    }
    s.set_nonblocking(false)?;
    Ok(s)
}

/// Writes all of `buf` unless `hard_deadline` passes first (the stream must have a write
/// timeout so that a blocked write returns to look at the clock). Returns the bytes written.
pub fn write_until<W: Write>(s: &mut W, buf: &[u8], hard_deadline: Instant) -> io::Result<usize> {
    let mut off = 0;
    while off < buf.len() {
        match s.write(&buf[off..]) {
            Ok(0) => return Err(io::Error::new(ErrorKind::WriteZero, "connection closed")),
            Ok(n) => off += n,
            Err(e) if is_timeout(&e) => {
                if Instant::now() >= hard_deadline {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(off)
}

/// A socket timeout (SO_RCVTIMEO / SO_SNDTIMEO expiry) or EINTR: try again.
pub fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
    )
}

/// SO_RCVLOWAT: a blocking read waits for `bytes` (or its timeout, then returns what there
/// is), and the kernel does not wake the reader for less. Cuts a subscriber's wake-ups and
/// reads when the broker writes message by message.
pub fn set_rcvlowat(s: &TcpStream, bytes: usize) -> io::Result<()> {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: setsockopt with a pointer to a local int.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A low-water mark that backs off: where the bytes in flight towards us are bounded (QoS 1
/// windows), a mark above what the broker will ever have outstanding would make every read
/// wait for its timeout. A read that returns fewer bytes than the mark did just that (Linux
/// returns short only on timeout, signal, error or EOF), so the mark is halved.
pub struct Lowat {
    cur: usize,
    pub backoffs: u32,
}

impl Lowat {
    pub fn new(s: &TcpStream, want: usize) -> io::Result<Lowat> {
        let cur = if want >= 8 {
            set_rcvlowat(s, want)?;
            want
        } else {
            1
        };
        Ok(Lowat { cur, backoffs: 0 })
    }

    /// Lowers the mark to at most `max` bytes (when no more than that is still expected).
    #[inline]
    pub fn cap(&mut self, s: &TcpStream, max: usize) {
        if self.cur > max.max(1) {
            self.cur = if max < 8 { 1 } else { max };
            let _ = set_rcvlowat(s, self.cur);
        }
    }

    /// After a read that returned `n` > 0 bytes.
    #[inline]
    pub fn after_read(&mut self, s: &TcpStream, n: usize) {
        if self.cur > 1 && n < self.cur {
            self.cur = if self.cur / 2 < 8 { 1 } else { self.cur / 2 };
            self.backoffs += 1;
            let _ = set_rcvlowat(s, self.cur);
        }
    }
}

/// Whether the peer has closed (or reset) the connection, without blocking or consuming.
pub fn peer_closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: recv into a local one-byte buffer.
    let r = unsafe {
        libc::recv(
            s.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if r == 0 {
        return true;
    }
    if r < 0 {
        let e = io::Error::last_os_error();
        return !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted);
    }
    false
}

/// Parses `127.0.0.2-127.0.0.16,10.0.0.1`: IPv4 addresses and inclusive ranges.
pub fn parse_sources(spec: &str) -> Result<Vec<Ipv4Addr>, String> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let a: Ipv4Addr = a
            .parse()
            .map_err(|_| format!("--sources: {a:?} is not an IPv4 address"))?;
        let b: Ipv4Addr = b
            .parse()
            .map_err(|_| format!("--sources: {b:?} is not an IPv4 address"))?;
        let (a, b) = (u32::from(a), u32::from(b));
        if b < a || b - a >= 65_536 {
            return Err(format!("--sources: bad range {part:?}"));
        }
        out.extend((a..=b).map(Ipv4Addr::from));
    }
    if out.is_empty() {
        return Err("--sources: no address".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    #[test]
    fn sources() {
        let v = parse_sources("127.0.0.2-127.0.0.4, 127.0.0.9").unwrap();
        assert_eq!(
            v,
            ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.9"]
                .iter()
                .map(|s| s.parse::<Ipv4Addr>().unwrap())
                .collect::<Vec<_>>()
        );
        assert!(parse_sources("127.0.0.4-127.0.0.2").is_err());
        assert!(parse_sources("nope").is_err());
        assert!(parse_sources("").is_err());
    }

    #[test]
    fn bound_connect_and_peer_close() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let c = connect(
            addr,
            Some(Ipv4Addr::new(127, 0, 0, 3)),
            Duration::from_secs(2),
        )
        .unwrap();
        let (srv, peer) = l.accept().unwrap();
        assert_eq!(peer.ip(), IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3)));
        assert!(!peer_closed(&c));
        drop(srv);
        std::thread::sleep(Duration::from_millis(50));
        assert!(peer_closed(&c));
    }

    #[test]
    fn rcvlowat_read_returns_partial_data_on_timeout() {
        use std::io::Read;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = connect(l.local_addr().unwrap(), None, Duration::from_secs(2)).unwrap();
        let (mut srv, _) = l.accept().unwrap();
        set_rcvlowat(&srv, 64 * 1024).unwrap();
        srv.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        c.write_all(&[1u8; 100]).unwrap();
        let mut buf = [0u8; 1024];
        let t = Instant::now();
        let n = loop {
            match srv.read(&mut buf) {
                Ok(n) => break n,
                Err(e) if is_timeout(&e) && t.elapsed() < Duration::from_secs(2) => continue,
                Err(e) => panic!("{e}"),
            }
        };
        assert_eq!(n, 100);
    }

    #[test]
    fn lowat_backs_off_on_short_reads() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _c = connect(l.local_addr().unwrap(), None, Duration::from_secs(2)).unwrap();
        let (srv, _) = l.accept().unwrap();
        let mut lw = Lowat::new(&srv, 100).unwrap();
        lw.after_read(&srv, 100);
        assert_eq!((lw.cur, lw.backoffs), (100, 0));
        lw.after_read(&srv, 99);
        assert_eq!((lw.cur, lw.backoffs), (50, 1));
        for _ in 0..3 {
            lw.after_read(&srv, 1);
        }
        // 50 -> 25 -> 12 -> off (1): a mark under 8 bytes is not worth keeping.
        assert_eq!((lw.cur, lw.backoffs), (1, 4));
        lw.after_read(&srv, 1);
        assert_eq!(lw.backoffs, 4);
        assert_eq!(Lowat::new(&srv, 4).unwrap().cur, 1);
        let mut lw = Lowat::new(&srv, 1000).unwrap();
        lw.cap(&srv, 2000);
        assert_eq!(lw.cur, 1000);
        lw.cap(&srv, 300);
        assert_eq!((lw.cur, lw.backoffs), (300, 0));
        lw.cap(&srv, 5);
        assert_eq!(lw.cur, 1);
    }

    #[test]
    fn cpu_time_advances() {
        let a = cpu_time();
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < Duration::from_millis(30) {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        std::hint::black_box(x);
        assert!(cpu_time() > a);
    }
}
