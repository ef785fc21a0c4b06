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

/// Bins on each side of zero lag.
const NBINS: usize = 500;
/// Bin width (s).
const TBIN: f64 = 1.0 / 1000.0;

/// The cross-correlogram (2·500 + 1 bins of 1 ms; bin 500 + round((t2 − t1)/1 ms))
/// of the trains `st1` and `st2` (seconds, any order), and T, the span of
/// both trains (s). Kilosort4's `compute_CCG`, sliding window included.
pub fn compute_ccg(st1: &[f64], st2: &[f64]) -> (Vec<f64>, f64) {
    let mut s1 = st1.to_vec();
    let mut s2 = st2.to_vec();
    s1.sort_by(f64::total_cmp);
    s2.sort_by(f64::total_cmp);
    let mut k = vec![0f64; 2 * NBINS + 1];
    if s1.is_empty() || s2.is_empty() {
        return (k, 0.0);
    }
    let dt = NBINS as f64 * TBIN;
    let t = s1[s1.len() - 1].max(s2[s2.len() - 1]) - s1[0].min(s2[0]);
    let (mut ilow, mut ihigh, mut j) = (0usize, 0usize, 0usize);
    while j < s2.len() {
        while ihigh < s1.len() && s1[ihigh] <= s2[j] + dt {
            ihigh += 1;
        }
        while ilow < s1.len() && s1[ilow] <= s2[j] - dt {
            ilow += 1;
        }
        if ilow >= s1.len() {
            break;
        }
        if s1[ilow] > s2[j] + dt {
            j += 1;
            continue;
        }
        for &a in &s1[ilow..ihigh] {
            let ibin = ((s2[j] - a) / TBIN).round_ties_even() as i64;
            k[(ibin + NBINS as i64) as usize] += 1.0;
        }
        j += 1;
    }
    (k, t)
}

/// Kilosort4's `CCG_metrics`: (R12, Q12, Q00) of a correlogram `k` of trains
/// with `n1` and `n2` spikes spanning `t` seconds.
pub fn ccg_metrics(k: &[f64], n1: usize, n2: usize, t: f64) -> (f64, f64, f64) {
    let nb = NBINS;
    let (n1, n2) = (n1 as f64, n2 as f64);
    let sum = |r: std::ops::Range<usize>| -> f64 { k[r].iter().sum() };
    let outer = (1..nb / 2).chain(3 * nb / 2..2 * nb);
    let len1 = (nb / 2 - 1 + nb / 2) as f64;
    let s1: f64 = outer.map(|i| k[i]).sum();
    let s2 = sum(nb - 50..nb - 10);
    let s3 = sum(nb + 10..nb + 50);
    let r00 = s1 / (len1 * TBIN * n1 * n2 / t);
    let r1 = s2 / (40.0 * TBIN * n1 * n2 / t);
    let r2 = s3 / (40.0 * TBIN * n1 * n2 / t);
    let r01 = r1.max(r2);
    let q00 = (s2 / 40.0).max(s3 / 40.0).max(s1 / len1);
    let mut kz = k.to_vec();
    kz[nb] = 0.0;
    let mut rmin = f64::INFINITY;
    let mut qmin = f64::INFINITY;
    for i in 1..=10usize {
        let c: f64 = kz[nb - i..=nb + i].iter().sum();
        let ri = c / ((2 * i) as f64 * TBIN * n1 * n2 / t);
        let lam = q00 * i as f64;
        let p = 0.5 * (1.0 + libm::erf((c / 2.0 - lam) / (1e-10 + 2.0 * lam).sqrt()));
        rmin = rmin.min(ri);
        qmin = qmin.min(p);
    }
    let r12 = rmin / (1e-10 + r00.max(r01));
    (r12, qmin, q00)
}

/// Whether two spike trains (seconds) are cross-refractory, i.e. should be
/// one unit (swarmsplitter's `check_CCG(st1, st2)[1]` as intended: false for
/// an empty train or a zero span).
pub fn cross_refractory(st1: &[f64], st2: &[f64]) -> bool {
    if st1.is_empty() || st2.is_empty() {
        return false;
    }
    let (k, t) = compute_ccg(st1, st2);
    if t == 0.0 {
        return false;
    }
    let (r12, q12, q00) = ccg_metrics(&k, st1.len(), st2.len(), t);
    r12 < 0.25 && (q12 < 0.05 || q00 < 0.25)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn correlogram_bins_lags() {
        let (k, t) = compute_ccg(&[1.0, 2.0], &[1.0105, 3.0]);
        // 1.0105 − 1.0 = 10.5 ms → bin 500 + 10 (half to even); 1.0105 − 2.0 → −990 ms: out.
        assert_eq!(k[510], 1.0);
        assert_eq!(k.iter().sum::<f64>(), 1.0);
        assert_eq!(t, 2.0);
    }

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
