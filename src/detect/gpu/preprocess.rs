//! Kilosort4's preprocessing on the device, GPU twin of
//! [`crate::preprocess::Preprocessor::apply`]: channel means, median CAR,
//! high-pass, whitening, from the raw window as read (int16 values packed two
//! per 32-bit word, or float32) into the detector's whitened window X.
//!
//! | step | CPU twin | kernel |
//! |---|---|---|
//! | channel means | [`crate::preprocess::remove_channel_means`] | [`row_means_kernel`] |
//! | mean removal, median CAR | [`crate::preprocess::subtract_channel_median`] | [`car_kernel`] |
//! | high-pass | [`crate::preprocess::HighpassFilter`] | [`super::highpass_iir`] (f64 devices) or [`highpass_kernel`] |
//! | whitening | [`crate::preprocess::Whitening`] | [`whiten_kernel`] |
//!
//! Numerics against the CPU:
//! * means: int16 data are summed exactly (integers, in two 32-bit integer
//!   parts), then divided in f64 as the CPU does ([`row_means_kernel`]);
//!   float32 data on a device with f64 in the CPU's order of f64 sums
//!   ([`row_means_float_f64_kernel`]): the CPU's bits. Without f64, in f32
//!   (int16 sums divided in f32, float32 values added in a tree): within a
//!   few f32 ulps of the mean, a constant per channel that the high-pass removes;
//! * median: the same lower median (rank ⌊(C − 1)/2⌋, Kilosort4's torch median),
//!   picked by counting ranks, so bit-identical for identical inputs;
//! * high-pass: where the device has f64 arithmetic and the window is long
//!   enough (N ≥ 1447 at 300 Hz / 30 kHz), the same operator as a circular
//!   forward–backward IIR with f64 state ([`super::highpass_iir`]; within 8.4e-7
//!   of max|x| of the CPU, measured on its twin); else the CPU's circular
//!   correlation `y[t] = Σ_o h[o]·x[(t + o) mod N]` computed directly over the
//!   taps whose magnitude is above [`crate::preprocess::DEVICE_TAP_FLOOR`] of the
//!   peak (the CPU uses FFTs over the taps above 1e-13 of the peak); the error is
//!   bounded by the dropped taps' sum times the input's magnitude (measured in
//!   `tests/gpu.rs` and docs/benchmarks-history.md);
//! * whitening: the CPU's sparse product with the same terms in the same order.
//!
//! Kilosort4's artifact check (`artifact_threshold`) has no device version: a run
//! that sets it preprocesses on the host.

use cubecl::prelude::*;

use super::exact::product;

/// Units per cube of every preprocessing kernel.
pub const UNITS: usize = 256;
/// Consecutive outputs per unit of the high-pass kernel, by default
/// ([`super::GpuOptions::hp_per_unit`]): 16 outputs from 32 values held in
/// registers, so that each tap read from shared memory serves 16 products.
pub const HP_PER_UNIT: usize = 16;
/// Floats of shared memory for one CAR tile's values (12 KiB), and at most
/// as many again for its sorting slots: within every device's limit.
pub const CAR_SHARED: usize = 3072;

/// Most sites the device CAR takes (their sorting slots fit [`CAR_SHARED`]).
pub const CAR_MAX_SITES: usize = 2048;

/// The CAR kernel's tile: (samples per cube, sorting slots per sample) for C
/// sites — slots the power of two ≥ C, samples a power of two (at most 64,
/// at least one) with both the values and the slots within [`CAR_SHARED`]
/// floats.
pub fn car_tile(c: usize) -> (usize, usize) {
    let m = c.max(2).next_power_of_two();
    let mut cols = 64usize;
    while cols > 1 && (c * cols > CAR_SHARED || cols * m > CAR_SHARED) {
        cols /= 2;
    }
    (cols, m)
}

/// Sample `t` of row `r` of a packed raw window as an integer: sample 2w in the
/// low half of word w, 2w + 1 in the high half.
#[cube]
// Kernel code: `is_multiple_of` has no CubeCL expansion.
#[allow(clippy::manual_is_multiple_of)]
fn packed_int16(raw: &Array<u32>, r: usize, t: usize, words: usize) -> i32 {
    let w = raw[r * words + t / 2];
    let half = if t % 2 == 0 { w << 16u32 } else { w };
    // Arithmetic shift of the high half: the sign-extended int16.
    i32::cast_from(half) >> 16i32
}

/// Sample `t` of row `r` of the raw window: int16 pairs (`packed`, see
/// [`packed_int16`]) or float32 bits.
#[cube]
fn raw_value(raw: &Array<u32>, r: usize, t: usize, words: usize, #[comptime] packed: bool) -> f32 {
    if comptime!(packed) {
        f32::cast_from(packed_int16(raw, r, t, words))
    } else {
        f32::from_bits(raw[r * words + t])
    }
}

/// Channel means: one cube per row. Packed int16 values are summed exactly as
/// integers (high and low bytes apart, so no 32-bit overflow below 2²³ samples);
/// float32 values in f32 (per unit, then a tree). With `f64_mean` an integer
/// sum is divided in f64 and rounded to f32, as the CPU takes the mean (its f64
/// sum of integers is exact too), so the means have the CPU's bits; without,
/// in f32 (a sum above 2²⁴ is then rounded first).
#[cube(launch_unchecked)]
pub(crate) fn row_means_kernel(
    raw: &Array<u32>,
    means: &mut Array<f32>,
    n_t: u32,
    words: u32,
    #[comptime] packed: bool,
    #[comptime] f64_mean: bool,
) {
    let mut hi = SharedMemory::<i32>::new(UNITS);
    let mut lo = SharedMemory::<i32>::new(UNITS);
    let mut fs = SharedMemory::<f32>::new(UNITS);
    let r = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let n_t = n_t as usize;
    let words = words as usize;
    let mut h = 0i32;
    let mut l = 0i32;
    let mut f = 0.0f32;
    let mut t = u;
    while t < n_t {
        if comptime!(packed) {
            let v = packed_int16(raw, r, t, words);
            h += v >> 8i32;
            l += v & 255i32;
        } else {
            f += f32::from_bits(raw[r * words + t]);
        }
        t += UNITS;
    }
    hi[u] = h;
    lo[u] = l;
    fs[u] = f;
    sync_cube();
    // A runtime value (the cube has UNITS units): a constant cannot be halved in place.
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if u < stride {
            hi[u] = hi[u] + hi[u + stride];
            lo[u] = lo[u] + lo[u + stride];
            fs[u] = fs[u] + fs[u + stride];
        }
        sync_cube();
        stride /= 2;
    }
    if u == 0 {
        if comptime!(packed) {
            if comptime!(f64_mean) {
                // Both terms and the sum are exact in f64 (|sum| < 2⁵³).
                let sum = f64::cast_from(hi[0]) * 256.0f64 + f64::cast_from(lo[0]);
                means[r] = f32::cast_from(sum / f64::cast_from(n_t as u32));
            } else {
                let sum = f32::cast_from(hi[0]) * 256.0f32 + f32::cast_from(lo[0]);
                means[r] = sum / f32::cast_from(n_t as u32);
            }
        } else {
            means[r] = fs[0] / f32::cast_from(n_t as u32);
        }
    }
}

/// Channel means of float32 windows on a device with f64, in the CPU's
/// order ([`crate::preprocess::remove_channel_means`]): units 0‥7 each add,
/// from +0, the samples t ≡ u (mod 8) of the whole chunks of 8 in f64; unit
/// 8 the samples past them; unit 0 then adds the lanes in order, the tail
/// last (when there is one), and rounds the f64 mean to f32. Every f64 sum
/// is the CPU's, so the means have its bits. One cube per row.
#[cube(launch_unchecked)]
pub(crate) fn row_means_float_f64_kernel(
    raw: &Array<u32>,
    means: &mut Array<f32>,
    n_t: u32,
    words: u32,
) {
    let lanes_n = comptime!(crate::preprocess::ROW_MEAN_LANES);
    let mut lanes = SharedMemory::<f64>::new(comptime!(crate::preprocess::ROW_MEAN_LANES + 1));
    let r = CUBE_POS_X as usize;
    let u = UNIT_POS_X as usize;
    let n_t = n_t as usize;
    let base = r * words as usize;
    let whole = n_t / lanes_n * lanes_n;
    if u < lanes_n {
        let mut s = 0.0f64;
        let mut t = u;
        while t < whole {
            s += f64::cast_from(f32::from_bits(raw[base + t]));
            t += lanes_n;
        }
        lanes[u] = s;
    } else if u == lanes_n && whole < n_t {
        // The CPU's tail starts from −0, which leaves its first value as it is.
        let mut s = f64::cast_from(f32::from_bits(raw[base + whole]));
        let mut t = whole + 1;
        while t < n_t {
            s += f64::cast_from(f32::from_bits(raw[base + t]));
            t += 1;
        }
        lanes[lanes_n] = s;
    }
    sync_cube();
    if u == 0 {
        let mut sum = lanes[0];
        for l in 1..lanes_n {
            sum += lanes[l];
        }
        // An empty tail adds −0 on the CPU: nothing.
        if whole < n_t {
            sum += lanes[lanes_n];
        }
        means[r] = f32::cast_from(sum / f64::cast_from(n_t as u32));
    }
}

/// Mean removal and median CAR: one cube per `cols` consecutive samples of every
/// row, held in shared memory. With `do_car`, each column's C values are copied
/// into a second shared array of `m` slots per column (`m`, a power of two ≥ C;
/// the slots past C hold the largest float) and sorted there by a bitonic
/// network (all columns at once, `log₂m·(log₂m + 1)/2` compare-exchange steps);
/// slot ⌊(C − 1)/2⌋ is then the column's lower median (Kilosort4's torch
/// median; a sorted order is unique up to equal values, so the value is the
/// CPU's). Writes X\[r, t\] = (raw − mean\[r\]) − median\[t\] (no median when
/// `do_car` is false).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn car_kernel(
    raw: &Array<u32>,
    means: &Array<f32>,
    x: &mut Array<f32>,
    n_rows: u32,
    n_t: u32,
    words: u32,
    #[comptime] cols: usize,
    #[comptime] m: usize,
    #[comptime] packed: bool,
    #[comptime] do_car: bool,
) {
    let mut sh = SharedMemory::<f32>::new(CAR_SHARED);
    let mut srt = SharedMemory::<f32>::new(comptime!(cols * m));
    let c = n_rows as usize;
    let n_t = n_t as usize;
    let words = words as usize;
    let t0 = CUBE_POS_X as usize * cols;
    let u = UNIT_POS_X as usize;
    let total = c * cols;
    let mut i = u;
    while i < total {
        let r = i / cols;
        let k = i % cols;
        let t = t0 + k;
        let mut v = 0.0f32;
        if t < n_t {
            v = raw_value(raw, r, t, words, packed) - means[r];
        }
        sh[i] = v;
        i += UNITS;
    }
    sync_cube();
    let want = (c - 1) / 2;
    if comptime!(do_car) {
        let slots = comptime!(cols * m);
        let mut i = u;
        while i < slots {
            let k = i / m;
            let r = i % m;
            let mut v = 3.402_823_5e38f32;
            if r < c {
                v = sh[r * cols + k];
            }
            srt[i] = v;
            i += UNITS;
        }
        sync_cube();
        let half = comptime!(m / 2);
        let pairs = comptime!(cols * m / 2);
        let mut size = 2usize;
        while size <= m {
            let mut j = size / 2;
            while j > 0 {
                let mut p = u;
                while p < pairs {
                    let col = p / half;
                    let q = p % half;
                    // The lower slot of pair q at distance j, and its partner.
                    let lo = 2 * q - (q & (j - 1));
                    let ia = col * m + lo;
                    let ib = ia + j;
                    let a = srt[ia];
                    let b = srt[ib];
                    let ascending = (lo & size) == 0;
                    if (a > b) == ascending {
                        srt[ia] = b;
                        srt[ib] = a;
                    }
                    p += UNITS;
                }
                sync_cube();
                j /= 2;
            }
            size *= 2;
        }
    }
    let mut i = u;
    while i < total {
        let r = i / cols;
        let k = i % cols;
        let t = t0 + k;
        if t < n_t {
            if comptime!(do_car) {
                x[r * n_t + t] = sh[i] - srt[k * m + want];
            } else {
                x[r * n_t + t] = sh[i];
            }
        }
        i += UNITS;
    }
}

/// The high-pass as a direct circular correlation over `k` taps (a multiple of
/// `per` ([`HP_PER_UNIT`] by default), zero-padded):
/// y\[r, t\] = Σ_{q<k} h\[q\]·x\[r, (t + first + q) mod N\], summed in q order.
/// One cube per row and [`UNITS`]·`per` outputs, its stretch of the row (with k
/// samples of wrap-around context) and the taps in shared memory; each unit
/// computes `per` consecutive outputs from a window of row values
/// held in registers, so each value read from shared memory serves
/// `per` products. Shared memory is padded by one word every 32 so
/// that units reading [`HP_PER_UNIT`] words apart hit different banks.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn highpass_kernel(
    x: &Array<f32>,
    taps: &Array<f32>,
    y: &mut Array<f32>,
    n_t: u32,
    first: u32,
    k: u32,
    #[comptime] max_taps: usize,
    #[comptime] per: usize,
) {
    let tile = comptime!(UNITS * per);
    let span = comptime!(UNITS * per + max_taps);
    let padded = comptime!(span + span / 32 + 1);
    let mut xs = SharedMemory::<f32>::new(padded);
    let mut hs = SharedMemory::<f32>::new(max_taps);
    let r = CUBE_POS_Y as usize;
    let t0 = CUBE_POS_X as usize * tile;
    let u = UNIT_POS_X as usize;
    let n = n_t as usize;
    let k = k as usize;
    let mut i = u;
    while i < k {
        hs[i] = taps[i];
        i += UNITS;
    }
    let len = tile + k;
    let mut s = u;
    while s < len {
        // Index (t0 + s + first) mod N with `first` already reduced mod N on the
        // host: unsigned arithmetic only (a signed remainder of a negative
        // number was measured wrong on one Vulkan driver).
        let p = (t0 + s + first as usize) % n;
        xs[s + s / 32] = x[r * n + p];
        s += UNITS;
    }
    sync_cube();
    let base = u * per;
    let mut w = Array::<f32>::new(comptime!(2 * per));
    let mut acc = Array::<f32>::new(per);
    #[unroll]
    for a in 0..per {
        let idx = base + a;
        w[a] = xs[idx + idx / 32];
        acc[a] = 0.0f32;
    }
    let mut q0 = 0usize;
    while q0 < k {
        #[unroll]
        for a in 0..per {
            let idx = base + q0 + per + a;
            w[per + a] = xs[idx + idx / 32];
        }
        #[unroll]
        for qq in 0..per {
            let h = hs[q0 + qq];
            #[unroll]
            for a in 0..per {
                acc[a] += h * w[a + qq];
            }
        }
        #[unroll]
        for a in 0..per {
            w[a] = w[per + a];
        }
        q0 += per;
    }
    #[unroll]
    for a in 0..per {
        let t = t0 + base + a;
        if t < n_t as usize {
            y[r * n_t as usize + t] = acc[a];
        }
    }
}

/// Whitening X\[j, t\] = Σ W\[j, m\]·Y\[m, t\] over row j's non-zeros (CSR:
/// `start`, `cols`, `vals`), four terms at a time as the CPU adds them.
/// One cube per row and [`UNITS`] samples; with `rows_first` the cubes'
/// first axis is the row (launch with [`whiten_cubes`]), so that cubes
/// running together read the same samples of neighbouring rows (a local
/// whitening's rows share most of their non-zero columns) while they are in
/// the cache; else the first axis is the samples. The same sums either way.
#[cube(launch_unchecked)]
pub(crate) fn whiten_kernel(
    y: &Array<f32>,
    start: &Array<u32>,
    cols: &Array<u32>,
    vals: &Array<f32>,
    x: &mut Array<f32>,
    n_t: u32,
    nz: f32,
    #[comptime] rows_first: bool,
) {
    let mut j = CUBE_POS_Y as usize;
    let mut tile = CUBE_POS_X as usize;
    if rows_first {
        j = CUBE_POS_X as usize;
        tile = CUBE_POS_Y as usize;
    }
    let t = tile * UNITS + UNIT_POS_X as usize;
    let n_t = n_t as usize;
    if t < n_t {
        let a = start[j] as usize;
        let b = start[j + 1] as usize;
        let quads = (b - a) / 4;
        let mut acc = 0.0f32;
        for qd in 0..quads {
            let o = a + qd * 4;
            let s0 = product::<f32>(vals[o], y[cols[o] as usize * n_t + t], nz);
            let s1 = product::<f32>(vals[o + 1], y[cols[o + 1] as usize * n_t + t], nz);
            let s2 = product::<f32>(vals[o + 2], y[cols[o + 2] as usize * n_t + t], nz);
            let s3 = product::<f32>(vals[o + 3], y[cols[o + 3] as usize * n_t + t], nz);
            acc += (s0 + s1) + (s2 + s3);
        }
        for o in a + quads * 4..b {
            acc += product::<f32>(vals[o], y[cols[o] as usize * n_t + t], nz);
        }
        x[j * n_t + t] = acc;
    }
}

/// The cube count of [`whiten_kernel`] for `c` rows of `n_t` samples.
pub(crate) fn whiten_cubes(c: usize, n_t: usize, rows_first: bool) -> CubeCount {
    let tiles = n_t.div_ceil(UNITS) as u32;
    if rows_first {
        CubeCount::Static(c as u32, tiles, 1)
    } else {
        CubeCount::Static(tiles, c as u32, 1)
    }
}
