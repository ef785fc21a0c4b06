//! Universal templates learned from the recording, as Kilosort4 4.1.7 does by
//! default (`templates_from_data = True`, `spikedetect.extract_wPCA_wTEMP`),
//! made deterministic.
//!
//! 1. [`isolated_peaks`] / [`extract_clips`]: in one whitened window, the
//!    single-channel peaks of |X| above `Th_single_ch` that are the maximum of
//!    their ±4-row × ±5-sample box and the only such peak in their ±6-row ×
//!    ±30-sample box; each gives the `nt`-sample clip with the peak at `nt0min`.
//! 2. [`ClipPool`]: clips of every 25th window ([`LEARN_NSKIP`]) in order, a
//!    window skipped (and reading stopped) once its clips would pass
//!    [`MAX_CLIPS`]; each clip divided by its L2 norm.
//! 3. [`learn_wpca`]: the top `n_pcs` right singular vectors of the clip matrix,
//!    uncentred, with a fixed sign (see there).
//! 4. [`learn_wtemp`]: k-means (greedy k-means++ seeding, `n_init` restarts,
//!    lowest inertia kept) with a seeded ChaCha8 generator, centroids unit-norm.
//!
//! Everything is independent of the number of threads: sums are formed over fixed
//! chunks of clips in a fixed order, and the random numbers depend only on the
//! seed and the restart number. Kilosort4 draws its k-means and its randomized SVD
//! from numpy's global random state instead, so its templates change between
//! seeds (see README, "Universal templates").

use ndarray::{Array2, ArrayView2};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rayon::prelude::*;

use crate::detect::templates::UniversalTemplates;
use crate::error::DetectError;

/// Kilosort4 reads every 25th window for this step (its own fixed `nskip`, not
/// the `nskip` setting), starting with window 0.
pub const LEARN_NSKIP: u64 = 25;
/// At most this many clips are pooled (Kilosort4's clip buffer size).
pub const MAX_CLIPS: usize = 500_000;
/// Half-size (rows, samples) of the box a peak must be the maximum of.
pub const PEAK_BOX: (usize, usize) = (4, 5);
/// Half-size (rows, samples) of the box in which a peak must be the only one.
pub const ISOLATION_BOX: (usize, usize) = (6, 30);
/// Default of [`LearnSettings::min_clips`]: below 300 isolated clips (50 per
/// template with 6 templates) spikecube does not learn and falls back to the
/// built-in templates. Not a Kilosort4 setting: Kilosort4 learns from any number
/// (and fails with fewer clips than templates).
pub const DEFAULT_MIN_CLIPS: usize = 300;
/// Clips per chunk of every sum over clips: the chunks' partial sums are added
/// in chunk order, so results do not depend on the thread count.
const CHUNK: usize = 4096;

/// Settings of the learning step, with Kilosort4's names and defaults.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LearnSettings {
    /// Threshold on |X| (whitened units) for a single-channel peak. Default 6.
    #[serde(rename = "Th_single_ch")]
    pub th_single_ch: f32,
    /// Temporal templates to learn (k-means clusters). Default 6.
    pub n_templates: usize,
    /// PCs to learn (rows of wPCA). Default 6.
    pub n_pcs: usize,
    /// Seed of the k-means++ draws. Default 1 (the value `run_kilosort` seeds numpy with).
    pub seed: u64,
    /// k-means restarts; the one with the lowest inertia is kept. Default 10 (scikit-learn's `n_init` in Kilosort4).
    pub n_init: usize,
    /// Most Lloyd iterations per restart. Default 300 (scikit-learn's).
    pub max_iter: usize,
    /// Relative tolerance: a restart stops when the centroids moved (sum of
    /// squared shifts) by at most `tol` × the mean per-sample variance of the
    /// clips. Default 1e-4 (scikit-learn's).
    pub tol: f64,
    /// Fewest clips to learn from ([`DEFAULT_MIN_CLIPS`]); with fewer the
    /// built-in templates are used. Raised to `max(n_templates, n_pcs)` when
    /// lower (the least k-means and the SVD can work with).
    pub min_clips: usize,
    /// Check each learned wTEMP row for its peak at `nt0min` and realign or
    /// replace those off centre ([`crate::detect::template_check`]); false
    /// keeps them (Kilosort4), still reporting them. Default true.
    #[serde(default = "yes")]
    pub template_check: bool,
}

fn yes() -> bool {
    true
}

impl Default for LearnSettings {
    fn default() -> Self {
        LearnSettings {
            th_single_ch: 6.0,
            n_templates: 6,
            n_pcs: 6,
            seed: 1,
            n_init: 10,
            max_iter: 300,
            tol: 1e-4,
            min_clips: DEFAULT_MIN_CLIPS,
            template_check: true,
        }
    }
}

impl LearnSettings {
    /// Fewest clips to learn from: `min_clips`, at least `max(n_templates, n_pcs)`.
    pub fn min_clips(&self) -> usize {
        self.min_clips.max(self.n_templates).max(self.n_pcs)
    }

    /// Checks the ranges.
    ///
    /// # Errors
    /// [`DetectError::Setting`] naming the setting.
    pub fn validate(&self, nt: usize) -> Result<(), DetectError> {
        let bad = |name, message: String| Err(DetectError::Setting { name, message });
        if !(self.th_single_ch.is_finite() && self.th_single_ch > 0.0) {
            return bad(
                "Th_single_ch",
                format!("is {}; must be a positive number", self.th_single_ch),
            );
        }
        if self.n_templates == 0 {
            return bad("n_templates", "is 0; must be at least 1".into());
        }
        if self.n_pcs == 0 || self.n_pcs > nt {
            return bad(
                "n_pcs",
                format!("is {}; must be 1 to nt = {nt}", self.n_pcs),
            );
        }
        if self.n_init == 0 || self.max_iter == 0 {
            return bad(
                "n_init",
                "k-means needs at least one restart and one iteration".into(),
            );
        }
        Ok(())
    }
}

/// The isolated single-channel peaks of one whitened window `x` (C sites × NT
/// samples, rows in channel-map order), as (site, sample) in row-major order
/// (all of site 0 by sample, then site 1, …): Kilosort4's `extract_snippets`.
///
/// A peak is a cell with |x| > `th_single_ch` equal to the largest |x| in its
/// ±4-row × ±5-sample box (cells outside the window ignored); it is kept when no
/// other peak lies in its ±6-row × ±30-sample box, and when `nt ≤ t < NT − nt`.
/// Rows are neighbours by index, not by distance, as in Kilosort4.
pub fn isolated_peaks(x: ArrayView2<f32>, th_single_ch: f32, nt: usize) -> Vec<(usize, usize)> {
    isolate_peaks(&row_peaks(x, th_single_ch), nt, x.ncols())
}

/// The peaks of each row of `x` ([`isolated_peaks`]' first test: |x| above
/// `th_single_ch` and the largest |x| in the [`PEAK_BOX`]), by sample.
pub fn row_peaks(x: ArrayView2<f32>, th_single_ch: f32) -> Vec<Vec<usize>> {
    let (n_rows, n_t) = x.dim();
    let (pr, pt) = PEAK_BOX;
    (0..n_rows)
        .into_par_iter()
        .map(|c| {
            let row = x.row(c);
            let mut out = Vec::new();
            for t in 0..n_t {
                let a = row[t].abs();
                // Only cells above the threshold (never NaN) can be peaks.
                if a.is_nan() || a <= th_single_ch {
                    continue;
                }
                let (r0, r1) = (c.saturating_sub(pr), (c + pr).min(n_rows - 1));
                let (t0, t1) = (t.saturating_sub(pt), (t + pt).min(n_t - 1));
                let is_max = (r0..=r1).all(|r| {
                    let rr = x.row(r);
                    (t0..=t1).all(|s| rr[s].abs() <= a)
                });
                if is_max {
                    out.push(t);
                }
            }
            out
        })
        .collect()
}

/// [`isolated_peaks`]' second test on the peaks of each row of a window of
/// `n_t` samples ([`row_peaks`], or the device's
/// [`crate::detect::gpu::GpuDetector::learning_clips`]): the peaks with no
/// other in their [`ISOLATION_BOX`] and `nt ≤ t < n_t − nt`, in row-major
/// order.
pub fn isolate_peaks(peaks: &[Vec<usize>], nt: usize, n_t: usize) -> Vec<(usize, usize)> {
    let n_rows = peaks.len();
    let (ir, it) = ISOLATION_BOX;
    let mut kept = Vec::new();
    for (c, row) in peaks.iter().enumerate() {
        for &t in row {
            if t < nt || t + nt >= n_t {
                continue;
            }
            let (r0, r1) = (c.saturating_sub(ir), (c + ir).min(n_rows - 1));
            let (lo, hi) = (t.saturating_sub(it), t + it);
            let n: usize = (r0..=r1)
                .map(|r| {
                    let p = &peaks[r];
                    p.partition_point(|&s| s <= hi) - p.partition_point(|&s| s < lo)
                })
                .sum();
            if n == 1 {
                kept.push((c, t));
            }
        }
    }
    kept
}

/// How the learning cuts clips from a whitened window
/// ([`extract_clips`] with these settings; on a device,
/// [`crate::detect::gpu::GpuDetector::learning_clips`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipCut {
    /// `Th_single_ch` (whitened units).
    pub th_single_ch: f32,
    /// Clip length, samples.
    pub nt: usize,
    /// The peak's sample in its clip.
    pub nt0min: usize,
}

impl ClipCut {
    /// The clips of the whitened window `x` (C × NT), one row each (n × nt).
    pub fn cut(&self, x: ArrayView2<f32>) -> Array2<f32> {
        extract_clips(x, self.th_single_ch, self.nt, self.nt0min).1
    }
}

/// The clips of [`isolated_peaks`]: row i is `x[c, t − nt0min .. t − nt0min + nt]`
/// for the i-th peak (c, t), signed and not normalised (n × nt, float32).
///
/// # Panics
/// Never for `nt0min < nt`, which [`crate::DetectionSettings::validate`] ensures.
pub fn extract_clips(
    x: ArrayView2<f32>,
    th_single_ch: f32,
    nt: usize,
    nt0min: usize,
) -> (Vec<(usize, usize)>, Array2<f32>) {
    let peaks = isolated_peaks(x, th_single_ch, nt);
    let mut clips = Array2::zeros((peaks.len(), nt));
    for (i, &(c, t)) in peaks.iter().enumerate() {
        let start = t - nt0min;
        clips
            .row_mut(i)
            .assign(&x.row(c).slice(ndarray::s![start..start + nt]));
    }
    (peaks, clips)
}

/// The clips pooled over windows (Kilosort4's clip buffer).
#[derive(Debug, Clone)]
pub struct ClipPool {
    nt: usize,
    cap: usize,
    data: Vec<f32>,
    /// Windows whose clips were added.
    pub windows_used: u64,
    /// Set once a window's clips did not fit: that window and all later ones are skipped.
    pub full: bool,
}

impl ClipPool {
    /// An empty pool of `nt`-sample clips holding at most `cap` ([`MAX_CLIPS`]).
    pub fn new(nt: usize, cap: usize) -> ClipPool {
        ClipPool {
            nt,
            cap,
            data: Vec::new(),
            windows_used: 0,
            full: false,
        }
    }

    /// Adds one window's clips (n × nt) unless they would take the pool past its
    /// cap; then the pool is full and takes nothing more. Returns whether the
    /// caller should go on reading windows.
    pub fn add_window(&mut self, clips: ArrayView2<f32>) -> bool {
        if self.full {
            return false;
        }
        if self.len() + clips.nrows() > self.cap {
            self.full = true;
            return false;
        }
        self.data.extend(clips.iter().copied());
        self.windows_used += 1;
        true
    }

    /// Clips pooled.
    pub fn len(&self) -> usize {
        self.data.len() / self.nt
    }

    /// Whether no clip was pooled.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The clips, each divided by its L2 norm (computed in float64), n × nt.
    pub fn normalised(&self) -> Array2<f32> {
        let mut out = Array2::from_shape_vec((self.len(), self.nt), self.data.clone())
            .expect("the pool holds whole clips");
        for mut row in out.rows_mut() {
            let norm = row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
                .sqrt();
            if norm > 0.0 {
                row.mapv_inplace(|v| (f64::from(v) / norm) as f32);
            }
        }
        out
    }
}

/// Σ clipᵀ·clip (nt × nt, float64) over fixed chunks of clips, added in order.
fn gram(clips: ArrayView2<f32>) -> Array2<f64> {
    let (n, d) = clips.dim();
    let parts: Vec<Vec<f64>> = (0..n.div_ceil(CHUNK))
        .into_par_iter()
        .map(|k| {
            let mut g = vec![0f64; d * d];
            for i in k * CHUNK..((k + 1) * CHUNK).min(n) {
                let x: Vec<f64> = clips.row(i).iter().map(|&v| f64::from(v)).collect();
                for a in 0..d {
                    let xa = x[a];
                    for b in a..d {
                        g[a * d + b] += xa * x[b];
                    }
                }
            }
            g
        })
        .collect();
    let mut g = Array2::<f64>::zeros((d, d));
    for p in &parts {
        for a in 0..d {
            for b in a..d {
                g[[a, b]] += p[a * d + b];
            }
        }
    }
    for a in 0..d {
        for b in 0..a {
            g[[a, b]] = g[[b, a]];
        }
    }
    g
}

/// Turns the first component of `wpca` (n_pcs × nt) so that it is negative at
/// the trough sample `nt0min`, as in Kilosort4's built-in wPCA: a trough-first
/// spike then has a positive first PC feature on its largest sites, which is
/// what Phy's depth estimate (phylib's `get_depths`, which keeps the positive
/// first features) and tools built on it expect. Negating a component is
/// exact, so detection, clustering, templates and matching give the same
/// bits either way; only the sign of that feature in `pc_features` follows it.
/// Kilosort4's learned wPCA has an arbitrary sign (its randomized SVD).
/// A component that is zero at `nt0min` (or a window shorter than it) keeps
/// [`learn_wpca`]'s sign.
pub fn trough_first_positive(wpca: &mut Array2<f32>, nt0min: usize) {
    if wpca.nrows() == 0 || nt0min >= wpca.ncols() {
        return;
    }
    if wpca[[0, nt0min]] > 0.0 {
        wpca.row_mut(0).mapv_inplace(|v| -v);
    }
}

/// wPCA: the top `n_pcs` right singular vectors of the clip matrix (n × nt),
/// uncentred, as rows (n_pcs × nt, float32, orthonormal).
///
/// They are the leading eigenvectors of the Gram matrix CᵀC (nt × nt, formed in
/// float64 over fixed chunks, so the same for any thread count), found with
/// faer's SVD of that symmetric matrix. Sign convention: each component's entry
/// of largest magnitude (the first one on a tie) is positive. Kilosort4's
/// randomized `TruncatedSVD` spans the same subspace with arbitrary signs.
///
/// # Errors
/// [`DetectError::Input`] when there are fewer clips than `n_pcs` or the SVD fails.
pub fn learn_wpca(clips: ArrayView2<f32>, n_pcs: usize) -> Result<Array2<f32>, DetectError> {
    let (n, d) = clips.dim();
    if n < n_pcs || n_pcs > d {
        return Err(DetectError::Input {
            what: "wPCA".into(),
            message: format!("{n} clips of {d} samples cannot give {n_pcs} components"),
        });
    }
    let g = gram(clips);
    let m = faer::Mat::<f64>::from_fn(d, d, |i, j| g[[i, j]]);
    let svd = m.svd().map_err(|e| DetectError::Input {
        what: "wPCA".into(),
        message: format!("the SVD did not converge ({e:?})"),
    })?;
    let v = svd.V();
    let mut out = Array2::<f32>::zeros((n_pcs, d));
    for k in 0..n_pcs {
        let col: Vec<f64> = (0..d).map(|i| v[(i, k)]).collect();
        let mut best = 0;
        for i in 1..d {
            if col[i].abs() > col[best].abs() {
                best = i;
            }
        }
        let sign = if col[best] < 0.0 { -1.0 } else { 1.0 };
        for i in 0..d {
            out[[k, i]] = (sign * col[i]) as f32;
        }
    }
    Ok(out)
}

/// Squared Euclidean distance, float32 with 8 lanes in a fixed order.
#[inline]
fn dist2(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            let d = x[l] - y[l];
            acc[l] += d * d;
        }
    }
    let mut s = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        let d = x - y;
        s += d * d;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + s
}

/// A uniform number in [0, 1) from 53 random bits (also the clusters'
/// ChaCha8 seeding draws').
pub(crate) fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The index i with cum[i−1] ≤ r < cum[i] (the last index when r reaches the total).
fn draw(cum: &[f64], r: f64) -> usize {
    cum.partition_point(|&c| c <= r).min(cum.len() - 1)
}

/// Per point, its squared distance to `centre` (float32), in point order.
fn distances_to(x: &[f32], d: usize, centre: &[f32]) -> Vec<f32> {
    x.par_chunks(d).map(|p| dist2(p, centre)).collect()
}

/// Greedy k-means++ seeding (scikit-learn's: 2 + ⌊ln k⌋ candidates per centre,
/// drawn with probability ∝ squared distance to the nearest chosen centre, the
/// one lowering the total most kept).
fn kmeans_pp(x: &[f32], d: usize, k: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    let n = x.len() / d;
    let trials = 2 + (k as f64).ln().floor() as usize;
    let mut centres = Vec::with_capacity(k * d);
    let first = ((uniform(rng) * n as f64) as usize).min(n - 1);
    centres.extend_from_slice(&x[first * d..(first + 1) * d]);
    let mut closest = distances_to(x, d, &x[first * d..(first + 1) * d]);
    for _ in 1..k {
        let mut cum = Vec::with_capacity(n);
        let mut total = 0f64;
        for &v in &closest {
            total += f64::from(v);
            cum.push(total);
        }
        let mut best: Option<(f64, usize, Vec<f32>)> = None;
        for _ in 0..trials {
            let cand = if total > 0.0 {
                draw(&cum, uniform(rng) * total)
            } else {
                ((uniform(rng) * n as f64) as usize).min(n - 1)
            };
            let dc = distances_to(x, d, &x[cand * d..(cand + 1) * d]);
            let merged: Vec<f32> = closest.iter().zip(&dc).map(|(&a, &b)| a.min(b)).collect();
            let pot = chunked_sum(&merged);
            if best.as_ref().is_none_or(|b| pot < b.0) {
                best = Some((pot, cand, merged));
            }
        }
        let (_, cand, merged) = best.expect("at least two trials");
        centres.extend_from_slice(&x[cand * d..(cand + 1) * d]);
        closest = merged;
    }
    centres
}

/// Σ v in float64 over fixed chunks, added in order.
fn chunked_sum(v: &[f32]) -> f64 {
    let parts: Vec<f64> = v
        .par_chunks(CHUNK)
        .map(|c| c.iter().map(|&a| f64::from(a)).sum::<f64>())
        .collect();
    parts.iter().sum()
}

/// One assignment pass: labels, each point's squared distance, per-cluster sums
/// (float64) and counts. Deterministic for any thread count.
struct Assignment {
    labels: Vec<u32>,
    dist: Vec<f32>,
    sums: Vec<f64>,
    counts: Vec<u64>,
    inertia: f64,
}

fn assign(x: &[f32], d: usize, centres: &[f32]) -> Assignment {
    let k = centres.len() / d;
    let parts: Vec<Assignment> = x
        .par_chunks(CHUNK * d)
        .map(|chunk| {
            let m = chunk.len() / d;
            let mut labels = Vec::with_capacity(m);
            let mut dist = Vec::with_capacity(m);
            let mut sums = vec![0f64; k * d];
            let mut counts = vec![0u64; k];
            let mut inertia = 0f64;
            for p in chunk.chunks_exact(d) {
                let mut bj = 0;
                let mut bd = f32::INFINITY;
                for j in 0..k {
                    let dj = dist2(p, &centres[j * d..(j + 1) * d]);
                    if dj < bd {
                        bd = dj;
                        bj = j;
                    }
                }
                labels.push(bj as u32);
                dist.push(bd);
                counts[bj] += 1;
                inertia += f64::from(bd);
                for (s, &v) in sums[bj * d..(bj + 1) * d].iter_mut().zip(p) {
                    *s += f64::from(v);
                }
            }
            Assignment {
                labels,
                dist,
                sums,
                counts,
                inertia,
            }
        })
        .collect();
    let mut out = Assignment {
        labels: Vec::with_capacity(x.len() / d),
        dist: Vec::with_capacity(x.len() / d),
        sums: vec![0f64; k * d],
        counts: vec![0u64; k],
        inertia: 0.0,
    };
    for p in parts {
        out.labels.extend(p.labels);
        out.dist.extend(p.dist);
        for (a, b) in out.sums.iter_mut().zip(&p.sums) {
            *a += b;
        }
        for (a, b) in out.counts.iter_mut().zip(&p.counts) {
            *a += b;
        }
        out.inertia += p.inertia;
    }
    out
}

/// One k-means restart: greedy k-means++ seeding from a ChaCha8 generator
/// seeded with `seed` on stream `restart`, then Lloyd iterations ([`kmeans`]'s
/// stopping rules; `tol` already scaled by the variance). Returns the
/// centroids (k × d), their final assignment and the iterations run.
fn lloyd(
    xs: &[f32],
    d: usize,
    k: usize,
    seed: u64,
    restart: usize,
    max_iter: usize,
    tol: f64,
) -> (Vec<f32>, Assignment, usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(restart as u64);
    let mut centres = kmeans_pp(xs, d, k, &mut rng);
    let mut labels: Vec<u32> = Vec::new();
    let mut iters = 0;
    for _ in 0..max_iter {
        iters += 1;
        let a = assign(xs, d, &centres);
        let same = a.labels == labels;
        labels = a.labels;
        if same {
            break;
        }
        let mut new = vec![0f32; k * d];
        let mut taken: Vec<usize> = Vec::new();
        for j in 0..k {
            if a.counts[j] > 0 {
                for i in 0..d {
                    new[j * d + i] = (a.sums[j * d + i] / a.counts[j] as f64) as f32;
                }
            } else {
                // The farthest point not yet taken (the first on a tie).
                let mut far = usize::MAX;
                for (p, &dp) in a.dist.iter().enumerate() {
                    if !taken.contains(&p) && (far == usize::MAX || dp > a.dist[far]) {
                        far = p;
                    }
                }
                taken.push(far);
                new[j * d..(j + 1) * d].copy_from_slice(&xs[far * d..(far + 1) * d]);
            }
        }
        let shift: f64 = new
            .iter()
            .zip(&centres)
            .map(|(&a, &b)| f64::from(a - b).powi(2))
            .sum();
        centres = new;
        if shift <= tol {
            break;
        }
    }
    let a = assign(xs, d, &centres);
    (centres, a, iters)
}

/// Result of [`kmeans`].
#[derive(Debug, Clone)]
pub struct KMeans {
    /// Centroids, k × d (not normalised).
    pub centres: Array2<f32>,
    /// Clips per centroid.
    pub counts: Vec<u64>,
    /// Σ squared distance of each clip to its nearest centroid.
    pub inertia: f64,
    /// The restart kept (0-based).
    pub restart: usize,
    /// Lloyd iterations of each restart.
    pub iterations: Vec<usize>,
}

/// k-means of the rows of `x` (n × d) into `k` clusters: for each of `n_init`
/// restarts, greedy k-means++ seeding from a ChaCha8 generator seeded with
/// `seed` on stream `restart`, then Lloyd iterations until no label changes,
/// the centroids move by at most `tol` × mean per-column variance, or
/// `max_iter`; an empty cluster takes the point farthest from its centroid. The
/// restart with the lowest inertia (the first on a tie) is kept.
///
/// # Errors
/// [`DetectError::Input`] when there are fewer rows than `k`.
pub fn kmeans(
    x: ArrayView2<f32>,
    k: usize,
    seed: u64,
    n_init: usize,
    max_iter: usize,
    tol: f64,
) -> Result<KMeans, DetectError> {
    let (n, d) = x.dim();
    if n < k || k == 0 {
        return Err(DetectError::Input {
            what: "wTEMP (k-means)".into(),
            message: format!("{n} clips cannot make {k} clusters"),
        });
    }
    let x = x.as_standard_layout();
    let xs = x.as_slice().expect("standard layout");
    // scikit-learn's tolerance: tol × mean over columns of the column variance.
    let mut mean = vec![0f64; d];
    let mut sq = vec![0f64; d];
    for p in xs.chunks_exact(d) {
        for j in 0..d {
            mean[j] += f64::from(p[j]);
            sq[j] += f64::from(p[j]) * f64::from(p[j]);
        }
    }
    let var: f64 = (0..d)
        .map(|j| sq[j] / n as f64 - (mean[j] / n as f64).powi(2))
        .sum::<f64>()
        / d as f64;
    let tol = tol * var;
    // The restarts are independent (each draws from its own stream), so they
    // run in parallel; the best is then chosen in restart order, as one by one.
    let runs: Vec<(Vec<f32>, Assignment, usize)> = (0..n_init)
        .into_par_iter()
        .map(|restart| lloyd(xs, d, k, seed, restart, max_iter, tol))
        .collect();
    let mut best: Option<KMeans> = None;
    let mut iterations = Vec::with_capacity(n_init);
    for (restart, (centres, a, iters)) in runs.into_iter().enumerate() {
        iterations.push(iters);
        if best.as_ref().is_none_or(|b| a.inertia < b.inertia) {
            best = Some(KMeans {
                centres: Array2::from_shape_vec((k, d), centres).expect("k × d"),
                counts: a.counts,
                inertia: a.inertia,
                restart,
                iterations: Vec::new(),
            });
        }
    }
    let mut best = best.expect("n_init ≥ 1");
    best.iterations = iterations;
    Ok(best)
}

/// wTEMP: the [`kmeans`] centroids of the normalised clips, each divided by its
/// L2 norm, ordered by cluster size (largest first; the lower index on a tie).
/// Returns them (n_templates × nt, float32) with the k-means result.
///
/// # Errors
/// As [`kmeans`].
pub fn learn_wtemp(
    clips: ArrayView2<f32>,
    settings: &LearnSettings,
) -> Result<(Array2<f32>, KMeans), DetectError> {
    let km = kmeans(
        clips,
        settings.n_templates,
        settings.seed,
        settings.n_init,
        settings.max_iter,
        settings.tol,
    )?;
    let mut order: Vec<usize> = (0..settings.n_templates).collect();
    order.sort_by(|&a, &b| km.counts[b].cmp(&km.counts[a]).then(a.cmp(&b)));
    let d = clips.ncols();
    let mut w = Array2::<f32>::zeros((settings.n_templates, d));
    for (r, &j) in order.iter().enumerate() {
        let c = km.centres.row(j);
        let norm = c.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        for i in 0..d {
            w[[r, i]] = if norm > 0.0 {
                (f64::from(c[i]) / norm) as f32
            } else {
                0.0
            };
        }
    }
    Ok((w, km))
}

/// What [`learn_from_windows`] found.
#[derive(Debug, Clone)]
pub struct Learned {
    /// The learned templates, or `None` when there were too few clips.
    pub templates: Option<UniversalTemplates>,
    /// Clips pooled.
    pub n_clips: usize,
    /// Windows whose clips were pooled.
    pub n_windows: u64,
    /// Windows read (every [`LEARN_NSKIP`]-th, up to the one that filled the pool).
    pub windows_read: u64,
    /// The fewest clips learning needs ([`LearnSettings::min_clips`]).
    pub min_clips: usize,
    /// k-means inertia of the kept restart (on the normalised clips), when learned.
    pub inertia: Option<f64>,
    /// Learned templates whose peak was off `nt0min`, and what was done
    /// ([`crate::detect::template_check::check_wtemp`]).
    pub template_findings: Vec<crate::detect::template_check::TemplateFinding>,
    /// Wall seconds of the three parts: the windows (read, preprocessed,
    /// clips cut), wPCA (the SVD) and wTEMP (the k-means restarts).
    pub seconds: [f64; 3],
}

/// The fewest windows [`learn_from_windows`] prepares at once.
pub const LEARN_WINDOWS_AT_ONCE_MIN: usize = 4;
/// The most windows [`learn_from_windows`] prepares at once.
pub const LEARN_WINDOWS_AT_ONCE_MAX: usize = 16;

/// Windows [`learn_from_windows`] prepares at once (read, preprocessed and
/// their clips cut in parallel) before pooling them in window order: the
/// current rayon pool's thread count clamped to
/// [`LEARN_WINDOWS_AT_ONCE_MIN`]`..=`[`LEARN_WINDOWS_AT_ONCE_MAX`]. Each
/// window's own preprocessing is only partly parallel, so one window per
/// thread keeps the cores busy; a 10-minute recording has only 12 windows to
/// learn from (every 25th of 300), so 16 threads prepare them all at once.
///
/// Memory: this many whitened windows, C × NT float32 each (plus what their
/// preprocessing holds), are alive at once: at 384 sites × 60 122 samples
/// (batch 60 000, nt 61) one is about 92 MB, so at most 16 × 92 MB ≈ 1.5 GB.
/// The result does not depend on this number.
pub fn learn_windows_at_once() -> usize {
    rayon::current_num_threads().clamp(LEARN_WINDOWS_AT_ONCE_MIN, LEARN_WINDOWS_AT_ONCE_MAX)
}

/// Kilosort4's `extract_wPCA_wTEMP` over a recording of `n_windows` windows:
/// `window(j)` returns the whitened window j (C × NT, as detection sees it) for
/// j = 0, 25, 50, …; the clips are pooled ([`ClipPool`]) and, when there are at
/// least [`LearnSettings::min_clips`], wPCA and wTEMP learned from them.
/// Up to [`learn_windows_at_once`] windows are made in parallel (`window` is
/// called from rayon's threads) and pooled in order, so the result is the one
/// of taking them one by one, whatever the thread count (a window made past
/// the one that filled the pool is not used; its error is not reported).
///
/// # Errors
/// Whatever `window` returns for a window that is pooled or fills the pool;
/// [`DetectError::Setting`] for invalid settings.
pub fn learn_from_windows<E>(
    n_windows: u64,
    nt: usize,
    nt0min: usize,
    settings: &LearnSettings,
    window: impl Fn(u64) -> Result<Array2<f32>, E> + Sync,
) -> Result<Learned, E>
where
    E: From<DetectError> + Send,
{
    learn_from_clips(n_windows, nt, nt0min, settings, |batch| {
        batch
            .par_iter()
            .map(|&j| {
                let x = window(j)?;
                Ok(extract_clips(x.view(), settings.th_single_ch, nt, nt0min).1)
            })
            .collect()
    })
}

/// [`learn_from_windows`] with the windows' clips made by the caller:
/// `clips(js)` returns the [`extract_clips`] clips (n × nt) of each whitened
/// window j of `js` in that order (it may stop after an error: the windows
/// after it are not used), for batches of up to [`learn_windows_at_once`] of
/// the windows 0, 25, 50, …. For a device that preprocesses the windows one
/// at a time on the calling thread; the result is the same as
/// [`learn_from_windows`]'s for the same whitened windows.
///
/// # Errors
/// As [`learn_from_windows`].
pub fn learn_from_clips<E>(
    n_windows: u64,
    nt: usize,
    nt0min: usize,
    settings: &LearnSettings,
    mut clips: impl FnMut(&[u64]) -> Vec<Result<Array2<f32>, E>>,
) -> Result<Learned, E>
where
    E: From<DetectError>,
{
    settings.validate(nt)?;
    let t0 = std::time::Instant::now();
    let mut pool = ClipPool::new(nt, MAX_CLIPS);
    let mut read = 0;
    let starts: Vec<u64> = (0..n_windows).step_by(LEARN_NSKIP as usize).collect();
    'batches: for batch in starts.chunks(learn_windows_at_once()) {
        let made = clips(batch);
        let n_made = made.len();
        for c in made {
            let c = c?;
            read += 1;
            if !pool.add_window(c.view()) {
                break 'batches;
            }
        }
        if n_made != batch.len() {
            return Err(DetectError::Input {
                what: "template learning".into(),
                message: format!(
                    "{n_made} of the {} windows asked for were made",
                    batch.len()
                ),
            }
            .into());
        }
    }
    let min_clips = settings.min_clips();
    let mut learned = Learned {
        templates: None,
        n_clips: pool.len(),
        n_windows: pool.windows_used,
        windows_read: read,
        min_clips,
        inertia: None,
        template_findings: Vec::new(),
        seconds: [t0.elapsed().as_secs_f64(), 0.0, 0.0],
    };
    if pool.len() < min_clips {
        return Ok(learned);
    }
    let t1 = std::time::Instant::now();
    let clips = pool.normalised();
    let mut wpca = learn_wpca(clips.view(), settings.n_pcs)?;
    trough_first_positive(&mut wpca, nt0min);
    let t2 = std::time::Instant::now();
    let (mut wtemp, km) = learn_wtemp(clips.view(), settings)?;
    learned.seconds[1] = (t2 - t1).as_secs_f64();
    learned.seconds[2] = t2.elapsed().as_secs_f64();
    learned.template_findings =
        crate::detect::template_check::check_wtemp(&mut wtemp, nt0min, settings.template_check);
    learned.templates = Some(UniversalTemplates { wtemp, wpca });
    learned.inertia = Some(km.inertia);
    Ok(learned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_component_is_turned_negative_at_the_trough() {
        let mut w = Array2::from_shape_fn((2, 5), |(k, t)| (k + t) as f32 - 1.5);
        let before = w.clone();
        trough_first_positive(&mut w, 2);
        // Row 0 was +0.5 at sample 2: negated, exactly; row 1 untouched.
        assert_eq!(w.row(0).to_vec(), before.row(0).mapv(|v| -v).to_vec());
        assert_eq!(w.row(1), before.row(1));
        // Already negative there, or outside the window: unchanged.
        let again = w.clone();
        trough_first_positive(&mut w, 2);
        trough_first_positive(&mut w, 9);
        assert_eq!(w, again);
    }

    #[test]
    fn a_lone_peak_is_isolated_and_its_clip_is_aligned() {
        let mut x = Array2::<f32>::zeros((20, 300));
        x[[7, 150]] = -10.0;
        x[[7, 151]] = -3.0;
        let (p, c) = extract_clips(x.view(), 6.0, 61, 20);
        assert_eq!(p, vec![(7, 150)]);
        assert_eq!(c[[0, 20]], -10.0);
        assert_eq!(c[[0, 21]], -3.0);
    }

    #[test]
    fn two_peaks_within_the_isolation_box_are_both_dropped() {
        let mut x = Array2::<f32>::zeros((20, 300));
        x[[7, 150]] = -10.0;
        x[[13, 180]] = 8.0; // 6 rows, 30 samples away: inside
        assert!(isolated_peaks(x.view(), 6.0, 61).is_empty());
        x[[13, 180]] = 0.0;
        x[[14, 180]] = 8.0; // 7 rows away: outside
        assert_eq!(isolated_peaks(x.view(), 6.0, 61), vec![(7, 150), (14, 180)]);
    }

    #[test]
    fn peaks_in_the_padding_count_for_isolation_but_give_no_clip() {
        let mut x = Array2::<f32>::zeros((4, 300));
        x[[1, 40]] = 9.0; // t < nt
        x[[2, 70]] = 9.0; // 30 samples later, 1 row away
        assert!(isolated_peaks(x.view(), 6.0, 61).is_empty());
    }

    #[test]
    fn the_pool_skips_the_window_that_would_overflow_and_all_later_ones() {
        let mut pool = ClipPool::new(3, 5);
        assert!(pool.add_window(Array2::<f32>::ones((3, 3)).view()));
        assert!(!pool.add_window(Array2::<f32>::ones((3, 3)).view()));
        assert!(!pool.add_window(Array2::<f32>::ones((1, 3)).view()));
        assert_eq!((pool.len(), pool.windows_used), (3, 1));
    }

    #[test]
    fn kmeans_finds_well_separated_clusters() {
        let mut x = Array2::<f32>::zeros((300, 4));
        for i in 0..300 {
            let c = i % 3;
            x[[i, c]] = 10.0 + (i as f32 * 0.37).sin() * 0.1;
        }
        let km = kmeans(x.view(), 3, 7, 3, 100, 1e-4).unwrap();
        let mut counts = km.counts.clone();
        counts.sort();
        assert_eq!(counts, vec![100, 100, 100]);
        assert!(km.inertia < 300.0 * 0.02);
    }
}
