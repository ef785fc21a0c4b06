//! The window term `X·Xᵀ` of Kilosort4's whitening covariance, computed fast
//! with exactly the bits of the plain product.
//!
//! The plain product ([`gram_reference`]) hands faer one f64 copy of 4096
//! columns at a time (`matmul`, `Accum::Add`). On x86-64 with AVX2 + FMA or
//! AVX-512, faer passes such a product to its `private-gemm-x86` kernels, and
//! those compute every entry the same way, whatever the tile that holds it,
//! the thread count or the matrix size: the depth is cut into blocks of
//! [`KC`] = 512 columns from the start of the call; within a block the entry
//! is a chain of fused multiply-adds `s ← fma(x_ik, x_jk, s)` from `s = 0` in
//! column order (one accumulator per entry: the SIMD kernels never split the
//! depth), and the block's `s` is then added to the entry (`acc ← acc + s`).
//! 4096 being a multiple of 512, the blocks of a window are the 512-column
//! blocks from its first column, and the window's term of entry (i, j) is
//! `(…((0 + s₁) + s₂) + …) + s_B`.
//!
//! [`gram_fast`] computes exactly that, differently arranged: each block's
//! `s_b` on its own (a `Par::Seq` faer product of that block, lower triangle
//! only: the same kernels, half the work), blocks in parallel, then adds them
//! to the running sum in block order. `fma(a, b, s) = fma(b, a, s)`, so the
//! upper triangle is the lower one mirrored. Nothing depends on the thread
//! count. Where faer would take another route for a chunk (fewer than 2
//! channels, a chunk of one column, `C²·w ≤ 16³`, no FMA), the plain product
//! is used. `tests` below and `tests/preprocessing.rs` check the bits.

use faer::linalg::matmul::matmul;
use faer::linalg::matmul::triangular::{self, BlockStructure};
use faer::{Accum, Mat, MatMut, MatRef, Par};
use ndarray::ArrayView2;
use rayon::prelude::*;

/// Depth block of faer's x86-64 kernels (`private-gemm-x86`: `kc = min(depth, 512)`).
pub(crate) const KC: usize = 512;

/// Columns converted to f64 at a time by [`gram_reference`] (a multiple of [`KC`]).
pub(crate) const COV_CHUNK: usize = 4096;

/// Products at most this large (`C·C·w`) go to faer's small-matrix code
/// (`nano-gemm`), whose order is not [`KC`]-blocked.
const NANO_GEMM_THRESHOLD: usize = 16 * 16 * 16;

/// Whether faer's x86-64 kernels run here (its own test: AVX-512F, or AVX2 and FMA).
fn x86_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            || (std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether [`gram_fast`] gives the bits of [`gram_reference`] for a (C × T)
/// window: every 4096-column chunk of the plain product goes to faer's x86-64
/// kernels (C ≥ 2 so it is no matrix–vector product, a chunk of ≥ 2 columns
/// so it is no rank-1 update, `C²·w` above the small-matrix threshold; the
/// last chunk is the smallest).
pub(crate) fn fast_applies(c: usize, t: usize) -> bool {
    if c < 2 || t == 0 || !x86_kernels() {
        return false;
    }
    let last = match t % COV_CHUNK {
        0 => COV_CHUNK,
        r => r,
    };
    last >= 2 && c * c * last > NANO_GEMM_THRESHOLD
}

/// Converts columns `k0 .. k0 + w` of the C `rows` to f64, column-major
/// (`x[k·C + i]`, sample k's C values contiguous).
fn to_f64_columns(rows: &[&[f32]], k0: usize, w: usize, x: &mut [f64]) {
    let c = rows.len();
    for (i, row) in rows.iter().enumerate() {
        for (k, &v) in row[k0..k0 + w].iter().enumerate() {
            x[k * c + i] = f64::from(v);
        }
    }
}

/// The plain window term (the simple form, kept as the oracle): `acc` (C × C, column-major, `acc[k·C + i]`) ← `X·Xᵀ` of a (C × T)
/// f32 block, with one faer product per 4096 columns converted to f64
/// (`Accum::Add` from zeros, all threads).
pub(crate) fn gram_reference(block: ArrayView2<'_, f32>, acc: &mut Vec<f64>) {
    let (c, t) = block.dim();
    acc.clear();
    acc.resize(c * c, 0.0);
    if t == 0 {
        return;
    }
    let mut accm = Mat::<f64>::zeros(c, c);
    // The chunk in f64, column-major (sample k's C values contiguous), filled
    // in parallel by tiles of columns.
    let mut x = vec![0f64; c * COV_CHUNK.min(t)];
    let block = block.as_standard_layout();
    let rows: &[f32] = block.as_slice().expect("standard layout");
    const TILE: usize = 64;
    let mut start = 0;
    while start < t {
        let w = COV_CHUNK.min(t - start);
        let xs = &mut x[..c * w];
        xs.par_chunks_mut(c * TILE)
            .enumerate()
            .for_each(|(j, cols)| {
                let k0 = start + j * TILE;
                let n_cols = cols.len() / c;
                for i in 0..c {
                    let src = &rows[i * t + k0..i * t + k0 + n_cols];
                    for (k, &v) in src.iter().enumerate() {
                        cols[k * c + i] = f64::from(v);
                    }
                }
            });
        let xm = MatRef::from_column_major_slice(xs, c, w);
        matmul(
            accm.as_mut(),
            Accum::Add,
            xm,
            xm.transpose(),
            1.0,
            Par::rayon(0),
        );
        start += w;
    }
    for k in 0..c {
        for i in 0..c {
            acc[k * c + i] = accm[(i, k)];
        }
    }
}

/// Reusable buffers of [`gram_fast`]: one C × C partial sum per block of a round.
#[derive(Debug, Default)]
pub(crate) struct GramScratch {
    partials: Vec<Vec<f64>>,
}

/// [`gram_reference`]'s result, the same bits, when [`fast_applies`]`(C, T)`:
/// per 512-column block the lower triangle of `X_b·X_bᵀ` (faer, `Par::Seq`,
/// `Accum::Replace`), blocks in parallel, added to `acc` in block order; then
/// the upper triangle mirrored from the lower. `rows`: C rows of T samples.
pub(crate) fn gram_fast(rows: &[&[f32]], t: usize, acc: &mut Vec<f64>, scratch: &mut GramScratch) {
    let c = rows.len();
    acc.clear();
    acc.resize(c * c, 0.0);
    if t == 0 || c == 0 {
        return;
    }
    let n_blocks = t.div_ceil(KC);
    // Blocks per round: enough to keep every thread busy (C²·8 bytes each).
    let group = (2 * rayon::current_num_threads()).clamp(1, n_blocks);
    scratch.partials.resize_with(group, Vec::new);
    for p in &mut scratch.partials {
        p.resize(c * c, 0.0);
    }
    let mut b0 = 0;
    while b0 < n_blocks {
        let nb = group.min(n_blocks - b0);
        scratch.partials[..nb]
            .par_iter_mut()
            .enumerate()
            .for_each(|(q, part)| {
                BLOCK_F64.with_borrow_mut(|x| {
                    let k0 = (b0 + q) * KC;
                    let w = KC.min(t - k0);
                    x.resize(c * KC, 0.0);
                    to_f64_columns(rows, k0, w, &mut x[..c * w]);
                    let xm = MatRef::from_column_major_slice(&x[..c * w], c, w);
                    let dst = MatMut::from_column_major_slice_mut(&mut part[..], c, c);
                    triangular::matmul(
                        dst,
                        BlockStructure::TriangularLower,
                        Accum::Replace,
                        xm,
                        BlockStructure::Rectangular,
                        xm.transpose(),
                        BlockStructure::Rectangular,
                        1.0,
                        Par::Seq,
                    );
                })
            });
        // acc(i, j) += s_b(i, j) for i ≥ j, blocks in order; columns in parallel.
        let parts = &scratch.partials[..nb];
        acc.par_chunks_mut(c).enumerate().for_each(|(j, col)| {
            for part in parts {
                let src = &part[j * c + j..(j + 1) * c];
                for (a, s) in col[j..].iter_mut().zip(src) {
                    *a += *s;
                }
            }
        });
        b0 += nb;
    }
    for j in 0..c {
        for i in 0..j {
            acc[j * c + i] = acc[i * c + j];
        }
    }
}

thread_local! {
    /// A block's f64 columns, per thread (every value read is written first).
    static BLOCK_F64: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `acc` (C × C, column-major) ← `X·Xᵀ` of a (C × T) f32 block:
/// [`gram_fast`] when it gives the plain product's bits ([`fast_applies`]),
/// else [`gram_reference`].
pub(crate) fn gram(block: ArrayView2<'_, f32>, acc: &mut Vec<f64>, scratch: &mut GramScratch) {
    let (c, t) = block.dim();
    if fast_applies(c, t) {
        let rows: Option<Vec<&[f32]>> = block.outer_iter().map(|r| r.to_slice()).collect();
        match rows {
            Some(rows) => gram_fast(&rows, t, acc, scratch),
            None => {
                let block = block.as_standard_layout();
                let rows: Vec<&[f32]> = block
                    .rows()
                    .into_iter()
                    .map(|r| r.to_slice().expect("standard layout"))
                    .collect();
                gram_fast(&rows, t, acc, scratch);
            }
        }
        return;
    }
    gram_reference(block, acc);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    fn noise(c: usize, t: usize, seed: u64) -> Array2<f32> {
        let mut s = seed;
        Array2::from_shape_fn((c, t), |(i, _)| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            // Mixed scales and signs; some exact zeros and −0.
            match s % 97 {
                0 => 0.0,
                1 => -0.0,
                _ => u * 300.0 * (1.0 + (i % 5) as f32) + 3.0,
            }
        })
    }

    fn bits(m: &[f64]) -> Vec<u64> {
        m.iter().map(|v| v.to_bits()).collect()
    }

    /// The fast product equals the plain one bit for bit (when it applies),
    /// for odd channel counts, tiles cut at the matrix edge, lengths that are
    /// not multiples of 512 or 4096, with 1, 2 and 3 threads.
    #[test]
    fn fast_gram_equals_plain_gram_bit_for_bit() {
        let shapes = [
            (2usize, 3000usize),
            (3, 700),
            (7, 4097 + 511),
            (17, 513),
            (33, 1025),
            (47, 4096 * 2 + 2),
            (48, 999),
            (49, 5000),
            (64, 512),
            (97, 4096 + 3),
            (130, 2000),
            (384, 4096 + 700),
        ];
        for (n, &(c, t)) in shapes.iter().enumerate() {
            let x = noise(c, t, 11 + n as u64);
            let mut plain = Vec::new();
            gram_reference(x.view(), &mut plain);
            assert_eq!(
                fast_applies(c, t),
                x86_kernels(),
                "{c} × {t}: the fast form should apply"
            );
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut fast = Vec::new();
                let mut scratch = GramScratch::default();
                pool.install(|| gram(x.view(), &mut fast, &mut scratch));
                assert_eq!(bits(&fast), bits(&plain), "{c} × {t}, {threads} threads");
                // The plain product itself does not depend on the thread count.
                let mut plain_t = Vec::new();
                pool.install(|| gram_reference(x.view(), &mut plain_t));
                assert_eq!(
                    bits(&plain_t),
                    bits(&plain),
                    "plain, {c} × {t}, {threads} threads"
                );
            }
        }
    }

    #[test]
    fn small_or_odd_shapes_use_the_plain_product() {
        assert!(!fast_applies(1, 60_000));
        assert!(!fast_applies(384, 0));
        // A last chunk of one column would be a rank-1 update in faer.
        assert!(!fast_applies(384, 4097));
        // 4 × 4 × 200 is faer's small-matrix code.
        assert!(!fast_applies(4, 200));
        // A sliced (non-contiguous) block is handled too.
        let x = noise(40, 3000, 5);
        let xt = x.t().to_owned();
        let v = xt.t();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        gram(v, &mut a, &mut GramScratch::default());
        gram_reference(x.view(), &mut b);
        assert_eq!(bits(&a), bits(&b));
    }
}
