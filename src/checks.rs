//! Checks on inputs that would otherwise fool detection quietly (field failures
//! BR-12, BR-19, BR-22, BR-26, BR-27): channel health, stuck (clipped) stretches,
//! the data's scale, layouts that disagree with the file, common referencing over
//! too few sites, and duplicate detections of one event across a window boundary.
//!
//! Each check either corrects the input (with a logged message) or returns a
//! one-line warning saying what was assumed and which flag changes it. The
//! pipeline collects the warnings into `spikecube.json` (`"warnings"`).

use std::collections::BTreeMap;

use ndarray::{Array2, ArrayView2};

use crate::detect::Geometry;
use crate::preprocess::WHITENING_EPS;
use crate::probe::Probe;
use crate::recording::Recording;

pub mod dtype;
mod noisy;
mod outcome;
mod pass;
pub use noisy::{NOISY_SD_RATIO, noisy_channels, noisy_channels_warning};
pub use pass::{PassChecks, WindowCheck, WindowFound};
mod scan;
pub mod transients;
pub use outcome::{ZERO_SPIKES_MIN_SECONDS, artifact_windows_warning, zero_spikes_warning};
pub use scan::{HASH_PIECE, RowFacts, RowScan, ScanColumns};

/// Shortest run of identical samples at a channel's window extreme counted as
/// stuck (clipped, saturated): 1 ms of samples, at least 8.
pub fn stuck_min_run(fs: f64) -> usize {
    ((fs * 1e-3).round() as usize).max(8)
}

/// A raw sample as the input checks see it: f32 (any reader) or the file's
/// int16 value (a GPU pass's int16 windows). Every check gives the
/// same answer for an int16 value and its (exact) f32 conversion.
pub trait RawSample: Copy + PartialEq + PartialOrd + Send + Sync + 'static {
    /// The value as f32 (exact for int16).
    fn to_f32(self) -> f32;
    /// The smaller value (f32: `f32::min`, which skips NaN).
    fn min_of(self, other: Self) -> Self;
    /// The larger value (f32: `f32::max`, which skips NaN).
    fn max_of(self, other: Self) -> Self;
    /// A total order, for medians.
    fn order(&self, other: &Self) -> std::cmp::Ordering;
    /// The value's int16 bits when it is an int16 value (f32: exactly, and
    /// not −0.0), for the row hash ([`RowScan`]).
    fn code16(self) -> Option<u16> {
        let (code, exact) = self.code16_exact();
        exact.then_some(code)
    }
    /// [`RawSample::code16`] without a branch: the code (anything when not
    /// exact) and whether the value is an int16 value.
    fn code16_exact(self) -> (u16, bool);
    /// Whether the value is zero (+0.0 or −0.0).
    fn is_zero(self) -> bool;
    /// Whether the two values' f32 forms have the same bits.
    fn same_bits(self, other: Self) -> bool;
    /// The values as int16 when they are int16 samples (for the integer
    /// fast paths of the checks); `None` for f32.
    fn as_i16s(values: &[Self]) -> Option<&[i16]> {
        let _ = values;
        None
    }
}

impl RawSample for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn min_of(self, other: Self) -> Self {
        self.min(other)
    }
    fn max_of(self, other: Self) -> Self {
        self.max(other)
    }
    fn order(&self, other: &Self) -> std::cmp::Ordering {
        self.total_cmp(other)
    }
    #[allow(clippy::manual_range_contains)] // `&`, not `&&`: no branch
    fn code16_exact(self) -> (u16, bool) {
        // 1.5·2^23: adding it rounds any |v| < 2^22 to an integer held in
        // the low mantissa bits (two's complement), with no conversion.
        const M: f32 = 12_582_912.0;
        // Bits compared, so −0.0 (which comes back +0.0) is not exact; the
        // range test fails for NaN. No branch, so that blocks vectorise.
        let shifted = self + M;
        let exact =
            ((shifted - M).to_bits() == self.to_bits()) & (self >= -32_768.0) & (self <= 32_767.0);
        (shifted.to_bits() as u16, exact)
    }
    fn is_zero(self) -> bool {
        (self.to_bits() << 1) == 0
    }
    fn same_bits(self, other: Self) -> bool {
        self.to_bits() == other.to_bits()
    }
}

impl RawSample for i16 {
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    fn min_of(self, other: Self) -> Self {
        self.min(other)
    }
    fn max_of(self, other: Self) -> Self {
        self.max(other)
    }
    fn order(&self, other: &Self) -> std::cmp::Ordering {
        self.cmp(other)
    }
    fn code16_exact(self) -> (u16, bool) {
        (self as u16, true)
    }
    fn is_zero(self) -> bool {
        self == 0
    }
    fn same_bits(self, other: Self) -> bool {
        self == other
    }
    fn as_i16s(values: &[Self]) -> Option<&[i16]> {
        Some(values)
    }
}

/// A window's rows as one slice: `n_rows` rows of `n_cols` samples, row r at
/// `values[r·stride ..]` (an f32 window: `stride = n_cols`; an int16 window:
/// [`crate::recording::Raw16`]).
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a, T> {
    /// The values, rows of `stride`.
    pub values: &'a [T],
    /// Rows (sites).
    pub n_rows: usize,
    /// Samples per row.
    pub n_cols: usize,
    /// Values from one row's start to the next's.
    pub stride: usize,
}

impl<'a, T: RawSample> Rows<'a, T> {
    /// Row `r`.
    pub fn row(&self, r: usize) -> &[T] {
        &self.values[r * self.stride..r * self.stride + self.n_cols]
    }

    /// The rows of a window in standard layout (`None` otherwise).
    pub fn of_view(a: &'a ArrayView2<'a, T>) -> Option<Self> {
        let (n_rows, n_cols) = a.dim();
        Some(Rows {
            values: a.to_slice()?,
            n_rows,
            n_cols,
            stride: n_cols,
        })
    }
}

/// The stuck runs of one channel's row: maximal runs of at least `min_run`
/// identical values, equal to the row's largest or smallest value in
/// `row[lo..hi]` (the columns that hold real samples). A row that is constant
/// over `lo..hi` has no runs (it is reported as zero or flat, not clipped).
///
/// Returns half-open column ranges inside `lo..hi`, in order.
pub fn stuck_runs<T: RawSample>(
    row: &[T],
    lo: usize,
    hi: usize,
    min_run: usize,
) -> Vec<(usize, usize)> {
    let hi = hi.min(row.len());
    let cols = ScanColumns {
        lo: lo.min(hi),
        hi,
        own: (0, 0),
        min_run,
    };
    let mut scan = RowScan::new(cols, cols.lo);
    scan.feed(&row[cols.lo..hi]);
    scan.finish(row).0
}

/// The stuck runs ([`stuck_runs`]) of every row of a raw window, over the
/// columns `lo..hi` that hold real samples.
pub fn find_stuck_runs(
    window: &Array2<f32>,
    lo: usize,
    hi: usize,
    min_run: usize,
) -> Vec<Vec<(usize, usize)>> {
    let std = window.as_standard_layout();
    let view = std.view();
    let rows = Rows::of_view(&view).expect("standard layout");
    find_stuck_runs_rows(&rows, lo, hi, min_run)
}

/// [`find_stuck_runs`] over [`Rows`] of any sample type.
pub fn find_stuck_runs_rows<T: RawSample>(
    rows: &Rows<'_, T>,
    lo: usize,
    hi: usize,
    min_run: usize,
) -> Vec<Vec<(usize, usize)>> {
    use rayon::prelude::*;
    (0..rows.n_rows)
        .into_par_iter()
        .map(|r| stuck_runs(rows.row(r), lo, hi, min_run))
        .collect()
}

/// Replaces the stuck runs `runs` (from [`find_stuck_runs`]) of each row of a
/// raw window by the median of that row's other real samples (columns
/// `lo..hi`), so the filters see no step: a rail-to-rail step would otherwise
/// ring for milliseconds and, through the circular FFT high-pass, reappear at
/// the window's other end (BR-22). A run touching `lo` (or `hi`, when
/// `pad_repeats` says the columns past `hi` repeat the last sample) also fills
/// the repeated pad columns. A row with nothing but stuck samples is left alone.
pub fn fill_stuck_runs(
    window: &mut Array2<f32>,
    runs: &[Vec<(usize, usize)>],
    lo: usize,
    hi: usize,
    pad_repeats: bool,
) {
    if !window.is_standard_layout() {
        *window = window.as_standard_layout().into_owned();
    }
    let n = window.ncols();
    let values = window.as_slice_mut().expect("standard layout");
    fill_stuck_runs_rows(values, n, n, runs, lo, hi, pad_repeats);
}

/// [`fill_stuck_runs`] over rows of any sample type: row r of `n` samples at
/// `values[r·stride ..]`, one row per entry of `runs` (the median of integer
/// values is one of them, so int16 rows get the f32 rows' values).
pub fn fill_stuck_runs_rows<T: RawSample>(
    values: &mut [T],
    n: usize,
    stride: usize,
    runs: &[Vec<(usize, usize)>],
    lo: usize,
    hi: usize,
    pad_repeats: bool,
) {
    let n_rows = values.len().checked_div(stride).unwrap_or(0);
    for (r, runs) in runs.iter().enumerate().take(n_rows) {
        fill_row(
            &mut values[r * stride..r * stride + n],
            runs,
            lo,
            hi,
            pad_repeats,
        );
    }
}

/// [`fill_stuck_runs_rows`] on one row of `row.len()` samples.
fn fill_row<T: RawSample>(
    row: &mut [T],
    runs: &[(usize, usize)],
    lo: usize,
    hi: usize,
    pad_repeats: bool,
) {
    if runs.is_empty() {
        return;
    }
    let n = row.len();
    let mut rest: Vec<T> = Vec::with_capacity(hi.saturating_sub(lo));
    let mut k = 0;
    for (c, &v) in row.iter().enumerate().take(hi.min(n)).skip(lo) {
        while k < runs.len() && runs[k].1 <= c {
            k += 1;
        }
        if k < runs.len() && runs[k].0 <= c {
            continue;
        }
        rest.push(v);
    }
    if rest.is_empty() {
        return;
    }
    let mid = (rest.len() - 1) / 2;
    let (_, m, _) = rest.select_nth_unstable_by(mid, T::order);
    let fill = *m;
    for &(a, b) in runs {
        let a = if a == lo { 0 } else { a };
        let b = if b == hi && pad_repeats { n } else { b };
        row[a..b].fill(fill);
    }
}

/// [`find_stuck_runs`] then [`fill_stuck_runs`]; returns the runs found.
pub fn mask_stuck_runs(
    window: &mut Array2<f32>,
    lo: usize,
    hi: usize,
    pad_repeats: bool,
    min_run: usize,
) -> Vec<Vec<(usize, usize)>> {
    let runs = find_stuck_runs(window, lo, hi, min_run);
    fill_stuck_runs(window, &runs, lo, hi, pad_repeats);
    runs
}

/// Which columns of window i hold what: real samples `lo..hi` (the others
/// repeat an edge sample or are zero), own samples `own.0..own.1`, and
/// whether the columns past `hi` repeat the last sample (`pad_repeats`; not
/// for a single window, which Kilosort4 pads with zeros).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowColumns {
    /// First real column.
    pub lo: usize,
    /// End of the real columns.
    pub hi: usize,
    /// The own columns.
    pub own: (usize, usize),
    /// Whether the columns past `hi` repeat the last sample.
    pub pad_repeats: bool,
}

impl WindowColumns {
    /// The columns of window `i` of `plan`.
    pub fn of(plan: &crate::recording::WindowPlan, i: u64) -> Self {
        let s0 = plan.window_first_column(i);
        let limit = if plan.n_windows == 1 {
            plan.n_samples
        } else {
            plan.n_used
        } as i64;
        let n = plan.window_len() as i64;
        let lo = (-s0).clamp(0, n) as usize;
        let hi = (limit - s0).clamp(lo as i64, n) as usize;
        let nt = plan.nt as usize;
        WindowColumns {
            lo,
            hi,
            own: (nt, nt + plan.own_len(i) as usize),
            pad_repeats: plan.n_windows > 1,
        }
    }
}

/// The input checks of one window of a run, whichever form its samples are
/// in (f32 `data`, or the file's int16 values in `raw16`): the stuck runs of
/// every row over the real columns ([`find_stuck_runs`]), added with the own
/// columns to `health` when given, and filled when `mask`
/// ([`fill_stuck_runs`]), in one pass over the rows, parallel over rows.
/// Returns the runs.
pub fn check_window(
    w: &mut crate::recording::Window,
    cols: &WindowColumns,
    min_run: usize,
    health: Option<&mut ChannelHealth>,
    mask: bool,
) -> Vec<Vec<(usize, usize)>> {
    let steps = RowSteps {
        mask,
        observe: health.is_some(),
        jumps: false,
    };
    let c = check_any(w, cols, min_run, steps);
    if let Some(h) = health {
        h.merge(&c.health);
    }
    c.runs
}

/// [`check_window`] without a [`ChannelHealth`] (for windows checked on
/// several reading threads at once): the same stuck runs and masking, and
/// the window's channel facts, for [`ChannelHealth::merge`] in window order
/// (`precheck_window` then `merge` in window order give the same health as
/// `check_window` with the health).
pub fn precheck_window(
    w: &mut crate::recording::Window,
    cols: &WindowColumns,
    min_run: usize,
    mask: bool,
) -> (Vec<Vec<(usize, usize)>>, WindowHealth) {
    let steps = RowSteps {
        mask,
        observe: true,
        jumps: false,
    };
    let c = check_any(w, cols, min_run, steps);
    (c.runs, c.health)
}

/// [`precheck_window`] (its masking and channel facts, without the runs),
/// and then the window's transients common to most channels
/// ([`transients::find_transients`] on the values after the masking, `gap`
/// samples joining columns into one event), found row by row in the same
/// pass over the window: the same values, facts and events as
/// [`precheck_window`] followed by [`transients::find_transients`].
pub fn precheck_window_with_transients(
    w: &mut crate::recording::Window,
    cols: &WindowColumns,
    min_run: usize,
    mask: bool,
    gap: usize,
) -> (WindowHealth, Vec<(usize, usize)>) {
    let steps = RowSteps {
        mask,
        observe: true,
        jumps: true,
    };
    let c = check_any(w, cols, min_run, steps);
    let n_cols = match &w.raw16 {
        Some(raw) => raw.n_cols,
        None => w.data.ncols(),
    };
    let events = transients::events_of_rows(&c.jumps, n_cols, gap);
    (c.health, events)
}

/// Masks the stuck (clipped) stretches of a window as read, as
/// [`precheck_window_with_transients`] with `mask` does, and nothing else:
/// for a later pass over the windows the detection pass saw (the sort's
/// learned-template matching), so that it sees the same samples.
pub fn mask_stuck_window(w: &mut crate::recording::Window, cols: &WindowColumns, min_run: usize) {
    let steps = RowSteps {
        mask: true,
        observe: false,
        jumps: false,
    };
    check_any(w, cols, min_run, steps);
}

/// [`check_rows`] on the window's int16 values when it has them, else on
/// its f32 values.
fn check_any(
    w: &mut crate::recording::Window,
    cols: &WindowColumns,
    min_run: usize,
    steps: RowSteps,
) -> RowChecks {
    let first = w.first_sample;
    match w.raw16.as_mut() {
        Some(raw) => {
            let shape = (raw.n_rows, raw.n_cols, raw.stride);
            check_rows(raw.values_mut(), shape, first, cols, min_run, steps)
        }
        None => check_values(&mut w.data, first, cols, min_run, steps),
    }
}

/// [`check_window`] on an f32 window `n_sites × n_cols` whose column 0 holds
/// absolute sample `first_sample` (the whitening fit's windows).
pub fn check_array(
    window: &mut Array2<f32>,
    first_sample: i64,
    cols: &WindowColumns,
    min_run: usize,
    health: Option<&mut ChannelHealth>,
    mask: bool,
) -> Vec<Vec<(usize, usize)>> {
    let observe = health.is_some();
    let steps = RowSteps {
        mask,
        observe,
        jumps: false,
    };
    let c = check_values(window, first_sample, cols, min_run, steps);
    if let Some(h) = health {
        h.merge(&c.health);
    }
    c.runs
}

/// [`check_rows`] on an f32 window (made standard layout first).
fn check_values(
    window: &mut Array2<f32>,
    first_sample: i64,
    cols: &WindowColumns,
    min_run: usize,
    steps: RowSteps,
) -> RowChecks {
    if !window.is_standard_layout() {
        *window = window.as_standard_layout().into_owned();
    }
    let (n_rows, n_cols) = window.dim();
    let values = window.as_slice_mut().expect("standard layout");
    let shape = (n_rows, n_cols, n_cols);
    check_rows(values, shape, first_sample, cols, min_run, steps)
}

/// The checks of [`check_window`] on `n_rows` rows of `n_cols` samples at
/// `values[r·stride ..]`: per row, in parallel over rows, the stuck runs
/// ([`stuck_runs`]), then (with `observe`) the row's channel facts over the
/// own columns (on the values as read, [`RowWindow`]), then the filling of
/// its runs when `mask`, then (with `jumps`) the row's part of the
/// transient check on the filled row ([`transients::row_jumps`]). The same
/// runs, findings and values as [`find_stuck_runs_rows`],
/// [`ChannelHealth::observe_rows`] and [`fill_stuck_runs_rows`] one after
/// the other (each row's steps see only that row), in one pass over the
/// window instead of three.
fn check_rows<T: RawSample>(
    values: &mut [T],
    (n_rows, n_cols, stride): (usize, usize, usize),
    first_sample: i64,
    cols: &WindowColumns,
    min_run: usize,
    steps: RowSteps,
) -> RowChecks {
    use rayon::prelude::*;
    let RowSteps {
        mask,
        observe,
        jumps,
    } = steps;
    let (a, b) = (cols.own.0.min(n_cols), cols.own.1.min(n_cols));
    let observe = observe && b > a;
    let scan_cols = ScanColumns {
        lo: cols.lo.min(n_cols),
        hi: cols.hi.min(n_cols),
        own: if observe { (a, b) } else { (0, 0) },
        min_run,
    };
    let per_row: Vec<_> = values[..n_rows * stride]
        .par_chunks_mut(stride.max(1))
        .map(|row| {
            let row = &mut row[..n_cols];
            let mut scan = RowScan::new(scan_cols, scan_cols.first());
            scan.feed(&row[scan_cols.first()..scan_cols.end()]);
            let (runs, found) = scan.finish(row);
            let facts = observe
                .then(|| RowWindow::of_scan(found, row, (a, b), first_sample + a as i64, &runs));
            if mask {
                fill_row(row, &runs, cols.lo, cols.hi, cols.pad_repeats);
            }
            // While the row is in cache: its part of the transient check.
            let jumps = jumps.then(|| transients::row_jumps(row));
            (runs, facts, jumps)
        })
        .collect();
    let mut out = RowChecks {
        runs: Vec::with_capacity(n_rows),
        health: WindowHealth {
            rows: Vec::new(),
            samples: 0,
        },
        jumps: Vec::new(),
    };
    for (runs, facts, jumps) in per_row {
        out.runs.push(runs);
        out.health.rows.extend(facts);
        out.jumps.extend(jumps);
    }
    if !out.health.rows.is_empty() {
        out.health.samples = (b - a) as u64;
    }
    out
}

/// Which of [`check_rows`]'s steps run besides the stuck runs: the masking,
/// the channel facts, the rows' part of the transient check.
#[derive(Debug, Clone, Copy)]
struct RowSteps {
    mask: bool,
    observe: bool,
    jumps: bool,
}

/// What [`check_rows`] found: each row's stuck runs, the window's channel
/// facts, and (when asked) each row's part of the transient check.
struct RowChecks {
    runs: Vec<Vec<(usize, usize)>>,
    health: WindowHealth,
    jumps: Vec<transients::RowJumps>,
}

/// Per-channel facts gathered over the samples seen: all zero, constant,
/// identical to another channel, stuck runs.
#[derive(Debug, Clone)]
pub struct ChannelHealth {
    /// File column of each row (the probe's channel map).
    chan_map: Vec<u64>,
    rows: Vec<RowHealth>,
    /// Own samples seen per row.
    samples: u64,
}

/// Multiplier of the rows' FNV-style hash lanes.
const ROW_HASH_PRIME: u64 = 0x0100_0000_01b3;
/// Start of each hash lane.
const ROW_HASH_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// What one window's own samples of one row show, found without the run's
/// totals (so on any thread, windows in any order) and added to them by
/// [`RowHealth::merge`] in window order.
#[derive(Debug, Clone)]
struct RowWindow {
    any_nonzero: bool,
    /// The window's first own value.
    first: Option<f32>,
    /// Whether every own value has the bits of `first`.
    all_first: bool,
    /// The window's hash key ([`RowScan`]).
    hash: [u64; 4],
    stuck: u64,
    first_stuck: Option<(u64, f32)>,
}

impl RowWindow {
    /// The facts of `row`'s own columns `a..b` (absolute sample of column a:
    /// `first_own`), with its stuck runs.
    fn of<T: RawSample>(
        row: &[T],
        (a, b): (usize, usize),
        first_own: i64,
        runs: &[(usize, usize)],
    ) -> RowWindow {
        let cols = ScanColumns {
            lo: 0,
            hi: 0,
            own: (a, b),
            min_run: 1,
        };
        let mut scan = RowScan::new(cols, a);
        scan.feed(&row[a..b]);
        let (_, found) = scan.finish(row);
        RowWindow::of_scan(found, row, (a, b), first_own, runs)
    }

    /// [`RowWindow::of`] from a finished scan's facts.
    fn of_scan<T: RawSample>(
        found: RowFacts,
        row: &[T],
        (a, b): (usize, usize),
        first_own: i64,
        runs: &[(usize, usize)],
    ) -> RowWindow {
        let mut stuck = 0;
        let mut first_stuck = None;
        for &(s, e) in runs {
            let (s, e) = (s.max(a), e.min(b));
            if e > s {
                stuck += (e - s) as u64;
                if first_stuck.is_none() {
                    let t = first_own + (s - a) as i64;
                    first_stuck = Some((t.max(0) as u64, row[s].to_f32()));
                }
            }
        }
        RowWindow {
            any_nonzero: found.any_nonzero,
            first: (b > a).then(|| row[a].to_f32()),
            all_first: found.all_first,
            hash: found.key,
            stuck,
            first_stuck,
        }
    }
}

/// One window's channel facts, found on its own ([`precheck_window`]) for
/// [`ChannelHealth::merge`] in window order.
#[derive(Debug, Clone)]
pub struct WindowHealth {
    rows: Vec<RowWindow>,
    samples: u64,
}

/// What [`ChannelHealth`] knows about one row.
#[derive(Debug, Clone)]
struct RowHealth {
    zero: bool,
    first: Option<f32>,
    flat: bool,
    /// Four interleaved FNV-style lanes over the sample bits (independent
    /// chains, so the pass is not latency-bound).
    hash: [u64; 4],
    /// Stuck own samples.
    stuck: u64,
    /// First stuck own sample (absolute) and its value.
    first_stuck: Option<(u64, f32)>,
}

impl RowHealth {
    fn observe<T: RawSample>(
        &mut self,
        row: &[T],
        own: (usize, usize),
        first_own: i64,
        runs: &[(usize, usize)],
    ) {
        self.merge(&RowWindow::of(row, own, first_own, runs));
    }

    /// Adds one window's facts ([`RowWindow`]), windows in order.
    fn merge(&mut self, w: &RowWindow) {
        if w.any_nonzero {
            self.zero = false;
        }
        if let Some(f) = w.first {
            match self.first {
                None => self.first = Some(f),
                Some(g) if g.to_bits() != f.to_bits() => self.flat = false,
                Some(_) => {}
            }
            if !w.all_first {
                self.flat = false;
            }
        }
        // The window's lanes chained onto the run's: equal rows keep equal keys.
        for k in 0..4 {
            self.hash[k] = (self.hash[k] ^ w.hash[k]).wrapping_mul(ROW_HASH_PRIME);
        }
        self.stuck += w.stuck;
        if self.first_stuck.is_none() {
            self.first_stuck = w.first_stuck;
        }
    }

    fn key(&self) -> [u64; 4] {
        self.hash
    }
}

/// One finding of [`ChannelHealth`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ChannelFinding {
    /// File column (index in the raw file).
    pub channel: u64,
    /// Probe site (row in channel-map order).
    pub site: usize,
    /// `"zero"`, `"flat"`, `"duplicate"` or `"clipped"`.
    pub kind: &'static str,
    /// Details: the channel duplicated, the stuck value and sample counts.
    pub detail: String,
}

impl ChannelHealth {
    /// An empty check for the rows of `chan_map` (file columns).
    pub fn new(chan_map: &[u64]) -> Self {
        let row = RowHealth {
            zero: true,
            first: None,
            flat: true,
            hash: [ROW_HASH_BASIS; 4],
            stuck: 0,
            first_stuck: None,
        };
        ChannelHealth {
            chan_map: chan_map.to_vec(),
            rows: vec![row; chan_map.len()],
            samples: 0,
        }
    }

    /// Adds a raw window's own columns `own.0..own.1` (absolute sample of
    /// column 0: `first_sample`) and the stuck runs found in it (as returned by
    /// [`find_stuck_runs`], before masking). Rows run in parallel.
    pub fn observe(
        &mut self,
        raw: ArrayView2<'_, f32>,
        own: (usize, usize),
        first_sample: i64,
        runs: &[Vec<(usize, usize)>],
    ) {
        let std = raw.as_standard_layout();
        let view = std.view();
        let rows = Rows::of_view(&view).expect("standard layout");
        self.observe_rows(&rows, own, first_sample, runs);
    }

    /// [`ChannelHealth::observe`] over [`Rows`] of any sample type (the same
    /// findings for an int16 window as for its f32 values).
    pub fn observe_rows<T: RawSample>(
        &mut self,
        raw: &Rows<'_, T>,
        own: (usize, usize),
        first_sample: i64,
        runs: &[Vec<(usize, usize)>],
    ) {
        use rayon::prelude::*;
        let (a, b) = (own.0.min(raw.n_cols), own.1.min(raw.n_cols));
        if b <= a {
            return;
        }
        let none: Vec<(usize, usize)> = Vec::new();
        self.rows.par_iter_mut().enumerate().for_each(|(r, h)| {
            let row = raw.row(r);
            let rr = runs.get(r).unwrap_or(&none);
            h.observe(row, (a, b), first_sample + a as i64, rr);
        });
        self.samples += (b - a) as u64;
    }

    /// Adds one window's facts from [`precheck_window`]; windows in order.
    pub fn merge(&mut self, w: &WindowHealth) {
        debug_assert!(w.samples == 0 || w.rows.len() == self.rows.len());
        if w.samples == 0 || w.rows.len() != self.rows.len() {
            return;
        }
        for (h, r) in self.rows.iter_mut().zip(&w.rows) {
            h.merge(r);
        }
        self.samples += w.samples;
    }

    /// Own samples seen per channel.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Stuck (masked) own samples summed over channels.
    pub fn stuck_samples(&self) -> u64 {
        self.rows.iter().map(|r| r.stuck).sum()
    }

    /// The findings, by site: all-zero channels, constant channels, exact
    /// duplicates of an earlier channel, channels with stuck stretches.
    pub fn findings(&self) -> Vec<ChannelFinding> {
        let mut out = Vec::new();
        if self.samples == 0 {
            return out;
        }
        let mut seen: BTreeMap<[u64; 4], usize> = BTreeMap::new();
        for (r, h) in self.rows.iter().enumerate() {
            let ch = self.chan_map[r];
            if h.zero {
                out.push(ChannelFinding {
                    channel: ch,
                    site: r,
                    kind: "zero",
                    detail: "all samples are 0".into(),
                });
                continue;
            }
            if h.flat {
                out.push(ChannelFinding {
                    channel: ch,
                    site: r,
                    kind: "flat",
                    detail: format!("every sample is {}", h.first.unwrap_or(0.0)),
                });
                continue;
            }
            if let Some(&o) = seen.get(&h.key()) {
                out.push(ChannelFinding {
                    channel: ch,
                    site: r,
                    kind: "duplicate",
                    detail: format!("identical to ch{}", self.chan_map[o]),
                });
            } else {
                seen.insert(h.key(), r);
            }
            if h.stuck > 0 {
                let (t, v) = h.first_stuck.unwrap_or((0, 0.0));
                out.push(ChannelFinding {
                    channel: ch,
                    site: r,
                    kind: "clipped",
                    detail: format!("stuck at {v} for {} samples (first at sample {t})", h.stuck),
                });
            }
        }
        out
    }

    /// One warning line naming the unhealthy channels, or `None` when all are
    /// fine. `scope` says which samples were read (e.g. "the whole recording");
    /// `masked` whether stuck stretches are masked in this run.
    pub fn warning(&self, scope: &str, masked: bool) -> Option<String> {
        let f = self.findings();
        if f.is_empty() {
            return None;
        }
        // Channels with the same finding, several of them, in one item
        // ("ch0–ch63 (64 channels) zero (all samples are 0)").
        let mut items: Vec<(String, Vec<u64>)> = Vec::new();
        for x in &f {
            let what = format!("{} ({})", x.kind, x.detail);
            match items.iter_mut().find(|(w, _)| *w == what) {
                Some((_, chans)) => chans.push(x.channel),
                None => items.push((what, vec![x.channel])),
            }
        }
        let mut parts = Vec::new();
        for (what, chans) in &items {
            if chans.len() >= GROUPED_FINDINGS {
                let mut sorted = chans.clone();
                sorted.sort_unstable();
                parts.push(format!(
                    "{} ({} channels) {what}",
                    channel_ranges(&sorted),
                    chans.len()
                ));
            } else {
                parts.extend(chans.iter().map(|c| format!("ch{c} {what}")));
            }
        }
        let mut text = format!("channel check over {scope}: {}", parts.join("; "));
        if f.iter().any(|x| x.kind == "clipped") {
            text += if masked {
                "; stuck stretches are replaced by the channel's median before filtering (--mask-clipped false keeps them, as Kilosort4 does)"
            } else {
                "; stuck stretches are kept (--mask-clipped false): their steps ring through the high-pass and wrap around their windows as false spikes"
            };
        }
        let bad: Vec<String> = f
            .iter()
            .filter(|x| x.kind != "clipped")
            .map(|x| x.channel.to_string())
            .collect();
        if !bad.is_empty() && bad.len() == self.rows.len() {
            text += "; no channel is usable: check the file and --n-channels, --dtype and --offset";
        } else if !bad.is_empty() {
            text += &format!(
                "; leave bad channels out with --exclude-channels {}",
                bad.join(",")
            );
        }
        Some(text)
    }
}

/// Channels with one finding from which [`ChannelHealth::warning`] names them
/// as ranges in one item rather than one item each.
const GROUPED_FINDINGS: usize = 4;

/// `ch0–ch3, ch7, ch9–ch10` for ascending channel numbers.
fn channel_ranges(chans: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < chans.len() {
        let mut j = i;
        while j + 1 < chans.len() && chans[j + 1] == chans[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("ch{}–ch{}", chans[i], chans[j])
        } else {
            format!("ch{}", chans[i])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// Typical noise standard deviation spikecube rescales data to when the data's
/// scale is out of range (int16 counts of a Neuropixels recording), file units.
pub const TARGET_SD: f64 = 10.0;
/// Below this median channel sd (filtered, file units) the whitening
/// regulariser eps = 1e-6 is no longer negligible (it is then ≥ 1e-4 of the variance).
pub const MIN_SD: f64 = 0.1;
/// Above this median channel sd the data cannot be int16 counts.
pub const MAX_SD: f64 = 32_767.0;

/// The factor that brings data whose whitening covariance is `cc` (filtered,
/// file units²) back to int16-like scale, when its median channel variance
/// (over channels with any) is outside [`MIN_SD`]², [`MAX_SD`]²: the power of
/// ten nearest to [`TARGET_SD`] / median sd. Returns `(factor, median sd)`;
/// `None` when the scale is fine or no channel varies.
pub fn scale_factor(cc: &Array2<f64>) -> Option<(f64, f64)> {
    let mut v: Vec<f64> = cc.diag().iter().copied().filter(|v| *v > 0.0).collect();
    if v.is_empty() {
        return None;
    }
    let mid = (v.len() - 1) / 2;
    let (_, m, _) = v.select_nth_unstable_by(mid, f64::total_cmp);
    let sd = m.sqrt();
    if (MIN_SD..=MAX_SD).contains(&sd) {
        return None;
    }
    let k = 10f64.powi((TARGET_SD / sd).log10().round() as i32);
    Some((k, sd))
}

/// The message logged when [`scale_factor`] rescales.
pub fn scale_message(k: f64, sd: f64) -> String {
    let why = if sd < MIN_SD {
        format!(
            "far below int16 counts: the whitening regulariser eps = {WHITENING_EPS:e} would swamp the variance and nothing would be detected"
        )
    } else {
        "far above int16 counts".to_string()
    };
    format!(
        "the filtered channels have a median sd of {sd:.3e} file units, {why}; the data were multiplied by {k:e} before whitening (as --scale {k:e} would); give --scale yourself to choose the factor (--scale 1 keeps Kilosort4's behaviour)"
    )
}

/// A warning when the probe's coordinates look like millimetres: the median
/// distance from a site to its nearest other site is below 1 µm.
pub fn millimetre_warning(probe: &Probe) -> Option<String> {
    let n = probe.n_sites();
    if n < 2 {
        return None;
    }
    let mut nn: Vec<f32> = (0..n)
        .map(|i| {
            (0..n)
                .filter(|&k| k != i)
                .map(|k| {
                    let dx = probe.xc[k] - probe.xc[i];
                    let dy = probe.yc[k] - probe.yc[i];
                    (dx * dx + dy * dy).sqrt()
                })
                .fold(f32::INFINITY, f32::min)
        })
        .collect();
    let mid = (nn.len() - 1) / 2;
    let (_, m, _) = nn.select_nth_unstable_by(mid, f32::total_cmp);
    let m = *m;
    (m > 0.0 && m < 1.0).then(|| {
        format!(
            "probe {}: the sites are {m} apart (median nearest-site distance): the coordinates look like millimetres, read as µm; multiply them by 1000 in the probe file",
            probe.source.display()
        )
    })
}

/// Distance within which every site sees the same spike, µm.
pub const SAME_SPIKE_UM: f32 = 50.0;
/// Fewest sites for a median common reference that leaves spikes alone.
pub const MIN_CAR_SITES: usize = 8;

/// A warning when a median common reference (do_CAR) is taken over so few
/// sites, or over sites so close together, that it removes part of the spikes:
/// fewer than [`MIN_CAR_SITES`] sites, or one site with half the probe's sites
/// within [`SAME_SPIKE_UM`] (e.g. one tetrode, where every site sees every spike).
pub fn car_warning(probe: &Probe, do_car: bool) -> Option<String> {
    if !do_car {
        return None;
    }
    let n = probe.n_sites();
    let crowd = (0..n)
        .map(|i| {
            (0..n)
                .filter(|&k| {
                    let dx = probe.xc[k] - probe.xc[i];
                    let dy = probe.yc[k] - probe.yc[i];
                    (dx * dx + dy * dy).sqrt() <= SAME_SPIKE_UM
                })
                .count()
        })
        .max()
        .unwrap_or(0);
    if n >= MIN_CAR_SITES && 2 * crowd < n {
        return None;
    }
    let why = if 2 * crowd >= n {
        format!(
            "{crowd} of which lie within {SAME_SPIKE_UM} µm of one site and see the same spikes"
        )
    } else {
        format!("fewer than {MIN_CAR_SITES}: a spike seen on a few of them moves the median")
    };
    Some(format!(
        "the median common reference (do_CAR) is taken over {n} sites, {why}: it removes part of such spikes and can invert their sign; --do-car false turns it off"
    ))
}

/// A warning when the probe reads fewer of the file's channels than expected:
/// `expected_unused` channels (sync, LF) are normal.
pub fn unused_channels_warning(
    probe: &Probe,
    n_file_channels: usize,
    expected_unused: usize,
) -> Option<String> {
    let used = probe.n_sites();
    if used + expected_unused >= n_file_channels {
        return None;
    }
    let mut cols: Vec<u64> = probe.chan_map.clone();
    cols.sort_unstable();
    // Only the last column unread besides the expected ones (e.g. channels
    // excluded with --exclude-channels): the sync channel of a Neuropixels
    // file (385 columns, 384 sites) read as flat binary.
    let last = n_file_channels as u64 - 1;
    if used + expected_unused + 1 == n_file_channels && !cols.contains(&last) {
        return None;
    }
    let shown = if cols.len() > 12 {
        format!(
            "{} … {}",
            cols[..6]
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            cols[cols.len() - 3..]
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )
    } else {
        cols.iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    Some(format!(
        "the probe {} uses {used} of the file's {n_file_channels} channels (columns {shown}); {} not read — give a probe that covers them if they hold data",
        probe.source.display(),
        match n_file_channels - used {
            1 => "the other one is".to_string(),
            k => format!("the other {k} are"),
        }
    ))
}

/// Frames read by [`channel_count_warning`].
const LAYOUT_FRAMES: u64 = 4000;

/// Pearson correlation of the interleaved values `s[e]` and `s[e + lag]`,
/// averaged over the `n` column classes `e ≡ j (mod n)`.
fn lag_correlation(s: &[f32], n: usize, lag: usize) -> f64 {
    let mut total = 0.0;
    let mut classes = 0;
    for j in 0..n {
        let (mut sa, mut sb, mut saa, mut sbb, mut sab, mut m) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
        let mut e = j;
        while e + lag < s.len() {
            let (a, b) = (f64::from(s[e]), f64::from(s[e + lag]));
            sa += a;
            sb += b;
            saa += a * a;
            sbb += b * b;
            sab += a * b;
            m += 1.0;
            e += n;
        }
        if m < 2.0 {
            continue;
        }
        let va = saa - sa * sa / m;
        let vb = sbb - sb * sb / m;
        if va <= 0.0 || vb <= 0.0 {
            continue;
        }
        total += (sab - sa * sb / m) / (va * vb).sqrt();
        classes += 1;
    }
    if classes == 0 {
        0.0
    } else {
        total / classes as f64
    }
}

/// A warning when a flat binary file's channel count looks wrong: some value
/// lag L ≠ n in the interleaved file (L a divisor of n, or n ± 1) is far more
/// alike than a column with itself one frame later (lag n), which is where
/// the next sample of the same channel should be. "Far more": correlation
/// above 0.5 and 1 − r(L) < 0.8·(1 − r(n)). Reads the first 4000 frames.
///
/// # Errors
/// When the read fails.
pub fn channel_count_warning(rec: &dyn Recording) -> anyhow::Result<Option<String>> {
    let n = rec.n_channels();
    let frames = rec.n_samples().min(LAYOUT_FRAMES) as usize;
    if n < 2 || frames < 16 {
        return Ok(None);
    }
    let cols: Vec<u64> = (0..n as u64).collect();
    let mut rows = vec![0f32; n * frames];
    rec.read_channels(0, frames, &cols, &mut rows)?;
    let mut s = vec![0f32; n * frames];
    for c in 0..n {
        for t in 0..frames {
            s[t * n + c] = rows[c * frames + t];
        }
    }
    let r_frame = lag_correlation(&s, n, n);
    let mut lags: Vec<usize> = (1..n).filter(|&l| n.is_multiple_of(l)).collect();
    lags.extend([n - 1, n + 1]);
    lags.sort_unstable();
    lags.dedup();
    let best = lags
        .iter()
        .filter(|&&l| l >= 1 && l != n)
        .map(|&l| (l, lag_correlation(&s, n, l)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    Ok(best.and_then(|(l, r)| {
        (r > 0.5 && (1.0 - r) < 0.8 * (1.0 - r_frame)).then(|| {
            format!(
                "{}: read as {n} channels, but values {l} apart in the file are more alike (r = {r:.2}) than a channel with its own next sample {n} apart (r = {r_frame:.2}): the file probably has {l} channels, not {n}; check --n-channels",
                rec.describe()
            )
        })
    }))
}

/// Removes the sites that read file channels `exclude` from `probe`.
///
/// # Errors
/// When a listed channel is not read by the probe, or nothing would remain.
pub fn exclude_channels(probe: &Probe, exclude: &[u64]) -> anyhow::Result<Probe> {
    for &c in exclude {
        if !probe.chan_map.contains(&c) {
            anyhow::bail!(
                "--exclude-channels {c}: the probe {} reads no file channel {c} (it reads {} channels, {} … {})",
                probe.source.display(),
                probe.n_sites(),
                probe.chan_map.iter().min().copied().unwrap_or(0),
                probe.chan_map.iter().max().copied().unwrap_or(0)
            );
        }
    }
    let keep: Vec<usize> = (0..probe.n_sites())
        .filter(|&i| !exclude.contains(&probe.chan_map[i]))
        .collect();
    if keep.is_empty() {
        anyhow::bail!(
            "--exclude-channels removes every site of the probe {}",
            probe.source.display()
        );
    }
    Ok(Probe {
        xc: keep.iter().map(|&i| probe.xc[i]).collect(),
        yc: keep.iter().map(|&i| probe.yc[i]).collect(),
        kcoords: keep.iter().map(|&i| probe.kcoords[i]).collect(),
        chan_map: keep.iter().map(|&i| probe.chan_map[i]).collect(),
        n_chan: probe.n_chan,
        source: probe.source.clone(),
    })
}

/// One detection near a window boundary, for [`boundary_duplicates`].
#[derive(Debug, Clone, Copy)]
pub struct Near {
    /// Absolute sample.
    pub t: i64,
    /// Template centre.
    pub centre: u32,
    /// |amplitude|, whitened units.
    pub amp: f32,
}

/// Duplicate detections of one event on both sides of a window boundary
/// (BR-19). The detector zeroes a window's values outside its own samples, so
/// a detection within `nt0min` samples of the boundary had its ±`nt0min`
/// max-pool cut off there: it may be the rising or falling edge of an event
/// whose peak lies in the other window, which detects it too.
///
/// `left` holds detections of the earlier window, `right` of the later one
/// (absolute samples, boundary at `boundary`, the later window's first own
/// sample). A detection within `nt0min` samples of the boundary (left:
/// `t ≥ boundary − nt0min`; right: `t < boundary + nt0min`) is removed when a
/// detection on the other side lies within 2·`nt0min` samples of it, their
/// centres' neighbourhoods (iC sites) share a site, and the other one has the
/// larger |amplitude| (on a tie the left one is kept).
///
/// Returns the flags (true = remove) for `left` and `right`.
pub fn boundary_duplicates(
    left: &[Near],
    right: &[Near],
    boundary: i64,
    geometry: &Geometry,
    nt0min: usize,
) -> (Vec<bool>, Vec<bool>) {
    let h = nt0min as i64;
    let mut rl = vec![false; left.len()];
    let mut rr = vec![false; right.len()];
    let share = |a: u32, b: u32| {
        let ca = geometry.i_c.column(a as usize);
        let cb = geometry.i_c.column(b as usize);
        ca.iter().any(|x| cb.iter().any(|y| x == y))
    };
    for (i, a) in left.iter().enumerate() {
        for (k, b) in right.iter().enumerate() {
            if (a.t - b.t).abs() > 2 * h || !share(a.centre, b.centre) {
                continue;
            }
            if b.amp > a.amp {
                if a.t >= boundary - h {
                    rl[i] = true;
                }
            } else if b.t < boundary + h {
                rr[k] = true;
            }
        }
    }
    (rl, rr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stuck_runs_at_extremes_only() {
        let mut row = vec![1.0f32, -2.0, 3.0, 0.5];
        row.extend(std::iter::repeat_n(9.0, 10));
        row.extend([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]);
        // Ten 0.0s are not at an extreme: not stuck.
        assert_eq!(stuck_runs(&row, 0, row.len(), 8), vec![(4, 14)]);
        assert!(stuck_runs(&[5.0; 20], 0, 20, 8).is_empty());
        let mut w = Array2::from_shape_vec((1, row.len()), row.clone()).unwrap();
        let runs = mask_stuck_runs(&mut w, 0, row.len(), true, 8);
        assert_eq!(runs[0], vec![(4, 14)]);
        assert!(w.iter().all(|&v| v != 9.0));
    }

    #[test]
    fn channel_health_names_zero_flat_duplicate_and_stuck_channels() {
        let n = 200;
        let mut x = Array2::<f32>::zeros((5, n));
        for t in 0..n {
            let v = ((t * 37) % 23) as f32 - 11.0;
            x[(1, t)] = 7.0;
            x[(2, t)] = v;
            x[(3, t)] = v;
            x[(4, t)] = if (50..100).contains(&t) { 40.0 } else { -v };
        }
        let runs = find_stuck_runs(&x, 0, n, 8);
        assert_eq!(runs[4], vec![(50, 100)]);
        assert!(runs[..4].iter().all(Vec::is_empty));
        let mut h = ChannelHealth::new(&[10, 11, 12, 13, 14]);
        h.observe(x.view(), (0, n), 1000, &runs);
        let kinds: Vec<(u64, &str)> = h.findings().iter().map(|f| (f.channel, f.kind)).collect();
        assert_eq!(
            kinds,
            vec![
                (10, "zero"),
                (11, "flat"),
                (13, "duplicate"),
                (14, "clipped")
            ]
        );
        assert_eq!(h.stuck_samples(), 50);
        let w = h.warning("test", true).unwrap();
        assert!(w.contains("first at sample 1050"), "{w}");
        assert!(w.contains("--exclude-channels 10,11,13"), "{w}");
    }

    /// Many channels with one finding are named as ranges in one item; when
    /// no channel is usable, the warning says to check the file's layout
    /// instead of suggesting to exclude them all.
    #[test]
    fn many_bad_channels_are_grouped() {
        let n = 200;
        let mut x = Array2::<f32>::zeros((8, n));
        for t in 0..n {
            x[(6, t)] = 3.0;
        }
        let runs = find_stuck_runs(&x, 0, n, 8);
        let mut h = ChannelHealth::new(&[0, 1, 2, 3, 5, 6, 9, 4]);
        h.observe(x.view(), (0, n), 0, &runs);
        let w = h.warning("test", true).unwrap();
        assert!(
            w.contains("ch0–ch6 (7 channels) zero (all samples are 0); ch9 flat"),
            "{w}"
        );
        assert!(
            w.contains("no channel is usable") && !w.contains("--exclude-channels"),
            "{w}"
        );
        // One usable channel left: the exclusion is suggested.
        for t in 0..n {
            x[(7, t)] = ((t * 37) % 23) as f32;
        }
        let mut h = ChannelHealth::new(&[0, 1, 2, 3, 5, 6, 9, 4]);
        h.observe(x.view(), (0, n), 0, &runs);
        let w = h.warning("test", true).unwrap();
        assert!(w.contains("ch0–ch3, ch5–ch6 (6 channels) zero"), "{w}");
        assert!(w.contains("--exclude-channels 0,1,2,3,5,6,9"), "{w}");
    }

    /// An int16 window (rows longer than the samples) gets the same runs,
    /// findings, warning and masked values as its f32 values.
    #[test]
    fn int16_windows_are_checked_as_their_float_values() {
        let n = 301;
        let stride = n + 1;
        let mut x = Array2::<f32>::zeros((6, n));
        for t in 0..n {
            let v = ((t * 37) % 23) as f32 - 11.0;
            x[(1, t)] = 7.0;
            x[(2, t)] = v;
            x[(3, t)] = v;
            x[(4, t)] = if (50..100).contains(&t) { 40.0 } else { -v };
            x[(5, t)] = if (20..=280).contains(&t) {
                v * 3.0
            } else {
                -300.0
            };
        }
        let mut raw = vec![0i16; 6 * stride];
        for r in 0..6 {
            for t in 0..n {
                raw[r * stride + t] = x[(r, t)] as i16;
            }
        }
        let window =
            |data: Array2<f32>, raw16: Option<crate::recording::Raw16>| crate::recording::Window {
                index: 0,
                own_start: 10,
                own_len: 281,
                first_sample: 0,
                data,
                raw16,
            };
        let mut wf = window(x.clone(), None);
        let r16 = crate::recording::Raw16::new(6, n, stride, Box::new(raw)).unwrap();
        let mut wi = window(Array2::zeros((0, 0)), Some(r16));
        let cols = WindowColumns {
            lo: 0,
            hi: n,
            own: (10, 291),
            pad_repeats: true,
        };
        let chans = [10, 11, 12, 13, 14, 15];
        let (mut hf, mut hi) = (ChannelHealth::new(&chans), ChannelHealth::new(&chans));
        let rf = check_window(&mut wf, &cols, 8, Some(&mut hf), true);
        let ri = check_window(&mut wi, &cols, 8, Some(&mut hi), true);
        assert_eq!(rf, ri);
        assert_eq!(rf[4], vec![(50, 100)]);
        assert_eq!(rf[5], vec![(0, 20), (281, 301)]);
        assert_eq!(hf.findings(), hi.findings());
        assert_eq!(hf.warning("test", true), hi.warning("test", true));
        assert_eq!(wi.raw16.as_ref().unwrap().to_f32(), wf.data);
        assert_ne!(wf.data, x, "the stuck runs were filled");
    }

    /// The channel hash is the plain definition ([`RowScan`]): per window,
    /// the own samples cut into pieces of [`HASH_PIECE`]; the 16-bit codes of
    /// samples 4q..4q+3 of a piece as one word into lane q mod 4, each lane
    /// from the basis; each piece's lanes mixed with its index and length and
    /// summed into the window's key; each window's key then chained onto the
    /// run's; int16 and f32 rows alike (and f32 rows with values that are
    /// not int16 through the float lane), over several calls.
    #[test]
    fn row_hash_equals_the_definition() {
        const P: u64 = 0x0100_0000_01b3;
        const B: u64 = 0xcbf2_9ce4_8422_2325;
        fn mix(mut z: u64) -> u64 {
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn window_key(own: &[f32]) -> [u64; 4] {
            let mut win = [0u64; 4];
            for (index, piece) in own.chunks(HASH_PIECE).enumerate() {
                let mut lanes = [B; 4];
                let mut float = B;
                for (q, quad) in piece.chunks(4).enumerate() {
                    let mut word = 0u64;
                    for (k, &v) in quad.iter().enumerate() {
                        let j = 4 * q + k;
                        let code = if v == (v as i16) as f32 && v.to_bits() != (-0.0f32).to_bits() {
                            v as i16 as u16
                        } else {
                            float = (float ^ (u64::from(v.to_bits()) | (j as u64) << 32))
                                .wrapping_mul(P);
                            0x8000
                        };
                        word |= u64::from(code) << (16 * k);
                    }
                    lanes[q % 4] = (lanes[q % 4] ^ word).wrapping_mul(P);
                }
                let tag = mix(((index as u64) << 20) ^ piece.len() as u64);
                for k in 0..4 {
                    win[k] = win[k].wrapping_add(mix(lanes[k] ^ tag.rotate_left(16 * k as u32)));
                }
                win[0] = win[0].wrapping_add(mix(float ^ !tag));
            }
            win
        }
        let mut want = [B; 4];
        let mut want_f = [B; 4];
        let mut row = ChannelHealth::new(&[0]).rows.remove(0);
        let mut row16 = row.clone();
        let mut rowf = row.clone();
        for (call, len) in [
            0usize, 1, 3, 4, 63, 64, 65, 131, 256, 1001, 1024, 1025, 2500,
        ]
        .into_iter()
        .enumerate()
        {
            let own: Vec<i16> = (0..len)
                .map(|j| ((j * 7919 + call * 104_729) % 65_536) as u16 as i16)
                .collect();
            let own32: Vec<f32> = own.iter().map(|&v| f32::from(v)).collect();
            // Some values that are not int16: fractions, −0.0, out of range.
            let mut fl = own32.clone();
            for (j, v) in fl.iter_mut().enumerate() {
                match j % 37 {
                    5 => *v += 0.5,
                    11 => *v = -0.0,
                    23 => *v = 40_000.0,
                    _ => {}
                }
            }
            let win = window_key(&own32);
            let win_f = window_key(&fl);
            for k in 0..4 {
                want[k] = (want[k] ^ win[k]).wrapping_mul(P);
                want_f[k] = (want_f[k] ^ win_f[k]).wrapping_mul(P);
            }
            row.observe(&own32, (0, len), 0, &[]);
            row16.observe(&own, (0, len), 0, &[]);
            rowf.observe(&fl, (0, len), 0, &[]);
            assert_eq!(row.hash, want, "f32, call {call}, {len} samples");
            assert_eq!(row16.hash, want, "int16, call {call}, {len} samples");
            assert_eq!(
                rowf.hash, want_f,
                "f32 not int16, call {call}, {len} samples"
            );
        }
    }

    /// A raw window as a reader gives it: real columns `lo..hi` with rows
    /// that are noisy, zero, flat, duplicated, stuck at an extreme at the
    /// real columns' ends and inside (runs across the own columns' edges),
    /// entirely stuck; the other columns repeat the edge samples (zero past
    /// `hi` when the pad does not repeat).
    fn raw_window(n_rows: usize, cols: &WindowColumns, n: usize, seed: u64) -> Array2<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let (lo, hi) = (cols.lo, cols.hi);
        let mut x = Array2::<f32>::zeros((n_rows, n));
        for r in 0..n_rows {
            for c in lo..hi {
                x[(r, c)] = match r {
                    0 => 0.0,
                    1 => -3.0,
                    2 | 3 => ((c * 7919 + seed as usize) % 41) as f32 - 20.0,
                    _ => (next() % 61) as f32 - 30.0,
                };
            }
            let mut stick = |a: usize, b: usize, v: f32| {
                for c in a.max(lo)..b.min(hi) {
                    x[(r, c)] = v;
                }
            };
            match r {
                4 => stick(lo, lo + 9 + (seed as usize % 5), 90.0),
                5 => stick(hi.saturating_sub(12), hi, -90.0),
                6 => {
                    stick(cols.own.0 - 3, cols.own.0 + 20, 77.0);
                    stick(cols.own.1 - 8, cols.own.1 + 9, -77.0);
                }
                7 => stick(lo, hi, 5.0),
                8 => stick(lo + 40, lo + 46, 99.0), // too short to count
                _ => {}
            }
            for c in 0..lo {
                x[(r, c)] = x[(r, lo)];
            }
            for c in hi..n {
                x[(r, c)] = if cols.pad_repeats {
                    x[(r, hi - 1)]
                } else {
                    0.0
                };
            }
        }
        x
    }

    /// The transients found row by row in the checks' pass
    /// ([`precheck_window_with_transients`]) are those of
    /// [`transients::find_transients`] on the window after
    /// [`precheck_window`] (masked or not), with the same runs and facts, for
    /// f32 windows and int16 rows longer than the samples.
    #[test]
    fn transients_in_the_checks_pass_equal_the_separate_check() {
        let (n_rows, n, stride, min_run, gap) = (20, 3001, 3005, 8, 30);
        let cols = WindowColumns {
            lo: 0,
            hi: n,
            own: (61, n - 61),
            pad_repeats: true,
        };
        let mut s = 7u64;
        let mut x = Array2::<f32>::zeros((n_rows, n));
        for r in 0..n_rows {
            for c in 0..n {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let step = if r < 15 && c >= 1700 {
                    400.0 + 31.0 * r as f32
                } else {
                    0.0
                };
                let half = if r < 9 && c >= 900 { 500.0 } else { 0.0 };
                x[(r, c)] = ((s >> 40) % 41) as f32 - 20.0 + step + half;
            }
        }
        for c in 200..260 {
            x[(2, c)] = 3000.0; // a stuck run, then masked
        }
        for mask in [false, true] {
            for int16 in [false, true] {
                let make = || {
                    let raw16 = int16.then(|| {
                        let mut raw = vec![-1i16; n_rows * stride];
                        for r in 0..n_rows {
                            for c in 0..n {
                                raw[r * stride + c] = x[(r, c)] as i16;
                            }
                        }
                        crate::recording::Raw16::new(n_rows, n, stride, Box::new(raw)).unwrap()
                    });
                    crate::recording::Window {
                        index: 0,
                        own_start: 61,
                        own_len: (n - 122) as u64,
                        first_sample: 0,
                        data: if int16 {
                            Array2::zeros((0, 0))
                        } else {
                            x.clone()
                        },
                        raw16,
                    }
                };
                let mut a = make();
                let (runs, facts) = precheck_window(&mut a, &cols, min_run, mask);
                let want = match &a.raw16 {
                    Some(raw) => transients::find_transients(
                        raw.values(),
                        (raw.n_rows, raw.n_cols, raw.stride),
                        gap,
                    ),
                    None => {
                        transients::find_transients(a.data.as_slice().unwrap(), (n_rows, n, n), gap)
                    }
                };
                assert_eq!(want, vec![(1700, 1701)], "mask {mask}, int16 {int16}");
                let mut b = make();
                let (facts_b, events) =
                    precheck_window_with_transients(&mut b, &cols, min_run, mask, gap);
                let values = |w: &crate::recording::Window| match &w.raw16 {
                    Some(raw) => raw.to_f32(),
                    None => w.data.clone(),
                };
                assert_eq!(values(&b), values(&a), "mask {mask}, int16 {int16}");
                assert!(runs[2].contains(&(200, 260)), "{:?}", runs[2]);
                assert_eq!(format!("{facts_b:?}"), format!("{facts:?}"));
                assert_eq!(events, want, "mask {mask}, int16 {int16}");
            }
        }
    }

    /// The one-pass checks ([`check_window`], [`check_array`]) give the runs,
    /// channel health (every row's state, over several windows) and masked
    /// values of the three separate steps, for f32 windows and for int16 rows
    /// longer than the samples; first and last windows (edge padding), a
    /// single window (zero pad), masking on and off.
    #[test]
    fn one_pass_checks_equal_the_separate_steps() {
        let (n_rows, n, min_run) = (12, 517, 8);
        let stride = n + 3;
        let chans: Vec<u64> = (0..n_rows as u64).map(|c| 100 + c).collect();
        let windows = [
            WindowColumns {
                lo: 11,
                hi: n,
                own: (11, 506),
                pad_repeats: true,
            },
            WindowColumns {
                lo: 0,
                hi: n,
                own: (11, 506),
                pad_repeats: true,
            },
            WindowColumns {
                lo: 0,
                hi: 300,
                own: (11, 300),
                pad_repeats: true,
            },
            WindowColumns {
                lo: 11,
                hi: 250,
                own: (11, 250),
                pad_repeats: false,
            },
        ];
        for mask in [false, true] {
            let mut h_ref = ChannelHealth::new(&chans);
            let mut h_f32 = ChannelHealth::new(&chans);
            let mut h_i16 = ChannelHealth::new(&chans);
            // Windows checked on their own (precheck_window), merged in order.
            let mut h_pre = ChannelHealth::new(&chans);
            let mut h_pre16 = ChannelHealth::new(&chans);
            for (k, cols) in windows.iter().enumerate() {
                let x = raw_window(n_rows, cols, n, k as u64 + 1);
                let first = 1000 * k as i64 - 11;
                let mut want = x.clone();
                let runs = find_stuck_runs(&want, cols.lo, cols.hi, min_run);
                h_ref.observe(want.view(), cols.own, first, &runs);
                if mask {
                    fill_stuck_runs(&mut want, &runs, cols.lo, cols.hi, cols.pad_repeats);
                }
                assert!(runs.iter().any(|r| !r.is_empty()), "window {k} has runs");
                let mut got = x.clone();
                let got_runs = check_array(&mut got, first, cols, min_run, Some(&mut h_f32), mask);
                assert_eq!(got_runs, runs, "window {k}");
                assert_eq!(got, want, "window {k}, mask {mask}");
                let mut raw = vec![-1i16; n_rows * stride];
                for r in 0..n_rows {
                    for c in 0..n {
                        raw[r * stride + c] = x[(r, c)] as i16;
                    }
                }
                let window = |data: Array2<f32>, raw16: Option<crate::recording::Raw16>| {
                    crate::recording::Window {
                        index: k as u64,
                        own_start: (first + 11) as u64,
                        own_len: (cols.own.1 - cols.own.0) as u64,
                        first_sample: first,
                        data,
                        raw16,
                    }
                };
                let mut wp = window(x.clone(), None);
                let (pre_runs, facts) = precheck_window(&mut wp, cols, min_run, mask);
                assert_eq!(pre_runs, runs, "window {k}, on its own");
                assert_eq!(wp.data, want, "window {k}, on its own, mask {mask}");
                h_pre.merge(&facts);
                let r16 = |raw: &Vec<i16>| {
                    crate::recording::Raw16::new(n_rows, n, stride, Box::new(raw.clone())).unwrap()
                };
                let mut wp16 = window(Array2::zeros((0, 0)), Some(r16(&raw)));
                let (pre_runs, facts) = precheck_window(&mut wp16, cols, min_run, mask);
                assert_eq!(pre_runs, runs, "window {k}, int16, on its own");
                assert_eq!(
                    wp16.raw16.unwrap().to_f32(),
                    want,
                    "window {k}, int16, on its own"
                );
                h_pre16.merge(&facts);
                let mut w = window(Array2::zeros((0, 0)), Some(r16(&raw)));
                let got_runs = check_window(&mut w, cols, min_run, Some(&mut h_i16), mask);
                assert_eq!(got_runs, runs, "window {k}, int16");
                let r16 = w.raw16.unwrap();
                assert_eq!(r16.to_f32(), want, "window {k}, int16, mask {mask}");
                for r in 0..n_rows {
                    let pad = &r16.values()[r * stride + n..(r + 1) * stride];
                    assert_eq!(pad, &[-1, -1, -1], "the row ends are left alone");
                }
            }
            let state = |h: &ChannelHealth| format!("{h:?}");
            assert_eq!(state(&h_f32), state(&h_ref));
            assert_eq!(state(&h_i16), state(&h_ref));
            assert_eq!(state(&h_pre), state(&h_ref));
            assert_eq!(state(&h_pre16), state(&h_ref));
            let kinds: Vec<&str> = h_ref.findings().iter().map(|f| f.kind).collect();
            assert_eq!(
                kinds,
                [
                    "zero",
                    "flat",
                    "duplicate",
                    "clipped",
                    "clipped",
                    "clipped",
                    "flat"
                ]
            );
        }
    }

    /// The plain definition: maximal runs of ≥ min_run equal values at an extreme.
    pub(super) fn naive<T: RawSample>(row: &[T], min_run: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let Some(&first) = row.first() else {
            return out;
        };
        let mn = row.iter().fold(first, |m, &v| m.min_of(v));
        let mx = row.iter().fold(first, |m, &v| m.max_of(v));
        if mn == mx {
            return out;
        }
        let mut i = 0;
        while i < row.len() {
            let mut e = i + 1;
            while e < row.len() && row[e] == row[i] {
                e += 1;
            }
            if e - i >= min_run && (row[i] == mn || row[i] == mx) {
                out.push((i, e));
            }
            i = e;
        }
        out
    }

    #[test]
    fn strided_run_search_equals_the_definition() {
        let mut s = 7u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for case in 0..400 {
            let n = 50 + (next() % 400) as usize;
            let levels = 2 + next() % 6;
            let mut row: Vec<f32> = (0..n).map(|_| (next() % levels) as f32).collect();
            for _ in 0..(next() % 4) {
                let a = (next() % n as u64) as usize;
                let len = (next() % 60) as usize;
                let v = [-5.0, 99.0, 1.0][(next() % 3) as usize];
                for x in row.iter_mut().skip(a).take(len) {
                    *x = v;
                }
            }
            for min_run in [8, 9, 30, 31] {
                assert_eq!(
                    stuck_runs(&row, 0, n, min_run),
                    naive(&row, min_run),
                    "case {case}, min_run {min_run}"
                );
            }
        }
    }

    /// A Neuropixels file read as flat binary (385 columns, 384 sites, the
    /// sync word last) gets no warning; one other unread column does, in the
    /// singular.
    #[test]
    fn unused_channels_spare_the_sync_column() {
        let probe = |chan_map: Vec<u64>| Probe {
            xc: vec![0.0; chan_map.len()],
            yc: (0..chan_map.len()).map(|i| i as f32 * 15.0).collect(),
            kcoords: vec![0; chan_map.len()],
            n_chan: 385,
            chan_map,
            source: "p.json".into(),
        };
        assert!(unused_channels_warning(&probe((0..384).collect()), 385, 0).is_none());
        // Two sites excluded (expected unused) and the sync column unread.
        let excluded: Vec<u64> = (0..384).filter(|&c| c != 3 && c != 7).collect();
        assert!(unused_channels_warning(&probe(excluded.clone()), 385, 2).is_none());
        assert!(unused_channels_warning(&probe(excluded), 385, 1).is_some());
        let w = unused_channels_warning(&probe((1..385).collect()), 385, 0).unwrap();
        assert!(w.contains("the other one is not read"), "{w}");
        let w = unused_channels_warning(&probe((0..383).collect()), 385, 0).unwrap();
        assert!(w.contains("the other 2 are not read"), "{w}");
    }

    #[test]
    fn scale_factor_regimes() {
        let cc = |v: f64| Array2::from_diag(&ndarray::arr1(&[v, v, v]));
        assert!(scale_factor(&cc(100.0)).is_none());
        assert!(scale_factor(&cc(3.8)).is_none());
        let (k, _) = scale_factor(&cc(3.8e-12)).unwrap();
        assert_eq!(k, 1e7);
        let (k, _) = scale_factor(&cc(1e12)).unwrap();
        assert!((k / 1e-5 - 1.0).abs() < 1e-12);
    }
}
