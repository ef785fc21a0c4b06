//! `.prb` probe files (klusta / spyking-circus / tridesclous style), read as data.
//!
//! A `.prb` file is Python source, but the files in use only assign literals:
//!
//! ```text
//! total_nb_channels = 32          # optional
//! radius = 100                    # ignored
//! channel_groups = {
//!     0: {'channels': [0, 1, 2, 3],
//!         'geometry': {0: (0, 0), 1: (0, 20), 2: (20, 0), 3: (20, 20)},
//!         'graph': [...]},        # ignored
//! }
//! ```
//!
//! This module parses that subset of Python literals (numbers, strings, lists,
//! tuples, dicts, `True`/`False`/`None`, `#` comments) with a small recursive
//! descent parser and never executes anything. Each group becomes one shank
//! (`kcoords` = group key); a site is each channel that has a geometry entry;
//! `chan_map` = the channel number; `n_chan` = `total_nb_channels` if given, else
//! the largest channel + 1.

use std::path::Path;

use super::Probe;
use crate::error::ProbeError;

/// A Python literal value.
#[derive(Debug, Clone, PartialEq)]
enum Lit {
    Num(f64),
    Str(String),
    List(Vec<Lit>),
    Dict(Vec<(Lit, Lit)>),
    None,
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    depth: usize,
}

impl<'a> Parser<'a> {
    fn skip_ws(&mut self) {
        while self.i < self.s.len() {
            match self.s[self.i] {
                b' ' | b'\t' | b'\r' | b'\n' | b'\\' => self.i += 1,
                b'#' => {
                    while self.i < self.s.len() && self.s[self.i] != b'\n' {
                        self.i += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.s.get(self.i).copied()
    }

    fn line(&self) -> usize {
        self.s[..self.i.min(self.s.len())]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1
    }

    fn err(&self, msg: &str) -> String {
        format!("line {}: {msg}", self.line())
    }

    fn ident(&mut self) -> Option<String> {
        self.skip_ws();
        let st = self.i;
        while self.i < self.s.len()
            && (self.s[self.i].is_ascii_alphanumeric() || self.s[self.i] == b'_')
        {
            self.i += 1;
        }
        (self.i > st && !self.s[st].is_ascii_digit())
            .then(|| String::from_utf8_lossy(&self.s[st..self.i]).into_owned())
            .or_else(|| {
                self.i = st;
                None
            })
    }

    fn value(&mut self) -> Result<Lit, String> {
        self.depth += 1;
        if self.depth > 64 {
            return Err(self.err("literals nested more than 64 deep"));
        }
        let r = self.value_inner();
        self.depth -= 1;
        r
    }

    fn seq(&mut self, close: u8) -> Result<Vec<Lit>, String> {
        let mut out = Vec::new();
        loop {
            if self.peek() == Some(close) {
                self.i += 1;
                return Ok(out);
            }
            out.push(self.value()?);
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(c) if c == close => {}
                _ => return Err(self.err(&format!("expected `,` or `{}`", close as char))),
            }
        }
    }

    fn value_inner(&mut self) -> Result<Lit, String> {
        match self.peek() {
            None => Err(self.err("unexpected end of file")),
            Some(b'[') => {
                self.i += 1;
                Ok(Lit::List(self.seq(b']')?))
            }
            Some(b'(') => {
                self.i += 1;
                Ok(Lit::List(self.seq(b')')?))
            }
            Some(b'{') => {
                self.i += 1;
                let mut out = Vec::new();
                loop {
                    if self.peek() == Some(b'}') {
                        self.i += 1;
                        return Ok(Lit::Dict(out));
                    }
                    let k = self.value()?;
                    if self.peek() != Some(b':') {
                        return Err(self.err("expected `:` after a dict key"));
                    }
                    self.i += 1;
                    let v = self.value()?;
                    out.push((k, v));
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {}
                        _ => return Err(self.err("expected `,` or `}` in a dict")),
                    }
                }
            }
            Some(q @ (b'\'' | b'"')) => {
                self.i += 1;
                let st = self.i;
                while self.i < self.s.len() && self.s[self.i] != q {
                    if self.s[self.i] == b'\n' {
                        return Err(self.err("string runs past the end of the line"));
                    }
                    self.i += 1;
                }
                if self.i >= self.s.len() {
                    return Err(self.err("unterminated string"));
                }
                let v = String::from_utf8_lossy(&self.s[st..self.i]).into_owned();
                self.i += 1;
                Ok(Lit::Str(v))
            }
            Some(c) if c == b'-' || c == b'+' || c == b'.' || c.is_ascii_digit() => {
                let st = self.i;
                self.i += 1;
                while self.i < self.s.len()
                    && (self.s[self.i].is_ascii_alphanumeric()
                        || matches!(self.s[self.i], b'.' | b'_')
                        || (matches!(self.s[self.i], b'-' | b'+')
                            && matches!(self.s[self.i - 1], b'e' | b'E')))
                {
                    self.i += 1;
                }
                let t: String = String::from_utf8_lossy(&self.s[st..self.i]).replace('_', "");
                t.parse::<f64>()
                    .map(Lit::Num)
                    .map_err(|_| self.err(&format!("`{t}` is not a number")))
            }
            Some(_) => match self.ident().as_deref() {
                Some("True") => Ok(Lit::Num(1.0)),
                Some("False") => Ok(Lit::Num(0.0)),
                Some("None") => Ok(Lit::None),
                Some(other) => Err(self.err(&format!(
                    "`{other}` is not a literal; .prb files are read as data, expressions are not evaluated"
                ))),
                None => Err(self.err("unexpected character")),
            },
        }
    }
}

/// Parses `name = literal` statements into (name, value) pairs.
fn assignments(text: &str) -> Result<Vec<(String, Lit)>, String> {
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
        depth: 0,
    };
    let mut out = Vec::new();
    while p.peek().is_some() {
        if p.peek() == Some(b';') {
            p.i += 1;
            continue;
        }
        let name = p.ident().ok_or_else(|| p.err("expected `name = value`"))?;
        if name == "import" || name == "from" {
            return Err(p.err("import statements are not supported; .prb files are read as data"));
        }
        if p.peek() != Some(b'=') {
            return Err(p.err(&format!("expected `=` after `{name}`")));
        }
        p.i += 1;
        let v = p.value()?;
        out.push((name, v));
    }
    Ok(out)
}

fn as_int(v: &Lit) -> Option<i64> {
    match v {
        Lit::Num(x) if x.fract() == 0.0 && x.abs() < 1e15 => Some(*x as i64),
        _ => None,
    }
}

/// Parses `.prb` text into a probe; `path` is used in messages only.
///
/// # Errors
/// [`ProbeError::Parse`] with the line for text outside the literal subset;
/// [`ProbeError::Field`] when `channel_groups` is missing or a group's
/// `channels`/`geometry` is malformed; errors of [`Probe::validate`].
pub fn parse(text: &str, path: &Path) -> Result<Probe, ProbeError> {
    let field = |f: &str, message: String| ProbeError::Field {
        path: path.to_owned(),
        field: f.to_owned(),
        message,
    };
    let items = assignments(text).map_err(|message| ProbeError::Parse {
        path: path.to_owned(),
        message,
    })?;
    let get = |n: &str| items.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v);
    let Some(Lit::Dict(groups)) = get("channel_groups") else {
        return Err(field(
            "channel_groups",
            "missing or not a dict {group: {'channels': [...], 'geometry': {...}}}".into(),
        ));
    };
    let total = match get("total_nb_channels") {
        None | Some(Lit::None) => None,
        Some(v) => Some(
            as_int(v)
                .filter(|&n| n > 0)
                .ok_or_else(|| field("total_nb_channels", "not a positive integer".into()))?
                as u64,
        ),
    };
    let mut probe = Probe {
        xc: vec![],
        yc: vec![],
        kcoords: vec![],
        chan_map: vec![],
        n_chan: 0,
        source: path.to_owned(),
    };
    for (gk, g) in groups {
        let gname = match gk {
            Lit::Str(s) => s.clone(),
            other => as_int(other).map(|x| x.to_string()).unwrap_or_default(),
        };
        let shank = as_int(gk).unwrap_or(probe.kcoords.iter().max().map_or(0, |m| m + 1));
        let f = |n: &str| format!("channel_groups[{gname}].{n}");
        let Lit::Dict(g) = g else {
            return Err(field(&f(""), "not a dict".into()));
        };
        let key = |n: &str| {
            g.iter()
                .find(|(k, _)| matches!(k, Lit::Str(s) if s == n))
                .map(|(_, v)| v)
        };
        let chans: Vec<i64> = match key("channels") {
            Some(Lit::List(l)) => l
                .iter()
                .map(|c| as_int(c).filter(|&c| c >= 0))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    field(
                        &f("channels"),
                        "entries must be non-negative integers".into(),
                    )
                })?,
            _ => return Err(field(&f("channels"), "missing or not a list".into())),
        };
        let Some(Lit::Dict(geom)) = key("geometry") else {
            return Err(field(
                &f("geometry"),
                "missing or not a dict {channel: (x, y)}".into(),
            ));
        };
        let mut pos = Vec::new();
        for (k, v) in geom {
            let ch = as_int(k)
                .filter(|&c| c >= 0)
                .ok_or_else(|| field(&f("geometry"), "keys must be channel numbers".into()))?;
            let xy = match v {
                Lit::List(l) if l.len() >= 2 => match (&l[0], &l[1]) {
                    (Lit::Num(x), Lit::Num(y)) => (*x as f32, *y as f32),
                    _ => {
                        return Err(field(
                            &f("geometry"),
                            format!("channel {ch}: (x, y) must be numbers"),
                        ));
                    }
                },
                _ => {
                    return Err(field(
                        &f("geometry"),
                        format!("channel {ch}: expected (x, y)"),
                    ));
                }
            };
            pos.push((ch, xy));
        }
        for ch in chans {
            let Some(&(_, (x, y))) = pos.iter().find(|(c, _)| *c == ch) else {
                tracing::warn!(file = %path.display(), "channel {ch} of group {gname} has no geometry and is left out");
                continue;
            };
            probe.xc.push(x);
            probe.yc.push(y);
            probe.kcoords.push(shank);
            probe.chan_map.push(ch as u64);
        }
    }
    probe.n_chan = total.unwrap_or_else(|| probe.chan_map.iter().max().map_or(0, |m| m + 1));
    probe.validate()?;
    Ok(probe)
}
