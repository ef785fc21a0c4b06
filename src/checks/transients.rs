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
    let rows: Vec<RowJumps> = (0..n_rows)
        .into_par_iter()
        .map(|r| row_jumps(&values[r * stride..r * stride + n_cols]))
        .collect();
    events_of_rows(&rows, n_cols, gap)
}

/// One row's part of [`find_transients`], which needs only that row: whether
/// it has noise (it votes), and the columns `c` ≥ 1 where
/// |x[c] − x[c−1]| exceeds [`TRANSIENT_SD`] × its robust sd, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct RowJumps {
    voter: bool,
    jumps: Vec<u32>,
}

/// [`RowJumps`] of one row of samples (int16 in integers, exactly as in f32).
pub fn row_jumps<T: RawSample>(x: &[T]) -> RowJumps {
    let mut jumps = Vec::new();
    let t = match T::as_i16s(x) {
        Some(x) => {
            let t = TRANSIENT_SD * robust_sd_of_difference_i16(x);
            if t > 0.0 {
                jump_columns_i16(x, t, &mut jumps);
            }
            t
        }
        None => {
            let t = TRANSIENT_SD * robust_sd_of_difference(x);
            if t > 0.0 {
                jump_columns(x, t, &mut jumps);
            }
            t
        }
    };
    RowJumps {
        voter: t > 0.0,
        jumps,
    }
}

/// The events of [`find_transients`] from every row's [`RowJumps`] (rows of
/// `n_cols` samples): the columns where at least [`TRANSIENT_FRACTION`] of
/// the voting rows jump, joined when closer than `gap`.
pub fn events_of_rows(rows: &[RowJumps], n_cols: usize, gap: usize) -> Vec<(usize, usize)> {
    if n_cols < 2 || rows.len() < TRANSIENT_MIN_SITES {
        return Vec::new();
    }
    let voters = rows.iter().filter(|r| r.voter).count();
    if voters < TRANSIENT_MIN_SITES {
        return Vec::new();
    }
    let need = ((TRANSIENT_FRACTION * voters as f64).ceil() as u32).max(1);
    let mut count = vec![0u32; n_cols];
    for r in rows {
        for &c in &r.jumps {
            count[c as usize] += 1;
        }
    }
    join_columns((1..n_cols).filter(|&c| count[c] >= need), gap)
}

/// Columns `c` ≥ 1 checked a block at a time by [`push_jumps`]: a block
/// without a jump costs one vector pass.
const JUMP_BLOCK: usize = 64;

/// Appends to `out` every column `c` ≥ 1 of `x` where `|x[c] − x[c−1]| > t`
/// (in f32, as the values' f32 forms), in order.
fn jump_columns<T: RawSample>(x: &[T], t: f32, out: &mut Vec<u32>) {
    push_jumps(x, |a, b| (a.to_f32() - b.to_f32()).abs() > t, out);
}

/// [`jump_columns`] of an int16 row, in integers: |d| of two int16 values
/// is an exact integer (its f32 form too), so `|d| > t` (f32 `t` > 0) holds
/// exactly when `|d| > ⌊t⌋`, and never when `t` ≥ 65 535 (the largest
/// |d|). The same columns; AVX2 when the CPU has it.
fn jump_columns_i16(x: &[i16], t: f32, out: &mut Vec<u32>) {
    let limit = if t >= 65_535.0 { u16::MAX } else { t as u16 };
    let plain = |x: &[i16], out: &mut Vec<u32>| push_jumps(x, |a, b| a.abs_diff(b) > limit, out);
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2(x: &[i16], limit: u16, out: &mut Vec<u32>) {
            push_jumps(x, |a, b| a.abs_diff(b) > limit, out)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { avx2(x, limit, out) };
        }
    }
    plain(x, out)
}

/// Appends to `out` every column `c` ≥ 1 of `x` where `jumps(x[c], x[c−1])`,
/// in order, [`JUMP_BLOCK`] columns at a time: a block where none jumps
/// costs one vector pass.
#[inline(always)]
fn push_jumps<S: Copy>(x: &[S], jumps: impl Fn(S, S) -> bool, out: &mut Vec<u32>) {
    for lo in (1..x.len()).step_by(JUMP_BLOCK) {
        let hi = (lo + JUMP_BLOCK).min(x.len());
        let (cur, prev) = (&x[lo..hi], &x[lo - 1..hi - 1]);
        let any = cur
            .iter()
            .zip(prev)
            .fold(false, |acc, (&a, &b)| acc | jumps(a, b));
        if any {
            out.extend(
                (lo..hi)
                    .filter(|&c| jumps(x[c], x[c - 1]))
                    .map(|c| c as u32),
            );
        }
    }
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

/// Values below this are counted in a histogram by
/// [`robust_sd_of_difference_i16`]; larger ones are selected among.
const SMALL_DIFF: usize = 1024;

/// [`robust_sd_of_difference`] of an int16 row, in integers: |d| of two
/// int16 values is an exact u16 and its f32 form is exact, so the median of
/// the u16 values is the one the f32 path finds (every value is finite). The
/// median is found by counting the values below [`SMALL_DIFF`] (a row's
/// sample-to-sample differences nearly always are), selecting among the
/// rest only when it lies there.
fn robust_sd_of_difference_i16(x: &[i16]) -> f32 {
    let mut hist = [0u32; SMALL_DIFF];
    let mut large: Vec<u16> = Vec::new();
    let mut n = 0usize;
    for t in (1..x.len()).step_by(NOISE_STRIDE) {
        let d = x[t].abs_diff(x[t - 1]);
        match hist.get_mut(usize::from(d)) {
            Some(h) => *h += 1,
            None => large.push(d),
        }
        n += 1;
    }
    if n == 0 {
        return 0.0;
    }
    // The value of rank n / 2 (from 0) in increasing order.
    let mid = n / 2;
    let mut below = 0usize;
    for (v, &h) in hist.iter().enumerate() {
        below += h as usize;
        if below > mid {
            return v as f32 / 0.6745;
        }
    }
    let (_, m, _) = large.select_nth_unstable(mid - below);
    f32::from(*m) / 0.6745
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

    /// The definition, column by column: the rows with noise that jump past
    /// their threshold, counted per column.
    fn reference<T: RawSample>(
        x: &[T],
        (rows, cols, stride): (usize, usize, usize),
        gap: usize,
    ) -> Vec<(usize, usize)> {
        let row = |r: usize| &x[r * stride..r * stride + cols];
        let thr: Vec<f32> = (0..rows)
            .map(|r| TRANSIENT_SD * robust_sd_of_difference(row(r)))
            .collect();
        let voters = thr.iter().filter(|&&t| t > 0.0).count();
        if cols < 2 || rows < TRANSIENT_MIN_SITES || voters < TRANSIENT_MIN_SITES {
            return Vec::new();
        }
        let need = ((TRANSIENT_FRACTION * voters as f64).ceil() as u32).max(1);
        let hits = (1..cols).filter(|&c| {
            let n = (0..rows)
                .filter(|&r| {
                    thr[r] > 0.0 && (row(r)[c].to_f32() - row(r)[c - 1].to_f32()).abs() > thr[r]
                })
                .count();
            n as u32 >= need
        });
        join_columns(hits, gap)
    }

    #[test]
    fn row_by_row_counts_equal_the_definition() {
        for seed in 1..12u64 {
            let (rows, cols, stride) = (24, 5000 + 37 * seed as usize, 5100 + 37 * seed as usize);
            let mut x = vec![0f32; rows * stride];
            let base = noise(rows, cols, seed);
            for r in 0..rows {
                // Rows of different noise, one flat, jumps near the threshold.
                // Row 9's median |d| is past the int16 path's histogram.
                let scale = match r {
                    5 => 0.0,
                    9 => 100.0,
                    _ => 1.0 + (r % 7) as f32 * 3.5,
                };
                for c in 0..cols {
                    x[r * stride + c] = (base[r * cols + c] * scale).round();
                }
            }
            for (k, c0) in [(0usize, 900usize), (1, 2500), (2, 2530), (3, 4100)] {
                for r in 0..rows - 2 * k {
                    let scale = 1.0 + (r % 7) as f32 * 3.5;
                    let jump =
                        (scale * (150.0 + 60.0 * ((r + k) % 5) as f32)).round() + seed as f32;
                    x[r * stride + c0 + (r % 2)] += jump;
                }
            }
            // Large values near the int16 limits.
            x[3 * stride + 77] = 32767.0;
            x[3 * stride + 78] = -32768.0;
            let x16: Vec<i16> = x.iter().map(|&v| v as i16).collect();
            let want = reference(&x, (rows, cols, stride), 30);
            assert!(!want.is_empty(), "seed {seed}");
            assert_eq!(
                find_transients(&x, (rows, cols, stride), 30),
                want,
                "f32, seed {seed}"
            );
            assert_eq!(
                find_transients(&x16, (rows, cols, stride), 30),
                want,
                "i16, seed {seed}"
            );
            assert_eq!(
                reference(&x16, (rows, cols, stride), 30),
                want,
                "i16 reference, seed {seed}"
            );
        }
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
