//! The initial labels of one group (Kilosort4 4.1.7
//! `clustering_qr.py:kmeans_plusplus`): a greedy "best of 100 candidates"
//! k-means++ seeding.
//!
//! Every spike keeps the best explained variance so far, v0 (start 0). At each
//! of the `n_clusters` steps, 100 distinct candidate spikes are drawn with
//! probability ∝ relu(‖x‖² − v0) (without replacement); the gain of candidate c
//! for spike x is 2x·c − ‖c‖²; the candidate with the largest summed positive
//! gain over v0 is kept, and every spike it improves takes its label. Spikes
//! never improved keep label 0.
//!
//! Kilosort4 draws with torch's generator (seeded at every call); spikecube
//! draws with a ChaCha8 generator seeded with `cluster_init_seed` at every
//! call, so the draws differ from Kilosort4's but not between runs, thread
//! counts or machines. Dot products are summed in float32 in feature order;
//! per-candidate totals in float64 over fixed blocks of spikes.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rayon::prelude::*;

use super::settings::N_CANDIDATES;

/// Spikes per block of the gain sums (fixed, so totals do not depend on the
/// thread count).
const SPIKE_BLOCK: usize = 2048;
/// Rejected (already drawn) candidates in a row before the weights are rebuilt
/// without the drawn ones.
const MAX_REJECTS: usize = 64;

/// x·c summed in float32 in feature order (the one order used everywhere here,
/// so that a spike's gain from itself equals its own ‖x‖²).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// A uniform number in [0, 1) from 53 random bits.
fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Up to `ntry` distinct indices drawn with probability ∝ `w` (non-negative),
/// one after another without replacement (a drawn index is redrawn; after many
/// redraws in a row the weights are rebuilt without the drawn ones, which
/// gives the same distribution). Indices with weight 0 are never drawn.
fn draw_without_replacement(w: &[f32], ntry: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
    let positive = w.iter().filter(|&&v| v > 0.0).count();
    let ntry = ntry.min(positive);
    let mut chosen: Vec<usize> = Vec::with_capacity(ntry);
    let mut is_chosen = vec![false; w.len()];
    let build = |is_chosen: &[bool]| -> Vec<f64> {
        let mut acc = 0f64;
        w.iter()
            .zip(is_chosen)
            .map(|(&v, &c)| {
                if !c && v > 0.0 {
                    acc += f64::from(v);
                }
                acc
            })
            .collect()
    };
    let mut cum = build(&is_chosen);
    let mut rejects = 0;
    while chosen.len() < ntry {
        let total = *cum.last().unwrap_or(&0.0);
        let r = uniform(rng) * total;
        let i = cum.partition_point(|&c| c <= r).min(w.len() - 1);
        if is_chosen[i] || w[i] <= 0.0 {
            rejects += 1;
            if rejects >= MAX_REJECTS {
                cum = build(&is_chosen);
                rejects = 0;
            }
            continue;
        }
        rejects = 0;
        is_chosen[i] = true;
        chosen.push(i);
    }
    chosen
}

/// A spike whose gain from a candidate beat its v0: (spike index, gain
/// t = 2x·c − ‖c‖² in float32, computed as in [`block_gains`]).
type Gain = (u32, f32);

/// Most memoised gains kept per spike of the group (see [`Memo`]): a bound
/// on the memo's memory, 8 bytes a gain.
const MEMO_GAINS_PER_SPIKE: usize = 64;

/// The gains of every candidate computed so far in one group, kept for when
/// it is drawn again (a spike far from every seed is drawn at many steps).
///
/// For candidate spike c, `lists[c]` holds, in ascending spike order, the
/// spikes whose gain t exceeded their v0 when last checked, with t (which
/// never changes). Every other spike's t was ≤ its v0 then, and v0 never
/// decreases, so it stays ≤ v0: its d = fl(t − v0) is ≤ 0 (rounding is
/// monotone) and adds exactly +0 to the candidate's sum, and it would not
/// take the candidate's label. A memoised candidate therefore gets the same
/// sums and labels from its list alone, with no dot product.
struct Memo {
    lists: Vec<Option<Vec<Gain>>>,
    /// Gains held in all lists.
    held: usize,
    /// Most gains held ([`MEMO_GAINS_PER_SPIKE`] per spike); a list that
    /// would pass it is not kept (its candidate is recomputed if drawn again).
    cap: usize,
}

/// Initial labels (0‥`n_clusters`) of the `xd.len() / dim` spikes of one group
/// (rows of `xd`, float32), by Kilosort4's greedy k-means++ seeding with our
/// own generator seeded with `seed`.
pub fn kmeans_plusplus(xd: &[f32], dim: usize, n_clusters: usize, seed: u64) -> Vec<u32> {
    let n = xd.len() / dim;
    let rows = |i: usize| &xd[i * dim..(i + 1) * dim];
    let vtot: Vec<f32> = (0..n).map(|i| dot(rows(i), rows(i))).collect();
    let mut vexp0 = vec![0f32; n];
    let mut iclust = vec![0u32; n];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut memo = Memo {
        lists: (0..n).map(|_| None).collect(),
        held: 0,
        cap: n.saturating_mul(MEMO_GAINS_PER_SPIKE),
    };
    for j in 0..n_clusters {
        let v2: Vec<f32> = vtot
            .iter()
            .zip(&vexp0)
            .map(|(&t, &e)| (t - e).max(0.0))
            .collect();
        let cand = draw_without_replacement(&v2, N_CANDIDATES, &mut rng);
        if cand.is_empty() {
            // Every spike is explained exactly: no candidate can gain.
            break;
        }
        // The spikes whose gain from the kept candidate beats their v0 (its
        // gain 2x·c − ‖c‖² > v0) take its label and that gain as their v0.
        for (i, t) in best_candidate(xd, dim, &cand, &vexp0, &mut memo) {
            vexp0[i as usize] = t;
            iclust[i as usize] = j as u32;
        }
    }
    iclust
}

/// Candidates per register tile of the gain kernel (one 16-lane vector).
const TILE_C: usize = 16;
/// Spikes per register tile of the gain kernel.
const TILE_S: usize = 6;

/// The candidate (of `cand`) with the largest summed positive gain
/// Σ relu(2x·c − ‖c‖² − v0), the first on ties; returns the spikes whose gain
/// from it beats their v0 (ascending), with those gains.
///
/// Each x·c is summed in float32 in feature order (multiply, then add; no
/// fused multiply-add); each candidate's positive gains are added in float64
/// in spike order within blocks of [`SPIKE_BLOCK`] spikes, and the blocks'
/// totals in block order. Candidates seen before at this group's earlier steps
/// are summed from their [`Memo`] lists, the others by [`block_gains`]; both
/// give the bits of one spike and one candidate at a time.
fn best_candidate(
    xd: &[f32],
    dim: usize,
    cand: &[usize],
    vexp0: &[f32],
    memo: &mut Memo,
) -> Vec<Gain> {
    let nc = cand.len();
    let mut total = vec![0f64; nc];
    let mut lists: Vec<Option<Vec<Gain>>> = cand.iter().map(|&s| memo.lists[s].take()).collect();
    for l in lists.iter().flatten() {
        memo.held -= l.len();
    }
    let fresh: Vec<usize> = (0..nc).filter(|&c| lists[c].is_none()).collect();
    total
        .par_iter_mut()
        .zip(lists.par_iter_mut())
        .for_each(|(t, l)| {
            if let Some(l) = l {
                *t = recheck(l, vexp0);
            }
        });
    if !fresh.is_empty() {
        let (sums, gains) = fresh_gains(xd, dim, cand, &fresh, vexp0);
        for ((&c, s), g) in fresh.iter().zip(sums).zip(gains) {
            total[c] = s;
            lists[c] = Some(g);
        }
    }
    let mut best = 0;
    for c in 1..nc {
        if total[c] > total[best] {
            best = c;
        }
    }
    let won = lists[best].take().unwrap_or_default();
    for (&s, l) in cand.iter().zip(lists) {
        let l = l.unwrap_or_default();
        if memo.held + l.len() <= memo.cap {
            memo.held += l.len();
            memo.lists[s] = Some(l);
        }
    }
    won
}

/// The summed positive gains Σ relu(t − v0) of one memoised candidate (float64,
/// in spike order within blocks of [`SPIKE_BLOCK`], blocks in order, as
/// [`block_gains`] sums them: the spikes left out add +0), dropping from
/// `list` the spikes whose t no longer beats v0.
fn recheck(list: &mut Vec<Gain>, v0: &[f32]) -> f64 {
    let mut total = 0f64;
    let mut block_sum = 0f64;
    let mut block = 0;
    list.retain(|&(i, t)| {
        let i = i as usize;
        if i / SPIKE_BLOCK != block {
            total += block_sum;
            block_sum = 0.0;
            block = i / SPIKE_BLOCK;
        }
        let e = v0[i];
        let d = t - e;
        if d > 0.0 {
            block_sum += f64::from(d);
        }
        t > e
    });
    total + block_sum
}

/// The summed positive gains of the candidates `cand[fresh]` (float64, in
/// spike order within blocks of [`SPIKE_BLOCK`], blocks in order) and, for
/// each, the spikes (ascending) whose gain t beats their v0, with t.
fn fresh_gains(
    xd: &[f32],
    dim: usize,
    cand: &[usize],
    fresh: &[usize],
    vexp0: &[f32],
) -> (Vec<f64>, Vec<Vec<Gain>>) {
    let nf = fresh.len();
    let ncp = nf.div_ceil(TILE_C) * TILE_C;
    // Candidates transposed (dim × ncp, zero-padded): one feature of
    // TILE_C candidates is one contiguous run.
    let mut ct = vec![0f32; dim * ncp];
    let mut cn = vec![0f32; ncp];
    for (c, &f) in fresh.iter().enumerate() {
        let row = &xd[cand[f] * dim..(cand[f] + 1) * dim];
        cn[c] = dot(row, row);
        for k in 0..dim {
            ct[k * ncp + c] = row[k];
        }
    }
    let partial: Vec<(Vec<f64>, Vec<BlockGain>)> = xd
        .par_chunks(SPIKE_BLOCK * dim)
        .zip(vexp0.par_chunks(SPIKE_BLOCK))
        .map(|(block, v0)| {
            let mut sum = vec![0f64; ncp];
            let mut gains = Vec::new();
            block_gains(block, v0, &ct, &cn, dim, nf, &mut sum, &mut gains);
            (sum, gains)
        })
        .collect();
    let mut total = vec![0f64; nf];
    let mut lists: Vec<Vec<Gain>> = vec![Vec::new(); nf];
    for (b, (sum, gains)) in partial.into_iter().enumerate() {
        for (t, v) in total.iter_mut().zip(&sum) {
            *t += v;
        }
        let base = b * SPIKE_BLOCK;
        for (c, s, t) in gains {
            lists[usize::from(c)].push(((base + s as usize) as u32, t));
        }
    }
    (total, lists)
}

/// A gain that beats v0 within one block: (candidate column, spike in the
/// block, t).
type BlockGain = (u16, u32, f32);

/// Adds, for each candidate column of `ct` (dim × ncp), the positive gains
/// 2x·c − ‖c‖² − v0 of the spikes of `block` (rows of `dim`) to `sum` (ncp),
/// in spike order, and pushes to `gains` each spike whose gain
/// t = 2x·c − ‖c‖² beats its v0, for the first `live` columns (each column's
/// spikes in ascending order). Compiled for AVX-512 and AVX2 too and chosen at
/// run time: the same operations on more lanes, the same bits.
#[allow(clippy::too_many_arguments)]
fn block_gains(
    block: &[f32],
    v0: &[f32],
    ct: &[f32],
    cn: &[f32],
    dim: usize,
    live: usize,
    sum: &mut [f64],
    gains: &mut Vec<BlockGain>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        #[allow(clippy::too_many_arguments)]
        fn avx512(
            b: &[f32],
            v0: &[f32],
            ct: &[f32],
            cn: &[f32],
            dim: usize,
            live: usize,
            s: &mut [f64],
            g: &mut Vec<BlockGain>,
        ) {
            block_gains_impl(b, v0, ct, cn, dim, live, s, g)
        }
        #[target_feature(enable = "avx2")]
        #[allow(clippy::too_many_arguments)]
        fn avx2(
            b: &[f32],
            v0: &[f32],
            ct: &[f32],
            cn: &[f32],
            dim: usize,
            live: usize,
            s: &mut [f64],
            g: &mut Vec<BlockGain>,
        ) {
            block_gains_impl(b, v0, ct, cn, dim, live, s, g)
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            unsafe { avx512(block, v0, ct, cn, dim, live, sum, gains) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { avx2(block, v0, ct, cn, dim, live, sum, gains) };
            return;
        }
    }
    block_gains_impl(block, v0, ct, cn, dim, live, sum, gains)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block_gains_impl(
    block: &[f32],
    v0: &[f32],
    ct: &[f32],
    cn: &[f32],
    dim: usize,
    live: usize,
    sum: &mut [f64],
    gains: &mut Vec<BlockGain>,
) {
    let ncp = cn.len();
    let ns = v0.len();
    let mut acc = [[0f32; TILE_C]; TILE_S];
    let mut s0 = 0;
    while s0 < ns {
        let rows = (ns - s0).min(TILE_S);
        for c0 in (0..ncp).step_by(TILE_C) {
            if rows == TILE_S {
                tile_full(&block[s0 * dim..], ct, ncp, c0, dim, &mut acc);
            } else {
                for r in 0..rows {
                    tile_row(&block[(s0 + r) * dim..], ct, ncp, c0, dim, &mut acc[r]);
                }
            }
            // Lanes past the last live column are padding.
            let live_lanes = live.saturating_sub(c0).min(TILE_C);
            let live_mask = if live_lanes == TILE_C {
                u32::MAX
            } else {
                (1u32 << live_lanes) - 1
            };
            for (r, a) in acc.iter().enumerate().take(rows) {
                let e = v0[s0 + r];
                let cnr = &cn[c0..c0 + TILE_C];
                let sr = &mut sum[c0..c0 + TILE_C];
                let mut t = [0f32; TILE_C];
                let mut beats = 0u32;
                for l in 0..TILE_C {
                    t[l] = 2.0 * a[l] - cnr[l];
                    let d = t[l] - e;
                    // Adding +0 leaves a sum of positive terms unchanged.
                    sr[l] += if d > 0.0 { f64::from(d) } else { 0.0 };
                    beats |= u32::from(t[l] > e) << l;
                }
                beats &= live_mask;
                while beats != 0 {
                    let l = beats.trailing_zeros() as usize;
                    beats &= beats - 1;
                    gains.push(((c0 + l) as u16, (s0 + r) as u32, t[l]));
                }
            }
        }
        s0 += rows;
    }
}

/// x·c for TILE_S consecutive rows of `x` and the TILE_C candidates from
/// column `c0` of `ct`, each summed in feature order.
#[inline(always)]
fn tile_full(
    x: &[f32],
    ct: &[f32],
    ncp: usize,
    c0: usize,
    dim: usize,
    acc: &mut [[f32; TILE_C]; TILE_S],
) {
    let x = &x[..TILE_S * dim];
    let mut a = [[0f32; TILE_C]; TILE_S];
    for k in 0..dim {
        let crow: &[f32; TILE_C] = ct[k * ncp + c0..k * ncp + c0 + TILE_C]
            .try_into()
            .expect("tile width");
        for r in 0..TILE_S {
            let xk = x[r * dim + k];
            for l in 0..TILE_C {
                a[r][l] += xk * crow[l];
            }
        }
    }
    *acc = a;
}

/// As [`tile_full`] for one row.
#[inline(always)]
fn tile_row(x: &[f32], ct: &[f32], ncp: usize, c0: usize, dim: usize, acc: &mut [f32; TILE_C]) {
    let mut a = [0f32; TILE_C];
    for k in 0..dim {
        let xk = x[k];
        let crow = &ct[k * ncp + c0..k * ncp + c0 + TILE_C];
        for l in 0..TILE_C {
            a[l] += xk * crow[l];
        }
    }
    *acc = a;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separated_blobs_get_their_own_labels() {
        // Three tight blobs far apart and three seeds: each blob's spikes share
        // a label and the blobs differ.
        let centres = [[10.0f32, 0.0], [0.0, 10.0], [-10.0, -10.0]];
        let mut xd = Vec::new();
        for i in 0..300 {
            let c = centres[i % 3];
            let e = (i / 3) as f32 * 1e-3;
            xd.extend_from_slice(&[c[0] + e, c[1] - e]);
        }
        let lab = kmeans_plusplus(&xd, 2, 3, 5);
        for i in 3..300 {
            assert_eq!(lab[i], lab[i % 3], "spike {i}");
        }
        assert!(lab[0] != lab[1] && lab[1] != lab[2] && lab[0] != lab[2]);
        assert_eq!(lab, kmeans_plusplus(&xd, 2, 3, 5));
    }

    /// The seeding computed literally: every spike against every candidate,
    /// one dot product at a time.
    #[allow(clippy::needless_range_loop)]
    fn literal(xd: &[f32], dim: usize, n_clusters: usize, seed: u64) -> Vec<u32> {
        let n = xd.len() / dim;
        let rows = |i: usize| &xd[i * dim..(i + 1) * dim];
        let vtot: Vec<f32> = (0..n).map(|i| dot(rows(i), rows(i))).collect();
        let mut v0 = vec![0f32; n];
        let mut lab = vec![0u32; n];
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for j in 0..n_clusters {
            let v2: Vec<f32> = vtot
                .iter()
                .zip(&v0)
                .map(|(&t, &e)| (t - e).max(0.0))
                .collect();
            let cand = draw_without_replacement(&v2, N_CANDIDATES, &mut rng);
            if cand.is_empty() {
                break;
            }
            let mut total = vec![0f64; cand.len()];
            for b0 in (0..n).step_by(SPIKE_BLOCK) {
                let mut sum = vec![0f64; cand.len()];
                for i in b0..(b0 + SPIKE_BLOCK).min(n) {
                    for (s, &c) in sum.iter_mut().zip(&cand) {
                        let d = 2.0 * dot(rows(i), rows(c)) - dot(rows(c), rows(c)) - v0[i];
                        if d > 0.0 {
                            *s += f64::from(d);
                        }
                    }
                }
                total.iter_mut().zip(&sum).for_each(|(t, s)| *t += s);
            }
            let best = (1..cand.len()).fold(0, |b, c| if total[c] > total[b] { c } else { b });
            let c = rows(cand[best]);
            for i in 0..n {
                let g = 2.0 * dot(rows(i), c) - dot(c, c);
                if g > v0[i] {
                    v0[i] = g;
                    lab[i] = j as u32;
                }
            }
        }
        lab
    }

    #[test]
    fn tiled_seeding_equals_literal_seeding() {
        // Blobs of different sizes and spreads, some points repeated, in a
        // dimension that is and one that is not a multiple of the tiles.
        for (dim, n, blobs) in [(84usize, 5000usize, 30usize), (7, 2500, 12)] {
            let mut x = 99u64;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f32 / (1u64 << 53) as f32 - 0.5
            };
            let centres: Vec<Vec<f32>> = (0..blobs)
                .map(|b| {
                    (0..dim)
                        .map(|_| next() * 20.0 * (1 + b % 3) as f32)
                        .collect()
                })
                .collect();
            let mut xd = Vec::with_capacity(n * dim);
            for i in 0..n {
                if i % 97 == 5 {
                    let prev = xd[(i - 1) * dim..i * dim].to_vec();
                    xd.extend(prev);
                    continue;
                }
                let c = &centres[(i * 7) % blobs];
                let spread = 0.5 + (i % 5) as f32;
                xd.extend(c.iter().map(|&v| v + spread * next()));
            }
            for seed in [1, 5] {
                assert_eq!(
                    kmeans_plusplus(&xd, dim, 60, seed),
                    literal(&xd, dim, 60, seed),
                    "dim {dim}, seed {seed}"
                );
            }
        }
    }

    #[test]
    fn draws_are_distinct_and_skip_zero_weights() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut w = vec![0f32; 500];
        for i in (0..500).step_by(3) {
            w[i] = 1.0 + i as f32;
        }
        w[7] = 1e9; // concentrated weight: forces the rebuild path
        let d = draw_without_replacement(&w, 100, &mut rng);
        assert_eq!(d.len(), 100);
        let mut s = d.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 100);
        assert!(d.iter().all(|&i| w[i] > 0.0));
        assert_eq!(d[0], 7);
    }
}
