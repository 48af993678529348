//! The envelope around every stored value: format version, flags, a checksum, the body.
//!
//! ```text
//! [version u8][flags u8][xxh3-64 of key + flags + stored body, u64 LE][stored body]
//! ```
//! The checksum covers the record's key too, so a value read under the wrong key (a damaged
//! key) fails like a damaged value. A torn write, a flipped bit or a value from a newer
//! format is reported, never decoded.
//! Bodies above the configured size are compressed with zstd (flag bit 0).

/// Version of the value layout; a newer one is refused, not guessed at.
pub const VERSION: u8 = 1;
const FLAG_ZSTD: u8 = 1;
const HEADER: usize = 1 + 1 + 8;
/// zstd level 1: compression is for large payloads on the write path, speed first.
const ZSTD_LEVEL: i32 = 1;
/// A stored body never decompresses to more than this (the largest MQTT packet), so a
/// corrupt size field cannot make recovery allocate without bound.
const MAX_BODY: usize = 268_435_455 + 5;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvelopeError {
    TooShort,
    UnknownVersion(u8),
    UnknownFlags(u8),
    Checksum,
    Decompress(String),
}

impl std::fmt::Display for EnvelopeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EnvelopeError::TooShort => write!(f, "value shorter than its header (torn write?)"),
            EnvelopeError::UnknownVersion(v) => write!(f, "value format {v} is not known"),
            EnvelopeError::UnknownFlags(x) => write!(f, "unknown value flags 0x{x:02x}"),
            EnvelopeError::Checksum => write!(f, "checksum mismatch (corrupted value)"),
            EnvelopeError::Decompress(e) => write!(f, "cannot decompress value: {e}"),
        }
    }
}

/// Wraps `body`, compressing it when it is longer than `compress_above` bytes (0 = never)
/// and compression actually saves space.
pub fn seal(key: &[u8], body: &[u8], compress_above: usize) -> Vec<u8> {
    if compress_above > 0 && body.len() > compress_above {
        if let Ok(packed) = zstd::bulk::compress(body, ZSTD_LEVEL) {
            if packed.len() < body.len() {
                return frame(key, FLAG_ZSTD, &packed);
            }
        }
    }
    frame(key, 0, body)
}

fn frame(key: &[u8], flags: u8, stored: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + stored.len());
    out.push(VERSION);
    out.push(flags);
    out.extend_from_slice(&checksum(key, flags, stored).to_le_bytes());
    out.extend_from_slice(stored);
    out
}

fn checksum(key: &[u8], flags: u8, stored: &[u8]) -> u64 {
    // One streaming hash over key, flags and body: a flipped compression bit or a value
    // under another key must not pass.
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&(key.len() as u32).to_le_bytes());
    h.update(key);
    h.update(&[flags]);
    h.update(stored);
    h.digest()
}

/// Checks and unwraps a stored value; the body is borrowed unless it was compressed.
pub fn open<'v>(key: &[u8], value: &'v [u8]) -> Result<std::borrow::Cow<'v, [u8]>, EnvelopeError> {
    if value.len() < HEADER {
        return Err(EnvelopeError::TooShort);
    }
    if value[0] != VERSION {
        return Err(EnvelopeError::UnknownVersion(value[0]));
    }
    let flags = value[1];
    if flags & !FLAG_ZSTD != 0 {
        return Err(EnvelopeError::UnknownFlags(flags));
    }
    let want = u64::from_le_bytes(value[2..HEADER].try_into().expect("8 bytes"));
    let stored = &value[HEADER..];
    if checksum(key, flags, stored) != want {
        return Err(EnvelopeError::Checksum);
    }
    if flags & FLAG_ZSTD == 0 {
        return Ok(std::borrow::Cow::Borrowed(stored));
    }
    let size = zstd::zstd_safe::get_frame_content_size(stored)
        .ok()
        .flatten()
        .ok_or_else(|| EnvelopeError::Decompress("no content size".into()))?;
    if size > MAX_BODY as u64 {
        return Err(EnvelopeError::Decompress(format!(
            "{size} bytes is too large"
        )));
    }
    zstd::bulk::decompress(stored, size as usize)
        .map(std::borrow::Cow::Owned)
        .map_err(|e| EnvelopeError::Decompress(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_plain_and_compressed() {
        let small = b"hello".to_vec();
        assert_eq!(&*open(b"k", &seal(b"k", &small, 4096)).unwrap(), &small[..]);
        let big = vec![b'a'; 100_000];
        let sealed = seal(b"k", &big, 4096);
        assert!(sealed.len() < 1000, "compressed to {}", sealed.len());
        assert_eq!(sealed[1], FLAG_ZSTD);
        assert_eq!(&*open(b"k", &sealed).unwrap(), &big[..]);
        // Incompressible data is stored as is.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<u8> = (0..10_000)
            .map(|_| {
                // xorshift64: incompressible enough for zstd.
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        assert_eq!(seal(b"k", &noise, 16)[1], 0);
        assert_eq!(&*open(b"k", &seal(b"k", &big, 0)).unwrap(), &big[..]);
        // The same value under another key fails.
        assert_eq!(open(b"j", &sealed), Err(EnvelopeError::Checksum));
    }

    #[test]
    fn every_single_bit_flip_and_truncation_is_detected() {
        for body in [b"some value".to_vec(), vec![7u8; 20_000]] {
            let sealed = seal(b"key", &body, 100);
            for i in 0..sealed.len().min(400) {
                for bit in 0..8 {
                    let mut bad = sealed.clone();
                    bad[i] ^= 1 << bit;
                    assert!(
                        open(b"key", &bad).is_err(),
                        "flip of bit {bit} in byte {i} passed"
                    );
                }
            }
            for len in 0..sealed.len() {
                assert!(
                    open(b"key", &sealed[..len]).is_err(),
                    "truncation to {len} passed"
                );
            }
        }
    }

    #[test]
    fn newer_versions_are_refused() {
        let mut sealed = seal(b"k", b"x", 0);
        sealed[0] = VERSION + 1;
        assert_eq!(
            open(b"k", &sealed),
            Err(EnvelopeError::UnknownVersion(VERSION + 1))
        );
    }
}
