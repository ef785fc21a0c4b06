//! The top-down cuts of the merge tree (Kilosort4 4.1.7 `swarmsplitter.py`:
//! `split`, `check_split`, `bimod_score`, `clean_tree`, `new_clusters`).
//!
//! Nodes are visited from the root down (reverse merge order); a node inside a
//! subtree already merged is skipped. A node keeps its split when its merge
//! ratio is below 0.2; otherwise, in the final clustering, a cross-refractory
//! pair of children merges; otherwise the bimodality of the children's
//! regularised linear discriminant decides (score < 0.6 → merge). A merge
//! removes the node's whole subtree. The leaves of the surviving nodes are the
//! group's clusters.

use super::ccg::cross_refractory;
use super::settings::{BIMODALITY_MERGE, RIDGE, SPLIT_RATIO};
use super::tree::Merge;

/// Bin edges of the projection histogram: 400 points on [−2, 2] (399 bins).
const HIST_EDGES: usize = 400;
/// σ (bins) of the histogram's Gaussian smoothing; the kernel's radius is
/// `int(4σ + 0.5)` = 16 bins (scipy's `truncate = 4`).
const SMOOTH_SIGMA: f64 = 4.0;
/// The minimum is looked for in bins 175‥225.
const VALLEY: std::ops::Range<usize> = 175..225;

/// Inputs of the cuts of one group.
pub struct SplitInput<'a> {
    /// Features (n × `dim`, float32), the group's Xd.
    pub xd: &'a [f32],
    /// Feature length.
    pub dim: usize,
    /// Spike labels after the label updates (0‥nc).
    pub iclust: &'a [u32],
    /// The merges of the tree.
    pub merges: &'a [Merge],
    /// Each node's leaf clusters (mask over nc).
    pub leaf_sets: &'a [Vec<bool>],
    /// Spike times (s), in the final clustering only.
    pub times: Option<&'a [f64]>,
    /// Skip the CCG test, as Kilosort4 4.1.5–4.1.7 effectively does.
    pub ks4_ccg_bug: bool,
}

/// Which merges survive the cuts (Kilosort4's `valid_merge`).
pub fn split(inp: &SplitInput<'_>) -> Vec<bool> {
    let nm = inp.merges.len();
    let nc = nm + 1;
    let mut valid = vec![true; nm];
    for kk in (0..nm).rev() {
        if !valid[kk] {
            continue;
        }
        let m = inp.merges[kk];
        // −1 keeps the split, 1 merges, 0 undecided.
        let mut criterion = 0i32;
        if f64::from(m.ratio) < SPLIT_RATIO {
            criterion = -1;
        }
        if let (0, false, Some(times)) = (criterion, inp.ks4_ccg_bug, inp.times) {
            let (t1, t2) = (
                pick(times, inp.iclust, &inp.leaf_sets[m.x]),
                pick(times, inp.iclust, &inp.leaf_sets[m.y]),
            );
            if cross_refractory(&t1, &t2) {
                criterion = 1;
            }
        }
        if criterion == 0 {
            let score = bimodality(inp, m);
            // NaN (an empty side of the histogram) keeps the split, as in numpy.
            criterion = if f64::from(score) < BIMODALITY_MERGE {
                1
            } else {
                -1
            };
        }
        if criterion == 1 {
            valid[kk] = false;
            clean_subtree(&mut valid, m.x, nc, inp.merges);
            clean_subtree(&mut valid, m.y, nc, inp.merges);
        }
    }
    valid
}

/// The values of `v` at the spikes whose label is in `set`, in spike order.
fn pick(v: &[f64], iclust: &[u32], set: &[bool]) -> Vec<f64> {
    v.iter()
        .zip(iclust)
        .filter(|(_, c)| set[**c as usize])
        .map(|(t, _)| *t)
        .collect()
}

/// Marks every merge below `node` invalid (Kilosort4's `clean_tree`).
fn clean_subtree(valid: &mut [bool], node: usize, nc: usize, merges: &[Merge]) {
    let mut stack = vec![node];
    while let Some(nd) = stack.pop() {
        if nd < nc {
            continue;
        }
        let t = nd - nc;
        valid[t] = false;
        stack.push(merges[t].x);
        stack.push(merges[t].y);
    }
}

/// Kilosort4's `check_split` + `bimod_score` for merge `m`: the node's spikes
/// with the last feature replaced by 1, labelled +1 (child x) and −1 (child
/// y), each class weighted by the other's fraction; the ridge-regularised
/// least-squares direction b = (XᵀWX + 0.01 I)⁻¹ XᵀW·labels; the histogram of
/// X·b on 399 bins over [−2, 2], smoothed; score = 1 − max(min/left max,
/// min/right max), the minimum taken in bins 175‥225. float32 like numpy's.
pub fn bimodality(inp: &SplitInput<'_>, m: Merge) -> f32 {
    let d = inp.dim;
    let (sx, sy) = (&inp.leaf_sets[m.x], &inp.leaf_sets[m.y]);
    let rows: Vec<(usize, f64)> = inp
        .iclust
        .iter()
        .enumerate()
        .filter_map(|(i, &c)| {
            if sx[c as usize] {
                Some((i, 1.0))
            } else if sy[c as usize] {
                Some((i, -1.0))
            } else {
                None
            }
        })
        .collect();
    let n = rows.len() as f64;
    let npos = rows.iter().filter(|r| r.1 > 0.0).count() as f64;
    let (wpos, wneg) = ((n - npos) / n, npos / n);
    let mut cc = vec![0f64; d * d];
    let mut rhs = vec![0f64; d];
    let mut x = vec![0f64; d];
    let weighted = rows.iter().map(|&(i, lab)| {
        let w = if lab > 0.0 { wpos } else { wneg };
        (&inp.xd[i * d..(i + 1) * d], lab, w)
    });
    accumulate_normal_equations(weighted, &mut cc, &mut rhs, &mut x);
    for a in 0..d {
        cc[a * d + a] += RIDGE;
        for b in 0..a {
            cc[b * d + a] = cc[a * d + b];
        }
    }
    let Some(beta) = solve_spd(cc, rhs, d) else {
        return f32::NAN;
    };
    let proj: Vec<f64> = rows
        .iter()
        .map(|&(i, _)| {
            load_row(&mut x, &inp.xd[i * d..(i + 1) * d]);
            x.iter().zip(&beta).map(|(a, b)| a * b).sum()
        })
        .collect();
    bimod_score(&proj)
}

/// Adds each row's weighted outer product to the lower triangle of `cc`
/// (d × d) and its weighted label to `rhs`, row after row: for each row
/// (features, label, weight), with x the features in float64 and the last one
/// set to 1, `rhs[a] += label·(w·x[a])` and `cc[a·d + b] += (w·x[a])·x[b]` for
/// b ≤ a. Compiled for AVX-512 and AVX2 too and chosen at run time: the same
/// multiplications and additions (none fused), in the same order, on wider
/// vectors, so the same bits.
fn accumulate_normal_equations<'a>(
    rows: impl Iterator<Item = (&'a [f32], f64, f64)>,
    cc: &mut [f64],
    rhs: &mut [f64],
    x: &mut [f64],
) {
    #[inline(always)]
    fn one_row(row: &[f32], lab: f64, w: f64, cc: &mut [f64], rhs: &mut [f64], x: &mut [f64]) {
        let d = x.len();
        load_row(x, row);
        for a in 0..d {
            let xa = x[a] * w;
            rhs[a] += lab * xa;
            for (c, &xb) in cc[a * d..a * d + a + 1].iter_mut().zip(&x[..a + 1]) {
                *c += xa * xb;
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512(row: &[f32], lab: f64, w: f64, cc: &mut [f64], rhs: &mut [f64], x: &mut [f64]) {
            one_row(row, lab, w, cc, rhs, x)
        }
        #[target_feature(enable = "avx2")]
        fn avx2(row: &[f32], lab: f64, w: f64, cc: &mut [f64], rhs: &mut [f64], x: &mut [f64]) {
            one_row(row, lab, w, cc, rhs, x)
        }
        if crate::simd::avx512() {
            for (row, lab, w) in rows {
                // SAFETY: the CPU has AVX-512F.
                unsafe { avx512(row, lab, w, cc, rhs, x) };
            }
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            for (row, lab, w) in rows {
                // SAFETY: the CPU has AVX2.
                unsafe { avx2(row, lab, w, cc, rhs, x) };
            }
            return;
        }
    }
    for (row, lab, w) in rows {
        one_row(row, lab, w, cc, rhs, x);
    }
}

/// One row of features in float64 with the last one set to 1 (the bias).
fn load_row(x: &mut [f64], row: &[f32]) {
    for (a, &v) in x.iter_mut().zip(row) {
        *a = f64::from(v);
    }
    if let Some(last) = x.last_mut() {
        *last = 1.0;
    }
}

/// Solves the symmetric positive-definite system `a`·x = `b` (d × d,
/// row-major) by Cholesky; `None` when `a` is not positive definite.
fn solve_spd(mut a: Vec<f64>, mut b: Vec<f64>, d: usize) -> Option<Vec<f64>> {
    for j in 0..d {
        let mut s = a[j * d + j];
        for k in 0..j {
            s -= a[j * d + k] * a[j * d + k];
        }
        if s.is_nan() || s <= 0.0 {
            return None;
        }
        let l = s.sqrt();
        a[j * d + j] = l;
        for i in j + 1..d {
            let mut t = a[i * d + j];
            for k in 0..j {
                t -= a[i * d + k] * a[j * d + k];
            }
            a[i * d + j] = t / l;
        }
    }
    for i in 0..d {
        let mut t = b[i];
        for k in 0..i {
            t -= a[i * d + k] * b[k];
        }
        b[i] = t / a[i * d + i];
    }
    for i in (0..d).rev() {
        let mut t = b[i];
        for k in i + 1..d {
            t -= a[k * d + i] * b[k];
        }
        b[i] = t / a[i * d + i];
    }
    Some(b)
}

/// Kilosort4's `bimod_score` of projections `xproj`.
pub fn bimod_score(xproj: &[f64]) -> f32 {
    let hist = histogram(xproj);
    let sm = gaussian_smooth(&hist);
    let mut imin = VALLEY.start;
    for i in VALLEY {
        if sm[i] < sm[imin] {
            imin = i;
        }
    }
    let xmin = sm[imin];
    // numpy's max propagates NaN; counts are finite, so plain max is enough.
    let xm1 = sm[..imin].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let xm2 = sm[imin..].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (r1, r2) = (xmin / xm1, xmin / xm2);
    let r = if r1.is_nan() || r2.is_nan() {
        f32::NAN
    } else {
        r1.max(r2)
    };
    1.0 - r
}

/// numpy's `histogram(x, linspace(−2, 2, 400))`: bin i holds
/// edges[i] ≤ x < edges[i+1], the last bin closed; values outside are dropped.
fn histogram(x: &[f64]) -> Vec<f32> {
    let nb = HIST_EDGES - 1;
    let step = 4.0 / nb as f64;
    let mut edges: Vec<f64> = (0..HIST_EDGES).map(|i| i as f64 * step - 2.0).collect();
    edges[nb] = 2.0;
    let mut h = vec![0f32; nb];
    for &v in x {
        if !(-2.0..=2.0).contains(&v) {
            continue;
        }
        let mut i = (((v + 2.0) * (nb as f64 / 4.0)) as usize).min(nb - 1);
        while i > 0 && v < edges[i] {
            i -= 1;
        }
        while i < nb - 1 && v >= edges[i + 1] {
            i += 1;
        }
        h[i] += 1.0;
    }
    h
}

/// scipy's `gaussian_filter1d(h, 4)` on float32: a 33-tap normalised Gaussian,
/// "reflect" ends, summed in float64 from the outermost taps inwards, stored
/// as float32.
fn gaussian_smooth(h: &[f32]) -> Vec<f32> {
    let r = (4.0 * SMOOTH_SIGMA + 0.5) as i64;
    let raw: Vec<f64> = (-r..=r)
        .map(|x| (-0.5 / (SMOOTH_SIGMA * SMOOTH_SIGMA) * (x * x) as f64).exp())
        .collect();
    let total = pairwise_sum(&raw);
    let w: Vec<f64> = raw.iter().map(|v| v / total).collect();
    let n = h.len() as i64;
    let at = |i: i64| -> f64 {
        let mut j = i;
        while j < 0 || j >= n {
            j = if j < 0 { -j - 1 } else { 2 * n - j - 1 };
        }
        f64::from(h[j as usize])
    };
    (0..n)
        .map(|i| {
            let mut t = at(i) * w[r as usize];
            for d in (1..=r).rev() {
                t += (at(i - d) + at(i + d)) * w[(r - d) as usize];
            }
            t as f32
        })
        .collect()
}

/// numpy's sum of a short float64 array (eight interleaved partial sums, then
/// the rest in order).
fn pairwise_sum(v: &[f64]) -> f64 {
    if v.len() < 8 {
        return v.iter().sum();
    }
    let mut r = [0f64; 8];
    r.copy_from_slice(&v[..8]);
    let full = v.len() - v.len() % 8;
    for c in v[8..full].chunks_exact(8) {
        for l in 0..8 {
            r[l] += c[l];
        }
    }
    let mut s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for &x in &v[full..] {
        s += x;
    }
    s
}

/// Final labels from the surviving merges (Kilosort4's `new_clusters`): the
/// leaves of the surviving nodes, numbered in increasing node id; all zeros
/// when no merge survives.
pub fn new_clusters(
    iclust: &[u32],
    merges: &[Merge],
    valid: &[bool],
    leaf_sets: &[Vec<bool>],
) -> Vec<u32> {
    let nc = merges.len() + 1;
    let mut state = vec![0u8; 2 * nc]; // 1: child of a surviving node, 2: a surviving node
    let mut any = false;
    for (t, m) in merges.iter().enumerate() {
        if valid[t] {
            any = true;
            for c in [m.x, m.y] {
                if state[c] == 0 {
                    state[c] = 1;
                }
            }
            state[nc + t] = 2;
        }
    }
    if !any {
        return vec![0; iclust.len()];
    }
    let mut out = iclust.to_vec();
    let mut label_of = vec![u32::MAX; nc];
    for (j, node) in (0..2 * nc).filter(|&v| state[v] == 1).enumerate() {
        for (leaf, &inside) in leaf_sets[node].iter().enumerate() {
            if inside {
                label_of[leaf] = j as u32;
            }
        }
    }
    for (o, &c) in out.iter_mut().zip(iclust) {
        if label_of[c as usize] != u32::MAX {
            *o = label_of[c as usize];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The normal equations accumulated on wide vectors have the bits of the
    /// plain row-by-row loop.
    #[test]
    fn normal_equations_equal_the_plain_loop() {
        let (n, d) = (300, 37);
        let mut s = 99u64;
        let xd: Vec<f32> = (0..n * d)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 7.3
            })
            .collect();
        let rows: Vec<(usize, f64, f64)> = (0..n)
            .map(|i| {
                if i % 3 == 0 {
                    (i, 1.0, 0.31)
                } else {
                    (i, -1.0, 0.69)
                }
            })
            .collect();
        let (mut cc, mut rhs, mut x) = (vec![0f64; d * d], vec![0f64; d], vec![0f64; d]);
        for &(i, lab, w) in &rows {
            load_row(&mut x, &xd[i * d..(i + 1) * d]);
            for a in 0..d {
                let xa = x[a] * w;
                rhs[a] += lab * xa;
                for b in 0..=a {
                    cc[a * d + b] += xa * x[b];
                }
            }
        }
        let (mut cc2, mut rhs2) = (vec![0f64; d * d], vec![0f64; d]);
        let it = rows
            .iter()
            .map(|&(i, lab, w)| (&xd[i * d..(i + 1) * d], lab, w));
        accumulate_normal_equations(it, &mut cc2, &mut rhs2, &mut x);
        let bits = |v: &[f64]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&cc2), bits(&cc));
        assert_eq!(bits(&rhs2), bits(&rhs));
    }

    #[test]
    fn bimodal_projection_scores_high_and_unimodal_low() {
        let two: Vec<f64> = (0..2000)
            .map(|i| if i % 2 == 0 { -1.0 } else { 1.0 } + ((i * 37 % 101) as f64 - 50.0) * 0.004)
            .collect();
        assert!(bimod_score(&two) > 0.9);
        let one: Vec<f64> = (0..2000)
            .map(|i| ((i * 37 % 1001) as f64 - 500.0) * 0.0016)
            .collect();
        assert!(bimod_score(&one) < 0.2);
    }

    #[test]
    fn histogram_edges_follow_numpy() {
        let h = histogram(&[-2.0, 2.0, 2.0000001, -2.1, 0.0]);
        assert_eq!(h[0], 1.0);
        assert_eq!(h[398], 1.0);
        assert_eq!(h[199], 1.0); // 0 lies in bin 199 = [-0.005, 0.005)
        assert_eq!(h.iter().sum::<f32>(), 3.0);
    }

    #[test]
    fn cholesky_solves() {
        let a = vec![4.0, 2.0, 2.0, 3.0];
        let x = solve_spd(a, vec![2.0, 1.0], 2).unwrap();
        assert!((x[0] - 0.5).abs() < 1e-15 && x[1].abs() < 1e-15);
    }
}
