//! Blanking of stimulus artifacts: the preprocessed (whitened) data of every
//! site are set to zero over a short stretch around each event, given as
//! times (`--artifact-times`) or found as transients common to most channels
//! ([`crate::checks::transients`], `--blank-transients`). Sample-level: a
//! stretch of `before + after` samples per event, never a whole window
//! (Kilosort4's only tool, `artifact_threshold`, zeroes whole batches).
//!
//! The stretches are found from the raw window and its place in the
//! recording, and zeroed after the whole preprocessing (CAR, high-pass,
//! whitening), so the filters' response to the artifact inside the stretch
//! goes too. [`crate::preprocess::Preprocessor`] carries a [`Blanking`]; a run
//! that blanks preprocesses on the host for every back end, so that all of
//! them detect in the same blanked windows.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use ndarray::Array2;

use crate::checks::transients::find_transients;

/// Default stretch blanked around each event: 0.5 ms before, 2 ms after.
pub const DEFAULT_ARTIFACT_WINDOW_MS: (f64, f64) = (0.5, 2.0);

/// What a run blanks: stretches around given event samples and, when
/// `transients`, around the transients found in each raw window.
#[derive(Debug, Clone, PartialEq)]
pub struct Blanking {
    /// Event samples, absolute (file) indices, increasing, no repeats.
    pub events: Vec<u64>,
    /// Samples blanked before each event (and before a transient's first column).
    pub before: usize,
    /// Samples blanked from each event on (and after a transient's last column).
    pub after: usize,
    /// Also blank around the transients found in each raw window.
    pub transients: bool,
    /// Transient columns closer than this join one event ([`crate::checks::transients::transient_gap`]).
    pub gap: usize,
}

impl Blanking {
    /// A blanking of `window_ms` = (ms before, ms after) at `fs` Hz around
    /// `events` (absolute samples, any order) and, when `transients`, around
    /// detected transients.
    ///
    /// # Errors
    /// When a side of the window is negative or not finite, or both are 0.
    pub fn new(events: Vec<u64>, window_ms: (f64, f64), fs: f64, transients: bool) -> Result<Self> {
        let (b, a) = window_ms;
        if !(b.is_finite() && a.is_finite() && b >= 0.0 && a >= 0.0 && b + a > 0.0) {
            bail!(
                "--artifact-window {b},{a}: give two non-negative milliseconds, before and after each event, not both 0"
            );
        }
        let mut events = events;
        events.sort_unstable();
        events.dedup();
        Ok(Blanking {
            events,
            before: (b * 1e-3 * fs).round() as usize,
            after: (a * 1e-3 * fs).round() as usize,
            transients,
            gap: crate::checks::transients::transient_gap(fs),
        })
    }

    /// Fraction of samples `first_sample .. first_sample + n_samples` that the
    /// given event times' stretches cover (overlaps counted once); the
    /// transients found while reading are not known before and not counted.
    pub fn events_share(&self, first_sample: u64, n_samples: u64) -> f64 {
        if n_samples == 0 {
            return 0.0;
        }
        let (lo, hi) = (first_sample, first_sample + n_samples);
        let mut covered = 0u64;
        let mut reach = lo;
        for &e in &self.events {
            let start = e.saturating_sub(self.before as u64).max(reach);
            let end = (e + self.after as u64).min(hi);
            if end > start {
                covered += end - start;
                reach = end;
            }
        }
        covered as f64 / n_samples as f64
    }

    /// The column ranges `[start, end)` of a raw window (C × N, column 0 at
    /// absolute sample `first_sample`) to zero after preprocessing, in
    /// order and not overlapping.
    pub fn ranges(&self, raw: &Array2<f32>, first_sample: i64) -> Vec<(usize, usize)> {
        let n = raw.ncols() as i64;
        let (before, after) = (self.before as i64, self.after as i64);
        let mut out = Vec::new();
        let lo = self
            .events
            .partition_point(|&e| (e as i64) + after <= first_sample);
        for &e in &self.events[lo..] {
            let c = e as i64 - first_sample;
            if c - before >= n {
                break;
            }
            out.push(((c - before).max(0) as usize, (c + after).min(n) as usize));
        }
        if self.transients {
            let std;
            let values = match raw.as_slice() {
                Some(v) => v,
                None => {
                    std = raw.as_standard_layout().into_owned();
                    std.as_slice().expect("standard layout")
                }
            };
            let shape = (raw.nrows(), raw.ncols(), raw.ncols());
            for (a, b) in find_transients(values, shape, self.gap) {
                out.push((
                    a.saturating_sub(self.before),
                    (b + self.after).min(raw.ncols()),
                ));
            }
        }
        merge_ranges(out)
    }
}

/// Sorts and merges overlapping or touching ranges.
fn merge_ranges(mut r: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    r.retain(|&(a, b)| b > a);
    r.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(r.len());
    for (a, b) in r {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// Sets columns `ranges` of every row of `x` to zero; returns how many columns.
pub fn zero_columns(x: &mut Array2<f32>, ranges: &[(usize, usize)]) -> usize {
    let n = x.ncols();
    let mut zeroed = 0;
    for &(a, b) in ranges {
        let (a, b) = (a.min(n), b.min(n));
        x.slice_mut(ndarray::s![.., a..b]).fill(0.0);
        zeroed += b - a;
    }
    zeroed
}

/// The blanking a run asks for on `rec` (`None`: none): the times of the
/// file `artifact_times` (`--artifact-times`), each blanked over `window_ms`
/// (`--artifact-window`, ms before and after), and, when `transients`
/// (`--blank-transients`), the transients found in each window. Warnings go
/// to `warnings`: times outside the recording, a window given with nothing
/// to blank, a window over a second, stretches covering over 10 % of the
/// recording.
///
/// # Errors
/// A times file that cannot be read or parsed, or holds no time inside the
/// recording; a window [`Blanking::new`] refuses.
pub fn blanking_for(
    rec: &dyn crate::recording::Recording,
    artifact_times: Option<TimesSource<'_>>,
    window_ms: (f64, f64),
    transients: bool,
    warnings: &mut Vec<String>,
) -> Result<Option<Arc<Blanking>>> {
    let mut events = Vec::new();
    let given = artifact_times.is_some();
    if let Some(source) = artifact_times {
        let times = source.read()?;
        let label = source.label();
        warnings.extend(times.warning.clone());
        let (inside, w) = event_samples(
            &times,
            &label,
            rec.fs(),
            rec.first_sample(),
            rec.n_samples(),
        );
        if inside.is_empty() {
            bail!(
                "{}",
                w.unwrap_or_else(|| format!("{label}: no time inside the recording"))
            );
        }
        warnings.extend(w);
        events = inside;
    }
    if !given && !transients {
        if window_ms != DEFAULT_ARTIFACT_WINDOW_MS {
            warnings.push("--artifact-window was given without --artifact-times or --blank-transients true: nothing is blanked".into());
        }
        return Ok(None);
    }
    let b = Blanking::new(events, window_ms, rec.fs(), transients)?;
    let (before, after) = window_ms;
    if before + after > 1000.0 {
        warnings.push(format!(
            "--artifact-window {before},{after} blanks {:.1} s around each event: it is in milliseconds before and after the event",
            (before + after) / 1000.0
        ));
    }
    let share = b.events_share(rec.first_sample(), rec.n_samples());
    if share > 0.1 {
        warnings.push(format!(
            "the --artifact-times stretches blank {:.0} % of the recording ({:.1} s of {:.1} s): few spikes can be found in the rest; check the times and --artifact-window",
            100.0 * share,
            share * rec.n_samples() as f64 / rec.fs(),
            rec.n_samples() as f64 / rec.fs()
        ));
    }
    Ok(Some(Arc::new(b)))
}

/// Where a run's stimulus artifact times come from: a file
/// (`--artifact-times`, [`read_event_times`]) or, from Python, the times
/// themselves (seconds from the start of the file).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TimesSource<'a> {
    /// A `.npy` array or a text/CSV file of times.
    File(&'a Path),
    /// The times, seconds.
    Seconds(&'a [f64]),
}

impl TimesSource<'_> {
    /// How messages name the times: `--artifact-times FILE`, or
    /// `artifact_times (a list of N times)`.
    pub fn label(&self) -> String {
        match self {
            TimesSource::File(p) => format!("--artifact-times {}", p.display()),
            TimesSource::Seconds(t) => {
                format!(
                    "artifact_times (a list of {})",
                    crate::error::count(t.len() as u64, "time")
                )
            }
        }
    }

    /// The times: read from the file, or checked as given.
    ///
    /// # Errors
    /// As [`read_event_times`] (no time at all, a time that is not finite).
    pub fn read(&self) -> Result<EventTimes> {
        match self {
            TimesSource::File(p) => read_event_times(p),
            TimesSource::Seconds(t) => checked_times(t.to_vec(), None, &self.label()),
        }
    }
}

/// `seconds` when there is at least one and every one is finite; errors
/// name `label`.
fn checked_times(seconds: Vec<f64>, warning: Option<String>, label: &str) -> Result<EventTimes> {
    if seconds.is_empty() {
        bail!("{label}: no times given");
    }
    if let Some((i, t)) = seconds.iter().enumerate().find(|(_, t)| !t.is_finite()) {
        bail!(
            "{label}: time {} of {} is {t}; every time must be a finite number of seconds",
            i + 1,
            seconds.len()
        );
    }
    Ok(EventTimes { seconds, warning })
}

/// Event times read from a file, seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct EventTimes {
    /// The times as read, seconds, in file order.
    pub seconds: Vec<f64>,
    /// A warning about how the file was read (a text file that looks like one
    /// column of decimal commas), or `None`.
    pub warning: Option<String>,
}

/// Reads event times (seconds) from `path`: a `.npy` array (1-D, or 2-D
/// whose first column is taken; float64, float32, int64 or int32), or text
/// as a spreadsheet exports it ([`parse_times_text`]): the times are the
/// first column, a header line is skipped, the other columns (labels,
/// durations, channels) are ignored.
///
/// # Errors
/// When the file cannot be read, a line's time is not a number (named with
/// its line and the text found), a time is not finite, or there is no time
/// at all.
pub fn read_event_times(path: &Path) -> Result<EventTimes> {
    let (seconds, warning) = if path.extension().is_some_and(|e| e == "npy") {
        (read_npy_times(path)?, None)
    } else {
        let bytes = std::fs::read(path)
            .with_context(|| format!("--artifact-times: cannot read {}", path.display()))?;
        let text = times_text(bytes).map_err(|e| {
            anyhow::anyhow!(
                "--artifact-times {}: {e}; save it as UTF-8 text or CSV (in Excel: \"CSV UTF-8\")",
                path.display()
            )
        })?;
        let seconds = parse_times_text(&text)
            .map_err(|e| anyhow::anyhow!("--artifact-times {}: {e}", path.display()))?;
        (seconds, decimal_comma_warning(&text, path))
    };
    if seconds.is_empty() {
        bail!(
            "--artifact-times {}: the file holds no times",
            path.display()
        );
    }
    checked_times(seconds, warning, &TimesSource::File(path).label())
}

/// The text of a times file: UTF-8 (bytes that are not, as in a Latin-1
/// label, replaced by U+FFFD), or UTF-16 with its byte order mark (a
/// spreadsheet's "Unicode text" export), decoded.
///
/// # Errors
/// UTF-16 that does not decode, and a file holding zero bytes (UTF-16
/// without its byte order mark, or not text), saying what it looks like.
fn times_text(bytes: Vec<u8>) -> std::result::Result<String, String> {
    let utf16 = |rest: &[u8], le: bool| -> std::result::Result<String, String> {
        if !rest.len().is_multiple_of(2) {
            return Err("UTF-16 text with an odd number of bytes".into());
        }
        let units: Vec<u16> = rest
            .chunks_exact(2)
            .map(|b| {
                if le {
                    u16::from_le_bytes([b[0], b[1]])
                } else {
                    u16::from_be_bytes([b[0], b[1]])
                }
            })
            .collect();
        String::from_utf16(&units).map_err(|_| "UTF-16 text that does not decode".into())
    };
    match bytes.as_slice() {
        [0xFF, 0xFE, rest @ ..] => utf16(rest, true),
        [0xFE, 0xFF, rest @ ..] => utf16(rest, false),
        _ if bytes.contains(&0) => Err(
            "not UTF-8 text (it holds zero bytes: UTF-16 without a byte order mark, or a binary file)"
                .into(),
        ),
        // Another 8-bit encoding (Latin-1, Windows-1252) differs from UTF-8
        // only outside ASCII, in labels and comments, which are not read:
        // those bytes become U+FFFD, and a time field holding one is an
        // error naming its line.
        _ => Ok(String::from_utf8_lossy(&bytes).into_owned()),
    }
}

#[allow(clippy::unnecessary_cast)] // the macro's `as f64` also runs on f64
fn read_npy_times(path: &Path) -> Result<Vec<f64>> {
    use ndarray::Axis;
    macro_rules! try_as {
        ($t:ty) => {
            if let Ok(a) = crate::npy::read::<$t, ndarray::Ix1>(path) {
                return Ok(a.iter().map(|&v| v as f64).collect());
            }
            if let Ok(a) = crate::npy::read::<$t, ndarray::Ix2>(path) {
                // One row (MATLAB's row vector): every value is a time.
                let times = if a.nrows() == 1 {
                    a.index_axis(Axis(0), 0)
                } else {
                    a.index_axis(Axis(1), 0)
                };
                return Ok(times.iter().map(|&v| v as f64).collect());
            }
        };
    }
    try_as!(f64);
    try_as!(f32);
    try_as!(i64);
    try_as!(i32);
    bail!(
        "--artifact-times {}: not a 1-D or 2-D .npy array of float64, float32, int64 or int32 (times in seconds)",
        path.display()
    )
}

/// Parses the text form of [`read_event_times`], line by line:
///
/// * a UTF-8 byte order mark, text after `#` and lines of nothing else but
///   separators (a spreadsheet's empty rows, `,,`) are ignored;
/// * fields are separated by commas or semicolons (an empty field between two
///   is a field: `,4` has an empty first field), and by tabs or spaces; in a
///   file that uses semicolons (a spreadsheet's export where the comma is
///   the decimal mark) commas are decimal marks, not separators (`12,5;laser`
///   is 12.5 s, `1.234,5;laser` 1234.5 s); double quotes around a field are
///   removed, and a separator inside them belongs to the field: a quoted
///   number with thousands separators (`"1,234.5"`) is that number;
/// * the first line is a header, and skipped, when its first field does not
///   start like a number (a digit, or `+`, `-` or `.` before one): `time,label`;
/// * the time of each line is its first field, which must be a finite number
///   of seconds; the other fields are ignored (`12.5,laser` is 12.5 s);
/// * text of a single line whose fields are all numbers is a row of times
///   (`0.5, 1.5 2`).
///
/// # Errors
/// A line whose first field is not a finite number, named with the line
/// number and the text found.
fn parse_times_text(text: &str) -> std::result::Result<Vec<f64>, String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let uncommented = |l: &'_ str| l.split('#').next().unwrap_or("").to_string();
    // Semicolons anywhere: the export of a spreadsheet whose decimal mark is the comma.
    let semicolons = text.lines().any(|l| uncommented(l).contains(';'));
    let separator = if semicolons { ';' } else { ',' };
    let lines: Vec<(usize, &str, Vec<String>)> = text
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let mut fields = Vec::new();
            for (cell, quoted) in split_cells(&uncommented(l), separator) {
                let cell = cell.trim();
                let cell = if semicolons {
                    decimal_comma_number(cell)
                } else if quoted {
                    thousands_commas_removed(cell)
                } else {
                    cell.to_string()
                };
                if cell.is_empty() {
                    fields.push(cell);
                } else {
                    fields.extend(
                        cell.split_whitespace()
                            .map(|f| f.trim_matches('"').to_string()),
                    );
                }
            }
            (i + 1, l.trim(), fields)
        })
        // Blank lines, comments, and rows of empty cells (`,,`).
        .filter(|(_, _, f)| f.iter().any(|f| !f.is_empty()))
        .collect();
    let mut data = &lines[..];
    if let Some((_, _, first)) = data.first()
        && !starts_like_a_number(&first[0])
        && !first[0].is_empty()
    {
        data = &data[1..]; // a header
    }
    let seconds = |(line, raw): (usize, &str), f: &str| match f.parse::<f64>() {
        Ok(t) if t.is_finite() => Ok(t),
        Ok(_) => Err(format!(
            "line {line} ({raw:?}): {f:?} is not a finite number of seconds"
        )),
        Err(_) if f.is_empty() => Err(format!(
            "line {line} ({raw:?}): the first field, the time, is empty"
        )),
        Err(_) => Err(format!(
            "line {line} ({raw:?}): {f:?} is not a number of seconds (each line's time is its first field; only the first line may be a header)"
        )),
    };
    if let [(line, raw, fields)] = data {
        let given: Vec<&String> = fields.iter().filter(|f| !f.is_empty()).collect();
        if given.iter().all(|f| f.parse::<f64>().is_ok()) {
            return given.iter().map(|f| seconds((*line, raw), f)).collect();
        }
    }
    data.iter()
        .map(|(line, raw, f)| seconds((*line, raw), &f[0]))
        .collect()
}

/// The cells of `line` between `separator`s, each with whether it was
/// quoted: a separator inside double quotes belongs to the cell (a
/// spreadsheet quotes `"1,234.5"` and `"laser, 5 mW"`), and a doubled quote
/// inside quotes is one quote.
fn split_cells(line: &str, separator: char) -> Vec<(String, bool)> {
    let mut cells = Vec::new();
    let (mut cell, mut quoted, mut inside) = (String::new(), false, false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if inside && chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            '"' => {
                inside = !inside;
                quoted = true;
            }
            c if c == separator && !inside => {
                cells.push((std::mem::take(&mut cell), quoted));
                quoted = false;
            }
            c => cell.push(c),
        }
    }
    cells.push((cell, quoted));
    cells
}

/// A quoted cell of a comma-separated file with its thousands separators
/// removed when it is written as a number with them (`1,234.5` is 1234.5,
/// as a spreadsheet formats it); any other cell as it is.
fn thousands_commas_removed(cell: &str) -> String {
    let digits = cell.strip_prefix(['+', '-']).unwrap_or(cell);
    let whole = digits.split('.').next().unwrap_or("");
    let mut groups = whole.split(',');
    let first_ok = groups
        .next()
        .is_some_and(|g| (1..=3).contains(&g.len()) && g.bytes().all(|b| b.is_ascii_digit()));
    let rest: Vec<&str> = groups.collect();
    let grouped = !rest.is_empty()
        && rest
            .iter()
            .all(|g| g.len() == 3 && g.bytes().all(|b| b.is_ascii_digit()));
    if first_ok && grouped {
        cell.replace(',', "")
    } else {
        cell.to_string()
    }
}

/// A cell of a semicolon-separated file (a spreadsheet's export where the
/// comma is the decimal mark): `12,5` is 12.5, and `1.234,5`, with points
/// between groups of three digits, is 1234.5.
fn decimal_comma_number(cell: &str) -> String {
    if let Some((whole, _)) = cell.split_once(',') {
        let digits = whole.strip_prefix(['+', '-']).unwrap_or(whole);
        let groups: Vec<&str> = digits.split('.').collect();
        let grouped = groups.len() > 1
            && (1..=3).contains(&groups[0].len())
            && groups[1..].iter().all(|g| g.len() == 3)
            && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_digit()));
        if grouped {
            return cell.replace('.', "").replace(',', ".");
        }
    }
    cell.replace(',', ".")
}

/// A warning when a comma-separated times file looks like one column of
/// decimal commas (`1,5` on every line: two whole numbers, no header), which
/// is read as a time and a label (1 s); `None` otherwise.
fn decimal_comma_warning(text: &str, path: &Path) -> Option<String> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if text.contains(';') {
        return None;
    }
    let rows: Vec<&str> = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .collect();
    let whole = |f: &str| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit());
    let looks = !rows.is_empty()
        && rows.iter().all(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            f.len() == 2 && whole(f[0]) && whole(f[1])
        });
    looks.then(|| {
        format!(
            "--artifact-times {}: every line is two whole numbers ({:?}), read as a time in seconds and a label; if the comma is a decimal mark, write the times with a point (or separate columns with semicolons)",
            path.display(),
            rows[0]
        )
    })
}

/// Whether a field starts as a number does (a digit, or `+`, `-` or `.`
/// before one): a first line whose first field does not is a header.
fn starts_like_a_number(field: &str) -> bool {
    let f = field.strip_prefix(['+', '-']).unwrap_or(field);
    let f = f.strip_prefix('.').unwrap_or(f);
    f.starts_with(|c: char| c.is_ascii_digit())
}

/// The given times as absolute samples of a recording whose sample 0 is
/// absolute sample `first` and which holds `n_samples` samples at `fs`:
/// `round(t·fs)`, those inside it; and a warning about those outside (their
/// count, the first few, the recording's range, and a hint when the times
/// look like milliseconds or samples), or `None`, beginning with `label`
/// ([`TimesSource::label`]).
pub fn event_samples(
    times: &EventTimes,
    label: &str,
    fs: f64,
    first: u64,
    n_samples: u64,
) -> (Vec<u64>, Option<String>) {
    let (lo, hi) = (first as f64 / fs, (first + n_samples) as f64 / fs);
    let mut inside = Vec::new();
    let mut outside = Vec::new();
    for &t in &times.seconds {
        let s = (t * fs).round();
        if s >= first as f64 && s < (first + n_samples) as f64 {
            inside.push(s as u64);
        } else {
            outside.push(t);
        }
    }
    if outside.is_empty() {
        return (inside, None);
    }
    let few: Vec<String> = outside.iter().take(5).map(|t| format!("{t}")).collect();
    let more = if outside.len() > 5 { ", …" } else { "" };
    let max = times.seconds.iter().copied().fold(f64::MIN, f64::max);
    // Milliseconds or samples put the last times an order of magnitude or
    // more past the end; times just past it are more likely another, longer
    // recording's (a batch gives every task the same file).
    let hint = if max >= 10.0 * hi {
        " (they look like milliseconds or samples: the times must be seconds)"
    } else if max >= hi {
        " (are they this recording's? the times must be counted from its first sample, in seconds)"
    } else {
        ""
    };
    let w = if inside.is_empty() {
        format!(
            "{label}: none of its {} times is inside the recording ({lo:.3}–{hi:.3} s): {}{more}{hint}",
            times.seconds.len(),
            few.join(", ")
        )
    } else {
        format!(
            "{label}: {} of {} times are outside the recording ({lo:.3}–{hi:.3} s) and were ignored: {}{more}{hint}",
            outside.len(),
            times.seconds.len(),
            few.join(", ")
        )
    };
    (inside, Some(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_events_and_clip_to_the_window() {
        let b = Blanking::new(vec![1000, 105, 5000], (1.0, 2.0), 10_000.0, false).unwrap();
        assert_eq!((b.before, b.after), (10, 20));
        let raw = Array2::<f32>::zeros((4, 200));
        // Window from absolute 0: event 105 → 95..125.
        assert_eq!(b.ranges(&raw, 0), vec![(95, 125)]);
        // Window from absolute 990: event 1000 at column 10 → 0..30.
        assert_eq!(b.ranges(&raw, 990), vec![(0, 30)]);
        // Event 5000 at column 210: its stretch starts at the window's end.
        assert!(b.ranges(&raw, 4790).is_empty());
        assert_eq!(b.ranges(&raw, 4791), vec![(199, 200)]);
        // Event 105's stretch ends where a window from 125 starts.
        assert!(b.ranges(&raw, 125).is_empty());
        assert_eq!(b.ranges(&raw, 124), vec![(0, 1)]);
        assert_eq!(
            merge_ranges(vec![(5, 9), (1, 3), (3, 4), (8, 12)]),
            vec![(1, 4), (5, 12)]
        );
        let mut x = Array2::<f32>::ones((2, 10));
        assert_eq!(zero_columns(&mut x, &[(2, 4), (8, 20)]), 4);
        assert_eq!(x.sum(), 12.0);
        // 1 ms before and 2 after at 10 kHz: 30 samples an event; two
        // overlapping events share theirs.
        let b = Blanking::new(vec![100, 110, 5000], (1.0, 2.0), 10_000.0, false).unwrap();
        assert!((b.events_share(0, 1000) - 40.0 / 1000.0).abs() < 1e-12);
        assert!((b.events_share(0, 10_000) - 70.0 / 10_000.0).abs() < 1e-12);
        assert!(Blanking::new(vec![], (-1.0, 2.0), 1e4, false).is_err());
        assert!(Blanking::new(vec![], (0.0, 0.0), 1e4, false).is_err());
    }

    #[test]
    fn times_from_text_and_npy() {
        assert_eq!(
            parse_times_text("0.5\n1.5\n\n2\n").unwrap(),
            vec![0.5, 1.5, 2.0]
        );
        assert_eq!(parse_times_text("0.5, 1.5 2").unwrap(), vec![0.5, 1.5, 2.0]);
        assert_eq!(
            parse_times_text("time_s,kind\n0.5,on # first\n0.7,off\n").unwrap(),
            vec![0.5, 0.7]
        );
        let e = parse_times_text("0.5\nabc\n").unwrap_err();
        assert!(e.contains("line 2") && e.contains("abc"), "{e}");
        // A spreadsheet's export: a header, the times first, labels after.
        for (text, want) in [
            ("time,label\n12.5,laser\n", vec![12.5]),
            ("12.5,laser\n", vec![12.5]),
            ("12.5,laser\n13,laser off\n", vec![12.5, 13.0]),
            ("\u{feff}12.5\n13\n", vec![12.5, 13.0]),
            ("\u{feff}time,label\n12.5,a\n", vec![12.5]),
            ("\"time\",\"label\"\n\"12.5\",\"laser, 5 mW\"\n", vec![12.5]),
            ("time\tlabel\n12.5\tlaser\n14\t\n", vec![12.5, 14.0]),
            ("time,label\n12.5,a\n,\n,,\n13,b\n", vec![12.5, 13.0]),
            ("Zeit;Marke\n12,5;Laser\n13;Laser\n", vec![12.5, 13.0]),
            ("t (s),chan\n-.5,3\n+2,4\n1e1,5\n", vec![-0.5, 2.0, 10.0]),
            // Quoted numbers with thousands separators, and quoted separators.
            (
                "time,label\n\"1,234.5\",laser\n\"12\",\"a, b\"\n",
                vec![1234.5, 12.0],
            ),
            (
                "Zeit;Marke\n1.234,5;Laser\n\"2,5\";\"a;b\"\n",
                vec![1234.5, 2.5],
            ),
        ] {
            assert_eq!(parse_times_text(text).unwrap(), want, "{text:?}");
        }
        // A time that is not a number is refused with its line and text,
        // also where the header is not the first line or the time not first.
        for (text, line, found) in [
            ("time,label\nlaser,12.5\n", "line 2", "\"laser\""),
            ("time,label\n12.5,a\ntime,label\n", "line 3", "\"time\""),
            ("12.5s,laser\n13s,laser\n", "line 1", "\"12.5s\""),
            ("0.5\n,4\n", "line 2", "empty"),
            ("# times\n0.5\nNaN\n", "line 3", "finite"),
            // Not thousands groups: refused, never read as another number.
            ("time\n\"1,23.5\"\n", "line 2", "\"1,23.5\""),
        ] {
            let e = parse_times_text(text).unwrap_err();
            assert!(e.contains(line) && e.contains(found), "{text:?}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.npy");
        crate::npy::write(&p, &ndarray::arr1(&[0.25f32, 1.0])).unwrap();
        assert_eq!(read_event_times(&p).unwrap().seconds, vec![0.25, 1.0]);
        let p = dir.path().join("empty.txt");
        std::fs::write(&p, "# nothing\n").unwrap();
        let e = read_event_times(&p).unwrap_err().to_string();
        assert!(e.contains("empty.txt") && e.contains("no times"), "{e}");
    }

    /// A spreadsheet's "Unicode text" export (UTF-16 with its byte order
    /// mark, either byte order) is read; UTF-16 without its mark is an error
    /// saying to save the file as UTF-8; Latin-1 labels are not read.
    #[test]
    fn utf16_files_are_read_and_other_encodings_named() {
        let dir = tempfile::tempdir().unwrap();
        let text = "time\tlabel\r\n1.5\tlaser\r\n2.25\tlaser\r\n";
        let units: Vec<u16> = text.encode_utf16().collect();
        for le in [true, false] {
            let mut bytes = if le {
                vec![0xFF, 0xFE]
            } else {
                vec![0xFE, 0xFF]
            };
            for u in &units {
                bytes.extend(if le { u.to_le_bytes() } else { u.to_be_bytes() });
            }
            let p = dir.path().join("times.txt");
            std::fs::write(&p, &bytes).unwrap();
            assert_eq!(read_event_times(&p).unwrap().seconds, vec![1.5, 2.25]);
        }
        let p = dir.path().join("nobom.txt");
        let bytes: Vec<u8> = units.iter().flat_map(|u| u.to_le_bytes()).collect();
        std::fs::write(&p, bytes).unwrap();
        let e = read_event_times(&p).unwrap_err().to_string();
        assert!(
            e.contains("nobom.txt") && e.contains("UTF-16") && e.contains("UTF-8"),
            "{e}"
        );
        // Latin-1 labels and comments are not read; a time that is not a
        // number is named with its line.
        let p = dir.path().join("latin1.txt");
        std::fs::write(&p, b"# caf\xe9\n1.5 \xe9clair\n2\n").unwrap();
        assert_eq!(read_event_times(&p).unwrap().seconds, vec![1.5, 2.0]);
        std::fs::write(&p, b"1.5\n2\xe9\n").unwrap();
        let e = read_event_times(&p).unwrap_err().to_string();
        assert!(e.contains("latin1.txt") && e.contains("line 2"), "{e}");
        // A row vector (MATLAB's) in a .npy: every value is a time.
        let p = dir.path().join("row.npy");
        crate::npy::write(&p, &ndarray::array![[2.5f64, 7.25, 12.0]]).unwrap();
        assert_eq!(read_event_times(&p).unwrap().seconds, vec![2.5, 7.25, 12.0]);
        let p = dir.path().join("pairs.npy");
        crate::npy::write(&p, &ndarray::array![[2.5f64, 3.0], [7.25, 8.0]]).unwrap();
        assert_eq!(read_event_times(&p).unwrap().seconds, vec![2.5, 7.25]);
    }

    #[test]
    fn one_column_of_decimal_commas_is_warned_about() {
        let p = Path::new("t.csv");
        let w = decimal_comma_warning("1,5\n5,25\n", p).unwrap();
        assert!(w.contains("t.csv") && w.contains("decimal mark"), "{w}");
        assert!(decimal_comma_warning("\u{feff}12,3\n", p).is_some());
        for text in [
            "time,trial\n1,5\n",
            "1.5,2\n",
            "1,5;2\n",
            "1\n2\n",
            "1,5\n2.5,3\n",
        ] {
            assert_eq!(decimal_comma_warning(text, p), None, "{text:?}");
        }
    }

    #[test]
    fn times_outside_are_named() {
        let t = EventTimes {
            seconds: vec![0.5, 1500.0, 2.5],
            warning: None,
        };
        let (s, w) = event_samples(&t, "--artifact-times light.csv", 1000.0, 0, 3000);
        assert_eq!(s, vec![500, 2500]);
        let w = w.unwrap();
        assert!(
            w.contains("light.csv") && w.contains("1 of 3") && w.contains("1500"),
            "{w}"
        );
        assert!(w.contains("milliseconds"), "{w}");
        // Just past the end (another, longer recording's times): no
        // milliseconds hint.
        let t = EventTimes {
            seconds: vec![0.5, 3.5],
            warning: None,
        };
        let w = event_samples(&t, "--artifact-times light.csv", 1000.0, 0, 3000)
            .1
            .unwrap();
        assert!(
            !w.contains("milliseconds") && w.contains("this recording's"),
            "{w}"
        );
    }
}
