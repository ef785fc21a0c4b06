//! The neighbour graph of one group (Kilosort4 4.1.7 `clustering_qr.py`:
//! `neigh_mat`, `subsample_idx`): each spike's exact k nearest landmarks.
//!
//! Kilosort4 searches with faiss `IndexFlatL2` (float32, ‖x‖² + ‖y‖² − 2x·y
//! through BLAS). spikecube computes each squared distance directly,
//! Σ(x − y)² in float32 in a fixed order, and keeps the lower landmark index on
//! a tie, so the graph does not depend on the thread count or the BLAS.

use rayon::prelude::*;

/// Queries handled together (one rayon task).
const QUERY_BLOCK: usize = 256;

/// The landmarks of a group of `n` spikes: every `nskip`-th spike; when that
/// leaves more than `max_sub`, `n1 − max_sub` of them are dropped at the
/// positions `round(linspace(0, n1 − 1, n1 − max_sub))` (round half to even).
/// Returns the landmarks' spike indices, ascending.
pub fn landmarks(n: usize, nskip: usize, max_sub: Option<usize>) -> Vec<usize> {
    let every: Vec<usize> = (0..n).step_by(nskip.max(1)).collect();
    let n1 = every.len();
    match max_sub {
        Some(cap) if n1 > cap => {
            let n2 = n1 - cap;
            let mut keep = vec![true; n1];
            for r in linspace_round(n1 - 1, n2) {
                keep[r] = false;
            }
            every
                .into_iter()
                .zip(keep)
                .filter_map(|(s, k)| k.then_some(s))
                .collect()
        }
        _ => every,
    }
}

/// `round(linspace(0, last, num))` with numpy's arithmetic (`i·step`, the
/// last point exactly `last`) and rounding (half to even).
pub(super) fn linspace_round(last: usize, num: usize) -> Vec<usize> {
    if num == 1 {
        return vec![0];
    }
    let step = last as f64 / (num - 1) as f64;
    (0..num)
        .map(|i| {
            if i == num - 1 {
                last
            } else {
                (i as f64 * step).round_ties_even() as usize
            }
        })
        .collect()
}

/// The k nearest landmarks of one query, kept sorted by (distance, index).
struct TopK {
    dist: Vec<f32>,
    idx: Vec<u32>,
    k: usize,
}

impl TopK {
    fn new(k: usize) -> Self {
        TopK {
            dist: Vec::with_capacity(k + 1),
            idx: Vec::with_capacity(k + 1),
            k,
        }
    }

    /// The distance a landmark must beat to enter, once k are held.
    #[inline]
    fn bar(&self) -> Option<f32> {
        (self.dist.len() == self.k).then(|| self.dist[self.k - 1])
    }

    /// Offers landmark `j` at squared distance `d`. The k held are the
    /// smallest by (distance, index), whatever the order of the offers: a
    /// tie goes to the lower index.
    #[inline]
    fn offer(&mut self, d: f32, j: u32) {
        if d.is_nan() {
            return;
        }
        // Whether (e, i) comes before the offer.
        let before = |e: f32, i: u32| e < d || (e == d && i < j);
        if self.dist.len() == self.k && before(self.dist[self.k - 1], self.idx[self.k - 1]) {
            return;
        }
        let mut p = 0;
        while p < self.dist.len() && before(self.dist[p], self.idx[p]) {
            p += 1;
        }
        self.dist.insert(p, d);
        self.idx.insert(p, j);
        if self.dist.len() > self.k {
            self.dist.pop();
            self.idx.pop();
        }
    }
}

/// Landmarks per register tile of the distance kernel (one 16-lane vector).
const TILE_L: usize = 16;
/// Queries per register tile of the distance kernel.
const TILE_Q: usize = 6;
/// Interleaved partial sums of a squared distance.
const PARTS: usize = 8;

/// For each row of `xd` (n × `dim`, float32), the indices (into `landmarks`) of
/// its `k` nearest landmarks, nearest first; (n × k) row-major. `k` must not
/// exceed the number of landmarks.
///
/// Each squared distance Σ(x − y)² is summed in float32 in a fixed order:
/// [`PARTS`] interleaved partial sums (feature f in sum f mod 8, over the whole
/// chunks of 8 features), combined as ((s0 + s4) + (s1 + s5)) + ((s2 + s6) +
/// (s3 + s7)), plus the sum of the remaining features in order; computed
/// [`TILE_Q`] queries × [`TILE_L`] landmarks at a time. Landmarks are
/// visited in order of their norm, from those nearest in norm to a tile of
/// queries outwards, and the visit stops on each side where the norm gap
/// alone, (‖x‖ − ‖y‖)² ≤ ‖x − y‖², puts every further landmark above every
/// query's k-th distance ([`beyond_bars`], with a margin for the float32
/// rounding): the landmarks left out could not enter, and the k kept are the
/// smallest by (distance, index) whatever the visiting order, so the result
/// is that of the exhaustive search.
pub fn knn(xd: &[f32], dim: usize, landmarks: &[usize], k: usize) -> Vec<u32> {
    let n = xd.len() / dim.max(1);
    assert!(
        k <= landmarks.len(),
        "k = {k} > {} landmarks",
        landmarks.len()
    );
    let nl = landmarks.len();
    let row = |i: usize| &xd[i * dim..(i + 1) * dim];
    // Landmarks in increasing norm (ties by index), by tiles of TILE_L, each
    // tile feature-major (dim × TILE_L, zero-padded): one feature of a
    // tile's landmarks is one run.
    let mut by_norm: Vec<(f64, u32)> = landmarks
        .iter()
        .enumerate()
        .map(|(j, &s)| (norm(row(s)), j as u32))
        .collect();
    by_norm.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let n_tiles = nl.div_ceil(TILE_L);
    let mut lt = vec![0f32; n_tiles * TILE_L * dim];
    for (p, &(_, j)) in by_norm.iter().enumerate() {
        let tile = &mut lt[(p / TILE_L) * dim * TILE_L..];
        for (f, &v) in row(landmarks[j as usize]).iter().enumerate() {
            tile[f * TILE_L + p % TILE_L] = v;
        }
    }
    // Each tile's smallest and largest landmark norm.
    let span: Vec<(f64, f64)> = by_norm
        .chunks(TILE_L)
        .map(|c| (c[0].0, c[c.len() - 1].0))
        .collect();
    let zero = vec![0f32; dim];
    let rel = float32_loss(dim);
    let mut kn = vec![0u32; n * k];
    kn.par_chunks_mut(QUERY_BLOCK * k)
        .enumerate()
        .for_each(|(b, out)| {
            let q0 = b * QUERY_BLOCK;
            let nq = out.len() / k;
            // The block's queries in increasing norm, TILE_Q at a time, so
            // that a tile's queries have close norms.
            let mut queries: Vec<(f64, usize)> = (q0..q0 + nq).map(|i| (norm(row(i)), i)).collect();
            queries.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for group in queries.chunks(TILE_Q) {
                // Rows past the queries read zeros (their results unused).
                let x: [&[f32]; TILE_Q] =
                    std::array::from_fn(|r| group.get(r).map_or(&zero[..], |&(_, i)| row(i)));
                let mut tops: Vec<TopK> = group.iter().map(|_| TopK::new(k)).collect();
                let offer_tile = |tops: &mut [TopK], t: usize| {
                    let d = tile_dists(&x, &lt[t * dim * TILE_L..(t + 1) * dim * TILE_L]);
                    let lanes = (nl - t * TILE_L).min(TILE_L);
                    for (top, d) in tops.iter_mut().zip(&d) {
                        // Only the lanes not above the bar can enter.
                        let mut offered = match top.bar() {
                            Some(bar) => d
                                .iter()
                                .enumerate()
                                .fold(0u32, |m, (l, &v)| m | (u32::from(v <= bar) << l)),
                            None => u32::MAX,
                        } & ((1u32 << lanes) - 1);
                        while offered != 0 {
                            let l = offered.trailing_zeros() as usize;
                            offered &= offered - 1;
                            top.offer(d[l], by_norm[t * TILE_L + l].1);
                        }
                    }
                };
                // From the tile at the group's middle norm outwards: past a
                // tile whose landmarks are all too far in norm for every
                // query of the group, the tiles further out are farther still.
                let mid = group[group.len() / 2].0;
                let start = span.partition_point(|&(_, hi)| hi < mid).min(n_tiles - 1);
                for (t, &sp) in span.iter().enumerate().skip(start) {
                    if beyond_bars(&tops, group, sp, rel) {
                        break;
                    }
                    offer_tile(&mut tops, t);
                }
                for (t, &sp) in span[..start].iter().enumerate().rev() {
                    if beyond_bars(&tops, group, sp, rel) {
                        break;
                    }
                    offer_tile(&mut tops, t);
                }
                for (top, &(_, i)) in tops.iter().zip(group) {
                    let q = i - q0;
                    out[q * k..(q + 1) * k].copy_from_slice(&top.idx);
                }
            }
        });
    kn
}

/// ‖x‖ in float64 (exact products, rounded sums in feature order).
fn norm(x: &[f32]) -> f64 {
    x.iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}

/// Whether no landmark of a tile whose norms lie in `span` can enter the
/// top k of any query of `group` (norm, spike): each query holds k and
/// (‖x‖ − ‖y‖)² ≤ ‖x − y‖² puts the float32 distance of every landmark of
/// the tile above its bar. `rel` allows for the float32 evaluation (each of
/// the at most dim + 3 roundings of a sum of non-negative terms loses at
/// most a relative 2⁻²⁴: [`float32_loss`]); the bound also allows for the
/// norms' float64 rounding and for terms flushed to zero.
fn beyond_bars(tops: &[TopK], group: &[(f64, usize)], (lo, hi): (f64, f64), rel: f64) -> bool {
    tops.iter().zip(group).all(|(top, &(nx, _))| {
        let Some(bar) = top.bar() else {
            return false;
        };
        let gap = if nx < lo {
            lo - nx
        } else if nx > hi {
            nx - hi
        } else {
            return false;
        };
        let gap = gap - 1e-12 * (nx + hi);
        gap > 0.0 && gap * gap * (1.0 - rel) - 1e-30 > f64::from(bar)
    })
}

/// An upper bound on the relative amount by which a float32 squared
/// distance over `dim` features can fall below the exact one: dim + 3
/// roundings of at most 2⁻²⁴ each (with a quarter more for their products).
fn float32_loss(dim: usize) -> f64 {
    (dim as f64 + 3.0) * f64::powi(2.0, -24) * 1.25
}

/// The squared distances (in the order [`knn`] describes) of [`TILE_Q`] rows
/// `x` (dim features each) and the [`TILE_L`] landmarks of one tile `lt`
/// (dim × TILE_L, feature-major). Compiled for AVX-512 and AVX2 too and
/// chosen at run time: the same operations on more lanes, the same bits.
fn tile_dists(x: &[&[f32]; TILE_Q], lt: &[f32]) -> [[f32; TILE_L]; TILE_Q] {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512(x: &[&[f32]; TILE_Q], lt: &[f32]) -> [[f32; TILE_L]; TILE_Q] {
            tile_dists_impl(x, lt)
        }
        #[target_feature(enable = "avx2")]
        fn avx2(x: &[&[f32]; TILE_Q], lt: &[f32]) -> [[f32; TILE_L]; TILE_Q] {
            tile_dists_impl(x, lt)
        }
        if crate::simd::avx512() {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { avx512(x, lt) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(x, lt) };
        }
    }
    tile_dists_impl(x, lt)
}

#[inline(always)]
fn tile_dists_impl(x: &[&[f32]; TILE_Q], lt: &[f32]) -> [[f32; TILE_L]; TILE_Q] {
    let dim = x[0].len();
    let full = dim / PARTS;
    // part[p][q]: partial sum p (features p, p + PARTS, … of the full
    // chunks), one at a time so that only TILE_Q accumulators are live.
    let mut part = [[[0f32; TILE_L]; TILE_Q]; PARTS];
    for (p, acc) in part.iter_mut().enumerate() {
        *acc = sq_sums(x, lt, p, PARTS, full);
    }
    let tail = sq_sums(x, lt, full * PARTS, 1, dim - full * PARTS);
    let mut d = [[0f32; TILE_L]; TILE_Q];
    for q in 0..TILE_Q {
        for l in 0..TILE_L {
            let a = |p: usize| part[p][q][l];
            d[q][l] =
                ((a(0) + a(4)) + (a(1) + a(5))) + ((a(2) + a(6)) + (a(3) + a(7))) + tail[q][l];
        }
    }
    d
}

/// Σ (x − y)² over the features `start`, `start + step`, … (`count` of them)
/// of each row of `x` and each landmark of the tile `lt`, in that order, from
/// 0, in float32.
#[inline(always)]
fn sq_sums(
    x: &[&[f32]; TILE_Q],
    lt: &[f32],
    start: usize,
    step: usize,
    count: usize,
) -> [[f32; TILE_L]; TILE_Q] {
    let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5] = [[0f32; TILE_L]; TILE_Q];
    let [x0, x1, x2, x3, x4, x5] = *x;
    fn every(r: &[f32], start: usize, step: usize, count: usize) -> impl Iterator<Item = &f32> {
        r[start.min(r.len())..].iter().step_by(step).take(count)
    }
    let feats = |r| every(r, start, step, count);
    let ys = lt[(start * TILE_L).min(lt.len())..]
        .chunks_exact(TILE_L)
        .step_by(step)
        .take(count);
    let rows = feats(x0)
        .zip(feats(x1))
        .zip(feats(x2))
        .zip(feats(x3))
        .zip(feats(x4))
        .zip(feats(x5));
    for ((((((&v0, &v1), &v2), &v3), &v4), &v5), y) in rows.zip(ys) {
        let y: &[f32; TILE_L] = y.try_into().expect("tile width");
        add_sq(&mut a0, v0, y);
        add_sq(&mut a1, v1, y);
        add_sq(&mut a2, v2, y);
        add_sq(&mut a3, v3, y);
        add_sq(&mut a4, v4, y);
        add_sq(&mut a5, v5, y);
    }
    [a0, a1, a2, a3, a4, a5]
}

/// a += (x − y)² lane by lane (y − x squares to the same bits: rounding is
/// symmetric).
#[inline(always)]
fn add_sq(a: &mut [f32; TILE_L], x: f32, y: &[f32; TILE_L]) {
    for (a, &y) in a.iter_mut().zip(y) {
        let d = y - x;
        *a += d * d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn landmarks_follow_subsample_idx() {
        // Kilosort4's docstring example: subsample_idx(6, 3) keeps 1, 3, 4.
        assert_eq!(landmarks(6, 1, Some(3)), vec![1, 3, 4]);
        assert_eq!(landmarks(100, 20, Some(25_000)), vec![0, 20, 40, 60, 80]);
        assert_eq!(landmarks(101, 20, None), vec![0, 20, 40, 60, 80, 100]);
    }

    /// Squared Euclidean distance in float32, one pair at a time, in the
    /// order [`knn`] describes.
    fn sq_dist(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let ca = a.chunks_exact(8);
        let cb = b.chunks_exact(8);
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for l in 0..8 {
                let d = x[l] - y[l];
                acc[l] += d * d;
            }
        }
        let mut tail = 0f32;
        for (x, y) in ra.iter().zip(rb) {
            let d = x - y;
            tail += d * d;
        }
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
    }

    /// The k nearest landmarks found one query and one landmark at a time.
    fn literal(xd: &[f32], dim: usize, landmarks: &[usize], k: usize) -> Vec<u32> {
        let mut kn = Vec::new();
        for x in xd.chunks_exact(dim) {
            let mut top = TopK::new(k);
            for (j, &s) in landmarks.iter().enumerate() {
                top.offer(sq_dist(x, &xd[s * dim..(s + 1) * dim]), j as u32);
            }
            kn.extend(top.idx);
        }
        kn
    }

    /// Values uniform in [−0.5, 0.5) from a xorshift generator seeded with `seed`.
    fn uniform(seed: u64) -> impl FnMut() -> f32 {
        let mut x = seed;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f32 / (1u64 << 53) as f32 - 0.5
        }
    }

    #[test]
    fn tiled_knn_equals_literal_knn() {
        // Dimensions under, at and over the 8 partial sums, with and without
        // a tail; landmark counts not multiples of the tiles; query blocks
        // not multiples of the query tile. Integer features make many exact
        // ties (the lower index must win), the others random distances.
        let mut next = uniform(5);
        for (dim, n, integer) in [
            (1usize, 700usize, true),
            (7, 1300, false),
            (8, 900, true),
            (13, 2000, false),
            (84, 3100, false),
            (84, 1000, true),
        ] {
            let xd: Vec<f32> = (0..n * dim)
                .map(|_| {
                    if integer {
                        (next() * 6.0).round()
                    } else {
                        next() * 30.0
                    }
                })
                .collect();
            for (skip, k) in [(20, 10), (3, 17)] {
                let lm = landmarks(n, skip, Some(600));
                assert_eq!(
                    knn(&xd, dim, &lm, k),
                    literal(&xd, dim, &lm, k),
                    "dim {dim}, skip {skip}"
                );
            }
        }
    }

    /// Rows of very different norms (amplitudes from 1 to 60), so that most
    /// landmarks are skipped by their norm, with repeated rows for ties: the
    /// same neighbours as the exhaustive search.
    #[test]
    fn norm_skipped_knn_equals_literal_knn() {
        let mut next = uniform(11);
        for (dim, n) in [(6usize, 4000usize), (72, 3000), (84, 2500)] {
            let shapes: Vec<Vec<f32>> = (0..12)
                .map(|_| (0..dim).map(|_| next()).collect())
                .collect();
            let mut xd = Vec::with_capacity(n * dim);
            for i in 0..n {
                let amp = 1.0 + (i * 7919 % 60) as f32;
                let shape = &shapes[i % 12];
                if i % 97 == 5 {
                    // A repeat of an earlier row: exact ties.
                    let r = (i / 2) * dim;
                    let prev: Vec<f32> = xd[r..r + dim].to_vec();
                    xd.extend(prev);
                } else {
                    xd.extend(shape.iter().map(|&s| amp * s + 0.05 * next()));
                }
            }
            for (skip, k) in [(20, 10), (7, 3)] {
                let lm = landmarks(n, skip, Some(600));
                assert_eq!(
                    knn(&xd, dim, &lm, k),
                    literal(&xd, dim, &lm, k),
                    "dim {dim}, skip {skip}"
                );
            }
        }
    }

    #[test]
    fn knn_is_exact_and_ties_go_to_the_lower_index() {
        // Points on a line; landmarks every other point.
        let xd: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let lm = landmarks(10, 2, None); // 0 2 4 6 8
        let kn = knn(&xd, 1, &lm, 2);
        // Point 1 is 1 from both 0 and 2: both kept, lower index first.
        assert_eq!(&kn[2..4], &[0, 1]);
        // Point 3 is equidistant from landmarks 1 (2) and 2 (4).
        assert_eq!(&kn[6..8], &[1, 2]);
        // Point 9: nearest landmark 4 (8), then 3 (6).
        assert_eq!(&kn[18..20], &[4, 3]);
    }
}
