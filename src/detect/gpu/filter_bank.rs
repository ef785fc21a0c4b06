//! Step 1 on the device: the filter bank, GPU twin of [`crate::detect::cpu::filter_bank`].
//!
//! B\[c, k, t\] = Σ_m wTEMP\[k, m\]·X\[c, t + m − nt/2\] with X = 0 outside the window
//! (Kilosort4's `conv1d` with zero padding: a cross-correlation), summed over m in
//! ascending order like the CPU. Each cube loads its stretch of one channel plus
//! nt − 1 samples of context and the 6 × nt templates into shared memory once;
//! each unit computes the 6 outputs of [`PER_UNIT`] samples, `UNITS` apart (so that
//! neighbouring units read neighbouring shared-memory words), reusing each template
//! tap from a register for all of them. The same pass writes
//! q\[c, t\] = max_k B\[c, k, t\]², the per-channel term of the pruning bound used by
//! [`super::centre_response`].

use cubecl::prelude::*;

use super::exact::product;

/// Units per cube.
pub const UNITS: usize = 256;
/// Samples per unit.
pub const PER_UNIT: usize = 4;
/// Samples per cube.
pub const TILE: usize = UNITS * PER_UNIT;

#[cube(launch_unchecked)]
// Nested ifs: the bound test must not evaluate `p - half` for p < half.
#[allow(clippy::collapsible_if)]
pub(crate) fn filter_bank_kernel(
    x: &Array<f32>,
    wtemp: &Array<f32>,
    b: &mut Array<f32>,
    q: &mut Array<f32>,
    n_t: u32,
    nz: f32,
    #[comptime] nk: usize,
    #[comptime] ntaps: usize,
    #[comptime] units: usize,
    #[comptime] per_unit: usize,
) {
    let tile = comptime!(units * per_unit);
    let half = comptime!(ntaps / 2);
    let span = comptime!(units * per_unit + ntaps - 1);
    let n_w = comptime!(nk * ntaps);
    let n_acc = comptime!(nk * per_unit);
    let mut xs = SharedMemory::<f32>::new(span);
    let mut ws = SharedMemory::<f32>::new(n_w);
    let ch = CUBE_POS_Y as usize;
    let t0 = CUBE_POS_X as usize * tile;
    let n_t = n_t as usize;
    let u = UNIT_POS_X as usize;
    let mut i = u;
    while i < n_w {
        ws[i] = wtemp[i];
        i += units;
    }
    let mut s = u;
    while s < span {
        let p = t0 + s;
        let mut v = 0.0f32;
        if p >= half {
            if p - half < n_t {
                v = x[ch * n_t + p - half];
            }
        }
        xs[s] = v;
        s += units;
    }
    sync_cube();
    let mut acc = Array::<f32>::new(n_acc);
    #[unroll]
    for a in 0..n_acc {
        acc[a] = 0.0f32;
    }
    let mut wv = Array::<f32>::new(nk);
    for m in 0..ntaps {
        #[unroll]
        for k in 0..nk {
            wv[k] = ws[k * ntaps + m];
        }
        #[unroll]
        for r in 0..per_unit {
            let xv = xs[u + r * units + m];
            #[unroll]
            for k in 0..nk {
                acc[r * nk + k] += product::<f32>(wv[k], xv, nz);
            }
        }
    }
    #[unroll]
    for r in 0..per_unit {
        let t = t0 + u + r * units;
        if t < n_t {
            let mut qm = 0.0f32;
            #[unroll]
            for k in 0..nk {
                let v = acc[r * nk + k];
                b[(ch * nk + k) * n_t + t] = v;
                qm = max(qm, v * v);
            }
            q[ch * n_t + t] = qm;
        }
    }
}
