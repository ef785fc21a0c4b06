//! Step 4 on the device: local peaks and their compaction, GPU twin of
//! [`crate::detect::cpu::local_peaks`].
//!
//! A unit per (centre j, sample t) with As\[j, t\] > Th_universal compares As with
//! the maximum of Amax\[j, ·\] over \[t − nt0min, t + nt0min\] clipped to the window,
//! where Amax counts as 0 in the first and last nt samples (Kilosort4's edge
//! zeroing). Every other value is ≥ 0, so the clipped −∞ padding of torch's
//! max-pool changes nothing. A detection takes a slot from an atomic counter and
//! writes (j, t) there; the host sorts them into Kilosort4's (centre, sample)
//! order. There is no fixed cap: when the counter passes the buffer's capacity
//! the host grows the buffers and runs steps 4–5 again.
//!
//! [`local_peaks_sparse_kernel`] needs no Amax: for a candidate it takes the
//! maximum over its iC2 neighbours' As rows directly (exact, since a maximum over
//! neighbours and samples can be taken in either order). Only candidates, a small
//! fraction of (j, t), pay for it.

use cubecl::prelude::*;

/// Samples per cube.
pub const TILE: usize = 256;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn local_peaks_kernel(
    as_in: &Array<f32>,
    amax: &Array<f32>,
    count: &mut Array<Atomic<u32>>,
    peak_j: &mut Array<u32>,
    peak_t: &mut Array<u32>,
    n_t: u32,
    nt: u32,
    half: u32,
    th: f32,
    cap: u32,
) {
    let j = CUBE_POS_X as usize;
    let t = CUBE_POS_Y as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let n_t = n_t as usize;
    if t < n_t {
        let v = as_in[j * n_t + t];
        if v > th {
            let half = half as usize;
            let nt = nt as usize;
            let mut lo = 0usize;
            if t > half {
                lo = t - half;
            }
            let lo = max(lo, nt);
            let hi = min(t + half + 1, n_t - nt);
            let mut m = 0.0f32;
            for tt in lo..hi {
                m = max(m, amax[j * n_t + tt]);
            }
            if v == m {
                let slot = count[0].fetch_add(1u32);
                if slot < cap {
                    peak_j[slot as usize] = j as u32;
                    peak_t[slot as usize] = t as u32;
                }
            }
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn local_peaks_sparse_kernel(
    as_in: &Array<f32>,
    neighbours: &Array<u32>,
    count: &mut Array<Atomic<u32>>,
    peak_j: &mut Array<u32>,
    peak_t: &mut Array<u32>,
    n_t: u32,
    nc2: u32,
    nt: u32,
    half: u32,
    th: f32,
    cap: u32,
) {
    let j = CUBE_POS_X as usize;
    let t = CUBE_POS_Y as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let n_t = n_t as usize;
    if t < n_t {
        let v = as_in[j * n_t + t];
        if v > th {
            let half = half as usize;
            let nt = nt as usize;
            let mut lo = 0usize;
            if t > half {
                lo = t - half;
            }
            let lo = max(lo, nt);
            let hi = min(t + half + 1, n_t - nt);
            let nc2 = nc2 as usize;
            // Own row first (iC2 starts with the centre itself): most candidates fail there.
            let mut m = 0.0f32;
            let mut n = 0usize;
            while n < nc2 && m <= v {
                let row = neighbours[j * nc2 + n] as usize * n_t;
                for tt in lo..hi {
                    m = max(m, as_in[row + tt]);
                }
                n += 1;
            }
            if v == m {
                let slot = count[0].fetch_add(1u32);
                if slot < cap {
                    peak_j[slot as usize] = j as u32;
                    peak_t[slot as usize] = t as u32;
                }
            }
        }
    }
}
