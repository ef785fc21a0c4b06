//! Channel-mean removal and median common average reference (Kilosort4
//! `io.BinaryFiltered.filter`, steps 1–3 of the preprocessing spec, section 4).

use ndarray::Array2;
use rayon::prelude::*;

use crate::error::PreprocessError;

/// Columns gathered at once when taking the median across channels: a block of
/// `MEDIAN_BLOCK × channels` floats stays in the L2 cache.
const MEDIAN_BLOCK: usize = 64;

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
        || vec![0u32; MEDIAN_BLOCK * c],
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

/// Maps an f32 to a u32 whose unsigned order is `f32::total_cmp`'s order.
#[inline]
fn sort_key(v: f32) -> u32 {
    let b = v.to_bits();
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

/// Inverse of [`sort_key`].
#[inline]
fn from_sort_key(k: u32) -> f32 {
    f32::from_bits(if k >> 31 == 1 { k & 0x7FFF_FFFF } else { !k })
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
    // otherwise within f64 rounding of a sequential sum).
    let mut lanes = [0.0f64; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += f64::from(v);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    let sum = lanes.iter().sum::<f64>() + tail;
    (sum / row.len() as f64) as f32
}

/// Columns per parallel job of [`mean_and_median_in_blocks`].
const CAR_JOB: usize = 16 * MEDIAN_BLOCK;

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
        CAR_SCRATCH.with_borrow_mut(|buf| {
            buf.resize(MEDIAN_BLOCK * c, 0);
            let mut med = [0f32; MEDIAN_BLOCK];
            let len = rows.first().map_or(0, |r| r.len());
            let mut c0 = 0;
            while c0 < len {
                let w = MEDIAN_BLOCK.min(len - c0);
                for (r, (row, &mean)) in rows.iter_mut().zip(means).enumerate() {
                    for (t, v) in row[c0..c0 + w].iter_mut().enumerate() {
                        *v -= mean;
                        buf[t * c + r] = sort_key(*v);
                    }
                }
                for (t, o) in med.iter_mut().take(w).enumerate() {
                    let col = &mut buf[t * c..(t + 1) * c];
                    let (_, m, _) = col.select_nth_unstable(k);
                    *o = from_sort_key(*m);
                }
                for row in rows.iter_mut() {
                    for (v, m) in row[c0..c0 + w].iter_mut().zip(&med[..w]) {
                        *v -= *m;
                    }
                }
                c0 += w;
            }
        })
    });
}

thread_local! {
    /// A block's sort keys, per thread (every value written before it is read).
    static CAR_SCRATCH: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
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

    #[test]
    fn empty_window_is_an_error() {
        let x = Array2::<f32>::zeros((0, 5));
        assert!(channel_medians(&x).is_err());
    }
}
