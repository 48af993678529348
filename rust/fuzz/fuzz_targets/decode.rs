//! Arbitrary bytes into the decoder, for both protocol versions: it must never panic, and
//! whatever decodes must survive encode -> decode unchanged.

#![no_main]

use bytes::BytesMut;
use fastbroker_core::codec::{decode, encode, Protocol};
use libfuzzer_sys::fuzz_target;

/// Large enough for anything a fuzz input holds; the size check itself is exercised by
/// the first byte of the input choosing a small maximum half of the time.
const MAX: usize = 268_435_460;

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, data)) = data.split_first() else {
        return;
    };
    let max = if ctl & 1 == 0 { MAX } else { usize::from(ctl) };
    for protocol in [Protocol::V311, Protocol::V5] {
        let mut buf = BytesMut::from(data);
        while let Ok(Some(packet)) = decode(&mut buf, protocol, max) {
            let mut out = Vec::new();
            encode(&packet, protocol, &mut out).expect("a decoded packet encodes");
            let mut again = BytesMut::from(&out[..]);
            let decoded = decode(&mut again, protocol, MAX)
                .expect("an encoded packet decodes")
                .expect("an encoded packet is complete");
            assert_eq!(decoded, packet);
            assert!(again.is_empty(), "encode wrote trailing bytes");
        }
    }
});
