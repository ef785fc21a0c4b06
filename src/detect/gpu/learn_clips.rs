//! The template learning's clips on the device: GPU twin of
//! [`crate::detect::learn::extract_clips`] (Kilosort4's `extract_snippets`)
//! on a window already whitened there, so that only the clips come back
//! instead of the whole window (92 MB at 384 sites).
//!
//! [`peak_bits_kernel`] does the first test of
//! [`crate::detect::learn::isolated_peaks`] — |x| above `Th_single_ch` and
//! the largest |x| in its [`crate::detect::learn::PEAK_BOX`] — one unit per
//! 32 samples of a row, writing one word of bits; the host reads the bits
//! back (a 32nd of the window), lists each row's peaks in sample order and
//! runs the isolation test ([`crate::detect::learn::isolate_peaks`]) as the
//! CPU does; [`gather_clips_kernel`] then copies each kept peak's clip.
//! Comparisons only: the same peaks and clips, bit for bit, as the host's
//! on the same whitened window.

use cubecl::prelude::*;

/// Units per cube of both kernels.
pub const UNITS: u32 = 256;

/// Bit `b` of word `k` of row `c` (`bits[c·words + k]`) is set when sample
/// `32·k + b` of row `c` of `x` (`n_rows` × `n_t`, row-major) is a peak: its
/// |x| is above `th` and no |x| in rows `c ± pr`, samples `t ± pt` (clipped
/// to the window) is larger. NaN is never a peak, and a NaN in the box
/// stops one (an unordered comparison is false), as on the host.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn peak_bits_kernel(
    x: &Array<f32>,
    bits: &mut Array<u32>,
    n_rows: u32,
    n_t: u32,
    words: u32,
    th: f32,
    pr: u32,
    pt: u32,
) {
    let w = ABSOLUTE_POS;
    let n_rows = n_rows as usize;
    let n_t = n_t as usize;
    let words = words as usize;
    if w < n_rows * words {
        let c = w / words;
        let k = w % words;
        let pr = pr as usize;
        let pt = pt as usize;
        let mut r0 = 0usize;
        if c > pr {
            r0 = c - pr;
        }
        let r1 = min(c + pr, n_rows - 1);
        let mut out = 0u32;
        for b in 0..32u32 {
            let t = k * 32 + b as usize;
            if t < n_t {
                let a = f32::abs(x[c * n_t + t]);
                if a > th {
                    let mut s0 = 0usize;
                    if t > pt {
                        s0 = t - pt;
                    }
                    let s1 = min(t + pt, n_t - 1);
                    let mut is_max = true;
                    for r in r0..r1 + 1 {
                        for s in s0..s1 + 1 {
                            let v = f32::abs(x[r * n_t + s]);
                            // Written so that NaN (unordered) also fails.
                            if v <= a {
                            } else {
                                is_max = false;
                            }
                        }
                    }
                    if is_max {
                        out |= 1u32 << b;
                    }
                }
            }
        }
        bits[w] = out;
    }
}

/// `out[i·nt + j] = x[starts[i] + j]` for the `n_clips` clips of `nt`
/// samples (`starts[i]`: the clip's first sample's index in `x`).
#[cube(launch_unchecked)]
pub(crate) fn gather_clips_kernel(
    x: &Array<f32>,
    starts: &Array<u32>,
    out: &mut Array<f32>,
    n_clips: u32,
    nt: u32,
) {
    let i = ABSOLUTE_POS;
    let nt = nt as usize;
    if i < n_clips as usize * nt {
        let k = i / nt;
        let j = i % nt;
        out[i] = x[starts[k] as usize + j];
    }
}

/// Each row's peaks, in sample order, from [`peak_bits_kernel`]'s words
/// (`words` per row).
pub fn peaks_from_bits(bits: &[u32], n_rows: usize, words: usize) -> Vec<Vec<usize>> {
    (0..n_rows)
        .map(|c| {
            let mut out = Vec::new();
            for (k, &word) in bits[c * words..(c + 1) * words].iter().enumerate() {
                let mut m = word;
                while m != 0 {
                    let b = m.trailing_zeros() as usize;
                    out.push(k * 32 + b);
                    m &= m - 1;
                }
            }
            out
        })
        .collect()
}
