//! Transients common to most channels at once (stimulus and light
//! artifacts): a light edge, an electrical stimulus or a reward solenoid
//! moves every site within a sample or two, by different amounts on each, so
//! the median reference removes only part of it and the rest is detected
//! as spikes locked to the stimulus. Kilosort4 has no such check.
//!
//! The check runs on each raw window as read (int16 or f32, before any
//! filtering, so that every back end sees the same answer): per row the first
//! difference `d[t] = x[t] − x[t−1]` (which removes the DC offset and the
//! LFP) and its robust sd (median |d| / 0.6745 over every
//! [`NOISE_STRIDE`]-th sample); per column, how many rows have
//! |d| > [`TRANSIENT_SD`] × their own sd. A column where at least
//! [`TRANSIENT_FRACTION`] of the rows with noise do is part of a transient;
//! such columns less than `gap` apart form one event. A spike moves a few
//! neighbouring sites, never half of a probe's; probes with fewer than
//! [`TRANSIENT_MIN_SITES`] sites with noise are not checked.

use rayon::prelude::*;

use super::RawSample;

/// A row's |first difference| must exceed this multiple of its robust sd.
pub const TRANSIENT_SD: f32 = 10.0;

/// Fraction of the rows with noise that must exceed it in one column.
pub const TRANSIENT_FRACTION: f64 = 0.5;

/// Probes with fewer sites with noise are not checked (on a tetrode one
/// large spike moves half of the sites).
pub const TRANSIENT_MIN_SITES: usize = 8;

/// Every how many samples of a row enter its noise estimate.
pub const NOISE_STRIDE: usize = 16;

/// Columns per parallel piece of the column counts.
const PIECE: usize = 4096;

/// Samples within which transient columns join one event: 1 ms at `fs`
/// (at least 1).
pub fn transient_gap(fs: f64) -> usize {
    ((fs * 1e-3).round() as usize).max(1)
}

/// The transients of one raw window: `n_rows` rows of `n_cols` samples at
/// `values[r·stride ..]` (rows in channel-map order, as read). Returns each
/// event as a column range `[start, end)` (its first and one past its last
/// transient column), in order; empty when fewer than
/// [`TRANSIENT_MIN_SITES`] rows have noise. Same answer for int16 values and
/// their f32 conversion, for any thread count (integer counts per column).
pub fn find_transients<T: RawSample>(
    values: &[T],
    (n_rows, n_cols, stride): (usize, usize, usize),
    gap: usize,
) -> Vec<(usize, usize)> {
    if n_cols < 2 || n_rows < TRANSIENT_MIN_SITES {
        return Vec::new();
    }
    let row = |r: usize| &values[r * stride..r * stride + n_cols];
    // Per row: the threshold on |d| (0: no noise, the row does not vote).
    let thr: Vec<f32> = (0..n_rows)
        .into_par_iter()
        .map(|r| TRANSIENT_SD * robust_sd_of_difference(row(r)))
        .collect();
    let voters = thr.iter().filter(|&&t| t > 0.0).count();
    if voters < TRANSIENT_MIN_SITES {
        return Vec::new();
    }
    let need = ((TRANSIENT_FRACTION * voters as f64).ceil() as u32).max(1);
    let pieces: Vec<Vec<usize>> = (0..n_cols.div_ceil(PIECE))
        .into_par_iter()
        .map(|p| {
            let (lo, hi) = ((p * PIECE).max(1), ((p + 1) * PIECE).min(n_cols));
            let mut count = vec![0u32; hi.saturating_sub(lo)];
            for (r, &t) in thr.iter().enumerate() {
                if t <= 0.0 {
                    continue;
                }
                let x = row(r);
                let (cur, prev) = (&x[lo..hi], &x[lo - 1..hi - 1]);
                for ((c, &a), &b) in count.iter_mut().zip(cur).zip(prev) {
                    *c += u32::from((a.to_f32() - b.to_f32()).abs() > t);
                }
            }
            (0..count.len())
                .filter(|&k| count[k] >= need)
                .map(|k| lo + k)
                .collect()
        })
        .collect();
    join_columns(pieces.into_iter().flatten(), gap)
}

/// Robust sd of a row's first difference: median |d| / 0.6745 over every
/// [`NOISE_STRIDE`]-th sample; 0 for a row without noise (flat, or NaN).
fn robust_sd_of_difference<T: RawSample>(x: &[T]) -> f32 {
    let mut d: Vec<f32> = (1..x.len())
        .step_by(NOISE_STRIDE)
        .map(|t| (x[t].to_f32() - x[t - 1].to_f32()).abs())
        .filter(|v| v.is_finite())
        .collect();
    if d.is_empty() {
        return 0.0;
    }
    let mid = d.len() / 2;
    let (_, m, _) = d.select_nth_unstable_by(mid, f32::total_cmp);
    *m / 0.6745
}

/// Joins increasing columns closer than `gap` into `[start, end)` ranges.
fn join_columns(cols: impl Iterator<Item = usize>, gap: usize) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for c in cols {
        match out.last_mut() {
            Some(last) if c < last.1 + gap => last.1 = c + 1,
            _ => out.push((c, c + 1)),
        }
    }
    out
}

/// The absolute samples (`first_sample` + column) of the transients that
/// start in the window's own samples (columns `nt .. nt + own_len`): each
/// event is counted by one window, the one whose own samples hold its start.
pub fn own_events(
    events: &[(usize, usize)],
    first_sample: i64,
    nt: usize,
    own_len: usize,
) -> Vec<i64> {
    events
        .iter()
        .filter(|&&(a, _)| a >= nt && a < nt + own_len)
        .map(|&(a, _)| first_sample + a as i64)
        .collect()
}

/// The warning about transients common to most channels: their count and the
/// first few times (seconds), and what to do; `None` when there are none.
/// `blanked`: whether the run blanked around them (`--blank-transients`).
pub fn transients_warning(times_s: &[f64], n_sites: usize, blanked: bool) -> Option<String> {
    if times_s.is_empty() {
        return None;
    }
    let first: Vec<String> = times_s.iter().take(5).map(|t| format!("{t:.4}")).collect();
    let more = if times_s.len() > 5 { ", …" } else { "" };
    let what = if blanked {
        "the preprocessed data around each were set to zero (--blank-transients true, over --artifact-window)"
    } else {
        "what is left of them after the median reference is detected as spikes locked to the stimulus; --blank-transients true (or --artifact-times FILE with the stimulus times) zeroes the preprocessed data around each, over --artifact-window"
    };
    Some(format!(
        "{} transient(s) common to most of the {n_sites} channels at once (more than {TRANSIENT_FRACTION} of them jump by over {TRANSIENT_SD}× their sample-to-sample sd), e.g. light or stimulus artifacts, at {}{more} s: {what}",
        times_s.len(),
        first.join(", "),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) % 41) as f32 - 20.0
            })
            .collect()
    }

    #[test]
    fn a_step_on_most_rows_is_one_event() {
        let (rows, cols) = (16, 9000);
        let mut x = noise(rows, cols, 3);
        for r in 0..rows - 3 {
            for t in 5000..cols {
                x[r * cols + t] += 500.0 + 40.0 * r as f32;
            }
        }
        // A spike-like jump on two rows is not an event.
        for r in 0..2 {
            x[r * cols + 2000] += 900.0;
        }
        let ev = find_transients(&x, (rows, cols, cols), 30);
        assert_eq!(ev, vec![(5000, 5001)]);
        let x16: Vec<i16> = x.iter().map(|&v| v as i16).collect();
        assert_eq!(find_transients(&x16, (rows, cols, cols), 30), ev);
        assert_eq!(own_events(&ev, 100, 61, 8000), vec![5100]);
        assert!(own_events(&ev, 100, 61, 4000).is_empty());
    }

    #[test]
    fn few_sites_or_flat_rows_are_not_checked() {
        let (rows, cols) = (6, 3000);
        let mut x = noise(rows, cols, 5);
        for r in 0..rows {
            x[r * cols + 1000] += 800.0;
        }
        assert!(find_transients(&x, (rows, cols, cols), 30).is_empty());
        let flat = vec![3.0f32; 12 * cols];
        assert!(find_transients(&flat, (12, cols, cols), 30).is_empty());
    }

    #[test]
    fn nearby_columns_join() {
        let j = join_columns([3, 4, 10, 50, 51].into_iter(), 30);
        assert_eq!(j, vec![(3, 11), (50, 52)]);
    }

    #[test]
    fn warning_names_count_times_and_flag() {
        assert!(transients_warning(&[], 32, false).is_none());
        let w = transients_warning(&[0.5, 1.25, 2.0, 3.0, 4.0, 5.0], 32, false).unwrap();
        assert!(w.starts_with("6 transient(s)"), "{w}");
        assert!(w.contains("0.5000, 1.2500") && w.contains("…"), "{w}");
        assert!(w.contains("--blank-transients true"), "{w}");
    }
}
