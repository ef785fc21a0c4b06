//! Learned templates between the first clustering and the matching pass
//! (Kilosort4 4.1.7 `template_matching.postprocess_templates`: `align_U`, then
//! `merging_function` in mode `'mu'`), and the template products the matching
//! uses (`prepare_matching`'s `WtW`, `UtU` and `ctc`), as
//! `shared/docs/sorting-spec.md` §2.4–2.5 states them.
//!
//! Shapes: K0 clusters of the first clustering, K templates after the
//! pre-merge, C sites, npc = 6 temporal PCs (`wPCA` rows), nt = 61 samples.
//! Templates are stored as PC coefficients per site; their waveform on site c
//! is `Σ_p U[k, p, c]·wPCA[p, :]`.
//!
//! Arithmetic: the sums that Kilosort4 does as float32 matrix products are
//! done here in float64 from the float32 inputs and rounded once, in a fixed
//! order, so results do not depend on the thread count and are within
//! Kilosort4's own float32 rounding of its values. Sites where a template is
//! exactly zero are skipped: their products are exact zeros in Kilosort4 too.

use ndarray::{Array3, ArrayView2, ArrayView3, s};
use rayon::prelude::*;

/// Similarity a pair needs for the pre-merge (`postprocess_templates`'s `r_thresh`).
pub const PRE_MERGE_SIMILARITY: f32 = 0.9;
/// Largest relative norm difference |2(μk − μj)/(μk + μj)| of a pre-merged pair (exclusive).
pub const PRE_MERGE_NORM_DIFF: f32 = 0.2;

/// Bad inputs to the template stage.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// Arrays whose shapes do not fit together.
    #[error("{what}: {message}")]
    Shape {
        /// Which array.
        what: &'static str,
        /// What is wrong, with the numbers.
        message: String,
    },
}

fn shape_err(what: &'static str, message: String) -> TemplateError {
    TemplateError::Shape { what, message }
}

/// `WtW` (npc × npc × (2·nt + 1)), Kilosort4's `prepare_matching`: lagged
/// products of the `wPCA` rows, `WtW[a, b, nt + d] = Σ_i wPCA[a, i]·wPCA[b, i + d]`
/// for lags d = −nt … nt (terms outside 0 … nt − 1 are zero).
///
/// Subtracting amp × template j's waveform at sample s from the data changes
/// template k's filter output at sample s + d by
/// `−amp·Σ_{a,b} UtU[k, j, a, b]·WtW[a, b, nt + d]`.
pub fn wtw(wpca: ArrayView2<f32>) -> Array3<f32> {
    wtw_f64(wpca).mapv(|v| v as f32)
}

/// [`wtw`] before its rounding to float32 (each lag summed in float64 over
/// ascending samples); the global merges' similarities use it as is.
pub fn wtw_f64(wpca: ArrayView2<f32>) -> Array3<f64> {
    let (npc, nt) = wpca.dim();
    let nt_i = nt as i64;
    let mut out = Array3::<f64>::zeros((npc, npc, 2 * nt + 1));
    for a in 0..npc {
        for b in 0..npc {
            for l in 0..(2 * nt + 1) {
                let d = l as i64 - nt_i;
                let mut acc = 0f64;
                for i in 0..nt_i {
                    let j = i + d;
                    if (0..nt_i).contains(&j) {
                        acc += f64::from(wpca[[a, i as usize]]) * f64::from(wpca[[b, j as usize]]);
                    }
                }
                out[[a, b, l]] = acc;
            }
        }
    }
    out
}

/// The sites where a (npc × C) template has a non-zero coefficient, ascending.
pub fn support(u: ArrayView2<f32>) -> Vec<u32> {
    (0..u.ncols())
        .filter(|&c| u.column(c).iter().any(|&v| v != 0.0))
        .map(|c| c as u32)
        .collect()
}

/// The result of [`postprocess_templates`].
#[derive(Debug, Clone)]
pub struct PostprocessedTemplates {
    /// `Wall3`, K × npc × C float32: the aligned, pre-merged templates that
    /// the matching uses, in the order of the clusters that kept them.
    pub wall3: Array3<f32>,
    /// Per first-clustering cluster (K0): the sample of its aligned waveform's
    /// largest filter response before the roll (`align_U`'s `imax`).
    pub imax: Vec<usize>,
    /// Per first-clustering cluster (K0): the template (0 … K − 1) it ended in.
    pub template_of: Vec<usize>,
    /// Per template (K): the spike count of the clusters merged into it.
    pub counts: Vec<u64>,
}

/// Kilosort4's `postprocess_templates`: [`align_templates`], then
/// [`pre_merge`] with the spike counts of `clu0`.
///
/// * `wall0`: K0 × C × npc float32 (the first clustering's `Wall`);
/// * `clu0`: the cluster (0 … K0 − 1) of every universal spike;
/// * `wpca`, `wtemp`: npc × nt and nw × nt (detection's `wPCA`, `wTEMP`).
///
/// # Errors
/// [`TemplateError::Shape`] when the shapes disagree, a label is outside
/// 0 … K0 − 1 or a cluster has no spike (Kilosort4 indexes its counts by
/// label and needs every label 0 … K0 − 1 present).
pub fn postprocess_templates(
    wall0: ArrayView3<f32>,
    clu0: &[i32],
    wpca: ArrayView2<f32>,
    wtemp: ArrayView2<f32>,
) -> Result<PostprocessedTemplates, TemplateError> {
    let k0 = wall0.dim().0;
    let mut counts = vec![0u64; k0];
    for &c in clu0 {
        if c < 0 || c as usize >= k0 {
            return Err(shape_err(
                "clu0",
                format!(
                    "label {c} is outside 0 … {} (Wall0 has {k0} clusters)",
                    k0 as i64 - 1
                ),
            ));
        }
        counts[c as usize] += 1;
    }
    if let Some(k) = counts.iter().position(|&n| n == 0) {
        return Err(shape_err(
            "clu0",
            format!("cluster {k} of {k0} has no spike; every cluster of Wall0 needs one"),
        ));
    }
    let (aligned, imax) = align_templates(wall0, wpca, wtemp)?;
    // (K0, npc, C) → (K0, C, npc), the layout `merging_function` receives.
    let wall2 = aligned
        .permuted_axes([0, 2, 1])
        .as_standard_layout()
        .into_owned();
    let merged = pre_merge(wall2, counts, &wtw(wpca))?;
    Ok(PostprocessedTemplates {
        wall3: merged
            .wall
            .permuted_axes([0, 2, 1])
            .as_standard_layout()
            .into_owned(),
        imax,
        template_of: merged.template_of,
        counts: merged.counts,
    })
}

/// Kilosort4's `align_U`: each template is expanded to time with `wPCA`
/// (nt × C), all templates are laid end to end per site and filtered with the
/// `wTEMP` waveforms (zero padding nt/2, so a template's edges see its
/// neighbours' samples, as in Kilosort4); the sample of the largest |response|
/// over sites and waveforms (first on ties) is rolled circularly to nt/2, and
/// the result projected back onto `wPCA`.
///
/// `wall0`: K0 × C × npc; returns (K0 × npc × C templates, per-template `imax`).
///
/// # Errors
/// [`TemplateError::Shape`] when `wpca`, `wtemp` and `wall0` disagree.
pub fn align_templates(
    wall0: ArrayView3<f32>,
    wpca: ArrayView2<f32>,
    wtemp: ArrayView2<f32>,
) -> Result<(Array3<f32>, Vec<usize>), TemplateError> {
    let (k0, n_c, npc) = wall0.dim();
    let (npc_w, nt) = wpca.dim();
    if npc_w != npc {
        return Err(shape_err(
            "Wall0",
            format!("has {npc} PCs per site but wPCA has {npc_w} rows"),
        ));
    }
    if wtemp.ncols() != nt || nt == 0 {
        return Err(shape_err(
            "wTEMP",
            format!("has {} samples, wPCA {nt}", wtemp.ncols()),
        ));
    }
    // Uex[k][t·C + c] = Σ_p Wall0[k, c, p]·wPCA[p, t]; a site whose
    // coefficients are all zero sums to +0 (wPCA finite), the value it starts with.
    let wpca64: Vec<f64> = wpca.iter().map(|&v| f64::from(v)).collect();
    let finite = wpca64.iter().all(|v| v.is_finite());
    let uex: Vec<Vec<f32>> = (0..k0)
        .into_par_iter()
        .map(|k| {
            let mut e = vec![0f32; nt * n_c];
            for c in 0..n_c {
                let w: Vec<f64> = (0..npc).map(|p| f64::from(wall0[[k, c, p]])).collect();
                if finite && w.iter().all(|&v| v == 0.0) {
                    continue;
                }
                for t in 0..nt {
                    let mut acc = 0f64;
                    for (p, &wp) in w.iter().enumerate() {
                        acc += wp * wpca64[p * nt + t];
                    }
                    e[t * n_c + c] = acc as f32;
                }
            }
            e
        })
        .collect();
    let active: Vec<Vec<bool>> = uex
        .iter()
        .map(|e| {
            (0..n_c)
                .map(|c| (0..nt).any(|t| e[t * n_c + c] != 0.0))
                .collect()
        })
        .collect();
    let half = nt / 2;
    let nw = wtemp.nrows();
    // The filters in groups of four, interleaved: wt4[(g·nt + i)·4 + l] is
    // filter 4g + l at sample i (zero past the last filter).
    let groups = nw.div_ceil(4);
    let mut wt4 = vec![0f64; groups * nt * 4];
    for f in 0..nw {
        for i in 0..nt {
            wt4[((f / 4) * nt + i) * 4 + f % 4] = f64::from(wtemp[[f, i]]);
        }
    }
    // For template k, the concatenated series of site c (templates end to
    // end, zeros before the first and after the last) over templates k − 1,
    // k, k + 1 is all the filter reads: sample t of template k reads
    // s = k·nt + t + i − nt/2 for i = 0…nt − 1, within those three.
    let imax: Vec<usize> = (0..k0)
        .into_par_iter()
        .map_init(
            || (vec![0f64; 3 * nt], vec![0f32; nt]),
            |(local, m), k| {
                let sites: Vec<usize> = (0..n_c)
                    .filter(|&c| (k.saturating_sub(1)..(k + 2).min(k0)).any(|kk| active[kk][c]))
                    .collect();
                m.fill(0.0);
                for &c in &sites {
                    for (j, v) in local.iter_mut().enumerate() {
                        // Template k − 1 + j / nt, sample j % nt.
                        let kk = (k + j / nt).checked_sub(1).filter(|&kk| kk < k0);
                        *v = kk.map_or(0.0, |kk| f64::from(uex[kk][(j % nt) * n_c + c]));
                    }
                    for (t, mt) in m.iter_mut().enumerate() {
                        let x = &local[nt + t - half..nt + t - half + nt];
                        for (g, wg) in wt4.chunks_exact(4 * nt).enumerate() {
                            // Four filters at once, each its own sum over i in order.
                            let mut acc = [0f64; 4];
                            for (&a, w) in x.iter().zip(wg.chunks_exact(4)) {
                                for (s, &b) in acc.iter_mut().zip(w) {
                                    *s += a * b;
                                }
                            }
                            for &v in &acc[..(nw - 4 * g).min(4)] {
                                *mt = mt.max((v as f32).abs());
                            }
                        }
                    }
                }
                let mut best = (0usize, f32::NEG_INFINITY);
                for (t, &v) in m.iter().enumerate() {
                    if v > best.1 {
                        best = (t, v);
                    }
                }
                best.0
            },
        )
        .collect();
    let rows: Vec<Vec<f32>> = (0..k0)
        .into_par_iter()
        .map(|k| {
            let mut o = vec![0f32; npc * n_c];
            let shift = (nt / 2) as i64 - imax[k] as i64;
            // Rolled: sample t of the new template is sample (t − shift) mod nt of the old.
            for c in 0..n_c {
                if !active[k][c] {
                    continue;
                }
                for p in 0..npc {
                    let mut acc = 0f64;
                    for t in 0..nt as i64 {
                        let src = (t - shift).rem_euclid(nt as i64) as usize;
                        acc += f64::from(uex[k][src * n_c + c]) * f64::from(wpca[[p, t as usize]]);
                    }
                    o[p * n_c + c] = acc as f32;
                }
            }
            o
        })
        .collect();
    let out = Array3::from_shape_vec((k0, npc, n_c), rows.concat()).expect("K0 × npc × C values");
    Ok((out, imax))
}

/// The result of [`pre_merge`].
#[derive(Debug, Clone)]
pub struct PreMerged {
    /// K × C × npc: the templates left, in their original order.
    pub wall: Array3<f32>,
    /// Per input template (K0): the output template it ended in.
    pub template_of: Vec<usize>,
    /// Per output template (K): its spike count.
    pub counts: Vec<u64>,
}

/// Kilosort4's `merging_function` in mode `'mu'` (no CCG check): templates are
/// visited by spike count, largest first (ties: the higher index first, a
/// stable sort reversed; Kilosort4's unstable numpy sort may order equal
/// counts otherwise). For the visited template, the similarity to every other
/// is the largest over lags ±nt of the normalised cross-correlation
/// ([`wtw`]); partners with similarity ≥ 0.9, from the most similar down, are
/// tried until one has a norm within 20 % (|2(μk − μj)/(μk + μj)| < 0.2). It is
/// absorbed: the visited template becomes the spike-count-weighted mean, the
/// partner is zeroed, and the same template is visited again.
///
/// `wall`: K0 × C × npc; `counts`: K0 spike counts; `wtw`: [`wtw`] of `wPCA`.
///
/// # Errors
/// [`TemplateError::Shape`] when `counts` or `wtw` do not fit `wall`.
pub fn pre_merge(
    mut wall: Array3<f32>,
    mut counts: Vec<u64>,
    wtw: &Array3<f32>,
) -> Result<PreMerged, TemplateError> {
    let (nn, n_c, npc) = wall.dim();
    if counts.len() != nn {
        return Err(shape_err(
            "counts",
            format!("{} values for {nn} templates", counts.len()),
        ));
    }
    if wtw.dim().0 != npc || wtw.dim().1 != npc {
        return Err(shape_err(
            "WtW",
            format!("is {:?}, templates have {npc} PCs", wtw.dim()),
        ));
    }
    let lags = LagProducts::new(wtw);
    let mut order: Vec<usize> = (0..nn).collect();
    order.sort_by_key(|&k| counts[k]);
    order.reverse();
    let mut owner: Vec<usize> = (0..nn).collect();
    let mut merged = vec![false; nn];
    let mut mu: Vec<f32> = (0..nn).map(|k| norm(wall.slice(s![k, .., ..]))).collect();
    let mut t = 0;
    while t < nn {
        let kk = order[t];
        if merged[kk] {
            t += 1;
            continue;
        }
        let cmax = similarities(&wall, &mu, kk, &lags);
        let mut cand: Vec<usize> = (0..nn).collect();
        cand.sort_by(|&a, &b| cmax[a].total_cmp(&cmax[b]));
        cand.reverse();
        let mut partner = None;
        for &jj in &cand {
            if cmax[jj] < PRE_MERGE_SIMILARITY {
                break;
            }
            let dmu = 2.0 * (mu[kk] - mu[jj]) / (mu[kk] + mu[jj]);
            if dmu.abs() < PRE_MERGE_NORM_DIFF {
                partner = Some(jj);
                break;
            }
        }
        let Some(jj) = partner else {
            t += 1;
            continue;
        };
        merged[jj] = true;
        owner[jj] = kk;
        let tot = (counts[kk] + counts[jj]) as f64;
        let wk = (counts[kk] as f64 / tot) as f32;
        let wj = (counts[jj] as f64 / tot) as f32;
        for c in 0..n_c {
            for p in 0..npc {
                let v = wk * wall[[kk, c, p]] + wj * wall[[jj, c, p]];
                wall[[kk, c, p]] = v;
                wall[[jj, c, p]] = 0.0;
            }
        }
        counts[kk] += counts[jj];
        counts[jj] = 0;
        mu[kk] = norm(wall.slice(s![kk, .., ..]));
        mu[jj] = 0.0;
    }
    let mut index = vec![usize::MAX; nn];
    let kept: Vec<usize> = (0..nn).filter(|&k| !merged[k]).collect();
    for (i, &k) in kept.iter().enumerate() {
        index[k] = i;
    }
    let template_of = (0..nn)
        .map(|mut k| {
            while merged[k] {
                k = owner[k];
            }
            index[k]
        })
        .collect();
    let mut out = Array3::<f32>::zeros((kept.len(), n_c, npc));
    for (i, &k) in kept.iter().enumerate() {
        out.slice_mut(s![i, .., ..])
            .assign(&wall.slice(s![k, .., ..]));
    }
    Ok(PreMerged {
        wall: out,
        template_of,
        counts: kept.iter().map(|&k| counts[k]).collect(),
    })
}

/// √(Σ w²) of one C × npc template, float32 as Kilosort4 rounds it.
fn norm(w: ArrayView2<f32>) -> f32 {
    let ss: f64 = w.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    (ss as f32).sqrt()
}

/// [`wtw`] as the similarities read it: float64, lag by lag, each lag's
/// (npc, npc) products row-major.
struct LagProducts {
    /// (2nt + 1, npc·npc).
    by_lag: Vec<f64>,
    /// Whether every value is finite (zero products then sum to zero).
    finite: bool,
}

impl LagProducts {
    fn new(wtw: &Array3<f32>) -> Self {
        let (npc, _, nl) = wtw.dim();
        let by_lag: Vec<f64> = (0..nl)
            .flat_map(|l| (0..npc * npc).map(move |ab| (l, ab)))
            .map(|(l, ab)| f64::from(wtw[[ab / npc, ab % npc, l]]))
            .collect();
        let finite = by_lag.iter().all(|v| v.is_finite());
        LagProducts { by_lag, finite }
    }
}

/// For template `kk`, the largest normalised cross-correlation with every
/// template over lags ±nt (`merging_function`'s `cmax`), 0 for `kk` itself.
fn similarities(wall: &Array3<f32>, mu: &[f32], kk: usize, lags: &LagProducts) -> Vec<f32> {
    let (nn, n_c, npc) = wall.dim();
    let scale = |k: usize| 1e-6f32 + mu[k];
    let sk = scale(kk);
    let wn_k: Vec<(usize, Vec<f32>)> = (0..n_c)
        .filter(|&c| (0..npc).any(|p| wall[[kk, c, p]] != 0.0))
        .map(|c| (c, (0..npc).map(|p| wall[[kk, c, p]] / sk).collect()))
        .collect();
    (0..nn)
        .into_par_iter()
        .map(|j| {
            if j == kk {
                return 0.0;
            }
            let sj = scale(j);
            let mut utu = vec![0f64; npc * npc];
            for (c, wk) in &wn_k {
                for b in 0..npc {
                    let wj = f64::from(wall[[j, *c, b]] / sj);
                    if wj == 0.0 {
                        continue;
                    }
                    for a in 0..npc {
                        utu[a * npc + b] += f64::from(wk[a]) * wj;
                    }
                }
            }
            if lags.finite && utu.iter().all(|&v| v == 0.0) {
                // Every lag sums +0 terms to +0 (no shared non-zero site).
                return 0.0;
            }
            let mut best = f32::NEG_INFINITY;
            for w in lags.by_lag.chunks_exact(npc * npc) {
                let mut acc = 0f64;
                for (&u, &x) in utu.iter().zip(w) {
                    acc += u * x;
                }
                best = best.max(acc as f32);
            }
            best
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, Array3};

    /// Pseudo-random values in [−1, 1) from a fixed LCG.
    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// `align_U`'s peak samples by the definition: each template's sample of
    /// the largest |filter response| over the whole concatenated series.
    fn imax_reference(
        wall0: ArrayView3<f32>,
        wpca: ArrayView2<f32>,
        wtemp: ArrayView2<f32>,
    ) -> Vec<usize> {
        let (k0, n_c, npc) = wall0.dim();
        let nt = wpca.ncols();
        let series = |c: usize, s: i64| -> f64 {
            if s < 0 || s >= (k0 * nt) as i64 {
                return 0.0;
            }
            let (k, t) = (s as usize / nt, s as usize % nt);
            let mut acc = 0f64;
            for p in 0..npc {
                acc += f64::from(wall0[[k, c, p]]) * f64::from(wpca[[p, t]]);
            }
            f64::from(acc as f32)
        };
        (0..k0)
            .map(|k| {
                let mut best = (0usize, f32::NEG_INFINITY);
                for t in 0..nt {
                    let s0 = (k * nt + t) as i64;
                    let mut m = 0f32;
                    for c in 0..n_c {
                        for f in 0..wtemp.nrows() {
                            let mut acc = 0f64;
                            for i in 0..nt as i64 {
                                acc += series(c, s0 + i - (nt / 2) as i64)
                                    * f64::from(wtemp[[f, i as usize]]);
                            }
                            m = m.max((acc as f32).abs());
                        }
                    }
                    if m > best.1 {
                        best = (t, m);
                    }
                }
                best.0
            })
            .collect()
    }

    /// The peak samples found from each template's three-template stretch of
    /// the series equal the definition's, exactly.
    #[test]
    fn peak_samples_equal_the_definition() {
        let (k0, n_c, npc, nt, nw) = (9, 10, 6, 61, 6);
        let mut wall0 = Array3::from_shape_vec((k0, n_c, npc), noise(k0 * n_c * npc, 3)).unwrap();
        // Sparse supports: some sites of each template are exactly zero.
        for k in 0..k0 {
            for c in 0..n_c {
                if (k * 5 + c) % 3 == 0 || c.abs_diff(k) > 5 {
                    wall0.slice_mut(s![k, c, ..]).fill(0.0);
                }
            }
        }
        let wpca = Array2::from_shape_vec((npc, nt), noise(npc * nt, 5)).unwrap();
        let wtemp = Array2::from_shape_vec((nw, nt), noise(nw * nt, 7)).unwrap();
        let (_, imax) = align_templates(wall0.view(), wpca.view(), wtemp.view()).unwrap();
        let want = imax_reference(wall0.view(), wpca.view(), wtemp.view());
        assert_eq!(imax, want);
        assert!(want.iter().any(|&t| t != want[0]), "{want:?}");
    }

    /// The pre-merge's similarities equal the direct sums over every lag,
    /// bit for bit, also for templates without a shared site (exact zeros).
    #[test]
    fn similarities_equal_the_direct_sums() {
        let (k0, n_c, npc, nt) = (8, 12, 6, 21);
        let mut wall = Array3::from_shape_vec((k0, n_c, npc), noise(k0 * n_c * npc, 11)).unwrap();
        for k in 0..k0 {
            for c in 0..n_c {
                if c.abs_diff(k) > 2 {
                    wall.slice_mut(s![k, c, ..]).fill(0.0);
                }
            }
        }
        let wpca = Array2::from_shape_vec((npc, nt), noise(npc * nt, 13)).unwrap();
        let w = wtw(wpca.view());
        let mu: Vec<f32> = (0..k0).map(|k| norm(wall.slice(s![k, .., ..]))).collect();
        let mut zeros = 0;
        for kk in 0..k0 {
            let got = similarities(&wall, &mu, kk, &LagProducts::new(&w));
            let want: Vec<f32> = (0..k0)
                .map(|j| {
                    if j == kk {
                        return 0.0;
                    }
                    let (sk, sj) = (1e-6f32 + mu[kk], 1e-6f32 + mu[j]);
                    let mut utu = vec![0f64; npc * npc];
                    for c in 0..n_c {
                        for a in 0..npc {
                            for b in 0..npc {
                                let (x, y) = (wall[[kk, c, a]] / sk, wall[[j, c, b]] / sj);
                                if x != 0.0 && y != 0.0 {
                                    utu[a * npc + b] += f64::from(x) * f64::from(y);
                                }
                            }
                        }
                    }
                    let mut best = f32::NEG_INFINITY;
                    for l in 0..w.dim().2 {
                        let mut acc = 0f64;
                        for a in 0..npc {
                            for b in 0..npc {
                                acc += utu[a * npc + b] * f64::from(w[[a, b, l]]);
                            }
                        }
                        best = best.max(acc as f32);
                    }
                    best
                })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "template {kk}");
            zeros += got.iter().filter(|&&v| v == 0.0).count() - 1;
        }
        assert!(zeros > 0, "no pair without a shared site");
    }
}
