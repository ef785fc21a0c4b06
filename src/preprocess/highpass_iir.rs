//! Kilosort4's high-pass as a circular forward–backward IIR: the CPU twin of the
//! device kernels in `crate::detect::gpu::highpass_iir`.
//!
//! [`HighpassFilter`](super::HighpassFilter) computes
//! `y[t] = Σ_j g[j]·x[(t + j + s) mod N]`, g the filtfilt impulse response of the
//! 3rd-order Butterworth (b, a) ([`butterworth_highpass`]) fitted to the window
//! ([`fit_kernel_to_window`](super::fit_kernel_to_window)) and s its shift. g
//! is the autocorrelation of the causal response h of (b, a), so the same
//! operator is the causal recursion (b, a) run *circularly* over the row
//! (u = h ⊛ x), then run backwards circularly over u (y = h ⋆ u): about seven
//! multiply-adds per sample and direction instead of one per tap (~1000 on
//! the device's direct kernel).
//!
//! The circular recursion is cut into chunks of C consecutive outputs per row,
//! each computed on its own (one device unit each):
//! * forward: zero state at (chunk start − L) mod N, the direct-form-II-
//!   transposed recursion ([`CircularIir::forward_chunk`], the arithmetic of
//!   scipy's `lfilter`) over L warm-up samples, then over the chunk's C samples,
//!   whose outputs u are kept;
//! * backward (once the u it reads is written: on the device after every
//!   chunk's forward pass, on the CPU as soon as the next chunks' forward
//!   passes are done): zero state at (chunk end + L)
//!   mod N, the same recursion run down over u through the next chunks' values,
//!   then over the chunk, whose outputs are y ([`CircularIir::backward_chunk`]).
//!
//! Error of the warm-up: starting from zero state drops the terms
//! `Σ_{k > L} h[k]·x[t − k]` of each pass, so
//! `max|y − y_exact| ≤ 2·‖h‖₁·Σ_{k > L}|h[k]| · max|x|` ([`warm_up_bound`]).
//! [`CircularIir::new`] takes the smallest L with that bound ≤ [`IIR_BOUND`]
//! (1e-10): L = 800 for 300 Hz at 30 kHz (poles of radius 0.969, 0.969 and
//! 0.939 per sample; bound 9.8e-11).
//!
//! Measured (tests below; f64 state, L = 800; C = 1024, 777, 256, 100 and
//! whole rows; unit noise and spike-like rows; N = 60 122, 60 123, 6122, 6123,
//! 1501, 1447): the chunked IIR, unrounded, equals the exact circular
//! correlation with the f64 kernel within 5.6e-12 of max|x| (f64 rounding
//! amplified by the poles near 1; the warm-up bound is 1e-10), and, rounded to
//! f32, the CPU's [`HighpassFilter`](super::HighpassFilter) within 8.4e-7 of
//! max|x| (the CPU's float32 FFT and f32 kernel). With f32 state and u the
//! recursion's rounding reaches 3.1e-4 of max|x|: hence f64 state on the device.
//!
//! The circular IIR is the *infinite* zero-phase filter wrapped onto the
//! window; the CPU's kernel is that response cut to the N taps nearest its
//! centre (N < 30 122). The two differ by [`crop_difference`] (the ℓ1 norm of
//! the taps cut off and the wrapped-in tails), ≤ [`IIR_BOUND`] of max|x| from
//! N = 1447 on at 300 Hz / 30 kHz; [`CircularIir::new`] declines shorter windows.

use ndarray::Array2;
use rayon::prelude::*;

use crate::error::PreprocessError;

use super::highpass::{KERNEL_CENTRE, KERNEL_LEN, butterworth_highpass, highpass_kernel_f64};

/// Target error of the circular IIR against the CPU's f64 operator, relative
/// to max|x|: bound on the warm-up error ([`warm_up_bound`]) and on
/// [`crop_difference`].
pub const IIR_BOUND: f64 = 1e-10;
/// Longest warm-up L taken, samples (about cutoff/fs ≥ 0.0007): beyond it
/// [`CircularIir::new`] declines and the device keeps the direct kernel.
pub const MAX_WARM: usize = 16_384;
/// Outputs per chunk C of the IIR, on the device and on the CPU, by default
/// ([`iir_chunk`]: the environment variable `SPIKECUBE_HIGHPASS_CHUNK`
/// overrides it on both, for measuring).
pub const IIR_CHUNK: usize = 1024;

/// Outputs per chunk C of the IIR, on the device and on the CPU (which must
/// cut the rows as the device does to give its bits): [`IIR_CHUNK`] unless the
/// environment variable `SPIKECUBE_HIGHPASS_CHUNK` names another positive
/// number (for measuring).
pub fn iir_chunk() -> usize {
    std::env::var("SPIKECUBE_HIGHPASS_CHUNK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&c| c > 0)
        .unwrap_or(IIR_CHUNK)
}

/// The float type of the recursion's state and of u: f64 on the device where it
/// has doubles (CUDA), f32 for studying the rounding and testing the device's
/// indexing on WGSL (no doubles).
pub trait IirFloat:
    Copy
    + Send
    + Sync
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
{
    /// Zero.
    const ZERO: Self;
    /// `v` rounded to this type.
    fn of_f64(v: f64) -> Self;
    /// `v` in this type (exact).
    fn of_f32(v: f32) -> Self;
    /// Rounded to f32.
    fn to_f32(self) -> f32;
}

impl IirFloat for f64 {
    const ZERO: Self = 0.0;
    fn of_f64(v: f64) -> Self {
        v
    }
    fn of_f32(v: f32) -> Self {
        f64::from(v)
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
}

impl IirFloat for f32 {
    const ZERO: Self = 0.0;
    fn of_f64(v: f64) -> Self {
        v as f32
    }
    fn of_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

/// One step of the direct-form-II-transposed recursion (scipy's `lfilter`;
/// the device kernels use the same expressions in the same order): returns
/// the output for input `xn` and updates the state `z`.
#[inline(always)]
fn step<F: IirFloat>(b: &[F; 4], a: &[F; 4], xn: F, z: &mut [F; 3]) -> F {
    let yn = b[0] * xn + z[0];
    z[0] = z[1] + b[1] * xn - a[1] * yn;
    z[1] = z[2] + b[2] * xn - a[2] * yn;
    z[2] = b[3] * xn - a[3] * yn;
    yn
}

/// The first `len` samples of the causal impulse response h of (b, a).
fn impulse_response(b: &[f64; 4], a: &[f64; 4], len: usize) -> Vec<f64> {
    let mut z = [0.0; 3];
    (0..len)
        .map(|k| step(b, a, if k == 0 { 1.0 } else { 0.0 }, &mut z))
        .collect()
}

/// Bound on the chunked IIR's error relative to max|x| for warm-up `warm`:
/// `2·‖h‖₁·Σ_{k > warm}|h[k]|`, h the causal impulse response of (b, a)
/// (summed over 4·[`MAX_WARM`] samples; a stable design's h is below f64
/// resolution long before). Returns +∞ for an unstable design.
pub fn warm_up_bound(b: &[f64; 4], a: &[f64; 4], warm: usize) -> f64 {
    let h = impulse_response(b, a, (4 * MAX_WARM).max(warm + 2));
    let l1: f64 = h.iter().map(|v| v.abs()).sum();
    let tail: f64 = h[warm + 1..].iter().map(|v| v.abs()).sum();
    if l1.is_finite() {
        2.0 * l1 * tail
    } else {
        f64::INFINITY
    }
}

/// The smallest warm-up L ≤ [`MAX_WARM`] with [`warm_up_bound`] ≤ `bound`.
fn smallest_warm_up(b: &[f64; 4], a: &[f64; 4], bound: f64) -> Option<usize> {
    let h = impulse_response(b, a, 4 * MAX_WARM);
    let l1: f64 = h.iter().map(|v| v.abs()).sum();
    if !l1.is_finite() {
        return None;
    }
    // tails[k] = Σ_{i ≥ k}|h[i]|, summed from the end.
    let mut tail = 0.0;
    let mut tails = vec![0.0; h.len() + 1];
    for k in (0..h.len()).rev() {
        tail += h[k].abs();
        tails[k] = tail;
    }
    (0..=MAX_WARM).find(|&l| 2.0 * l1 * tails[l + 1] <= bound)
}

/// The shift s of [`HighpassFilter`](super::HighpassFilter)'s operator for a
/// window of `n` columns and Kilosort's kernel length: the centre's index among
/// the fitted taps minus ⌊n/2⌋ (1 for odd n < 30 122, else 0).
pub fn window_shift(n: usize) -> usize {
    let centre = if n <= KERNEL_LEN {
        KERNEL_CENTRE - (KERNEL_LEN - n) / 2
    } else {
        KERNEL_CENTRE + (n - KERNEL_LEN) / 2
    };
    centre - n / 2
}

/// ℓ1 distance between the circular IIR's operator (the full zero-phase
/// response `kernel`, [`KERNEL_LEN`] f64 taps centred at [`KERNEL_CENTRE`],
/// wrapped onto `n` samples) and the CPU's (the same taps fitted to the window by
/// [`fit_kernel_to_window`](super::fit_kernel_to_window)): a bound on their
/// outputs' difference relative to max|x| (0 for n ≥ 30 122, where nothing is
/// cut or wrapped).
pub fn crop_difference(kernel: &[f64], n: usize) -> f64 {
    let len = kernel.len();
    if n >= len {
        return 0.0;
    }
    let start = (len - n) / 2;
    let centre = len / 2 - start;
    let mut wrapped = vec![0.0f64; n];
    for (i, &g) in kernel.iter().enumerate() {
        // Lag j = i − len/2 lands on fitted index (j + centre) mod n.
        let idx = (i + centre + n * len - len / 2) % n;
        wrapped[idx] += g;
    }
    wrapped
        .iter()
        .zip(&kernel[start..start + n])
        .map(|(w, k)| (w - k).abs())
        .sum()
}

/// [`CircularIir::new`] for a preprocessor given the full f32 `kernel`: `None`
/// also when the kernel is not the design's of (`fs`, `cutoff`) rounded to f32
/// (within an f32 rounding and 1e-20, e.g. Kilosort's own `hp_filter`), so that
/// the IIR never replaces another kernel.
///
/// # Errors
/// As [`butterworth_highpass`].
pub(crate) fn iir_for_kernel(
    fs: f64,
    cutoff: f64,
    kernel: &[f32],
    n: usize,
) -> Result<Option<CircularIir>, PreprocessError> {
    let (b, a) = butterworth_highpass(fs, cutoff)?;
    let design = highpass_kernel_f64(fs, cutoff)?;
    let same = kernel.len() == design.len()
        && kernel
            .iter()
            .zip(&design)
            .all(|(&k, &g)| (f64::from(k) - g).abs() <= f64::from(f32::EPSILON) * g.abs() + 1e-20);
    Ok(if same {
        CircularIir::for_kernel(b, a, &design, n)
    } else {
        None
    })
}

/// The high-pass of one window length as a chunked circular forward–backward
/// IIR (see the module docs): the design (b, a), the window length N, the
/// shift s and the warm-up L.
#[derive(Debug, Clone, PartialEq)]
pub struct CircularIir {
    /// Numerator of the Butterworth design ([`butterworth_highpass`]).
    pub b: [f64; 4],
    /// Denominator, `a[0]` = 1.
    pub a: [f64; 4],
    /// Window length N, samples.
    pub n: usize,
    /// The CPU operator's shift s ([`window_shift`]): output t is the zero-phase
    /// filter's value at (t + s) mod N; applied by reading x from (t + s) mod N.
    pub shift: usize,
    /// Warm-up L, samples, of each chunk in each direction.
    pub warm: usize,
}

impl CircularIir {
    /// The IIR form of Kilosort's high-pass at `cutoff` Hz for sampling rate
    /// `fs` Hz and windows of `n` samples, when it equals the CPU's operator
    /// within [`IIR_BOUND`] of max|x| (up to the CPU's float32 roundings):
    /// `None` when the warm-up would exceed [`MAX_WARM`] or the window is so
    /// short that the CPU's cropped kernel differs ([`crop_difference`]).
    ///
    /// # Errors
    /// As [`butterworth_highpass`].
    pub fn new(fs: f64, cutoff: f64, n: usize) -> Result<Option<Self>, PreprocessError> {
        let (b, a) = butterworth_highpass(fs, cutoff)?;
        let kernel = highpass_kernel_f64(fs, cutoff)?;
        Ok(Self::for_kernel(b, a, &kernel, n))
    }

    /// As [`CircularIir::new`] with the design and its f64 kernel given.
    pub(crate) fn for_kernel(b: [f64; 4], a: [f64; 4], kernel: &[f64], n: usize) -> Option<Self> {
        if n == 0 || crop_difference(kernel, n) > IIR_BOUND {
            return None;
        }
        let warm = smallest_warm_up(&b, &a, IIR_BOUND)?;
        Some(CircularIir {
            b,
            a,
            n,
            shift: window_shift(n),
            warm,
        })
    }

    /// The coefficients in `F`: (b, a).
    fn coefficients<F: IirFloat>(&self) -> ([F; 4], [F; 4]) {
        (self.b.map(F::of_f64), self.a.map(F::of_f64))
    }

    /// Forward pass of the chunk of `len` outputs from `start`: u\[start + i\] for
    /// i < len, from zero state at (start + s − L) mod N in x's indices.
    /// `x` and `u`: one row, N samples.
    pub fn forward_chunk<F: IirFloat>(&self, x: &[f32], u: &mut [F], start: usize, len: usize) {
        let n = self.n;
        let (b, a) = self.coefficients::<F>();
        let mut z = [F::ZERO; 3];
        // (start + s − L) mod N without negative numbers (as on the device).
        let mut p = (start + self.shift + (n - self.warm % n)) % n;
        for _ in 0..self.warm {
            step(&b, &a, F::of_f32(x[p]), &mut z);
            p += 1;
            if p == n {
                p = 0;
            }
        }
        for i in 0..len {
            u[start + i] = step(&b, &a, F::of_f32(x[p]), &mut z);
            p += 1;
            if p == n {
                p = 0;
            }
        }
    }

    /// Backward pass of the chunk of `len` outputs from `start`: y\[start + i\]
    /// for i < len, from zero state at (start + len − 1 + L) mod N, running down
    /// over u (which must hold every chunk's forward output). `u` and `y`: one
    /// row, N samples.
    pub fn backward_chunk<F: IirFloat>(&self, u: &[F], y: &mut [f32], start: usize, len: usize) {
        self.backward_chunk_with(u, start, len, |p, v: F| y[p] = v.to_f32());
    }

    /// [`CircularIir::backward_chunk`] handing each output (index, value in
    /// `F`) to `out`, unrounded.
    fn backward_chunk_with<F: IirFloat>(
        &self,
        u: &[F],
        start: usize,
        len: usize,
        mut out: impl FnMut(usize, F),
    ) {
        let n = self.n;
        let (b, a) = self.coefficients::<F>();
        let mut z = [F::ZERO; 3];
        let mut p = (start + len - 1 + self.warm) % n;
        for _ in 0..self.warm {
            step(&b, &a, u[p], &mut z);
            p = if p == 0 { n - 1 } else { p - 1 };
        }
        for _ in 0..len {
            out(p, step(&b, &a, u[p], &mut z));
            p = if p == 0 { n - 1 } else { p - 1 };
        }
    }

    /// The chunked filter of one row `x` (N samples) with `chunk` > 0 outputs
    /// per chunk, unrounded: every chunk's forward pass, then every chunk's
    /// backward pass.
    fn filter_row<F: IirFloat>(&self, x: &[f32], chunk: usize, out: impl FnMut(usize, F)) {
        let mut out = out;
        let mut u = vec![F::ZERO; self.n];
        let starts = (0..self.n).step_by(chunk);
        for s in starts.clone() {
            self.forward_chunk(x, &mut u, s, chunk.min(self.n - s));
        }
        for s in starts {
            self.backward_chunk_with(&u, s, chunk.min(self.n - s), &mut out);
        }
    }

    /// [`CircularIir::apply_row`] without the final rounding to f32 (for
    /// measuring the IIR's own error).
    ///
    /// # Panics
    /// If `x.len()` ≠ N or `chunk` is 0.
    pub fn filter_row_unrounded<F: IirFloat>(&self, x: &[f32], chunk: usize) -> Vec<F> {
        assert!(
            x.len() == self.n && chunk > 0,
            "a row of N samples, chunk > 0"
        );
        let mut y = vec![F::ZERO; self.n];
        self.filter_row(x, chunk, |p, v| y[p] = v);
        y
    }

    /// Filters one row (N samples) in place with chunks of `chunk` outputs
    /// (the last may be shorter), state and u in `F`: every chunk's forward
    /// pass, then every chunk's backward pass, as the device does.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if `row.len()` ≠ N; [`PreprocessError::Setting`]
    /// if `chunk` is 0.
    pub fn apply_row<F: IirFloat>(
        &self,
        row: &mut [f32],
        chunk: usize,
    ) -> Result<(), PreprocessError> {
        if row.len() != self.n {
            return Err(PreprocessError::Shape {
                what: "high-pass input row",
                rows: 1,
                cols: row.len(),
                expected_rows: 1,
                expected_cols: self.n,
            });
        }
        if chunk == 0 {
            return Err(PreprocessError::Setting {
                name: "highpass chunk",
                message: "is 0; a chunk has at least one output".into(),
            });
        }
        // Every chunk's forward output is taken before the row is overwritten.
        let y = self.filter_row_unrounded::<F>(row, chunk);
        for (r, v) in row.iter_mut().zip(y) {
            *r = v.to_f32();
        }
        Ok(())
    }

    /// [`CircularIir::apply_row`] on every row of a (C × N) window, rows in parallel.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if the window does not have N columns;
    /// [`PreprocessError::Setting`] if `chunk` is 0.
    pub fn apply<F: IirFloat>(
        &self,
        window: &mut Array2<f32>,
        chunk: usize,
    ) -> Result<(), PreprocessError> {
        super::highpass::window_values(window, self.n)?
            .par_chunks_mut(self.n)
            .try_for_each(|row| self.apply_row::<F>(row, chunk))
    }
}

/// Rows filtered together by [`CircularIir::apply_f64`], one per SIMD lane.
const ROW_LANES: usize = 16;

/// [`step`] for [`ROW_LANES`] rows at once: lane l is row l's recursion, with
/// the same f64 operations in the same order, so the same bits.
#[inline(always)]
fn step_lanes(
    b: &[f64; 4],
    a: &[f64; 4],
    xn: &[f64; ROW_LANES],
    z: &mut [[f64; ROW_LANES]; 3],
) -> [f64; ROW_LANES] {
    let mut yn = [0f64; ROW_LANES];
    for l in 0..ROW_LANES {
        yn[l] = b[0] * xn[l] + z[0][l];
        z[0][l] = z[1][l] + b[1] * xn[l] - a[1] * yn[l];
        z[1][l] = z[2][l] + b[2] * xn[l] - a[2] * yn[l];
        z[2][l] = b[3] * xn[l] - a[3] * yn[l];
    }
    yn
}

/// Where [`CircularIir::filter_rows_f64`] keeps u, chunk by chunk: the
/// first `lag` chunks for good (the last chunks' backward passes wrap round
/// to them), every later chunk in one of `lag + 1` slots used in turn. A
/// chunk's backward pass reads u up to `warm` samples past its end, so at
/// most `lag` chunks ahead, and `lag` = 1 + ⌈warm / chunk⌉ also keeps the
/// forward pass `lag` chunks ahead from reading samples already overwritten.
struct UBuffer {
    n: usize,
    chunk: usize,
    n_chunks: usize,
    lag: usize,
    /// Chunks kept for good: min(lag, n_chunks).
    head: usize,
}

impl UBuffer {
    fn new(n: usize, chunk: usize, warm: usize) -> Self {
        let n_chunks = n.div_ceil(chunk);
        let lag = 1 + warm.div_ceil(chunk);
        UBuffer {
            n,
            chunk,
            n_chunks,
            lag,
            head: lag.min(n_chunks),
        }
    }

    /// Entries in the buffer: the kept chunks, then the slots.
    fn len(&self) -> usize {
        let slots = if self.n_chunks > self.head {
            self.lag + 1
        } else {
            0
        };
        (self.head + slots) * self.chunk
    }

    /// Where chunk `c`'s first entry is.
    fn base(&self, c: usize) -> usize {
        if c < self.head {
            c * self.chunk
        } else {
            (self.head + c % (self.lag + 1)) * self.chunk
        }
    }

    /// The first sample of the chunk holding sample `p` (< N), and where that
    /// chunk's entries start.
    fn locate(&self, p: usize) -> (usize, usize) {
        debug_assert!(p < self.n);
        let c = p / self.chunk;
        (c * self.chunk, self.base(c))
    }
}

impl CircularIir {
    /// [`CircularIir::apply_row`] with f64 state on up to [`ROW_LANES`]
    /// consecutive rows of `rows` (N samples each) at once, in place: every
    /// row's recursion as the row alone would run it (the same chunks, steps
    /// and operations), its lanes side by side in vectors. Lanes past the last
    /// row filter zeros and are dropped. Inlined into each of
    /// [`CircularIir::filter_rows_dispatch`]'s wrappers, so that it is
    /// compiled for their vector instructions (a call would run the baseline
    /// build).
    ///
    /// Chunks are independent, so only their order differs from the row
    /// alone's: each chunk's backward pass runs as soon as the forward passes
    /// it reads are done, [`UBuffer::lag`] chunks behind, so that u (16 f64 a
    /// sample) lives in a few chunks' worth of cache-sized buffer rather than
    /// a whole row's (7.7 MB at 60 122 samples, which went to memory and back).
    /// The lag also keeps every forward pass's reads ahead of the outputs
    /// written in place. Chunk 0's backward pass runs last, after the last
    /// forward pass has read the row's first `shift` samples.
    #[inline(always)]
    fn filter_rows_f64(&self, rows: &mut [f32], chunk: usize, u: &mut Vec<[f64; ROW_LANES]>) {
        let n = self.n;
        let k = rows.len() / n;
        let ub = UBuffer::new(n, chunk, self.warm);
        // Every u entry a backward pass reads was written by a forward pass
        // before it: no need to clear what the buffer held.
        if u.len() < ub.len() {
            u.resize(ub.len(), [0f64; ROW_LANES]);
        }
        let u = &mut u[..ub.len()];
        // A full group (all but the last group of a probe) moves its 16
        // lanes with no per-lane test.
        if k == ROW_LANES {
            self.chunks_in_order::<true>(k, &ub, rows, u);
        } else {
            self.chunks_in_order::<false>(k, &ub, rows, u);
        }
    }

    /// Every chunk's two passes of [`CircularIir::filter_rows_f64`], in the
    /// order its docs give. `FULL`: `k` is [`ROW_LANES`].
    #[inline(always)]
    fn chunks_in_order<const FULL: bool>(
        &self,
        k: usize,
        ub: &UBuffer,
        rows: &mut [f32],
        u: &mut [[f64; ROW_LANES]],
    ) {
        let n_chunks = ub.n_chunks;
        for c in 0..n_chunks {
            self.forward_lanes::<FULL>(c, k, ub, rows, u);
            // Chunk 0's backward pass waits for the end.
            if c > ub.lag {
                self.backward_lanes::<FULL>(c - ub.lag, k, ub, rows, u);
            }
        }
        for c in n_chunks.saturating_sub(ub.lag).max(1)..n_chunks {
            self.backward_lanes::<FULL>(c, k, ub, rows, u);
        }
        self.backward_lanes::<FULL>(0, k, ub, rows, u);
    }

    /// The forward pass of chunk `c` of [`CircularIir::filter_rows_f64`]'s
    /// `k` rows, into its place in u.
    #[inline(always)]
    fn forward_lanes<const FULL: bool>(
        &self,
        c: usize,
        k: usize,
        ub: &UBuffer,
        rows: &[f32],
        u: &mut [[f64; ROW_LANES]],
    ) {
        let n = self.n;
        let (b, a) = (self.b, self.a);
        let start = c * ub.chunk;
        let len = ub.chunk.min(n - start);
        let dst = &mut u[ub.base(c)..ub.base(c) + len];
        let mut z = [[0f64; ROW_LANES]; 3];
        let mut p = (start + self.shift + (n - self.warm % n)) % n;
        let k = if FULL { ROW_LANES } else { k };
        assert!(rows.len() >= k * n);
        let mut xf = [0f32; ROW_LANES];
        for i in 0..self.warm + len {
            for (l, v) in xf.iter_mut().enumerate().take(k) {
                *v = rows[l * n + p];
            }
            let xn = xf.map(f64::from);
            let yn = step_lanes(&b, &a, &xn, &mut z);
            if i >= self.warm {
                dst[i - self.warm] = yn;
            }
            p += 1;
            if p == n {
                p = 0;
            }
        }
    }

    /// The backward pass of chunk `c` of [`CircularIir::filter_rows_f64`]'s
    /// `k` rows, from u into the rows.
    #[inline(always)]
    fn backward_lanes<const FULL: bool>(
        &self,
        c: usize,
        k: usize,
        ub: &UBuffer,
        rows: &mut [f32],
        u: &[[f64; ROW_LANES]],
    ) {
        let n = self.n;
        let (b, a) = (self.b, self.a);
        let start = c * ub.chunk;
        let len = ub.chunk.min(n - start);
        let mut z = [[0f64; ROW_LANES]; 3];
        let mut p = (start + len - 1 + self.warm) % n;
        // u[p] is u[base + p − first] while p stays in the chunk from `first`.
        let (mut first, mut base) = ub.locate(p);
        let k = if FULL { ROW_LANES } else { k };
        assert!(rows.len() >= k * n);
        for i in 0..self.warm + len {
            let yn = step_lanes(&b, &a, &u[base + p - first], &mut z);
            if i >= self.warm {
                let yf = yn.map(|v| v as f32);
                for (l, &v) in yf.iter().enumerate().take(k) {
                    rows[l * n + p] = v;
                }
            }
            if p == first {
                p = if p == 0 { n - 1 } else { p - 1 };
                (first, base) = ub.locate(p);
            } else {
                p -= 1;
            }
        }
    }

    /// [`CircularIir::apply`] with f64 state, the same bits, faster: rows in
    /// groups of 16 filtered side by side (SIMD lanes, AVX-512 or
    /// AVX2 where the CPU has them), groups in parallel. The CPU's high-pass.
    ///
    /// # Errors
    /// As [`CircularIir::apply`].
    pub fn apply_f64(&self, window: &mut Array2<f32>, chunk: usize) -> Result<(), PreprocessError> {
        if chunk == 0 {
            return Err(PreprocessError::Setting {
                name: "highpass chunk",
                message: "is 0; a chunk has at least one output".into(),
            });
        }
        let n = self.n;
        super::highpass::window_values(window, n)?
            .par_chunks_mut(ROW_LANES * n)
            .for_each_init(Vec::new, |u, rows| {
                self.filter_rows_dispatch(rows, chunk, u)
            });
        Ok(())
    }

    /// [`CircularIir::filter_rows_f64`] compiled for the widest vectors the CPU has.
    fn filter_rows_dispatch(&self, rows: &mut [f32], chunk: usize, u: &mut Vec<[f64; ROW_LANES]>) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            fn avx512(
                iir: &CircularIir,
                rows: &mut [f32],
                chunk: usize,
                u: &mut Vec<[f64; ROW_LANES]>,
            ) {
                iir.filter_rows_f64(rows, chunk, u)
            }
            #[target_feature(enable = "avx2")]
            fn avx2(
                iir: &CircularIir,
                rows: &mut [f32],
                chunk: usize,
                u: &mut Vec<[f64; ROW_LANES]>,
            ) {
                iir.filter_rows_f64(rows, chunk, u)
            }
            if crate::simd::avx512() {
                // SAFETY: the CPU supports AVX-512F, checked just above.
                return unsafe { avx512(self, rows, chunk, u) };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2, checked just above.
                return unsafe { avx2(self, rows, chunk, u) };
            }
        }
        self.filter_rows_f64(rows, chunk, u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::{HighpassFilter, highpass_kernel};

    fn lcg(state: &mut u64) -> f64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*state >> 11) as f64) / (1u64 << 53) as f64
    }

    /// The lane-parallel f64 filter gives every row the bits of the row alone,
    /// for partial groups of rows, odd lengths and chunks.
    #[test]
    fn rows_side_by_side_equal_rows_alone() {
        for (n, rows, chunk) in [
            (6122, 13, 1024),
            (6123, 8, 777),
            (1501, 3, 100),
            (60_122, 17, 1024),
            // Fewer chunks than the backward pass's lag, one chunk, and
            // chunks shorter than the warm-up with a short last chunk.
            (1447, 16, 1024),
            (1447, 5, 2000),
            (2999, 16, 64),
        ] {
            let iir = CircularIir::new(30_000.0, 300.0, n).unwrap().unwrap();
            let mut seed = n as u64 + rows as u64;
            let x =
                Array2::from_shape_fn((rows, n), |_| (lcg(&mut seed) * 2.0 - 1.0) as f32 * 50.0);
            let mut alone = x.clone();
            iir.apply::<f64>(&mut alone, chunk).unwrap();
            let mut lanes = x.clone();
            iir.apply_f64(&mut lanes, chunk).unwrap();
            let differ = alone
                .iter()
                .zip(&lanes)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(differ, 0, "n {n}, {rows} rows, chunk {chunk}");
        }
    }

    /// Unit-scale uniform noise (mean-free, as after CAR).
    fn noise_row(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n).map(|_| (lcg(&mut s) - 0.5) as f32).collect()
    }

    /// Noise (sd ≈ 3) with spikes of −60 to −100 every ~300 samples (each a
    /// 30-sample biphasic shape), a slow sine and an offset, like a raw channel.
    fn spike_row(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut x: Vec<f64> = (0..n)
            .map(|t| {
                6.0 * (lcg(&mut s) - 0.5) * 1.7
                    + 20.0 * (t as f64 * 2.0 * std::f64::consts::PI / 7000.0).sin()
                    + 5.0
            })
            .collect();
        let mut t = 17;
        while t + 30 < n {
            let amp = 60.0 + 40.0 * lcg(&mut s);
            for k in 0..30 {
                let ph = k as f64 / 30.0;
                x[t + k] -= amp * (std::f64::consts::PI * ph).sin() * (1.0 - 1.6 * ph);
            }
            t += 200 + (200.0 * lcg(&mut s)) as usize;
        }
        x.into_iter().map(|v| v as f32).collect()
    }

    /// The exact operator in f64: Σ_j g[j]·x[(t + j + s) mod N] over lags
    /// |j| ≤ 1500 of the f64 kernel (the rest sum to < 1e-17).
    fn reference(kernel: &[f64], x: &[f32], shift: usize) -> Vec<f64> {
        let n = x.len();
        let c = KERNEL_CENTRE;
        let lags = 1500usize.min(c);
        (0..n)
            .map(|t| {
                let mut acc = 0.0;
                for (i, g) in kernel.iter().enumerate().take(c + lags + 1).skip(c - lags) {
                    // j = i − c; index (t + j + s) mod N.
                    let idx = (t + i + shift + n * c - c) % n;
                    acc += g * f64::from(x[idx]);
                }
                acc
            })
            .collect()
    }

    fn max_abs(v: &[f32]) -> f64 {
        v.iter().fold(0.0f64, |m, &a| m.max(f64::from(a.abs())))
    }

    #[test]
    fn warm_up_for_the_default_design() {
        let (b, a) = butterworth_highpass(30_000.0, 300.0).unwrap();
        let iir = CircularIir::new(30_000.0, 300.0, 60_122).unwrap().unwrap();
        assert_eq!(iir.warm, 800);
        assert_eq!(iir.shift, 0);
        let bound = warm_up_bound(&b, &a, iir.warm);
        assert!(bound <= IIR_BOUND && bound > 0.9e-10, "{bound}");
        assert!(warm_up_bound(&b, &a, iir.warm - 1) > IIR_BOUND);
        // A lower cutoff needs a longer warm-up (slower poles).
        let low = CircularIir::new(30_000.0, 100.0, 60_122).unwrap().unwrap();
        assert!(low.warm > 2 * iir.warm, "{}", low.warm);
    }

    #[test]
    fn shift_matches_the_cpu_operator() {
        for (n, s) in [
            (6122, 0),
            (6123, 1),
            (30_123, 0),
            (12_001, 1),
            (60_122, 0),
            (60_123, 0),
        ] {
            assert_eq!(window_shift(n), s, "n = {n}");
            let (_, centre) = crate::preprocess::fit_kernel_to_window(&vec![0.0f32; KERNEL_LEN], n);
            assert_eq!(centre - n / 2, s, "n = {n}");
        }
    }

    /// The smallest window the IIR takes for 300 Hz / 30 kHz, and the crop
    /// difference on either side of it.
    #[test]
    fn shortest_window() {
        let kernel = highpass_kernel_f64(30_000.0, 300.0).unwrap();
        let n_min = (100..4000)
            .find(|&n| crop_difference(&kernel, n) <= IIR_BOUND)
            .unwrap();
        eprintln!(
            "shortest window for the IIR: N = {n_min} (crop difference {:.2e}; N − 1: {:.2e})",
            crop_difference(&kernel, n_min),
            crop_difference(&kernel, n_min - 1)
        );
        assert_eq!(n_min, 1447);
        // Monotone enough: every longer window qualifies.
        for n in [
            n_min + 1,
            1500,
            2000,
            6122,
            6123,
            30_121,
            30_122,
            30_123,
            60_122,
        ] {
            assert!(crop_difference(&kernel, n) <= IIR_BOUND, "n = {n}");
            assert!(CircularIir::new(30_000.0, 300.0, n).unwrap().is_some());
        }
        assert!(
            CircularIir::new(30_000.0, 300.0, n_min - 1)
                .unwrap()
                .is_none()
        );
        assert!(CircularIir::new(30_000.0, 300.0, 222).unwrap().is_none());
    }

    /// The chunked IIR (f64) against the exact operator and against the CPU's
    /// FFT high-pass, for several window lengths, chunk sizes and signals.
    /// Measured: ≤ 5.6e-12 of max|x| against the exact operator (bound 1e-10);
    /// ≤ 8.4e-7 against the CPU (its float32 FFT and f32 kernel).
    #[test]
    fn chunked_iir_equals_the_cpu_highpass() {
        let kernel32 = highpass_kernel(30_000.0, 300.0).unwrap();
        let kernel = highpass_kernel_f64(30_000.0, 300.0).unwrap();
        let mut worst_exact = 0.0f64;
        let mut worst_cpu = 0.0f64;
        for (n, chunk) in [
            (60_122, IIR_CHUNK),
            (60_123, 777),
            (6122, IIR_CHUNK),
            (6123, 256),
            (6122, 6122),
            (1501, 100),
            (1447, 5000),
        ] {
            let iir = CircularIir::new(30_000.0, 300.0, n).unwrap().unwrap();
            let cpu = HighpassFilter::new(&kernel32, n).unwrap();
            for (what, x) in [
                ("noise", noise_row(n, n as u64)),
                ("spikes", spike_row(n, 7)),
            ] {
                let scale = max_abs(&x);
                let exact = reference(&kernel, &x, iir.shift);
                let unrounded = iir.filter_row_unrounded::<f64>(&x, chunk);
                let mut got = x.clone();
                iir.apply_row::<f64>(&mut got, chunk).unwrap();
                let mut want = x.clone();
                cpu.apply_row(&mut want).unwrap();
                let d_exact = unrounded
                    .iter()
                    .zip(&exact)
                    .map(|(g, e)| (g - e).abs())
                    .fold(0.0, f64::max)
                    / scale;
                let d_cpu = got
                    .iter()
                    .zip(&want)
                    .map(|(&g, &w)| f64::from((g - w).abs()))
                    .fold(0.0, f64::max)
                    / scale;
                eprintln!(
                    "N {n}, C {chunk}, L {}, {what}: IIR − exact {d_exact:.2e}, IIR − CPU {d_cpu:.2e} of max|x| {scale:.1}",
                    iir.warm
                );
                worst_exact = worst_exact.max(d_exact);
                worst_cpu = worst_cpu.max(d_cpu);
            }
        }
        assert!(worst_exact <= IIR_BOUND, "{worst_exact}");
        assert!(worst_cpu <= 1e-6, "{worst_cpu}");
    }

    /// Without the warm-up the chunk edges are wrong: the test above would see it.
    #[test]
    fn warm_up_matters() {
        let n = 6122;
        let mut iir = CircularIir::new(30_000.0, 300.0, n).unwrap().unwrap();
        let kernel = highpass_kernel_f64(30_000.0, 300.0).unwrap();
        let x = noise_row(n, 3);
        let exact = reference(&kernel, &x, iir.shift);
        let err = |iir: &CircularIir| {
            iir.filter_row_unrounded::<f64>(&x, 500)
                .iter()
                .zip(&exact)
                .map(|(g, e)| (g - e).abs())
                .fold(0.0, f64::max)
        };
        assert!(err(&iir) <= IIR_BOUND * max_abs(&x));
        iir.warm = 200;
        let e200 = err(&iir);
        let (b, a) = (iir.b, iir.a);
        assert!(
            e200 > 1e-4 && e200 <= warm_up_bound(&b, &a, 200) * max_abs(&x),
            "{e200}"
        );
    }

    /// The same with f32 state and u: the rounding in the recursion.
    /// Measured ≤ 3.1e-4 of max|x|.
    #[test]
    fn f32_state_rounding() {
        let kernel = highpass_kernel_f64(30_000.0, 300.0).unwrap();
        let mut worst = 0.0f64;
        for n in [60_122usize, 6123] {
            let iir = CircularIir::new(30_000.0, 300.0, n).unwrap().unwrap();
            for x in [noise_row(n, 11), spike_row(n, 12)] {
                let exact = reference(&kernel, &x, iir.shift);
                let got = iir.filter_row_unrounded::<f32>(&x, IIR_CHUNK);
                let d = got
                    .iter()
                    .zip(&exact)
                    .map(|(&g, &e)| (f64::from(g) - e).abs())
                    .fold(0.0, f64::max)
                    / max_abs(&x);
                eprintln!("f32 state, N {n}: IIR − exact {d:.2e} of max|x|");
                worst = worst.max(d);
            }
        }
        assert!(worst <= 5e-4, "{worst}");
    }

    /// The preprocessor offers the IIR form for the design's own kernel only.
    #[test]
    fn preprocessor_carries_the_iir() {
        use crate::preprocess::{DEVICE_TAP_FLOOR, PreprocessSettings, Preprocessor};
        let settings = PreprocessSettings {
            batch_size: 6000,
            ..Default::default()
        };
        let p = Preprocessor::new(&settings, Array2::eye(2)).unwrap();
        let iir = p.highpass_iir().unwrap();
        assert_eq!((iir.n, iir.shift, iir.warm), (6122, 0, 800));
        assert_eq!(
            p.device_form(DEVICE_TAP_FLOOR).unwrap().iir.as_ref(),
            Some(iir)
        );
        // Another kernel (scaled by 1.001): no IIR.
        let other: Vec<f32> = highpass_kernel(30_000.0, 300.0)
            .unwrap()
            .iter()
            .map(|v| v * 1.001)
            .collect();
        let p = Preprocessor::with_kernel(&settings, &other, Array2::eye(2)).unwrap();
        assert!(p.highpass_iir().is_none());
        // A short window (N = 222 < 1447): no IIR.
        let short = PreprocessSettings {
            batch_size: 100,
            ..Default::default()
        };
        let p = Preprocessor::new(&short, Array2::eye(2)).unwrap();
        assert!(p.highpass_iir().is_none());
        assert!(p.device_form(DEVICE_TAP_FLOOR).unwrap().iir.is_none());
    }

    #[test]
    fn window_apply_and_errors() {
        let n = 3000;
        let iir = CircularIir::new(30_000.0, 300.0, n).unwrap().unwrap();
        let mut w = Array2::from_shape_fn((3, n), |(r, t)| ((r * 31 + t * 17) % 23) as f32 - 11.0);
        let mut rows = w.clone();
        iir.apply::<f64>(&mut w, 700).unwrap();
        for (r, mut row) in rows.rows_mut().into_iter().enumerate() {
            let v = row.as_slice_mut().unwrap();
            iir.apply_row::<f64>(v, 700).unwrap();
            assert_eq!(v, w.row(r).as_slice().unwrap());
        }
        assert!(
            iir.apply::<f64>(&mut Array2::zeros((2, n - 1)), 700)
                .is_err()
        );
        assert!(iir.apply_row::<f64>(&mut vec![0.0; n], 0).is_err());
    }
}
