//! The seeding's pair screen on a GPU ([`SeedingDevice`]).
//!
//! At each step of the seeding ([`super::seeding`]) every spike x of a group
//! is tested against the fresh candidates c: only the pairs whose float32
//! gain t = 2x·c − ‖c‖² beats the spike's v0 change a sum or a label. The
//! device computes every pair's gain in float32 (in its own order, fused or
//! not) and flags, per spike and tile of 16 candidates, whether any pair
//! could beat v0 within a bound that covers any difference between two
//! float32 evaluations of the same gain; the CPU then computes the flagged
//! spikes' gains exactly as without the device. The flags are a superset of
//! the pairs that beat v0, and a pair that does not adds exactly +0 and
//! takes no label, so the labels have the bits of the CPU seeding on every
//! device.

use std::fmt;
use std::sync::Arc;

use super::lockstep::ExactSteps;

/// Candidates per tile of the device screen: one bit of a spike's flags
/// (the CPU seeding's tile width).
pub(crate) const SCREEN_TILE: usize = 16;

/// Largest feature dimension the device screen takes (its tile of candidates
/// is staged in 16 KB of shared memory); wider groups are screened on the CPU.
pub const MAX_DEVICE_DIM: usize = 256;

/// Largest |feature| the device screen takes (as the CPU screen): beyond it a
/// float32 dot product could overflow.
const MAX_ABS: f32 = 1e15;

/// The fresh candidates of one group at one step: their rows in the group
/// and their ‖c‖² as the CPU computes them.
pub(crate) type Ask = (Vec<u32>, Vec<f32>);

/// The screens of several groups on a device, made by a [`SeedingDevice`]
/// ([`SeedingDevice::batch`]), all screened in one launch a step.
pub(crate) trait BatchScreen {
    /// Per group with an ask that the device took, per spike: bit t set when
    /// a candidate of tile t (`cand[16t..16t+16]`, at most 8 tiles) may beat
    /// the spike's v0 (`v0[g]`): a superset of the pairs whose float32 gain
    /// 2x·c − ‖c‖² is above v0. `None` for the other groups. `changed[g]`
    /// lists the (spike, v0) that changed since the last call (a device may
    /// keep v0 and update it from these alone).
    fn flags(
        &mut self,
        v0: &[&[f32]],
        changed: &[&[(u32, f32)]],
        asks: &[Option<Ask>],
    ) -> Vec<Option<Vec<u8>>>;
}

/// Makes the device screens.
pub(crate) trait ScreenFactory: Send + Sync {
    /// The screens of the groups `groups[g]` = (features n × dim float32,
    /// dim, ‖x‖²) with `taken[g]` (checked by [`SeedingDevice::takes`]).
    fn batch(&self, groups: &[(&[f32], usize, &[f32])], taken: &[bool]) -> Box<dyn BatchScreen>;
    /// The device, in words.
    fn name(&self) -> String;
    /// The seeding of the groups `(features n × dim, dim)` with every gain
    /// on the device ([`super::lockstep`]); `None` where the device cannot
    /// (no float64).
    fn exact(&self, _groups: &[(&[f32], usize)]) -> Option<Box<dyn ExactSteps>> {
        None
    }
}

/// Where the seeding screens its pairs: on the CPU (default) or on a GPU
/// (the sort's CUDA or wgpu device). The labels are the same bytes either
/// way, so two settings that differ only here compare equal, and the choice
/// is not serialised.
#[derive(Clone, Default)]
pub struct SeedingDevice(Option<Arc<dyn ScreenFactory>>, usize, usize);

/// Most spikes a device seeds at once by default
/// ([`SeedingDevice::with_batch_spikes`]).
pub const DEVICE_BATCH_SPIKES: usize = 4_000_000;

/// Groups with fewer spikes than this are screened on the CPU even when a
/// device is set ([`SeedingDevice::with_min_spikes`] sets another bound): a
/// step's round trip to the device costs more than their screen there.
pub const DEVICE_MIN_SPIKES: usize = 0;

impl fmt::Debug for SeedingDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(d) => write!(f, "SeedingDevice({})", d.name()),
            None => write!(f, "SeedingDevice(cpu)"),
        }
    }
}

impl PartialEq for SeedingDevice {
    /// Always equal: the device does not change a label.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl SeedingDevice {
    /// The CPU screen.
    pub fn cpu() -> Self {
        SeedingDevice(None, 0, DEVICE_BATCH_SPIKES)
    }

    /// Whether a GPU screens the pairs.
    pub fn is_device(&self) -> bool {
        self.0.is_some()
    }

    /// The device, in words ("cpu" for the CPU screen).
    pub fn name(&self) -> String {
        self.0.as_ref().map_or_else(|| "cpu".into(), |d| d.name())
    }

    /// The screen on the first CUDA device.
    #[cfg(feature = "cuda")]
    pub fn cuda() -> Self {
        let device = crate::backend::cuda_device();
        SeedingDevice(
            Some(Arc::new(CubeScreens::<cubecl::cuda::CudaRuntime>::new(
                &device, "cuda",
            ))),
            DEVICE_MIN_SPIKES,
            DEVICE_BATCH_SPIKES,
        )
    }

    /// The screen on wgpu's default device.
    #[cfg(feature = "wgpu")]
    pub fn wgpu() -> Self {
        let device = cubecl::wgpu::WgpuDevice::DefaultDevice;
        SeedingDevice(
            Some(Arc::new(CubeScreens::<cubecl::wgpu::WgpuRuntime>::new(
                &device, "wgpu",
            ))),
            DEVICE_MIN_SPIKES,
            DEVICE_BATCH_SPIKES,
        )
    }

    /// A device screen made by `factory` (tests: screens on the CPU).
    #[cfg(test)]
    pub(crate) fn from_factory(factory: Arc<dyn ScreenFactory>) -> Self {
        SeedingDevice(Some(factory), 0, DEVICE_BATCH_SPIKES)
    }

    /// The same device, taking only groups of at least `n` spikes (the
    /// others are screened on the CPU; the labels are the same).
    pub fn with_min_spikes(self, n: usize) -> Self {
        SeedingDevice(self.0, n, self.2)
    }

    /// The same device, clustering at most `n` spikes at once when it seeds
    /// every gain (default [`DEVICE_BATCH_SPIKES`]: the groups, largest
    /// first, go in batches of at most n spikes, a larger group alone; the
    /// labels are the same). Bounds the device and host memory of a
    /// clustering.
    pub fn with_batch_spikes(self, n: usize) -> Self {
        SeedingDevice(self.0, self.1, n.max(1))
    }

    /// Most spikes clustered at once ([`SeedingDevice::with_batch_spikes`]).
    pub fn batch_spikes(&self) -> usize {
        self.2
    }

    /// Whether a device is set and takes a group of features `xd` (n × `dim`):
    /// at least as many spikes as [`SeedingDevice::with_min_spikes`] asks, not wider than
    /// [`MAX_DEVICE_DIM`], every feature finite and not too large.
    pub(crate) fn takes(&self, xd: &[f32], dim: usize) -> bool {
        self.0.is_some()
            && dim > 0
            && dim <= MAX_DEVICE_DIM
            && xd.len().is_multiple_of(dim)
            && !xd.is_empty()
            && xd.len() / dim >= self.1
            && xd.iter().all(|v| v.is_finite() && v.abs() <= MAX_ABS)
    }

    /// The device's seeding of `groups` with every gain computed there
    /// ([`super::lockstep`]), when a device is set, can, and each group is
    /// one it [`takes`](SeedingDevice::takes).
    pub(crate) fn exact(&self, groups: &[(&[f32], usize)]) -> Option<Box<dyn ExactSteps>> {
        if groups.iter().any(|&(x, dim)| !self.takes(x, dim)) {
            return None;
        }
        self.exact_taken(groups)
    }

    /// [`SeedingDevice::exact`] of groups already checked with
    /// [`SeedingDevice::takes`].
    pub(crate) fn exact_taken(&self, groups: &[(&[f32], usize)]) -> Option<Box<dyn ExactSteps>> {
        self.0.as_ref()?.exact(groups)
    }

    /// The device screens of the groups `taken` ([`SeedingDevice::takes`]);
    /// `None` without a device or when it takes none.
    pub(crate) fn batch(
        &self,
        groups: &[(&[f32], usize, &[f32])],
        taken: &[bool],
    ) -> Option<Box<dyn BatchScreen>> {
        let d = self.0.as_ref()?;
        if !taken.iter().any(|&t| t) {
            return None;
        }
        Some(d.batch(groups, taken))
    }
}

/// The slack factor of the screen's bound for `dim` features: two float32
/// evaluations of 2x·c − ‖c‖² (dot products summed in any order, fused or
/// not, then the subtraction rounded) differ by at most
/// 2(γ_dim·2‖x‖‖c‖ + u(2‖x‖‖c‖ + ‖c‖²)) ≤ 2(dim + 1)·u·1.01·(‖x‖² + 2‖c‖²)
/// (u = 2⁻²⁴, γ_dim = dim·u/(1 − dim·u)); the device compares
/// t > v0 − f·(‖x‖² + 2‖c‖² + |v0|) with f four times that, which also
/// covers the float32 rounding of the bound, of the norms and of the
/// comparison's own subtraction; 10⁻³⁰ more covers products that a device
/// flushes to zero below float32's normal range.
#[cfg(any(feature = "cuda", feature = "wgpu", test))]
pub(crate) fn slack_factor(dim: usize) -> f32 {
    (8.0 * (dim as f64 + 4.0) * f64::from(f32::EPSILON) / 2.0) as f32
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub(crate) use cube::CubeScreens;

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube {
    use cubecl::prelude::*;
    use cubecl::server::Handle;

    use super::{Ask, BatchScreen, MAX_DEVICE_DIM, SCREEN_TILE, ScreenFactory, slack_factor};

    /// Units (spikes) per cube of [`screen_kernel`].
    const UNITS: usize = 128;

    /// flags\[r\] = Σ_t 2^t·\[any candidate c of tile t has
    /// 2·(x·c) − cn\[c\] > v0\[r\] − f_g·(xn\[r\] + 2cn\[c\] + |v0\[r\]|) + 10⁻³⁰\]
    /// for the spikes of several groups at once. Group g's spikes are rows
    /// `row0[g]`‥ (padded to whole cubes: cube `c` serves group
    /// `cube_group[c]`, its spikes from `(c − row0[g]/UNITS)·UNITS`), its
    /// features from `x_off[g]` (feature-major: dim\[g\] × n\[g\], so that a
    /// warp's loads of one feature are contiguous), its candidates (spike rows
    /// of the group) `cand[c_off[g]‥c_off[g] + nf[g]]` with ‖c‖² in `cn`;
    /// the candidates of a tile are staged in shared memory
    /// ([`SCREEN_TILE`] × `max_dim`). One unit per spike.
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn screen_kernel(
        x: &Array<f32>,
        xn: &Array<f32>,
        v0: &Array<f32>,
        cand: &Array<u32>,
        cn: &Array<f32>,
        cube_group: &Array<u32>,
        table: &Array<u32>,
        slack: &Array<f32>,
        flags: &mut Array<u32>,
        #[comptime] max_dim: usize,
    ) {
        let mut cs = SharedMemory::<f32>::new(comptime!(SCREEN_TILE * max_dim));
        let u = UNIT_POS_X as usize;
        let cube = CUBE_POS_X as usize;
        let g = cube_group[cube] as usize;
        // table: row0, n, dim, x_off, c_off, nf per group.
        let row0 = table[g * 6] as usize;
        let n = table[g * 6 + 1] as usize;
        let dim = table[g * 6 + 2] as usize;
        let x_off = table[g * 6 + 3] as usize;
        let c_off = table[g * 6 + 4] as usize;
        let nf = table[g * 6 + 5] as usize;
        let f = slack[g];
        let s = (cube - row0 / UNITS) * UNITS + u;
        let r = row0 + s;
        let live = s < n;
        let mut e = 0.0f32;
        let mut xs = 0.0f32;
        if live {
            e = v0[r];
            xs = xn[r];
        }
        let mut ae = e;
        if e < 0.0f32 {
            ae = -e;
        }
        let ntiles = nf.div_ceil(SCREEN_TILE);
        let mut bits = 0u32;
        for tile in 0..ntiles {
            let mut i = u;
            while i < SCREEN_TILE * dim {
                let l = i % SCREEN_TILE;
                let k = i / SCREEN_TILE;
                let c = tile * SCREEN_TILE + l;
                let mut v = 0.0f32;
                if c < nf {
                    v = x[x_off + k * n + cand[c_off + c] as usize];
                }
                cs[i] = v;
                i += UNITS;
            }
            sync_cube();
            if live {
                let mut acc = Array::<f32>::new(SCREEN_TILE);
                #[unroll]
                for l in 0..SCREEN_TILE {
                    acc[l] = 0.0f32;
                }
                for k in 0..dim {
                    let xv = x[x_off + k * n + s];
                    #[unroll]
                    for l in 0..SCREEN_TILE {
                        acc[l] += xv * cs[k * SCREEN_TILE + l];
                    }
                }
                #[unroll]
                for l in 0..SCREEN_TILE {
                    let c = tile * SCREEN_TILE + l;
                    if c < nf {
                        let cc = cn[c_off + c];
                        let t = 2.0f32 * acc[l] - cc;
                        let sl = f * (xs + 2.0f32 * cc + ae) + 1e-30f32;
                        if t > e - sl {
                            bits |= 1u32 << tile as u32;
                        }
                    }
                }
            }
            sync_cube();
        }
        if live {
            flags[r] = bits;
        }
    }

    /// v0\[idx\[i\]\] = val\[i\] for i < `count` (distinct indices).
    #[cube(launch_unchecked)]
    pub(crate) fn scatter_kernel(
        idx: &Array<u32>,
        val: &Array<f32>,
        v0: &mut Array<f32>,
        count: u32,
    ) {
        let i = ABSOLUTE_POS_X as usize;
        if i < count as usize {
            let j = idx[i] as usize;
            v0[j] = val[i];
        }
    }

    /// packed\[w\] = the low bytes of flags\[4w‥4w + 4\], little-endian (one byte a
    /// spike: at most 8 tiles).
    #[cube(launch_unchecked)]
    pub(crate) fn pack_kernel(flags: &Array<u32>, packed: &mut Array<u32>, words: u32) {
        let w = ABSOLUTE_POS_X as usize;
        if w < words as usize {
            let b = w * 4;
            packed[w] = (flags[b] & 255u32)
                | ((flags[b + 1] & 255u32) << 8u32)
                | ((flags[b + 2] & 255u32) << 16u32)
                | ((flags[b + 3] & 255u32) << 24u32);
        }
    }

    /// Device screens on one CubeCL device.
    pub(crate) struct CubeScreens<R: Runtime> {
        client: ComputeClient<R>,
        name: String,
    }

    impl<R: Runtime> CubeScreens<R> {
        pub(crate) fn new(device: &R::Device, backend: &str) -> Self {
            CubeScreens {
                client: R::client(device),
                name: backend.to_string(),
            }
        }
    }

    impl<R: Runtime> ScreenFactory for CubeScreens<R> {
        fn batch(
            &self,
            groups: &[(&[f32], usize, &[f32])],
            taken: &[bool],
        ) -> Box<dyn BatchScreen> {
            // Taken groups, their rows padded to whole cubes.
            let mut slots = Vec::new();
            let mut cube_group = Vec::new();
            let (mut rows, mut x_len, mut max_dim) = (0usize, 0usize, 32usize);
            let mut x = Vec::new();
            let mut xn = Vec::new();
            for (g, (&(xd, dim, vtot), &on)) in groups.iter().zip(taken).enumerate() {
                if !on {
                    continue;
                }
                let n = vtot.len();
                let cubes = n.div_ceil(UNITS);
                let slot = slots.len();
                slots.push(Slot {
                    group: g,
                    row0: rows,
                    n,
                    dim,
                    x_off: x_len,
                });
                cube_group.extend(std::iter::repeat_n(slot as u32, cubes));
                for k in 0..dim {
                    x.extend(xd.iter().skip(k).step_by(dim));
                }
                xn.extend_from_slice(vtot);
                xn.resize(rows + cubes * UNITS, 0.0);
                rows += cubes * UNITS;
                x_len += xd.len();
                max_dim = max_dim.max(dim.div_ceil(32) * 32);
            }
            let slack: Vec<f32> = slots.iter().map(|s| slack_factor(s.dim)).collect();
            let c = &self.client;
            Box::new(CubeBatch::<R> {
                x: c.create_from_slice(f32::as_bytes(&x)),
                x_len,
                xn: c.create_from_slice(f32::as_bytes(&xn)),
                cube_group: c.create_from_slice(u32::as_bytes(&cube_group)),
                slack: c.create_from_slice(f32::as_bytes(&slack)),
                flags: c.empty(rows.max(1) * 4),
                packed: c.empty((rows / 4).max(1) * 4),
                v0: c.create_from_slice(f32::as_bytes(&vec![0f32; rows.max(1)])),
                client: c.clone(),
                rows,
                n_cubes: cube_group.len(),
                max_dim: max_dim.min(MAX_DEVICE_DIM),
                n_groups: groups.len(),
                slots,
            })
        }

        fn name(&self) -> String {
            self.name.clone()
        }

        fn exact(&self, groups: &[(&[f32], usize)]) -> Option<Box<dyn super::ExactSteps>> {
            let s = super::super::lockstep::CubeSteps::<R>::new(&self.client, groups)?;
            Some(Box::new(s))
        }
    }

    /// A taken group's place in the batch.
    struct Slot {
        group: usize,
        row0: usize,
        n: usize,
        dim: usize,
        x_off: usize,
    }

    /// The taken groups' features on the device.
    struct CubeBatch<R: Runtime> {
        client: ComputeClient<R>,
        x: Handle,
        x_len: usize,
        xn: Handle,
        cube_group: Handle,
        slack: Handle,
        flags: Handle,
        /// `flags` packed one byte a spike.
        packed: Handle,
        /// Each spike's v0, kept up to date from the changes.
        v0: Handle,
        rows: usize,
        n_cubes: usize,
        max_dim: usize,
        n_groups: usize,
        slots: Vec<Slot>,
    }

    impl<R: Runtime> BatchScreen for CubeBatch<R> {
        fn flags(
            &mut self,
            _v0: &[&[f32]],
            changed: &[&[(u32, f32)]],
            asks: &[Option<Ask>],
        ) -> Vec<Option<Vec<u8>>> {
            let mut out: Vec<Option<Vec<u8>>> = vec![None; self.n_groups];
            let (mut cand, mut cn) = (Vec::new(), Vec::new());
            let (mut idx, mut val) = (Vec::new(), Vec::new());
            let mut table = Vec::with_capacity(self.slots.len() * 6);
            let mut any = false;
            for s in &self.slots {
                let ask = asks[s.group].as_ref().filter(|a| !a.0.is_empty());
                let nf = ask.map_or(0, |a| a.0.len().min(a.1.len()).min(8 * SCREEN_TILE));
                for &(i, v) in changed[s.group] {
                    idx.push((s.row0 + i as usize) as u32);
                    val.push(v);
                }
                table.extend_from_slice(&[
                    s.row0 as u32,
                    s.n as u32,
                    s.dim as u32,
                    s.x_off as u32,
                    cand.len() as u32,
                    nf as u32,
                ]);
                if let Some(a) = ask {
                    cand.extend_from_slice(&a.0[..nf]);
                    cn.extend_from_slice(&a.1[..nf]);
                    any = true;
                }
            }
            let c = &self.client;
            let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
            if !idx.is_empty() {
                // The same spike may have changed at several steps: keep the
                // last value of each, so that the scatter's writes are distinct.
                let mut last = std::collections::HashMap::with_capacity(idx.len());
                for (k, &i) in idx.iter().enumerate() {
                    last.insert(i, k);
                }
                let mut pairs: Vec<(u32, f32)> =
                    last.into_iter().map(|(i, k)| (i, val[k])).collect();
                pairs.sort_unstable_by_key(|p| p.0);
                let ih: Vec<u32> = pairs.iter().map(|p| p.0).collect();
                let vh: Vec<f32> = pairs.iter().map(|p| p.1).collect();
                let ihd = c.create_from_slice(u32::as_bytes(&ih));
                let vhd = c.create_from_slice(f32::as_bytes(&vh));
                // SAFETY: every index is a row of a taken group (< rows).
                unsafe {
                    scatter_kernel::launch_unchecked::<R>(
                        c,
                        CubeCount::Static(ih.len().div_ceil(256) as u32, 1, 1),
                        CubeDim::new_1d(256),
                        arr(&ihd, ih.len()),
                        arr(&vhd, vh.len()),
                        arr(&self.v0, self.rows.max(1)),
                        ih.len() as u32,
                    );
                }
            }
            if !any {
                return out;
            }
            let ch = c.create_from_slice(u32::as_bytes(&cand));
            let cnh = c.create_from_slice(f32::as_bytes(&cn));
            let th = c.create_from_slice(u32::as_bytes(&table));
            // SAFETY: each cube reads its own group's rows (below row0 + its
            // padded rows), features (x_off + n·dim ≤ x_len), candidates
            // (c_off + nf ≤ cand.len(), rows below n) and table entries.
            unsafe {
                screen_kernel::launch_unchecked::<R>(
                    c,
                    CubeCount::Static(self.n_cubes as u32, 1, 1),
                    CubeDim::new_1d(UNITS as u32),
                    arr(&self.x, self.x_len),
                    arr(&self.xn, self.rows),
                    arr(&self.v0, self.rows),
                    arr(&ch, cand.len()),
                    arr(&cnh, cn.len()),
                    arr(&self.cube_group, self.n_cubes),
                    arr(&th, table.len()),
                    arr(&self.slack, self.slots.len()),
                    arr(&self.flags, self.rows),
                    self.max_dim,
                );
            }
            let words = self.rows / 4;
            // SAFETY: rows is a multiple of 4 (whole cubes of UNITS).
            unsafe {
                pack_kernel::launch_unchecked::<R>(
                    c,
                    CubeCount::Static(words.div_ceil(256) as u32, 1, 1),
                    CubeDim::new_1d(256),
                    arr(&self.flags, self.rows),
                    arr(&self.packed, words.max(1)),
                    words as u32,
                );
            }
            let data = c.read(vec![self.packed.clone()]);
            let all: &[u8] = &data[0];
            for s in &self.slots {
                if asks[s.group].as_ref().is_some_and(|a| !a.0.is_empty()) {
                    out[s.group] = Some(all[s.row0..s.row0 + s.n].to_vec());
                }
            }
            out
        }
    }
}
