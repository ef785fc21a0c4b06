//! The seeding of many groups at once with every gain on a GPU
//! ([`seed_lockstep`]): Kilosort4's greedy k-means++ seeding
//! (`clustering_qr.py:kmeans_plusplus`, as [`super::seeding`] states it),
//! one step of every group a round trip.
//!
//! At each step the host draws each group's candidates (as the CPU seeding
//! draws them, [`super::draws`]) and the device does the rest for all groups
//! in three launches: every spike's gain t = 2x·c − ‖c‖² from every
//! candidate and the positive parts of t − v0 summed per candidate
//! ([`ExactSteps`]); each group's best candidate; the update of v0 and of the labels. The host then
//! reads back the spikes whose v0 changed, for the next draws.
//!
//! The device computes the CPU seeding's bits: each x·c is summed in float32
//! in feature order with every product rounded before its addition (each
//! product goes through an integer xor with a zero that the compiler cannot
//! see, so it cannot be fused into a multiply-add), the positive gains are
//! added in float64 in spike order within blocks of 2048 spikes, the blocks
//! in order, and the first of equal totals wins. So the labels equal
//! [`super::seeding::kmeans_plusplus`]'s (tested on CUDA and on Mesa's
//! lavapipe), provided the device keeps subnormal floats (CUDA does: NVRTC
//! runs without flush-to-zero; a Vulkan driver that flushes them could
//! differ where a product or a gain falls below 2⁻¹²⁶, which features of
//! real spikes do not reach). A device without float64 is not used.
//!
//! Unlike the CPU seeding, which skips what cannot change (a memo of gains
//! and a screen of pairs), the device computes every pair at every step:
//! 100 candidates × every spike × the feature length, a dense product that a
//! GPU does in about a millisecond for a million spikes.

use rayon::prelude::*;

use super::draws::{Drawer, SeedingRng};
use super::seeding::dot;

/// One step's candidates of one group: their rows in the group (draw order)
/// and their ‖c‖² (float32, feature order).
pub(crate) type Candidates = (Vec<u32>, Vec<f32>);

/// The seeding's steps of several groups on a device, with every gain
/// computed there in the CPU seeding's arithmetic.
pub(crate) trait ExactSteps: Send {
    /// Takes step `j` of every group with candidates in `cand` (the others
    /// are over): each group's best candidate (largest summed positive gain
    /// Σ relu(t − v0), the first of equal ones), whose improved spikes
    /// (t > v0) take label `j` and v0 = t; then brings `v0[g]` (every
    /// group's v0 as the previous step left it) up to date.
    fn step(&mut self, cand: &[Option<Candidates>], j: u32, v0: &mut [Vec<f32>]);
    /// Every group's labels.
    fn labels(&mut self) -> Vec<Vec<u32>>;
    /// Where the device's time went, when profiling (`SPIKECUBE_SEED_PROFILE`).
    fn report(&self) -> String {
        String::new()
    }
}

/// One group's host state between steps.
struct Draws {
    vtot: Vec<f32>,
    rng: Drawer,
    done: bool,
}

/// Initial labels (0‥`n_clusters`) of each group (`(xd, dim)`, rows of
/// float32 features) by Kilosort4's seeding with the candidates drawn by
/// `rng`, every gain computed by `steps` (made for these groups); the draws
/// run on `pool`. Each group's labels are those of
/// [`super::seeding::kmeans_plusplus`] on it alone.
pub(crate) fn seed_lockstep(
    groups: &[(&[f32], usize)],
    n_clusters: usize,
    rng: SeedingRng,
    steps: &mut dyn ExactSteps,
    pool: &rayon::ThreadPool,
) -> Vec<Vec<u32>> {
    let mut state: Vec<Draws> = pool.install(|| {
        groups
            .par_iter()
            .map(|&(xd, dim)| {
                let vtot: Vec<f32> = xd.chunks_exact(dim.max(1)).map(|r| dot(r, r)).collect();
                Draws {
                    done: vtot.is_empty(),
                    vtot,
                    rng: Drawer::new(rng),
                }
            })
            .collect()
    });
    let mut v0: Vec<Vec<f32>> = state.iter().map(|s| vec![0f32; s.vtot.len()]).collect();
    let (mut t_draws, mut t_steps, mut n_steps) = (0f64, 0f64, 0usize);
    for j in 0..n_clusters {
        crate::cancel::check("the clustering's seeding");
        let t = std::time::Instant::now();
        let cand: Vec<Option<Candidates>> = pool.install(|| {
            state
                .par_iter_mut()
                .zip(&v0)
                .map(|(s, v0)| {
                    if s.done {
                        return None;
                    }
                    let c = s.rng.candidates(&s.vtot, v0);
                    if c.is_empty() {
                        s.done = true;
                        return None;
                    }
                    let cn = c.iter().map(|&i| s.vtot[i]).collect();
                    Some((c.into_iter().map(|i| i as u32).collect(), cn))
                })
                .collect()
        });
        if cand.iter().all(Option::is_none) {
            break;
        }
        t_draws += t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        steps.step(&cand, j as u32, &mut v0);
        t_steps += t.elapsed().as_secs_f64();
        n_steps += 1;
    }
    if super::profile::enabled() {
        tracing::info!(
            "device seeding: {} groups, {n_steps} steps: draws {t_draws:.3} s, device steps {t_steps:.3} s{}",
            groups.len(),
            steps.report()
        );
    }
    steps.labels()
}

/// The device's steps evaluated on the CPU, literally, pair by pair: the
/// reference the kernels are checked against in the library's tests.
#[cfg(test)]
pub(crate) struct CpuSteps {
    groups: Vec<(Vec<f32>, usize)>,
    v0: Vec<Vec<f32>>,
    labels: Vec<Vec<u32>>,
}

#[cfg(test)]
impl CpuSteps {
    pub(crate) fn new(groups: &[(&[f32], usize)]) -> Self {
        let n = |&(x, d): &(&[f32], usize)| x.len() / d.max(1);
        CpuSteps {
            groups: groups.iter().map(|&(x, d)| (x.to_vec(), d)).collect(),
            v0: groups.iter().map(|g| vec![0f32; n(g)]).collect(),
            labels: groups.iter().map(|g| vec![0u32; n(g)]).collect(),
        }
    }
}

#[cfg(test)]
impl ExactSteps for CpuSteps {
    fn step(&mut self, cand: &[Option<Candidates>], j: u32, v0_out: &mut [Vec<f32>]) {
        for (g, c) in cand.iter().enumerate() {
            let Some((rows, cn)) = c else { continue };
            let (xd, dim) = (&self.groups[g].0, self.groups[g].1);
            let v0 = &mut self.v0[g];
            let row = |i: usize| &xd[i * dim..(i + 1) * dim];
            use super::seeding::SPIKE_BLOCK;
            let gain = |s: usize, k: usize| 2.0 * dot(row(s), row(rows[k] as usize)) - cn[k];
            let totals: Vec<f64> = (0..rows.len())
                .map(|k| {
                    let mut total = 0f64;
                    for b in (0..v0.len()).step_by(SPIKE_BLOCK) {
                        let mut bs = 0f64;
                        for (s, &e) in v0.iter().enumerate().skip(b).take(SPIKE_BLOCK) {
                            let d = gain(s, k) - e;
                            if d > 0.0 {
                                bs += f64::from(d);
                            }
                        }
                        total += bs;
                    }
                    total
                })
                .collect();
            let mut best = 0;
            for k in 1..totals.len() {
                if totals[k] > totals[best] {
                    best = k;
                }
            }
            for (s, (e, l)) in v0.iter_mut().zip(&mut self.labels[g]).enumerate() {
                let t = gain(s, best);
                if t > *e {
                    *e = t;
                    *l = j;
                }
            }
        }
        for (o, v) in v0_out.iter_mut().zip(&self.v0) {
            o.copy_from_slice(v);
        }
    }

    fn labels(&mut self) -> Vec<Vec<u32>> {
        self.labels.clone()
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub(crate) use cube::CubeSteps;

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube {
    use cubecl::prelude::*;
    use cubecl::server::Handle;

    use super::super::seeding::SPIKE_BLOCK;
    use super::super::settings::N_CANDIDATES;
    use super::{Candidates, ExactSteps};

    /// Spikes per chunk of a block and units per cube.
    const UNITS: usize = 128;
    /// Candidates per cube of [`gains_kernel`].
    const TILE: usize = 16;
    /// Candidate slots per group (a whole number of tiles).
    const SLOTS: usize = N_CANDIDATES.div_ceil(TILE) * TILE;
    /// Chunks of 2·[`UNITS`] spikes in a block.
    const CHUNKS: usize = SPIKE_BLOCK / (2 * UNITS);
    const _: () = assert!(SPIKE_BLOCK.is_multiple_of(2 * UNITS));
    /// No candidate (a group whose seeding is over).
    const NONE: u32 = u32::MAX;
    /// [`best_kernel`] has a unit per candidate slot.
    const _: () = assert!(UNITS >= SLOTS);
    /// Most cubes along one axis of a launch (wgpu allows 65 535): longer
    /// launches are folded onto a second axis ([`fold`]).
    const DISPATCH_X: usize = 32_768;

    /// The most cubes along one axis: [`DISPATCH_X`], or the smaller
    /// `SPIKECUBE_SEED_DISPATCH_X`, with which the tests fold small launches.
    fn dispatch_limit() -> usize {
        std::env::var("SPIKECUBE_SEED_DISPATCH_X")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(DISPATCH_X, |v| v.clamp(1, DISPATCH_X))
    }

    /// `count` cubes as (x, y) with x ≤ `limit`: cube x + y·x_count.
    fn fold(count: usize, limit: usize) -> (u32, u32) {
        let x = count.clamp(1, limit);
        (x as u32, count.div_ceil(x).max(1) as u32)
    }

    /// x·c in float32, feature order, each product rounded before the sum:
    /// the xor with `zero` (0 at run time) keeps the compiler from fusing
    /// the product into the addition.
    #[cube]
    fn product(x: f32, c: f32, zero: u32) -> f32 {
        f32::reinterpret(u32::reinterpret(x * c) ^ zero)
    }

    /// bsum\[b·SLOTS + c\] = Σ over the spikes s of block b in order (float64)
    /// of relu(2·(x_s·c) − cn\[c\] − v0\[s\]), for the candidates c of tile
    /// `CUBE_POS_Y` of the block's group.
    ///
    /// Cube (b, tile) (b folded: `CUBE_POS_X + CUBE_POS_Z·cubes_x`, cubes
    /// past `n_blocks` idle): block b (`blocks[2b]` = its group, `blocks[2b + 1]`
    /// = its index in the group) of [`SPIKE_BLOCK`] spikes, in chunks of
    /// 2·[`UNITS`] (two spikes a unit, u and u + UNITS, so that each staged
    /// candidate value serves two products: 16 gains each, written to shared
    /// memory; then unit l < 16 adds candidate l's column in spike order).
    /// `table` per group: row0 (its first row in `v0`), n, dim, x_off (its
    /// features, feature-major dim × n), number of candidates. Candidates
    /// (rows of the group) in `cand[g·SLOTS..]`, their ‖c‖² in `cn`; staged
    /// in shared memory (`TILE` × `max_dim`).
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gains_kernel(
        x: &Array<f32>,
        v0: &Array<f32>,
        cand: &Array<u32>,
        cn: &Array<f32>,
        blocks: &Array<u32>,
        table: &Array<u32>,
        bsum: &mut Array<f64>,
        zero: u32,
        cubes_x: u32,
        n_blocks: u32,
        #[comptime] max_dim: usize,
    ) {
        let mut cs = SharedMemory::<f32>::new(comptime!(TILE * max_dim));
        let mut dsh = SharedMemory::<f32>::new(comptime!(2 * UNITS * TILE));
        let u = UNIT_POS_X as usize;
        let mut blk = (CUBE_POS_Z * cubes_x + CUBE_POS_X) as usize;
        let live_cube = blk < n_blocks as usize;
        if !live_cube {
            blk = 0;
        }
        let tile = CUBE_POS_Y as usize;
        let g = blocks[blk * 2] as usize;
        let b = blocks[blk * 2 + 1] as usize;
        let row0 = table[g * 5] as usize;
        let n = table[g * 5 + 1] as usize;
        let dim = table[g * 5 + 2] as usize;
        let x_off = table[g * 5 + 3] as usize;
        let nc = table[g * 5 + 4] as usize;
        let c0 = tile * TILE;
        if live_cube && c0 < nc {
            let mut i = u;
            while i < TILE * dim {
                let l = i % TILE;
                let k = i / TILE;
                let mut v = 0.0f32;
                if c0 + l < nc {
                    v = x[x_off + k * n + cand[g * SLOTS + c0 + l] as usize];
                }
                cs[i] = v;
                i += UNITS;
            }
            let mut cc = Array::<f32>::new(TILE);
            #[unroll]
            for l in 0..TILE {
                cc[l] = 0.0f32;
                if c0 + l < nc {
                    cc[l] = cn[g * SLOTS + c0 + l];
                }
            }
            sync_cube();
            let mut bs = 0.0f64;
            let first = b * SPIKE_BLOCK;
            let mut chunk = 0usize;
            while chunk < CHUNKS && first + chunk * 2 * UNITS < n {
                let s0 = first + chunk * 2 * UNITS + u;
                let s1 = s0 + UNITS;
                // Rows past the group's end compute row n − 1 (not used).
                let mut r0 = s0;
                let mut r1 = s1;
                if r0 >= n {
                    r0 = n - 1;
                }
                if r1 >= n {
                    r1 = n - 1;
                }
                let mut a0 = Array::<f32>::new(TILE);
                let mut a1 = Array::<f32>::new(TILE);
                #[unroll]
                for l in 0..TILE {
                    a0[l] = 0.0f32;
                    a1[l] = 0.0f32;
                }
                for k in 0..dim {
                    let x0 = x[x_off + k * n + r0];
                    let x1 = x[x_off + k * n + r1];
                    #[unroll]
                    for l in 0..TILE {
                        let cv = cs[k * TILE + l];
                        a0[l] += product(x0, cv, zero);
                        a1[l] += product(x1, cv, zero);
                    }
                }
                let e0 = v0[row0 + r0];
                let e1 = v0[row0 + r1];
                #[unroll]
                for l in 0..TILE {
                    let d0 = (2.0f32 * a0[l] - cc[l]) - e0;
                    let d1 = (2.0f32 * a1[l] - cc[l]) - e1;
                    let mut w0 = 0.0f32;
                    let mut w1 = 0.0f32;
                    if d0 > 0.0f32 && s0 < n {
                        w0 = d0;
                    }
                    if d1 > 0.0f32 && s1 < n {
                        w1 = d1;
                    }
                    dsh[u * TILE + l] = w0;
                    dsh[(u + UNITS) * TILE + l] = w1;
                }
                sync_cube();
                if u < TILE {
                    for i in 0..2 * UNITS {
                        bs += f64::cast_from(dsh[i * TILE + u]);
                    }
                }
                sync_cube();
                chunk += 1;
            }
            if u < TILE {
                bsum[blk * SLOTS + c0 + u] = bs;
            }
        }
    }

    /// dst\[x_off + k·n + s\] = src\[s·dim + k\]: one group's features from
    /// rows (n × dim) to feature-major (dim × n). One unit an element, 256
    /// units a cube, cubes folded (`CUBE_POS_X + CUBE_POS_Y·cubes_x`).
    #[cube(launch_unchecked)]
    pub(crate) fn transpose_kernel(
        src: &Array<f32>,
        dst: &mut Array<f32>,
        n: u32,
        dim: u32,
        x_off: u32,
        cubes_x: u32,
    ) {
        let i = ((CUBE_POS_Y * cubes_x + CUBE_POS_X) * 256 + UNIT_POS_X) as usize;
        let (n, dim) = (n as usize, dim as usize);
        if i < n * dim {
            let s = i / dim;
            let k = i % dim;
            dst[x_off as usize + k * n + s] = src[i];
        }
    }

    /// best\[g\] = the row of group g's candidate with the largest total
    /// (block sums `bsum` added in block order, float64; the first of equal
    /// ones), bestcn\[g\] its ‖c‖²; [`NONE`] for a group without candidates.
    /// Also zeroes the count of changes for [`update_kernel`].
    /// One cube (of [`UNITS`] ≥ `SLOTS` units) a group; `gblocks` per group:
    /// its first block and block count.
    #[cube(launch_unchecked)]
    pub(crate) fn best_kernel(
        bsum: &Array<f64>,
        cand: &Array<u32>,
        cn: &Array<f32>,
        table: &Array<u32>,
        gblocks: &Array<u32>,
        best: &mut Array<u32>,
        bestcn: &mut Array<f32>,
        changes: &mut Array<Atomic<u32>>,
    ) {
        let mut tot = SharedMemory::<f64>::new(SLOTS);
        let u = UNIT_POS_X as usize;
        let g = CUBE_POS_X as usize;
        if g == 0 && u == 0 {
            changes[0].store(0u32);
        }
        let nc = table[g * 5 + 4] as usize;
        let b0 = gblocks[g * 2] as usize;
        let nb = gblocks[g * 2 + 1] as usize;
        if u < nc {
            let mut t = 0.0f64;
            for b in 0..nb {
                t += bsum[(b0 + b) * SLOTS + u];
            }
            tot[u] = t;
        }
        sync_cube();
        if u == 0 {
            if nc == 0 {
                best[g] = NONE;
            } else {
                let mut k = 0usize;
                for c in 1..nc {
                    if tot[c] > tot[k] {
                        k = c;
                    }
                }
                best[g] = cand[g * SLOTS + k];
                bestcn[g] = cn[g * SLOTS + k];
            }
        }
    }

    /// For each spike of a group with a best candidate c: t = 2·(x·c) −
    /// ‖c‖² (as [`gains_kernel`]); where t > v0, v0 = t and the label is `j`,
    /// and (row, t) is listed in `chg_row`, `chg_val` (at a slot taken from
    /// the count `changes[0]`: in any order, each row at most once).
    /// One unit a row; `cube_group` gives each cube's group (rows padded to
    /// whole cubes per group); cubes folded (`CUBE_POS_X + CUBE_POS_Y·cubes_x`,
    /// those past `n_cubes` idle).
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn update_kernel(
        x: &Array<f32>,
        table: &Array<u32>,
        cube_group: &Array<u32>,
        best: &Array<u32>,
        bestcn: &Array<f32>,
        v0: &mut Array<f32>,
        labels: &mut Array<u32>,
        changes: &mut Array<Atomic<u32>>,
        chg_row: &mut Array<u32>,
        chg_val: &mut Array<f32>,
        j: u32,
        zero: u32,
        cubes_x: u32,
        n_cubes: u32,
    ) {
        let mut cube = (CUBE_POS_Y * cubes_x + CUBE_POS_X) as usize;
        let live_cube = cube < n_cubes as usize;
        if !live_cube {
            cube = 0;
        }
        let g = cube_group[cube] as usize;
        let row0 = table[g * 5] as usize;
        let n = table[g * 5 + 1] as usize;
        let dim = table[g * 5 + 2] as usize;
        let x_off = table[g * 5 + 3] as usize;
        let s = (cube - row0 / UNITS) * UNITS + UNIT_POS_X as usize;
        let c = best[g];
        if live_cube && s < n && c != NONE {
            let c = c as usize;
            let mut acc = 0.0f32;
            for k in 0..dim {
                acc += product(x[x_off + k * n + s], x[x_off + k * n + c], zero);
            }
            let t = 2.0f32 * acc - bestcn[g];
            let r = row0 + s;
            if t > v0[r] {
                v0[r] = t;
                labels[r] = j;
                let slot = changes[0].fetch_add(1u32) as usize;
                chg_row[slot] = r as u32;
                chg_val[slot] = t;
            }
        }
    }

    /// A group's place on the device.
    struct Slot {
        row0: usize,
        n: usize,
        dim: usize,
        x_off: usize,
    }

    /// The groups' features, v0 and labels on one CubeCL device.
    pub(crate) struct CubeSteps<R: Runtime> {
        client: ComputeClient<R>,
        x: Handle,
        x_len: usize,
        v0: Handle,
        labels: Handle,
        bsum: Handle,
        best: Handle,
        bestcn: Handle,
        blocks: Handle,
        n_blocks: usize,
        gblocks: Handle,
        cube_group: Handle,
        /// Each cube's group, on the host.
        cube_group_host: Vec<u32>,
        /// The count of changed rows of a step, and their rows and v0.
        changes: Handle,
        chg_row: Handle,
        chg_val: Handle,
        n_cubes: usize,
        rows: usize,
        max_dim: usize,
        slots: Vec<Slot>,
        /// Most cubes along one launch axis ([`dispatch_limit`]).
        dispatch: usize,
        /// Seconds in: preparing and uploading the candidates, the gains
        /// kernel, the best kernel, the update kernel, reading the changes (the
        /// kernels timed apart only with `SPIKECUBE_SEED_PROFILE=kernels`,
        /// which waits for each).
        clock: Option<([f64; 5], bool)>,
    }

    impl<R: Runtime> CubeSteps<R> {
        /// Waits for the device and books the time since `t` to phase `i`
        /// (profiling only).
        fn lap(&mut self, i: usize, t: &mut std::time::Instant) {
            if let Some((secs, kernels)) = self.clock.as_mut()
                && (*kernels || i == 0 || i == 4)
            {
                if *kernels {
                    let _ = cubecl::future::block_on(self.client.sync());
                }
                let now = std::time::Instant::now();
                secs[i] += now.duration_since(*t).as_secs_f64();
                *t = now;
            }
        }

        /// Uploads the groups (`(xd, dim)`: finite features, dim ≤ `max_dim`
        /// rounded up to 32); `None` when the device has no float64 or the
        /// groups hold 2³¹ features or more (32-bit indices).
        pub(crate) fn new(client: &ComputeClient<R>, groups: &[(&[f32], usize)]) -> Option<Self> {
            if !crate::detect::gpu::highpass_iir::supports_f64(client) {
                return None;
            }
            let mut slots = Vec::with_capacity(groups.len());
            let (mut rows, mut max_dim, mut x_len) = (0usize, 32usize, 0usize);
            let (mut blocks, mut gblocks, mut cube_group) = (Vec::new(), Vec::new(), Vec::new());
            for (g, &(xd, dim)) in groups.iter().enumerate() {
                let n = xd.len() / dim.max(1);
                let cubes = n.div_ceil(UNITS);
                slots.push(Slot {
                    row0: rows,
                    n,
                    dim,
                    x_off: x_len,
                });
                x_len += n * dim;
                let nb = n.div_ceil(SPIKE_BLOCK);
                gblocks.extend_from_slice(&[(blocks.len() / 2) as u32, nb as u32]);
                for b in 0..nb {
                    blocks.extend_from_slice(&[g as u32, b as u32]);
                }
                cube_group.extend(std::iter::repeat_n(g as u32, cubes));
                rows += cubes * UNITS;
                max_dim = max_dim.max(dim.div_ceil(32) * 32);
            }
            let n_blocks = blocks.len() / 2;
            // The kernels index with 32-bit integers.
            if x_len.max(rows) > (u32::MAX / 2) as usize {
                return None;
            }
            let c = client;
            let dispatch = dispatch_limit();
            // Each group's rows uploaded as they are, made feature-major on
            // the device (so that a warp's loads of one feature are one run).
            let x = c.empty(x_len.max(1) * 4);
            for (slot, &(xd, _)) in slots.iter().zip(groups) {
                let len = slot.n * slot.dim;
                if len == 0 {
                    continue;
                }
                let src = c.create_from_slice(f32::as_bytes(&xd[..len]));
                let (fx, fy) = fold(len.div_ceil(256), dispatch);
                // SAFETY: reads src[..n·dim], writes x[x_off..x_off + n·dim]
                // (x_off + n·dim ≤ x_len).
                unsafe {
                    transpose_kernel::launch_unchecked::<R>(
                        c,
                        CubeCount::Static(fx, fy, 1),
                        CubeDim::new_1d(256),
                        ArrayArg::from_raw_parts(src, len),
                        ArrayArg::from_raw_parts(x.clone(), x_len.max(1)),
                        slot.n as u32,
                        slot.dim as u32,
                        slot.x_off as u32,
                        fx,
                    );
                }
            }
            Some(CubeSteps {
                x,
                x_len: x_len.max(1),
                v0: c.create_from_slice(f32::as_bytes(&vec![0f32; rows.max(1)])),
                labels: c.create_from_slice(u32::as_bytes(&vec![0u32; rows.max(1)])),
                bsum: c.empty(n_blocks.max(1) * SLOTS * 8),
                best: c.empty(slots.len().max(1) * 4),
                bestcn: c.empty(slots.len().max(1) * 4),
                blocks: c.create_from_slice(u32::as_bytes(&blocks)),
                n_blocks,
                gblocks: c.create_from_slice(u32::as_bytes(&gblocks)),
                n_cubes: cube_group.len(),
                cube_group: c.create_from_slice(u32::as_bytes(&cube_group)),
                cube_group_host: cube_group,
                changes: c.create_from_slice(u32::as_bytes(&[0u32])),
                chg_row: c.empty(rows.max(1) * 4),
                chg_val: c.empty(rows.max(1) * 4),
                rows,
                max_dim,
                slots,
                dispatch,
                client: c.clone(),
                clock: std::env::var("SPIKECUBE_SEED_PROFILE")
                    .ok()
                    .map(|v| ([0.0; 5], v == "kernels")),
            })
        }
    }

    impl<R: Runtime> ExactSteps for CubeSteps<R> {
        fn step(&mut self, cand: &[Option<Candidates>], j: u32, v0_out: &mut [Vec<f32>]) {
            let mut t = std::time::Instant::now();
            let ng = self.slots.len();
            let mut rows = vec![0u32; ng * SLOTS];
            let mut cns = vec![0f32; ng * SLOTS];
            let mut table = Vec::with_capacity(ng * 5);
            let mut max_nc = 0;
            for (g, s) in self.slots.iter().enumerate() {
                let nc = cand[g].as_ref().map_or(0, |c| c.0.len().min(SLOTS));
                if let Some((r, cn)) = &cand[g] {
                    rows[g * SLOTS..g * SLOTS + nc].copy_from_slice(&r[..nc]);
                    cns[g * SLOTS..g * SLOTS + nc].copy_from_slice(&cn[..nc]);
                }
                max_nc = max_nc.max(nc);
                table.extend_from_slice(&[
                    s.row0 as u32,
                    s.n as u32,
                    s.dim as u32,
                    s.x_off as u32,
                    nc as u32,
                ]);
            }
            let c = &self.client;
            let ch = c.create_from_slice(u32::as_bytes(&rows));
            let cnh = c.create_from_slice(f32::as_bytes(&cns));
            let th = c.create_from_slice(u32::as_bytes(&table));
            let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
            self.lap(0, &mut t);
            let c = &self.client;
            if max_nc > 0 && self.n_blocks > 0 {
                let (bx, bz) = fold(self.n_blocks, self.dispatch);
                // SAFETY: a cube reads its block's group's rows (< n), its
                // features (x_off + dim·n ≤ x_len), candidate slots and table
                // entries, and writes its own SLOTS-wide row of bsum.
                unsafe {
                    gains_kernel::launch_unchecked::<R>(
                        c,
                        CubeCount::Static(bx, max_nc.div_ceil(TILE) as u32, bz),
                        CubeDim::new_1d(UNITS as u32),
                        arr(&self.x, self.x_len),
                        arr(&self.v0, self.rows.max(1)),
                        arr(&ch, rows.len()),
                        arr(&cnh, cns.len()),
                        arr(&self.blocks, self.n_blocks * 2),
                        arr(&th, table.len()),
                        arr(&self.bsum, self.n_blocks * SLOTS),
                        0u32,
                        bx,
                        self.n_blocks as u32,
                        self.max_dim,
                    );
                }
            }
            self.lap(1, &mut t);
            let c = &self.client;
            // SAFETY: one cube a group, reading that group's blocks' sums.
            unsafe {
                best_kernel::launch_unchecked::<R>(
                    c,
                    CubeCount::Static(ng as u32, 1, 1),
                    CubeDim::new_1d(UNITS as u32),
                    arr(&self.bsum, self.n_blocks.max(1) * SLOTS),
                    arr(&ch, rows.len()),
                    arr(&cnh, cns.len()),
                    arr(&th, table.len()),
                    arr(&self.gblocks, ng * 2),
                    arr(&self.best, ng.max(1)),
                    arr(&self.bestcn, ng.max(1)),
                    arr(&self.changes, 1),
                );
            }
            self.lap(2, &mut t);
            let c = &self.client;
            if self.n_cubes > 0 {
                let (ux, uy) = fold(self.n_cubes, self.dispatch);
                // SAFETY: each unit reads and writes its own row (below rows)
                // and reads its group's features.
                unsafe {
                    update_kernel::launch_unchecked::<R>(
                        c,
                        CubeCount::Static(ux, uy, 1),
                        CubeDim::new_1d(UNITS as u32),
                        arr(&self.x, self.x_len),
                        arr(&th, table.len()),
                        arr(&self.cube_group, self.n_cubes),
                        arr(&self.best, ng.max(1)),
                        arr(&self.bestcn, ng.max(1)),
                        arr(&self.v0, self.rows.max(1)),
                        arr(&self.labels, self.rows.max(1)),
                        arr(&self.changes, 1),
                        arr(&self.chg_row, self.rows.max(1)),
                        arr(&self.chg_val, self.rows.max(1)),
                        j,
                        0u32,
                        ux,
                        self.n_cubes as u32,
                    );
                }
            }
            self.lap(3, &mut t);
            // Only the changed rows come back: their count, then the rows
            // and values (each row once, so the order does not matter).
            let data = self.client.read(vec![self.changes.clone()]);
            let k = (u32::from_bytes(&data[0])[0] as usize).min(self.rows);
            if k > 0 {
                let cut = ((self.rows.max(1) - k) * 4) as u64;
                let data = self.client.read(vec![
                    self.chg_row.clone().offset_end(cut),
                    self.chg_val.clone().offset_end(cut),
                ]);
                let rows = u32::from_bytes(&data[0]);
                let vals = f32::from_bytes(&data[1]);
                for (&r, &v) in rows.iter().zip(vals).take(k) {
                    let r = r as usize;
                    let g = self.cube_group_host[r / UNITS] as usize;
                    v0_out[g][r - self.slots[g].row0] = v;
                }
            }
            self.lap(4, &mut t);
        }

        fn report(&self) -> String {
            match &self.clock {
                Some((s, _)) => format!(
                    " (candidates {:.3}, gains {:.3}, best {:.3}, update {:.3}, read changes {:.3} s)",
                    s[0], s[1], s[2], s[3], s[4]
                ),
                None => String::new(),
            }
        }

        fn labels(&mut self) -> Vec<Vec<u32>> {
            let data = self.client.read(vec![self.labels.clone()]);
            let all = u32::from_bytes(&data[0]);
            self.slots
                .iter()
                .map(|s| all[s.row0..s.row0 + s.n].to_vec())
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sort::clustering::seeding::kmeans_plusplus;
    use crate::sort::clustering::seeding::tests::uniform_gen;

    #[test]
    fn lockstep_with_literal_steps_equals_cpu_seeding() {
        // Groups of different sizes (one over two blocks of 2048 spikes) and
        // feature lengths, integer features with exact ties, one group of
        // spikes all at the origin (no step).
        let mut next = uniform_gen(31);
        let mut groups: Vec<(Vec<f32>, usize)> = Vec::new();
        for (n, dim) in [(4300usize, 12usize), (900, 30), (1500, 5)] {
            groups.push((
                (0..n * dim)
                    .map(|i| next() * (1 + i % 5) as f32 * 8.0)
                    .collect(),
                dim,
            ));
        }
        groups.push(((0..800 * 3).map(|_| (next() * 5.0).round()).collect(), 3));
        groups.push((vec![0f32; 50 * 3], 3));
        let views: Vec<(&[f32], usize)> = groups.iter().map(|(x, d)| (x.as_slice(), *d)).collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let mut steps = CpuSteps::new(&views);
        let got = seed_lockstep(&views, 60, SeedingRng::torch(5), &mut steps, &pool);
        for (g, &(x, d)) in views.iter().enumerate() {
            assert_eq!(
                got[g],
                kmeans_plusplus(x, d, 60, SeedingRng::torch(5)),
                "group {g}"
            );
        }
    }
}
