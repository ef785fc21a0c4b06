//! Channel-mean removal and median common average reference (Kilosort4
//! `io.BinaryFiltered.filter`, steps 1–3 of the preprocessing spec, section 4).

use ndarray::Array2;
use rayon::prelude::*;

use crate::error::PreprocessError;

/// Columns gathered at once when taking the median across channels: a block of
/// `MEDIAN_BLOCK × channels` floats stays in the L2 cache.
const MEDIAN_BLOCK: usize = 32;

/// Makes `window` a standard (row-major, contiguous) array, copying only when needed.
pub(crate) fn ensure_standard(window: &mut Array2<f32>) {
    if !window.is_standard_layout() {
        *window = window.as_standard_layout().into_owned();
    }
}

/// Multiplies every sample by −1 (Kilosort4's `invert_sign`, applied right after
/// the chanMap rows are taken).
///
/// `window`: (sites × samples) f32, any layout. Never fails.
pub fn invert_sign(window: &mut Array2<f32>) {
    window.mapv_inplace(|v| -v);
}

/// Subtracts from each channel (row) its mean over all columns of the window,
/// pads included (Kilosort4: `X - X.mean(1)`).
///
/// `window`: (sites × N) f32 counts. The mean is summed in f64 and rounded once
/// to f32, which is what Kilosort's float32 mean gives whenever its sum is
/// exact (integer data, sums below 2²⁴) and the best possible value otherwise.
/// The subtraction itself is in f32, as in Kilosort. An empty window is left as is.
pub fn remove_channel_means(window: &mut Array2<f32>) {
    ensure_standard(window);
    let n = window.ncols();
    if n == 0 {
        return;
    }
    let data = window
        .as_slice_mut()
        .expect("standard layout was just ensured");
    data.par_chunks_mut(n).for_each(|row| {
        let mean = row_mean(row);
        for v in row.iter_mut() {
            *v -= mean;
        }
    });
}

/// The per-column median across channels, as torch's `median(X, 0)` takes it:
/// for C channels the sorted value at index ⌊(C − 1)/2⌋ (the LOWER middle value
/// for even C, with no averaging).
///
/// `window`: (C × N) f32. Returns N values. Fails with
/// [`PreprocessError::Shape`] when the window has no rows. NaN sorts above every
/// number (the order of `f32::total_cmp`).
pub fn channel_medians(window: &Array2<f32>) -> Result<Vec<f32>, PreprocessError> {
    let (c, n) = window.dim();
    if c == 0 {
        return Err(PreprocessError::Shape {
            what: "window for the median CAR",
            rows: c,
            cols: n,
            expected_rows: 1,
            expected_cols: n,
        });
    }
    let std_view;
    let data = match window.as_slice() {
        Some(s) => s,
        None => {
            std_view = window.as_standard_layout().into_owned();
            // The owned copy lives as long as this function.
            std_view.as_slice().expect("standard layout")
        }
    };
    let k = (c - 1) / 2;
    let mut med = vec![0.0f32; n];
    med.par_chunks_mut(MEDIAN_BLOCK).enumerate().for_each_init(
        || vec![0i32; MEDIAN_BLOCK * c],
        |buf, (b, out)| {
            let c0 = b * MEDIAN_BLOCK;
            let w = out.len();
            // Transpose the block so each column's C values are contiguous,
            // as order-preserving integer keys (cheaper to compare).
            for r in 0..c {
                let src = &data[r * n + c0..r * n + c0 + w];
                for (t, &v) in src.iter().enumerate() {
                    buf[t * c + r] = sort_key(v);
                }
            }
            for (t, o) in out.iter_mut().enumerate() {
                let col = &mut buf[t * c..(t + 1) * c];
                let (_, m, _) = col.select_nth_unstable(k);
                *o = from_sort_key(*m);
            }
        },
    );
    Ok(med)
}

/// Maps an f32 to an i32 whose order is `f32::total_cmp`'s order (its own
/// trick: a negative number's 31 lower bits are flipped).
#[inline]
fn sort_key(v: f32) -> i32 {
    let b = v.to_bits() as i32;
    b ^ (((b >> 31) as u32) >> 1) as i32
}

/// Inverse of [`sort_key`].
#[inline]
fn from_sort_key(k: i32) -> f32 {
    f32::from_bits((k ^ (((k >> 31) as u32) >> 1) as i32) as u32)
}

/// Median common average reference: at every column, subtracts the lower
/// median across channels ([`channel_medians`]) in f32 (Kilosort4:
/// `X - torch.median(X, 0)[0]`, applied after [`remove_channel_means`]).
///
/// `window`: (C × N) f32. Fails with [`PreprocessError::Shape`] when it has no rows.
pub fn subtract_channel_median(window: &mut Array2<f32>) -> Result<(), PreprocessError> {
    ensure_standard(window);
    let med = channel_medians(window)?;
    let n = window.ncols();
    if n == 0 {
        return Ok(());
    }
    let data = window
        .as_slice_mut()
        .expect("standard layout was just ensured");
    data.par_chunks_mut(n).for_each(|row| {
        for (v, m) in row.iter_mut().zip(&med) {
            *v -= *m;
        }
    });
    Ok(())
}

/// Kilosort4's CAR stage: [`remove_channel_means`], then, if `do_car`,
/// [`subtract_channel_median`]. The result equals Kilosort's
/// `padded_batch_to_torch(i, skip_preproc=True)` for the same raw window.
///
/// `window`: (C × N) f32 counts, rows in chanMap order. Errors as
/// [`subtract_channel_median`].
pub fn common_reference(window: &mut Array2<f32>, do_car: bool) -> Result<(), PreprocessError> {
    if !do_car {
        remove_channel_means(window);
        return Ok(());
    }
    ensure_standard(window);
    let (c, n) = window.dim();
    if c == 0 {
        return Err(PreprocessError::Shape {
            what: "window for the median CAR",
            rows: c,
            cols: n,
            expected_rows: 1,
            expected_cols: n,
        });
    }
    if n == 0 {
        return Ok(());
    }
    let data = window
        .as_slice_mut()
        .expect("standard layout was just ensured");
    let means: Vec<f32> = data.par_chunks(n).map(row_mean).collect();
    mean_and_median_in_blocks(data, c, n, &means);
    Ok(())
}

/// One row's mean as [`remove_channel_means`] takes it.
fn row_mean(row: &[f32]) -> f32 {
    // Eight independent f64 partial sums (exact for integer data, and
    // otherwise within f64 rounding of a sequential sum). The device's
    // `row_means_float_f64_kernel` repeats this order.
    let mut lanes = [0.0f64; ROW_MEAN_LANES];
    let mut chunks = row.chunks_exact(ROW_MEAN_LANES);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += f64::from(v);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    let sum = lanes.iter().sum::<f64>() + tail;
    (sum / row.len() as f64) as f32
}

/// Partial sums of a channel mean: lane l adds the samples t ≡ l (mod 8) of
/// the whole chunks of 8, in order; then the lanes in order, then the samples
/// past the last whole chunk, summed in order.
pub(crate) const ROW_MEAN_LANES: usize = 8;

/// Columns per parallel job of [`mean_and_median_in_blocks`].
const CAR_JOB: usize = 512;

/// [`remove_channel_means`] then [`subtract_channel_median`] in one pass over
/// the (C × N) row-major `data`, block of [`MEDIAN_BLOCK`] columns by block:
/// each block's values x − mean are gathered, their lower median per column
/// taken, and (x − mean) − median written back while the block is in cache.
/// The same f32 operations on the same values as the two steps, so the same
/// bits.
fn mean_and_median_in_blocks(data: &mut [f32], c: usize, n: usize, means: &[f32]) {
    let k = (c - 1) / 2;
    // Per job, its columns of every row.
    let n_jobs = n.div_ceil(CAR_JOB);
    let mut jobs: Vec<Vec<&mut [f32]>> = (0..n_jobs).map(|_| Vec::with_capacity(c)).collect();
    for row in data.chunks_mut(n) {
        for (job, piece) in jobs.iter_mut().zip(row.chunks_mut(CAR_JOB)) {
            job.push(piece);
        }
    }
    jobs.into_par_iter().for_each(|mut rows| {
        CAR_SCRATCH.with_borrow_mut(|(buf, small)| {
            buf.resize(MEDIAN_BLOCK * c, 0);
            small.resize(c, 0);
            car_job(&mut rows, means, k, buf, small);
        })
    });
}

/// One job of [`mean_and_median_in_blocks`]: `rows` are its columns of every
/// row; `buf` holds [`MEDIAN_BLOCK`] × C keys, `small` C. Compiled for AVX2
/// too and chosen at run time (integer compares and the same f32
/// subtractions: the same bits).
fn car_job(rows: &mut [&mut [f32]], means: &[f32], k: usize, buf: &mut [i32], small: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn car_job_avx2(
        rows: &mut [&mut [f32]],
        means: &[f32],
        k: usize,
        buf: &mut [i32],
        small: &mut [i32],
    ) {
        car_job_impl(rows, means, k, buf, small)
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        unsafe { car_job_avx2(rows, means, k, buf, small) };
        return;
    }
    car_job_impl(rows, means, k, buf, small)
}

#[inline(always)]
fn car_job_impl(
    rows: &mut [&mut [f32]],
    means: &[f32],
    k: usize,
    buf: &mut [i32],
    small: &mut [i32],
) {
    let c = rows.len();
    let mut guess = MedianGuess::default();
    let mut med = [0f32; MEDIAN_BLOCK];
    let len = rows.first().map_or(0, |r| r.len());
    let mut c0 = 0;
    while c0 < len {
        let w = MEDIAN_BLOCK.min(len - c0);
        // The next block's cache lines of every row, asked for now: C rows
        // are too many separate streams for the hardware prefetcher.
        if c0 + w < len {
            for row in rows.iter() {
                crate::prefetch::prefetch(&row[c0 + w..(c0 + 2 * w).min(len)]);
            }
        }
        for (r, (row, &mean)) in rows.iter_mut().zip(means).enumerate() {
            for (t, v) in row[c0..c0 + w].iter_mut().enumerate() {
                *v -= mean;
                buf[t * c + r] = sort_key(*v);
            }
        }
        for (t, o) in med.iter_mut().take(w).enumerate() {
            let col = &mut buf[t * c..(t + 1) * c];
            *o = from_sort_key(guess.select(col, k, small));
        }
        for row in rows.iter_mut() {
            for (v, m) in row[c0..c0 + w].iter_mut().zip(&med[..w]) {
                *v -= *m;
            }
        }
        c0 += w;
    }
}

thread_local! {
    /// A block's sort keys and [`MedianGuess::select`]'s scratch, per thread
    /// (every value written before it is read).
    static CAR_SCRATCH: std::cell::RefCell<(Vec<i32>, Vec<i32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// The k-th smallest sort key of a column, found faster by guessing where it
/// lies from the previous column's: the column's median moves little from
/// one sample to the next. The result never depends on the guess (a wrong
/// one costs a full selection), so it is exactly `select_nth_unstable`'s.
#[derive(Debug, Clone, Copy)]
struct MedianGuess {
    /// The previous column's median.
    centre: f32,
    /// Half-width of the value interval tried around it, adapted so that
    /// about [`GUESS_TARGET`] values fall inside.
    half: f32,
}

/// Values wanted inside [`MedianGuess`]'s interval: few enough for a quick
/// selection among them, enough that the median usually stays inside.
const GUESS_TARGET: (usize, usize) = (8, 48);

impl Default for MedianGuess {
    fn default() -> Self {
        MedianGuess {
            centre: 0.0,
            half: 1.0,
        }
    }
}

impl MedianGuess {
    /// The k-th smallest of `col` (k < `col.len()`); `small` is scratch of
    /// at least `col.len()` keys. `col` may be reordered.
    ///
    /// With an interval [lo, hi] of keys: if `below` keys are under lo and
    /// `inside` lie in it, and below ≤ k < below + inside, the answer is the
    /// (k − below)-th smallest of those inside. The interval starts around the
    /// last median; when the answer lies outside, the next interval is the
    /// stretch just beyond it on that side (twice as wide), a few times, and
    /// then the whole column is searched.
    #[inline(always)]
    fn select(&mut self, col: &mut [i32], k: usize, small: &mut [i32]) -> i32 {
        let mut lo = sort_key(self.centre - self.half);
        let mut hi = sort_key(self.centre + self.half);
        let mut half = self.half;
        for attempt in 0..4 {
            let (below, inside) = count_keys(col, lo, hi);
            if below <= k && k < below + inside {
                let mut n = 0;
                let width = hi.wrapping_sub(lo) as u32;
                for &v in col.iter() {
                    small[n] = v;
                    n += usize::from(v.wrapping_sub(lo) as u32 <= width);
                }
                let (_, m, _) = small[..n].select_nth_unstable(k - below);
                if attempt == 0 && inside > GUESS_TARGET.1 {
                    self.half *= 0.75;
                } else if attempt == 0 && inside < GUESS_TARGET.0 {
                    self.half *= 1.5;
                } else if attempt > 0 {
                    self.half *= 1.25;
                }
                return self.found(*m);
            }
            half *= 2.0;
            if k < below {
                // Every key at or below hi' = lo − 1 is under the old lo.
                if lo == i32::MIN {
                    break;
                }
                hi = lo - 1;
                lo = sort_key(from_sort_key(hi) - half).min(hi);
            } else {
                if hi == i32::MAX {
                    break;
                }
                lo = hi + 1;
                hi = sort_key(from_sort_key(lo) + half).max(lo);
            }
        }
        self.half *= 2.0;
        let (_, m, _) = col.select_nth_unstable(k);
        self.found(*m)
    }

    /// Records the median found and returns it.
    #[inline(always)]
    fn found(&mut self, key: i32) -> i32 {
        let value = from_sort_key(key);
        self.centre = if value.is_finite() { value } else { 0.0 };
        if !(self.half > 1e-30 && self.half < 1e30) {
            self.half = 1.0;
        }
        key
    }
}

/// How many of `col` are below `lo`, and how many lie in [lo, hi].
#[inline(always)]
fn count_keys(col: &[i32], lo: i32, hi: i32) -> (usize, usize) {
    let (mut below, mut inside) = (0u32, 0u32);
    for &v in col {
        below += u32::from(v < lo);
        inside += u32::from((v >= lo) & (v <= hi));
    }
    (below as usize, inside as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    #[test]
    fn lower_median_for_even_count() {
        // torch.median([1, 4, 2, 3]) is 2 (numpy would say 2.5).
        let x = array![[1.0f32], [4.0], [2.0], [3.0]];
        assert_eq!(channel_medians(&x).unwrap(), vec![2.0]);
        let y = array![[3.0f32, 0.0], [1.0, 5.0], [2.0, -1.0]];
        assert_eq!(channel_medians(&y).unwrap(), vec![2.0, 0.0]);
    }

    #[test]
    fn non_standard_layout_is_handled() {
        let x = array![[1.0f32, 10.0], [4.0, 40.0], [2.0, 20.0], [3.0, 30.0]];
        use ndarray::ShapeBuilder;
        let mut xt = Array2::<f32>::zeros((4, 2).f());
        xt.assign(&x);
        assert!(!xt.is_standard_layout());
        assert_eq!(channel_medians(&xt).unwrap(), vec![2.0, 20.0]);
        let mut w = xt.clone();
        common_reference(&mut w, true).unwrap();
        let mut w2 = x.clone();
        common_reference(&mut w2, true).unwrap();
        assert_eq!(w, w2);
    }

    #[test]
    fn sort_keys_keep_order() {
        let v = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in v.windows(2) {
            assert!(sort_key(w[0]) < sort_key(w[1]), "{} {}", w[0], w[1]);
        }
        for x in v {
            assert_eq!(from_sort_key(sort_key(x)).to_bits(), x.to_bits());
        }
    }

    /// The one-pass CAR equals its two steps bit for bit: odd and even channel
    /// counts, lengths that are not multiples of the blocks, ties, ±0 and
    /// non-integer values.
    #[test]
    fn blocked_car_equals_the_two_steps() {
        let mut state = 7u64;
        for (c, n) in [
            (1usize, 5usize),
            (2, 70),
            (5, 1000),
            (32, CAR_JOB + 77),
            (384, 3 * MEDIAN_BLOCK + 5),
        ] {
            let x = Array2::from_shape_fn((c, n), |(r, t)| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = ((state >> 40) % 200) as f32 - 100.0;
                match (r + t) % 7 {
                    0 => v * 0.37,
                    1 => -0.0,
                    _ => v + r as f32,
                }
            });
            let mut fused = x.clone();
            common_reference(&mut fused, true).unwrap();
            let mut steps = x.clone();
            remove_channel_means(&mut steps);
            subtract_channel_median(&mut steps).unwrap();
            let bits = |a: &Array2<f32>| a.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fused), bits(&steps), "{c} × {n}");
        }
    }

    /// The guessed selection returns select_nth_unstable's key whatever the
    /// columns: slow drifts, jumps, constant columns, ties, ±0, ±∞, NaN,
    /// odd and even counts.
    #[test]
    fn guessed_median_equals_full_selection() {
        let mut state = 3u64;
        let mut rnd = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        for c in [1usize, 2, 3, 10, 383, 384] {
            let mut guess = MedianGuess::default();
            let mut small = vec![0i32; c];
            let k = (c - 1) / 2;
            for t in 0..600 {
                let scale = match t / 100 {
                    0 => 1.0,
                    1 => 1e4,
                    2 => 1e-6,
                    _ => 30.0,
                };
                let offset = (t as f32 * 0.37).sin() * 50.0 + if t % 97 == 0 { 1e5 } else { 0.0 };
                let col: Vec<f32> = (0..c)
                    .map(|_| {
                        let r = rnd();
                        match (t / 50 % 6, r % 64) {
                            (5, _) => 7.0,
                            (_, 0) => f32::NAN,
                            (_, 1) => f32::INFINITY,
                            (_, 2) => f32::NEG_INFINITY,
                            (_, 3) => -0.0,
                            (_, 4) => 0.0,
                            (4, _) => (r % 5) as f32,
                            _ => offset + scale * ((r % 20001) as f32 / 10000.0 - 1.0),
                        }
                    })
                    .collect();
                let mut keys: Vec<i32> = col.iter().map(|&v| sort_key(v)).collect();
                let mut full = keys.clone();
                let want = *full.select_nth_unstable(k).1;
                assert_eq!(guess.select(&mut keys, k, &mut small), want, "c {c}, t {t}");
            }
        }
    }

    #[test]
    fn empty_window_is_an_error() {
        let x = Array2::<f32>::zeros((0, 5));
        assert!(channel_medians(&x).is_err());
    }
}
