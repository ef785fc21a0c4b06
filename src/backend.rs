//! Where detection runs: the CPU, or a GPU through CubeCL (CUDA or wgpu), chosen
//! once per run ([`Backend`]) and wrapped in one [`Detector`] with the CPU
//! detector's interface.
//!
//! CubeCL 0.10's CUDA runtime panics on a machine without an NVIDIA driver, and
//! its wgpu runtime panics when no adapter exists, so both are probed first
//! ([`probe_cuda`], [`probe_wgpu`]) and only then asked for a device.

use ndarray::ArrayView2;

use crate::detect::cpu::{CpuDetector, Detections};
use crate::detect::{DetectionSettings, Geometry, UniversalTemplates};
use crate::error::DetectError;

/// Which device runs detection (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// CUDA when a driver and an NVIDIA GPU are present, else a wgpu adapter that
    /// is a real GPU, else the CPU.
    Auto,
    /// Every CPU core (rayon): the reference.
    Cpu,
    /// NVIDIA GPUs through CUDA (feature `cuda`).
    Cuda,
    /// Any GPU through wgpu: Vulkan on Linux and Windows, Metal on macOS (feature `wgpu`).
    Wgpu,
}

impl Backend {
    /// The back ends this build has, in `--backend`'s spelling.
    pub fn compiled() -> Vec<&'static str> {
        let mut v = vec!["auto", "cpu"];
        if cfg!(feature = "cuda") {
            v.push("cuda");
        }
        if cfg!(feature = "wgpu") {
            v.push("wgpu");
        }
        v
    }
}

/// Where compiled GPU kernels are kept between runs: `$SPIKECUBE_KERNEL_CACHE`,
/// else the user's cache folder (`~/.cache/spikecube/kernels` on Linux); `None`
/// when that variable is `off` or the folder cannot be made and written.
/// CUDA kernels are compiled (NVRTC) on first use, about 0.1 s each; kept
/// there, a later run loads them instead (CubeCL's PTX cache, keyed by each
/// kernel's source and settings, so a new spikecube version adds entries and
/// never reads stale ones).
pub fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    let dir = match std::env::var_os("SPIKECUBE_KERNEL_CACHE") {
        Some(v) if v == "off" => return None,
        Some(v) if !v.is_empty() => std::path::PathBuf::from(v),
        _ => dirs::cache_dir()?.join("spikecube").join("kernels"),
    };
    std::fs::create_dir_all(&dir).ok()?;
    // CubeCL stops on a folder it cannot write: try first.
    let probe = dir.join(format!(".write-test-{}", std::process::id()));
    std::fs::write(&probe, b"").ok()?;
    let _ = std::fs::remove_file(&probe);
    Some(dir)
}

/// GPU 0 of CubeCL's CUDA runtime, with its kernel cache set first
/// ([`kernel_cache`]). Every CUDA client a run makes (detection, the
/// clusterings' seeding, the matching) takes its device from here: CubeCL
/// reads its configuration once, when the first client is made, and a
/// client made before the cache is set compiles every kernel again on
/// every run.
#[cfg(feature = "cuda")]
pub fn cuda_device() -> cubecl::cuda::CudaDevice {
    kernel_cache();
    cubecl::cuda::CudaDevice::new(0)
}

/// Points CubeCL's kernel cache at [`kernel_cache_dir`], once, before the
/// CUDA device is opened (no effect when CubeCL's configuration was already
/// read; a `cubecl.toml` naming a cache decides instead). Logs where the
/// kernels are kept, or that they are not.
#[cfg(feature = "cuda")]
fn kernel_cache() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
        let Some(dir) = kernel_cache_dir() else {
            tracing::debug!("CUDA kernels are not kept between runs (SPIKECUBE_KERNEL_CACHE=off, or no writable cache folder)");
            return;
        };
        let mut slot = CubeClRuntimeConfig::storage().lock();
        if slot.is_none() {
            let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
            if config.compilation.cache.is_none() {
                config.compilation.cache = Some(CacheConfig::File(dir.clone()));
            }
            tracing::debug!(
                "CUDA kernels kept between runs in {}",
                config
                    .compilation
                    .cache
                    .as_ref()
                    .map_or(dir, |c| c.root())
                    .display()
            );
            *slot = Some(std::sync::Arc::new(config));
        } else {
            tracing::debug!(
                "CubeCL's configuration was read before the kernel cache was set: CUDA kernels are compiled again on every run"
            );
        }
    });
}

/// What a probe found: a usable device's name, or why there is none.
pub type Probe = Result<String, String>;

/// Looks for a usable CUDA device without touching CubeCL: loads the driver
/// library, initialises it and reads the first device's name; CubeCL 0.10 also
/// compiles kernels at run time with NVRTC against the CUDA headers, so those are
/// looked for too (`$CUDA_PATH/include` or `/usr/local/cuda/include`).
pub fn probe_cuda() -> Probe {
    #[cfg(feature = "cuda")]
    {
        cuda_probe::probe()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this build has no CUDA back end (built without the `cuda` feature)".into())
    }
}

/// Ends GPU 0's primary CUDA context (the one CubeCL and the page-locked
/// pool use) and frees everything in it: the work CUDA otherwise does when
/// the process exits (measured 0.16 s at exit after a 10-minute
/// pass on the H200; done on a thread while the outputs are written, the
/// exit took 0.07 s and the whole run about 0.1 s less). Returns whether the
/// driver did it.
///
/// # Safety
/// Nothing may use the CUDA device in this process afterwards: every
/// CubeCL CUDA client, buffer and kernel (and every page-locked block) of
/// the process becomes invalid. Only for a process that ends after its one
/// run (`spikecube detect`).
pub unsafe fn end_cuda_context() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: the caller vouches that the context is no longer used.
        unsafe { cuda_probe::end_primary_context() }
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Bytes free on CUDA GPU 0 now (`cuMemGetInfo` in its primary context,
/// which CubeCL uses); `None` without a loaded driver or when it fails.
pub fn cuda_free_memory() -> Option<u64> {
    #[cfg(feature = "cuda")]
    {
        cuda_probe::free_memory()
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

#[cfg(feature = "cuda")]
mod cuda_probe {
    use std::ffi::{c_char, c_int};
    use std::path::PathBuf;

    type CuInit = unsafe extern "C" fn(u32) -> c_int;
    type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
    type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;

    /// The driver and NVRTC libraries once loaded, kept loaded for the
    /// process: CubeCL loads them again by name, and then finds them
    /// initialised instead of loading and initialising them a second time.
    static DRIVER: std::sync::OnceLock<libloading::Library> = std::sync::OnceLock::new();
    static NVRTC: std::sync::OnceLock<libloading::Library> = std::sync::OnceLock::new();

    /// `cuDevicePrimaryCtxReset` on GPU 0, with the driver the probe loaded.
    ///
    /// # Safety
    /// As [`super::end_cuda_context`].
    pub(super) unsafe fn end_primary_context() -> bool {
        type CuPrimaryCtxReset = unsafe extern "C" fn(c_int) -> c_int;
        let Some(lib) = DRIVER.get() else {
            return false;
        };
        // SAFETY: the symbol has the driver API's signature; GPU 0 is the
        // device the probe found; the caller vouches that nothing uses it.
        unsafe {
            lib.get::<CuPrimaryCtxReset>(b"cuDevicePrimaryCtxReset_v2\0")
                .is_ok_and(|reset| reset(0) == 0)
        }
    }

    /// Free bytes on GPU 0: its primary context is retained and made current
    /// on this thread for `cuMemGetInfo_v2`, then released (CubeCL's own
    /// reference keeps it alive).
    pub(super) fn free_memory() -> Option<u64> {
        type CuCtx = *mut std::ffi::c_void;
        type Retain = unsafe extern "C" fn(*mut CuCtx, c_int) -> c_int;
        type Release = unsafe extern "C" fn(c_int) -> c_int;
        type Push = unsafe extern "C" fn(CuCtx) -> c_int;
        type Pop = unsafe extern "C" fn(*mut CuCtx) -> c_int;
        type MemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
        let lib = DRIVER.get()?;
        // SAFETY: the symbols have the driver API's signatures; GPU 0 is the
        // device the probe found; the context pushed here is popped before
        // returning and released once for the one retain.
        unsafe {
            let retain = lib.get::<Retain>(b"cuDevicePrimaryCtxRetain\0").ok()?;
            let release = lib.get::<Release>(b"cuDevicePrimaryCtxRelease_v2\0").ok()?;
            let push = lib.get::<Push>(b"cuCtxPushCurrent_v2\0").ok()?;
            let pop = lib.get::<Pop>(b"cuCtxPopCurrent_v2\0").ok()?;
            let info = lib.get::<MemInfo>(b"cuMemGetInfo_v2\0").ok()?;
            let mut ctx: CuCtx = std::ptr::null_mut();
            if retain(&mut ctx, 0) != 0 {
                return None;
            }
            let mut out = None;
            if push(ctx) == 0 {
                let (mut free, mut total) = (0usize, 0usize);
                if info(&mut free, &mut total) == 0 {
                    out = Some(free as u64);
                }
                let mut popped: CuCtx = std::ptr::null_mut();
                pop(&mut popped);
            }
            release(0);
            out
        }
    }

    /// How a host thread waits for the GPU (`SPIKECUBE_CUDA_SYNC`): `spin`,
    /// `yield`, `blocking`, or `auto` (the driver's default: spin while the
    /// process has no more contexts than cores). Set on GPU 0's primary
    /// context, which CubeCL then takes, at the process's first probe (before
    /// the context is made; later probes leave it); a value the driver refuses
    /// is logged and left as the driver has it.
    fn set_sync_flags(lib: &libloading::Library, dev: c_int) {
        type CuPrimaryCtxSetFlags = unsafe extern "C" fn(c_int, u32) -> c_int;
        static ONCE: std::sync::Once = std::sync::Once::new();
        let mut first = false;
        ONCE.call_once(|| first = true);
        let (true, Ok(mode)) = (first, std::env::var("SPIKECUBE_CUDA_SYNC")) else {
            return;
        };
        // CU_CTX_SCHED_AUTO, _SPIN, _YIELD, _BLOCKING_SYNC.
        let flags = match mode.as_str() {
            "auto" => 0u32,
            "spin" => 1,
            "yield" => 2,
            "blocking" => 4,
            other => {
                tracing::warn!(
                    "SPIKECUBE_CUDA_SYNC={other} is not one of auto, spin, yield, blocking: left as the driver has it"
                );
                return;
            }
        };
        // SAFETY: the symbol has the driver API's signature; `dev` is a
        // device the initialised driver handed out.
        let rc = unsafe {
            lib.get::<CuPrimaryCtxSetFlags>(b"cuDevicePrimaryCtxSetFlags_v2\0")
                .map(|set| set(dev, flags))
        };
        match rc {
            Ok(0) => tracing::debug!("CUDA host threads wait by {mode}"),
            Ok(rc) => {
                tracing::info!("SPIKECUBE_CUDA_SYNC={mode} refused by the driver (CUDA error {rc})")
            }
            Err(e) => tracing::info!("SPIKECUBE_CUDA_SYNC={mode}: {e}"),
        }
    }

    pub(super) fn probe() -> super::Probe {
        // SAFETY: loading the NVIDIA driver library runs its initialisers, which
        // have no preconditions; the symbols below have the driver API's C signatures.
        let lib = match DRIVER.get() {
            Some(lib) => lib,
            None => {
                let lib = unsafe { libloading::Library::new("libcuda.so.1") }
                    .or_else(|_| unsafe { libloading::Library::new("libcuda.so") })
                    .map_err(|_| "no NVIDIA driver (libcuda.so.1 not found)".to_string())?;
                DRIVER.get_or_init(|| lib)
            }
        };
        let name = unsafe {
            let init: libloading::Symbol<CuInit> =
                lib.get(b"cuInit\0").map_err(|e| e.to_string())?;
            let count: libloading::Symbol<CuDeviceGetCount> =
                lib.get(b"cuDeviceGetCount\0").map_err(|e| e.to_string())?;
            let get: libloading::Symbol<CuDeviceGet> =
                lib.get(b"cuDeviceGet\0").map_err(|e| e.to_string())?;
            let get_name: libloading::Symbol<CuDeviceGetName> =
                lib.get(b"cuDeviceGetName\0").map_err(|e| e.to_string())?;
            let rc = init(0);
            if rc != 0 {
                return Err(format!(
                    "the NVIDIA driver did not initialise (CUDA error {rc})"
                ));
            }
            let mut n: c_int = 0;
            if count(&mut n) != 0 || n < 1 {
                return Err("the NVIDIA driver reports no GPU".into());
            }
            let mut dev: c_int = 0;
            if get(&mut dev, 0) != 0 {
                return Err("the NVIDIA driver cannot open GPU 0".into());
            }
            set_sync_flags(lib, dev);
            let mut buf = [0 as c_char; 256];
            if get_name(buf.as_mut_ptr(), buf.len() as c_int, dev) != 0 {
                return Err("the NVIDIA driver cannot name GPU 0".into());
            }
            std::ffi::CStr::from_ptr(buf.as_ptr())
                .to_string_lossy()
                .into_owned()
        };
        let cuda_root = std::env::var_os("CUDA_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"));
        let header = cuda_root.join("include/cuda_runtime.h");
        if !header.is_file() {
            return Err(format!(
                "{name} found, but the CUDA toolkit headers are not ({} missing; CubeCL compiles kernels at run time; set CUDA_PATH)",
                header.display()
            ));
        }
        let nvrtc = NVRTC.get().is_some()
            || ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
                .iter()
                .find_map(|l| unsafe { libloading::Library::new(l) }.ok())
                .is_some_and(|lib| {
                    let _ = NVRTC.set(lib);
                    true
                });
        if !nvrtc {
            return Err(format!(
                "{name} found, but NVRTC (libnvrtc.so) is not; CubeCL compiles kernels at run time with it"
            ));
        }
        Ok(name)
    }
}

/// One wgpu adapter: its name and whether it is a real GPU (not a CPU rasteriser
/// such as Mesa's lavapipe).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// The adapter's name, as its driver reports it.
    pub name: String,
    /// False for software adapters (lavapipe, llvmpipe, SwiftShader).
    pub is_gpu: bool,
    /// "Vulkan", "Metal", …
    pub api: String,
}

/// Lists the adapters CubeCL's wgpu runtime can use (Vulkan on Linux and
/// Windows, Metal on macOS), without creating a device.
pub fn probe_wgpu() -> Vec<Adapter> {
    #[cfg(feature = "wgpu")]
    {
        let backends = if cfg!(target_os = "macos") {
            wgpu::Backends::METAL
        } else {
            wgpu::Backends::VULKAN
        };
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        cubecl::future::block_on(instance.enumerate_adapters(backends))
            .into_iter()
            .map(|a| {
                let info = a.get_info();
                Adapter {
                    name: info.name,
                    is_gpu: info.device_type != wgpu::DeviceType::Cpu,
                    api: format!("{:?}", info.backend),
                }
            })
            .collect()
    }
    #[cfg(not(feature = "wgpu"))]
    {
        Vec::new()
    }
}

/// The back end a run uses, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Chosen {
    /// "cpu", "cuda" or "wgpu".
    pub backend: String,
    /// The device's name ("CPU, N threads" for the CPU).
    pub device: String,
    /// Why this one (what `auto` found, or "asked for").
    pub reason: String,
}

/// Resolves `backend` to one that can run here.
///
/// # Errors
/// [`DetectError::Device`] when an explicitly requested GPU back end is missing from
/// this build or finds no device (the message says why); `auto` never fails.
pub fn choose(backend: Backend) -> Result<Chosen, DetectError> {
    let cpu = |reason: String| Chosen {
        backend: "cpu".into(),
        device: format!(
            "CPU, {}",
            crate::error::count(rayon::current_num_threads() as u64, "thread")
        ),
        reason,
    };
    match backend {
        Backend::Cpu => Ok(cpu("asked for (--backend cpu)".into())),
        Backend::Cuda => match probe_cuda() {
            Ok(name) => Ok(Chosen {
                backend: "cuda".into(),
                device: name,
                reason: "asked for (--backend cuda)".into(),
            }),
            Err(why) => Err(DetectError::Device {
                message: format!("--backend cuda: {why}"),
            }),
        },
        Backend::Wgpu => {
            if !cfg!(feature = "wgpu") {
                return Err(DetectError::Device {
                    message: "--backend wgpu: this build has no wgpu back end (built without the `wgpu` feature)".into(),
                });
            }
            let adapters = probe_wgpu();
            match adapters.iter().find(|a| a.is_gpu).or(adapters.first()) {
                Some(a) => Ok(Chosen {
                    backend: "wgpu".into(),
                    device: format!("{} ({})", a.name, a.api),
                    reason: if a.is_gpu {
                        "asked for (--backend wgpu)".into()
                    } else {
                        "asked for (--backend wgpu); this adapter is a CPU rasteriser, far slower than --backend cpu".into()
                    },
                }),
                None => Err(DetectError::Device {
                    message: "--backend wgpu: no Vulkan/Metal adapter found (on Linux, install the GPU's Vulkan driver, or mesa-vulkan-drivers for a software one)".into(),
                }),
            }
        }
        Backend::Auto => {
            let cuda = probe_cuda();
            if let Ok(name) = cuda {
                return Ok(Chosen {
                    backend: "cuda".into(),
                    device: name,
                    reason: "auto: an NVIDIA GPU with a CUDA driver".into(),
                });
            }
            let why_not_cuda = cuda.err().unwrap_or_default();
            if cfg!(feature = "wgpu")
                && let Some(a) = probe_wgpu().into_iter().find(|a| a.is_gpu)
            {
                return Ok(Chosen {
                    backend: "wgpu".into(),
                    device: format!("{} ({})", a.name, a.api),
                    reason: format!("auto: a {} GPU; no CUDA: {why_not_cuda}", a.api),
                });
            }
            Ok(cpu(format!(
                "auto: no GPU found (CUDA: {why_not_cuda}; wgpu: {})",
                if cfg!(feature = "wgpu") {
                    "no hardware Vulkan/Metal adapter"
                } else {
                    "not in this build"
                }
            )))
        }
    }
}

/// A detector on the chosen back end, with [`CpuDetector`]'s interface.
#[derive(Debug)]
pub enum Detector {
    /// The CPU reference.
    Cpu(Box<CpuDetector>),
    /// CUDA through CubeCL.
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::detect::gpu::GpuDetector<cubecl::cuda::CudaRuntime>>),
    /// wgpu through CubeCL.
    #[cfg(feature = "wgpu")]
    Wgpu(Box<crate::detect::gpu::GpuDetector<cubecl::wgpu::WgpuRuntime>>),
}

impl Detector {
    /// Builds the detector for `chosen` (from [`choose`]).
    ///
    /// # Errors
    /// As [`CpuDetector::new`], or [`DetectError::Device`].
    pub fn new(
        chosen: &Chosen,
        geometry: Geometry,
        templates: UniversalTemplates,
        settings: DetectionSettings,
    ) -> Result<Detector, DetectError> {
        match chosen.backend.as_str() {
            #[cfg(feature = "cuda")]
            "cuda" => Ok(Detector::Cuda(Box::new({
                crate::detect::gpu::GpuDetector::new(
                    &cuda_device(),
                    chosen.device.clone(),
                    geometry,
                    templates,
                    settings,
                    Default::default(),
                )?
            }))),
            #[cfg(feature = "wgpu")]
            "wgpu" => Ok(Detector::Wgpu(Box::new(
                crate::detect::gpu::GpuDetector::new(
                    &cubecl::wgpu::WgpuDevice::DefaultDevice,
                    chosen.device.clone(),
                    geometry,
                    templates,
                    settings,
                    Default::default(),
                )?,
            ))),
            _ => Ok(Detector::Cpu(Box::new(CpuDetector::new(
                geometry, templates, settings,
            )?))),
        }
    }

    /// Detects spikes in one whitened window (C sites × NT samples); see
    /// [`CpuDetector::detect`].
    ///
    /// # Errors
    /// As [`CpuDetector::detect`]; [`DetectError::Device`] when a GPU fails.
    pub fn detect(&mut self, x: ArrayView2<f32>, yc: &[f32]) -> Result<Detections, DetectError> {
        match self {
            Detector::Cpu(d) => d.detect(x, yc),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.detect(x, yc),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.detect(x, yc),
        }
    }

    /// The CPU detector's busy seconds per step since the last call
    /// ([`CpuDetector::take_step_seconds`]); empty on a GPU.
    pub fn take_step_seconds(&mut self) -> Vec<(&'static str, f64)> {
        match self {
            Detector::Cpu(d) => d.take_step_seconds(),
            #[allow(unreachable_patterns)]
            _ => Vec::new(),
        }
    }

    /// Whether detection computes the PC features `tF`
    /// ([`CpuDetector::set_pc_features`]; the drift step's first pass goes
    /// without); `false` when this back end always computes them (a GPU).
    pub fn set_pc_features(&mut self, on: bool) -> bool {
        match self {
            Detector::Cpu(d) => {
                d.set_pc_features(on);
                true
            }
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Moves preprocessing onto the device for the windows given to
    /// [`Detector::detect_raw`]; `Ok(false)` on the CPU or when the preprocessing
    /// has no device form (`artifact_threshold` set).
    ///
    /// # Errors
    /// [`DetectError::Setting`] when the device cannot hold the kernels' tiles.
    #[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
    pub fn set_preprocessing(
        &mut self,
        pre: &crate::preprocess::Preprocessor,
    ) -> Result<bool, DetectError> {
        let Some(form) = pre.device_form(crate::preprocess::DEVICE_TAP_FLOOR) else {
            return Ok(false);
        };
        match self {
            Detector::Cpu(_) => Ok(false),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.set_preprocessing(&form).map(|_| true),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.set_preprocessing(&form).map(|_| true),
        }
    }

    /// Compiles the device's kernels and allocates its window buffers for
    /// windows preprocessed as `pre` does (any whitening, e.g. the identity
    /// before the fit) by one all-zero window ([`crate::detect::gpu::GpuDetector::warm_up`]);
    /// `Ok(false)` on the CPU or when `pre` has no device form. Lets the
    /// device start while the whitening fit runs on the host.
    ///
    /// # Errors
    /// As [`Detector::set_preprocessing`] and [`Detector::detect_raw`].
    #[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
    pub fn warm_up(
        &mut self,
        pre: &crate::preprocess::Preprocessor,
        yc: &[f32],
    ) -> Result<bool, DetectError> {
        let Some(form) = pre.device_form(crate::preprocess::DEVICE_TAP_FLOOR) else {
            return Ok(false);
        };
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        let Some(packer) = self.packer() else {
            return Ok(false);
        };
        match self {
            Detector::Cpu(_) => Ok(false),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.warm_up(&form, yc, &packer).map(|_| true),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.warm_up(&form, yc, &packer).map(|_| true),
        }
    }

    /// The whitening fit's Gram matrix of one raw window, preprocessed on the
    /// device ([`crate::detect::gpu::GpuDetector::window_gram`]); `Ok(None)` on
    /// the CPU.
    ///
    /// # Errors
    /// As that method.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn window_gram(
        &mut self,
        raw: crate::detect::gpu::RawWindow,
        yc: &[f32],
        lo: usize,
        hi: usize,
    ) -> Result<Option<ndarray::Array2<f64>>, DetectError> {
        match self {
            Detector::Cpu(_) => Ok(None),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.window_gram(raw, yc, lo, hi).map(Some),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.window_gram(raw, yc, lo, hi).map(Some),
        }
    }

    /// The high-pass the device preprocessing runs (`iir-f64`, `iir-f32`,
    /// `direct`, `none`); `None` on the CPU.
    pub fn device_highpass(&self) -> Option<&'static str> {
        match self {
            Detector::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => Some(d.highpass_form()),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => Some(d.highpass_form()),
        }
    }

    /// Seconds of the whitening fit's device work since the last call (putting
    /// windows on the device, preprocessing, products; zeros on the CPU).
    pub fn take_gram_seconds(&mut self) -> [f64; 3] {
        match self {
            Detector::Cpu(_) => [0.0; 3],
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.take_gram_seconds(),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.take_gram_seconds(),
        }
    }

    /// Seconds the host waited for a GPU's detections since the last call
    /// (0 on the CPU).
    pub fn take_wait_seconds(&mut self) -> f64 {
        match self {
            Detector::Cpu(_) => 0.0,
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.take_wait_seconds(),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.take_wait_seconds(),
        }
    }

    /// The template learning's clips of one raw window, cut on the device
    /// ([`crate::detect::gpu::GpuDetector::learning_clips`]); `Ok(None)` on
    /// the CPU.
    ///
    /// # Errors
    /// As that method.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn learning_clips(
        &mut self,
        raw: crate::detect::gpu::RawWindow,
        yc: &[f32],
        cut: &crate::detect::learn::ClipCut,
    ) -> Result<Option<ndarray::Array2<f32>>, DetectError> {
        match self {
            Detector::Cpu(_) => {
                let _ = (raw, yc, cut);
                Ok(None)
            }
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.learning_clips(raw, yc, cut).map(Some),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.learning_clips(raw, yc, cut).map(Some),
        }
    }

    /// Frees what [`Detector::learning_clips`] keeps between windows
    /// ([`crate::detect::gpu::GpuDetector::end_whitened`]); nothing on the CPU.
    pub fn end_whitened(&mut self) {
        match self {
            Detector::Cpu(_) => {}
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.end_whitened(),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.end_whitened(),
        }
    }

    /// Replaces the device preprocessing's whitening by a C × C matrix in CSR
    /// form (see [`crate::detect::gpu::GpuDetector::set_whitening`]).
    ///
    /// # Errors
    /// As that method; on the CPU always.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn set_whitening(
        &mut self,
        start: &[u32],
        cols: &[u32],
        vals: &[f32],
    ) -> Result<(), DetectError> {
        match self {
            Detector::Cpu(_) => Err(DetectError::Setting {
                name: "backend",
                message: "the CPU back end has no device preprocessing".into(),
            }),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.set_whitening(start, cols, vals),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.set_whitening(start, cols, vals),
        }
    }

    /// A copy, in a device buffer of its own, of the whitened window the last
    /// launched window left on the device (`n_sites × n_t` f32), queued after
    /// that window's work; `None` on the CPU or before any window.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn keep_window(&mut self) -> Option<cubecl::server::Handle> {
        match self {
            Detector::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.keep_window(),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.keep_window(),
        }
    }

    /// Asks the next window's preprocessing on the device to keep a copy of
    /// its high-passed samples ([`crate::detect::gpu::GpuDetector::copy_filtered_next`]);
    /// nothing on the CPU.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn copy_filtered_next(&mut self) {
        match self {
            Detector::Cpu(_) => {}
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.copy_filtered_next(),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.copy_filtered_next(),
        }
    }

    /// The copy [`Detector::copy_filtered_next`] asked for (`n_sites × n_t`
    /// f32 on the device), once that window was launched; `None` otherwise.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn take_filtered_copy(&mut self) -> Option<cubecl::server::Handle> {
        match self {
            Detector::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.take_filtered_copy(),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.take_filtered_copy(),
        }
    }

    /// Queues a window from its high-passed samples on the device
    /// ([`crate::detect::gpu::GpuDetector::submit_filtered`]) and returns the
    /// buffer holding it whitened; [`Detector::collect`] returns its
    /// detections.
    ///
    /// # Errors
    /// As that method; on the CPU always.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn submit_filtered(
        &mut self,
        filtered: cubecl::server::Handle,
        yc: &[f32],
    ) -> Result<cubecl::server::Handle, DetectError> {
        match self {
            Detector::Cpu(_) => Err(DetectError::Setting {
                name: "backend",
                message: "the CPU back end preprocesses on the host".into(),
            }),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.submit_filtered(filtered, yc),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.submit_filtered(filtered, yc),
        }
    }

    /// Bytes free on the device now (CUDA's `cuMemGetInfo`); `None` on the
    /// CPU and wgpu, or when the driver does not say.
    pub fn free_device_memory(&self) -> Option<u64> {
        match self {
            #[cfg(feature = "cuda")]
            Detector::Cuda(_) => cuda_free_memory(),
            _ => None,
        }
    }

    /// The back end's name: `cpu`, `cuda` or `wgpu`.
    pub fn backend_name(&self) -> &'static str {
        match self {
            Detector::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            Detector::Cuda(_) => "cuda",
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(_) => "wgpu",
        }
    }

    /// The packer of raw windows for [`Detector::detect_raw`] (page-locked
    /// memory with CUDA); `None` on the CPU.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn packer(&mut self) -> Option<crate::detect::gpu::Packer> {
        match self {
            Detector::Cpu(_) => None,
            // One page-locked pool per detector, made at the first
            // call (or given by `use_pinned_pool`) and shared by every packer
            // (warm-up, whitening fit, pass).
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => Some(match d.pinned_pool() {
                Some(pool) => crate::detect::gpu::Packer::with_pool(pool),
                None => {
                    let p = crate::detect::gpu::Packer::pinned_cuda();
                    if let Some(pool) = p.pool() {
                        d.use_direct_upload(pool);
                    }
                    p
                }
            }),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(_) => Some(crate::detect::gpu::Packer::default()),
        }
    }

    /// Makes `pool` this detector's page-locked pool (opened and
    /// filled on a thread of its own while the device starts,
    /// [`crate::detect::gpu::pinned::PinnedPool::open_reserving`]); later
    /// [`Detector::packer`]s pack into it. Nothing on the other back ends.
    #[cfg(feature = "cuda")]
    pub fn use_pinned_pool(&mut self, pool: crate::detect::gpu::pinned::PinnedPool) {
        if let Detector::Cuda(d) = self {
            d.use_direct_upload(pool);
        }
    }

    /// Gives `packer` two upload buffers of this detector for windows of
    /// `bytes` bytes, so that its [`crate::detect::gpu::Packer::send_ahead`]
    /// copies a window while the device works on the one before (CUDA with
    /// page-locked memory; nothing on the other back ends). Returns whether
    /// it did.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn give_upload_slots(
        &mut self,
        packer: &mut crate::detect::gpu::Packer,
        bytes: usize,
    ) -> bool {
        let _ = (&packer, bytes);
        match self {
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => {
                let Some(pool) = packer.pool() else {
                    return false;
                };
                let Some(ptrs) = d.upload_slot_ptrs(bytes) else {
                    return false;
                };
                match pool.upload_slots(ptrs, bytes) {
                    Some(slots) => {
                        packer.set_slots(slots);
                        true
                    }
                    None => false,
                }
            }
            _ => false,
        }
    }

    /// Preprocesses a raw window on the device and detects in it (after
    /// [`Detector::set_preprocessing`] returned true); with `times`, syncs after
    /// each step and records its seconds there.
    ///
    /// # Errors
    /// As [`crate::detect::gpu::GpuDetector::detect_raw`]; on the CPU always.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn detect_raw(
        &mut self,
        raw: crate::detect::gpu::RawWindow,
        yc: &[f32],
        times: Option<&mut crate::detect::gpu::StepTimes>,
    ) -> Result<Detections, DetectError> {
        match self {
            Detector::Cpu(_) => Err(DetectError::Setting {
                name: "backend",
                message: "the CPU back end preprocesses on the host".into(),
            }),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.detect_raw(raw, yc, times),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.detect_raw(raw, yc, times),
        }
    }

    /// Queues a raw window that was sent ahead on the device without waiting
    /// for its detections ([`crate::detect::gpu::GpuDetector::submit_raw`]);
    /// [`Detector::collect`] returns them in order.
    ///
    /// # Errors
    /// As that method; on the CPU always.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn submit_raw(
        &mut self,
        raw: crate::detect::gpu::RawWindow,
        yc: &[f32],
    ) -> Result<(), DetectError> {
        match self {
            Detector::Cpu(_) => Err(DetectError::Setting {
                name: "backend",
                message: "the CPU back end preprocesses on the host".into(),
            }),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.submit_raw(raw, yc),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.submit_raw(raw, yc),
        }
    }

    /// The detections of the oldest window queued by [`Detector::submit_raw`]
    /// (`None` when none is queued; always on the CPU).
    ///
    /// # Errors
    /// As [`crate::detect::gpu::GpuDetector::collect`].
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn collect(&mut self) -> Result<Option<Detections>, DetectError> {
        match self {
            Detector::Cpu(_) => Ok(None),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.collect(),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.collect(),
        }
    }

    /// The longest window (samples, padding included) this back end can take for
    /// `n_sites` channels; `usize::MAX` on the CPU.
    #[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(unused_variables))]
    pub fn max_window_samples(&self, n_sites: usize) -> usize {
        let _ = n_sites; // unused in a CPU-only build
        match self {
            Detector::Cpu(_) => {
                // Only the GPU back ends (when compiled in) read it.
                let _ = n_sites;
                usize::MAX
            }
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.max_window_samples(n_sites),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.max_window_samples(n_sites),
        }
    }

    /// The geometry in use.
    pub fn geometry(&self) -> &Geometry {
        self.geometry_inner()
    }

    /// Detects with other universal templates (same shapes) from the next
    /// window on, keeping the device's buffers (e.g. templates learned again
    /// for the drift-corrected pass).
    ///
    /// # Errors
    /// [`DetectError::Setting`] when their shapes do not fit this detector.
    pub fn set_templates(&mut self, templates: &UniversalTemplates) -> Result<(), DetectError> {
        match self {
            Detector::Cpu(d) => d.set_templates(templates),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.set_templates(templates),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.set_templates(templates),
        }
    }

    fn geometry_inner(&self) -> &Geometry {
        match self {
            Detector::Cpu(d) => d.geometry(),
            #[cfg(feature = "cuda")]
            Detector::Cuda(d) => d.geometry(),
            #[cfg(feature = "wgpu")]
            Detector::Wgpu(d) => d.geometry(),
        }
    }
}
