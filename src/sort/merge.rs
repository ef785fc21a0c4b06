//! The CCG-gated global merges after the final clustering, Kilosort4 4.1.7's
//! `template_matching.merging_function(mode='ccg', r_thresh=0.5, check_dt=True)`
//! with `roll_features` (`../shared/docs/sorting-spec.md` §2.7), and the
//! template similarity it and the Phy export share (`CCG.similarity`).
//!
//! Layouts (row-major): `wall` (U, C, npc) float32 templates in wPCA space;
//! `wpca` (npc, nt); `st` (n, 3) float64 [sample, template, amplitude];
//! `tf` (n, nC, npc) float32 features; `clu` (n,) cluster ids 0…U−1.
//!
//! # Order and ties
//! - Clusters are visited by descending spike count, partners by descending
//!   similarity. Kilosort4 reverses `np.argsort` (quicksort: unstable, and on
//!   AVX2/AVX-512 machines NumPy's SIMD sort, whose order among equal keys
//!   depends on the CPU); here equal keys go **higher index first** (a
//!   reversed stable sort). Equal spike counts matter only when both such
//!   clusters are refractory and compete for the same partner.
//! - The final re-sort by time is stable: spikes with equal times keep their
//!   order in the input (Kilosort4's `np.argsort(st[:, 0])` leaves their order
//!   to NumPy's unstable sort). Equal times arise when two templates matched
//!   the same sample, or a merge shifted a spike onto another's time.
//!
//! # Precision
//! Similarities are computed in float64 from the float32 templates
//! (Kilosort4: float32 einsums); they decide only comparisons with 0.5 and
//! the partners' order. The shifted features and templates are computed in
//! float64 and rounded once to float32 (Kilosort4: three float32 matmuls).
//! The count-weighted template mean is Kilosort4's float32 arithmetic
//! exactly (weights rounded to float32, two products and a sum).
//!
//! # One template, two amplitudes
//! The matching's peaks in one peel are more than nt samples apart, and a fit
//! leaves little of its template in the residual next to it, so one learned
//! template is seldom matched twice within ±nt samples. Two clusters made of
//! one template's spikes then have a nearly empty cross-correlogram near
//! zero whatever their relation, and Kilosort4's test passes them as one
//! unit. When the matching also fitted that template to another unit's
//! residual (at a fraction of its amplitude), the final clustering separates
//! those fits and the merge puts them back into the unit. The rule refuses a pair whose two clusters have the same most
//! frequent template when the smaller median amplitude (`st` column 2, the
//! matching's fitted amplitude) is below
//! [`MergeSettings::same_template_amplitude_ratio`] times the larger (0:
//! Kilosort4's rule, the CCG alone decides). It would also keep apart one
//! neuron whose amplitude changed more than that between two clusters.

use anyhow::{Result, bail};
use ndarray::{Array2, Array3, ArrayView2, ArrayView3, Axis};
use rayon::prelude::*;

use super::ccg::{self, Thresholds};

/// Kilosort4's global-merge similarity threshold (`r_thresh`).
pub const R_THRESH: f64 = 0.5;

/// Lagged products of the temporal basis (Kilosort4's `WtW`): for PCs a, b and
/// lag index l = 0…2nt, Σ_t wPCA[a][t + nt − l]·wPCA[b][t] (l = nt is zero lag).
#[derive(Debug, Clone)]
pub struct Similarity {
    npc: usize,
    nt: usize,
    /// (npc, npc, 2nt + 1), float64.
    wtw: Vec<f64>,
}

/// One template divided by (1e-6 + its L2 norm), kept only on its non-zero channels.
#[derive(Debug, Clone, Default)]
pub struct Normed {
    chans: Vec<usize>,
    /// (chans.len(), npc).
    vals: Vec<f64>,
}

impl Similarity {
    /// `WtW` of a (npc, nt) temporal basis.
    pub fn new(wpca: ArrayView2<f32>) -> Self {
        let (npc, nt) = wpca.dim();
        // (npc, npc, 2nt + 1) in standard order: index (a·npc + b)·(2nt + 1) + lag.
        let wtw = crate::sort::templates::wtw_f64(wpca)
            .iter()
            .copied()
            .collect();
        Similarity { npc, nt, wtw }
    }

    /// Lags: 2nt + 1.
    pub fn n_lags(&self) -> usize {
        2 * self.nt + 1
    }

    /// Normalises template `w` (C, npc): w / (1e-6 + ‖w‖).
    pub fn normed(&self, w: ArrayView2<f32>) -> Normed {
        let mu = w.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        let mut out = Normed::default();
        for (c, row) in w.outer_iter().enumerate() {
            if row.iter().any(|&v| v != 0.0) {
                out.chans.push(c);
                out.vals
                    .extend(row.iter().map(|&v| f64::from(v) / (1e-6 + mu)));
            }
        }
        out
    }

    /// Normalised cross-correlation of templates `a` and `b` at every lag
    /// (`n_lags()` values; `a` is the one shifted, Kilosort4's `ctc[b, :]` for
    /// template `a`), from their [`Similarity::normed`] forms; `dense_a` is `a`
    /// scattered on all C channels ((C, npc), zero elsewhere).
    fn lags(&self, dense_a: &[f64], b: &Normed, out: &mut [f64]) {
        let npc = self.npc;
        let nl = self.n_lags();
        let mut utu = vec![0.0f64; npc * npc];
        let mut any = false;
        for (i, &c) in b.chans.iter().enumerate() {
            let ra = &dense_a[c * npc..(c + 1) * npc];
            if ra.iter().all(|&v| v == 0.0) {
                continue;
            }
            any = true;
            let rb = &b.vals[i * npc..(i + 1) * npc];
            for k in 0..npc {
                for m in 0..npc {
                    utu[k * npc + m] += ra[k] * rb[m];
                }
            }
        }
        out.iter_mut().for_each(|v| *v = 0.0);
        if !any {
            return;
        }
        for (km, &u) in utu.iter().enumerate() {
            let row = &self.wtw[km * nl..(km + 1) * nl];
            for (o, &w) in out.iter_mut().zip(row) {
                *o += u * w;
            }
        }
    }

    /// `a` on all `n_chan` channels, (C, npc) row-major.
    fn dense(&self, a: &Normed, n_chan: usize) -> Vec<f64> {
        let npc = self.npc;
        let mut d = vec![0.0f64; n_chan * npc];
        for (i, &c) in a.chans.iter().enumerate() {
            d[c * npc..(c + 1) * npc].copy_from_slice(&a.vals[i * npc..(i + 1) * npc]);
        }
        d
    }

    /// For template `k` against every template j: the largest normalised
    /// cross-correlation over lags (`cmax[j]`) and its lag index (`imax[j]`,
    /// the first on a tie; nt is zero lag). Parallel over j, deterministic.
    pub fn row(&self, k: usize, normed: &[Normed], n_chan: usize) -> (Vec<f64>, Vec<usize>) {
        let dense = self.dense(&normed[k], n_chan);
        normed
            .par_iter()
            .map(|b| {
                let mut lag = vec![0.0f64; self.n_lags()];
                self.lags(&dense, b, &mut lag);
                let mut best = (lag[0], 0usize);
                for (l, &v) in lag.iter().enumerate().skip(1) {
                    if v > best.0 {
                        best = (v, l);
                    }
                }
                best
            })
            .unzip()
    }

    /// Kilosort4's `CCG.similarity`: (U, U) maxima over lags of the normalised
    /// template cross-correlations, float64 (Kilosort4 stores them as float32).
    pub fn matrix(&self, wall: ArrayView3<f32>) -> Array2<f64> {
        let u = wall.shape()[0];
        let n_chan = wall.shape()[1];
        let normed: Vec<Normed> = (0..u)
            .map(|i| self.normed(wall.index_axis(Axis(0), i)))
            .collect();
        let rows: Vec<Vec<f64>> = (0..u)
            .into_par_iter()
            .map(|i| self.row(i, &normed, n_chan).0)
            .collect();
        Array2::from_shape_vec((u, u), rows.concat()).expect("U × U similarities")
    }
}

/// Settings of the global merges (Kilosort4's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MergeSettings {
    /// Similarity a partner needs (`r_thresh`, 0.5).
    pub r_thresh: f64,
    /// `acg_threshold` (0.2) and `ccg_threshold` (0.25).
    pub thresholds: Thresholds,
    /// Shift the absorbed cluster's spikes and features by the lag (`check_dt`, true).
    pub check_dt: bool,
    /// Two clusters whose most frequent learned template (`st` column 1) is
    /// the same merge only when the smaller of their median amplitudes
    /// (`st` column 2) is at least this fraction of the larger; 0 merges on
    /// the CCG alone, as Kilosort4 does. spikecube's default
    /// [`SAME_TEMPLATE_AMPLITUDE_RATIO`]; not a Kilosort4 setting.
    pub same_template_amplitude_ratio: f64,
}

/// spikecube's default [`MergeSettings::same_template_amplitude_ratio`]:
/// half, chosen on SpikeInterface's ground-truth recording (BENCHMARKS.md,
/// "Same-template merges"), where the same-template pairs the CCG passed
/// were either one unit (median amplitudes within 15 % of each other) or a
/// unit and low-amplitude fits to other units' residuals (the fits' median
/// 0.28–0.32 of the unit's).
pub const SAME_TEMPLATE_AMPLITUDE_RATIO: f64 = 0.5;

impl Default for MergeSettings {
    /// Kilosort4's merges with spikecube's same-template amplitude rule
    /// ([`MergeSettings::kilosort`] without it).
    fn default() -> Self {
        MergeSettings {
            same_template_amplitude_ratio: SAME_TEMPLATE_AMPLITUDE_RATIO,
            ..MergeSettings::kilosort()
        }
    }
}

impl MergeSettings {
    /// Kilosort4 4.1.7's global merges exactly: the CCG alone decides.
    pub fn kilosort() -> Self {
        MergeSettings {
            r_thresh: R_THRESH,
            thresholds: Thresholds::default(),
            check_dt: true,
            same_template_amplitude_ratio: 0.0,
        }
    }
}

/// What [`merge_ccg`]'s same-template rule reads of a cluster: its most
/// frequent learned template (the lowest id among equally frequent ones;
/// `None` for a cluster without spikes) and the lower middle value of its
/// amplitudes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Profile {
    template: Option<i64>,
    amplitude: f64,
}

impl Profile {
    /// The profile of the spikes `members` (rows of `st`).
    fn of(members: &[usize], st: &Array2<f64>) -> Profile {
        if members.is_empty() {
            return Profile {
                template: None,
                amplitude: 0.0,
            };
        }
        let mut templates: Vec<i64> = members.iter().map(|&i| st[[i, 1]] as i64).collect();
        templates.sort_unstable();
        let (mut best, mut best_n) = (templates[0], 0usize);
        let mut run_start = 0;
        for i in 1..=templates.len() {
            if i == templates.len() || templates[i] != templates[run_start] {
                if i - run_start > best_n {
                    (best, best_n) = (templates[run_start], i - run_start);
                }
                run_start = i;
            }
        }
        let mut amps: Vec<f64> = members.iter().map(|&i| st[[i, 2]]).collect();
        let mid = (amps.len() - 1) / 2;
        let (_, &mut amplitude, _) = amps.select_nth_unstable_by(mid, f64::total_cmp);
        Profile {
            template: Some(best),
            amplitude,
        }
    }

    /// Whether the same-template rule refuses merging clusters `a` and `b`:
    /// one most frequent template, and the smaller median amplitude below
    /// `ratio` times the larger. A NaN amplitude never refuses (the pair is
    /// left to the CCG).
    fn refuses(ratio: f64, a: Profile, b: Profile) -> bool {
        if ratio <= 0.0 || a.template.is_none() || a.template != b.template {
            return false;
        }
        let (lo, hi) = if a.amplitude <= b.amplitude {
            (a.amplitude, b.amplitude)
        } else {
            (b.amplitude, a.amplitude)
        };
        lo < ratio * hi
    }
}

/// The result of [`merge_ccg`]: U' ≤ U units.
#[derive(Debug, Clone)]
pub struct Merged {
    /// (U', C, npc) float32 templates of the surviving clusters, in id order.
    pub wall: Array3<f32>,
    /// (n,) unit ids 0…U'−1, in the re-sorted spike order.
    pub clu: Vec<i32>,
    /// (U',) whether each unit was refractory before the merges (Kilosort4's `is_ref`).
    pub is_ref: Vec<bool>,
    /// (n, 3) spikes re-sorted by time; absorbed clusters' times shifted by their lag.
    pub st: Array2<f64>,
    /// (n, nC, npc) features in the same order, shifted with their spikes.
    pub tf: Array3<f32>,
    /// Merges made.
    pub n_merges: usize,
    /// Pairs the CCG would have merged that the same-template amplitude rule
    /// refused ([`MergeSettings::same_template_amplitude_ratio`]).
    pub n_refused: usize,
}

/// Indices 0…n−1 ordered by descending key, equal keys higher index first.
fn descending<T: PartialOrd + Copy>(keys: &[T]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..keys.len()).collect();
    idx.sort_by(|&a, &b| {
        keys[b]
            .partial_cmp(&keys[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(b.cmp(&a))
    });
    idx
}

/// The (npc, npc) operator of Kilosort4's `roll_features` for a shift of `dt`
/// samples (|dt| < nt): to time with wPCA, roll by dt filling the wrapped edge
/// with the nearest kept sample (sample t takes t − dt clamped to [0, nt−1]),
/// back with wPCAᵀ. New coefficients f'[q] = Σ_p f[p]·M[p][q].
pub fn roll_operator(wpca: ArrayView2<f32>, dt: i64) -> Vec<f64> {
    let (npc, nt) = wpca.dim();
    let mut m = vec![0.0f64; npc * npc];
    for p in 0..npc {
        for q in 0..npc {
            let mut acc = 0.0f64;
            for t in 0..nt {
                let src = (t as i64 - dt).clamp(0, nt as i64 - 1) as usize;
                acc += f64::from(wpca[[p, src]]) * f64::from(wpca[[q, t]]);
            }
            m[p * npc + q] = acc;
        }
    }
    m
}

/// Applies a [`roll_operator`] to rows of npc coefficients in place.
fn roll_rows(data: &mut [f32], m: &[f64], npc: usize) {
    let mut tmp = vec![0.0f64; npc];
    for row in data.chunks_exact_mut(npc) {
        for (q, t) in tmp.iter_mut().enumerate() {
            *t = (0..npc).map(|p| f64::from(row[p]) * m[p * npc + q]).sum();
        }
        for (r, &t) in row.iter_mut().zip(&tmp) {
            *r = t as f32;
        }
    }
}

fn check_inputs(
    wall: &Array3<f32>,
    clu: &[i32],
    st: &Array2<f64>,
    tf: &Array3<f32>,
    wpca: ArrayView2<f32>,
    fs: f64,
) -> Result<()> {
    let (u, _, npc) = wall.dim();
    let n = clu.len();
    if st.nrows() != n || st.ncols() < 2 || tf.shape()[0] != n {
        bail!(
            "merges: st has {} rows × {} columns and tF {} rows, for {n} cluster labels (st needs ≥ 2 columns)",
            st.nrows(),
            st.ncols(),
            tf.shape()[0]
        );
    }
    if wpca.nrows() != npc || tf.shape()[2] != npc {
        bail!(
            "merges: Wall has {npc} PCs per channel, wPCA {} and tF {}",
            wpca.nrows(),
            tf.shape()[2]
        );
    }
    if !(fs.is_finite() && fs > 0.0) {
        bail!("merges: sample rate {fs} Hz must be positive");
    }
    if let Some(&c) = clu.iter().find(|&&c| c < 0 || c as usize >= u) {
        bail!(
            "merges: cluster label {c} outside 0…{} (Wall has {u} templates)",
            u as i64 - 1
        );
    }
    if let Some(t) = st.column(0).iter().find(|t| !t.is_finite()) {
        bail!("merges: spike time {t} is not finite");
    }
    Ok(())
}

/// Kilosort4's `merging_function` in mode `ccg` (module docs; spec §2.7).
///
/// 1. `is_ref` once, from [`ccg::refract`] on the input labels (times st[:,0]/fs s);
/// 2. clusters by descending count; a non-refractory or absorbed one is skipped;
/// 3. partners by descending similarity while ≥ `r_thresh`; the first whose
///    CCG with the cluster is cross-refractory is absorbed: its spikes and
///    template are shifted by dt = imax[k] − imax[j] samples (`check_dt`), the
///    template becomes the count-weighted mean, and the same cluster is tried again;
/// 4. ids compacted over the survivors, spikes re-sorted by time.
///
/// Unlike Kilosort4, a label 0…U−1 without spikes is allowed (count 0, never
/// refractory); Kilosort4 fails on it with an index error.
///
/// # Errors
/// When the arrays' sizes disagree, a label is outside 0…U−1, fs is not
/// positive or a spike time is not finite.
pub fn merge_ccg(
    mut wall: Array3<f32>,
    clu: &[i32],
    mut st: Array2<f64>,
    mut tf: Array3<f32>,
    wpca: ArrayView2<f32>,
    fs: f64,
    settings: &MergeSettings,
) -> Result<Merged> {
    check_inputs(&wall, clu, &st, &tf, wpca, fs)?;
    if !tf.is_standard_layout() {
        tf = tf.as_standard_layout().into_owned();
    }
    if !wall.is_standard_layout() {
        wall = wall.as_standard_layout().into_owned();
    }
    let (nn, n_chan, npc) = wall.dim();
    let nt = wpca.ncols();
    let mut ns = vec![0i64; nn];
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); nn];
    for (i, &c) in clu.iter().enumerate() {
        ns[c as usize] += 1;
        members[c as usize].push(i);
    }
    let order = descending(&ns);
    let times: Vec<f64> = st.column(0).iter().map(|&t| t / fs).collect();
    let clock = std::time::Instant::now();
    let (is_ref, _) = ccg::refract(clu, &times, nn, settings.thresholds);
    let refract_s = clock.elapsed().as_secs_f64();

    let sim = Similarity::new(wpca);
    let mut normed: Vec<Normed> = (0..nn)
        .map(|j| sim.normed(wall.index_axis(Axis(0), j)))
        .collect();
    let mut is_merged = vec![false; nn];
    let mut n_merges = 0usize;
    let ratio = settings.same_template_amplitude_ratio;
    let mut profiles: Vec<Profile> = if ratio > 0.0 {
        members.par_iter().map(|m| Profile::of(m, &st)).collect()
    } else {
        Vec::new()
    };
    let mut refused = std::collections::BTreeSet::new();
    let feat_len = tf.shape()[1] * npc;
    let mut t = 0usize;
    let (mut row_s, mut ccg_s, mut n_tests) = (0.0f64, 0.0f64, 0usize);
    while t < nn {
        let kk = order[t];
        if !is_ref[kk] || is_merged[kk] {
            t += 1;
            continue;
        }
        let t_row = std::time::Instant::now();
        let (mut cmax, imax) = sim.row(kk, &normed, n_chan);
        row_s += t_row.elapsed().as_secs_f64();
        cmax[kk] = 0.0;
        let seconds = |c: usize, st: &Array2<f64>| -> Vec<f64> {
            members[c].iter().map(|&i| st[[i, 0]] / fs).collect()
        };
        let st_k = seconds(kk, &st);
        // Partners above r_thresh by descending similarity: the first
        // cross-refractory one. Their CCGs are computed a batch at a time in
        // parallel; the first in order wins, whatever the batch size.
        let candidates: Vec<usize> = descending(&cmax)
            .into_iter()
            .take_while(|&jj| cmax[jj] >= settings.r_thresh)
            .collect();
        let batch = rayon::current_num_threads().max(1);
        let t_ccg = std::time::Instant::now();
        let mut partner = None;
        for group in candidates.chunks(batch) {
            n_tests += group.len();
            let tests: Vec<bool> = group
                .par_iter()
                .map(|&jj| {
                    let st_j = seconds(jj, &st);
                    ccg::check_ccg(&st_k, Some(&st_j), settings.thresholds).cross_refractory
                })
                .collect();
            // The first cross-refractory partner the amplitude rule allows.
            let first = group.iter().zip(&tests).find(|&(&jj, &passes)| {
                if passes && ratio > 0.0 && Profile::refuses(ratio, profiles[kk], profiles[jj]) {
                    if refused.insert((kk.min(jj), kk.max(jj))) {
                        tracing::debug!(
                            "merges: cluster {jj} not merged into {kk}: template {:?} is the most frequent in both, median amplitudes {:.2} and {:.2}",
                            profiles[kk].template,
                            profiles[jj].amplitude,
                            profiles[kk].amplitude
                        );
                    }
                    return false;
                }
                passes
            });
            if let Some((&jj, _)) = first {
                partner = Some(jj);
                break;
            }
        }
        ccg_s += t_ccg.elapsed().as_secs_f64();
        let Some(jj) = partner else {
            t += 1;
            continue;
        };
        is_merged[jj] = true;
        let dt = imax[kk] as i64 - imax[jj] as i64;
        if dt != 0 && settings.check_dt && dt.unsigned_abs() < nt as u64 {
            let m = roll_operator(wpca, dt);
            let flat = tf.as_slice_mut().expect("tF is contiguous");
            for &i in &members[jj] {
                roll_rows(&mut flat[i * feat_len..(i + 1) * feat_len], &m, npc);
                st[[i, 0]] -= dt as f64;
            }
            let mut wj = wall.index_axis_mut(Axis(0), jj);
            roll_rows(wj.as_slice_mut().expect("Wall is contiguous"), &m, npc);
        }
        let total = (ns[kk] + ns[jj]) as f64;
        let (a, b) = (
            (ns[kk] as f64 / total) as f32,
            (ns[jj] as f64 / total) as f32,
        );
        let wj = wall.index_axis(Axis(0), jj).to_owned();
        wall.index_axis_mut(Axis(0), kk)
            .zip_mut_with(&wj, |wk, &w| *wk = *wk * a + w * b);
        wall.index_axis_mut(Axis(0), jj).fill(0.0);
        ns[kk] += ns[jj];
        ns[jj] = 0;
        let moved = std::mem::take(&mut members[jj]);
        members[kk].extend(moved);
        normed[kk] = sim.normed(wall.index_axis(Axis(0), kk));
        normed[jj] = Normed::default();
        if ratio > 0.0 {
            profiles[kk] = Profile::of(&members[kk], &st);
            // Refused while the amplitudes differed; merged once they agreed.
            refused.remove(&(kk.min(jj), kk.max(jj)));
        }
        n_merges += 1;
    }
    let loop_s = clock.elapsed().as_secs_f64() - refract_s;
    let mut merged = finish(wall, members, is_ref, is_merged, st, tf, n_merges);
    merged.n_refused = refused.len();
    tracing::debug!(
        "merges: {n_merges} merges, {} refused by the same-template amplitude rule; refractoriness {refract_s:.3} s, merge loop {loop_s:.3} s (similarity rows {row_s:.3} s, CCG tests {ccg_s:.3} s {n_tests} tests in batches of up to {} partners), re-sort {:.3} s",
        merged.n_refused,
        rayon::current_num_threads(),
        clock.elapsed().as_secs_f64() - refract_s - loop_s
    );
    Ok(merged)
}

/// The rows `order` of a standard-layout (n, a, b) array, copied in parallel.
fn gather_rows(tf: &Array3<f32>, order: &[usize]) -> Array3<f32> {
    let (_, a, b) = tf.dim();
    let row = a * b;
    let src = tf.as_slice().expect("tF is contiguous");
    let mut out = Array3::<f32>::zeros((order.len(), a, b));
    if row > 0 {
        out.as_slice_mut()
            .expect("standard layout")
            .par_chunks_mut(row)
            .zip(order.par_iter())
            .for_each(|(o, &i)| o.copy_from_slice(&src[i * row..(i + 1) * row]));
    }
    out
}

/// Compacts ids over the surviving clusters and re-sorts spikes by time (stable).
fn finish(
    wall: Array3<f32>,
    members: Vec<Vec<usize>>,
    is_ref: Vec<bool>,
    is_merged: Vec<bool>,
    st: Array2<f64>,
    tf: Array3<f32>,
    n_merges: usize,
) -> Merged {
    let n = st.nrows();
    let mut clu2 = vec![0i32; n];
    let mut new_id = 0i32;
    let mut keep = Vec::new();
    for (c, m) in members.iter().enumerate() {
        if is_merged[c] {
            continue;
        }
        for &i in m {
            clu2[i] = new_id;
        }
        keep.push(c);
        new_id += 1;
    }
    let mut order: Vec<usize> = (0..n).collect();
    // Stable, as the sequential sort (equal times keep their input order).
    order.par_sort_by(|&a, &b| st[[a, 0]].total_cmp(&st[[b, 0]]));
    let (st2, tf2) = if order.iter().enumerate().all(|(i, &o)| i == o) {
        // Already in time order (no merge moved a spike): no copies.
        (st, tf)
    } else {
        (st.select(Axis(0), &order), gather_rows(&tf, &order))
    };
    Merged {
        wall: wall.select(Axis(0), &keep),
        clu: order.iter().map(|&i| clu2[i]).collect(),
        is_ref: keep.iter().map(|&c| is_ref[c]).collect(),
        st: st2,
        tf: tf2,
        n_merges,
        n_refused: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basis(npc: usize, nt: usize) -> Array2<f32> {
        // Smooth, roughly orthonormal bumps.
        Array2::from_shape_fn((npc, nt), |(p, t)| {
            let x = (t as f32 - nt as f32 / 2.0) / 6.0;
            (-(x * x) / 2.0).exp() * ((p as f32 + 1.0) * x * 0.7).cos() / 3.0
        })
    }

    #[test]
    fn roll_by_zero_is_projection() {
        let w = basis(3, 21);
        let m0 = roll_operator(w.view(), 0);
        // M[p][q] = Σ_t w_p w_q (the Gram matrix).
        for p in 0..3 {
            for q in 0..3 {
                let g: f64 = (0..21)
                    .map(|t| f64::from(w[[p, t]]) * f64::from(w[[q, t]]))
                    .sum();
                assert!((m0[p * 3 + q] - g).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn self_similarity_peaks_at_zero_lag() {
        let w = basis(3, 21);
        let sim = Similarity::new(w.view());
        let wall = Array3::from_shape_fn((2, 4, 3), |(k, c, p)| {
            ((k * 7 + c * 3 + p) as f32 * 0.37).sin()
        });
        let normed: Vec<Normed> = (0..2)
            .map(|j| sim.normed(wall.index_axis(Axis(0), j)))
            .collect();
        let (cmax, imax) = sim.row(0, &normed, 4);
        assert_eq!(imax[0], 21);
        assert!(cmax[0] > 0.0);
        assert!(cmax[1] <= cmax[0] + 1e-12);
        let m = sim.matrix(wall.view());
        assert!((m[[0, 1]] - m[[1, 0]]).abs() < 1e-9, "{m:?}");
    }

    #[test]
    fn ties_go_to_higher_index() {
        assert_eq!(descending(&[3i64, 5, 3, 5]), vec![3, 1, 2, 0]);
    }

    /// Two clusters made from one refractory train with identical templates
    /// merge into one; a third with a different template stays.
    #[test]
    fn refractory_halves_merge() {
        let (npc, nt, c) = (3, 21, 4);
        let w = basis(npc, nt);
        let mut wall = Array3::<f32>::zeros((3, c, npc));
        for p in 0..npc {
            wall[[0, 1, p]] = 1.0 + p as f32;
            wall[[1, 1, p]] = 1.0 + p as f32;
            wall[[2, 3, p]] = 2.0;
        }
        let fs = 30000.0;
        let mut rows = Vec::new();
        for i in 0..3000usize {
            // 10 Hz units: cluster 0 and 1 alternate spikes of one 100-ms-periodic train.
            let t = (i as f64 * 0.05 * fs).round();
            rows.push((t, (i % 2) as i32));
        }
        for i in 0..500usize {
            rows.push(((i as f64 * 0.29 * fs).round() + 7.0, 2));
        }
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        let n = rows.len();
        let st = Array2::from_shape_fn((n, 3), |(i, j)| if j == 0 { rows[i].0 } else { 0.0 });
        let clu: Vec<i32> = rows.iter().map(|r| r.1).collect();
        let tf = Array3::<f32>::zeros((n, 2, npc));
        let m = merge_ccg(wall, &clu, st, tf, w.view(), fs, &MergeSettings::kilosort()).unwrap();
        assert_eq!(m.n_merges, 1);
        assert_eq!(m.wall.shape(), &[2, c, npc]);
        assert_eq!(m.clu.iter().filter(|&&c| c == 0).count(), 3000);
        assert_eq!(m.is_ref, vec![true, true]);
        assert!(m.st.column(0).windows(2).into_iter().all(|w| w[0] <= w[1]));
    }

    /// Two clusters of one learned template with an empty CCG near zero: the
    /// same-template rule refuses them when one's median amplitude is below
    /// half the other's (a unit and fits to another unit's residual), and
    /// lets them merge when their amplitudes agree, when their templates
    /// differ, or with Kilosort4's settings.
    #[test]
    fn same_template_pairs_merge_only_with_agreeing_amplitudes() {
        let (npc, nt, c) = (3, 21, 4);
        let w = basis(npc, nt);
        let mut wall = Array3::<f32>::zeros((2, c, npc));
        for p in 0..npc {
            wall[[0, 1, p]] = 1.0 + p as f32;
            wall[[1, 1, p]] = 1.0 + p as f32;
        }
        let fs = 30000.0;
        let run = |amp1: f64, template1: f64, settings: &MergeSettings| {
            let n = 3000usize;
            // One 20-Hz train, alternate spikes in clusters 0 and 1.
            let st = Array2::from_shape_fn((n, 3), |(i, j)| match (j, i % 2) {
                (0, _) => (i as f64 * 0.05 * fs).round(),
                (1, 0) => 5.0,
                (1, _) => template1,
                (_, 0) => 30.0 + (i % 7) as f64,
                _ => amp1 + (i % 5) as f64,
            });
            let clu: Vec<i32> = (0..n).map(|i| (i % 2) as i32).collect();
            let tf = Array3::<f32>::zeros((n, 2, npc));
            let m = merge_ccg(wall.clone(), &clu, st, tf, w.view(), fs, settings).unwrap();
            (m.n_merges, m.n_refused)
        };
        let ours = MergeSettings::default();
        assert_eq!(ours.same_template_amplitude_ratio, 0.5);
        // Medians 33 and 10: refused.
        assert_eq!(run(8.0, 5.0, &ours), (0, 1));
        assert_eq!(run(8.0, 5.0, &MergeSettings::kilosort()), (1, 0));
        // Medians 33 and 30: one unit.
        assert_eq!(run(28.0, 5.0, &ours), (1, 0));
        // Another template: the CCG decides, as in Kilosort4.
        assert_eq!(run(8.0, 6.0, &ours), (1, 0));
        // Exactly half: allowed (the smaller must be below the fraction to refuse).
        assert!(!Profile::refuses(
            0.5,
            Profile {
                template: Some(1),
                amplitude: 10.0
            },
            Profile {
                template: Some(1),
                amplitude: 20.0
            },
        ));
        assert!(Profile::refuses(
            0.5,
            Profile {
                template: Some(1),
                amplitude: 9.99
            },
            Profile {
                template: Some(1),
                amplitude: 20.0
            },
        ));
        assert!(!Profile::refuses(
            0.0,
            Profile {
                template: Some(1),
                amplitude: 1.0
            },
            Profile {
                template: Some(1),
                amplitude: 20.0
            },
        ));
    }

    /// A cluster's profile: its most frequent template (the lowest id among
    /// equally frequent ones) and its lower middle amplitude.
    #[test]
    fn profiles_take_the_most_frequent_template_and_lower_median() {
        let st = Array2::from_shape_vec(
            (5, 3),
            vec![
                0.0, 7.0, 4.0, //
                1.0, 3.0, 1.0, //
                2.0, 7.0, 3.0, //
                3.0, 3.0, 2.0, //
                4.0, 9.0, 5.0,
            ],
        )
        .unwrap();
        let p = Profile::of(&[0, 1, 2, 3], &st);
        assert_eq!(p.template, Some(3));
        assert_eq!(p.amplitude, 2.0);
        let p = Profile::of(&[0, 1, 2, 3, 4], &st);
        assert_eq!((p.template, p.amplitude), (Some(3), 3.0));
        assert_eq!(Profile::of(&[], &st).template, None);
    }
}
