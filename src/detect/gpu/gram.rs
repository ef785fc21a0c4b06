//! The whitening fit's product on the device: the Gram matrix `X·Xᵀ` of a
//! preprocessed window's central columns (Kilosort4's `get_whitening_matrix`:
//! the covariance is the mean of `X·Xᵀ/NT` over every `nskip`-th window,
//! after channel means, median CAR and the high-pass).
//!
//! The CPU twin is [`crate::preprocess::whitening_covariance`]. On devices
//! with doubles [`gram_f64_kernel`] sums as the CPU does (f64, in its
//! 512-sample blocks) and gives its bits. Without doubles [`gram_kernel`]
//! sums each entry in f32 over runs of [`GRAM_RUN`] samples, adds those run
//! sums in f32 per part of the window, and the host adds the parts in f64: a
//! different order, so entries agree within float32 rounding, not bit for bit
//! (tests/gpu.rs states the tolerance).

use cubecl::prelude::*;

/// Rows (and columns) of one cube's output tile.
pub const GRAM_TILE: usize = 32;
/// Samples per run: the tile's rows are staged in shared memory this many
/// samples at a time, and each run's products are summed apart.
pub const GRAM_RUN: usize = 32;
/// Units per cube: 16 × 16, each computing 2 × 2 entries of the tile.
pub const GRAM_UNITS: usize = 256;

/// Stages GRAM_TILE rows × GRAM_RUN samples from `s0` of the row blocks `bx`
/// and `by` of `q` (C × N) into `sa` and `sb` (rows `GRAM_RUN + 1` apart),
/// zeros past `end` or past the last row; unit `u` of [`GRAM_UNITS`].
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_run(
    q: &Array<f32>,
    sa: &mut SharedMemory<f32>,
    sb: &mut SharedMemory<f32>,
    bx: usize,
    by: usize,
    c: usize,
    n_t: usize,
    s0: usize,
    end: usize,
    u: usize,
) {
    let stride = comptime!(GRAM_RUN + 1);
    let mut i = u;
    while i < comptime!(GRAM_TILE * GRAM_RUN) {
        let r = i / GRAM_RUN;
        let k = i % GRAM_RUN;
        let t = s0 + k;
        let ra = bx * GRAM_TILE + r;
        let rb = by * GRAM_TILE + r;
        let mut va = 0.0f32;
        let mut vb = 0.0f32;
        if t < end {
            if ra < c {
                va = q[ra * n_t + t];
            }
            if rb < c {
                vb = q[rb * n_t + t];
            }
        }
        sa[r * stride + k] = va;
        sb[r * stride + k] = vb;
        i += GRAM_UNITS;
    }
}

/// Writes one unit's 2 × 2 entries (rows r0, r0 + 1; columns c0, c0 + 1)
/// into `out[base + row·C + col]`, leaving out those past the last row or
/// column.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_quad<F: Float>(
    out: &mut Array<F>,
    base: usize,
    c: usize,
    r0: usize,
    c0: usize,
    t00: F,
    t01: F,
    t10: F,
    t11: F,
) {
    if r0 < c {
        if c0 < c {
            out[base + r0 * c + c0] = t00;
        }
        if c0 + 1 < c {
            out[base + r0 * c + c0 + 1] = t01;
        }
    }
    if r0 + 1 < c {
        if c0 < c {
            out[base + (r0 + 1) * c + c0] = t10;
        }
        if c0 + 1 < c {
            out[base + (r0 + 1) * c + c0 + 1] = t11;
        }
    }
}

/// Partial Gram matrices of rows of `q` (C × N, row-major) over samples
/// `lo .. hi`, split into `CUBE_COUNT_Z` parts: cube (bx, by, z) writes the
/// 32 × 32 tile of rows `bx·32 ..` and columns `by·32 ..` (only tiles with
/// by ≤ bx: the lower triangle and the diagonal) of part z into
/// `out[z·C·C + row·C + col]`.
#[cube(launch_unchecked)]
pub(crate) fn gram_kernel(
    q: &Array<f32>,
    out: &mut Array<f32>,
    n_rows: u32,
    n_t: u32,
    lo: u32,
    hi: u32,
) {
    let stride = comptime!(GRAM_RUN + 1);
    let mut sa = SharedMemory::<f32>::new(comptime!(GRAM_TILE * (GRAM_RUN + 1)));
    let mut sb = SharedMemory::<f32>::new(comptime!(GRAM_TILE * (GRAM_RUN + 1)));
    let bx = CUBE_POS_X as usize;
    let by = CUBE_POS_Y as usize;
    let z = CUBE_POS_Z as usize;
    let parts = CUBE_COUNT_Z as usize;
    let c = n_rows as usize;
    let n_t = n_t as usize;
    let u = UNIT_POS_X as usize;
    // Uniform over the cube: the whole cube leaves (no sync is skipped by part of it).
    if by <= bx {
        let len = (hi - lo) as usize;
        let start = lo as usize + z * len / parts;
        let end = lo as usize + (z + 1) * len / parts;
        let ua = (u / 16) * 2;
        let ub = (u % 16) * 2;
        let mut t00 = 0.0f32;
        let mut t01 = 0.0f32;
        let mut t10 = 0.0f32;
        let mut t11 = 0.0f32;
        let mut s0 = start;
        while s0 < end {
            stage_run(q, &mut sa, &mut sb, bx, by, c, n_t, s0, end, u);
            sync_cube();
            let mut p00 = 0.0f32;
            let mut p01 = 0.0f32;
            let mut p10 = 0.0f32;
            let mut p11 = 0.0f32;
            #[unroll]
            for k in 0..GRAM_RUN {
                let a0 = sa[ua * stride + k];
                let a1 = sa[(ua + 1) * stride + k];
                let b0 = sb[ub * stride + k];
                let b1 = sb[(ub + 1) * stride + k];
                p00 += a0 * b0;
                p01 += a0 * b1;
                p10 += a1 * b0;
                p11 += a1 * b1;
            }
            t00 += p00;
            t01 += p01;
            t10 += p10;
            t11 += p11;
            sync_cube();
            s0 += GRAM_RUN;
        }
        write_quad(
            out,
            z * c * c,
            c,
            bx * GRAM_TILE + ua,
            by * GRAM_TILE + ub,
            t00,
            t01,
            t10,
            t11,
        );
    }
}

/// Columns of one summation block of [`gram_f64_kernel`]: the CPU's
/// (`preprocess::covariance::KC`, faer's depth block), which it must equal
/// for the CPU's bits.
pub const GRAM_BLOCK: usize = crate::preprocess::COVARIANCE_BLOCK;

/// The Gram matrix of rows of `q` (C × N, row-major) over samples `lo .. hi`
/// with the bits of the CPU's [`covariance::gram`](crate::preprocess::covariance):
/// in f64, each entry a chain `s ← s + q_i·q_j` from s = 0 over one block of
/// [`GRAM_BLOCK`] consecutive samples (blocks from `lo`), the blocks' sums then
/// added in order from 0. A product of two f32 values is exact in f64, so
/// whether the device fuses it into the add does not matter. Cube (bx, by)
/// writes the 32 × 32 tile of rows `bx·32 ..` and columns `by·32 ..` (by ≤ bx)
/// into `out[row·C + col]`.
#[cube(launch_unchecked)]
// Kernel code: `is_multiple_of` has no CubeCL expansion.
#[allow(clippy::manual_is_multiple_of)]
pub(crate) fn gram_f64_kernel(
    q: &Array<f32>,
    out: &mut Array<f64>,
    n_rows: u32,
    n_t: u32,
    lo: u32,
    hi: u32,
) {
    let stride = comptime!(GRAM_RUN + 1);
    let mut sa = SharedMemory::<f32>::new(comptime!(GRAM_TILE * (GRAM_RUN + 1)));
    let mut sb = SharedMemory::<f32>::new(comptime!(GRAM_TILE * (GRAM_RUN + 1)));
    let bx = CUBE_POS_X as usize;
    let by = CUBE_POS_Y as usize;
    let c = n_rows as usize;
    let n_t = n_t as usize;
    let u = UNIT_POS_X as usize;
    // Uniform over the cube: the whole cube leaves (no sync is skipped by part of it).
    if by <= bx {
        let start = lo as usize;
        let end = hi as usize;
        let ua = (u / 16) * 2;
        let ub = (u % 16) * 2;
        let mut t00 = 0.0f64;
        let mut t01 = 0.0f64;
        let mut t10 = 0.0f64;
        let mut t11 = 0.0f64;
        let mut p00 = 0.0f64;
        let mut p01 = 0.0f64;
        let mut p10 = 0.0f64;
        let mut p11 = 0.0f64;
        let mut s0 = start;
        while s0 < end {
            stage_run(q, &mut sa, &mut sb, bx, by, c, n_t, s0, end, u);
            sync_cube();
            // Samples past `end` are staged as 0: adding their +0 products
            // changes no sum of the block (s + 0 = s, and an all-zero sum is +0
            // either way).
            #[unroll]
            for k in 0..GRAM_RUN {
                let a0 = f64::cast_from(sa[ua * stride + k]);
                let a1 = f64::cast_from(sa[(ua + 1) * stride + k]);
                let b0 = f64::cast_from(sb[ub * stride + k]);
                let b1 = f64::cast_from(sb[(ub + 1) * stride + k]);
                p00 += a0 * b0;
                p01 += a0 * b1;
                p10 += a1 * b0;
                p11 += a1 * b1;
            }
            sync_cube();
            s0 += GRAM_RUN;
            // A block ends every GRAM_BLOCK samples from `lo`, and at `end`.
            if (s0 - start) % GRAM_BLOCK == 0 || s0 >= end {
                t00 += p00;
                t01 += p01;
                t10 += p10;
                t11 += p11;
                p00 = 0.0f64;
                p01 = 0.0f64;
                p10 = 0.0f64;
                p11 = 0.0f64;
            }
        }
        write_quad(
            out,
            0,
            c,
            bx * GRAM_TILE + ua,
            by * GRAM_TILE + ub,
            t00,
            t01,
            t10,
            t11,
        );
    }
}
