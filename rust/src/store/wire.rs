//! Little-endian building blocks of record bodies: fixed-width integers and length-prefixed
//! byte strings, read back with bounds checks (a bad body is an error, never a panic).

#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Some(v) as 1 + v, None as 0.
    pub fn opt_u64(&mut self, v: Option<u64>) -> &mut Self {
        match v {
            Some(v) => self.u8(1).u64(v),
            None => self.u8(0),
        }
    }

    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(u32::try_from(v.len()).expect("record field under 4 GiB"));
        self.buf.extend_from_slice(v);
        self
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyError(pub &'static str);

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed record body: {}", self.0)
    }
}

pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], BodyError> {
        if self.data.len() < n {
            return Err(BodyError("truncated"));
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }

    pub fn u8(&mut self) -> Result<u8, BodyError> {
        Ok(self.take(1)?[0])
    }

    pub fn u16(&mut self) -> Result<u16, BodyError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }

    pub fn u32(&mut self) -> Result<u32, BodyError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }

    pub fn u64(&mut self) -> Result<u64, BodyError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }

    pub fn opt_u64(&mut self) -> Result<Option<u64>, BodyError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.u64()?)),
            _ => Err(BodyError("bad option tag")),
        }
    }

    pub fn bytes(&mut self) -> Result<&'a [u8], BodyError> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    pub fn string(&mut self) -> Result<String, BodyError> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| BodyError("invalid UTF-8"))
    }

    /// Nothing left: an optional field appended by a later layout is absent.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The body must be used up exactly: trailing bytes mean a layout mismatch.
    pub fn finish(self) -> Result<(), BodyError> {
        if self.data.is_empty() {
            Ok(())
        } else {
            Err(BodyError("trailing bytes"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut w = Writer::default();
        w.u8(1)
            .u16(2)
            .u32(3)
            .u64(4)
            .opt_u64(Some(5))
            .opt_u64(None)
            .bytes(b"abc");
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u8(), Ok(1));
        assert_eq!(r.u16(), Ok(2));
        assert_eq!(r.u32(), Ok(3));
        assert_eq!(r.u64(), Ok(4));
        assert_eq!(r.opt_u64(), Ok(Some(5)));
        assert_eq!(r.opt_u64(), Ok(None));
        assert_eq!(r.bytes(), Ok(&b"abc"[..]));
        assert!(r.finish().is_ok());
        for len in 0..w.buf.len() {
            let mut r = Reader::new(&w.buf[..len]);
            let ok = (|| -> Result<(), BodyError> {
                r.u8()?;
                r.u16()?;
                r.u32()?;
                r.u64()?;
                r.opt_u64()?;
                r.opt_u64()?;
                r.bytes()?;
                Ok(())
            })();
            assert!(ok.is_err(), "truncated to {len} read fine");
        }
    }
}
