//! Arbitrary bytes into the cluster frame decoder: it must never panic, it must give the same
//! frames (and the same error) whether the bytes arrive at once or in pieces, and whatever
//! decodes must be canonical: encoding it again gives back the very bytes it came from.

#![no_main]

use fastbroker_core::cluster::{encode_frame, FrameDecoder, Value, WireError, DEFAULT_MAX_FRAME};
use libfuzzer_sys::fuzz_target;

/// Every frame before the first error, and that error, from `data` fed in pieces of `chunk`.
fn decode_stream(data: &[u8], max: usize, chunk: usize) -> (Vec<(u8, Value)>, Option<WireError>) {
    let mut decoder = FrameDecoder::new(max);
    let mut frames = Vec::new();
    for piece in data.chunks(chunk) {
        decoder.extend(piece);
        loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(e) => return (frames, Some(e)),
            }
        }
    }
    (frames, None)
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, data)) = data.split_first() else {
        return;
    };
    // The first byte sets the maximum frame length (small half the time, to exercise the
    // size check) and the size of the pieces fed (1 to 127 bytes).
    let max = if ctl & 1 == 0 {
        DEFAULT_MAX_FRAME
    } else {
        usize::from(ctl)
    };
    let chunk = usize::from(ctl >> 1).max(1);

    if let Ok(value) = Value::decode(data) {
        assert_eq!(value.to_bytes().expect("a decoded value encodes"), data);
    }

    let (frames, err) = decode_stream(data, max, data.len().max(1));
    let mut at = 0;
    for (kind, value) in &frames {
        let bytes = encode_frame(*kind, value).expect("a decoded frame encodes");
        assert_eq!(&data[at..at + bytes.len()], &bytes[..]);
        at += bytes.len();
    }
    assert_eq!(decode_stream(data, max, chunk), (frames, err));
});
