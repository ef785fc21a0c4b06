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
        let best = best_candidate(xd, dim, &cand, &vexp0);
        let c = rows(cand[best]);
        let cn = dot(c, c);
        for i in 0..n {
            let g = 2.0 * dot(rows(i), c) - cn;
            if g > vexp0[i] {
                vexp0[i] = g;
                iclust[i] = j as u32;
            }
        }
    }
    iclust
}

/// The position (in `cand`) of the candidate with the largest summed positive
/// gain Σ relu(2x·c − ‖c‖² − v0); the first on ties.
fn best_candidate(xd: &[f32], dim: usize, cand: &[usize], vexp0: &[f32]) -> usize {
    let nc = cand.len();
    // Candidates transposed (dim × nc) so that one spike's gains are a run of
    // multiply-adds along the candidates.
    let mut ct = vec![0f32; dim * nc];
    let mut cn = vec![0f32; nc];
    for (c, &s) in cand.iter().enumerate() {
        let row = &xd[s * dim..(s + 1) * dim];
        cn[c] = dot(row, row);
        for k in 0..dim {
            ct[k * nc + c] = row[k];
        }
    }
    let partial: Vec<Vec<f64>> = xd
        .par_chunks(SPIKE_BLOCK * dim)
        .zip(vexp0.par_chunks(SPIKE_BLOCK))
        .map(|(block, v0)| {
            let mut sum = vec![0f64; nc];
            let mut acc = vec![0f32; nc];
            for (x, &e) in block.chunks_exact(dim).zip(v0) {
                acc.iter_mut().for_each(|a| *a = 0.0);
                for (k, &xk) in x.iter().enumerate() {
                    let crow = &ct[k * nc..(k + 1) * nc];
                    for (a, &cv) in acc.iter_mut().zip(crow) {
                        *a += xk * cv;
                    }
                }
                for c in 0..nc {
                    let d = 2.0 * acc[c] - cn[c] - e;
                    if d > 0.0 {
                        sum[c] += f64::from(d);
                    }
                }
            }
            sum
        })
        .collect();
    let mut total = vec![0f64; nc];
    for p in &partial {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    let mut best = 0;
    for c in 1..nc {
        if total[c] > total[best] {
            best = c;
        }
    }
    best
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
