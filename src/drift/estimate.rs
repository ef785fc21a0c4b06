//! Drift estimation from the first pass's spikes (Kilosort4 4.1.7's
//! `datashift.bin_spikes` and `datashift.align_block2`; drift-spec.md §3–§6).
//!
//! [`bin_spikes`] builds the per-batch depth × log-amplitude histogram,
//! [`register`] aligns it rigidly (integer bins), then per block with a
//! sub-bin up-sampled search, giving `dshift` (batches × blocks, µm) and
//! `yblk` (µm).

use anyhow::{Result, bail};
use ndarray::{Array2, Array3, ArrayView2};

/// Amplitude bins of the histogram.
pub const N_AMP_BINS: usize = 20;
/// Amplitudes are clipped at this value before the log.
pub const AMP_CLIP: f64 = 99.0;
/// Rigid lag range, ± bins.
pub const RIGID_LAGS: i32 = 15;
/// Rigid passes (the last computes scores only).
pub const RIGID_PASSES: usize = 10;
/// Fine (block) lag range, ± bins.
pub const FINE_LAGS: i32 = 5;
/// Up-sampling factor of the fine lags (0.1 bin steps).
pub const UPSAMPLE: usize = 10;

/// The first detection pass's spikes, as the drift step reads them
/// (Kilosort4's `st0` columns 1, 2 and 4). All three vectors have one entry per spike.
#[derive(Debug, Clone, Default)]
pub struct FirstPassSpikes {
    /// Amplitude-weighted depth `yct`, µm.
    pub y: Vec<f32>,
    /// Detection amplitude |A|, whitened units (> `Th_universal`).
    pub amp: Vec<f32>,
    /// Batch (window) index, 0-based.
    pub batch: Vec<u32>,
    /// Sample of each spike (absolute), for the picture only.
    pub sample: Vec<i64>,
}

impl FirstPassSpikes {
    /// Number of spikes.
    pub fn len(&self) -> usize {
        self.y.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }
}

/// The per-batch fingerprint of §3.
#[derive(Debug, Clone)]
pub struct Histogram {
    /// `F[b, r, c] = log2(1 + N[b, r, c])`, shape (Nbatches, D, 20).
    pub f: Array3<f64>,
    /// `ysamp`, D values, µm (bin centre minus one `dd`, as Kilosort4).
    pub ysamp: Vec<f64>,
    /// Spikes per batch.
    pub counts: Vec<u64>,
}

impl Histogram {
    /// Depth bins D.
    pub fn n_depth(&self) -> usize {
        self.f.dim().1
    }
}

/// Number of depth bins `D = 1 + ceil((ymax − (ymin − 1)) / dd)` (f32 maths,
/// §3) and `y0 = ymin − 1`, for site depths `yc` (µm) and bin height `dd` (µm).
pub fn depth_bins(yc: &[f32], dd: f64) -> (usize, f32) {
    let ymin = yc.iter().copied().fold(f32::INFINITY, f32::min);
    let ymax = yc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let y0 = ymin - 1.0;
    let d = 1 + ((ymax - y0) / dd as f32).ceil() as usize;
    (d, y0)
}

/// Kilosort4's `bin_spikes` (§3): spikes counted per (batch, depth row,
/// log-amplitude column), then `log2(1 + n)`.
///
/// `yc`: site depths, µm (every site, every shank); `dd` = `binning_depth`
/// (µm); `th` = `Th_universal`; `n_batches`: batches of the run.
///
/// # Errors
/// When a spike's batch is ≥ `n_batches`, its depth lies outside the sites'
/// span or its amplitude is not above `th` (a spike table that did not come
/// from this probe's first pass).
pub fn bin_spikes(
    spikes: &FirstPassSpikes,
    yc: &[f32],
    dd: f64,
    th: f64,
    n_batches: usize,
) -> Result<Histogram> {
    let (d, y0) = depth_bins(yc, dd);
    let mut n = Array3::<u64>::zeros((n_batches, d, N_AMP_BINS));
    let mut counts = vec![0u64; n_batches];
    let lth = th.log10();
    let span = 2.0 - lth;
    for i in 0..spikes.len() {
        let b = spikes.batch[i] as usize;
        if b >= n_batches {
            bail!("first-pass spike {i} is in batch {b}, but the run has {n_batches} batches");
        }
        let y = spikes.y[i] as f64;
        let rf = ((y - y0 as f64) / dd).trunc();
        let a = spikes.amp[i] as f64;
        let u = ((a.min(AMP_CLIP)).log10() - lth) / span;
        let cf = (1e-5 + u * N_AMP_BINS as f64).trunc();
        if !(rf >= 0.0 && (rf as usize) < d && cf >= 0.0 && (cf as usize) < N_AMP_BINS) {
            bail!(
                "first-pass spike {i} (depth {y} µm, amplitude {a}) falls outside the drift histogram (depth bins 0..{d} from {y0} µm, amplitudes above Th_universal = {th})"
            );
        }
        n[[b, rf as usize, cf as usize]] += 1;
        counts[b] += 1;
    }
    let f = n.mapv(|k| (1.0 + k as f64).log2());
    let ysamp = (0..d)
        .map(|k| y0 as f64 + dd * k as f64 - dd / 2.0)
        .collect();
    Ok(Histogram { f, ysamp, counts })
}

/// Reference batch of the rigid registration: `min(300, ⌊Nbatches/2⌋)`.
pub fn reference_batch(n_batches: usize) -> usize {
    300.min(n_batches / 2)
}

/// Block layout of §5 for D depth bins and `nblocks`: `L = ⌊D/nblocks⌋` rows
/// per block and the 2·nblocks − 1 block starts (half-overlapping).
pub fn blocks(d: usize, nblocks: usize) -> (usize, Vec<usize>) {
    let l = d / nblocks;
    let nb = 2 * nblocks - 1;
    let hi = (d - l) as f64;
    let starts = (0..nb)
        .map(|j| {
            let v = if nb == 1 {
                0.0
            } else if j == nb - 1 {
                hi
            } else {
                j as f64 * (hi / (nb - 1) as f64)
            };
            v.round_ties_even() as usize
        })
        .collect();
    (l, starts)
}

/// Everything [`register`] computes.
#[derive(Debug, Clone)]
pub struct Registration {
    /// Rigid offset K_b of each batch, bins (sum of the 9 applied rounds).
    pub rigid: Vec<i32>,
    /// Fine scores C before smoothing, (11, Nbatches, blocks).
    pub scores: Array3<f64>,
    /// Fine scores after smoothing.
    pub smoothed: Array3<f64>,
    /// `imin`: total shift per batch and block, bins (K_b + fine shift).
    pub imin: Array2<f64>,
    /// `yblk`: block centres, µm.
    pub yblk: Vec<f64>,
    /// Per batch, the lag (bins) its last applied rigid pass chose: at the
    /// edge of the ±[`RIGID_LAGS`] search the batch was still moving as fast as
    /// the search allows when the passes ended.
    pub rigid_last: Vec<i32>,
}

/// Mean of f32 values, accumulated in f64 and rounded to f32 (a float32
/// mean as torch computes it, to rounding).
fn mean_f32(it: impl Iterator<Item = f32>, n: usize) -> f32 {
    (it.map(f64::from).sum::<f64>() / n as f64) as f32
}

/// `mean_r(mean_c(roll_k(g)[r, c] · t[r, c]))` over the rows of the views
/// (rows × 20), with the circular roll within those rows (§4 step 3), for
/// every lag k of `lags`, in order.
///
/// Each score is the same float sequence as a direct loop: per row the
/// float32 products summed in float64 over the columns in order, the row's
/// mean rounded to float32, the rows' means summed in float64 in row order.
/// Eight lags are computed side by side, one vector lane each (the lanes
/// never mix), from a copy of `g` whose columns are laid out so that the
/// eight lags' rows are adjacent.
fn lag_scores(
    g: ArrayView2<f32>,
    t: ArrayView2<f32>,
    lags: std::ops::RangeInclusive<i32>,
) -> Vec<f32> {
    let (n, nc) = g.dim();
    let (kmin, kmax) = (*lags.start(), *lags.end());
    if n == 0 || kmax < kmin {
        return lags.map(|_| f32::NAN).collect();
    }
    // e[c·len + m] = g[(n − 1 − kmin − m) mod n, c]: lag k's row for output
    // row r sits at m = n − 1 − kmin − r + k, so consecutive lags are
    // consecutive m.
    let len = n + (kmax - kmin) as usize + LAG_LANES;
    let top = n as i64 - 1 - i64::from(kmin);
    let mut e = vec![0f32; nc * len];
    for m in 0..len {
        let src = (top - m as i64).rem_euclid(n as i64) as usize;
        for (c, &v) in g.row(src).iter().enumerate() {
            e[c * len + m] = v;
        }
    }
    let t = t.as_standard_layout();
    let t = t.as_slice().expect("standard layout");
    let mut out = Vec::with_capacity((kmax - kmin + 1) as usize);
    let mut k0 = kmin;
    while k0 <= kmax {
        let lanes = scores_lanes(&e, len, t, n, nc, (k0 - kmin) as usize);
        let take = ((kmax - k0 + 1) as usize).min(LAG_LANES);
        out.extend_from_slice(&lanes[..take]);
        k0 += LAG_LANES as i32;
    }
    out
}

/// Lags scored side by side by [`lag_scores`].
const LAG_LANES: usize = 8;

/// [`lag_scores`] for the [`LAG_LANES`] lags starting `dk` after the first.
fn scores_lanes(
    e: &[f32],
    len: usize,
    t: &[f32],
    n: usize,
    nc: usize,
    dk: usize,
) -> [f32; LAG_LANES] {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512(
            e: &[f32],
            len: usize,
            t: &[f32],
            n: usize,
            nc: usize,
            dk: usize,
        ) -> [f32; LAG_LANES] {
            scores_lanes_impl(e, len, t, n, nc, dk)
        }
        #[target_feature(enable = "avx2")]
        fn avx2(
            e: &[f32],
            len: usize,
            t: &[f32],
            n: usize,
            nc: usize,
            dk: usize,
        ) -> [f32; LAG_LANES] {
            scores_lanes_impl(e, len, t, n, nc, dk)
        }
        if crate::simd::avx512() {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { avx512(e, len, t, n, nc, dk) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { avx2(e, len, t, n, nc, dk) };
        }
    }
    scores_lanes_impl(e, len, t, n, nc, dk)
}

#[inline(always)]
fn scores_lanes_impl(
    e: &[f32],
    len: usize,
    t: &[f32],
    n: usize,
    nc: usize,
    dk: usize,
) -> [f32; LAG_LANES] {
    let mut acc = [0f64; LAG_LANES];
    for r in 0..n {
        let m0 = n - 1 - r + dk;
        let mut s = [0f64; LAG_LANES];
        for (c, &tv) in t[r * nc..(r + 1) * nc].iter().enumerate() {
            let ev: &[f32; LAG_LANES] = e[c * len + m0..c * len + m0 + LAG_LANES]
                .try_into()
                .expect("LAG_LANES values");
            for (sj, &gv) in s.iter_mut().zip(ev) {
                *sj += f64::from(gv * tv);
            }
        }
        for (aj, &sj) in acc.iter_mut().zip(&s) {
            *aj += f64::from((sj / nc as f64) as f32);
        }
    }
    acc.map(|a| (a / n as f64) as f32)
}

/// Rolls the rows of `g` by `k` (content moves to higher rows).
fn roll_rows(g: &mut ndarray::ArrayViewMut2<f32>, k: i32) {
    let n = g.nrows();
    if n == 0 {
        return;
    }
    let k = (k as i64).rem_euclid(n as i64) as usize;
    if k == 0 {
        return;
    }
    let old = g.to_owned();
    for r in 0..n {
        g.row_mut((r + k) % n).assign(&old.row(r));
    }
}

/// Kilosort4's `align_block2` (§4, §5): rigid registration of the
/// mean-subtracted fingerprints against `reference` (batch index), then
/// per-block fine scores, smoothed with σ = `smoothing` (lag, batch, block),
/// up-sampled ×10, and the total shift per batch and block in bins.
///
/// # Errors
/// When `nblocks` is 0 or larger than the depth bins D (blocks would be empty).
pub fn register(
    hist: &Histogram,
    nblocks: usize,
    smoothing: [f64; 3],
    reference: usize,
) -> Result<Registration> {
    let (nbat, d, nc) = hist.f.dim();
    if nblocks == 0 || nblocks > d {
        bail!(
            "--nblocks {nblocks}: the drift histogram has {d} depth bins, so nblocks must be between 1 and {d}"
        );
    }
    if nbat == 0 {
        bail!("no batches to register");
    }
    // G: float32, mean over depth subtracted per (batch, column).
    let mut g = hist.f.mapv(|v| v as f32);
    for b in 0..nbat {
        for c in 0..nc {
            let m = mean_f32((0..d).map(|r| g[[b, r, c]]), d);
            for r in 0..d {
                g[[b, r, c]] -= m;
            }
        }
    }
    let mut t = g.index_axis(ndarray::Axis(0), reference).to_owned();
    let mut rigid = vec![0i32; nbat];
    let mut rigid_last = vec![0i32; nbat];
    let lags: Vec<i32> = (-RIGID_LAGS..=RIGID_LAGS).collect();
    use rayon::prelude::*;
    for it in 0..RIGID_PASSES {
        if it < RIGID_PASSES - 1 {
            let best: Vec<i32> = (0..nbat)
                .into_par_iter()
                .map(|b| {
                    let gb = g.index_axis(ndarray::Axis(0), b);
                    let s = lag_scores(gb, t.view(), -RIGID_LAGS..=RIGID_LAGS);
                    // First lag reaching the maximum wins (numpy argmax).
                    let mut best = (s[0], lags[0]);
                    for (&v, &k) in s.iter().zip(&lags).skip(1) {
                        if v > best.0 {
                            best = (v, k);
                        }
                    }
                    best.1
                })
                .collect();
            for b in 0..nbat {
                let mut gb = g.index_axis_mut(ndarray::Axis(0), b);
                roll_rows(&mut gb, best[b]);
                rigid[b] += best[b];
                rigid_last[b] = best[b];
            }
        }
        // The last pass's scores are never used; its template equals this one.
        t = Array2::from_shape_fn((d, nc), |(r, c)| {
            mean_f32((0..nbat).map(|b| g[[b, r, c]]), nbat)
        });
        if it == RIGID_PASSES - 2 {
            break;
        }
    }

    // Blocks.
    let (l, starts) = blocks(d, nblocks);
    let nb = starts.len();
    let yblk: Vec<f64> = starts
        .iter()
        .map(|&s| hist.ysamp[s..s + l].iter().sum::<f64>() / l as f64)
        .collect();
    let nlag = (2 * FINE_LAGS + 1) as usize;
    let mut scores = Array3::<f64>::zeros((nlag, nbat, nb));
    for (j, &s) in starts.iter().enumerate() {
        let tj = t.slice(ndarray::s![s..s + l, ..]);
        let col: Vec<Vec<f64>> = (0..nbat)
            .into_par_iter()
            .map(|b| {
                let gb = g.slice(ndarray::s![b, s..s + l, ..]);
                lag_scores(gb, tj, -FINE_LAGS..=FINE_LAGS)
                    .into_iter()
                    .map(f64::from)
                    .collect()
            })
            .collect();
        for (b, v) in col.iter().enumerate() {
            for (i, &x) in v.iter().enumerate() {
                scores[[i, b, j]] = x;
            }
        }
    }
    let mut smoothed = scores.clone();
    for (axis, &sigma) in smoothing.iter().enumerate() {
        gaussian_filter_axis(&mut smoothed, axis, sigma);
    }
    // Up-sampling: Gaussian-weighted sum (σ = 1 bin) onto 101 lags.
    let nup = 2 * FINE_LAGS as usize * UPSAMPLE + 1;
    let up: Vec<f64> = (0..nup)
        .map(|q| {
            if q == nup - 1 {
                FINE_LAGS as f64
            } else {
                q as f64 * (2.0 * FINE_LAGS as f64 / (nup - 1) as f64) - FINE_LAGS as f64
            }
        })
        .collect();
    let kn: Vec<Vec<f64>> = (0..nlag)
        .map(|i| {
            let ki = i as f64 - FINE_LAGS as f64;
            up.iter()
                .map(|&u| (-(ki - u).powi(2) / 2.0).exp())
                .collect()
        })
        .collect();
    let mut imin = Array2::<f64>::zeros((nbat, nb));
    for j in 0..nb {
        for b in 0..nbat {
            let u = |q: usize| -> f64 { (0..nlag).map(|i| kn[i][q] * smoothed[[i, b, j]]).sum() };
            let mut best = (u(0), 0usize);
            for q in 1..nup {
                let v = u(q);
                if v > best.0 {
                    best = (v, q);
                }
            }
            imin[[b, j]] = rigid[b] as f64 + up[best.1];
        }
    }
    Ok(Registration {
        rigid,
        scores,
        smoothed,
        imin,
        yblk,
        rigid_last,
    })
}

/// What [`check_search_range`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RangeCheck {
    /// Batches whose last rigid pass chose an edge lag (±[`RIGID_LAGS`]).
    pub edge_batches: Vec<usize>,
    /// Batches (with spikes) whose fingerprint, shifted by the estimate, still
    /// matches the reference batch's best at a further lag beyond
    /// ±[`FINE_LAGS`] bins, and that lag (bins).
    pub missed: Vec<(usize, i32)>,
    /// The widest lag tried by the check, bins.
    pub wide_lags: i32,
}

/// Checks a registration against its search range: batches with spikes whose
/// last rigid pass chose an edge lag, and batches that, shifted by their estimated
/// rigid offset, still match the reference batch best at a lag beyond the
/// fine step's ±[`FINE_LAGS`] bins, searching up to ±4·[`RIGID_LAGS`] bins
/// (at most a third of the depth bins, so the circular roll does not alias;
/// the lag must score above lag 0 by 10 % of the score range).
pub fn check_search_range(hist: &Histogram, reg: &Registration, reference: usize) -> RangeCheck {
    let (nbat, d, nc) = hist.f.dim();
    let wide = (4 * RIGID_LAGS).min((d / 3) as i32);
    let mut out = RangeCheck {
        // A batch without first-pass spikes scores every lag alike, and the
        // first (an edge) wins: it says nothing about the search range (its
        // shift is interpolated, with its own warning).
        edge_batches: (0..nbat)
            .filter(|&b| hist.counts[b] > 0 && reg.rigid_last[b].abs() == RIGID_LAGS)
            .collect(),
        missed: Vec::new(),
        wide_lags: wide,
    };
    if wide <= FINE_LAGS || reference >= nbat {
        return out;
    }
    let fingerprint = |b: usize| {
        let mut g = hist.f.index_axis(ndarray::Axis(0), b).mapv(|v| v as f32);
        for c in 0..nc {
            let m = mean_f32((0..d).map(|r| g[[r, c]]), d);
            g.column_mut(c).mapv_inplace(|v| v - m);
        }
        roll_rows(&mut g.view_mut(), reg.rigid[b]);
        g
    };
    let t = fingerprint(reference);
    // Batches are independent: scored on the thread pool, kept in batch order.
    use rayon::prelude::*;
    let missed: Vec<Option<(usize, i32)>> = (0..nbat)
        .into_par_iter()
        .map(|b| {
            if b == reference || hist.counts[b] == 0 {
                return None;
            }
            let gb = fingerprint(b);
            let s: Vec<(i32, f32)> = (-wide..=wide)
                .zip(lag_scores(gb.view(), t.view(), -wide..=wide))
                .collect();
            let at0 = s[wide as usize].1;
            let (lo, hi) = s.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |a, x| {
                (a.0.min(x.1), a.1.max(x.1))
            });
            let best = s.iter().fold(s[0], |a, &x| if x.1 > a.1 { x } else { a });
            (best.0.abs() > FINE_LAGS && best.1 - at0 > 0.1 * (hi - lo)).then_some((b, best.0))
        })
        .collect();
    out.missed = missed.into_iter().flatten().collect();
    out
}

/// The warning for a [`RangeCheck`] (`dd`: bin height, µm; `nbat`: batches),
/// or `None` when the estimate sits well inside its range: edge hits and
/// batches left off by more than the fine step (at least 2 and 10 % of the
/// batches) name the shift, the limit and what to do.
pub fn range_warning(check: &RangeCheck, dd: f64, nbat: usize) -> Option<String> {
    let limit = f64::from(RIGID_LAGS) * dd;
    let enough = check.missed.len() >= 2 && check.missed.len() * 10 >= nbat;
    if check.edge_batches.is_empty() && !enough {
        return None;
    }
    let mut parts = Vec::new();
    if !check.edge_batches.is_empty() {
        parts.push(format!(
            "the rigid search's best shift still sat at the edge of its range in its last pass (±{RIGID_LAGS} bins × {dd} µm = ±{limit:.0} µm) in {} of {nbat} windows (first: {})",
            check.edge_batches.len(),
            check.edge_batches.iter().take(5).map(|b| b.to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    if enough {
        let mut lags: Vec<i32> = check.missed.iter().map(|m| m.1.abs()).collect();
        lags.sort_unstable();
        parts.push(format!(
            "{} of {nbat} windows, shifted by their estimate, still match the reference window best {:.0} µm further (median; up to {:.0} µm; first windows: {})",
            check.missed.len(),
            f64::from(lags[lags.len() / 2]) * dd,
            f64::from(lags[lags.len() - 1]) * dd,
            check.missed.iter().take(5).map(|m| m.0.to_string()).collect::<Vec<_>>().join(", ")
        ));
    }
    Some(format!(
        "drift: {}: the drift is probably larger than the ±{limit:.0} µm Kilosort4's registration can find, and is under-corrected (depths jump where it happens; see drift.png): sort the stretches before and after a large jump separately (--tmin/--tmax), or compare with --nblocks 0 (no correction); a larger --binning-depth widens the search (±{RIGID_LAGS} bins of it) but its circular search may then alias",
        parts.join("; ")
    ))
}

/// scipy's `gaussian_filter1d` along `axis` (truncate 4, mode "reflect"),
/// in place; σ ≤ 1e-15 and axes of length 1 are left unchanged (§5).
pub fn gaussian_filter_axis(a: &mut Array3<f64>, axis: usize, sigma: f64) {
    let len = a.shape()[axis];
    if sigma <= 1e-15 || len <= 1 {
        return;
    }
    let radius = (4.0 * sigma + 0.5).floor() as i64;
    let mut w: Vec<f64> = (-radius..=radius)
        .map(|m| (-0.5 / (sigma * sigma) * (m * m) as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    for v in &mut w {
        *v /= total;
    }
    let w0 = w[radius as usize];
    let reflect = |i: i64| -> usize {
        let p = 2 * len as i64;
        let m = i.rem_euclid(p);
        (if m >= len as i64 { p - 1 - m } else { m }) as usize
    };
    for mut lane in a.lanes_mut(ndarray::Axis(axis)) {
        let x: Vec<f64> = lane.iter().copied().collect();
        for i in 0..len {
            let mut acc = w0 * x[i];
            for m in 1..=radius {
                let wm = w[(radius + m) as usize];
                acc += wm * (x[reflect(i as i64 + m)] + x[reflect(i as i64 - m)]);
            }
            lane[i] = acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The score of one lag as §4 step 3 states it, one element at a time.
    fn direct_score(g: ArrayView2<f32>, t: ArrayView2<f32>, k: i32) -> f32 {
        let n = g.nrows();
        let nc = g.ncols();
        let mut acc = 0f64;
        for r in 0..n {
            let src = (r as i64 - k as i64).rem_euclid(n as i64) as usize;
            acc += f64::from(mean_f32((0..nc).map(|c| g[[src, c]] * t[[r, c]]), nc));
        }
        (acc / n as f64) as f32
    }

    #[test]
    fn lag_scores_are_the_direct_scores_bit_for_bit() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        // Fewer rows than lags (the roll wraps more than once), a lag count
        // that is not a multiple of the lanes, and a probe-sized case; one
        // view of rows within a larger array, as the blocks take them.
        for (n, lags) in [
            (7usize, -15..=15),
            (40, -5..=5),
            (575, -60..=60),
            (1, -2..=3),
        ] {
            let g = Array2::from_shape_fn((n + 4, N_AMP_BINS), |_| next());
            let t = Array2::from_shape_fn((n + 4, N_AMP_BINS), |_| next());
            let (gv, tv) = (
                g.slice(ndarray::s![2..n + 2, ..]),
                t.slice(ndarray::s![2..n + 2, ..]),
            );
            let got = lag_scores(gv, tv, lags.clone());
            let want: Vec<f32> = lags.map(|k| direct_score(gv, tv, k)).collect();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{n} rows"
            );
        }
    }
}
