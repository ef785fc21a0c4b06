//! The matching pass's CubeCL kernels (see the parent module for the order in
//! which they run and what each array holds). Every sum runs in the CPU
//! twin's order ([`crate::sort::matching`]); no float atomics anywhere.

use cubecl::prelude::*;

use crate::detect::gpu::exact::product;

/// Units per cube of the element-wise kernels.
pub const UNITS: usize = 256;
/// Templates per tile of the filter product.
pub const KB: usize = 32;
/// Samples per tile of the filter product.
pub const TT: usize = 128;

/// Device state word (u32): spikes found so far.
pub const S_TOTAL: usize = 0;
/// Device state word: non-zero once a peel found nothing (or overflowed).
pub const S_STOP: usize = 1;
/// Device state word: peels run.
pub const S_PEELS: usize = 2;
/// Device state word: index of the current peel's first spike.
pub const S_BASE: usize = 3;
/// Device state word: spikes of the current peel.
pub const S_ROUND: usize = 4;
/// Device state word: non-zero when the spikes would pass the capacity.
pub const S_OVERFLOW: usize = 5;
/// Words in the state buffer.
pub const S_LEN: usize = 8;

/// Samples per unit of [`filter_kernel`] (at t, t + [`UNITS`], …): the cube
/// covers FILTER_R·[`UNITS`] samples.
pub const FILTER_R: usize = 4;

/// F\[(slot·npc + p)·n + t\] = Σ_i X\[site, t − nt/2 + i\]·wPCA\[p, i\] (zero
/// padding), i ascending from zero, for the used sites (`sites[slot]`). Cube
/// (t-tile of [`FILTER_R`]·[`UNITS`] samples, slot), [`UNITS`] units; each
/// unit keeps the npc × [`FILTER_R`] sums of its samples in registers, so
/// that one load of X and of wPCA serves several sums (each sum still runs
/// over i in ascending order).
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
    #[comptime] per_unit: usize,
) {
    let half = comptime!(nt / 2);
    let tile = comptime!(per_unit * UNITS);
    let span = comptime!(per_unit * UNITS + nt - 1);
    let n_w = comptime!(npc * nt);
    let n_acc = comptime!(npc * per_unit);
    let mut xs = SharedMemory::<f32>::new(span);
    let mut ws = SharedMemory::<f32>::new(n_w);
    let slot = CUBE_POS_Y as usize;
    let site = sites[slot] as usize;
    let t0 = CUBE_POS_X as usize * tile;
    let n = n as usize;
    let u = UNIT_POS_X as usize;
    let mut i = u;
    while i < n_w {
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
    let mut acc = Array::<f32>::new(n_acc);
    #[unroll]
    for a in 0..n_acc {
        acc[a] = 0.0f32;
    }
    let mut wv = Array::<f32>::new(npc);
    for m in 0..nt {
        #[unroll]
        for p in 0..npc {
            wv[p] = ws[p * nt + m];
        }
        #[unroll]
        for r in 0..per_unit {
            let xv = xs[u + r * UNITS + m];
            #[unroll]
            for p in 0..npc {
                acc[r * npc + p] += product::<f32>(xv, wv[p], nz);
            }
        }
    }
    #[unroll]
    for r in 0..per_unit {
        let t = t0 + u + r * UNITS;
        if t < n {
            #[unroll]
            for p in 0..npc {
                f[(slot * npc + p) * n + t] = acc[r * npc + p];
            }
        }
    }
}

/// Sites of a block's union staged in shared memory at once by
/// [`product_kernel`] (fewer barriers; the summation order is unchanged).
pub const SLOTS_PER_STAGE: usize = 8;

/// B\[k·n + t\] = Σ_{slot ∈ block's union, p} U\[k, p, slot\]·F\[slot, p, t\]: a
/// tiled product of [`KB`] templates × [`TT`] samples per cube over the union
/// of the block's sites (ascending; zeros where a template has no
/// coefficient, which add exact zeros). Cube (t-tile, k-block), 256 units of
/// 4 templates × 4 samples each; [`SLOTS_PER_STAGE`] sites' coefficients and
/// F rows are staged in shared memory between two barriers, and every sum
/// still runs over the sites in ascending order, then over the PCs.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_kernel(
    f: &Array<f32>,
    blk_off: &Array<u32>,
    blk_slot: &Array<u32>,
    blk_u: &Array<f32>,
    b: &mut Array<f32>,
    n: u32,
    k: u32,
    nz: f32,
    #[comptime] npc: usize,
) {
    let mut su = SharedMemory::<f32>::new(comptime!(SLOTS_PER_STAGE * KB * npc));
    let mut sf = SharedMemory::<f32>::new(comptime!(SLOTS_PER_STAGE * npc * TT));
    let blk = CUBE_POS_Y as usize;
    let t0 = CUBE_POS_X as usize * TT;
    let n = n as usize;
    let u = UNIT_POS_X as usize;
    let kr = u / 32usize;
    let tc = u % 32usize;
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for a in 0..16usize {
        acc[a] = 0.0f32;
    }
    let e0 = blk_off[blk] as usize;
    let e1 = blk_off[blk + 1] as usize;
    let mut e = e0;
    while e < e1 {
        let mut cnt = e1 - e;
        if cnt > SLOTS_PER_STAGE {
            cnt = SLOTS_PER_STAGE;
        }
        let mut i = u;
        while i < cnt * comptime!(KB * npc) {
            su[i] = blk_u[e * comptime!(KB * npc) + i];
            i += UNITS;
        }
        i = u;
        while i < cnt * comptime!(npc * TT) {
            let s = i / comptime!(npc * TT);
            let r = i % comptime!(npc * TT);
            let p = r / TT;
            let c = r % TT;
            let slot = blk_slot[e + s] as usize;
            let t = t0 + c;
            let mut v = 0.0f32;
            if t < n {
                v = f[(slot * npc + p) * n + t];
            }
            sf[i] = v;
            i += UNITS;
        }
        sync_cube();
        for s in 0..cnt {
            let ub = s * comptime!(KB * npc);
            let fb = s * comptime!(npc * TT);
            #[unroll]
            for p in 0..npc {
                #[unroll]
                for r in 0..4usize {
                    let uv = su[ub + (kr * 4usize + r) * npc + p];
                    #[unroll]
                    for m in 0..4usize {
                        acc[r * 4usize + m] +=
                            product::<f32>(uv, sf[fb + p * TT + tc + 32usize * m], nz);
                    }
                }
            }
        }
        sync_cube();
        e += cnt;
    }
    let k = k as usize;
    #[unroll]
    for r in 0..4usize {
        let kk = blk * KB + kr * 4usize + r;
        #[unroll]
        for m in 0..4usize {
            let t = t0 + tc + 32usize * m;
            if kk < k && t < n {
                b[kk * n + t] = acc[r * 4usize + m];
            }
        }
    }
}

/// Samples per cube of the best-template kernels (x of the cube).
pub const BEST_LANES: usize = 32;
/// Template slices per cube (y of the cube): slice s scans templates s,
/// s + [`BEST_SLICES`], …, so that no unit walks all K templates alone.
pub const BEST_SLICES: usize = 16;

/// The best template at sample t and its Cf = relu(B)²/‖U‖² (the first
/// largest; zero in the first and last nt samples), found by the cube's
/// [`BEST_SLICES`] slices of templates: the unit
/// (lane, s) finds the first largest Cf at sample t among its slice's
/// templates (slice 0 starts from template 0's Cf as the serial scan does, the
/// others from below every Cf), then lane's slice-0 unit combines the slices in
/// order (larger Cf, or equal and a lower template), which is the serial
/// scan's first largest. Every unit of the cube must call it; `valid` false
/// for a unit without a sample.
#[cube]
#[allow(clippy::too_many_arguments)]
// Nested ifs: the kernel language does not short-circuit `&&`.
#[allow(clippy::collapsible_if)]
fn best_sliced(
    b: &Array<f32>,
    nm: &Array<f32>,
    cfmax: &mut Array<f32>,
    imax: &mut Array<u32>,
    sh_cf: &mut SharedMemory<f32>,
    sh_j: &mut SharedMemory<u32>,
    t: usize,
    valid: bool,
    n: usize,
    k: usize,
    nt: usize,
) {
    let lane = UNIT_POS_X as usize;
    let s = UNIT_POS_Y as usize;
    let mut inside = false;
    if valid {
        if t >= nt {
            if t + nt < n {
                inside = true;
            }
        }
    }
    // Below every Cf (which is ≥ 0 or NaN); a literal −1 would be a
    // comptime value that the kernel language does not let a runtime one
    // replace.
    let mut best = 0.0f32;
    best -= 1.0f32;
    let mut bj = 0u32;
    if inside {
        let mut j = s;
        if s == 0 {
            let r0 = max(b[t], 0.0f32);
            best = (r0 * r0) / nm[0];
            j = BEST_SLICES;
        }
        while j < k {
            let r = max(b[j * n + t], 0.0f32);
            let cf = (r * r) / nm[j];
            if cf > best {
                best = cf;
                bj = j as u32;
            }
            j += BEST_SLICES;
        }
    }
    sh_cf[s * BEST_LANES + lane] = best;
    sh_j[s * BEST_LANES + lane] = bj;
    sync_cube();
    if s == 0 {
        if valid {
            let mut acc = 0.0f32;
            let mut aj = 0u32;
            if inside {
                acc = sh_cf[lane];
                aj = sh_j[lane];
                for q in 1..BEST_SLICES {
                    let c = sh_cf[q * BEST_LANES + lane];
                    let jq = sh_j[q * BEST_LANES + lane];
                    let mut take = c > acc;
                    if c == acc {
                        if jq < aj {
                            take = true;
                        }
                    }
                    if take {
                        acc = c;
                        aj = jq;
                    }
                }
            }
            cfmax[t] = acc;
            imax[t] = aj;
        }
    }
    sync_cube();
}

/// [`best_sliced`] for every sample: cube of [`BEST_LANES`] samples ×
/// [`BEST_SLICES`] template slices ([`best_sliced`]).
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
    let mut sh_cf = SharedMemory::<f32>::new(comptime!(BEST_LANES * BEST_SLICES));
    let mut sh_j = SharedMemory::<u32>::new(comptime!(BEST_LANES * BEST_SLICES));
    let t = CUBE_POS_X as usize * BEST_LANES + UNIT_POS_X as usize;
    let n = n as usize;
    best_sliced(
        b,
        nm,
        cfmax,
        imax,
        &mut sh_cf,
        &mut sh_j,
        t,
        t < n,
        n,
        k as usize,
        nt as usize,
    );
}

/// [`best_sliced`] again over col ± nt of each spike of the current peel: cube
/// (spike, [`BEST_LANES`] of the 2·nt + 1 samples) × [`BEST_SLICES`]
/// template slices, grid-stride over the spikes (overlapping ranges write
/// equal values).
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
    let mut sh_cf = SharedMemory::<f32>::new(comptime!(BEST_LANES * BEST_SLICES));
    let mut sh_j = SharedMemory::<u32>::new(comptime!(BEST_LANES * BEST_SLICES));
    let base = state[S_BASE] as usize;
    let cnt = state[S_ROUND] as usize;
    let nt = nt as usize;
    let nl = 2 * nt + 1;
    let d = CUBE_POS_Y as usize * BEST_LANES + UNIT_POS_X as usize;
    let mut r = CUBE_POS_X as usize;
    while r < cnt {
        let t = col[base + r] as usize - nt + d;
        best_sliced(
            b,
            nm,
            cfmax,
            imax,
            &mut sh_cf,
            &mut sh_j,
            t,
            d < nl,
            n as usize,
            k as usize,
            nt,
        );
        r += CUBE_COUNT_X as usize;
    }
}

/// Inclusive prefix sum of `sh[0..UNITS]` in place (Hillis–Steele; every
/// unit of the cube must call it).
#[cube]
fn scan_shared(sh: &mut SharedMemory<u32>, u: usize) {
    let mut off = 1usize;
    while off < UNITS {
        let mut v = 0u32;
        if u >= off {
            v = sh[u - off];
        }
        sync_cube();
        sh[u] += v;
        sync_cube();
        off *= 2;
    }
}

/// Peaks of the peel: flag\[t\] = Cf\[t\] > th2 and Cf\[t\] ≥ every Cf within
/// ±nt (nt ≤ t < n − nt); lrank\[t\] = flags before t in its cube's
/// [`UNITS`] samples; bcount\[cube\] = the cube's flags. Skipped once stopped.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn flags_kernel(
    cfmax: &Array<f32>,
    state: &Array<u32>,
    flags: &mut Array<u32>,
    lrank: &mut Array<u32>,
    bcount: &mut Array<u32>,
    n: u32,
    nt: u32,
    th2: f32,
) {
    if state[S_STOP] == 0 {
        let mut sh = SharedMemory::<u32>::new(UNITS);
        let u = UNIT_POS_X as usize;
        let t = CUBE_POS_X as usize * UNITS + u;
        let n = n as usize;
        let nt = nt as usize;
        let mut flag = 0u32;
        if t >= nt && t + nt < n {
            let v = cfmax[t];
            if v > th2 {
                let hi = min(t + nt + 1, n);
                let mut ok = true;
                for w in t - nt..hi {
                    if cfmax[w] > v {
                        ok = false;
                    }
                }
                if ok {
                    flag = 1u32;
                }
            }
        }
        sh[u] = flag;
        sync_cube();
        scan_shared(&mut sh, u);
        if t < n {
            flags[t] = flag;
            lrank[t] = sh[u] - flag;
        }
        if u == UNITS - 1 {
            bcount[CUBE_POS_X as usize] = sh[u];
        }
    }
}

/// One cube: exclusive offsets of the flag blocks (after the spikes found
/// so far) and the peel's bookkeeping: base, count, peels = peel + 1; stops
/// when the peel found nothing or the spikes would pass `cap` (overflow).
#[cube(launch_unchecked)]
// Written out: the kernel language has no `div_ceil`.
#[allow(clippy::manual_div_ceil)]
pub(crate) fn offsets_kernel(
    bcount: &Array<u32>,
    boff: &mut Array<u32>,
    state: &mut Array<u32>,
    nb: u32,
    peel: u32,
    cap: u32,
) {
    if state[S_STOP] == 0 {
        let mut sh = SharedMemory::<u32>::new(UNITS);
        let u = UNIT_POS_X as usize;
        let nb = nb as usize;
        let per = (nb + UNITS - 1) / UNITS;
        let lo = min(u * per, nb);
        let hi = min(lo + per, nb);
        let base = state[S_TOTAL];
        let mut s = 0u32;
        for i in lo..hi {
            s += bcount[i];
        }
        sh[u] = s;
        sync_cube();
        scan_shared(&mut sh, u);
        let mut run = base + sh[u] - s;
        for i in lo..hi {
            boff[i] = run;
            run += bcount[i];
        }
        let total = sh[UNITS - 1];
        sync_cube();
        if u == 0 {
            state[S_PEELS] = peel + 1;
            state[S_BASE] = base;
            if base + total > cap {
                state[S_OVERFLOW] = 1u32;
                state[S_STOP] = 1u32;
                state[S_ROUND] = 0u32;
            } else {
                state[S_ROUND] = total;
                state[S_TOTAL] = base + total;
                if total == 0 {
                    state[S_STOP] = 1u32;
                }
            }
        }
    }
}

/// Writes the peel's spikes in ascending sample order: col, template, amp =
/// B/nm, Cf (its square root is taken on the host, as the CPU takes it; one
/// unit per sample).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
// Nested ifs: flags[t] must not be read for t ≥ n.
#[allow(clippy::collapsible_if)]
pub(crate) fn write_kernel(
    flags: &Array<u32>,
    lrank: &Array<u32>,
    boff: &Array<u32>,
    cfmax: &Array<f32>,
    imax: &Array<u32>,
    b: &Array<f32>,
    nm: &Array<f32>,
    state: &Array<u32>,
    out_col: &mut Array<u32>,
    out_tmpl: &mut Array<u32>,
    out_amp: &mut Array<f32>,
    out_th: &mut Array<f32>,
    n: u32,
    cap: u32,
) {
    let t = ABSOLUTE_POS;
    let n = n as usize;
    if t < n && state[S_ROUND] > 0 {
        if flags[t] == 1 {
            let idx = (boff[t / UNITS] + lrank[t]) as usize;
            if idx < cap as usize {
                let j = imax[t] as usize;
                out_col[idx] = t as u32;
                out_tmpl[idx] = j as u32;
                out_amp[idx] = b[j * n + t] / nm[j];
                out_th[idx] = cfmax[t];
            }
        }
    }
}

/// Subtracts the peel's spikes of one parity (rank within the peel mod 2):
/// amp × ctc\[kk, j, d\] from B\[kk, col − nt + d\] for each partner kk of the
/// spike's template, and amp × waveform from the residual over col ± nt/2
/// on the template's support sites. Cubes (spike, part): the grid's x
/// strides over the spikes, its y over each spike's values, so that a peel
/// of few spikes still spreads them over several cubes. Each value is
/// written by one unit (spikes of one parity are more than 2·nt apart), so
/// the grid does not change the result. With `precomputed` false, ctc is
/// made from the pair's UtU and WtW in float32 (a, b ascending).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn subtract_kernel(
    state: &Array<u32>,
    col: &Array<u32>,
    tmpl: &Array<u32>,
    amp: &Array<f32>,
    pk_off: &Array<u32>,
    pk_k: &Array<u32>,
    pairs: &Array<f32>,
    wtw: &Array<f32>,
    sup_off: &Array<u32>,
    sup_site: &Array<u32>,
    wave: &Array<f32>,
    b: &mut Array<f32>,
    xres: &mut Array<f32>,
    n: u32,
    parity: u32,
    nz: f32,
    #[comptime] nt: usize,
    #[comptime] npc: usize,
    #[comptime] precomputed: bool,
) {
    let base = state[S_BASE] as usize;
    let cnt = state[S_ROUND] as usize;
    let n = n as usize;
    let nl = comptime!(2 * nt + 1);
    let half = comptime!(nt / 2);
    let mut r = parity as usize + 2 * CUBE_POS_X as usize;
    while r < cnt {
        let s = base + r;
        let j = tmpl[s] as usize;
        let t = col[s] as usize;
        let a = amp[s];
        let p0 = pk_off[j] as usize;
        let np = pk_off[j + 1] as usize - p0;
        let first = CUBE_POS_Y as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
        let stride = CUBE_COUNT_Y as usize * CUBE_DIM_X as usize;
        let mut e = first;
        while e < np * nl {
            let pi = e / nl;
            let d = e % nl;
            let kk = pk_k[p0 + pi] as usize;
            let mut c = 0.0f32;
            if comptime!(precomputed) {
                c = pairs[(p0 + pi) * nl + d];
            } else {
                #[unroll]
                for q in 0..comptime!(npc * npc) {
                    c += product::<f32>(
                        pairs[(p0 + pi) * comptime!(npc * npc) + q],
                        wtw[q * nl + d],
                        nz,
                    );
                }
            }
            let idx = kk * n + t - nt + d;
            b[idx] = b[idx] - product::<f32>(a, c, nz);
            e += stride;
        }
        let s0 = sup_off[j] as usize;
        let ns = sup_off[j + 1] as usize - s0;
        let mut e = first;
        while e < ns * nt {
            let si = e / nt;
            let i = e % nt;
            let site = sup_site[s0 + si] as usize;
            let idx = site * n + t - half + i;
            xres[idx] = xres[idx] - product::<f32>(a, wave[(s0 + si) * nt + i], nz);
            e += stride;
        }
        r += 2 * CUBE_COUNT_X as usize;
    }
}

/// Features: tF\[s, ci, p\] = Σ_i res\[c, col − nt/2 + i\]·wPCA\[p, i\] (float32,
/// i ascending) + amp·U\[j, p, c\], c = iCC\[ci, iU\[j\]\]; one unit per value.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn features_kernel(
    xres: &Array<f32>,
    wpca: &Array<f32>,
    u_all: &Array<f32>,
    icc: &Array<u32>,
    iu: &Array<u32>,
    col: &Array<u32>,
    tmpl: &Array<u32>,
    amp: &Array<f32>,
    tf: &mut Array<f32>,
    n: u32,
    count: u32,
    n_c: u32,
    nz: f32,
    #[comptime] nc: usize,
    #[comptime] npc: usize,
    #[comptime] nt: usize,
) {
    let g = ABSOLUTE_POS;
    let s = g / comptime!(nc * npc);
    if s < count as usize {
        let ci = (g / npc) % nc;
        let p = g % npc;
        let n = n as usize;
        let n_c = n_c as usize;
        let j = tmpl[s] as usize;
        let t = col[s] as usize - comptime!(nt / 2);
        let c = icc[ci * n_c + iu[j] as usize] as usize;
        let mut acc = 0.0f32;
        for i in 0..nt {
            acc += product::<f32>(xres[c * n + t + i], wpca[p * nt + i], nz);
        }
        tf[g] = acc + product::<f32>(amp[s], u_all[(j * npc + p) * n_c + c], nz);
    }
}
