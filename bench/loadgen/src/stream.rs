//! A client's byte stream: plain TCP (the default), TLS (`--tls-ca`, rustls) or WebSocket
//! (`--ws-path`, over TCP or TLS), plus the credentials every CONNECT carries. All of it is
//! chosen once per process from the command line ([`configure`]).
//!
//! The hot loops read and write a [`Stream`] as they would a `TcpStream`: with plain TCP
//! that is one match on the variant per system call, nothing else. Socket options (timeouts,
//! SO_RCVLOWAT, nonblocking) always act on the TCP socket underneath ([`Stream::tcp`]).
//!
//! TLS and WebSocket writes follow one rule so that `net::write_until` and the publishers'
//! byte counts stay right: bytes an earlier `write` accepted are pushed out first, and a
//! socket timeout then is returned as an error with nothing new accepted; afterwards the new
//! bytes are taken (encrypted or framed) and pushed as far as the socket allows. Each `read`
//! first pushes out what is still pending, so a PUBACK never waits behind a blocked read.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore};

use crate::cli::Opts;
use crate::net::{self, POLL};

/// Process-wide client set-up.
#[derive(Default)]
pub struct Setup {
    tls: Option<TlsSetup>,
    /// WebSocket request path (None: MQTT straight over TCP/TLS).
    ws_path: Option<String>,
    /// `Host` header of the WebSocket upgrade request.
    ws_host: String,
    pub username: Option<String>,
    pub password: Option<String>,
}

struct TlsSetup {
    config: Arc<ClientConfig>,
    server_name: ServerName<'static>,
}

static SETUP: OnceLock<Setup> = OnceLock::new();
/// What the first TLS handshake negotiated ("TLSv1_3 TLS13_AES_256_GCM_SHA384"), for the result.
static NEGOTIATED: OnceLock<String> = OnceLock::new();

/// Reads the CA file and builds the TLS configuration; call once before connecting.
pub fn configure(o: &Opts) -> Result<(), String> {
    let tls = match &o.tls_ca {
        Some(path) => Some(tls_setup(
            path,
            o.tls_server_name.as_deref().unwrap_or(&o.host),
        )?),
        None => None,
    };
    let setup = Setup {
        tls,
        ws_path: o.ws_path.clone(),
        ws_host: format!("{}:{}", o.host, o.port),
        username: o.username.clone(),
        password: o.password.clone(),
    };
    SETUP
        .set(setup)
        .map_err(|_| "stream::configure called twice".to_string())
}

/// The set-up (plain TCP without credentials until [`configure`] ran: unit tests).
pub fn setup() -> &'static Setup {
    SETUP.get_or_init(Setup::default)
}

/// "tcp", "tls", "ws" or "wss".
pub fn transport_name() -> &'static str {
    let s = setup();
    match (s.tls.is_some(), s.ws_path.is_some()) {
        (false, false) => "tcp",
        (true, false) => "tls",
        (false, true) => "ws",
        (true, true) => "wss",
    }
}

pub fn negotiated() -> Option<&'static str> {
    NEGOTIATED.get().map(String::as_str)
}

fn tls_setup(ca_file: &str, server_name: &str) -> Result<TlsSetup, String> {
    let mut roots = RootCertStore::empty();
    let certs =
        CertificateDer::pem_file_iter(ca_file).map_err(|e| format!("--tls-ca {ca_file}: {e}"))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("--tls-ca {ca_file}: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("--tls-ca {ca_file}: {e}"))?;
    }
    if roots.is_empty() {
        return Err(format!("--tls-ca {ca_file}: no certificate in it"));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let server_name = ServerName::try_from(server_name.to_string())
        .map_err(|e| format!("TLS server name {server_name:?}: {e}"))?;
    Ok(TlsSetup {
        config: Arc::new(config),
        server_name,
    })
}

/// Turns a connected TCP socket into the configured stream: TLS handshake and/or WebSocket
/// upgrade, each bounded by `deadline`. The socket ends up blocking with no timeouts set.
pub fn wrap(tcp: TcpStream, deadline: Instant) -> Result<Stream, String> {
    let s = setup();
    let mut stream = match &s.tls {
        None => Stream::Tcp(tcp),
        Some(t) => Stream::Tls(Box::new(
            TlsStream::handshake(tcp, t, deadline).map_err(|e| format!("TLS handshake: {e}"))?,
        )),
    };
    if let Some(path) = &s.ws_path {
        stream = Stream::Ws(Box::new(
            WsStream::upgrade(stream, &s.ws_host, path, deadline)
                .map_err(|e| format!("WebSocket upgrade: {e}"))?,
        ));
    }
    let tcp = stream.tcp();
    tcp.set_read_timeout(None)
        .and_then(|_| tcp.set_write_timeout(None))
        .map_err(|e| e.to_string())?;
    Ok(stream)
}

pub enum Stream {
    Tcp(TcpStream),
    Tls(Box<TlsStream>),
    Ws(Box<WsStream>),
}

impl Stream {
    /// The TCP socket underneath (for socket options).
    #[inline]
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Tcp(s) => s,
            Stream::Tls(s) => &s.sock,
            Stream::Ws(s) => s.inner.tcp(),
        }
    }

    pub fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        self.tcp().set_read_timeout(t)
    }

    pub fn set_write_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        self.tcp().set_write_timeout(t)
    }

    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.tcp().set_nonblocking(on)
    }
}

impl Read for Stream {
    #[inline]
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
            Stream::Ws(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    #[inline]
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
            Stream::Ws(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
            Stream::Ws(s) => s.flush(),
        }
    }
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(ErrorKind::TimedOut, format!("timed out {what}"))
}

/// TLS over a blocking socket. Reads take up to 256 KiB from the socket at once and feed
/// them to rustls from memory (rustls alone reads 4 KiB per system call).
pub struct TlsStream {
    conn: ClientConnection,
    sock: TcpStream,
    raw: Box<[u8]>,
    raw_pos: usize,
    raw_end: usize,
}

impl TlsStream {
    fn handshake(mut sock: TcpStream, t: &TlsSetup, deadline: Instant) -> io::Result<TlsStream> {
        let mut conn = ClientConnection::new(t.config.clone(), t.server_name.clone())
            .map_err(io::Error::other)?;
        sock.set_read_timeout(Some(POLL))?;
        sock.set_write_timeout(Some(POLL))?;
        while conn.is_handshaking() {
            match conn.complete_io(&mut sock) {
                Ok(_) => {}
                Err(e) if net::is_timeout(&e) => {
                    if Instant::now() >= deadline {
                        return Err(timed_out("in the TLS handshake"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        if NEGOTIATED.get().is_none() {
            let version = conn
                .protocol_version()
                .map_or("?".to_string(), |v| format!("{v:?}"));
            let suite = conn
                .negotiated_cipher_suite()
                .map_or("?".to_string(), |s| format!("{:?}", s.suite()));
            let _ = NEGOTIATED.set(format!("{version} {suite}"));
        }
        Ok(TlsStream {
            conn,
            sock,
            raw: vec![0u8; crate::run::READ_BUF].into_boxed_slice(),
            raw_pos: 0,
            raw_end: 0,
        })
    }

    /// Writes out every TLS byte rustls holds; a socket timeout is returned as an error.
    fn push(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            if self.conn.write_tls(&mut self.sock)? == 0 {
                return Err(io::Error::new(ErrorKind::WriteZero, "connection closed"));
            }
        }
        Ok(())
    }
}

impl Read for TlsStream {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        if self.conn.wants_write() {
            let _ = self.push(); // best effort: a timeout leaves it for the next call
        }
        let mut n = 0;
        loop {
            match self.conn.reader().read(&mut out[n..]) {
                Ok(0) => return Ok(n), // close_notify
                Ok(k) => {
                    n += k;
                    if n == out.len() {
                        return Ok(n);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return if n > 0 { Ok(n) } else { Err(e) },
            }
            if self.raw_pos < self.raw_end {
                // The plaintext buffer was just emptied, so rustls takes more.
                let mut src = &self.raw[self.raw_pos..self.raw_end];
                self.raw_pos += self.conn.read_tls(&mut src)?;
                if let Err(e) = self.conn.process_new_packets() {
                    let _ = self.push(); // the alert
                    return Err(io::Error::new(ErrorKind::InvalidData, e));
                }
                continue;
            }
            if n > 0 {
                return Ok(n);
            }
            let k = self.sock.read(&mut self.raw)?;
            if k == 0 {
                return Ok(0);
            }
            (self.raw_pos, self.raw_end) = (0, k);
        }
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.push()?;
        // Up to rustls's 64 KiB of unsent TLS data, which `push` just emptied.
        let n = self.conn.writer().write(buf)?;
        let _ = self.push();
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.push()
    }
}

/// RFC 6455 client side: binary frames out, masked with the all-zero key (legal, and it
/// spares the loadgen a pass over every byte; the broker unmasks as it would any key),
/// server frames in, with pings answered and a close frame read as end of stream.
pub struct WsStream {
    inner: Stream,
    raw: Box<[u8]>,
    raw_pos: usize,
    raw_end: usize,
    /// Payload bytes of the current data frame not yet returned.
    left: u64,
    /// Frame bytes accepted by `write` but not yet written.
    out: Vec<u8>,
    out_pos: usize,
    closed: bool,
}

/// The RFC 6455 example key and the accept value that goes with it (SHA-1 + base64 of the
/// key and the GUID): any server must answer it like this.
const WS_KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
const WS_ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";
const WS_MAX_FRAME: usize = 64 * 1024;

impl WsStream {
    fn upgrade(
        mut inner: Stream,
        host: &str,
        path: &str,
        deadline: Instant,
    ) -> io::Result<WsStream> {
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: {WS_KEY}\r\nSec-WebSocket-Version: 13\r\n\
             Sec-WebSocket-Protocol: mqtt\r\n\r\n"
        );
        inner.set_write_timeout(Some(POLL))?;
        inner.set_read_timeout(Some(POLL))?;
        net::write_until(&mut inner, req.as_bytes(), deadline).and_then(|w| {
            if w < req.len() {
                Err(timed_out("sending the upgrade request"))
            } else {
                inner.flush()
            }
        })?;
        let mut raw = vec![0u8; crate::run::READ_BUF].into_boxed_slice();
        let mut end = 0;
        let head_len = loop {
            if let Some(i) = raw[..end].windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            if end >= 16 * 1024 {
                return Err(io::Error::new(
                    ErrorKind::InvalidData,
                    "response head too long",
                ));
            }
            match inner.read(&mut raw[end..]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "closed before the upgrade response",
                    ))
                }
                Ok(k) => end += k,
                Err(e) if net::is_timeout(&e) => {
                    if Instant::now() >= deadline {
                        return Err(timed_out("waiting for the upgrade response"));
                    }
                }
                Err(e) => return Err(e),
            }
        };
        check_upgrade_response(&String::from_utf8_lossy(&raw[..head_len]))
            .map_err(|e| io::Error::new(ErrorKind::InvalidData, e))?;
        Ok(WsStream {
            inner,
            raw,
            raw_pos: head_len,
            raw_end: end,
            left: 0,
            out: Vec::with_capacity(WS_MAX_FRAME + 16),
            out_pos: 0,
            closed: false,
        })
    }

    fn push(&mut self) -> io::Result<()> {
        while self.out_pos < self.out.len() {
            match self.inner.write(&self.out[self.out_pos..])? {
                0 => return Err(io::Error::new(ErrorKind::WriteZero, "connection closed")),
                k => self.out_pos += k,
            }
        }
        self.out.clear();
        self.out_pos = 0;
        self.inner.flush()
    }

    /// Queues one frame (the caller pushes it).
    fn queue_frame(&mut self, opcode: u8, payload: &[u8]) {
        frame_header(&mut self.out, opcode, payload.len());
        self.out.extend_from_slice(payload);
    }
}

fn check_upgrade_response(head: &str) -> Result<(), String> {
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or("");
    if status.split_whitespace().nth(1) != Some("101") {
        return Err(format!("the server answered {status:?}, not 101"));
    }
    let accept = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("sec-websocket-accept"))
        .map(|(_, v)| v.trim());
    if accept != Some(WS_ACCEPT) {
        return Err(format!("bad Sec-WebSocket-Accept {accept:?}"));
    }
    Ok(())
}

/// A masked (zero key) client frame header with FIN set.
fn frame_header(out: &mut Vec<u8>, opcode: u8, len: usize) {
    out.push(0x80 | opcode);
    if len < 126 {
        out.push(0x80 | len as u8);
    } else if len <= 0xffff {
        out.push(0x80 | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    out.extend_from_slice(&[0, 0, 0, 0]);
}

/// A server frame header at the front of `b`: (fin+opcode byte, payload length, header
/// length), or None until it is all there.
fn parse_frame_header(b: &[u8]) -> io::Result<Option<(u8, u64, usize)>> {
    if b.len() < 2 {
        return Ok(None);
    }
    if b[1] & 0x80 != 0 {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            "masked server frame",
        ));
    }
    let (len, hlen) = match b[1] & 0x7f {
        126 if b.len() >= 4 => (u64::from(u16::from_be_bytes([b[2], b[3]])), 4),
        127 if b.len() >= 10 => (
            u64::from_be_bytes(b[2..10].try_into().expect("8 bytes")),
            10,
        ),
        126 | 127 => return Ok(None),
        n => (u64::from(n), 2),
    };
    Ok(Some((b[0], len, hlen)))
}

impl Read for WsStream {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() || self.closed {
            return Ok(0);
        }
        if self.out_pos < self.out.len() {
            let _ = self.push();
        }
        let mut n = 0;
        loop {
            let avail = self.raw_end - self.raw_pos;
            if self.left > 0 && avail > 0 {
                let k = (self.left.min(avail as u64) as usize).min(out.len() - n);
                out[n..n + k].copy_from_slice(&self.raw[self.raw_pos..self.raw_pos + k]);
                (n, self.raw_pos, self.left) = (n + k, self.raw_pos + k, self.left - k as u64);
                if n == out.len() {
                    return Ok(n);
                }
                continue;
            }
            if self.left == 0 && avail > 0 {
                if let Some((b0, len, hlen)) =
                    parse_frame_header(&self.raw[self.raw_pos..self.raw_end])?
                {
                    let opcode = b0 & 0x0f;
                    if opcode >= 8 && (len > 125 || b0 & 0x80 == 0) {
                        return Err(io::Error::new(ErrorKind::InvalidData, "bad control frame"));
                    }
                    match opcode {
                        0 | 2 => {
                            self.raw_pos += hlen;
                            self.left = len;
                            continue;
                        }
                        8..=10 if avail >= hlen + len as usize => {
                            let start = self.raw_pos + hlen;
                            let body = self.raw[start..start + len as usize].to_vec();
                            self.raw_pos = start + len as usize;
                            match opcode {
                                8 => {
                                    self.closed = true;
                                    return Ok(n);
                                }
                                9 => {
                                    self.queue_frame(10, &body);
                                    let _ = self.push();
                                }
                                _ => {}
                            }
                            continue;
                        }
                        8..=10 => {} // a control frame still coming in
                        _ => {
                            return Err(io::Error::new(
                                ErrorKind::InvalidData,
                                format!("unexpected WebSocket opcode {opcode}"),
                            ))
                        }
                    }
                }
            }
            // More bytes needed.
            if n > 0 {
                return Ok(n);
            }
            if self.raw_pos > 0 {
                self.raw.copy_within(self.raw_pos..self.raw_end, 0);
                (self.raw_end, self.raw_pos) = (self.raw_end - self.raw_pos, 0);
            }
            let k = self.inner.read(&mut self.raw[self.raw_end..])?;
            if k == 0 {
                return Ok(0);
            }
            self.raw_end += k;
        }
    }
}

impl Write for WsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.push()?;
        let n = buf.len().min(WS_MAX_FRAME);
        self.queue_frame(2, &buf[..n]);
        let _ = self.push();
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.push()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_headers() {
        let mut v = Vec::new();
        frame_header(&mut v, 2, 5);
        assert_eq!(v, [0x82, 0x85, 0, 0, 0, 0]);
        v.clear();
        frame_header(&mut v, 2, 300);
        assert_eq!(v, [0x82, 0xfe, 1, 44, 0, 0, 0, 0]);
        v.clear();
        frame_header(&mut v, 2, 70_000);
        assert_eq!(&v[..2], [0x82, 0xff]);
        assert_eq!(u64::from_be_bytes(v[2..10].try_into().unwrap()), 70_000);
        assert_eq!(
            parse_frame_header(&[0x82, 126, 1, 44]).unwrap(),
            Some((0x82, 300, 4))
        );
        assert_eq!(parse_frame_header(&[0x82, 126, 1]).unwrap(), None);
        assert!(parse_frame_header(&[0x82, 0x85]).is_err());
    }

    #[test]
    fn upgrade_response_is_checked() {
        let ok = format!(
            "HTTP/1.1 101 Switching Protocols\r\nsec-websocket-accept: {WS_ACCEPT}\r\n\r\n"
        );
        assert!(check_upgrade_response(&ok).is_ok());
        assert!(check_upgrade_response("HTTP/1.1 400 Bad Request\r\n\r\n").is_err());
        assert!(
            check_upgrade_response("HTTP/1.1 101 OK\r\nSec-WebSocket-Accept: x\r\n\r\n").is_err()
        );
    }

    /// A WebSocket stream against a hand-written server: frames split across reads, a ping
    /// answered with a pong, a close frame read as the end.
    #[test]
    fn websocket_round_trip() {
        use std::net::TcpListener;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = vec![0u8; 4096];
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let k = s.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..k]);
            }
            let head = String::from_utf8_lossy(&got).to_string();
            assert!(head.starts_with("GET /mqtt HTTP/1.1\r\n"), "{head}");
            assert!(head.contains("Sec-WebSocket-Protocol: mqtt\r\n"));
            let resp = format!(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                 Sec-WebSocket-Accept: {WS_ACCEPT}\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
            );
            // Upgrade answer, a 300-byte binary frame split in two, a ping, a close.
            let mut frames = resp.into_bytes();
            frames.extend_from_slice(&[0x82, 126, 1, 44]);
            frames.extend_from_slice(&[7u8; 300]);
            frames.extend_from_slice(&[0x89, 2, b'h', b'i', 0x88, 0]);
            let (a, b) = frames.split_at(frames.len() - 200);
            s.write_all(a).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(30));
            s.write_all(b).unwrap();
            // The client's frame (zero mask) and its pong.
            let mut got = Vec::new();
            while got.len() < 6 + 3 + 6 + 2 {
                let k = s.read(&mut buf).unwrap();
                assert!(k > 0);
                got.extend_from_slice(&buf[..k]);
            }
            got
        });
        let tcp = net::connect(addr, None, std::time::Duration::from_secs(2)).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        let mut ws = WsStream::upgrade(Stream::Tcp(tcp), "h:1", "/mqtt", deadline).unwrap();
        ws.write_all(b"abc").unwrap();
        let mut data = Vec::new();
        let mut buf = [0u8; 64];
        loop {
            match ws.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => data.extend_from_slice(&buf[..k]),
                Err(e) if net::is_timeout(&e) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(data, vec![7u8; 300]);
        let got = server.join().unwrap();
        assert_eq!(&got[..9], [0x82, 0x83, 0, 0, 0, 0, b'a', b'b', b'c']);
        assert_eq!(&got[9..], [0x8a, 0x82, 0, 0, 0, 0, b'h', b'i']);
    }
}
