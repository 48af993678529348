//! Sans-I/O WebSocket frame codec (RFC 6455), server side, for MQTT over WebSocket.
//!
//! MQTT over WebSocket is a byte stream carried in binary messages, so the decoder does not
//! reassemble messages: the payload of every binary (and continuation) frame is unmasked and
//! appended to the output as soon as its bytes arrive, whatever the frame and read
//! boundaries. Only frame headers (at most 14 bytes) and control frames (at most 125 bytes)
//! are buffered, so a connection holds no more than that between reads.
//!
//! Control frames are answered here (ping -> pong, close -> close echo); any protocol
//! violation produces a close frame with the RFC's status code and ends decoding.

/// Normal closure.
pub const CLOSE_NORMAL: u16 = 1000;
/// The peer broke the protocol (unmasked frame, reserved bits, bad opcode, ...).
pub const CLOSE_PROTOCOL_ERROR: u16 = 1002;
/// A data type the endpoint does not accept: text frames (MQTT is binary).
pub const CLOSE_UNSUPPORTED_DATA: u16 = 1003;
/// What a close frame without a status code reports (never sent on the wire).
pub const CLOSE_NO_STATUS: u16 = 1005;
/// A close reason that is not UTF-8.
pub const CLOSE_INVALID_PAYLOAD: u16 = 1007;
/// A frame or message larger than the endpoint accepts.
pub const CLOSE_TOO_BIG: u16 = 1009;

pub const OP_CONTINUATION: u8 = 0x0;
pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xA;

/// Largest payload of a control frame (RFC 6455 5.5).
const MAX_CONTROL_PAYLOAD: usize = 125;
/// Longest frame header: 2 bytes, an 8-byte extended length and a 4-byte mask.
const MAX_HEADER: usize = 14;

/// The frame being read: its header has arrived, `remaining` payload bytes have not.
#[derive(Debug, Clone, Copy)]
struct Frame {
    opcode: u8,
    fin: bool,
    mask: [u8; 4],
    /// Payload bytes already read, which selects the mask byte for the next one.
    offset: u64,
    remaining: u64,
}

/// Incremental decoder of the frames a client sends; see the module documentation.
#[derive(Debug)]
pub struct Decoder {
    max_message_size: u64,
    header: [u8; MAX_HEADER],
    header_len: usize,
    frame: Option<Frame>,
    /// The payload of the control frame being read.
    control: Vec<u8>,
    /// A fragmented binary message is open: only continuation frames may carry data.
    in_message: bool,
    message_size: u64,
    /// The status code of the close that ended decoding, if any.
    closed: Option<u16>,
}

impl Decoder {
    /// `max_message_size` bounds a frame's payload and a fragmented message's total; past it
    /// the connection is closed with 1009.
    pub fn new(max_message_size: u64) -> Self {
        Decoder {
            max_message_size,
            header: [0; MAX_HEADER],
            header_len: 0,
            frame: None,
            control: Vec::new(),
            in_message: false,
            message_size: 0,
            closed: None,
        }
    }

    /// The status code of the close that ended decoding (the peer's, echoed, or ours for a
    /// protocol violation); None while the connection is open.
    pub fn closed(&self) -> Option<u16> {
        self.closed
    }

    /// Bytes held from a partial frame header or control frame.
    pub fn buffered(&self) -> usize {
        self.header_len + self.control.len()
    }

    /// Decodes `data`: application bytes are appended to `payload`, frames to send back
    /// (pongs, a close) to `replies`. Returns the close status code once the connection is to
    /// be closed after `replies` is written; later calls then do nothing.
    pub fn decode(
        &mut self,
        data: &[u8],
        payload: &mut Vec<u8>,
        replies: &mut Vec<u8>,
    ) -> Option<u16> {
        let mut data = data;
        while self.closed.is_none() && !data.is_empty() {
            match self.frame {
                None => data = self.read_header(data, replies),
                Some(_) => data = self.read_payload(data, payload, replies),
            }
            // A frame with an empty payload is complete as soon as its header is.
            if let Some(frame) = self.frame {
                if frame.remaining == 0 && self.closed.is_none() {
                    self.finish_frame(frame, replies);
                }
            }
        }
        self.closed
    }

    fn fail(&mut self, code: u16, replies: &mut Vec<u8>) {
        encode_close(code, "", replies);
        self.closed = Some(code);
    }

    /// Takes header bytes from `data`; returns the rest.
    fn read_header<'a>(&mut self, data: &'a [u8], replies: &mut Vec<u8>) -> &'a [u8] {
        let mut data = data;
        // The first two bytes say how long the header is.
        let mut needed = if self.header_len < 2 {
            2
        } else {
            self.header_size()
        };
        while self.header_len < needed && !data.is_empty() {
            let take = (needed - self.header_len).min(data.len());
            self.header[self.header_len..self.header_len + take].copy_from_slice(&data[..take]);
            self.header_len += take;
            data = &data[take..];
            if self.header_len == 2 {
                // Checked before the rest arrives, so a bad client is refused at once.
                if let Err(code) = self.check_first_bytes() {
                    self.fail(code, replies);
                    return data;
                }
                needed = self.header_size();
            }
        }
        if self.header_len < needed {
            return data;
        }
        let h = &self.header;
        let short = h[1] & 0x7F;
        let (length, mask_at) = match short {
            126 => (u64::from(u16::from_be_bytes([h[2], h[3]])), 4),
            127 => (
                u64::from_be_bytes(h[2..10].try_into().expect("8 bytes")),
                10,
            ),
            n => (u64::from(n), 2),
        };
        let frame = Frame {
            opcode: h[0] & 0x0F,
            fin: h[0] & 0x80 != 0,
            mask: h[mask_at..mask_at + 4].try_into().expect("4 bytes"),
            offset: 0,
            remaining: length,
        };
        self.header_len = 0;
        if length >> 63 != 0 {
            self.fail(CLOSE_PROTOCOL_ERROR, replies);
            return data;
        }
        if is_control(frame.opcode) {
            if length > MAX_CONTROL_PAYLOAD as u64 {
                self.fail(CLOSE_PROTOCOL_ERROR, replies);
                return data;
            }
        } else {
            let total = self.message_size.saturating_add(length);
            if length > self.max_message_size || total > self.max_message_size {
                self.fail(CLOSE_TOO_BIG, replies);
                return data;
            }
            self.message_size = total;
        }
        self.frame = Some(frame);
        data
    }

    /// The header's size, known once its first two bytes are in.
    fn header_size(&self) -> usize {
        let ext = match self.header[1] & 0x7F {
            126 => 2,
            127 => 8,
            _ => 0,
        };
        2 + ext + 4
    }

    /// Checks what the first two header bytes tell: every rule that does not need the
    /// length. Err is the close status code.
    fn check_first_bytes(&mut self) -> Result<(), u16> {
        let (b0, b1) = (self.header[0], self.header[1]);
        let opcode = b0 & 0x0F;
        let fin = b0 & 0x80 != 0;
        if b0 & 0x70 != 0 {
            // No extension was negotiated, so no reserved bit may be set.
            return Err(CLOSE_PROTOCOL_ERROR);
        }
        if b1 & 0x80 == 0 {
            // Every frame from a client must be masked (RFC 6455 5.1).
            return Err(CLOSE_PROTOCOL_ERROR);
        }
        match opcode {
            OP_CONTINUATION if !self.in_message => Err(CLOSE_PROTOCOL_ERROR),
            OP_CONTINUATION => Ok(()),
            OP_TEXT if self.in_message => Err(CLOSE_PROTOCOL_ERROR),
            OP_TEXT => Err(CLOSE_UNSUPPORTED_DATA),
            OP_BINARY if self.in_message => Err(CLOSE_PROTOCOL_ERROR),
            OP_BINARY => {
                self.message_size = 0;
                Ok(())
            }
            OP_CLOSE | OP_PING | OP_PONG if !fin => Err(CLOSE_PROTOCOL_ERROR),
            OP_CLOSE | OP_PING | OP_PONG => Ok(()),
            _ => Err(CLOSE_PROTOCOL_ERROR),
        }
    }

    /// Takes payload bytes of the current frame from `data`; returns the rest.
    fn read_payload<'a>(
        &mut self,
        data: &'a [u8],
        payload: &mut Vec<u8>,
        replies: &mut Vec<u8>,
    ) -> &'a [u8] {
        let mut frame = self.frame.expect("a frame is open");
        // Bounded by remaining, which for a control frame is at most 125.
        let take = usize::try_from(frame.remaining).map_or(data.len(), |r| r.min(data.len()));
        let (chunk, rest) = data.split_at(take);
        let out = if is_control(frame.opcode) {
            &mut self.control
        } else {
            &mut *payload
        };
        let start = out.len();
        out.extend_from_slice(chunk);
        unmask(&mut out[start..], frame.mask, frame.offset);
        frame.offset += take as u64;
        frame.remaining -= take as u64;
        self.frame = Some(frame);
        if frame.remaining == 0 {
            self.finish_frame(frame, replies);
        }
        rest
    }

    /// A frame's last payload byte has arrived.
    fn finish_frame(&mut self, frame: Frame, replies: &mut Vec<u8>) {
        self.frame = None;
        match frame.opcode {
            OP_BINARY | OP_CONTINUATION => {
                self.in_message = !frame.fin;
                if frame.fin {
                    self.message_size = 0;
                }
            }
            OP_PING => {
                let data = std::mem::take(&mut self.control);
                encode_frame(OP_PONG, &data, replies);
            }
            OP_PONG => self.control.clear(),
            OP_CLOSE => {
                let data = std::mem::take(&mut self.control);
                match close_status(&data) {
                    Ok(None) => {
                        // No status code: answer with none either.
                        encode_frame(OP_CLOSE, &[], replies);
                        self.closed = Some(CLOSE_NO_STATUS);
                    }
                    Ok(Some(code)) => {
                        encode_close(code, "", replies);
                        self.closed = Some(code);
                    }
                    Err(code) => self.fail(code, replies),
                }
            }
            _ => unreachable!("opcodes are checked with the header"),
        }
    }
}

fn is_control(opcode: u8) -> bool {
    opcode & 0x8 != 0
}

/// The status code of a close frame's payload (None: no code). Err: the code to close with
/// because the payload is invalid.
fn close_status(data: &[u8]) -> Result<Option<u16>, u16> {
    match data {
        [] => Ok(None),
        [_] => Err(CLOSE_PROTOCOL_ERROR),
        [hi, lo, reason @ ..] => {
            let code = u16::from_be_bytes([*hi, *lo]);
            if !valid_close_code(code) {
                return Err(CLOSE_PROTOCOL_ERROR);
            }
            if std::str::from_utf8(reason).is_err() {
                return Err(CLOSE_INVALID_PAYLOAD);
            }
            Ok(Some(code))
        }
    }
}

/// Codes a peer may send (RFC 6455 7.4): the defined ones that are not reserved for
/// reporting, and the registered (3000-3999) and private (4000-4999) ranges.
pub fn valid_close_code(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999)
}

/// XORs `buf` with `mask`, the first byte of `buf` being payload byte `offset`.
pub fn unmask(buf: &mut [u8], mask: [u8; 4], offset: u64) {
    let shift = (offset % 4) as usize;
    let rotated = [
        mask[shift],
        mask[(shift + 1) % 4],
        mask[(shift + 2) % 4],
        mask[(shift + 3) % 4],
    ];
    // Eight bytes at a time: the mask repeats every four, so a doubled mask covers a word.
    let wide = u64::from_ne_bytes([
        rotated[0], rotated[1], rotated[2], rotated[3], rotated[0], rotated[1], rotated[2],
        rotated[3],
    ]);
    let mut words = buf.chunks_exact_mut(8);
    for word in &mut words {
        let value = u64::from_ne_bytes((&*word).try_into().expect("8 bytes")) ^ wide;
        word.copy_from_slice(&value.to_ne_bytes());
    }
    for (i, byte) in words.into_remainder().iter_mut().enumerate() {
        *byte ^= rotated[i % 4];
    }
}

/// Appends one unmasked (server) frame with FIN set.
pub fn encode_frame(opcode: u8, payload: &[u8], out: &mut Vec<u8>) {
    out.reserve(header_len(payload.len()) + payload.len());
    write_header(opcode, payload.len(), out);
    out.extend_from_slice(payload);
}

/// The size of a server frame's header for `len` payload bytes.
pub fn header_len(len: usize) -> usize {
    match len {
        0..=125 => 2,
        126..=65535 => 4,
        _ => 10,
    }
}

/// Appends the header of an unmasked frame with FIN set.
pub fn write_header(opcode: u8, len: usize, out: &mut Vec<u8>) {
    out.push(0x80 | opcode);
    match len {
        0..=125 => out.push(len as u8),
        126..=65535 => {
            out.push(126);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        _ => {
            out.push(127);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }
}

/// Appends a close frame with `code` and `reason` (cut to fit a control frame).
pub fn encode_close(code: u16, reason: &str, out: &mut Vec<u8>) {
    let mut end = reason.len().min(MAX_CONTROL_PAYLOAD - 2);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut payload = Vec::with_capacity(2 + end);
    payload.extend_from_slice(&code.to_be_bytes());
    payload.extend_from_slice(&reason.as_bytes()[..end]);
    encode_frame(OP_CLOSE, &payload, out);
}

/// Appends a masked (client) frame: for tests and fuzzing.
pub fn encode_client_frame(
    opcode: u8,
    fin: bool,
    mask: [u8; 4],
    payload: &[u8],
    out: &mut Vec<u8>,
) {
    let len = payload.len();
    out.push(if fin { 0x80 } else { 0 } | opcode);
    match len {
        0..=125 => out.push(0x80 | len as u8),
        126..=65535 => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        _ => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(len as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&mask);
    let start = out.len();
    out.extend_from_slice(payload);
    unmask(&mut out[start..], mask, 0);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MAX: u64 = 1 << 20;

    fn client(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_client_frame(opcode, fin, [0x11, 0x22, 0x33, 0x44], payload, &mut out);
        out
    }

    fn decode_all(decoder: &mut Decoder, data: &[u8]) -> (Vec<u8>, Vec<u8>, Option<u16>) {
        let (mut payload, mut replies) = (Vec::new(), Vec::new());
        let closed = decoder.decode(data, &mut payload, &mut replies);
        (payload, replies, closed)
    }

    /// The status code of the single close frame in `replies`.
    fn close_code(replies: &[u8]) -> u16 {
        assert_eq!(replies[0], 0x88, "a close frame");
        assert_eq!(replies[1], 2);
        u16::from_be_bytes([replies[2], replies[3]])
    }

    #[test]
    fn binary_frames_of_every_length_class() {
        for len in [0usize, 1, 125, 126, 65535, 65536, 200_000] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let mut decoder = Decoder::new(MAX);
            let (payload, replies, closed) =
                decode_all(&mut decoder, &client(OP_BINARY, true, &data));
            assert_eq!(payload, data, "length {len}");
            assert!(replies.is_empty());
            assert_eq!(closed, None);
            assert_eq!(decoder.buffered(), 0);
        }
    }

    #[test]
    fn ping_gets_pong_with_its_payload() {
        let mut decoder = Decoder::new(MAX);
        let (payload, replies, closed) = decode_all(&mut decoder, &client(OP_PING, true, b"hi"));
        assert!(payload.is_empty());
        assert_eq!(replies, [0x8A, 2, b'h', b'i']);
        assert_eq!(closed, None);
    }

    #[test]
    fn pong_is_ignored() {
        let mut decoder = Decoder::new(MAX);
        let (payload, replies, closed) = decode_all(&mut decoder, &client(OP_PONG, true, b"x"));
        assert!(payload.is_empty() && replies.is_empty() && closed.is_none());
    }

    #[test]
    fn close_is_echoed_and_ends_decoding() {
        let mut decoder = Decoder::new(MAX);
        let mut data = client(OP_CLOSE, true, &[0x03, 0xE8, b'b', b'y', b'e']);
        data.extend(client(OP_BINARY, true, b"after"));
        let (payload, replies, closed) = decode_all(&mut decoder, &data);
        assert!(payload.is_empty(), "nothing after a close is decoded");
        assert_eq!(close_code(&replies), 1000);
        assert_eq!(closed, Some(1000));
        let (payload, replies, closed) = decode_all(&mut decoder, &client(OP_BINARY, true, b"x"));
        assert!(payload.is_empty() && replies.is_empty());
        assert_eq!(closed, Some(1000));
    }

    #[test]
    fn close_without_code_gets_an_empty_close() {
        let mut decoder = Decoder::new(MAX);
        let (_, replies, closed) = decode_all(&mut decoder, &client(OP_CLOSE, true, b""));
        assert_eq!(replies, [0x88, 0]);
        assert_eq!(closed, Some(CLOSE_NO_STATUS));
    }

    #[test]
    fn bad_close_payloads() {
        for (payload, code) in [
            (&[0x03][..], CLOSE_PROTOCOL_ERROR),
            (&[0x03, 0xED][..], CLOSE_PROTOCOL_ERROR), // 1005 may not be sent
            (&[0x00, 0x10][..], CLOSE_PROTOCOL_ERROR),
            (&[0x03, 0xE8, 0xFF][..], CLOSE_INVALID_PAYLOAD),
        ] {
            let mut decoder = Decoder::new(MAX);
            let (_, replies, closed) = decode_all(&mut decoder, &client(OP_CLOSE, true, payload));
            assert_eq!(close_code(&replies), code, "{payload:?}");
            assert_eq!(closed, Some(code));
        }
    }

    #[test]
    fn violations_close_with_their_codes() {
        let unmasked = {
            let mut out = Vec::new();
            encode_frame(OP_BINARY, b"abc", &mut out);
            out
        };
        let mut rsv = client(OP_BINARY, true, b"a");
        rsv[0] |= 0x40;
        let mut long_control = client(OP_PING, true, &[0; 126]);
        long_control.truncate(8);
        let cases: Vec<(&str, Vec<u8>, u16)> = vec![
            ("unmasked", unmasked, CLOSE_PROTOCOL_ERROR),
            ("text", client(OP_TEXT, true, b"a"), CLOSE_UNSUPPORTED_DATA),
            ("reserved bit", rsv, CLOSE_PROTOCOL_ERROR),
            ("opcode 3", client(0x3, true, b"a"), CLOSE_PROTOCOL_ERROR),
            ("opcode 0xB", client(0xB, true, b""), CLOSE_PROTOCOL_ERROR),
            (
                "lone continuation",
                client(OP_CONTINUATION, true, b"a"),
                CLOSE_PROTOCOL_ERROR,
            ),
            (
                "fragmented ping",
                client(OP_PING, false, b""),
                CLOSE_PROTOCOL_ERROR,
            ),
            ("ping over 125", long_control, CLOSE_PROTOCOL_ERROR),
            (
                "too big",
                client(OP_BINARY, true, &vec![0; MAX as usize + 1]),
                CLOSE_TOO_BIG,
            ),
        ];
        for (name, data, code) in cases {
            let mut decoder = Decoder::new(MAX);
            let (payload, replies, closed) = decode_all(&mut decoder, &data);
            assert!(payload.is_empty(), "{name}");
            assert_eq!(close_code(&replies), code, "{name}");
            assert_eq!(closed, Some(code), "{name}");
        }
    }

    #[test]
    fn length_with_top_bit_is_refused() {
        let mut data = vec![0x82, 0x80 | 127];
        data.extend_from_slice(&(1u64 << 63).to_be_bytes());
        data.extend_from_slice(&[0; 4]);
        let mut decoder = Decoder::new(u64::MAX);
        let (_, replies, closed) = decode_all(&mut decoder, &data);
        assert_eq!(close_code(&replies), CLOSE_PROTOCOL_ERROR);
        assert_eq!(closed, Some(CLOSE_PROTOCOL_ERROR));
    }

    #[test]
    fn fragmented_message_with_interleaved_ping() {
        let mut data = client(OP_BINARY, false, b"ab");
        data.extend(client(OP_PING, true, b"p"));
        data.extend(client(OP_CONTINUATION, false, b"cd"));
        data.extend(client(OP_CONTINUATION, true, b"ef"));
        data.extend(client(OP_BINARY, true, b"gh"));
        let mut decoder = Decoder::new(MAX);
        let (payload, replies, closed) = decode_all(&mut decoder, &data);
        assert_eq!(payload, b"abcdefgh");
        assert_eq!(replies, [0x8A, 1, b'p']);
        assert_eq!(closed, None);
    }

    #[test]
    fn new_message_inside_a_fragmented_one_is_refused() {
        let mut data = client(OP_BINARY, false, b"ab");
        data.extend(client(OP_BINARY, true, b"cd"));
        let mut decoder = Decoder::new(MAX);
        let (payload, replies, closed) = decode_all(&mut decoder, &data);
        assert_eq!(payload, b"ab");
        assert_eq!(close_code(&replies), CLOSE_PROTOCOL_ERROR);
        assert_eq!(closed, Some(CLOSE_PROTOCOL_ERROR));
    }

    #[test]
    fn fragmented_message_total_is_bounded() {
        let mut data = client(OP_BINARY, false, &[1; 600]);
        data.extend(client(OP_CONTINUATION, true, &[2; 600]));
        let mut decoder = Decoder::new(1000);
        let (payload, replies, closed) = decode_all(&mut decoder, &data);
        assert_eq!(payload.len(), 600);
        assert_eq!(close_code(&replies), CLOSE_TOO_BIG);
        assert_eq!(closed, Some(CLOSE_TOO_BIG));
        // Separate messages of the same sizes are fine: the bound is per message.
        let mut data = client(OP_BINARY, true, &[1; 600]);
        data.extend(client(OP_BINARY, true, &[2; 600]));
        let mut decoder = Decoder::new(1000);
        let (payload, _, closed) = decode_all(&mut decoder, &data);
        assert_eq!(payload.len(), 1200);
        assert_eq!(closed, None);
    }

    #[test]
    fn server_frames_have_minimal_headers() {
        for (len, head) in [
            (0usize, 2usize),
            (125, 2),
            (126, 4),
            (65535, 4),
            (65536, 10),
        ] {
            let mut out = Vec::new();
            encode_frame(OP_BINARY, &vec![9; len], &mut out);
            assert_eq!(out.len(), head + len);
            assert_eq!(header_len(len), head);
            assert_eq!(out[0], 0x82);
        }
    }

    #[test]
    fn close_reason_is_cut_on_a_char_boundary() {
        let mut out = Vec::new();
        encode_close(1000, &"é".repeat(100), &mut out);
        assert_eq!(out[1] as usize, out.len() - 2);
        assert!(out.len() - 2 <= MAX_CONTROL_PAYLOAD);
        assert!(std::str::from_utf8(&out[4..]).is_ok());
    }

    #[test]
    fn unmask_matches_bytewise_xor_at_every_offset() {
        let mask = [1, 2, 4, 8];
        for offset in 0..8u64 {
            for len in 0..40 {
                let data: Vec<u8> = (0..len as u8).collect();
                let mut fast = data.clone();
                unmask(&mut fast, mask, offset);
                let slow: Vec<u8> = data
                    .iter()
                    .enumerate()
                    .map(|(i, b)| b ^ mask[((offset as usize) + i) % 4])
                    .collect();
                assert_eq!(fast, slow);
            }
        }
    }

    /// (opcode, fin, payload) sequences that form a valid client stream of binary messages
    /// with pings in between.
    fn stream() -> impl Strategy<Value = Vec<(u8, bool, Vec<u8>)>> {
        prop::collection::vec(
            (
                prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 1..4),
                prop::option::of(prop::collection::vec(any::<u8>(), 0..126)),
            ),
            0..8,
        )
        .prop_map(|messages| {
            let mut frames = Vec::new();
            for (fragments, ping) in messages {
                let last = fragments.len() - 1;
                for (i, fragment) in fragments.into_iter().enumerate() {
                    let opcode = if i == 0 { OP_BINARY } else { OP_CONTINUATION };
                    frames.push((opcode, i == last, fragment));
                    if i == 0 {
                        if let Some(p) = &ping {
                            frames.push((OP_PING, true, p.clone()));
                        }
                    }
                }
            }
            frames
        })
    }

    proptest! {
        #[test]
        fn any_split_decodes_the_same(
            frames in stream(),
            mask in any::<[u8; 4]>(),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..10),
        ) {
            let mut wire = Vec::new();
            let mut expected_payload = Vec::new();
            let mut expected_replies = Vec::new();
            for (opcode, fin, payload) in &frames {
                encode_client_frame(*opcode, *fin, mask, payload, &mut wire);
                if *opcode == OP_PING {
                    encode_frame(OP_PONG, payload, &mut expected_replies);
                } else {
                    expected_payload.extend_from_slice(payload);
                }
            }
            let mut points: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
            points.sort_unstable();
            let mut decoder = Decoder::new(MAX);
            let (mut payload, mut replies) = (Vec::new(), Vec::new());
            let mut start = 0;
            for point in points.into_iter().chain([wire.len()]) {
                prop_assert_eq!(decoder.decode(&wire[start..point], &mut payload, &mut replies), None);
                start = point;
            }
            prop_assert_eq!(payload, expected_payload);
            prop_assert_eq!(replies, expected_replies);
            prop_assert_eq!(decoder.buffered(), 0);
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_stay_bounded(data in prop::collection::vec(any::<u8>(), 0..2000)) {
            let mut decoder = Decoder::new(512);
            let (mut payload, mut replies) = (Vec::new(), Vec::new());
            let closed = decoder.decode(&data, &mut payload, &mut replies);
            prop_assert!(payload.len() <= data.len());
            prop_assert!(decoder.buffered() <= MAX_HEADER + MAX_CONTROL_PAYLOAD);
            if let Some(code) = closed {
                prop_assert!(code == CLOSE_NO_STATUS || valid_close_code(code));
            }
        }
    }
}
