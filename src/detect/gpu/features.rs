//! Step 5 on the device: what Kilosort4 reports about each detection, GPU twin
//! of [`crate::detect::cpu::features`]. One unit per (detection, site); the
//! site-0 unit also writes the per-detection values:
//!
//! * `amp` = As\[j, t\], `code` = imaxs\[j, t\] = (1 + r)·sign;
//! * `adist[c]` = sign·B\[iC\[c, j\], r mod nk, t\] (read from step 1's output);
//! * `yct` = Σ_c w_c·yc\[iC\[c, j\]\], w = max(adist, 0)/Σ max(adist, 0) (`yweighted`);
//! * `tf[c·npc + p]` = Σ_m X\[iC\[c, j\], t − nt/2 + m\]·wPCA\[p, m\] (zero outside the window).

use cubecl::prelude::*;

use super::exact::product;

#[cube(launch_unchecked)]
// Nested ifs: the bound test must not evaluate `p - half` for p < half.
#[allow(clippy::collapsible_if)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn features_kernel(
    x: &Array<f32>,
    b: &Array<f32>,
    as_in: &Array<f32>,
    imax_in: &Array<i32>,
    sites: &Array<u32>,
    yc: &Array<f32>,
    wpca: &Array<f32>,
    count: &Array<u32>,
    peak_j: &Array<u32>,
    peak_t: &Array<u32>,
    out_amp: &mut Array<f32>,
    out_code: &mut Array<i32>,
    out_adist: &mut Array<f32>,
    out_yct: &mut Array<f32>,
    out_tf: &mut Array<f32>,
    n_t: u32,
    cap: u32,
    nz: f32,
    #[comptime] nc: usize,
    #[comptime] nk: usize,
    #[comptime] npc: usize,
    #[comptime] ntaps: usize,
) {
    let i = ABSOLUTE_POS / nc;
    let c = ABSOLUTE_POS % nc;
    let n = min(count[0], cap) as usize;
    if i < n {
        let n_t = n_t as usize;
        let j = peak_j[i] as usize;
        let t = peak_t[i] as usize;
        let code = imax_in[j * n_t + t];
        let mut sign = 1.0f32;
        let mut r = code - 1;
        if code < 0 {
            sign = -1.0f32;
            r = -code - 1;
        }
        let k = r as usize % nk;
        let s = sites[j * nc + c] as usize;
        out_adist[i * nc + c] = b[(s * nk + k) * n_t + t] * sign;
        if c == 0 {
            out_amp[i] = as_in[j * n_t + t];
            out_code[i] = code;
            let mut wsum = 0.0f32;
            #[unroll]
            for cc in 0..nc {
                let sc = sites[j * nc + cc] as usize;
                wsum += max(b[(sc * nk + k) * n_t + t] * sign, 0.0f32);
            }
            let mut yct = 0.0f32;
            #[unroll]
            for cc in 0..nc {
                let sc = sites[j * nc + cc] as usize;
                let a = b[(sc * nk + k) * n_t + t] * sign;
                yct += product::<f32>(max(a, 0.0f32) / wsum, yc[sc], nz);
            }
            out_yct[i] = yct;
        }
        let half = comptime!(ntaps / 2);
        #[unroll]
        for p in 0..npc {
            let mut acc = 0.0f32;
            for m in 0..ntaps {
                let tt = t + m;
                let mut v = 0.0f32;
                if tt >= half {
                    if tt - half < n_t {
                        v = x[s * n_t + tt - half];
                    }
                }
                acc += product::<f32>(v, wpca[p * ntaps + m], nz);
            }
            out_tf[(i * nc + c) * npc + p] = acc;
        }
    }
}
