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
//! descent parser and never executes anything. It also evaluates, as data, the
//! forms real files use to build channel lists: `range(...)`,
//! `list(range(...))`, arithmetic on numbers (`+ - * / // %`), names assigned
//! earlier in the file, and list or dict comprehensions with one `for` over
//! `range` or a list (`[i for i in range(8)]`, `{i: (0, 20 * i) for i in
//! range(4)}`). Anything else (other calls, `import`, `if` in a
//! comprehension, ...) is an error naming the construct and asking for a
//! literal instead. Each group becomes one shank
//! (`kcoords` = group key); a site is each channel that has a geometry entry;
//! `chan_map` = the channel number; `n_chan` = `total_nb_channels` if given, else
//! the largest channel + 1.

use std::path::Path;

use super::Probe;
use crate::error::ProbeError;

/// A Python literal value (the result of evaluating an [`Expr`]).
#[derive(Debug, Clone, PartialEq)]
enum Lit {
    Num(f64),
    Str(String),
    List(Vec<Lit>),
    Dict(Vec<(Lit, Lit)>),
    None,
}

/// Binary arithmetic operators allowed in expressions.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
    FloorDiv,
    Mod,
}

/// The expressions a `.prb` file may use: literals, arithmetic on numbers,
/// names bound earlier in the file or by a comprehension, `range(...)`,
/// `list(...)`, and list or dict comprehensions over one `for` clause.
#[derive(Debug, Clone, PartialEq)]
enum Expr {
    Num(f64),
    Str(String),
    None,
    List(Vec<Expr>),
    Dict(Vec<(Expr, Expr)>),
    Name(String, usize),
    Neg(Box<Expr>),
    Bin(Op, Box<Expr>, Box<Expr>),
    /// `range(...)` (1 to 3 arguments) with the line it is on.
    Range(Vec<Expr>, usize),
    /// `list(x)`.
    ListOf(Box<Expr>),
    /// `[elem for var in iter]`.
    ListComp(Box<Expr>, String, Box<Expr>, usize),
    /// `{key: value for var in iter}`.
    DictComp(Box<Expr>, Box<Expr>, String, Box<Expr>, usize),
}

/// Most elements a `range` or comprehension may produce (a probe has at most a
/// few thousand sites; this keeps a malformed file from filling memory).
const MAX_ELEMENTS: usize = 1_000_000;

/// How to write any construct the reader does not support.
const REWRITE_HINT: &str = "write the value as a literal instead (e.g. [0, 1, 2, 3] or {0: (0, 0), 1: (0, 20)}); .prb files are read as data, not run as Python";

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

    /// Consumes the keyword `kw` when it comes next.
    fn keyword(&mut self, kw: &str) -> bool {
        let st = self.i;
        match self.ident() {
            Some(w) if w == kw => true,
            _ => {
                self.i = st;
                false
            }
        }
    }

    fn value(&mut self) -> Result<Expr, String> {
        self.depth += 1;
        if self.depth > 64 {
            return Err(self.err("expressions nested more than 64 deep"));
        }
        let r = self.sum();
        self.depth -= 1;
        r
    }

    fn sum(&mut self) -> Result<Expr, String> {
        let mut a = self.product()?;
        loop {
            let op = match self.peek() {
                Some(b'+') => Op::Add,
                Some(b'-') => Op::Sub,
                _ => return Ok(a),
            };
            self.i += 1;
            let b = self.product()?;
            a = Expr::Bin(op, Box::new(a), Box::new(b));
        }
    }

    fn product(&mut self) -> Result<Expr, String> {
        let mut a = self.unary()?;
        loop {
            let op = match self.peek() {
                Some(b'*') if self.s.get(self.i + 1) == Some(&b'*') => {
                    return Err(self.err(&format!("`**` is not supported; {REWRITE_HINT}")));
                }
                Some(b'*') => Op::Mul,
                Some(b'/') if self.s.get(self.i + 1) == Some(&b'/') => {
                    self.i += 1;
                    Op::FloorDiv
                }
                Some(b'/') => Op::Div,
                Some(b'%') => Op::Mod,
                _ => return Ok(a),
            };
            self.i += 1;
            let b = self.unary()?;
            a = Expr::Bin(op, Box::new(a), Box::new(b));
        }
    }

    fn unary(&mut self) -> Result<Expr, String> {
        match self.peek() {
            Some(b'-') => {
                self.i += 1;
                Ok(Expr::Neg(Box::new(self.unary()?)))
            }
            Some(b'+') => {
                self.i += 1;
                self.unary()
            }
            _ => self.atom(),
        }
    }

    /// Items up to `close`; returns them and whether a comma was seen.
    fn seq(&mut self, close: u8, first: Option<Expr>) -> Result<(Vec<Expr>, bool), String> {
        let mut out = Vec::new();
        let mut comma = false;
        if let Some(f) = first {
            out.push(f);
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    comma = true;
                }
                Some(c) if c == close => {}
                _ => return Err(self.err(&format!("expected `,` or `{}`", close as char))),
            }
        }
        loop {
            if self.peek() == Some(close) {
                self.i += 1;
                return Ok((out, comma));
            }
            out.push(self.value()?);
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    comma = true;
                }
                Some(c) if c == close => {}
                _ => return Err(self.err(&format!("expected `,` or `{}`", close as char))),
            }
        }
    }

    /// After `for`: `NAME in ITER` then `close`.
    fn comp_tail(&mut self, close: u8) -> Result<(String, Expr), String> {
        let var = self
            .ident()
            .ok_or_else(|| self.err("expected a name after `for`"))?;
        if self.peek() == Some(b',') {
            return Err(self.err(&format!(
                "a comprehension over several names (`for {var}, ...`) is not supported; {REWRITE_HINT}"
            )));
        }
        if !self.keyword("in") {
            return Err(self.err(&format!("expected `in` after `for {var}`")));
        }
        let iter = self.value()?;
        if self.keyword("if") {
            return Err(self.err(&format!(
                "`if` in a comprehension is not supported; {REWRITE_HINT}"
            )));
        }
        if self.keyword("for") {
            return Err(self.err(&format!(
                "a comprehension with two `for` clauses is not supported; {REWRITE_HINT}"
            )));
        }
        if self.peek() != Some(close) {
            return Err(self.err(&format!(
                "expected `{}` to end the comprehension",
                close as char
            )));
        }
        self.i += 1;
        Ok((var, iter))
    }

    fn atom(&mut self) -> Result<Expr, String> {
        let line = self.line();
        match self.peek() {
            None => Err(self.err("unexpected end of file")),
            Some(b'[') => {
                self.i += 1;
                if self.peek() == Some(b']') {
                    self.i += 1;
                    return Ok(Expr::List(vec![]));
                }
                let first = self.value()?;
                if self.keyword("for") {
                    let (var, iter) = self.comp_tail(b']')?;
                    return Ok(Expr::ListComp(Box::new(first), var, Box::new(iter), line));
                }
                Ok(Expr::List(self.seq(b']', Some(first))?.0))
            }
            Some(b'(') => {
                self.i += 1;
                if self.peek() == Some(b')') {
                    self.i += 1;
                    return Ok(Expr::List(vec![]));
                }
                let first = self.value()?;
                if self.keyword("for") {
                    return Err(self.err(&format!(
                        "a generator expression `(... for ...)` is not supported; use a list comprehension `[... for ...]` or {REWRITE_HINT}"
                    )));
                }
                let (mut items, comma) = self.seq(b')', Some(first))?;
                // `(x)` is x; `(x,)` and `(x, y)` are tuples.
                Ok(if comma || items.len() != 1 {
                    Expr::List(items)
                } else {
                    items.remove(0)
                })
            }
            Some(b'{') => {
                self.i += 1;
                let mut out = Vec::new();
                loop {
                    if self.peek() == Some(b'}') {
                        self.i += 1;
                        return Ok(Expr::Dict(out));
                    }
                    let k = self.value()?;
                    if self.peek() != Some(b':') {
                        return Err(self.err("expected `:` after a dict key"));
                    }
                    self.i += 1;
                    let v = self.value()?;
                    if out.is_empty() && self.keyword("for") {
                        let (var, iter) = self.comp_tail(b'}')?;
                        return Ok(Expr::DictComp(
                            Box::new(k),
                            Box::new(v),
                            var,
                            Box::new(iter),
                            line,
                        ));
                    }
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
                Ok(Expr::Str(v))
            }
            Some(c) if c == b'.' || c.is_ascii_digit() => {
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
                    .map(Expr::Num)
                    .map_err(|_| self.err(&format!("`{t}` is not a number")))
            }
            Some(_) => match self.ident() {
                Some(w) if w == "True" => Ok(Expr::Num(1.0)),
                Some(w) if w == "False" => Ok(Expr::Num(0.0)),
                Some(w) if w == "None" => Ok(Expr::None),
                Some(name) => {
                    if self.peek() == Some(b'[') {
                        return Err(self.err(&format!(
                            "indexing (`{name}[...]`) is not supported; {REWRITE_HINT}"
                        )));
                    }
                    if self.peek() == Some(b'.') {
                        return Err(self.err(&format!(
                            "attributes and methods (`{name}.…`) are not supported; {REWRITE_HINT}"
                        )));
                    }
                    if self.peek() != Some(b'(') {
                        return Ok(Expr::Name(name, line));
                    }
                    self.i += 1;
                    let (mut args, _) = self.seq(b')', None)?;
                    match name.as_str() {
                        "range" if (1..=3).contains(&args.len()) => Ok(Expr::Range(args, line)),
                        "range" => Err(self.err("range() takes 1 to 3 arguments")),
                        "list" | "tuple" if args.len() == 1 => {
                            Ok(Expr::ListOf(Box::new(args.remove(0))))
                        }
                        _ => Err(self.err(&format!(
                            "the call `{name}(...)` is not supported (only range(...), list(...) and comprehensions over range are); {REWRITE_HINT}"
                        ))),
                    }
                }
                None => Err(self.err(&format!(
                    "unexpected character `{}`",
                    self.s[self.i] as char
                ))),
            },
        }
    }
}

/// Names bound while evaluating: top-level assignments, then comprehension variables.
type Env = Vec<(String, Lit)>;

fn num(v: &Lit, line: usize, what: &str) -> Result<f64, String> {
    match v {
        Lit::Num(x) => Ok(*x),
        _ => Err(format!("line {line}: {what} must be a number")),
    }
}

fn int(v: &Lit, line: usize, what: &str) -> Result<i64, String> {
    as_int(v).ok_or_else(|| format!("line {line}: {what} must be an integer"))
}

/// The elements of an iterable value (a list or tuple; a dict gives its keys).
fn elements(v: Lit, line: usize) -> Result<Vec<Lit>, String> {
    match v {
        Lit::List(l) => Ok(l),
        Lit::Dict(d) => Ok(d.into_iter().map(|(k, _)| k).collect()),
        _ => Err(format!(
            "line {line}: a comprehension or list() must go over range(...) or a list"
        )),
    }
}

fn eval(e: &Expr, env: &mut Env) -> Result<Lit, String> {
    Ok(match e {
        Expr::Num(x) => Lit::Num(*x),
        Expr::Str(s) => Lit::Str(s.clone()),
        Expr::None => Lit::None,
        Expr::List(items) => Lit::List(
            items
                .iter()
                .map(|x| eval(x, env))
                .collect::<Result<_, _>>()?,
        ),
        Expr::Dict(items) => Lit::Dict(
            items
                .iter()
                .map(|(k, v)| Ok((eval(k, env)?, eval(v, env)?)))
                .collect::<Result<_, String>>()?,
        ),
        Expr::Name(n, line) => env
            .iter()
            .rev()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| {
                format!(
                    "line {line}: `{n}` is not a literal nor a name assigned earlier in the file; {REWRITE_HINT}"
                )
            })?,
        Expr::Neg(a) => Lit::Num(-num(&eval(a, env)?, 0, "the operand of `-`")?),
        Expr::Bin(op, a, b) => {
            let (x, y) = (eval(a, env)?, eval(b, env)?);
            let what = "an operand of an arithmetic operator";
            let (x, y) = (
                num(&x, 0, what).map_err(|_| format!("{what} is not a number; {REWRITE_HINT}"))?,
                num(&y, 0, what).map_err(|_| format!("{what} is not a number; {REWRITE_HINT}"))?,
            );
            if matches!(op, Op::Div | Op::FloorDiv | Op::Mod) && y == 0.0 {
                return Err("division by zero".into());
            }
            Lit::Num(match op {
                Op::Add => x + y,
                Op::Sub => x - y,
                Op::Mul => x * y,
                Op::Div => x / y,
                Op::FloorDiv => (x / y).floor(),
                Op::Mod => x - y * (x / y).floor(),
            })
        }
        Expr::Range(args, line) => {
            let v: Vec<i64> = args
                .iter()
                .map(|a| int(&eval(a, env)?, *line, "an argument of range()"))
                .collect::<Result<_, _>>()?;
            let (start, stop, step) = match v[..] {
                [stop] => (0, stop, 1),
                [start, stop] => (start, stop, 1),
                [start, stop, step] => (start, stop, step),
                _ => unreachable!("range() is parsed with 1 to 3 arguments"),
            };
            if step == 0 {
                return Err(format!("line {line}: range() step must not be zero"));
            }
            let (span, by) = if step > 0 {
                ((stop as i128 - start as i128).max(0), step as i128)
            } else {
                ((start as i128 - stop as i128).max(0), -(step as i128))
            };
            let len = (span + by - 1) / by;
            if len as u64 > MAX_ELEMENTS as u64 {
                return Err(format!(
                    "line {line}: range() gives {len} elements, more than {MAX_ELEMENTS}"
                ));
            }
            Lit::List(
                (0..len as i64)
                    .map(|k| Lit::Num((start + k * step) as f64))
                    .collect(),
            )
        }
        Expr::ListOf(a) => Lit::List(elements(eval(a, env)?, 0)?),
        Expr::ListComp(elem, var, iter, line) => {
            let items = elements(eval(iter, env)?, *line)?;
            let mut out = Vec::with_capacity(items.len());
            for it in items {
                env.push((var.clone(), it));
                let r = eval(elem, env);
                env.pop();
                out.push(r?);
            }
            Lit::List(out)
        }
        Expr::DictComp(k, v, var, iter, line) => {
            let items = elements(eval(iter, env)?, *line)?;
            let mut out = Vec::with_capacity(items.len());
            for it in items {
                env.push((var.clone(), it));
                let r = eval(k, env).and_then(|key| Ok((key, eval(v, env)?)));
                env.pop();
                out.push(r?);
            }
            Lit::Dict(out)
        }
    })
}

/// Parses `name = expression` statements into (name, value) pairs, evaluating
/// each expression (names may refer to earlier assignments).
fn assignments(text: &str) -> Result<Vec<(String, Lit)>, String> {
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
        depth: 0,
    };
    let mut out: Env = Vec::new();
    while p.peek().is_some() {
        if p.peek() == Some(b';') {
            p.i += 1;
            continue;
        }
        let name = p.ident().ok_or_else(|| p.err("expected `name = value`"))?;
        if name == "import" || name == "from" {
            return Err(p.err(&format!(
                "import statements are not supported; {REWRITE_HINT}"
            )));
        }
        if matches!(
            name.as_str(),
            "for" | "def" | "if" | "while" | "class" | "with" | "lambda"
        ) {
            return Err(p.err(&format!(
                "`{name}` statements are not supported; {REWRITE_HINT}"
            )));
        }
        if p.peek() != Some(b'=') || p.s.get(p.i + 1) == Some(&b'=') {
            return Err(p.err(&format!(
                "expected `=` after `{name}` (only `name = value` statements are read; {REWRITE_HINT})"
            )));
        }
        p.i += 1;
        let line = p.line();
        let e = p.value()?;
        let v = eval(&e, &mut out).map_err(|m| {
            if m.starts_with("line ") {
                m
            } else {
                format!("line {line}: {m}")
            }
        })?;
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
