//! Kilosort4's zero-phase high-pass filter (`preprocessing.get_highpass_filter`,
//! `fft_highpass` and the FFT step of `io.BinaryFiltered.filter`; spec section 4.1).
//!
//! The kernel is the forward–backward (filtfilt) response of a 3rd-order
//! Butterworth high-pass to a centred unit impulse. Each padded window is
//! filtered on its own, as a circular correlation with that kernel over the
//! window's N columns, computed with real FFTs of length N.

use std::sync::{Arc, Mutex};

use ndarray::Array2;
use rayon::prelude::*;
use realfft::num_complex::Complex;
use realfft::{ComplexToReal, RealFftPlanner, RealToComplex};

use crate::error::PreprocessError;

use super::car::ensure_standard;

/// Length of Kilosort's high-pass kernel, fixed whatever `fs` or the window length.
pub const KERNEL_LEN: usize = 30_122;
/// Index of the kernel's centre (the unit impulse and the peak).
pub const KERNEL_CENTRE: usize = 15_061;
/// Block mode keeps the taps above this fraction of the peak. For 300 Hz at
/// 30 kHz that is lags −830…830; the taps left out sum to 4e-12 of the peak,
/// far below f32 rounding (6e-8 relative).
const BLOCK_TAP_FLOOR: f32 = 1e-13;
/// Order of the Butterworth design.
const ORDER: usize = 3;
/// scipy's default `filtfilt` pad length for this design: 3 · max(len(a), len(b)).
const FILTFILT_PADLEN: usize = 3 * (ORDER + 1);

/// Coefficients (b, a) of the digital 3rd-order Butterworth high-pass at
/// `cutoff` Hz for sampling rate `fs` Hz, designed as scipy's
/// `butter(3, cutoff, fs=fs, btype='high')` does: analog prototype poles,
/// pre-warped high-pass transform, bilinear transform. `a[0]` is 1.
///
/// For 300 Hz at 30 kHz: b ≈ [0.93909, −2.81727, 2.81727, −0.93909],
/// a ≈ [1, −2.87436, 2.75648, −0.88189].
///
/// # Errors
/// [`PreprocessError::Setting`] unless `fs` is finite and positive and
/// 0 < `cutoff` < `fs`/2.
pub fn butterworth_highpass(fs: f64, cutoff: f64) -> Result<([f64; 4], [f64; 4]), PreprocessError> {
    if !(fs.is_finite() && fs > 0.0) {
        return Err(PreprocessError::Setting {
            name: "fs",
            message: format!("is {fs}; it must be a positive sampling rate in Hz"),
        });
    }
    if !(cutoff.is_finite() && cutoff > 0.0 && cutoff < fs / 2.0) {
        return Err(PreprocessError::Setting {
            name: "highpass_cutoff",
            message: format!(
                "is {cutoff} Hz; it must lie strictly between 0 and the Nyquist frequency fs/2 = {} Hz",
                fs / 2.0
            ),
        });
    }
    type C = Complex<f64>;
    // Normalised frequency (Nyquist = 1), then the pre-warped analog frequency
    // for the bilinear transform at a nominal sampling rate of 2.
    let wn = 2.0 * cutoff / fs;
    let warped = 4.0 * (std::f64::consts::PI * wn / 2.0).tan();
    // Analog Butterworth prototype poles on the unit circle's left half.
    let mut poles = [C::new(0.0, 0.0); ORDER];
    for (i, p) in poles.iter_mut().enumerate() {
        let m = 2.0 * i as f64 - (ORDER as f64 - 1.0);
        let theta = std::f64::consts::PI * m / (2.0 * ORDER as f64);
        *p = -C::new(theta.cos(), theta.sin());
    }
    // Low-pass to high-pass: p -> warped / p; all zeros at the origin; gain
    // 1 / prod(-p).
    let mut prod_neg = C::new(1.0, 0.0);
    for p in &poles {
        prod_neg *= -p;
    }
    let k_hp = (C::new(1.0, 0.0) / prod_neg).re;
    let hp_poles: Vec<C> = poles.iter().map(|p| C::new(warped, 0.0) / p).collect();
    // Bilinear transform with 2·fs = 4: zeros at the origin map to z = 1.
    let fs2 = C::new(4.0, 0.0);
    let z_poles: Vec<C> = hp_poles.iter().map(|p| (fs2 + p) / (fs2 - p)).collect();
    let mut num = C::new(1.0, 0.0);
    let mut den = C::new(1.0, 0.0);
    for p in &hp_poles {
        num *= fs2;
        den *= fs2 - p;
    }
    let k = k_hp * (num / den).re;
    // Expand the polynomials.
    let poly = |roots: &[C]| -> [f64; 4] {
        let mut c = [C::new(0.0, 0.0); ORDER + 1];
        c[0] = C::new(1.0, 0.0);
        for (deg, r) in roots.iter().enumerate() {
            for i in (1..=deg + 1).rev() {
                c[i] -= r * c[i - 1];
            }
        }
        c.map(|v| v.re)
    };
    let ones = [C::new(1.0, 0.0); ORDER];
    let b = poly(&ones).map(|v| v * k);
    let a = poly(&z_poles);
    Ok((b, a))
}

/// Direct-form-II-transposed IIR filter with initial state `z` (modified).
fn lfilter(b: &[f64; 4], a: &[f64; 4], x: &[f64], z: &mut [f64; 3]) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for &xn in x {
        let yn = b[0] * xn + z[0];
        z[0] = z[1] + b[1] * xn - a[1] * yn;
        z[1] = z[2] + b[2] * xn - a[2] * yn;
        z[2] = b[3] * xn - a[3] * yn;
        y.push(yn);
    }
    y
}

/// Steady-state initial state of [`lfilter`] for a unit step (scipy's
/// `lfilter_zi`): solves (I − Aᵀ)·zi = b[1..] − a[1..]·b[0], with A the
/// companion matrix of `a`, by Gaussian elimination with partial pivoting.
fn lfilter_zi(b: &[f64; 4], a: &[f64; 4]) -> [f64; 3] {
    let mut m = [[1.0 + a[1], -1.0, 0.0], [a[2], 1.0, -1.0], [a[3], 0.0, 1.0]];
    let mut r = [b[1] - a[1] * b[0], b[2] - a[2] * b[0], b[3] - a[3] * b[0]];
    for col in 0..3 {
        let piv = (col..3)
            .max_by(|&i, &j| m[i][col].abs().total_cmp(&m[j][col].abs()))
            .unwrap_or(col);
        m.swap(col, piv);
        r.swap(col, piv);
        let pivot_row = m[col];
        for row in col + 1..3 {
            let f = m[row][col] / pivot_row[col];
            for (dst, src) in m[row].iter_mut().zip(&pivot_row).skip(col) {
                *dst -= f * src;
            }
            r[row] -= f * r[col];
        }
    }
    let mut z = [0.0; 3];
    for row in (0..3).rev() {
        let mut s = r[row];
        for c2 in row + 1..3 {
            s -= m[row][c2] * z[c2];
        }
        z[row] = s / m[row][row];
    }
    z
}

/// Zero-phase forward–backward filtering with scipy `filtfilt`'s defaults:
/// odd extension by 12 samples at each end, steady-state initial conditions
/// scaled by the first sample of each pass.
fn filtfilt(b: &[f64; 4], a: &[f64; 4], x: &[f64]) -> Vec<f64> {
    let n = x.len();
    let p = FILTFILT_PADLEN;
    debug_assert!(n > p);
    let mut ext = Vec::with_capacity(n + 2 * p);
    for i in (1..=p).rev() {
        ext.push(2.0 * x[0] - x[i]);
    }
    ext.extend_from_slice(x);
    for i in 1..=p {
        ext.push(2.0 * x[n - 1] - x[n - 1 - i]);
    }
    let zi = lfilter_zi(b, a);
    let mut z = zi.map(|v| v * ext[0]);
    let mut y = lfilter(b, a, &ext, &mut z);
    y.reverse();
    let mut z = zi.map(|v| v * y[0]);
    let mut y = lfilter(b, a, &y, &mut z);
    y.reverse();
    y[p..p + n].to_vec()
}

/// Kilosort4's high-pass kernel (`get_highpass_filter(fs, cutoff)`): the
/// [`butterworth_highpass`] design run forward and backward (scipy `filtfilt`
/// defaults) over a float64 unit impulse at index [`KERNEL_CENTRE`] of a
/// [`KERNEL_LEN`]-long signal, then cast to f32.
///
/// Returns 30 122 taps, symmetric about index 15 061 (peak 0.97906 for
/// 300 Hz at 30 kHz), summing to about zero.
///
/// # Errors
/// As [`butterworth_highpass`].
pub fn highpass_kernel(fs: f64, cutoff: f64) -> Result<Vec<f32>, PreprocessError> {
    Ok(highpass_kernel_f64(fs, cutoff)?
        .into_iter()
        .map(|v| v as f32)
        .collect())
}

/// [`highpass_kernel`] before its cast to f32: 30 122 f64 taps.
///
/// # Errors
/// As [`butterworth_highpass`].
pub fn highpass_kernel_f64(fs: f64, cutoff: f64) -> Result<Vec<f64>, PreprocessError> {
    let (b, a) = butterworth_highpass(fs, cutoff)?;
    let mut impulse = vec![0.0f64; KERNEL_LEN];
    impulse[KERNEL_CENTRE] = 1.0;
    Ok(filtfilt(&b, &a, &impulse))
}

/// Fits a kernel to a window of `n` columns as Kilosort's `fft_highpass` does:
/// for `n` < kernel length, the `n` taps starting at ⌊(len − n)/2⌋; for a longer
/// window, ⌊(n − len)/2⌋ zeros, the kernel, then zeros up to `n`.
///
/// Returns `(taps, centre)`: `n` taps and the index of the kernel's centre
/// among them (`len/2`, shifted by the crop or the padding). `kernel` must have
/// an even length (Kilosort's is 30 122); `n` ≥ 1.
pub fn fit_kernel_to_window(kernel: &[f32], n: usize) -> (Vec<f32>, usize) {
    let len = kernel.len();
    let centre = len / 2;
    if n <= len {
        let start = (len - n) / 2;
        (kernel[start..start + n].to_vec(), centre - start)
    } else {
        let pad = (n - len) / 2;
        let mut taps = vec![0.0f32; n];
        taps[pad..pad + len].copy_from_slice(kernel);
        (taps, centre + pad)
    }
}

/// The values of a (C × `n`) window, rows one after another (made standard
/// layout first), for filtering row by row.
///
/// # Errors
/// [`PreprocessError::Shape`] if the window does not have `n` columns.
pub(crate) fn window_values(
    window: &mut Array2<f32>,
    n: usize,
) -> Result<&mut [f32], PreprocessError> {
    if window.ncols() != n {
        return Err(PreprocessError::Shape {
            what: "window for the high-pass",
            rows: window.nrows(),
            cols: window.ncols(),
            expected_rows: window.nrows(),
            expected_cols: n,
        });
    }
    ensure_standard(window);
    Ok(window
        .as_slice_mut()
        .expect("standard layout was just ensured"))
}

/// Per-thread FFT buffers for [`HighpassFilter`].
struct HpScratch {
    /// FFT input, F samples.
    input: Vec<f32>,
    /// Spectrum, F/2 + 1 bins.
    spectrum: Vec<Complex<f32>>,
    /// realfft's scratch.
    fft: Vec<Complex<f32>>,
    /// The row, extended circularly (block mode only): N + K − 1 samples.
    ext: Vec<f32>,
    /// One block's correlation (block mode only): F samples.
    block_out: Vec<f32>,
}

/// Block mode (overlap-save) geometry: the same circular correlation computed
/// from the kernel's non-zero taps with short power-of-two FFTs.
#[derive(Debug, Clone, Copy)]
struct Blocks {
    /// First non-zero offset o of the correlation `y[t] = Σ_o h[o]·x[(t + o) mod N]`.
    first: isize,
    /// Number K of offsets from the first to the last non-zero tap.
    k: usize,
    /// Outputs per block, F − K + 1.
    per_block: usize,
}

/// The conjugate spectrum of `taps` (f64 FFT), scaled by 1/len and rounded to f32.
fn conj_spectrum(taps: Vec<f64>) -> Result<Vec<Complex<f32>>, PreprocessError> {
    let len = taps.len();
    let mut planner = RealFftPlanner::<f64>::new();
    let fwd = planner.plan_fft_forward(len);
    let mut inp = taps;
    let mut spec = fwd.make_output_vec();
    fwd.process(&mut inp, &mut spec)
        .map_err(|e| PreprocessError::Setting {
            name: "hp_filter",
            message: format!("FFT of the fitted kernel failed: {e}"),
        })?;
    let scale = 1.0 / len as f64;
    let mut out: Vec<Complex<f32>> = spec
        .iter()
        .map(|c| Complex::new((c.re * scale) as f32, (-c.im * scale) as f32))
        .collect();
    // Purely real bins of a real signal's spectrum.
    out[0].im = 0.0;
    if len.is_multiple_of(2) {
        out[len / 2].im = 0.0;
    }
    Ok(out)
}

/// The high-pass of one window length, with the kernel's spectrum precomputed.
///
/// Applies Kilosort's `fftshift(real(ifft(fft(x) · conj(fft(k)))))` to each
/// channel (row): the circular correlation
/// `y[t] = Σ_j g[j] · x[(t + j + s) mod N]`, where g is the kernel centred at
/// lag 0 and s = (centre index among the fitted taps) − ⌊N/2⌋ (s = +1 for odd
/// N < 30 122, else 0). The roll, the conjugation and the 1/N are folded into
/// the stored spectrum, which is computed in f64 and rounded once to f32; the
/// per-window FFTs run in f32 like Kilosort's.
///
/// Two ways to compute the same sum, chosen per window length:
/// * one real FFT of length N per channel (always used when the kernel's
///   non-zero taps span more than N/4 samples, e.g. N = 6122);
/// * for long windows (Kilosort's default N = 60 122, whose FFT length has the
///   prime factor 1307), overlap-save over the circularly extended row with
///   power-of-two FFTs of at least 8× the kernel's span, using the taps above
///   1e-13 of the peak (lags ±830 at 300 Hz / 30 kHz; the rest sum to 4e-12 of
///   the peak). This is the same circular correlation, wrap-around included,
///   and differs from the single FFT only by f32 rounding (checked to 2e-6 on
///   unit-scale noise).
pub struct HighpassFilter {
    n: usize,
    taps: Vec<f32>,
    fft_len: usize,
    spectrum: Vec<Complex<f32>>,
    forward: Arc<dyn RealToComplex<f32>>,
    inverse: Arc<dyn ComplexToReal<f32>>,
    scratch_len: usize,
    blocks: Option<Blocks>,
    pool: Mutex<Vec<HpScratch>>,
}

/// A copy sharing the FFT plans; its scratch pool starts empty.
impl Clone for HighpassFilter {
    fn clone(&self) -> Self {
        HighpassFilter {
            n: self.n,
            taps: self.taps.clone(),
            fft_len: self.fft_len,
            spectrum: self.spectrum.clone(),
            forward: self.forward.clone(),
            inverse: self.inverse.clone(),
            scratch_len: self.scratch_len,
            blocks: self.blocks,
            pool: Mutex::new(Vec::new()),
        }
    }
}

impl std::fmt::Debug for HighpassFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HighpassFilter")
            .field("n", &self.n)
            .field("fft_len", &self.fft_len)
            .field("blocks", &self.blocks)
            .finish_non_exhaustive()
    }
}

impl HighpassFilter {
    /// Prepares the filter for windows of `n` columns from a full kernel
    /// (e.g. [`highpass_kernel`] or Kilosort's `hp_filter.npy`), fitted with
    /// [`fit_kernel_to_window`]. Picks the computation (see the type's docs).
    ///
    /// # Errors
    /// [`PreprocessError::Setting`] if `n` is 0 or the kernel is empty or has
    /// an odd length (Kilosort's has 30 122 taps).
    pub fn new(kernel: &[f32], n: usize) -> Result<Self, PreprocessError> {
        Self::build(kernel, n, true)
    }

    /// As [`HighpassFilter::new`] but always with one FFT of length N per
    /// channel, exactly Kilosort's arrangement (for comparisons).
    ///
    /// # Errors
    /// As [`HighpassFilter::new`].
    pub fn new_full_fft(kernel: &[f32], n: usize) -> Result<Self, PreprocessError> {
        Self::build(kernel, n, false)
    }

    fn build(kernel: &[f32], n: usize, allow_blocks: bool) -> Result<Self, PreprocessError> {
        if n == 0 {
            return Err(PreprocessError::Setting {
                name: "batch_size",
                message: "the window has 0 columns (batch_size + 2·nt must be positive)".into(),
            });
        }
        if kernel.is_empty() || !kernel.len().is_multiple_of(2) {
            return Err(PreprocessError::Setting {
                name: "hp_filter",
                message: format!(
                    "the kernel has {} taps; it must be non-empty with an even length (Kilosort's has {KERNEL_LEN})",
                    kernel.len()
                ),
            });
        }
        let (taps, _centre) = fit_kernel_to_window(kernel, n);
        let shift = n / 2;
        // Fold the final roll by ⌊N/2⌋ into the kernel: correlating with
        // k'[m] = k[(m + ⌊N/2⌋) mod N] and not rolling gives the same output.
        let rolled: Vec<f64> = (0..n).map(|m| f64::from(taps[(m + shift) % n])).collect();
        // Offsets o = idx − ⌊N/2⌋ of the first and last fitted taps above the floor.
        let peak = taps.iter().fold(0.0f32, |a, &b| a.max(b.abs()));
        let floor = BLOCK_TAP_FLOOR * peak;
        let nz_first = taps.iter().position(|&v| v.abs() > floor);
        let nz_last = taps.iter().rposition(|&v| v.abs() > floor);
        let blocks = match (allow_blocks, nz_first, nz_last) {
            (true, Some(f), Some(l)) if (l - f + 1) * 4 <= n && n >= 8192 => {
                let k = l - f + 1;
                let fft_len = (8 * k).next_power_of_two();
                Some((
                    Blocks {
                        first: f as isize - shift as isize,
                        k,
                        per_block: fft_len - k + 1,
                    },
                    fft_len,
                ))
            }
            _ => None,
        };
        let (blocks, fft_len, spectrum) = match blocks {
            Some((b, fft_len)) => {
                let mut h = vec![0.0f64; fft_len];
                for (q, v) in h.iter_mut().take(b.k).enumerate() {
                    let o = b.first + q as isize;
                    *v = rolled[o.rem_euclid(n as isize) as usize];
                }
                (Some(b), fft_len, conj_spectrum(h)?)
            }
            None => (None, n, conj_spectrum(rolled)?),
        };
        let mut planner = RealFftPlanner::<f32>::new();
        let forward = planner.plan_fft_forward(fft_len);
        let inverse = planner.plan_fft_inverse(fft_len);
        let scratch_len = forward.get_scratch_len().max(inverse.get_scratch_len());
        Ok(HighpassFilter {
            n,
            taps,
            fft_len,
            spectrum,
            forward,
            inverse,
            scratch_len,
            blocks,
            pool: Mutex::new(Vec::new()),
        })
    }

    /// Window length N (columns) this filter was prepared for.
    pub fn window_len(&self) -> usize {
        self.n
    }

    /// The N fitted taps (Kilosort's `fft_highpass` input before its FFT).
    pub fn taps(&self) -> &[f32] {
        &self.taps
    }

    /// Whether the overlap-save (block) computation is in use.
    pub fn uses_blocks(&self) -> bool {
        self.blocks.is_some()
    }

    fn take_scratch(&self) -> HpScratch {
        let popped = self.pool.lock().ok().and_then(|mut p| p.pop());
        popped.unwrap_or_else(|| HpScratch {
            input: vec![0.0; self.fft_len],
            spectrum: vec![Complex::new(0.0, 0.0); self.fft_len / 2 + 1],
            fft: vec![Complex::new(0.0, 0.0); self.scratch_len],
            ext: match self.blocks {
                Some(b) => vec![0.0; self.n + b.k - 1],
                None => Vec::new(),
            },
            block_out: match self.blocks {
                Some(_) => vec![0.0; self.fft_len],
                None => Vec::new(),
            },
        })
    }

    fn give_scratch(&self, s: HpScratch) {
        if let Ok(mut p) = self.pool.lock() {
            p.push(s);
        }
    }

    /// `out` ← correlation of `input` with the stored kernel, circular over
    /// the FFT length F; `input` (F samples, destroyed), `spectrum` (F/2 + 1)
    /// and `fft` are scratch, `out` has F samples.
    fn correlate(
        &self,
        input: &mut [f32],
        spectrum: &mut [Complex<f32>],
        fft: &mut [Complex<f32>],
        out: &mut [f32],
    ) {
        // Lengths match by construction, so these calls cannot fail.
        let _ = self.forward.process_with_scratch(input, spectrum, fft);
        for (x, k) in spectrum.iter_mut().zip(&self.spectrum) {
            *x *= *k;
        }
        spectrum[0].im = 0.0;
        if self.fft_len.is_multiple_of(2) {
            spectrum[self.fft_len / 2].im = 0.0;
        }
        let _ = self.inverse.process_with_scratch(spectrum, out, fft);
    }

    /// Filters one channel in place. `row.len()` must equal N (checked by the callers).
    fn filter_row(&self, row: &mut [f32], s: &mut HpScratch) {
        let HpScratch {
            input,
            spectrum,
            fft,
            ext,
            block_out,
        } = s;
        let Some(b) = self.blocks else {
            input.copy_from_slice(row);
            self.correlate(input, spectrum, fft, row);
            return;
        };
        let n = self.n as isize;
        // ext[u] = x[(u + first) mod N], u < N + K − 1; then
        // y[t] = Σ_{q < K} h[first + q] · ext[t + q], a linear correlation.
        // Copied as whole runs of the row (at most three: wrap-arounds).
        let mut src = b.first.rem_euclid(n) as usize;
        let mut u = 0;
        while u < ext.len() {
            let take = (self.n - src).min(ext.len() - u);
            ext[u..u + take].copy_from_slice(&row[src..src + take]);
            u += take;
            src = 0;
        }
        let mut t0 = 0;
        while t0 < self.n {
            let take = (ext.len() - t0).min(self.fft_len);
            input[..take].copy_from_slice(&ext[t0..t0 + take]);
            input[take..].fill(0.0);
            // Outputs 0..=F−K of a block use no wrapped-around input.
            let m = b.per_block.min(self.n - t0);
            if t0 + self.fft_len <= self.n {
                // Straight into the row: the F − m values past this block's
                // outputs are overwritten by the next blocks' (their inputs
                // come from `ext`, not from the row).
                self.correlate(input, spectrum, fft, &mut row[t0..t0 + self.fft_len]);
            } else {
                self.correlate(input, spectrum, fft, block_out);
                row[t0..t0 + m].copy_from_slice(&block_out[..m]);
            }
            t0 += m;
        }
    }

    /// Filters one channel (`row`, N samples) in place.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if `row.len()` ≠ N.
    pub fn apply_row(&self, row: &mut [f32]) -> Result<(), PreprocessError> {
        if row.len() != self.n {
            return Err(PreprocessError::Shape {
                what: "high-pass input row",
                rows: 1,
                cols: row.len(),
                expected_rows: 1,
                expected_cols: self.n,
            });
        }
        let mut s = self.take_scratch();
        self.filter_row(row, &mut s);
        self.give_scratch(s);
        Ok(())
    }

    /// Filters every channel (row) of a (C × N) window in place, rows in
    /// parallel; buffers are reused between calls.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if the window does not have N columns.
    pub fn apply(&self, window: &mut Array2<f32>) -> Result<(), PreprocessError> {
        window_values(window, self.n)?
            .par_chunks_mut(self.n)
            .for_each_init(
                || ScratchGuard {
                    owner: self,
                    s: Some(self.take_scratch()),
                },
                |g, row| {
                    if let Some(s) = g.s.as_mut() {
                        self.filter_row(row, s);
                    }
                },
            );
        Ok(())
    }
}

/// Returns a scratch buffer to its filter's pool when a rayon job ends.
struct ScratchGuard<'a> {
    owner: &'a HighpassFilter,
    s: Option<HpScratch>,
}

impl Drop for ScratchGuard<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.s.take() {
            self.owner.give_scratch(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn butterworth_matches_scipy_design() {
        let (b, a) = butterworth_highpass(30000.0, 300.0).unwrap();
        let b_ref = [0.93909165, -2.81727496, 2.81727496, -0.93909165];
        let a_ref = [1.0, -2.87435689, 2.75648320, -0.88189313];
        for i in 0..4 {
            assert!((b[i] - b_ref[i]).abs() < 1e-8, "b[{i}] = {}", b[i]);
            assert!((a[i] - a_ref[i]).abs() < 1e-8, "a[{i}] = {}", a[i]);
        }
    }

    #[test]
    fn kernel_properties() {
        let h = highpass_kernel(30000.0, 300.0).unwrap();
        assert_eq!(h.len(), KERNEL_LEN);
        assert!((h[KERNEL_CENTRE] - 0.979_059_46).abs() < 1e-7);
        assert!((h[KERNEL_CENTRE + 1] + 0.020_919_9).abs() < 1e-7);
        for j in 1..4000 {
            assert!((h[KERNEL_CENTRE + j] - h[KERNEL_CENTRE - j]).abs() < 1e-9);
        }
    }

    #[test]
    fn bad_cutoff_is_an_error() {
        assert!(highpass_kernel(30000.0, 15000.0).is_err());
        assert!(highpass_kernel(30000.0, 0.0).is_err());
        assert!(highpass_kernel(f64::NAN, 300.0).is_err());
    }

    /// The FFT filter equals the direct circular correlation with shift s.
    fn check_against_direct(n: usize, expected_shift: isize) {
        let h = highpass_kernel(30000.0, 300.0).unwrap();
        let filt = HighpassFilter::new(&h, n).unwrap();
        let mut x = vec![0.0f32; n];
        let mut state = 12345u64;
        for v in x.iter_mut() {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *v = ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
        }
        let mut y = x.clone();
        filt.apply_row(&mut y).unwrap();
        let nn = n as isize;
        for t in [0usize, 1, 7, n / 2, n - 3, n - 1] {
            let mut acc = 0.0f64;
            for j in -3000isize..3000 {
                let g = f64::from(h[(KERNEL_CENTRE as isize + j) as usize]);
                let idx = (t as isize + j + expected_shift).rem_euclid(nn) as usize;
                acc += g * f64::from(x[idx]);
            }
            assert!(
                (acc - f64::from(y[t])).abs() < 1e-5,
                "n={n} t={t}: {acc} vs {}",
                y[t]
            );
        }
    }

    #[test]
    fn circular_correlation_and_shift() {
        check_against_direct(6122, 0);
        check_against_direct(6123, 1);
        check_against_direct(30_123, 0);
        check_against_direct(30_124, 0);
        check_against_direct(12_001, 1);
        check_against_direct(60_122, 0);
        check_against_direct(60_123, 0);
    }

    #[test]
    fn blocks_equal_full_fft() {
        let h = highpass_kernel(30000.0, 300.0).unwrap();
        for n in [60_122usize, 60_123, 30_123, 45_001, 12_001, 20_000] {
            let fast = HighpassFilter::new(&h, n).unwrap();
            let full = HighpassFilter::new_full_fft(&h, n).unwrap();
            assert!(fast.uses_blocks(), "n = {n}");
            let mut state = 99u64;
            let x: Vec<f32> = (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
                })
                .collect();
            let mut a = x.clone();
            let mut b = x.clone();
            fast.apply_row(&mut a).unwrap();
            full.apply_row(&mut b).unwrap();
            let d = a
                .iter()
                .zip(&b)
                .fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
            // Unit-scale noise (RMS 0.29): both are f32 FFTs of the same sum.
            assert!(d < 2e-6, "n = {n}: max diff {d}");
        }
        assert!(!HighpassFilter::new(&h, 6122).unwrap().uses_blocks());
    }

    #[test]
    fn wrong_length_is_an_error() {
        let h = highpass_kernel(30000.0, 300.0).unwrap();
        let filt = HighpassFilter::new(&h, 100).unwrap();
        let mut w = Array2::<f32>::zeros((2, 99));
        assert!(filt.apply(&mut w).is_err());
    }
}
