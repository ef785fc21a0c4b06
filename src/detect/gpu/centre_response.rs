//! Step 2 on the device: `centre_response`, GPU twin of
//! [`crate::detect::cpu::centre_response`] (dense) and
//! [`crate::detect::cpu::centre_response_pruned`] (pruned).
//!
//! One unit per (template centre j, sample t): the nsz·nk outputs
//! A\[s·nk + k\] = Σ_c weigh\[s, c, j\]·B\[iC\[c, j\], k, t\] (sum over c ascending, as
//! on the CPU) held in registers (sizes and channel counts are compile-time
//! constants, the loops unrolled), then As = max |A|, the first r attaining it
//! and its sign: imaxs = (1 + r)·sign (Kilosort4's `template_match`).
//!
//! One cube per centre and [`TILE`] samples, centre-fastest (CUBE_POS_X = centre),
//! so all centres of one time tile run together and that tile of B stays in L2.
//! (Staging a block of centres' sites in shared memory instead was measured 3.5×
//! slower on the H200: docs/benchmarks-history.md.)
//!
//! Pruned: where the Cauchy–Schwarz bound max_s ‖weigh\[s, :, j\]‖²·Σ_c q\[iC\[c, j\], t\]
//! (1 % margin) stays below Th_universal², no |A| can exceed the threshold and the
//! unit writes As = 0, imaxs = 0 after reading nC values of q instead of 6·nC of B.

use cubecl::prelude::*;

use super::exact::product;

/// Samples per cube.
pub const TILE: usize = 256;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn centre_response_kernel(
    b: &Array<f32>,
    q: &Array<f32>,
    sites: &Array<u32>,
    weights: &Array<f32>,
    weight_norm2: &Array<f32>,
    as_out: &mut Array<f32>,
    imax_out: &mut Array<i32>,
    n_t: u32,
    th2: f32,
    nz: f32,
    #[comptime] nc: usize,
    #[comptime] nsz: usize,
    #[comptime] nk: usize,
    #[comptime] pruned: bool,
) {
    let j = CUBE_POS_X as usize;
    let t = CUBE_POS_Y as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let n_t = n_t as usize;
    if t < n_t {
        let mut go = true;
        if comptime!(pruned) {
            let mut sum = 0.0f32;
            #[unroll]
            for c in 0..nc {
                let s = sites[j * nc + c] as usize;
                sum += q[s * n_t + t];
            }
            let scale = weight_norm2[j] * 1.01f32;
            go = sum * scale >= th2;
        }
        if go {
            let nr = comptime!(nsz * nk);
            let mut acc = Array::<f32>::new(nr);
            #[unroll]
            for r in 0..nr {
                acc[r] = 0.0f32;
            }
            #[unroll]
            for c in 0..nc {
                let s = sites[j * nc + c] as usize;
                #[unroll]
                for k in 0..nk {
                    let bv = b[(s * nk + k) * n_t + t];
                    #[unroll]
                    for z in 0..nsz {
                        acc[z * nk + k] += product::<f32>(weights[(j * nc + c) * nsz + z], bv, nz);
                    }
                }
            }
            let mut best = f32::abs(acc[0]);
            let mut r_best = 0i32;
            let mut value = acc[0];
            #[unroll]
            for r in 1..nr {
                let v = f32::abs(acc[r]);
                if v > best {
                    best = v;
                    r_best = r as i32;
                    value = acc[r];
                }
            }
            let mut code = 0i32;
            if value > 0.0f32 {
                code = r_best + 1;
            } else if value < 0.0f32 {
                code = -(r_best + 1);
            }
            as_out[j * n_t + t] = best;
            imax_out[j * n_t + t] = code;
        } else {
            as_out[j * n_t + t] = 0.0f32;
            imax_out[j * n_t + t] = 0i32;
        }
    }
}
