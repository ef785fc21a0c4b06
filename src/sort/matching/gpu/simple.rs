//! The first forms of the wPCA filter and of the best-template scans: one
//! unit per sample walking every tap or every template. Kept as the
//! reference the register-tiled and template-sliced kernels of
//! [`super::kernels`] are checked against on a device, and selectable with
//! `SPIKECUBE_MATCH_KERNELS=simple` (a diagnostic).

use cubecl::prelude::*;

use super::kernels::{S_BASE, S_ROUND, UNITS};
use crate::detect::gpu::exact::product;

/// F\[(slot·npc + p)·n + t\] = Σ_i X\[site, t − nt/2 + i\]·wPCA\[p, i\] (zero
/// padding), i ascending from zero, for the used sites (`sites[slot]`). Cube
/// (t-tile, slot), [`UNITS`] units, one sample each.
#[cube(launch_unchecked)]
#[allow(clippy::collapsible_if)]
pub(crate) fn filter_kernel(
    x: &Array<f32>,
    wpca: &Array<f32>,
    sites: &Array<u32>,
    f: &mut Array<f32>,
    n: u32,
    nz: f32,
    #[comptime] npc: usize,
    #[comptime] nt: usize,
) {
    let half = comptime!(nt / 2);
    let span = comptime!(UNITS + nt - 1);
    let mut xs = SharedMemory::<f32>::new(span);
    let mut ws = SharedMemory::<f32>::new(comptime!(npc * nt));
    let slot = CUBE_POS_Y as usize;
    let site = sites[slot] as usize;
    let t0 = CUBE_POS_X as usize * UNITS;
    let n = n as usize;
    let u = UNIT_POS_X as usize;
    let mut i = u;
    while i < comptime!(npc * nt) {
        ws[i] = wpca[i];
        i += UNITS;
    }
    let mut j = u;
    while j < span {
        let p = t0 + j;
        let mut v = 0.0f32;
        if p >= half {
            if p - half < n {
                v = x[site * n + p - half];
            }
        }
        xs[j] = v;
        j += UNITS;
    }
    sync_cube();
    let t = t0 + u;
    if t < n {
        #[unroll]
        for p in 0..npc {
            let mut acc = 0.0f32;
            for m in 0..nt {
                acc += product::<f32>(xs[u + m], ws[p * nt + m], nz);
            }
            f[(slot * npc + p) * n + t] = acc;
        }
    }
}

/// The best template at sample t and its Cf (first on ties; zero in the
/// first and last nt samples).
#[cube]
fn best_at(
    b: &Array<f32>,
    nm: &Array<f32>,
    cfmax: &mut Array<f32>,
    imax: &mut Array<u32>,
    t: usize,
    n: usize,
    k: usize,
    nt: usize,
) {
    if t < nt || t + nt >= n {
        cfmax[t] = 0.0f32;
        imax[t] = 0u32;
    } else {
        let r0 = max(b[t], 0.0f32);
        let mut best = (r0 * r0) / nm[0];
        let mut bj = 0u32;
        for j in 1..k {
            let r = max(b[j * n + t], 0.0f32);
            let cf = (r * r) / nm[j];
            if cf > best {
                best = cf;
                bj = j as u32;
            }
        }
        cfmax[t] = best;
        imax[t] = bj;
    }
}

/// [`best_at`] for every sample (one unit each).
#[cube(launch_unchecked)]
pub(crate) fn best_dense_kernel(
    b: &Array<f32>,
    nm: &Array<f32>,
    cfmax: &mut Array<f32>,
    imax: &mut Array<u32>,
    n: u32,
    k: u32,
    nt: u32,
) {
    let t = ABSOLUTE_POS;
    if t < n as usize {
        best_at(b, nm, cfmax, imax, t, n as usize, k as usize, nt as usize);
    }
}

/// [`best_at`] again over col ± nt of each spike of the current peel (cube
/// per spike, grid-stride; overlapping ranges write equal values).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn best_sparse_kernel(
    b: &Array<f32>,
    nm: &Array<f32>,
    state: &Array<u32>,
    col: &Array<u32>,
    cfmax: &mut Array<f32>,
    imax: &mut Array<u32>,
    n: u32,
    k: u32,
    nt: u32,
) {
    let base = state[S_BASE] as usize;
    let cnt = state[S_ROUND] as usize;
    let nl = 2 * nt as usize + 1;
    let mut r = CUBE_POS_X as usize;
    while r < cnt {
        let t0 = col[base + r] as usize - nt as usize;
        let mut d = UNIT_POS_X as usize;
        while d < nl {
            best_at(
                b,
                nm,
                cfmax,
                imax,
                t0 + d,
                n as usize,
                k as usize,
                nt as usize,
            );
            d += CUBE_DIM_X as usize;
        }
        r += CUBE_COUNT_X as usize;
    }
}
