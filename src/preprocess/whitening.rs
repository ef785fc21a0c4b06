//! Kilosort4's whitening: the covariance of some preprocessed windows
//! (`preprocessing.get_whitening_matrix`), the local ZCA per channel
//! (`whitening_local`, `whitening_from_covariance`) and its application
//! `X ← W·X` (spec section 5 and step 6 of section 4).

use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par, Side};
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis};
use rayon::prelude::*;

use crate::error::PreprocessError;
use crate::probe::Probe;

use super::car::{common_reference, ensure_standard, invert_sign};
use super::covariance::{self, GramScratch};
use super::highpass::{HighpassFilter, highpass_kernel};
use super::{PreprocessSettings, exceeds_artifact_threshold};

/// Regulariser added to each eigenvalue before the inverse square root
/// (Kilosort4's fixed `eps`, counts²).
pub const WHITENING_EPS: f64 = 1e-6;

/// The windows whose covariance Kilosort4 averages: `0, nskip, 2·nskip, …`
/// below `n_windows − 1` (the last window never enters).
///
/// Kilosort itself fails on a 1-window recording (its average is 0/0); here
/// that case returns `[0]`, so the only window is used. `n_windows` = 0 gives
/// an empty list; `nskip` = 0 is treated as 1.
pub fn covariance_windows(n_windows: u64, nskip: u64) -> Vec<u64> {
    match n_windows {
        0 => Vec::new(),
        1 => vec![0],
        _ => (0..n_windows - 1).step_by(nskip.max(1) as usize).collect(),
    }
}

/// The `whitening_range` nearest sites of every site, nearest first, as
/// Kilosort4's `whitening_local` picks them: squared distances computed in f32
/// from `xc`, `yc` (µm), ascending. The site itself always comes first; other
/// ties are broken by site index (numpy's unstable sort may order exact ties
/// differently, which only changes rounding unless they straddle the cut).
///
/// Returns one list of `min(whitening_range, n_sites)` site indices per site.
pub fn whitening_neighbours(probe: &Probe, whitening_range: usize) -> Vec<Vec<usize>> {
    let n = probe.n_sites();
    let m = whitening_range.min(n);
    (0..n)
        .map(|j| {
            let (xj, yj) = (probe.xc[j], probe.yc[j]);
            let d2: Vec<f32> = (0..n)
                .map(|k| {
                    let dx = probe.xc[k] - xj;
                    let dy = probe.yc[k] - yj;
                    dx * dx + dy * dy
                })
                .collect();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| {
                d2[a]
                    .total_cmp(&d2[b])
                    .then((a != j).cmp(&(b != j)))
                    .then(a.cmp(&b))
            });
            order.truncate(m);
            order
        })
        .collect()
}

/// Symmetric inverse square root E·diag(1/√(|λ| + eps))·Eᵀ of a symmetric
/// matrix, from its eigen-decomposition. Using |λ| makes it equal to the
/// SVD-based form Kilosort uses, also for tiny negative rounding eigenvalues.
fn zca(sub: MatRef<'_, f64>, channel: usize) -> Result<Mat<f64>, PreprocessError> {
    let m = sub.nrows();
    let evd = sub
        .self_adjoint_eigen(Side::Lower)
        .map_err(|_| PreprocessError::Eigen { channel, size: m })?;
    let u = evd.U();
    let s = evd.S().column_vector();
    let scaled = Mat::<f64>::from_fn(m, m, |i, q| u[(i, q)] / (s[q].abs() + WHITENING_EPS).sqrt());
    let mut out = Mat::<f64>::zeros(m, m);
    matmul(
        out.as_mut(),
        Accum::Replace,
        scaled.as_ref(),
        u.transpose(),
        1.0,
        Par::Seq,
    );
    Ok(out)
}

/// Kilosort4's local whitening matrix from a covariance (`whitening_local`).
///
/// `cc`: (C × C) covariance of the preprocessed channels, counts² (f64);
/// `probe`: C sites in the same order. For each channel j it takes the
/// `whitening_range` nearest sites ([`whitening_neighbours`], j first), the
/// ZCA matrix E·diag(1/√(D + 1e-6))·Eᵀ of the covariance restricted to them,
/// and writes that matrix's row for j into row j of W at those columns; every
/// other entry of row j is 0. When the range covers every site, all rows come
/// from one global ZCA matrix (computed once).
///
/// Returns W, (C × C) f32; whitened data is `W·X`.
///
/// # Errors
/// [`PreprocessError::Shape`] if `cc` is not C × C, [`PreprocessError::Setting`]
/// if `whitening_range` is 0, [`PreprocessError::NonFiniteCovariance`] for a NaN
/// or infinite entry, [`PreprocessError::Eigen`] if a decomposition fails.
pub fn whitening_from_covariance(
    cc: &Array2<f64>,
    probe: &Probe,
    whitening_range: usize,
) -> Result<Array2<f32>, PreprocessError> {
    let c = probe.n_sites();
    if cc.dim() != (c, c) {
        return Err(PreprocessError::Shape {
            what: "whitening covariance",
            rows: cc.nrows(),
            cols: cc.ncols(),
            expected_rows: c,
            expected_cols: c,
        });
    }
    if whitening_range == 0 {
        return Err(PreprocessError::Setting {
            name: "whitening_range",
            message: "is 0; it must be at least 1 (Kilosort's default is 32)".into(),
        });
    }
    if let Some(((row, col), &value)) = cc.indexed_iter().find(|(_, v)| !v.is_finite()) {
        return Err(PreprocessError::NonFiniteCovariance { row, col, value });
    }
    let neighbours = whitening_neighbours(probe, whitening_range);
    let mut w = Array2::<f32>::zeros((c, c));
    if whitening_range >= c {
        let full = Mat::<f64>::from_fn(c, c, |i, k| cc[(i, k)]);
        let z = zca(full.as_ref(), 0)?;
        for j in 0..c {
            for k in 0..c {
                w[(j, k)] = z[(j, k)] as f32;
            }
        }
        return Ok(w);
    }
    let rows: Vec<Result<Vec<f64>, PreprocessError>> = neighbours
        .par_iter()
        .enumerate()
        .map(|(j, ix)| {
            let m = ix.len();
            let sub = Mat::<f64>::from_fn(m, m, |a, b| cc[(ix[a], ix[b])]);
            let z = zca(sub.as_ref(), j)?;
            Ok((0..m).map(|l| z[(0, l)]).collect())
        })
        .collect();
    for (j, (row, ix)) in rows.into_iter().zip(&neighbours).enumerate() {
        let row = row?;
        for (l, &k) in ix.iter().enumerate() {
            w[(j, k)] = row[l] as f32;
        }
    }
    Ok(w)
}

/// Adds `X·Xᵀ / ncols` of a (C × T) block to `cc` (f64), the per-window term of
/// Kilosort4's whitening covariance.
///
/// The product is f64 (each f32 value converted exactly), in the order of
/// faer's full product over chunks of 4096 columns
/// ([`accumulate_covariance_plain`]); on x86-64 with FMA it is computed as the
/// same sums over 512-column blocks, lower triangle only, blocks in parallel
/// (the bits do not change, nor depend on the thread count; see
/// `src/preprocess/covariance.rs`).
///
/// # Errors
/// [`PreprocessError::Shape`] if `cc` is not C × C.
pub fn accumulate_covariance(
    cc: &mut Array2<f64>,
    block: ndarray::ArrayView2<'_, f32>,
) -> Result<(), PreprocessError> {
    WindowSum::new(true).add(cc, block, &mut FitTimes::default())
}

/// As [`accumulate_covariance`], always with the plain product: one faer
/// `X·Xᵀ` (all threads) per 4096 columns converted to f64: the simple form,
/// kept to check the fast form's bits and for the benchmark.
///
/// # Errors
/// As [`accumulate_covariance`].
pub fn accumulate_covariance_plain(
    cc: &mut Array2<f64>,
    block: ndarray::ArrayView2<'_, f32>,
) -> Result<(), PreprocessError> {
    WindowSum::new(false).add(cc, block, &mut FitTimes::default())
}

/// Adds windows' terms `X·Xᵀ / T` to a covariance, buffers kept between windows.
struct WindowSum {
    /// [`covariance::gram`] (fast when it keeps the bits) or always the plain product.
    fast: bool,
    /// The window's `X·Xᵀ`, C × C column-major.
    acc: Vec<f64>,
    scratch: GramScratch,
}

impl WindowSum {
    fn new(fast: bool) -> Self {
        WindowSum {
            fast,
            acc: Vec::new(),
            scratch: GramScratch::default(),
        }
    }

    /// `cc += X·Xᵀ / T` for the (C × T) `block` (`product` and `sum` in `times`).
    fn add(
        &mut self,
        cc: &mut Array2<f64>,
        block: ndarray::ArrayView2<'_, f32>,
        times: &mut FitTimes,
    ) -> Result<(), PreprocessError> {
        let (c, t) = block.dim();
        if cc.dim() != (c, c) {
            return Err(PreprocessError::Shape {
                what: "whitening covariance accumulator",
                rows: cc.nrows(),
                cols: cc.ncols(),
                expected_rows: c,
                expected_cols: c,
            });
        }
        if t == 0 {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        if self.fast {
            covariance::gram(block, &mut self.acc, &mut self.scratch);
        } else {
            covariance::gram_reference(block, &mut self.acc);
        }
        let t0 = times.lap("product", t0);
        // Scaled once by 1/T, entry by entry.
        let inv_t = 1.0 / t as f64;
        for i in 0..c {
            for k in 0..c {
                cc[(i, k)] += self.acc[k * c + i] * inv_t;
            }
        }
        times.lap("sum", t0);
        Ok(())
    }
}

/// Fits Kilosort4's whitening matrix (`get_whitening_matrix`, spec section 5),
/// independently of how the recording is read.
///
/// * `n_windows`: number of windows (batches) in the recording, as Kilosort
///   counts them.
/// * `read_raw_window(i)`: window i as raw values, f32 (C × N) with
///   N = `batch_size + 2·nt`, rows = probe sites in chanMap order, padded as
///   Kilosort pads (dtype conversion, `shift`/`scale` already applied; no
///   inversion, mean removal or filtering).
///
/// The windows of [`covariance_windows`]`(n_windows, nskip)` are read; each is
/// inverted if `invert_sign`, mean-removed and median-referenced (`do_CAR`),
/// high-passed, zeroed if it reaches `artifact_threshold`, cut to its NT
/// central columns, and enters the mean of `X·Xᵀ/NT` (accumulated in f64).
/// The matrix then comes from [`whitening_from_covariance`].
///
/// A 1-window recording (where Kilosort divides 0 by 0 and fails) uses its
/// only window and logs it (info).
///
/// Returns W, (C × C) f32.
///
/// # Errors
/// Whatever `read_raw_window` returns; [`PreprocessError`] (converted into
/// `E`) for invalid settings, 0 windows, a window of the wrong shape, a probe
/// with no sites, or a failed decomposition.
pub fn fit_whitening<E, F>(
    n_windows: u64,
    read_raw_window: F,
    probe: &Probe,
    settings: &PreprocessSettings,
) -> Result<Array2<f32>, E>
where
    F: FnMut(u64) -> Result<Array2<f32>, E> + Send,
    E: From<PreprocessError> + Send,
{
    let cc = whitening_covariance(n_windows, read_raw_window, probe, settings)?;
    Ok(whitening_from_covariance(
        &cc,
        probe,
        settings.whitening_range,
    )?)
}

/// The covariance [`fit_whitening`] turns into W: the mean of `X·Xᵀ/NT` over
/// the windows of [`covariance_windows`], each preprocessed as described
/// there. (C × C), f64, file units² (after `shift`/`scale`).
///
/// # Errors
/// As [`fit_whitening`], except for the decomposition.
pub fn whitening_covariance<E, F>(
    n_windows: u64,
    read_raw_window: F,
    probe: &Probe,
    settings: &PreprocessSettings,
) -> Result<Array2<f64>, E>
where
    F: FnMut(u64) -> Result<Array2<f32>, E> + Send,
    E: From<PreprocessError> + Send,
{
    whitening_covariance_timed(
        n_windows,
        read_raw_window,
        probe,
        settings,
        &mut FitTimes::default(),
    )
}

/// Busy seconds of the whitening fit's parts, summed over its windows, by
/// name: `read` (the caller's `read_raw_window`, with its checks), `invert`,
/// `car`, `highpass`, `artifact`, `product` (`X·Xᵀ` with the f64 copy) and
/// `sum` (adding the window's term). Parts overlap in time: reading runs on
/// its own thread, and a window's product runs beside the next window's
/// preprocessing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FitTimes(pub std::collections::BTreeMap<&'static str, f64>);

impl FitTimes {
    /// Adds `seconds` to `part`.
    pub fn add(&mut self, part: &'static str, seconds: f64) {
        *self.0.entry(part).or_insert(0.0) += seconds;
    }

    /// Adds the seconds since `since` to `part`; returns now.
    pub fn lap(&mut self, part: &'static str, since: std::time::Instant) -> std::time::Instant {
        let now = std::time::Instant::now();
        self.add(part, (now - since).as_secs_f64());
        now
    }

    /// Adds every part of `other`.
    pub fn merge(&mut self, other: &FitTimes) {
        for (k, v) in &other.0 {
            self.add(k, *v);
        }
    }
}

/// How [`whitening_covariance_with`] schedules its work. Every choice gives
/// the same covariance, bit for bit; the default is the fastest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FitOptions {
    /// Window k's product runs beside window k + 1's preprocessing (`true`),
    /// or after it (`false`: one step at a time, the simple schedule).
    pub pipelined: bool,
    /// `X·Xᵀ` by 512-column blocks, lower triangle only, where that keeps the
    /// bits ([`accumulate_covariance`]), or always the plain product
    /// ([`accumulate_covariance_plain`]).
    pub fast_product: bool,
    /// [`whitening_covariance_into`] reads into window buffers used before
    /// (`true`), or into a new zeroed buffer for every window (`false`).
    pub reuse_buffers: bool,
}

impl FitOptions {
    /// The simple schedule, for comparisons: one step at a time, the plain
    /// product, a new buffer per window.
    pub fn plain() -> Self {
        FitOptions {
            pipelined: false,
            fast_product: false,
            reuse_buffers: false,
        }
    }
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            pipelined: true,
            fast_product: true,
            reuse_buffers: true,
        }
    }
}

/// As [`whitening_covariance`], adding each part's busy seconds to `times`.
///
/// # Errors
/// As [`whitening_covariance`].
pub fn whitening_covariance_timed<E, F>(
    n_windows: u64,
    read_raw_window: F,
    probe: &Probe,
    settings: &PreprocessSettings,
    times: &mut FitTimes,
) -> Result<Array2<f64>, E>
where
    F: FnMut(u64) -> Result<Array2<f32>, E> + Send,
    E: From<PreprocessError> + Send,
{
    whitening_covariance_with(
        n_windows,
        read_raw_window,
        probe,
        settings,
        FitOptions::default(),
        times,
    )
}

/// One window of the fit, preprocessed as [`fit_whitening`] describes:
/// inverted if `invert_sign`, CAR, high-pass, zeroed at `artifact_threshold`.
fn preprocess_for_fit(
    mut x: Array2<f32>,
    i: u64,
    settings: &PreprocessSettings,
    hp: &HighpassFilter,
    iir: Option<&super::CircularIir>,
    times: &mut FitTimes,
) -> Result<Array2<f32>, PreprocessError> {
    let t = std::time::Instant::now();
    if settings.invert_sign {
        invert_sign(&mut x);
    }
    let t = times.lap("invert", t);
    common_reference(&mut x, settings.do_car)?;
    let t = times.lap("car", t);
    super::highpass_window(hp, iir, &mut x)?;
    let t = times.lap("highpass", t);
    if exceeds_artifact_threshold(&x, settings.artifact_threshold) {
        tracing::info!(
            window = i,
            "window reaches artifact_threshold; it enters the whitening covariance as zeros"
        );
        x.fill(0.0);
    }
    times.lap("artifact", t);
    Ok(x)
}

/// As [`whitening_covariance_timed`], scheduled as `options` says (the
/// result does not depend on it).
///
/// # Errors
/// As [`whitening_covariance`].
pub fn whitening_covariance_with<E, F>(
    n_windows: u64,
    mut read_raw_window: F,
    probe: &Probe,
    settings: &PreprocessSettings,
    options: FitOptions,
    times: &mut FitTimes,
) -> Result<Array2<f64>, E>
where
    F: FnMut(u64) -> Result<Array2<f32>, E> + Send,
    E: From<PreprocessError> + Send,
{
    whitening_covariance_into(
        n_windows,
        |i, x: &mut Array2<f32>| {
            *x = read_raw_window(i)?;
            Ok(())
        },
        probe,
        settings,
        options,
        times,
    )
}

/// As [`whitening_covariance_with`], the windows read into buffers the fit
/// reuses: `read_raw_window_into(i, x)` overwrites every value of `x`
/// (C × N, allocated zeroed the first times) with window i, as
/// `read_raw_window(i)` of [`fit_whitening`] returns it. Saves allocating
/// (and the OS zeroing) a window per read.
///
/// Reading (with the caller's checks) runs ahead on its own thread. With
/// `options.pipelined`, window k's product `X·Xᵀ` runs (on the rayon pool)
/// beside window k + 1's preprocessing; the windows' terms are still added in
/// window order. Window buffers at once: at most four (one being read, one
/// queued, one being preprocessed, one in the product).
///
/// # Errors
/// As [`whitening_covariance`].
pub fn whitening_covariance_into<E, F>(
    n_windows: u64,
    mut read_raw_window_into: F,
    probe: &Probe,
    settings: &PreprocessSettings,
    options: FitOptions,
    times: &mut FitTimes,
) -> Result<Array2<f64>, E>
where
    F: FnMut(u64, &mut Array2<f32>) -> Result<(), E> + Send,
    E: From<PreprocessError> + Send,
{
    settings.validate()?;
    let c = probe.n_sites();
    if c == 0 {
        return Err(PreprocessError::Probe {
            message: "the probe has no sites".into(),
        }
        .into());
    }
    if n_windows == 0 {
        return Err(PreprocessError::NoWindows { n_windows }.into());
    }
    let n = settings.window_len();
    let nt = settings.nt;
    let kernel = highpass_kernel(settings.fs, settings.highpass_cutoff)?;
    let hp = HighpassFilter::new(&kernel, n)?;
    let iir =
        super::highpass_iir::iir_for_kernel(settings.fs, settings.highpass_cutoff, &kernel, n)?;
    let windows = covariance_windows(n_windows, settings.nskip as u64);
    if n_windows == 1 {
        tracing::info!(
            "the recording has a single window: the whitening covariance uses it alone \
             (Kilosort4 cannot whiten such a recording; it averages over no window)"
        );
    }
    tracing::info!(
        n_windows,
        nskip = settings.nskip,
        used = windows.len(),
        "fitting the whitening matrix"
    );
    let mut cc = Array2::<f64>::zeros((c, c));
    let mut sum = WindowSum::new(options.fast_product);
    // Adds a preprocessed window's central NT columns to `cc`; hands the
    // buffer back.
    let add = |sum: &mut WindowSum,
               cc: &mut Array2<f64>,
               x: Array2<f32>,
               times: &mut FitTimes|
     -> Result<Array2<f32>, PreprocessError> {
        sum.add(cc, x.slice(ndarray::s![.., nt..n - nt]), times)?;
        Ok(x)
    };
    let read_s = std::thread::scope(|scope| -> Result<f64, E> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Array2<f32>, E>>(1);
        // Buffers back from the product, for the reader to fill again.
        let (free_tx, free_rx) = std::sync::mpsc::channel::<Array2<f32>>();
        let list = windows.clone();
        let reader = scope.spawn(move || {
            let mut busy = 0.0;
            for &i in &list {
                let t = std::time::Instant::now();
                let reused = match options.reuse_buffers {
                    true => free_rx.try_recv().ok(),
                    false => None,
                };
                let mut x = reused.unwrap_or_else(|| Array2::<f32>::zeros((c, n)));
                let r = read_raw_window_into(i, &mut x).map(|()| x);
                busy += t.elapsed().as_secs_f64();
                let failed = r.is_err();
                if tx.send(r).is_err() || failed {
                    break;
                }
            }
            busy
        });
        // A preprocessed window whose product is still to come.
        let mut pending: Option<Array2<f32>> = None;
        for &i in &windows {
            let Ok(x) = rx.recv() else { break };
            let x = x?;
            if x.dim() != (c, n) {
                return Err(PreprocessError::Shape {
                    what: "raw window for the whitening fit",
                    rows: x.nrows(),
                    cols: x.ncols(),
                    expected_rows: c,
                    expected_cols: n,
                }
                .into());
            }
            if options.pipelined {
                let mut pre_times = FitTimes::default();
                let mut sum_times = FitTimes::default();
                let previous = pending.take();
                let (pre, added) = rayon::join(
                    || preprocess_for_fit(x, i, settings, &hp, iir.as_ref(), &mut pre_times),
                    || match previous {
                        Some(p) => add(&mut sum, &mut cc, p, &mut sum_times).map(Some),
                        None => Ok(None),
                    },
                );
                times.merge(&pre_times);
                times.merge(&sum_times);
                if let Some(done) = added? {
                    let _ = free_tx.send(done);
                }
                pending = Some(pre?);
            } else {
                let x = preprocess_for_fit(x, i, settings, &hp, iir.as_ref(), times)?;
                let done = add(&mut sum, &mut cc, x, times)?;
                let _ = free_tx.send(done);
            }
        }
        if let Some(p) = pending.take() {
            add(&mut sum, &mut cc, p, times)?;
        }
        Ok(reader
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
    })?;
    times.add("read", read_s);
    cc.mapv_inplace(|v| v / windows.len() as f64);
    Ok(cc)
}

/// The matrix's size, checked square.
fn square(w: &Array2<f32>) -> Result<(usize, usize), PreprocessError> {
    let (r, c) = w.dim();
    if r != c {
        return Err(PreprocessError::Shape {
            what: "whitening matrix",
            rows: r,
            cols: c,
            expected_rows: r,
            expected_cols: r,
        });
    }
    Ok((r, c))
}

/// Each row's (column, value) non-zeros, in column order.
/// Rows in parallel.
fn nonzero_rows(w: &Array2<f32>) -> Vec<Vec<(usize, f32)>> {
    let rows: Vec<ndarray::ArrayView1<'_, f32>> = w.outer_iter().collect();
    rows.into_par_iter()
        .map(|row| {
            row.iter()
                .enumerate()
                .filter(|(_, v)| **v != 0.0)
                .map(|(k, &v)| (k, v))
                .collect()
        })
        .collect()
}

/// Copies a column block's rows into `tmp`, one after another, each
/// followed by `TMP_PAD` zeros: the layout [`sparse_block`] reads.
fn stage_block(block: ArrayView2<'_, f32>, tmp: &mut Vec<f32>) {
    tmp.clear();
    for row in block.outer_iter() {
        match row.as_slice() {
            Some(r) => tmp.extend_from_slice(r),
            None => tmp.extend(row.iter().copied()),
        }
        tmp.extend(std::iter::repeat_n(0.0, TMP_PAD));
    }
}

/// The sparse product over a column block: each output row j of `block`
/// (C × b samples) = Σ over row j's non-zeros `rows[j]` of w·(`tmp`'s row k),
/// where `tmp` is the block's copy with rows `stride` values apart. Per
/// sample, four terms per pass as `(w0·a0 + w1·a1) + (w2·a2 + w3·a3)` are
/// added to the accumulator (from 0), then the remaining terms one by one
/// (float32, no fused multiply-add): the order of [`Whitening::csr`].
///
/// [`SPARSE_RUN`] samples of every row are done before the next
/// [`SPARSE_RUN`] samples, their sums kept in registers over all the row's
/// terms: neighbouring rows read nearly the same source rows, so a run's
/// sources stay in the L1 cache even for the drift-corrected `G_b` (about
/// 90 terms per row; row by row over the whole block, they did not). Each
/// sample's sum does not depend on the run length or the order of rows, so
/// the bits are those of a plain loop. Compiled for AVX2 and AVX-512 too and
/// chosen at run time: the same operations on 8 or 16 lanes, the same bits.
fn sparse_block(
    block: &mut ArrayViewMut2<'_, f32>,
    rows: &[Vec<(usize, f32)>],
    tmp: &[f32],
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn sparse_block_avx512(
            block: &mut ArrayViewMut2<'_, f32>,
            rows: &[Vec<(usize, f32)>],
            tmp: &[f32],
            stride: usize,
        ) {
            sparse_block_impl(block, rows, tmp, stride)
        }
        #[target_feature(enable = "avx2")]
        fn sparse_block_avx2(
            block: &mut ArrayViewMut2<'_, f32>,
            rows: &[Vec<(usize, f32)>],
            tmp: &[f32],
            stride: usize,
        ) {
            sparse_block_impl(block, rows, tmp, stride)
        }
        if crate::simd::avx512() {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            unsafe { sparse_block_avx512(block, rows, tmp, stride) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { sparse_block_avx2(block, rows, tmp, stride) };
            return;
        }
    }
    sparse_block_impl(block, rows, tmp, stride)
}

#[inline(always)]
fn sparse_block_impl(
    block: &mut ArrayViewMut2<'_, f32>,
    rows: &[Vec<(usize, f32)>],
    tmp: &[f32],
    stride: usize,
) {
    let b = block.ncols();
    let full = b - b % SPARSE_RUN;
    let mut t0 = 0;
    while t0 < full {
        for (j, nz) in rows.iter().enumerate() {
            let mut dst = block.row_mut(j);
            let dst = dst
                .as_slice_mut()
                .expect("rows of a column block are contiguous");
            sparse_run::<SPARSE_RUN>(&mut dst[t0..t0 + SPARSE_RUN], nz, tmp, stride, t0);
        }
        t0 += SPARSE_RUN;
    }
    if full < b {
        for (j, nz) in rows.iter().enumerate() {
            let mut dst = block.row_mut(j);
            let dst = dst
                .as_slice_mut()
                .expect("rows of a column block are contiguous");
            let mut t = full;
            while t + LANES8 <= b {
                sparse_run::<LANES8>(&mut dst[t..t + LANES8], nz, tmp, stride, t);
                t += LANES8;
            }
            while t < b {
                sparse_run::<1>(&mut dst[t..t + 1], nz, tmp, stride, t);
                t += 1;
            }
        }
    }
}

/// Samples whose sums [`sparse_block`] keeps in registers at once (64: 1.5
/// times faster than 32 for `G_b`, as fast for W, on dev-2c).
const SPARSE_RUN: usize = 64;
/// One 256-bit vector of f32.
const LANES8: usize = 8;

/// `dst` (R samples from `t0`) = the row's sum, as [`sparse_block`]
/// describes; `tmp`'s rows are `stride` values apart.
#[inline(always)]
fn sparse_run<const R: usize>(
    dst: &mut [f32],
    nz: &[(usize, f32)],
    tmp: &[f32],
    stride: usize,
    t0: usize,
) {
    let mut acc = [0f32; R];
    let src = |k: usize| -> &[f32; R] {
        tmp[k * stride + t0..k * stride + t0 + R]
            .try_into()
            .expect("R samples")
    };
    let mut quads = nz.chunks_exact(4);
    for q in &mut quads {
        let (s0, s1, s2, s3) = (src(q[0].0), src(q[1].0), src(q[2].0), src(q[3].0));
        let (w0, w1, w2, w3) = (q[0].1, q[1].1, q[2].1, q[3].1);
        for l in 0..R {
            acc[l] += (w0 * s0[l] + w1 * s1[l]) + (w2 * s2[l] + w3 * s3[l]);
        }
    }
    for &(k, wv) in quads.remainder() {
        let s = src(k);
        for l in 0..R {
            acc[l] += wv * s[l];
        }
    }
    dst.copy_from_slice(&acc);
}

/// Zeros after each row of a column block's copy for the sparse product:
/// rows a multiple of 1 KiB apart would map to the same few L1 cache sets.
const TMP_PAD: usize = 16;

/// Columns per block of the sparse product in [`Whitening::apply`] (256:
/// with runs of 64 samples, as fast as 128 for W and faster for `G_b`, on dev-2c).
const SPARSE_BLOCK: usize = 256;

/// A whitening matrix ready to apply: W dense, plus its non-zeros per row,
/// which the product sums (the order of [`Whitening::csr`], the device's too).
#[derive(Debug, Clone)]
pub struct Whitening {
    w: Array2<f32>,
    /// Per row, the (column, value) non-zeros in column order.
    rows: Vec<Vec<(usize, f32)>>,
}

impl Whitening {
    /// Wraps a (C × C) whitening matrix (e.g. from [`fit_whitening`] or
    /// Kilosort's `whiten_mat.npy`).
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if it is not square.
    pub fn new(w: Array2<f32>) -> Result<Self, PreprocessError> {
        square(&w)?;
        let w = w.as_standard_layout().into_owned();
        // Every matrix is applied as the sum of each row's non-zeros in the
        // order of [`Whitening::csr`], which the device kernels follow, so that
        // CPU and GPU whiten to the same bits (a dense sgemm sums in its own
        // order).
        let rows = nonzero_rows(&w);
        Ok(Whitening { w, rows })
    }

    /// The (C × C) matrix.
    pub fn matrix(&self) -> &Array2<f32> {
        &self.w
    }

    // A whitening-like matrix (drift correction's G_b = M_b·W) applied as
    // CSR, and the CSR form of any whitening.

    /// Wraps a (C × C) matrix for the sparse product only, without the
    /// entries whose magnitude is at most `floor` × its largest (`floor` = 0
    /// keeps every non-zero). Used for the drift-corrected whitening
    /// `G_b = M_b·W` (drift-spec.md §7 step 8), which
    /// [`crate::drift::DriftRun::window_whitening`] builds per window; the
    /// sparse product is used whatever the density, so [`Whitening::csr`] is
    /// always the CPU's summation order.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if it is not square;
    /// [`PreprocessError::Setting`] if `floor` is negative or not finite.
    pub fn sparse_with_floor(w: Array2<f32>, floor: f32) -> Result<Self, PreprocessError> {
        square(&w)?;
        if !(floor.is_finite() && floor >= 0.0) {
            return Err(PreprocessError::Setting {
                name: "sparse floor",
                message: format!("is {floor}; it must be a finite fraction ≥ 0"),
            });
        }
        let mut w = w;
        if !w.is_standard_layout() {
            w = w.as_standard_layout().into_owned();
        }
        // Rows in parallel (the largest |value| is the same in any order).
        let n = w.ncols().max(1);
        let vals = w.as_slice_mut().expect("standard layout");
        let max = vals
            .par_chunks(n)
            .map(|row| row.iter().fold(0f32, |a, v| a.max(v.abs())))
            .reduce(|| 0f32, f32::max);
        let cut = floor * max;
        vals.par_chunks_mut(n).for_each(|row| {
            for v in row {
                *v = if v.abs() > cut { *v } else { 0.0 };
            }
        });
        let rows = nonzero_rows(&w);
        Ok(Whitening { w, rows })
    }

    /// Non-zero entries.
    pub fn nnz(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }

    /// The matrix in compressed rows: (row starts, C + 1 values; columns;
    /// values). Row j's non-zeros are `columns/values[starts[j]..starts[j + 1]]`,
    /// in increasing column order, which is the order in which the sparse
    /// product sums them: output j at sample t is
    /// `acc = 0; for each full group of four (w0..w3 at sites k0..k3):
    /// acc += (w0·x[k0] + w1·x[k1]) + (w2·x[k2] + w3·x[k3]); then the
    /// remaining one to three terms one by one: acc += w·x[k]` (float32).
    pub fn csr(&self) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
        let (mut start, mut cols, mut vals) = (vec![0u32], Vec::new(), Vec::new());
        for row in &self.rows {
            for &(k, v) in row {
                cols.push(k as u32);
                vals.push(v);
            }
            start.push(cols.len() as u32);
        }
        (start, cols, vals)
    }

    fn whiten_block(&self, mut block: ArrayViewMut2<'_, f32>, tmp: &mut Vec<f32>) {
        let b = block.ncols();
        stage_block(block.view(), tmp);
        sparse_block(&mut block, &self.rows, tmp, b + TMP_PAD);
    }

    /// C, when `window` has C rows.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if it does not.
    fn check_rows(&self, window: &Array2<f32>) -> Result<usize, PreprocessError> {
        let c = self.w.nrows();
        if window.nrows() != c {
            return Err(PreprocessError::Shape {
                what: "window for whitening",
                rows: window.nrows(),
                cols: window.ncols(),
                expected_rows: c,
                expected_cols: window.ncols(),
            });
        }
        Ok(c)
    }

    /// Whitens a (C × N) window in place: `X ← W·X` over all N columns, in
    /// f32, column blocks in parallel.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if the window does not have C rows.
    pub fn apply(&self, window: &mut Array2<f32>) -> Result<(), PreprocessError> {
        let c = self.check_rows(window)?;
        if window.ncols() == 0 {
            return Ok(());
        }
        ensure_standard(window);
        let blocks: Vec<ArrayViewMut2<'_, f32>> =
            window.axis_chunks_iter_mut(Axis(1), SPARSE_BLOCK).collect();
        blocks.into_par_iter().for_each_init(
            || Vec::with_capacity(c * (SPARSE_BLOCK + TMP_PAD)),
            |tmp, block| self.whiten_block(block, tmp),
        );
        Ok(())
    }

    /// `W·X` of a (C × N) window into a new array, `window` left as it was:
    /// the bits of [`Whitening::apply`] (each column block is read into the
    /// same staging copy first either way).
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if the window does not have C rows.
    pub fn apply_to_new(&self, window: &Array2<f32>) -> Result<Array2<f32>, PreprocessError> {
        let c = self.check_rows(window)?;
        // Zeroed pages come from the system untouched: each is written once, below.
        let mut out = Array2::<f32>::zeros(window.dim());
        if window.ncols() == 0 {
            return Ok(out);
        }
        let blocks: Vec<(ArrayView2<'_, f32>, ArrayViewMut2<'_, f32>)> = window
            .axis_chunks_iter(Axis(1), SPARSE_BLOCK)
            .zip(out.axis_chunks_iter_mut(Axis(1), SPARSE_BLOCK))
            .collect();
        blocks.into_par_iter().for_each_init(
            || Vec::with_capacity(c * (SPARSE_BLOCK + TMP_PAD)),
            |tmp, (src, mut dst)| {
                stage_block(src, tmp);
                sparse_block(&mut dst, &self.rows, tmp, src.ncols() + TMP_PAD);
            },
        );
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `apply_to_new` gives `apply`'s bits and leaves its input as it was,
    /// for a window whose width is not a multiple of the column block, and
    /// for one in column-major layout.
    #[test]
    fn whitening_into_a_new_array_is_in_place_whitening() {
        let c = 12;
        let n = 2 * SPARSE_BLOCK + 37;
        let w = Array2::from_shape_fn((c, c), |(j, k)| {
            if j.abs_diff(k) <= 3 {
                0.21 * ((j * 5 + k * 7) % 13) as f32 - 1.1
            } else {
                0.0
            }
        });
        let g = Whitening::sparse_with_floor(w, 1e-8).unwrap();
        let x = Array2::from_shape_fn((c, n), |(i, t)| ((i * 29 + t * 13) % 31) as f32 * 0.3 - 4.1);
        let mut y = x.clone();
        g.apply(&mut y).unwrap();
        let bits = |a: &Array2<f32>| a.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let z = g.apply_to_new(&x).unwrap();
        assert_eq!(bits(&z), bits(&y));
        let x_f = x.t().as_standard_layout().into_owned().reversed_axes();
        assert!(!x_f.is_standard_layout());
        let z_f = g.apply_to_new(&x_f).unwrap();
        assert_eq!(bits(&z_f), bits(&y));
        assert_eq!(bits(&x_f.as_standard_layout().into_owned()), bits(&x));
        assert!(g.apply_to_new(&Array2::zeros((c + 1, 4))).is_err());
    }

    #[test]
    fn covariance_window_lists() {
        assert_eq!(covariance_windows(4, 1), vec![0, 1, 2]);
        assert_eq!(covariance_windows(4, 2), vec![0, 2]);
        assert_eq!(covariance_windows(4, 3), vec![0]);
        assert_eq!(covariance_windows(4, 25), vec![0]);
        assert_eq!(covariance_windows(1, 25), vec![0]);
        assert!(covariance_windows(0, 25).is_empty());
        assert_eq!(covariance_windows(60, 25), vec![0, 25, 50]);
    }

    /// `csr()` lists the non-zeros in the order the sparse product sums them:
    /// per row, groups of four `(w0·a0 + w1·a1) + (w2·a2 + w3·a3)` added to the
    /// accumulator, then the remainder one by one (bitwise), for rows of 0 to 9
    /// non-zeros; `sparse_with_floor` drops entries at most floor × the largest.
    #[test]
    fn csr_is_the_sparse_products_summation_order() {
        let c = 10;
        let n = 300;
        let w = Array2::from_shape_fn((c, c), |(j, k)| {
            if k < j {
                0.37 * ((j * 7 + k * 3) % 11) as f32 - 1.9 + 1e-3 * k as f32
            } else {
                0.0
            }
        });
        let mut w = w;
        w[(3, 0)] = 1e-9; // below 1e-8 of the largest: dropped
        let g = Whitening::sparse_with_floor(w.clone(), 1e-8).unwrap();
        let (start, cols, vals) = g.csr();
        assert_eq!(start.len(), c + 1);
        assert!(!cols[start[3] as usize..start[4] as usize].contains(&0));
        let x = Array2::from_shape_fn((c, n), |(i, t)| ((i * 31 + t * 17) % 23) as f32 * 0.7 - 7.3);
        let mut y = x.clone();
        g.apply(&mut y).unwrap();
        for j in 0..c {
            let (a, b) = (start[j] as usize, start[j + 1] as usize);
            for t in 0..n {
                let mut acc = 0f32;
                let mut e = a;
                while e + 4 <= b {
                    let term = |i: usize| vals[e + i] * x[(cols[e + i] as usize, t)];
                    acc += (term(0) + term(1)) + (term(2) + term(3));
                    e += 4;
                }
                while e < b {
                    acc += vals[e] * x[(cols[e] as usize, t)];
                    e += 1;
                }
                assert_eq!(acc.to_bits(), y[(j, t)].to_bits(), "row {j} sample {t}");
            }
        }
        // Whitening::new's sparse form lists the same non-zeros.
        let sparse_new = Whitening::new(g.matrix().clone()).unwrap();
        assert_eq!(sparse_new.csr(), g.csr());
        assert!(Whitening::sparse_with_floor(w, -1.0).is_err());
    }

    #[test]
    fn the_product_agrees_with_a_dense_reference() {
        let c = 12;
        let n = 600;
        let mut w = Array2::<f32>::zeros((c, c));
        for j in 0..c {
            w[(j, j)] = 1.0 + j as f32 * 0.1;
            w[(j, (j + 1) % c)] = -0.3;
        }
        let x = Array2::from_shape_fn((c, n), |(i, t)| ((i * 7 + t * 13) % 17) as f32 - 8.0);
        let expect = w.dot(&x);
        let ws = Whitening::new(w.clone()).unwrap();
        let mut y = x.clone();
        ws.apply(&mut y).unwrap();
        let d = (&y - &expect).mapv(f32::abs).fold(0.0f32, |a, &b| a.max(b));
        assert!(d < 1e-5, "sparse {d}");
    }
}
