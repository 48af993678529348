//! Values of the inter-node wire format: a compact, self-describing encoding (msgpack-like,
//! but ours). Each value is a one-byte tag and then:
//!
//! | tag | value          | body                                                   |
//! |-----|----------------|--------------------------------------------------------|
//! | 0   | None           | nothing                                                |
//! | 1   | false          | nothing                                                |
//! | 2   | true           | nothing                                                |
//! | 3   | int (i64)      | zigzag LEB128 varint                                   |
//! | 4   | float (f64)    | 8 bytes, IEEE 754 big-endian (bits kept: NaN, -0.0)    |
//! | 5   | str            | varint byte length, UTF-8 bytes                        |
//! | 6   | bytes          | varint length, the bytes                               |
//! | 7   | list           | varint count, the items                                |
//! | 8   | dict           | varint count, key and value of each pair (keys: any)   |
//!
//! Varints are unsigned LEB128, at most 10 bytes, and must be minimal: every value has
//! exactly one encoding, so decode -> encode gives back the input bytes. Containers nest at
//! most [`MAX_DEPTH`] deep, on both sides, so hostile input cannot exhaust the stack. Every
//! malformed input is a [`WireError`], never a panic; announced counts never size an
//! allocation beyond the bytes actually present.

use std::fmt;

/// Containers (lists, dicts) nest at most this deep; a 65th level is [`WireError::TooDeep`].
pub const MAX_DEPTH: usize = 64;

/// The tag byte that starts each encoded value.
pub mod tag {
    pub const NONE: u8 = 0;
    pub const FALSE: u8 = 1;
    pub const TRUE: u8 = 2;
    pub const INT: u8 = 3;
    pub const FLOAT: u8 = 4;
    pub const STR: u8 = 5;
    pub const BYTES: u8 = 6;
    pub const LIST: u8 = 7;
    pub const DICT: u8 = 8;
}

/// Why bytes are not a valid value or frame (or a value cannot be encoded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    UnknownTag(u8),
    /// The input ends inside a value, or a length or count exceeds the bytes left.
    Truncated,
    BadUtf8,
    /// A varint with more than 64 bits.
    VarintOverflow,
    /// A varint longer than needed (its last byte is zero).
    OverlongVarint,
    /// Bytes left after the value (inside a frame, or in the whole input).
    TrailingBytes,
    /// Containers nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A frame whose length is 0: it has no kind byte.
    EmptyFrame,
    /// A frame longer than the maximum (the decoder's, or u32::MAX when encoding).
    FrameTooLarge {
        len: u64,
        max: u64,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::UnknownTag(t) => write!(f, "unknown value tag 0x{t:02x}"),
            WireError::Truncated => f.write_str("truncated value"),
            WireError::BadUtf8 => f.write_str("string is not valid UTF-8"),
            WireError::VarintOverflow => f.write_str("varint overflows 64 bits"),
            WireError::OverlongVarint => f.write_str("overlong varint"),
            WireError::TrailingBytes => f.write_str("trailing bytes after the value"),
            WireError::TooDeep => write!(f, "containers nested deeper than {MAX_DEPTH}"),
            WireError::EmptyFrame => f.write_str("empty frame (no kind byte)"),
            WireError::FrameTooLarge { len, max } => {
                write!(f, "frame of {len} bytes is over the maximum of {max}")
            }
        }
    }
}

impl std::error::Error for WireError {}

/// A decoded value. Dicts keep their pairs in wire order, duplicates included, so that
/// decode -> encode is the identity.
#[derive(Debug, Clone)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
}

/// Equality of encodings: floats compare by bits (NaN equals the same NaN, 0.0 differs from
/// -0.0), which makes `Value` `Eq` and matches what goes over the wire.
impl PartialEq for Value {
    fn eq(&self, other: &Value) -> bool {
        match (self, other) {
            (Value::None, Value::None) => true,
            (Value::Bool(a), Value::Bool(b)) => a == b,
            (Value::Int(a), Value::Int(b)) => a == b,
            (Value::Float(a), Value::Float(b)) => a.to_bits() == b.to_bits(),
            (Value::Str(a), Value::Str(b)) => a == b,
            (Value::Bytes(a), Value::Bytes(b)) => a == b,
            (Value::List(a), Value::List(b)) => a == b,
            (Value::Dict(a), Value::Dict(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Value {}

impl Value {
    /// Appends the encoding of `self`; [`WireError::TooDeep`] if it nests too deep (what the
    /// decoder would reject is never written).
    pub fn encode(&self, w: &mut Writer) -> Result<(), WireError> {
        self.encode_at(w, 0)
    }

    fn encode_at(&self, w: &mut Writer, depth: usize) -> Result<(), WireError> {
        match self {
            Value::None => w.none(),
            Value::Bool(b) => w.bool(*b),
            Value::Int(i) => w.int(*i),
            Value::Float(x) => w.float(*x),
            Value::Str(s) => w.str(s),
            Value::Bytes(b) => w.bytes(b),
            Value::List(items) => {
                w.list(items.len(), depth)?;
                for item in items {
                    item.encode_at(w, depth + 1)?;
                }
            }
            Value::Dict(pairs) => {
                w.dict(pairs.len(), depth)?;
                for (k, v) in pairs {
                    k.encode_at(w, depth + 1)?;
                    v.encode_at(w, depth + 1)?;
                }
            }
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>, WireError> {
        let mut w = Writer::default();
        self.encode(&mut w)?;
        Ok(w.buf)
    }

    /// Decodes exactly one value filling all of `data`.
    pub fn decode(data: &[u8]) -> Result<Value, WireError> {
        decode_with(data, &mut ValueBuilder)
    }
}

/// Writes values piece by piece: the containers' headers, then their items. Used by
/// [`Value::encode`] and by encoders of other representations (the Python bindings).
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn none(&mut self) {
        self.buf.push(tag::NONE);
    }

    pub fn bool(&mut self, v: bool) {
        self.buf.push(if v { tag::TRUE } else { tag::FALSE });
    }

    pub fn int(&mut self, v: i64) {
        self.buf.push(tag::INT);
        // Zigzag: small magnitudes of either sign take few bytes.
        self.varint(((v << 1) ^ (v >> 63)) as u64);
    }

    pub fn float(&mut self, v: f64) {
        self.buf.push(tag::FLOAT);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    pub fn str(&mut self, v: &str) {
        self.buf.push(tag::STR);
        self.varint(v.len() as u64);
        self.buf.extend_from_slice(v.as_bytes());
    }

    pub fn bytes(&mut self, v: &[u8]) {
        self.buf.push(tag::BYTES);
        self.varint(v.len() as u64);
        self.buf.extend_from_slice(v);
    }

    /// The header of a list of `count` items, at nesting `depth` (0 for the outermost
    /// value); the caller then writes the items at `depth + 1`.
    pub fn list(&mut self, count: usize, depth: usize) -> Result<(), WireError> {
        self.container(tag::LIST, count, depth)
    }

    /// The header of a dict of `count` pairs; the caller then writes key, value, key, ...
    pub fn dict(&mut self, count: usize, depth: usize) -> Result<(), WireError> {
        self.container(tag::DICT, count, depth)
    }

    fn container(&mut self, t: u8, count: usize, depth: usize) -> Result<(), WireError> {
        if depth >= MAX_DEPTH {
            return Err(WireError::TooDeep);
        }
        self.buf.push(t);
        self.varint(count as u64);
        Ok(())
    }

    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push(v as u8 | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }
}

/// Receives decoded values bottom-up, so one decoder serves every representation:
/// [`Value`] here, Python objects in the bindings (no intermediate tree).
pub trait Build {
    type Out;
    type Error: From<WireError>;
    fn none(&mut self) -> Result<Self::Out, Self::Error>;
    fn bool(&mut self, v: bool) -> Result<Self::Out, Self::Error>;
    fn int(&mut self, v: i64) -> Result<Self::Out, Self::Error>;
    fn float(&mut self, v: f64) -> Result<Self::Out, Self::Error>;
    fn str(&mut self, v: &str) -> Result<Self::Out, Self::Error>;
    fn bytes(&mut self, v: &[u8]) -> Result<Self::Out, Self::Error>;
    fn list(&mut self, items: Vec<Self::Out>) -> Result<Self::Out, Self::Error>;
    fn dict(&mut self, pairs: Vec<(Self::Out, Self::Out)>) -> Result<Self::Out, Self::Error>;
}

/// Builds [`Value`]s.
pub struct ValueBuilder;

impl Build for ValueBuilder {
    type Out = Value;
    type Error = WireError;

    fn none(&mut self) -> Result<Value, WireError> {
        Ok(Value::None)
    }

    fn bool(&mut self, v: bool) -> Result<Value, WireError> {
        Ok(Value::Bool(v))
    }

    fn int(&mut self, v: i64) -> Result<Value, WireError> {
        Ok(Value::Int(v))
    }

    fn float(&mut self, v: f64) -> Result<Value, WireError> {
        Ok(Value::Float(v))
    }

    fn str(&mut self, v: &str) -> Result<Value, WireError> {
        Ok(Value::Str(v.to_owned()))
    }

    fn bytes(&mut self, v: &[u8]) -> Result<Value, WireError> {
        Ok(Value::Bytes(v.to_vec()))
    }

    fn list(&mut self, items: Vec<Value>) -> Result<Value, WireError> {
        Ok(Value::List(items))
    }

    fn dict(&mut self, pairs: Vec<(Value, Value)>) -> Result<Value, WireError> {
        Ok(Value::Dict(pairs))
    }
}

/// Decodes exactly one value filling all of `data`, handing its parts to `b`.
pub fn decode_with<B: Build>(data: &[u8], b: &mut B) -> Result<B::Out, B::Error> {
    let mut r = Reader { data };
    let out = read_value(&mut r, b, 0)?;
    if !r.data.is_empty() {
        return Err(WireError::TrailingBytes.into());
    }
    Ok(out)
}

fn read_value<B: Build>(r: &mut Reader<'_>, b: &mut B, depth: usize) -> Result<B::Out, B::Error> {
    match r.u8()? {
        tag::NONE => b.none(),
        tag::FALSE => b.bool(false),
        tag::TRUE => b.bool(true),
        tag::INT => {
            let z = r.varint()?;
            b.int((z >> 1) as i64 ^ -((z & 1) as i64))
        }
        tag::FLOAT => {
            let raw: [u8; 8] = r.take(8)?.try_into().expect("took 8 bytes");
            b.float(f64::from_be_bytes(raw))
        }
        tag::STR => {
            let n = r.len_prefix(1)?;
            let s = std::str::from_utf8(r.take(n)?).map_err(|_| WireError::BadUtf8)?;
            b.str(s)
        }
        tag::BYTES => {
            let n = r.len_prefix(1)?;
            b.bytes(r.take(n)?)
        }
        tag::LIST => {
            if depth >= MAX_DEPTH {
                return Err(WireError::TooDeep.into());
            }
            // Every item takes at least its tag byte.
            let n = r.len_prefix(1)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_value(r, b, depth + 1)?);
            }
            b.list(items)
        }
        tag::DICT => {
            if depth >= MAX_DEPTH {
                return Err(WireError::TooDeep.into());
            }
            let n = r.len_prefix(2)?;
            let mut pairs = Vec::with_capacity(n);
            for _ in 0..n {
                let k = read_value(r, b, depth + 1)?;
                let v = read_value(r, b, depth + 1)?;
                pairs.push((k, v));
            }
            b.dict(pairs)
        }
        t => Err(WireError::UnknownTag(t).into()),
    }
}

struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.data.len() < n {
            return Err(WireError::Truncated);
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut v = 0u64;
        for i in 0..10 {
            let byte = self.u8()?;
            // The 10th byte holds bit 63 only.
            if i == 9 && byte > 1 {
                return Err(WireError::VarintOverflow);
            }
            v |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                if byte == 0 && i > 0 {
                    return Err(WireError::OverlongVarint);
                }
                return Ok(v);
            }
        }
        Err(WireError::VarintOverflow)
    }

    /// A length or count whose items take at least `unit` bytes each: more than the bytes
    /// left is truncation, found before anything is allocated for it.
    fn len_prefix(&mut self, unit: usize) -> Result<usize, WireError> {
        let n = self.varint()?;
        match usize::try_from(n) {
            Ok(n) if n <= self.data.len() / unit => Ok(n),
            _ => Err(WireError::Truncated),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn enc(v: &Value) -> Vec<u8> {
        v.to_bytes().expect("encodable")
    }

    fn nested_lists(depth: usize) -> Value {
        let mut v = Value::None;
        for _ in 0..depth {
            v = Value::List(vec![v]);
        }
        v
    }

    #[test]
    fn scalars_have_their_pinned_encoding() {
        assert_eq!(enc(&Value::None), [0]);
        assert_eq!(enc(&Value::Bool(false)), [1]);
        assert_eq!(enc(&Value::Bool(true)), [2]);
        assert_eq!(enc(&Value::Int(0)), [3, 0]);
        assert_eq!(enc(&Value::Int(-1)), [3, 1]);
        assert_eq!(enc(&Value::Int(1)), [3, 2]);
        assert_eq!(enc(&Value::Int(-64)), [3, 0x7f]);
        assert_eq!(enc(&Value::Int(64)), [3, 0x80, 0x01]);
        assert_eq!(
            enc(&Value::Int(i64::MAX)),
            [3, 0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
        assert_eq!(
            enc(&Value::Int(i64::MIN)),
            [3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
        assert_eq!(enc(&Value::Float(1.5)), [4, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
        assert_eq!(enc(&Value::Str("hé".into())), [5, 3, b'h', 0xc3, 0xa9]);
        assert_eq!(enc(&Value::Bytes(vec![0, 255])), [6, 2, 0, 255]);
        assert_eq!(
            enc(&Value::List(vec![Value::Int(1), Value::None])),
            [7, 2, 3, 2, 0]
        );
        assert_eq!(
            enc(&Value::Dict(vec![(
                Value::Str("a".into()),
                Value::Bool(true)
            )])),
            [8, 1, 5, 1, b'a', 2]
        );
    }

    #[test]
    fn boundaries_round_trip() {
        let long = "x".repeat(300);
        let values = [
            Value::None,
            Value::Bool(false),
            Value::Bool(true),
            Value::Int(0),
            Value::Int(i64::MIN),
            Value::Int(i64::MAX),
            Value::Int(i64::MIN + 1),
            Value::Int(i64::MAX - 1),
            Value::Float(0.0),
            Value::Float(-0.0),
            Value::Float(f64::NAN),
            Value::Float(f64::from_bits(0x7ff0_0000_0000_0001)), // a signalling NaN
            Value::Float(f64::INFINITY),
            Value::Float(f64::NEG_INFINITY),
            Value::Float(f64::MIN_POSITIVE / 2.0), // subnormal
            Value::Str(String::new()),
            Value::Str(long.clone()), // a 2-byte length
            Value::Str("\u{0}\u{10ffff}".into()),
            Value::Bytes(Vec::new()),
            Value::Bytes(long.into_bytes()),
            Value::List(Vec::new()),
            Value::Dict(Vec::new()),
            // Non-string keys, a duplicate key and a container as a key.
            Value::Dict(vec![
                (Value::Int(1), Value::None),
                (Value::Int(1), Value::Bool(true)),
                (
                    Value::List(vec![Value::Float(2.0)]),
                    Value::Dict(Vec::new()),
                ),
                (Value::None, Value::Bytes(vec![1])),
            ]),
            nested_lists(MAX_DEPTH),
        ];
        for v in values {
            let bytes = enc(&v);
            assert_eq!(Value::decode(&bytes), Ok(v.clone()), "{bytes:?}");
        }
    }

    #[test]
    fn float_equality_is_bitwise() {
        assert_eq!(Value::Float(f64::NAN), Value::Float(f64::NAN));
        assert_ne!(Value::Float(0.0), Value::Float(-0.0));
        assert_ne!(Value::Int(1), Value::Bool(true));
        assert_ne!(Value::Int(0), Value::Float(0.0));
    }

    #[test]
    fn nesting_is_bounded_on_both_sides() {
        assert_eq!(
            nested_lists(MAX_DEPTH + 1).to_bytes(),
            Err(WireError::TooDeep)
        );
        let too_deep_dict = Value::Dict(vec![(nested_lists(MAX_DEPTH), Value::None)]);
        assert_eq!(too_deep_dict.to_bytes(), Err(WireError::TooDeep));
        // Hand-made: 65 list headers, which no encoder writes.
        let mut bytes = [tag::LIST, 1].repeat(MAX_DEPTH + 1);
        bytes.push(tag::NONE);
        assert_eq!(Value::decode(&bytes), Err(WireError::TooDeep));
        // As deep as a hostile input can go is cut off early, with no stack overflow.
        let huge = [tag::LIST, 1].repeat(1_000_000);
        assert_eq!(Value::decode(&huge), Err(WireError::TooDeep));
        // Dict values nest too.
        let mut bytes = [tag::DICT, 1, tag::NONE].repeat(MAX_DEPTH + 1);
        bytes.push(tag::NONE);
        assert_eq!(Value::decode(&bytes), Err(WireError::TooDeep));
        bytes.drain(..3);
        assert!(Value::decode(&bytes).is_ok());
    }

    #[test]
    fn every_error_path() {
        let cases: &[(&[u8], WireError)] = &[
            (&[], WireError::Truncated),
            (&[9], WireError::UnknownTag(9)),
            (&[0xff], WireError::UnknownTag(0xff)),
            (&[tag::INT], WireError::Truncated),
            (&[tag::INT, 0x80], WireError::Truncated),
            (&[tag::FLOAT, 0, 0, 0, 0, 0, 0, 0], WireError::Truncated),
            (&[tag::STR, 2, b'a'], WireError::Truncated),
            (&[tag::STR, 2, 0xc3, 0x28], WireError::BadUtf8),
            (&[tag::STR, 3, 0xed, 0xa0, 0x80], WireError::BadUtf8), // a surrogate
            (&[tag::BYTES, 1], WireError::Truncated),
            (&[tag::LIST, 1], WireError::Truncated),
            (&[tag::LIST, 2, tag::NONE], WireError::Truncated),
            (&[tag::DICT, 1, tag::NONE], WireError::Truncated),
            (&[tag::DICT, 1, tag::NONE, 9], WireError::UnknownTag(9)),
            (&[tag::LIST, 1, 9], WireError::UnknownTag(9)),
            (&[tag::NONE, tag::NONE], WireError::TrailingBytes),
            (&[tag::LIST, 0, 0], WireError::TrailingBytes),
            // Overlong: 0 and 1 with a needless continuation byte.
            (&[tag::INT, 0x80, 0x00], WireError::OverlongVarint),
            (&[tag::STR, 0x81, 0x00, b'a'], WireError::OverlongVarint),
            // 10 bytes with more than bit 63 in the last; 11 bytes.
            (
                &[
                    tag::INT,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0x02,
                ],
                WireError::VarintOverflow,
            ),
            (
                &[
                    tag::INT,
                    0x80,
                    0x80,
                    0x80,
                    0x80,
                    0x80,
                    0x80,
                    0x80,
                    0x80,
                    0x80,
                    0x80,
                    0x01,
                ],
                WireError::VarintOverflow,
            ),
            // A huge announced count fails before allocating for it.
            (
                &[
                    tag::LIST,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0x7f,
                ],
                WireError::Truncated,
            ),
            (
                &[
                    tag::BYTES,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0xff,
                    0x01,
                ],
                WireError::Truncated,
            ),
        ];
        for (bytes, err) in cases {
            assert_eq!(Value::decode(bytes).as_ref(), Err(err), "{bytes:?}");
        }
        // Every strict prefix of a valid encoding is truncated.
        let v = Value::Dict(vec![(
            Value::Str("k".into()),
            Value::List(vec![
                Value::Int(300),
                Value::Float(1.0),
                Value::Bytes(vec![7]),
            ]),
        )]);
        let bytes = enc(&v);
        for len in 0..bytes.len() {
            assert_eq!(Value::decode(&bytes[..len]), Err(WireError::Truncated));
        }
    }

    #[test]
    fn errors_display() {
        assert_eq!(
            WireError::UnknownTag(0xab).to_string(),
            "unknown value tag 0xab"
        );
        assert_eq!(
            WireError::FrameTooLarge { len: 10, max: 5 }.to_string(),
            "frame of 10 bytes is over the maximum of 5"
        );
        assert!(WireError::TooDeep.to_string().contains("64"));
    }

    /// Arbitrary values, nested a few levels; floats from any bits (every NaN).
    pub(crate) fn value_strategy() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::None),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::Int),
            any::<u64>().prop_map(|b| Value::Float(f64::from_bits(b))),
            ".{0,12}".prop_map(Value::Str),
            proptest::collection::vec(any::<u8>(), 0..12).prop_map(Value::Bytes),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::List),
                proptest::collection::vec((inner.clone(), inner), 0..6).prop_map(Value::Dict),
            ]
        })
    }

    proptest! {
        #[test]
        fn round_trip(v in value_strategy()) {
            let bytes = enc(&v);
            let back = Value::decode(&bytes).expect("an encoded value decodes");
            prop_assert_eq!(&back, &v);
            prop_assert_eq!(enc(&back), bytes);
        }

        #[test]
        fn int_round_trip(i in any::<i64>()) {
            prop_assert_eq!(Value::decode(&enc(&Value::Int(i))), Ok(Value::Int(i)));
        }

        /// Anything that decodes was canonical: it encodes back to the same bytes. Bytes
        /// mostly below 12 are mostly valid tags and short lengths.
        #[test]
        fn arbitrary_bytes_never_panic(
            data in proptest::collection::vec(prop_oneof![0u8..12, any::<u8>()], 0..64)
        ) {
            if let Ok(v) = Value::decode(&data) {
                prop_assert_eq!(enc(&v), data);
            }
        }
    }
}
