//! Drift correction of whitened windows (Kilosort4 4.1.7's
//! `preprocessing.get_drift_matrix` and the drift branch of
//! `io.BinaryFiltered.filter`; drift-spec.md §7).
//!
//! Per window b the high-passed data X (sites × samples) become
//! `(M_b·W)·X`, where `M_b = K(Q_b, P) · (K(P, P) + 0.01·I)⁻¹` interpolates,
//! with a Gaussian kernel of width `sig_interp`, the whitened signal at the
//! sites moved by the window's shift (kriging with a small ridge) and W is
//! the whitening matrix. As Kilosort4 does, the two matrices are multiplied
//! first ([`DriftCorrection::window_whitening`]: `G_b`, applied in place of
//! W by the same sparse product, without its entries below
//! [`COMBINED_EPS`] of its largest).

use anyhow::{Result, bail};
use ndarray::{Array2, ArrayView2};
use rayon::prelude::*;

use crate::preprocess::Whitening;

/// Default margin, µm, beyond the probe's end past which corrected sites read
/// zero ([`DriftCorrection::with_zero_outside`]): one Neuropixels 2.0 row.
/// Measured on simulated drifting recordings (docs/benchmarks-history.md): 0 µm removes
/// every false detection at the end but loses 0.2–0.4 % recall there;
/// 15 µm keeps recall at or above no correction with 99–99.8 % precision;
/// Kilosort4's extrapolation (no zeroing) gives 83–96 % precision.
pub const DEFAULT_EDGE_MARGIN: f64 = 15.0;

/// Ridge added to the kernel's diagonal before inversion.
pub const RIDGE: f64 = 0.01;

/// Gaussian kernel `exp(−|a_i − b_k|² / (2σ²))` between two point sets
/// (µm), float32 as Kilosort4 computes it (`kernel2D`).
/// Rows in parallel (each entry on its own: the same bits in any order).
pub fn kernel2d(ax: &[f32], ay: &[f32], bx: &[f32], by: &[f32], sig_interp: f64) -> Array2<f32> {
    let den = (2.0 * sig_interp * sig_interp) as f32;
    let n = bx.len();
    let mut k = vec![0f32; ax.len() * n];
    k.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        for (j, v) in row.iter_mut().enumerate() {
            let dx = ax[i] - bx[j];
            let dy = ay[i] - by[j];
            *v = (-(dx * dx + dy * dy) / den).exp();
        }
    });
    Array2::from_shape_vec((ax.len(), n), k).expect("rows × columns values")
}

/// `inv(K + ridge·I)` of a square float32 matrix, computed in f64 (Gauss–Jordan
/// with partial pivoting) and rounded to float32 (`iKxx`, §7).
///
/// # Errors
/// When the matrix is singular (cannot happen for a Gaussian kernel with a ridge).
pub fn inverse_with_ridge(k: &Array2<f32>, ridge: f64) -> Result<Array2<f32>> {
    let n = k.nrows();
    let w = 2 * n;
    let mut a = vec![0f64; n * w];
    for i in 0..n {
        for j in 0..n {
            a[i * w + j] = k[[i, j]] as f64 + if i == j { ridge } else { 0.0 };
        }
        a[i * w + n + i] = 1.0;
    }
    for col in 0..n {
        let piv = (col..n)
            .max_by(|&x, &y| a[x * w + col].abs().total_cmp(&a[y * w + col].abs()))
            .unwrap_or(col);
        if a[piv * w + col].abs() < 1e-300 {
            bail!("the interpolation kernel is singular");
        }
        if piv != col {
            for j in 0..w {
                a.swap(piv * w + j, col * w + j);
            }
        }
        let p = a[col * w + col];
        for j in 0..w {
            a[col * w + j] /= p;
        }
        let pivot_row: Vec<f64> = a[col * w..(col + 1) * w].to_vec();
        a.par_chunks_mut(w).enumerate().for_each(|(r, row)| {
            if r != col {
                let f = row[col];
                if f != 0.0 {
                    for j in 0..w {
                        row[j] -= f * pivot_row[j];
                    }
                }
            }
        });
    }
    Ok(Array2::from_shape_fn((n, n), |(i, j)| {
        a[i * w + n + j] as f32
    }))
}

/// The shift at each site for one window (§7 step 1), µm: with one block the
/// block's shift everywhere, else the piecewise-linear interpolant of
/// (`yblk`, `dshift_row`) at each site depth, extended linearly beyond the ends.
pub fn site_shifts(dshift_row: &[f64], yblk: &[f64], yc: &[f32]) -> Vec<f64> {
    if dshift_row.len() == 1 || yblk.len() < 2 {
        return vec![dshift_row[0]; yc.len()];
    }
    let n = yblk.len();
    yc.iter()
        .map(|&y| {
            let y = y as f64;
            // The segment: the first whose right end is ≥ y, clamped to the ends.
            let mut j = 0;
            while j + 2 < n && y > yblk[j + 1] {
                j += 1;
            }
            let (x0, x1) = (yblk[j], yblk[j + 1]);
            let (d0, d1) = (dshift_row[j], dshift_row[j + 1]);
            let slope = (d1 - d0) / (x1 - x0);
            slope * (y - x0) + d0
        })
        .collect()
}

/// The interpolation matrix `M_b` (C × C, float32) of one window (§7):
/// targets `Q_c = (xc_c, yc_c − s_c)` with `s` from [`site_shifts`], then
/// `K(Q, P) · iKxx`, the product accumulated in f64 and rounded to float32.
pub fn drift_matrix(
    xc: &[f32],
    yc: &[f32],
    ikxx: &Array2<f32>,
    dshift_row: &[f64],
    yblk: &[f64],
    sig_interp: f64,
) -> Array2<f32> {
    let s = site_shifts(dshift_row, yblk, yc);
    let qy: Vec<f32> = yc
        .iter()
        .zip(&s)
        .map(|(&y, &d)| (y as f64 - d) as f32)
        .collect();
    let kyx = kernel2d(xc, &qy, xc, yc, sig_interp);
    let ikxx = ikxx.as_standard_layout();
    let n = xc.len();
    let mut m = vec![0f32; n * n];
    m.par_chunks_mut(n.max(1)).enumerate().for_each_init(
        || vec![0f64; n],
        |acc, (c, out)| {
            acc.fill(0.0);
            for (k, &a) in kyx.row(c).iter().enumerate() {
                let a = a as f64;
                // Far sites' kernel values underflow to 0 in float32 (beyond
                // about 290 µm at σ = 20 µm): skipping them changes nothing.
                if a == 0.0 {
                    continue;
                }
                // Row k of iKxx as a slice: the same sums, vectorised.
                let row = ikxx.row(k);
                let row = row.as_slice().expect("iKxx is in standard layout");
                for (v, &m) in acc.iter_mut().zip(row) {
                    *v += a * m as f64;
                }
            }
            for (o, &v) in out.iter_mut().zip(acc.iter()) {
                *o = v as f32;
            }
        },
    );
    Array2::from_shape_vec((n, n), m).expect("n × n values")
}

/// Entries of `G_b = M_b·W` at most this fraction of its largest are dropped
/// before the sparse product ([`DriftCorrection::window_whitening`]).
///
/// Measured with numpy in float64 (W of a 20-s simulated Neuropixels 2.0
/// recording, 384 sites, local whitening of 32 sites; shifts 0, 7.5, −19.5,
/// 40 and 120 µm; white data): the float32 product with the whole G_b, summed
/// in the CPU's order, is off the exact one by 1.0e-7 of the output RMS (RMS;
/// at most 1.7e-6). Dropping below 1e-8 keeps 87–93 of 384 entries per row
/// and leaves that error unchanged (1.0e-7 RMS, at most 1.5e-6); 1e-7 keeps
/// 75–80 but raises it to 2.6e-7; 1e-6 keeps 65–69, 1.6e-6.
pub const COMBINED_EPS: f32 = 1e-8;

/// `G = M·W` (C × C): `M` float32, `W` a whitening matrix (its non-zeros),
/// products accumulated in f64 in W's CSR order, rounded to float32
/// (Kilosort4 multiplies the two float32 matrices in float32; this is as
/// close to the exact product as float32 allows).
///
/// Rows in parallel, each written in place.
pub fn combine(m: &Array2<f32>, w: &Whitening) -> Array2<f32> {
    let n = m.ncols();
    let (start, cols, vals) = w.csr();
    let mut g = vec![0f32; m.nrows() * n];
    g.par_chunks_mut(n.max(1)).enumerate().for_each_init(
        || vec![0f64; n],
        |acc, (c, out)| {
            acc.fill(0.0);
            for (k, &a) in m.row(c).iter().enumerate() {
                let a = f64::from(a);
                if a == 0.0 {
                    continue;
                }
                for e in start[k] as usize..start[k + 1] as usize {
                    acc[cols[e] as usize] += a * f64::from(vals[e]);
                }
            }
            for (o, &v) in out.iter_mut().zip(acc.iter()) {
                *o = v as f32;
            }
        },
    );
    Array2::from_shape_vec((m.nrows(), n), g).expect("rows × n values")
}

/// Drift correction of a run: `dshift` and `yblk` from the estimate, the
/// site positions and `iKxx`; [`DriftCorrection::apply`] corrects one
/// whitened window.
#[derive(Debug, Clone)]
pub struct DriftCorrection {
    xc: Vec<f32>,
    yc: Vec<f32>,
    ikxx: Array2<f32>,
    dshift: Array2<f64>,
    yblk: Vec<f64>,
    sig_interp: f64,
    sparse: bool,
    zero_outside: Option<f64>,
    exact: bool,
}

impl DriftCorrection {
    /// Builds the correction for sites at (`xc`, `yc`) µm (channel-map order,
    /// every shank), `dshift` (windows × blocks, µm, Kilosort4's sign),
    /// `yblk` (µm) and `sig_interp` (µm); computes `iKxx` once.
    ///
    /// # Errors
    /// When the shapes disagree or `sig_interp` is not positive.
    pub fn new(
        xc: &[f32],
        yc: &[f32],
        dshift: Array2<f64>,
        yblk: Vec<f64>,
        sig_interp: f64,
    ) -> Result<Self> {
        if xc.len() != yc.len() || xc.is_empty() {
            bail!("site positions: {} x and {} y values", xc.len(), yc.len());
        }
        if dshift.ncols() != yblk.len() || yblk.is_empty() {
            bail!(
                "dshift has {} blocks but yblk {} values",
                dshift.ncols(),
                yblk.len()
            );
        }
        if !(sig_interp.is_finite() && sig_interp > 0.0) {
            bail!("--sig-interp = {sig_interp} µm must be positive");
        }
        let kxx = kernel2d(xc, yc, xc, yc, sig_interp);
        let ikxx = inverse_with_ridge(&kxx, RIDGE)?;
        Ok(DriftCorrection {
            xc: xc.to_vec(),
            yc: yc.to_vec(),
            ikxx,
            dshift,
            yblk,
            sig_interp,
            sparse: true,
            zero_outside: Some(DEFAULT_EDGE_MARGIN),
            exact: false,
        })
    }

    /// Sites whose target `yc − s` lies more than `margin` µm outside the
    /// sites' depth span (below the lowest or above the highest site) read
    /// zero (`Some(margin)`; default `Some(`[`DEFAULT_EDGE_MARGIN`]`)`), or Kilosort4's kernel
    /// extrapolation everywhere (`None`, for `--drift-mode kilosort`).
    /// Extrapolated rows are near-copies of the last real sites; their
    /// strongly correlated noise makes the spatial templates cross the
    /// threshold at the probe's end (docs/benchmarks-history.md).
    pub fn with_zero_outside(mut self, margin: Option<f64>) -> Self {
        self.zero_outside = margin;
        self
    }

    /// Sites whose target lies more than `margin` µm outside the depth span in
    /// window `window_index`.
    ///
    /// # Errors
    /// When the window index is past the rows of `dshift`.
    pub fn sites_outside(&self, window_index: u64, margin: f64) -> Result<Vec<usize>> {
        let b = window_index as usize;
        if b >= self.dshift.nrows() {
            bail!(
                "window {b}: the drift estimate has {} windows",
                self.dshift.nrows()
            );
        }
        let row: Vec<f64> = self.dshift.row(b).to_vec();
        let s = site_shifts(&row, &self.yblk, &self.yc);
        let lo = self.yc.iter().copied().fold(f32::INFINITY, f32::min) as f64 - margin;
        let hi = self.yc.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64 + margin;
        Ok((0..self.yc.len())
            .filter(|&c| {
                let q = ((self.yc[c] as f64 - s[c]) as f32) as f64;
                q < lo || q > hi
            })
            .collect())
    }

    /// [`DriftCorrection::apply`] multiplies by M_b as a dense product (`true`)
    /// or as a sparse one without the entries below [`SPARSE_EPS`] of M_b's
    /// largest ([`SparseMatrix`], the default of [`DriftCorrection::new`]).
    /// The pipeline uses neither: it applies `G_b = M_b·W`
    /// ([`DriftCorrection::window_whitening`]) to the high-passed window.
    pub fn with_dense(mut self, dense: bool) -> Self {
        self.sparse = !dense;
        self
    }

    /// Keeps every non-zero of `G_b` (`true`; `--drift-mode kilosort`) instead
    /// of dropping those below [`COMBINED_EPS`] of its largest (`false`, the default).
    pub fn with_exact(mut self, exact: bool) -> Self {
        self.exact = exact;
        self
    }

    /// The drift-corrected whitening of window `window_index` (drift-spec.md §7
    /// step 8): `G_b = M_b·W` ([`combine`]), the rows of sites whose target
    /// lies beyond the edge margin zeroed
    /// ([`DriftCorrection::with_zero_outside`]), the entries at most
    /// [`COMBINED_EPS`] of its largest dropped (unless
    /// [`DriftCorrection::with_exact`]), ready for the sparse product
    /// ([`Whitening::sparse_with_floor`]). Apply it to the high-passed window
    /// in place of W.
    ///
    /// # Errors
    /// When the window index is past the rows of `dshift` or W is not C × C.
    pub fn window_whitening(&self, window_index: u64, w: &Whitening) -> Result<Whitening> {
        let c = self.xc.len();
        if w.matrix().dim() != (c, c) {
            bail!(
                "the whitening matrix is {} × {}, the probe has {c} sites",
                w.matrix().nrows(),
                w.matrix().ncols()
            );
        }
        let mut m = self.matrix(window_index)?;
        if let Some(margin) = self.zero_outside {
            for s in self.sites_outside(window_index, margin)? {
                m.row_mut(s).fill(0.0);
            }
        }
        let g = combine(&m, w);
        let floor = if self.exact { 0.0 } else { COMBINED_EPS };
        Ok(Whitening::sparse_with_floor(g, floor)?)
    }

    /// `iKxx`, C × C.
    pub fn ikxx(&self) -> &Array2<f32> {
        &self.ikxx
    }

    /// `dshift`, windows × blocks, µm.
    pub fn dshift(&self) -> &Array2<f64> {
        &self.dshift
    }

    /// `yblk`, µm.
    pub fn yblk(&self) -> &[f64] {
        &self.yblk
    }

    /// `M_b` of window `window_index` ([`drift_matrix`]).
    ///
    /// # Errors
    /// When the window index is past the rows of `dshift`.
    pub fn matrix(&self, window_index: u64) -> Result<Array2<f32>> {
        let b = window_index as usize;
        if b >= self.dshift.nrows() {
            bail!(
                "window {b}: the drift estimate has {} windows",
                self.dshift.nrows()
            );
        }
        let row: Vec<f64> = self.dshift.row(b).to_vec();
        Ok(drift_matrix(
            &self.xc,
            &self.yc,
            &self.ikxx,
            &row,
            &self.yblk,
            self.sig_interp,
        ))
    }

    /// Corrects one whitened window in place: `X ← M_b · X` (C × N, float32;
    /// `M_b·(W·X)`, for tests and analysis; the pipeline applies
    /// [`DriftCorrection::window_whitening`] to the high-passed window instead),
    /// with the rows of sites whose target lies outside the probe set to zero
    /// unless [`DriftCorrection::with_zero_outside`] turned that off.
    ///
    /// # Errors
    /// When the window index is out of range or the window does not have C rows.
    pub fn apply(&self, window_index: u64, x: &mut Array2<f32>) -> Result<()> {
        if x.nrows() != self.xc.len() {
            bail!(
                "window {window_index} has {} rows, the probe {} sites",
                x.nrows(),
                self.xc.len()
            );
        }
        let mut m = self.matrix(window_index)?;
        if let Some(margin) = self.zero_outside {
            for c in self.sites_outside(window_index, margin)? {
                m.row_mut(c).fill(0.0);
            }
        }
        if self.sparse {
            SparseMatrix::new(&m, SPARSE_EPS).apply(x);
        } else {
            apply_matrix(m.view(), x);
        }
        Ok(())
    }
}

/// Columns per block of [`apply_matrix`].
const BLOCK: usize = 256;

/// `X ← M · X` in float32, column blocks in parallel (sgemm per block).
pub fn apply_matrix(m: ArrayView2<f32>, x: &mut Array2<f32>) {
    if !x.is_standard_layout() {
        *x = x.as_standard_layout().into_owned();
    }
    let src = x.clone();
    let blocks: Vec<(usize, ndarray::ArrayViewMut2<'_, f32>)> = x
        .axis_chunks_iter_mut(ndarray::Axis(1), BLOCK)
        .enumerate()
        .collect();
    blocks.into_par_iter().for_each(|(k, mut out)| {
        let lo = k * BLOCK;
        let hi = lo + out.ncols();
        let xs = src.slice(ndarray::s![.., lo..hi]);
        ndarray::linalg::general_mat_mul(1.0, &m, &xs, 0.0, &mut out);
    });
}

/// Entries of M_b smaller than this fraction of its largest are dropped by
/// the sparse product. On Neuropixels 2.0 geometry (384 sites, σ = 20 µm)
/// that keeps about 80 of 384 entries per row and changes the corrected
/// signal by about 1e-6 of its RMS, below the float32 rounding of the dense
/// product (measured with numpy, float64, for shifts of 0, 7.5 and 40 µm).
pub const SPARSE_EPS: f32 = 1e-7;

/// A C × C matrix in compressed rows, for `X ← M · X`.
#[derive(Debug, Clone)]
pub struct SparseMatrix {
    n: usize,
    ptr: Vec<usize>,
    idx: Vec<usize>,
    val: Vec<f32>,
}

impl SparseMatrix {
    /// The entries of `m` with |m| > `eps` · max|m|.
    pub fn new(m: &Array2<f32>, eps: f32) -> Self {
        let max = m.iter().fold(0f32, |a, v| a.max(v.abs()));
        let cut = eps * max;
        let mut ptr = vec![0];
        let mut idx = Vec::new();
        let mut val = Vec::new();
        for row in m.rows() {
            for (k, &v) in row.iter().enumerate() {
                if v.abs() > cut {
                    idx.push(k);
                    val.push(v);
                }
            }
            ptr.push(idx.len());
        }
        SparseMatrix {
            n: m.nrows(),
            ptr,
            idx,
            val,
        }
    }

    /// Stored entries.
    pub fn nnz(&self) -> usize {
        self.val.len()
    }

    /// `X ← M · X` in float32 (C × N), column blocks in parallel.
    pub fn apply(&self, x: &mut Array2<f32>) {
        if !x.is_standard_layout() {
            *x = x.as_standard_layout().into_owned();
        }
        let blocks: Vec<ndarray::ArrayViewMut2<'_, f32>> =
            x.axis_chunks_iter_mut(ndarray::Axis(1), BLOCK).collect();
        blocks.into_par_iter().for_each(|mut out| {
            let w = out.ncols();
            let src: Vec<f32> = out.iter().copied().collect();
            let mut acc = vec![0f32; w];
            for c in 0..self.n {
                acc.fill(0.0);
                for e in self.ptr[c]..self.ptr[c + 1] {
                    let v = self.val[e];
                    let row = &src[self.idx[e] * w..(self.idx[e] + 1) * w];
                    for (a, &s) in acc.iter_mut().zip(row) {
                        *a += v * s;
                    }
                }
                out.row_mut(c)
                    .iter_mut()
                    .zip(&acc)
                    .for_each(|(o, &a)| *o = a);
            }
        });
    }
}
