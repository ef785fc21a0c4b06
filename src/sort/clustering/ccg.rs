//! The cross-refractoriness test inside the final clustering's merge tree
//! (Kilosort4 4.1.7 `swarmsplitter.py:check_CCG`, `refractoriness`, on
//! `CCG.py:compute_CCG`, `CCG_metrics`).
//!
//! The cross-correlogram of two spike trains (seconds) in 1-ms bins over ±500
//! bins; its shoulders (lags 250–500 ms, and −50…−11 / +10…+49 ms) give the
//! baseline, and the ±1…±10-ms centre is compared with it. The pair is
//! cross-refractory when R12 < 0.25 and (Q12 < 0.05 or Q00 < 0.25); these
//! thresholds are hard-coded in swarmsplitter's copy (the `ccg_threshold` and
//! `acg_threshold` settings do not reach it).

use crate::sort::ccg::{NBINS, TBIN, ccg_metrics, compute_ccg};

/// Whether two spike trains (seconds) are cross-refractory, i.e. should be
/// one unit (swarmsplitter's `check_CCG(st1, st2)[1]` as intended: false for
/// an empty train or a zero span). The correlogram and its statistics are
/// [`crate::sort::ccg`]'s; only the thresholds are swarmsplitter's own.
pub fn cross_refractory(st1: &[f64], st2: &[f64]) -> bool {
    if st1.is_empty() || st2.is_empty() {
        return false;
    }
    let ccg = compute_ccg(st1, st2, TBIN, NBINS);
    if ccg.span == 0.0 {
        return false;
    }
    let m = ccg_metrics(st1.len(), st2.len(), &ccg, NBINS, TBIN);
    m.r12 < 0.25 && (m.q12 < 0.05 || m.q00 < 0.25)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spike times (s) with gaps of `min_gap` plus up to 50 ms, from an LCG.
    fn train(seed: u64, n: usize, min_gap: f64) -> Vec<f64> {
        let mut x = seed;
        let mut t = 0.0;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                t += min_gap + (x >> 40) as f64 / (1u64 << 24) as f64 * 0.05;
                t
            })
            .collect()
    }

    #[test]
    fn halves_of_one_refractory_train_are_cross_refractory() {
        let st = train(7, 4000, 0.003);
        let a: Vec<f64> = st.iter().step_by(2).copied().collect();
        let b: Vec<f64> = st.iter().skip(1).step_by(2).copied().collect();
        assert!(cross_refractory(&a, &b));
        // Two independent trains are not.
        let c = train(99, 2000, 0.0);
        assert!(!cross_refractory(&a, &c));
        assert!(!cross_refractory(&a, &[]));
    }
}
