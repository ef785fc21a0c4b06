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

/// Candidates per tile of the device screen: one bit of a spike's flags
/// (the CPU seeding's tile width).
pub(crate) const SCREEN_TILE: usize = 16;

/// Largest feature dimension the device screen takes (its tile of candidates
/// is staged in 16 KB of shared memory); wider groups are screened on the CPU.
pub const MAX_DEVICE_DIM: usize = 256;

/// Largest |feature| the device screen takes (as the CPU screen): beyond it a
/// float32 dot product could overflow.
const MAX_ABS: f32 = 1e15;

/// The screen of one group on a device, made by a [`SeedingDevice`].
pub(crate) trait GroupScreen {
    /// Per spike, bit t set when a candidate of tile t (`cand[16t..16t+16]`)
    /// may beat the spike's `v0` (n values): a superset of the pairs whose
    /// float32 gain 2x·c − ‖c‖² is above v0. `cand` are spike rows of the
    /// group, `cn` their ‖c‖² as the CPU computes them (same length).
    fn flags(&mut self, v0: &[f32], cand: &[u32], cn: &[f32]) -> Vec<u32>;
}

/// Makes the device screens of groups.
pub(crate) trait ScreenFactory: Send + Sync {
    /// The screen of a group's features `xd` (n × `dim`, float32) with their
    /// ‖x‖² `xn`, or `None` when the device does not take it (too wide, a
    /// feature not finite or too large).
    fn group(&self, xd: &[f32], dim: usize, xn: &[f32]) -> Option<Box<dyn GroupScreen>>;
    /// The device, in words.
    fn name(&self) -> String;
}

/// Where the seeding screens its pairs: on the CPU (default) or on a GPU
/// (the sort's CUDA or wgpu device). The labels are the same bytes either
/// way, so two settings that differ only here compare equal, and the choice
/// is not serialised.
#[derive(Clone, Default)]
pub struct SeedingDevice(Option<Arc<dyn ScreenFactory>>);

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
        SeedingDevice(None)
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
        let device = cubecl::cuda::CudaDevice::new(0);
        SeedingDevice(Some(Arc::new(
            CubeScreens::<cubecl::cuda::CudaRuntime>::new(&device, "cuda"),
        )))
    }

    /// The screen on wgpu's default device.
    #[cfg(feature = "wgpu")]
    pub fn wgpu() -> Self {
        let device = cubecl::wgpu::WgpuDevice::DefaultDevice;
        SeedingDevice(Some(Arc::new(
            CubeScreens::<cubecl::wgpu::WgpuRuntime>::new(&device, "wgpu"),
        )))
    }

    /// A device screen made by `factory` (tests: screens on the CPU).
    #[cfg(test)]
    pub(crate) fn from_factory(factory: Arc<dyn ScreenFactory>) -> Self {
        SeedingDevice(Some(factory))
    }

    /// The screen of one group, when a device is set and takes it.
    pub(crate) fn group(&self, xd: &[f32], dim: usize, xn: &[f32]) -> Option<Box<dyn GroupScreen>> {
        let d = self.0.as_ref()?;
        if dim == 0
            || dim > MAX_DEVICE_DIM
            || xd.len() != xn.len() * dim
            || xd.iter().any(|v| !v.is_finite() || v.abs() > MAX_ABS)
        {
            return None;
        }
        d.group(xd, dim, xn)
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
pub(crate) fn slack_factor(dim: usize) -> f32 {
    (8.0 * (dim as f64 + 4.0) * f64::from(f32::EPSILON) / 2.0) as f32
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub(crate) use cube::CubeScreens;

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod cube {
    use cubecl::prelude::*;
    use cubecl::server::Handle;

    use super::{GroupScreen, MAX_DEVICE_DIM, SCREEN_TILE, ScreenFactory, slack_factor};

    /// Units (spikes) per cube of [`screen_kernel`].
    const UNITS: usize = 128;

    /// flags\[s\] = Σ_t 2^t·\[any live candidate c of tile t has
    /// 2·(x_s·c) − cn\[c\] > v0\[s\] − f·(xn\[s\] + 2cn\[c\] + |v0\[s\]|)\], the
    /// tiles' candidate rows (`cand`) staged in shared memory
    /// ([`SCREEN_TILE`] × `max_dim`). One unit per spike.
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn screen_kernel(
        x: &Array<f32>,
        xn: &Array<f32>,
        v0: &Array<f32>,
        cand: &Array<u32>,
        cn: &Array<f32>,
        flags: &mut Array<u32>,
        n: u32,
        dim: u32,
        nf: u32,
        f: f32,
        #[comptime] max_dim: usize,
    ) {
        let mut cs = SharedMemory::<f32>::new(comptime!(SCREEN_TILE * max_dim));
        let u = UNIT_POS_X as usize;
        let s = CUBE_POS_X as usize * UNITS + u;
        let n = n as usize;
        let dim = dim as usize;
        let nf = nf as usize;
        let live = s < n;
        let mut e = 0.0f32;
        let mut xs = 0.0f32;
        if live {
            e = v0[s];
            xs = xn[s];
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
                    v = x[cand[c] as usize * dim + k];
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
                    let xv = x[s * dim + k];
                    #[unroll]
                    for l in 0..SCREEN_TILE {
                        acc[l] += xv * cs[k * SCREEN_TILE + l];
                    }
                }
                #[unroll]
                for l in 0..SCREEN_TILE {
                    let c = tile * SCREEN_TILE + l;
                    if c < nf {
                        let cc = cn[c];
                        let t = 2.0f32 * acc[l] - cc;
                        let slack = f * (xs + 2.0f32 * cc + ae) + 1e-30f32;
                        if t > e - slack {
                            bits |= 1u32 << tile as u32;
                        }
                    }
                }
            }
            sync_cube();
        }
        if live {
            flags[s] = bits;
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
        fn group(&self, xd: &[f32], dim: usize, xn: &[f32]) -> Option<Box<dyn GroupScreen>> {
            let n = xn.len();
            if n == 0 || dim > MAX_DEVICE_DIM {
                return None;
            }
            Some(Box::new(CubeGroup::<R> {
                x: self.client.create_from_slice(f32::as_bytes(xd)),
                xn: self.client.create_from_slice(f32::as_bytes(xn)),
                flags: self.client.empty(n * 4),
                client: self.client.clone(),
                n,
                dim,
                // A few compiled sizes: multiples of 32 features.
                max_dim: dim.div_ceil(32) * 32,
            }))
        }

        fn name(&self) -> String {
            self.name.clone()
        }
    }

    /// One group's features on the device.
    struct CubeGroup<R: Runtime> {
        client: ComputeClient<R>,
        x: Handle,
        xn: Handle,
        flags: Handle,
        n: usize,
        dim: usize,
        max_dim: usize,
    }

    impl<R: Runtime> GroupScreen for CubeGroup<R> {
        fn flags(&mut self, v0: &[f32], cand: &[u32], cn: &[f32]) -> Vec<u32> {
            let nf = cand.len().min(cn.len());
            if nf == 0 {
                return vec![0; self.n];
            }
            let v0h = self.client.create_from_slice(f32::as_bytes(v0));
            let ch = self.client.create_from_slice(u32::as_bytes(&cand[..nf]));
            let cnh = self.client.create_from_slice(f32::as_bytes(&cn[..nf]));
            let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
            // SAFETY: every index is below the arrays' lengths: spikes below
            // n, candidates below nf, candidate rows below n (spike rows of
            // the group), features below dim ≤ max_dim.
            unsafe {
                screen_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(self.n.div_ceil(UNITS) as u32, 1, 1),
                    CubeDim::new_1d(UNITS as u32),
                    arr(&self.x, self.n * self.dim),
                    arr(&self.xn, self.n),
                    arr(&v0h, self.n),
                    arr(&ch, nf),
                    arr(&cnh, nf),
                    arr(&self.flags, self.n),
                    self.n as u32,
                    self.dim as u32,
                    nf as u32,
                    slack_factor(self.dim),
                    self.max_dim,
                );
            }
            let data = self.client.read(vec![self.flags.clone()]);
            u32::from_bytes(&data[0]).to_vec()
        }
    }
}
