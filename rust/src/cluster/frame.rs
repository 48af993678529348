//! Frames of an inter-node connection: a `u32` big-endian length of what follows, then a
//! `u8` kind, then one encoded value ([`super::wire`]). Sans-I/O: [`FrameDecoder`] takes
//! the bytes read in any split and hands back whole frames.

use super::wire::{Value, WireError, Writer};

/// The default bound on a frame's announced length (kind and value).
pub const DEFAULT_MAX_FRAME: usize = 16 * 1024 * 1024;

const HEADER_LEN: usize = 4;

/// Where a frame begins in a [`Writer`], between [`start_frame`] and [`finish_frame`].
#[derive(Debug, Clone, Copy)]
pub struct FrameStart(usize);

/// Writes the header of a frame of `kind` (its length still unknown); the caller writes
/// one value and then calls [`finish_frame`].
pub fn start_frame(w: &mut Writer, kind: u8) -> FrameStart {
    let start = w.buf.len();
    w.buf.extend_from_slice(&[0; HEADER_LEN]);
    w.buf.push(kind);
    FrameStart(start)
}

/// Fills in the length of the frame begun at `start`. A frame over `u32::MAX` bytes is an
/// error, and then the writer is cut back to where the frame began.
pub fn finish_frame(w: &mut Writer, start: FrameStart) -> Result<(), WireError> {
    let at = start.0;
    let len = w.buf.len() - at - HEADER_LEN;
    let Ok(len) = u32::try_from(len) else {
        w.buf.truncate(at);
        return Err(WireError::FrameTooLarge {
            len: len as u64,
            max: u64::from(u32::MAX),
        });
    };
    w.buf[at..at + HEADER_LEN].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

/// One whole frame: its kind and its value.
pub fn encode_frame(kind: u8, value: &Value) -> Result<Vec<u8>, WireError> {
    let mut w = Writer::default();
    let start = start_frame(&mut w, kind);
    value.encode(&mut w)?;
    finish_frame(&mut w, start)?;
    Ok(w.buf)
}

/// Reassembles frames from a byte stream cut anywhere. A broken stream stays broken: after
/// an error every later call returns the same error (the caller drops the connection).
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already handed out as frames.
    start: usize,
    max_frame: usize,
    failed: Option<WireError>,
}

impl FrameDecoder {
    /// `max_frame` bounds a frame's announced length (kind and value, not the 4-byte
    /// header); a longer one is an error as soon as its header arrives.
    pub fn new(max_frame: usize) -> FrameDecoder {
        FrameDecoder {
            buf: Vec::new(),
            start: 0,
            max_frame,
            failed: None,
        }
    }

    pub fn max_frame(&self) -> usize {
        self.max_frame
    }

    /// Bytes held waiting for the rest of a frame (or not yet taken with `next_*`).
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Takes the bytes held (a partial frame), leaving the decoder empty: what another
    /// decoder of the same stream starts from.
    pub fn take_buffered(&mut self) -> Vec<u8> {
        let rest = self.buf.split_off(self.start);
        self.buf.clear();
        self.start = 0;
        rest
    }

    /// Appends bytes read from the connection.
    pub fn extend(&mut self, data: &[u8]) {
        // Frames handed out are dropped here, not one by one: at most one partial frame
        // (or the frames of the last read not yet taken) is moved.
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// The next whole frame's kind and still-encoded value; `None` until more bytes arrive.
    /// Only the framing is checked: a caller decoding the value itself (with
    /// [`super::wire::decode_with`]) must treat the stream as broken if that fails, as the
    /// Python bindings do.
    pub fn next_raw(&mut self) -> Result<Option<(u8, &[u8])>, WireError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let pending = &self.buf[self.start..];
        let Some(header) = pending.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes(*header);
        // usize is at least 32 bits on every target this builds for.
        let len_usize = len as usize;
        if len_usize > self.max_frame {
            return Err(self.fail(WireError::FrameTooLarge {
                len: u64::from(len),
                max: self.max_frame as u64,
            }));
        }
        if len == 0 {
            return Err(self.fail(WireError::EmptyFrame));
        }
        if pending.len() < HEADER_LEN + len_usize {
            return Ok(None);
        }
        let kind_at = self.start + HEADER_LEN;
        let end = kind_at + len_usize;
        self.start = end;
        Ok(Some((self.buf[kind_at], &self.buf[kind_at + 1..end])))
    }

    /// The next whole frame as a [`Value`]; `None` until more bytes arrive.
    /// A value that does not decode breaks the stream like a bad header.
    pub fn next_frame(&mut self) -> Result<Option<(u8, Value)>, WireError> {
        let Some((kind, body)) = self.next_raw()? else {
            return Ok(None);
        };
        match Value::decode(body) {
            Ok(v) => Ok(Some((kind, v))),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn fail(&mut self, e: WireError) -> WireError {
        self.failed = Some(e.clone());
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::wire::tests::value_strategy;
    use proptest::prelude::*;

    fn frame(kind: u8, v: &Value) -> Vec<u8> {
        encode_frame(kind, v).expect("encodable")
    }

    /// Feeds `chunks` one by one, collecting frames until the first error.
    fn feed_all<'a>(
        d: &mut FrameDecoder,
        chunks: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Vec<(u8, Value)>, WireError> {
        let mut out = Vec::new();
        for chunk in chunks {
            d.extend(chunk);
            while let Some(f) = d.next_frame()? {
                out.push(f);
            }
        }
        Ok(out)
    }

    /// Feeds `chunks` one by one: every frame before the first error, and that error.
    fn frames_and_error<'a>(
        d: &mut FrameDecoder,
        chunks: impl IntoIterator<Item = &'a [u8]>,
    ) -> (Vec<(u8, Value)>, Option<WireError>) {
        let mut out = Vec::new();
        for chunk in chunks {
            d.extend(chunk);
            loop {
                match d.next_frame() {
                    Ok(Some(f)) => out.push(f),
                    Ok(None) => break,
                    Err(e) => return (out, Some(e)),
                }
            }
        }
        (out, None)
    }

    #[test]
    fn frame_layout_is_pinned() {
        assert_eq!(frame(7, &Value::None), [0, 0, 0, 2, 7, 0]);
        assert_eq!(frame(255, &Value::Int(-1)), [0, 0, 0, 3, 255, 3, 1]);
        let big = Value::Bytes(vec![0; 300]);
        let f = frame(0, &big);
        assert_eq!(f[..4], (1u32 + 1 + 2 + 300).to_be_bytes());
        assert_eq!(f.len(), 4 + 304);
    }

    #[test]
    fn too_deep_value_is_not_framed() {
        let mut v = Value::None;
        for _ in 0..=crate::cluster::wire::MAX_DEPTH {
            v = Value::List(vec![v]);
        }
        assert_eq!(encode_frame(1, &v), Err(WireError::TooDeep));
    }

    #[test]
    fn frames_in_one_chunk_and_byte_by_byte() {
        let frames = vec![
            (1, Value::None),
            (2, Value::Str("hello".into())),
            (0, Value::Dict(vec![(Value::Int(1), Value::List(vec![]))])),
            (255, Value::Bytes(vec![9; 1000])),
        ];
        let stream: Vec<u8> = frames.iter().flat_map(|(k, v)| frame(*k, v)).collect();

        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        assert_eq!(feed_all(&mut d, [&stream[..]]), Ok(frames.clone()));
        assert_eq!(d.buffered(), 0);

        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        assert_eq!(feed_all(&mut d, stream.chunks(1)), Ok(frames));
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn partial_frame_stays_buffered() {
        let f = frame(3, &Value::Str("abc".into()));
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        for (i, byte) in f[..f.len() - 1].iter().enumerate() {
            d.extend(std::slice::from_ref(byte));
            assert_eq!(d.next_frame(), Ok(None));
            assert_eq!(d.buffered(), i + 1);
        }
        // The last byte and the start of the next frame.
        d.extend(&[f[f.len() - 1], 0, 0]);
        assert_eq!(d.next_frame(), Ok(Some((3, Value::Str("abc".into())))));
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.buffered(), 2);
        d.extend(&[0, 2, 9, 0]);
        assert_eq!(d.next_frame(), Ok(Some((9, Value::None))));
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn max_frame_is_checked_on_the_header_alone() {
        let mut d = FrameDecoder::new(100);
        d.extend(&101u32.to_be_bytes());
        assert_eq!(
            d.next_frame(),
            Err(WireError::FrameTooLarge { len: 101, max: 100 })
        );
        // The largest length the default allows waits for its body; one more is refused.
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        d.extend(&(DEFAULT_MAX_FRAME as u32).to_be_bytes());
        assert_eq!(d.next_frame(), Ok(None));
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        d.extend(&(DEFAULT_MAX_FRAME as u32 + 1).to_be_bytes());
        assert!(matches!(
            d.next_frame(),
            Err(WireError::FrameTooLarge { .. })
        ));
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        d.extend(&u32::MAX.to_be_bytes());
        assert!(d.next_frame().is_err());
    }

    #[test]
    fn a_frame_of_exactly_max_frame_passes() {
        // Kind, tag, 1-byte length, 97 bytes: 100.
        let f = frame(1, &Value::Bytes(vec![5; 97]));
        assert_eq!(f.len(), 104);
        let mut d = FrameDecoder::new(100);
        assert_eq!(
            feed_all(&mut d, [&f[..]]),
            Ok(vec![(1, Value::Bytes(vec![5; 97]))])
        );
        let mut d = FrameDecoder::new(99);
        assert!(feed_all(&mut d, [&f[..]]).is_err());
    }

    #[test]
    fn framing_and_value_errors() {
        let cases: &[(&[u8], WireError)] = &[
            (&[0, 0, 0, 0], WireError::EmptyFrame),
            // A kind and no value.
            (&[0, 0, 0, 1, 7], WireError::Truncated),
            // A value shorter than the frame: trailing bytes inside it.
            (&[0, 0, 0, 3, 7, 0, 0], WireError::TrailingBytes),
            // A value running past the frame's end (into the next frame's bytes).
            (&[0, 0, 0, 3, 7, 5, 2, b'a', b'b'], WireError::Truncated),
            (&[0, 0, 0, 2, 7, 42], WireError::UnknownTag(42)),
        ];
        for (bytes, err) in cases {
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
            assert_eq!(feed_all(&mut d, [*bytes]).as_ref(), Err(err), "{bytes:?}");
        }
    }

    #[test]
    fn errors_are_sticky() {
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        d.extend(&[0, 0, 0, 2, 1, 99]);
        assert_eq!(d.next_frame(), Err(WireError::UnknownTag(99)));
        d.extend(&frame(1, &Value::None));
        assert_eq!(d.next_frame(), Err(WireError::UnknownTag(99)));
        assert_eq!(d.next_raw(), Err(WireError::UnknownTag(99)));

        let mut d = FrameDecoder::new(4);
        d.extend(&[0, 0, 0, 5]);
        assert!(d.next_raw().is_err());
        d.extend(&[1, 0, 0, 0, 0]);
        assert!(d.next_raw().is_err());
    }

    #[test]
    fn next_raw_leaves_the_value_encoded() {
        let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
        d.extend(&frame(4, &Value::Int(1)));
        assert_eq!(d.next_raw(), Ok(Some((4, &[3u8, 2][..]))));
        assert_eq!(d.next_raw(), Ok(None));
    }

    proptest! {
        /// Any split of a stream gives the frames that the whole stream gives.
        #[test]
        fn random_splits_give_the_same_frames(
            frames in proptest::collection::vec((any::<u8>(), value_strategy()), 0..6),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..8),
        ) {
            let stream: Vec<u8> = frames.iter().flat_map(|(k, v)| frame(*k, v)).collect();
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(stream.len() + 1)).collect();
            at.push(0);
            at.push(stream.len());
            at.sort_unstable();
            let chunks = at.windows(2).map(|w| &stream[w[0]..w[1]]);
            let mut d = FrameDecoder::new(DEFAULT_MAX_FRAME);
            prop_assert_eq!(feed_all(&mut d, chunks), Ok(frames));
            prop_assert_eq!(d.buffered(), 0);
        }

        /// Arbitrary bytes: never a panic, and the same outcome whole or byte by byte.
        #[test]
        fn arbitrary_streams(
            data in proptest::collection::vec(prop_oneof![0u8..12, any::<u8>()], 0..80),
            max in 0usize..40,
        ) {
            let whole = frames_and_error(&mut FrameDecoder::new(max), [&data[..]]);
            let bytewise = frames_and_error(&mut FrameDecoder::new(max), data.chunks(1));
            prop_assert_eq!(whole, bytewise);
        }
    }
}
