//! Arbitrary bytes from a "client" into the WebSocket frame decoder, split at a point the
//! input chooses: it must never panic, must decode the same whatever the split, must hold
//! no more than a frame header and a control frame between calls, and every close it
//! answers with must carry a code that may be sent.

#![no_main]

use fastbroker_core::ws::{valid_close_code, Decoder, CLOSE_NO_STATUS};
use libfuzzer_sys::fuzz_target;

/// A frame header (14 bytes) and a control frame's payload (125 bytes).
const MAX_HELD: usize = 14 + 125;

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, data)) = data.split_first() else {
        return;
    };
    // Half of the inputs get a small bound, so the size checks are reached.
    let max = if ctl & 1 == 0 {
        1 << 24
    } else {
        u64::from(ctl)
    };
    let cut = usize::from(ctl >> 1) % (data.len() + 1);

    let mut whole = Decoder::new(max);
    let (mut payload, mut replies) = (Vec::new(), Vec::new());
    let closed = whole.decode(data, &mut payload, &mut replies);

    let mut split = Decoder::new(max);
    let (mut split_payload, mut split_replies) = (Vec::new(), Vec::new());
    split.decode(&data[..cut], &mut split_payload, &mut split_replies);
    assert!(split.buffered() <= MAX_HELD);
    let split_closed = split.decode(&data[cut..], &mut split_payload, &mut split_replies);

    assert_eq!(closed, split_closed);
    assert_eq!(payload, split_payload);
    assert_eq!(replies, split_replies);
    assert!(payload.len() <= data.len());
    assert!(whole.buffered() <= MAX_HELD);
    if let Some(code) = closed {
        assert!(code == CLOSE_NO_STATUS || valid_close_code(code));
    }
});
