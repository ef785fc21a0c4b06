//! The neighbour graph of one group (Kilosort4 4.1.7 `clustering_qr.py`:
//! `neigh_mat`, `subsample_idx`): each spike's exact k nearest landmarks.
//!
//! Kilosort4 searches with faiss `IndexFlatL2` (float32, ‖x‖² + ‖y‖² − 2x·y
//! through BLAS). spikecube computes each squared distance directly,
//! Σ(x − y)² in float32 in a fixed order, and keeps the lower landmark index on
//! a tie, so the graph does not depend on the thread count or the BLAS.

use rayon::prelude::*;

/// Queries handled together (one rayon task), and the landmark block they share.
const QUERY_BLOCK: usize = 256;
const LANDMARK_BLOCK: usize = 512;

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
fn linspace_round(last: usize, num: usize) -> Vec<usize> {
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

/// Squared Euclidean distance in float32, summed in 8 interleaved partial sums
/// combined in a fixed order.
#[inline]
pub(crate) fn sq_dist(a: &[f32], b: &[f32]) -> f32 {
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

    /// Offers landmark `j`; landmarks arrive in increasing index, so a tie
    /// keeps the earlier one (strictly smaller distances displace).
    #[inline]
    fn offer(&mut self, d: f32, j: u32) {
        if d.is_nan() || (self.dist.len() == self.k && d >= self.dist[self.k - 1]) {
            return;
        }
        let p = self.dist.partition_point(|&e| e <= d);
        self.dist.insert(p, d);
        self.idx.insert(p, j);
        if self.dist.len() > self.k {
            self.dist.pop();
            self.idx.pop();
        }
    }
}

/// For each row of `xd` (n × `dim`, float32), the indices (into `landmarks`) of
/// its `k` nearest landmarks, nearest first; (n × k) row-major. `k` must not
/// exceed the number of landmarks.
pub fn knn(xd: &[f32], dim: usize, landmarks: &[usize], k: usize) -> Vec<u32> {
    let n = xd.len() / dim.max(1);
    assert!(
        k <= landmarks.len(),
        "k = {k} > {} landmarks",
        landmarks.len()
    );
    let mut lm = Vec::with_capacity(landmarks.len() * dim);
    for &s in landmarks {
        lm.extend_from_slice(&xd[s * dim..(s + 1) * dim]);
    }
    let mut kn = vec![0u32; n * k];
    kn.par_chunks_mut(QUERY_BLOCK * k)
        .enumerate()
        .for_each(|(b, out)| {
            let q0 = b * QUERY_BLOCK;
            let nq = out.len() / k;
            let mut tops: Vec<TopK> = (0..nq).map(|_| TopK::new(k)).collect();
            for l0 in (0..landmarks.len()).step_by(LANDMARK_BLOCK) {
                let l1 = (l0 + LANDMARK_BLOCK).min(landmarks.len());
                for (q, top) in tops.iter_mut().enumerate() {
                    let x = &xd[(q0 + q) * dim..(q0 + q + 1) * dim];
                    for j in l0..l1 {
                        top.offer(sq_dist(x, &lm[j * dim..(j + 1) * dim]), j as u32);
                    }
                }
            }
            for (q, top) in tops.iter().enumerate() {
                out[q * k..(q + 1) * k].copy_from_slice(&top.idx);
            }
        });
    kn
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
