//! The device high-pass as a circular forward–backward IIR, GPU twin of
//! [`CircularIir`]: Kilosort4's zero-phase high-pass at about 14
//! multiply-adds per sample instead of the direct kernel's ~1000 taps
//! ([`super::preprocess::highpass_kernel`]).
//!
//! Two launches, one unit per (row, chunk of C outputs) each, in stream order:
//! * [`iir_forward_kernel`]: x (C × N f32, the CAR's output) → u (C × N, in the
//!   state type F), [`CircularIir::forward_chunk`];
//! * [`iir_backward_kernel`]: u → y (C × N f32), [`CircularIir::backward_chunk`].
//!
//! u lives in the detector's filter-bank buffer B (C × 6 × N f32, idle during
//! preprocessing and rewritten by step 1 later in stream order), so the IIR takes
//! no device memory of its own beyond its 8 coefficients (and the −0.0 of
//! [`super::exact::product`]).
//!
//! F is f64 where the device has doubles ([`supports_f64`]: CUDA, and wgpu
//! adapters with `SHADER_F64`, lavapipe among them): the result is the CPU
//! twin's within f64 rounding (bit-identical on lavapipe), and the CPU's FFT
//! high-pass within 8.4e-7 of max|x| (measured on the twin,
//! `src/preprocess/highpass_iir.rs`). F = f32 ([`HighpassMode::IirF32`]) is for
//! testing the indexing: the recursion's rounding then reaches 3e-4 of max|x|,
//! beyond the device preprocessing's tolerance, so it is never chosen by itself.
//!
//! Each unit walks its stretch of one row sequentially (L + C samples per
//! direction); units of a plane hold consecutive chunks of one row. x and y are
//! row-major, so a plane's loads and stores of them touch one sector per unit
//! (loads are then served from L1 for the next samples); u is stored
//! chunk-interleaved ([`u_index`]: position kC + j at j·n_chunks + k), so that
//! the plane's stores (forward) and loads (backward) of u are contiguous.

use cubecl::prelude::*;

use super::exact::product;
use cubecl::server::Handle;

use crate::error::DetectError;
use crate::preprocess::{CircularIir, DevicePreprocessing};

/// Units per cube of the IIR kernels: small cubes, so that the few thousand
/// units of a window (C × N / [`IIR_CHUNK`](crate::preprocess::IIR_CHUNK)) spread over every SM.
pub const IIR_UNITS: usize = 64;

/// Which high-pass the device runs ([`super::GpuOptions::highpass`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HighpassMode {
    /// The IIR with f64 state where the device has doubles and the
    /// preprocessing offers it ([`DevicePreprocessing::iir`]), else the direct kernel.
    #[default]
    Auto,
    /// Always the direct kernel.
    Direct,
    /// The IIR with f64 state; where it is unavailable (no doubles, or no IIR
    /// form), the direct kernel with a warning.
    Iir,
    /// The IIR with f32 state (for testing the kernels' indexing on devices
    /// without doubles; 3e-4 of max|x| off the CPU), where the preprocessing
    /// offers the IIR form, else the direct kernel with a warning.
    IirF32,
}

impl HighpassMode {
    /// The mode named by the environment variable `SPIKECUBE_HIGHPASS`
    /// (`direct`, `iir`, `iir-f32`; for measuring), else [`HighpassMode::Auto`].
    pub fn from_env() -> Self {
        match std::env::var("SPIKECUBE_HIGHPASS").as_deref() {
            Ok("direct") => HighpassMode::Direct,
            Ok("iir") => HighpassMode::Iir,
            Ok("iir-f32") => HighpassMode::IirF32,
            _ => HighpassMode::Auto,
        }
    }
}

pub use crate::preprocess::iir_chunk;

/// Whether the device runs f64 arithmetic: CUDA always (CubeCL 0.10's CUDA
/// runtime leaves f64 out of its advertised types, but its compiler emits
/// `double`); others when they advertise f64 (wgpu with `SHADER_F64`).
pub fn supports_f64<R: Runtime>(client: &ComputeClient<R>) -> bool {
    R::name(client) == "cuda"
        || client
            .properties()
            .supports_type(cubecl::ir::ElemType::Float(cubecl::ir::FloatKind::F64))
}

/// Forward pass: unit (r, k) computes u\[r, kC .. kC + len\] (len = C, or what
/// is left of the row) from zero state at x\[r, (kC + lead) mod N\], with
/// `lead` = (s + N − L mod N) mod N: L warm-up steps, then len kept ones.
/// `coef`: b\[0..4\], a\[0..4\], −0.0. u is stored chunk-interleaved (see
/// [`u_index`]), so that the units of a plane, on consecutive chunks of a row,
/// store to consecutive addresses.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn iir_forward_kernel<F: Float>(
    x: &Array<f32>,
    coef: &Array<F>,
    u: &mut Array<F>,
    n_units: u32,
    n_t: u32,
    chunk: u32,
    n_chunks: u32,
    warm: u32,
    lead: u32,
) {
    let id = ABSOLUTE_POS;
    if id < n_units as usize {
        let n = n_t as usize;
        let nc = n_chunks as usize;
        let k = id % nc;
        let row = (id / nc) * n;
        // Row r of u: C·n_chunks values, position kC + i at i·n_chunks + k.
        let urow = (id / nc) * (chunk as usize * nc) + k;
        let start = k * chunk as usize;
        let len = min(chunk as usize, n - start);
        let b0 = coef[0];
        let b1 = coef[1];
        let b2 = coef[2];
        let b3 = coef[3];
        let a1 = coef[5];
        let a2 = coef[6];
        let a3 = coef[7];
        let nz = coef[8];
        let mut z0 = F::new(0.0);
        let mut z1 = F::new(0.0);
        let mut z2 = F::new(0.0);
        let mut p = (start + lead as usize) % n;
        for _ in 0..warm as usize {
            let xn = F::cast_from(x[row + p]);
            let yn = product::<F>(b0, xn, nz) + z0;
            z0 = z1 + product::<F>(b1, xn, nz) - product::<F>(a1, yn, nz);
            z1 = z2 + product::<F>(b2, xn, nz) - product::<F>(a2, yn, nz);
            z2 = product::<F>(b3, xn, nz) - product::<F>(a3, yn, nz);
            p += 1;
            if p == n {
                p = 0;
            }
        }
        for i in 0..len {
            let xn = F::cast_from(x[row + p]);
            let yn = product::<F>(b0, xn, nz) + z0;
            z0 = z1 + product::<F>(b1, xn, nz) - product::<F>(a1, yn, nz);
            z1 = z2 + product::<F>(b2, xn, nz) - product::<F>(a2, yn, nz);
            z2 = product::<F>(b3, xn, nz) - product::<F>(a3, yn, nz);
            u[urow + i * nc] = yn;
            p += 1;
            if p == n {
                p = 0;
            }
        }
    }
}

/// Where position p of row r of u is stored, for chunks of C outputs and
/// `n_chunks` chunks per row: r·C·n_chunks + (p mod C)·n_chunks + ⌊p / C⌋ (the
/// chunk-interleaved layout of [`iir_forward_kernel`]; host-side, for tests and docs).
pub fn u_index(r: usize, p: usize, chunk: usize, n_chunks: usize) -> usize {
    r * chunk * n_chunks + (p % chunk) * n_chunks + p / chunk
}

/// Backward pass: unit (r, k) computes y\[r, kC .. kC + len\] from zero state at
/// u\[r, (kC + len − 1 + L) mod N\], running down: L warm-up steps over the next
/// chunks' u, then len kept ones. `coef` and u's layout as [`iir_forward_kernel`].
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn iir_backward_kernel<F: Float>(
    u: &Array<F>,
    coef: &Array<F>,
    y: &mut Array<f32>,
    n_units: u32,
    n_t: u32,
    chunk: u32,
    n_chunks: u32,
    warm: u32,
) {
    let id = ABSOLUTE_POS;
    if id < n_units as usize {
        let n = n_t as usize;
        let nc = n_chunks as usize;
        let cl = chunk as usize;
        let row = (id / nc) * n;
        let urow = (id / nc) * (cl * nc);
        let start = (id % nc) * cl;
        let len = min(cl, n - start);
        let b0 = coef[0];
        let b1 = coef[1];
        let b2 = coef[2];
        let b3 = coef[3];
        let a1 = coef[5];
        let a2 = coef[6];
        let a3 = coef[7];
        let nz = coef[8];
        let mut z0 = F::new(0.0);
        let mut z1 = F::new(0.0);
        let mut z2 = F::new(0.0);
        // Position p = kk·C + j, walked down with (kk, j) kept alongside.
        let mut p = (start + len - 1 + warm as usize) % n;
        let mut kk = p / cl;
        let mut j = p % cl;
        for _ in 0..warm as usize {
            let xn = u[urow + j * nc + kk];
            let yn = product::<F>(b0, xn, nz) + z0;
            z0 = z1 + product::<F>(b1, xn, nz) - product::<F>(a1, yn, nz);
            z1 = z2 + product::<F>(b2, xn, nz) - product::<F>(a2, yn, nz);
            z2 = product::<F>(b3, xn, nz) - product::<F>(a3, yn, nz);
            if p == 0 {
                p = n;
                kk = (n - 1) / cl;
                j = (n - 1) % cl + 1;
            } else if j == 0 {
                j = cl;
                kk -= 1;
            }
            p -= 1;
            j -= 1;
        }
        for _ in 0..len {
            let xn = u[urow + j * nc + kk];
            let yn = product::<F>(b0, xn, nz) + z0;
            z0 = z1 + product::<F>(b1, xn, nz) - product::<F>(a1, yn, nz);
            z1 = z2 + product::<F>(b2, xn, nz) - product::<F>(a2, yn, nz);
            z2 = product::<F>(b3, xn, nz) - product::<F>(a3, yn, nz);
            y[row + p] = f32::cast_from(yn);
            if p == 0 {
                p = n;
                kk = (n - 1) / cl;
                j = (n - 1) % cl + 1;
            } else if j == 0 {
                j = cl;
                kk -= 1;
            }
            p -= 1;
            j -= 1;
        }
    }
}

/// The IIR high-pass set up on a device: the form, the state type, the chunk
/// length and the coefficients' buffer.
pub(crate) struct DeviceIir {
    iir: CircularIir,
    f64: bool,
    chunk: usize,
    coef: Handle,
}

impl DeviceIir {
    /// The IIR for `form` under `mode` on `client`'s device, or `None` for the
    /// direct kernel (see [`HighpassMode`]); chunks of [`iir_chunk`] outputs.
    pub(crate) fn select<R: Runtime>(
        client: &ComputeClient<R>,
        form: &DevicePreprocessing,
        mode: HighpassMode,
    ) -> Option<Self> {
        if mode == HighpassMode::Direct {
            return None;
        }
        let Some(iir) = form.iir.clone() else {
            if mode != HighpassMode::Auto {
                tracing::warn!(
                    "SPIKECUBE_HIGHPASS / GpuOptions asks for the IIR high-pass, but this window length ({}) or kernel has no IIR form: the direct kernel runs",
                    form.n
                );
            }
            return None;
        };
        let f64 = match mode {
            HighpassMode::IirF32 => false,
            _ if supports_f64(client) => true,
            HighpassMode::Iir => {
                tracing::warn!(
                    "the IIR high-pass needs f64 arithmetic, which this device lacks: the direct kernel runs"
                );
                return None;
            }
            _ => return None,
        };
        let chunk = iir_chunk();
        // b[0..4], a[0..4], then the −0.0 of `exact::product`.
        let c: Vec<f64> = iir
            .b
            .iter()
            .chain(&iir.a)
            .copied()
            .chain([super::exact::NEG_ZERO_F64])
            .collect();
        let coef = if f64 {
            client.create_from_slice(f64::as_bytes(&c))
        } else {
            let c32: Vec<f32> = c.iter().map(|&v| v as f32).collect();
            client.create_from_slice(f32::as_bytes(&c32))
        };
        Some(DeviceIir {
            iir,
            f64,
            chunk,
            coef,
        })
    }

    /// Name of this form for logs: `iir-f64` or `iir-f32`.
    pub(crate) fn name(&self) -> &'static str {
        if self.f64 { "iir-f64" } else { "iir-f32" }
    }

    /// Launches both passes: `x` (C × N f32) → `y` (C × N f32), u in `scratch`,
    /// which must hold C rows of C·⌈N/C⌉ < 2N values of the state type ([`u_index`];
    /// the filter bank's buffer B holds C × 3N f64).
    ///
    /// # Errors
    /// [`DetectError::Input`] when N is not the form's or a buffer is too small.
    pub(crate) fn launch<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        x: &Handle,
        scratch: &Handle,
        y: &Handle,
        c: usize,
        n_t: usize,
    ) -> Result<(), DetectError> {
        let width = if self.f64 { 8 } else { 4 };
        let chunk = self.chunk.min(n_t.max(1));
        let n_chunks = n_t.div_ceil(chunk);
        // u's rows are C·n_chunks < N + C ≤ 2N long (chunk-interleaved).
        let u_len = c * chunk * n_chunks;
        let needs = [(x, c * n_t * 4), (scratch, u_len * width), (y, c * n_t * 4)];
        if n_t != self.iir.n || needs.iter().any(|&(h, bytes)| (h.size() as usize) < bytes) {
            return Err(DetectError::Input {
                what: "high-pass window".into(),
                message: format!(
                    "{c} × {n_t} does not fit the IIR set up for N = {} or its buffers",
                    self.iir.n
                ),
            });
        }
        let n_units = c * n_chunks;
        let lead = (self.iir.shift + n_t - self.iir.warm % n_t) % n_t;
        let len = c * n_t;
        let shape = IirShape {
            n_units,
            n_t,
            chunk,
            n_chunks,
            warm: self.iir.warm,
            lead,
        };
        // SAFETY: unit id < n_units = C·⌈N/chunk⌉ reads and writes indices
        // r·N + p with r < C and p < N of x and y (≥ C·N elements each) and
        // r·chunk·n_chunks + j·n_chunks + k with j < chunk, k < n_chunks of u
        // (≥ u_len elements), all checked above, and coefficients 0..9.
        unsafe {
            if self.f64 {
                launch_passes::<f64, R>(client, x, &self.coef, scratch, y, len, u_len, &shape);
            } else {
                launch_passes::<f32, R>(client, x, &self.coef, scratch, y, len, u_len, &shape);
            }
        }
        Ok(())
    }
}

/// The sizes both passes are launched with ([`DeviceIir::launch`]).
struct IirShape {
    n_units: usize,
    n_t: usize,
    chunk: usize,
    n_chunks: usize,
    warm: usize,
    lead: usize,
}

/// Launches [`iir_forward_kernel`] then [`iir_backward_kernel`] with state type `F`.
///
/// # Safety
/// `x` and `y` hold `len` and `scratch` `u_len` values that every index the
/// kernels compute for `shape` stays within (checked by [`DeviceIir::launch`]).
#[allow(clippy::too_many_arguments)]
unsafe fn launch_passes<F: Float, R: Runtime>(
    client: &ComputeClient<R>,
    x: &Handle,
    coef: &Handle,
    scratch: &Handle,
    y: &Handle,
    len: usize,
    u_len: usize,
    shape: &IirShape,
) {
    let count = CubeCount::Static(shape.n_units.div_ceil(IIR_UNITS) as u32, 1, 1);
    let dim = CubeDim::new_1d(IIR_UNITS as u32);
    let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
    // SAFETY: as this function's contract.
    unsafe {
        iir_forward_kernel::launch_unchecked::<F, R>(
            client,
            count.clone(),
            dim,
            arr(x, len),
            arr(coef, 9),
            arr(scratch, u_len),
            shape.n_units as u32,
            shape.n_t as u32,
            shape.chunk as u32,
            shape.n_chunks as u32,
            shape.warm as u32,
            shape.lead as u32,
        );
        iir_backward_kernel::launch_unchecked::<F, R>(
            client,
            count,
            dim,
            arr(scratch, u_len),
            arr(coef, 9),
            arr(y, len),
            shape.n_units as u32,
            shape.n_t as u32,
            shape.chunk as u32,
            shape.n_chunks as u32,
            shape.warm as u32,
        );
    }
}
