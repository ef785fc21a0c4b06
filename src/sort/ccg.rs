//! Spike-train cross-correlograms and the refractoriness tests Kilosort4 4.1.7
//! builds on them (`CCG.py`: `compute_CCG`, `CCG_metrics`, `check_CCG`,
//! `refract`; `../shared/docs/sorting-spec.md` §2.6).
//!
//! Times are in **seconds** (float64), as Kilosort4 passes them (sample / fs).
//! Everything is float64 and sequential, so a result is the same on every
//! thread count; [`refract`] runs clusters in parallel, each on its own.
//!
//! The metrics, with n1, n2 the spike counts, T the span of both trains and
//! the Poisson count per bin λ = n1·n2·tbin/T:
//! - baselines R00 (lags ±250…±500 ms: bins 1…249 and 750…999), R1 (bins
//!   450…489) and R2 (bins 510…549), each a mean count per bin over λ;
//! - Q00, the largest plain mean count per bin of those three ranges;
//! - with the zero-lag bin blanked, for i = 1…10: Ri = count in ±i bins over
//!   2i·λ, and Qi = ½(1 + erf((count/2 − Q00·i)/√(1e-10 + 2·Q00·i)));
//! - R12 = min Ri / (1e-10 + max(R00, R1, R2)), Q12 = min Qi.
//!
//! (Kilosort4's code names R12 and Q12 the other way round from its paper.)

use rayon::prelude::*;

/// Bin width, seconds (1 ms).
pub const TBIN: f64 = 1.0 / 1000.0;
/// Bins on each side of zero lag (±500 ms).
pub const NBINS: usize = 500;
/// Kilosort4's `acg_threshold`: a cluster is refractory when R12 is below it (and Q12 < 0.2).
pub const ACG_THRESHOLD: f64 = 0.2;
/// Kilosort4's `ccg_threshold`: two clusters are cross-refractory when R12 is below it (and Q12 < 0.05).
pub const CCG_THRESHOLD: f64 = 0.25;

/// A cross-correlogram: counts of st2 − st1 in `2·nbins + 1` bins of `tbin`
/// seconds (bin `nbins` is zero lag), and T, the span of both trains, seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Ccg {
    /// Counts per bin (float64, as Kilosort4 holds them), length 2·nbins + 1.
    pub counts: Vec<f64>,
    /// max(last spike) − min(first spike) over both trains, seconds.
    pub span: f64,
}

/// Round half to even, as NumPy's `np.round` (and numba's) does.
fn round_half_even(x: f64) -> f64 {
    // Adding and removing 1.5·2^52 leaves the nearest integer, ties to even
    // (the default rounding of the addition), exactly, for |x| < 2^51; far
    // cheaper than a library call in the correlograms' inner loop.
    const SHIFT: f64 = 6_755_399_441_055_744.0;
    if x.abs() < 2_251_799_813_685_248.0 {
        (x + SHIFT) - SHIFT
    } else {
        x.round_ties_even()
    }
}

/// Sorted copy of a spike train (total order; times are finite).
fn sorted(st: &[f64]) -> Vec<f64> {
    let mut v = st.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// The histogram of st2 − st1 within ±nbins·tbin, Kilosort4's `compute_CCG`.
///
/// Both trains are sorted first (their order does not matter). A pair counts
/// when st2[j] − nbins·tbin < st1[k] ≤ st2[j] + nbins·tbin; its bin is
/// `round_half_even((st2[j] − st1[k]) / tbin) + nbins`. For an ACG (the same
/// train twice) each spike's pair with itself lands in the zero-lag bin.
/// Empty trains give all-zero counts and span 0 (Kilosort4 raises there).
pub fn compute_ccg(st1: &[f64], st2: &[f64], tbin: f64, nbins: usize) -> Ccg {
    let mut counts = vec![0.0f64; 2 * nbins + 1];
    if st1.is_empty() || st2.is_empty() {
        return Ccg { counts, span: 0.0 };
    }
    let st1 = sorted(st1);
    let st2 = sorted(st2);
    let dt = nbins as f64 * tbin;
    let span = st1[st1.len() - 1].max(st2[st2.len() - 1]) - st1[0].min(st2[0]);
    let (mut ilow, mut ihigh) = (0usize, 0usize);
    for &t2 in &st2 {
        while ihigh < st1.len() && st1[ihigh] <= t2 + dt {
            ihigh += 1;
        }
        while ilow < st1.len() && st1[ilow] <= t2 - dt {
            ilow += 1;
        }
        if ilow >= st1.len() {
            break;
        }
        if st1[ilow] > t2 + dt {
            continue;
        }
        for &t1 in &st1[ilow..ihigh] {
            let bin = round_half_even((t2 - t1) / tbin) as i64 + nbins as i64;
            if let Some(c) = usize::try_from(bin).ok().and_then(|b| counts.get_mut(b)) {
                *c += 1.0;
            }
        }
    }
    Ccg { counts, span }
}

/// Kilosort4's three CCG statistics (module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CcgMetrics {
    /// Refractory-window rate over baseline (Kilosort4's `R12`; × 100 is `ContamPct`).
    pub r12: f64,
    /// Poisson probability of the refractory-window count (Kilosort4's `Q12`).
    pub q12: f64,
    /// Largest baseline mean count per bin.
    pub q00: f64,
}

fn range_sum(k: &[f64], a: usize, b: usize) -> f64 {
    k[a..b].iter().sum()
}

/// Kilosort4's `CCG_metrics` on a histogram of `nbins` bins each side
/// (`ccg.counts.len() == 2·nbins + 1`, nbins ≥ 50) of trains with `n1` and
/// `n2` spikes. The arithmetic follows Kilosort4's order of operations, so the
/// result equals Kilosort4's float64 one (erf: the `libm` crate, within an ulp
/// of the C library's).
pub fn ccg_metrics(n1: usize, n2: usize, ccg: &Ccg, nbins: usize, tbin: f64) -> CcgMetrics {
    let k = &ccg.counts;
    let t = ccg.span;
    let (n1, n2) = (n1 as f64, n2 as f64);
    // Baseline ranges: [1, nbins/2) ∪ [3·nbins/2, 2·nbins), [nbins−50, nbins−10), [nbins+10, nbins+50).
    let (a1, b1, a1b, b1b) = (1, nbins / 2, 3 * nbins / 2, 2 * nbins);
    let len1 = (b1 - a1) + (b1b - a1b);
    let s1 = range_sum(k, a1, b1) + range_sum(k, a1b, b1b);
    let s2 = range_sum(k, nbins - 50, nbins - 10);
    let s3 = range_sum(k, nbins + 10, nbins + 50);
    let norm = |len: f64| len * tbin * n1 * n2 / t;
    let r00 = s1 / norm(len1 as f64);
    let r1 = s2 / norm(40.0);
    let r2 = s3 / norm(40.0);
    let r01 = r1.max(r2);
    let q00 = (s2 / 40.0).max(s3 / 40.0).max(s1 / len1 as f64);

    let mut ri_min = f64::INFINITY;
    let mut qi_min = f64::INFINITY;
    for i in 1..=10usize {
        // Zero-lag bin left out.
        let count = range_sum(k, nbins - i, nbins) + range_sum(k, nbins + 1, nbins + i + 1);
        let ri = count / ((2 * i) as f64 * tbin * n1 * n2 / t);
        let n = count / 2.0;
        let lam = q00 * i as f64;
        let p = 0.5 * (1.0 + libm::erf((n - lam) / (1e-10 + 2.0 * lam).powf(0.5)));
        ri_min = ri_min.min(ri);
        qi_min = qi_min.min(p);
    }
    CcgMetrics {
        r12: ri_min / (1e-10 + r00.max(r01)),
        q12: qi_min,
        q00,
    }
}

/// The refractoriness thresholds (Kilosort4's `acg_threshold`, `ccg_threshold`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// R12 below this (and Q12 < 0.2): refractory (ACG test). Default 0.2.
    pub acg: f64,
    /// R12 below this (and Q12 < 0.05): cross-refractory (CCG test). Default 0.25.
    pub ccg: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            acg: ACG_THRESHOLD,
            ccg: CCG_THRESHOLD,
        }
    }
}

/// What Kilosort4's `check_CCG` returns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CcgTest {
    /// R12 < acg threshold and Q12 < 0.2.
    pub is_refractory: bool,
    /// R12 < ccg threshold and Q12 < 0.05.
    pub cross_refractory: bool,
    /// The R12 statistic.
    pub r12: f64,
}

/// Kilosort4's `check_CCG`: the CCG of `st1` and `st2` (seconds; `None` = the
/// ACG of `st1`), its metrics and both tests. Kilosort4's `Q00 < 0.25`
/// alternatives are commented out in 4.1.7 and are not applied here either.
pub fn check_ccg(st1: &[f64], st2: Option<&[f64]>, thr: Thresholds) -> CcgTest {
    let st2 = st2.unwrap_or(st1);
    let ccg = compute_ccg(st1, st2, TBIN, NBINS);
    let m = ccg_metrics(st1.len(), st2.len(), &ccg, NBINS, TBIN);
    CcgTest {
        is_refractory: m.r12 < thr.acg && m.q12 < 0.2,
        cross_refractory: m.r12 < thr.ccg && m.q12 < 0.05,
        r12: m.r12,
    }
}

/// Whether two spike trains (seconds) are cross-refractory with the default
/// thresholds: the test that lets two clusters merge (Kilosort4's
/// `check_CCG(st1, st2)[1]`). Empty trains are never cross-refractory.
pub fn cross_refractory(st1_s: &[f64], st2_s: &[f64]) -> bool {
    !st1_s.is_empty()
        && !st2_s.is_empty()
        && check_ccg(st1_s, Some(st2_s), Thresholds::default()).cross_refractory
}

/// Whether one spike train (seconds) is refractory with the default
/// thresholds (Kilosort4's `check_CCG(st)[0]`, the `good` label). Empty
/// trains are not.
pub fn is_refractory(st_s: &[f64]) -> bool {
    !st_s.is_empty() && check_ccg(st_s, None, Thresholds::default()).is_refractory
}

/// Kilosort4's `refract`: for every cluster id 0 ≤ k < `n_clusters`, whether
/// its ACG is refractory, and its R12 (0 and false for clusters with ≤ 10
/// spikes or a zero span). `clu[i]` is spike i's cluster (ids outside the
/// range are ignored), `st_s[i]` its time in seconds.
///
/// Kilosort4 sizes its arrays by `max(clu) + 1`; callers pass that or the
/// number of templates (they agree whenever the last cluster has spikes).
pub fn refract(
    clu: &[i32],
    st_s: &[f64],
    n_clusters: usize,
    thr: Thresholds,
) -> (Vec<bool>, Vec<f64>) {
    let mut members: Vec<Vec<f64>> = vec![Vec::new(); n_clusters];
    for (&c, &t) in clu.iter().zip(st_s) {
        if let Some(m) = usize::try_from(c).ok().and_then(|c| members.get_mut(c)) {
            m.push(t);
        }
    }
    let res: Vec<(bool, f64)> = members
        .par_iter()
        .map(|st| {
            let (lo, hi) = st
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &t| {
                    (a.min(t), b.max(t))
                });
            if st.len() > 10 && hi - lo != 0.0 {
                let r = check_ccg(st, None, thr);
                (r.is_refractory, r.r12)
            } else {
                (false, 0.0)
            }
        })
        .collect();
    res.into_iter().unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_even() {
        assert_eq!(round_half_even(0.5), 0.0);
        assert_eq!(round_half_even(1.5), 2.0);
        assert_eq!(round_half_even(2.5), 2.0);
        assert_eq!(round_half_even(-2.5), -2.0);
        assert_eq!(round_half_even(-0.4), 0.0);
        assert_eq!(round_half_even(2.6), 3.0);
    }

    /// The same integer as the library's ties-to-even rounding for halves,
    /// near-halves, the correlograms' lag range and values past 2^51.
    #[test]
    fn half_even_is_the_library_rounding() {
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut values = vec![
            0.5,
            -0.5,
            1.5,
            4503599627370495.5,
            2f64.powi(51),
            -(2f64.powi(51)) - 1.0,
            1e300,
        ];
        for i in -1200..=1200 {
            let h = f64::from(i) / 2.0;
            values.extend([h, h.next_up(), h.next_down()]);
        }
        for _ in 0..100_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            values.push(((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 1100.0);
        }
        for v in values {
            assert_eq!(round_half_even(v), v.round_ties_even(), "{v}");
        }
    }

    /// The ACG counts each spike with itself at zero lag and each ordered pair once.
    #[test]
    fn acg_counts_pairs() {
        let st = [0.0, 0.0105, 0.1, 0.7];
        let c = compute_ccg(&st, &st, TBIN, NBINS);
        assert_eq!(c.counts[NBINS], 4.0);
        // 0.0105 s: 10.5 bins rounds to 10 (half to even); either direction.
        assert_eq!(c.counts[NBINS + 10], 1.0);
        assert_eq!(c.counts[NBINS - 10], 1.0);
        assert_eq!(c.counts.iter().sum::<f64>(), 4.0 + 2.0 * 3.0);
        assert_eq!(c.span, 0.7);
    }

    /// A perfectly periodic train with a long dead time is refractory; a
    /// dense Poisson-like train with coincidences is not.
    #[test]
    fn refractory_trains() {
        let regular: Vec<f64> = (0..2000).map(|i| i as f64 * 0.0503).collect();
        assert!(is_refractory(&regular));
        // Pseudo-random times (fixed LCG), with violations at 1 ms.
        let mut x: u64 = 12345;
        let mut st = Vec::new();
        for _ in 0..3000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            st.push((x >> 11) as f64 / (1u64 << 53) as f64 * 100.0);
        }
        assert!(!is_refractory(&st));
        let (is_ref, r12) = refract(&[0; 2000], &regular, 1, Thresholds::default());
        assert!(is_ref[0]);
        assert!(r12[0] < 0.2);
        // Too few spikes: not tested.
        let (is_ref, r12) = refract(&[0, 0, 1], &[0.0, 1.0, 2.0], 2, Thresholds::default());
        assert_eq!((is_ref, r12), (vec![false, false], vec![0.0, 0.0]));
    }

    /// Two interleaved halves of one refractory train are cross-refractory.
    #[test]
    fn interleaved_halves_cross_refractory() {
        let a: Vec<f64> = (0..1500).map(|i| i as f64 * 0.1).collect();
        let b: Vec<f64> = (0..1500).map(|i| i as f64 * 0.1 + 0.05).collect();
        assert!(cross_refractory(&a, &b));
        assert!(!cross_refractory(&a, &[]));
        // Coincidences 0.8 ms apart (the ±1-ms bins), spike for spike: not cross-refractory.
        let c: Vec<f64> = (0..1500).map(|i| i as f64 * 0.1 + 0.0008).collect();
        assert!(!cross_refractory(&a, &c));
    }
}
