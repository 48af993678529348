//! Just enough JSON output for one flat-ish result object (no dependency for it).

use std::fmt::{self, Write};

pub enum Val {
    Str(String),
    Int(i64),
    Num(f64),
    Bool(bool),
    Obj(Obj),
}

impl From<&str> for Val {
    fn from(v: &str) -> Self {
        Val::Str(v.to_string())
    }
}
impl From<String> for Val {
    fn from(v: String) -> Self {
        Val::Str(v)
    }
}
impl From<bool> for Val {
    fn from(v: bool) -> Self {
        Val::Bool(v)
    }
}
impl From<f64> for Val {
    fn from(v: f64) -> Self {
        Val::Num(v)
    }
}
impl From<Obj> for Val {
    fn from(v: Obj) -> Self {
        Val::Obj(v)
    }
}
macro_rules! int_val {
    ($($t:ty),*) => {$(
        impl From<$t> for Val {
            fn from(v: $t) -> Self {
                Val::Int(i64::try_from(v).unwrap_or(i64::MAX))
            }
        }
    )*};
}
int_val!(u8, u16, u32, u64, usize, i32, i64);

/// An object whose keys keep their insertion order.
#[derive(Default)]
pub struct Obj(Vec<(String, Val)>);

impl Obj {
    pub fn new() -> Self {
        Obj(Vec::new())
    }

    pub fn set(&mut self, key: &str, v: impl Into<Val>) -> &mut Self {
        let v = v.into();
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = v,
            None => self.0.push((key.to_string(), v)),
        }
        self
    }
}

fn write_str(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    f.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => f.write_str("\\\"")?,
            '\\' => f.write_str("\\\\")?,
            '\n' => f.write_str("\\n")?,
            '\r' => f.write_str("\\r")?,
            '\t' => f.write_str("\\t")?,
            c if (c as u32) < 0x20 => write!(f, "\\u{:04x}", c as u32)?,
            c => f.write_char(c)?,
        }
    }
    f.write_char('"')
}

impl fmt::Display for Val {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Val::Str(s) => write_str(f, s),
            Val::Int(i) => write!(f, "{i}"),
            Val::Num(x) if !x.is_finite() => f.write_str("null"),
            Val::Num(x) if x.fract() == 0.0 && x.abs() < 1e15 => write!(f, "{x:.1}"),
            Val::Num(x) => {
                // Three decimals, trailing zeros dropped.
                let s = format!("{x:.3}");
                let s = s.trim_end_matches('0');
                f.write_str(s)?;
                if s.ends_with('.') {
                    f.write_char('0')?;
                }
                Ok(())
            }
            Val::Bool(b) => write!(f, "{b}"),
            Val::Obj(o) => write!(f, "{o}"),
        }
    }
}

impl fmt::Display for Obj {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('{')?;
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write_str(f, k)?;
            write!(f, ": {v}")?;
        }
        f.write_char('}')
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_valid_json() {
        let mut params = Obj::new();
        params.set("payload", 64usize).set("topic", "a\"b\\c\n");
        let mut o = Obj::new();
        o.set("scenario", "fan-in")
            .set("params", params)
            .set("rate", 1234.5678)
            .set("whole", 3.0)
            .set("nan", f64::NAN)
            .set("ok", true)
            .set("tiny", 0.0001)
            .set("rate", 1.25); // replaces, keeps position
        assert_eq!(
            o.to_string(),
            r#"{"scenario": "fan-in", "params": {"payload": 64, "topic": "a\"b\\c\n"}, "rate": 1.25, "whole": 3.0, "nan": null, "ok": true, "tiny": 0.0}"#
        );
    }
}
