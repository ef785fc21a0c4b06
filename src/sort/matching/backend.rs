//! The matching pass on the chosen back end: [`Matcher`] wraps the CPU twin
//! ([`super::match_window`]) or a [`GpuMatcher`](super::gpu::GpuMatcher) on
//! CUDA or wgpu behind one `match_window`, chosen as detection chooses
//! ([`crate::backend::choose`]).

use std::sync::Arc;

use ndarray::{Array2, ArrayView2};

use super::{MatchError, MatchingSetup, WindowSpikes};
use crate::backend::{Backend, Chosen};

/// Learned-template matching on one back end.
#[derive(Debug)]
pub enum Matcher {
    /// The CPU reference (rayon).
    Cpu(Arc<MatchingSetup>),
    /// CUDA through CubeCL.
    #[cfg(feature = "cuda")]
    Cuda(Box<super::gpu::GpuMatcher<cubecl::cuda::CudaRuntime>>),
    /// wgpu through CubeCL.
    #[cfg(feature = "wgpu")]
    Wgpu(Box<super::gpu::GpuMatcher<cubecl::wgpu::WgpuRuntime>>),
}

impl Matcher {
    /// The matcher for `backend` (`--backend`): `cpu` the CPU twin; `cuda`
    /// and `wgpu` that device or an error; `auto` the device
    /// [`crate::backend::choose`] finds, else the CPU (with a warning in the
    /// returned list when a GPU was found but could not be used).
    ///
    /// # Errors
    /// [`MatchError::Device`] when an explicitly requested GPU back end is not
    /// in this build or finds no device.
    pub fn open(
        backend: Backend,
        setup: Arc<MatchingSetup>,
        warnings: &mut Vec<String>,
    ) -> Result<(Matcher, Chosen), MatchError> {
        let chosen = crate::backend::choose(backend).map_err(|e| MatchError::Device {
            device: format!("{backend:?}").to_lowercase(),
            message: e.to_string(),
        })?;
        match Self::device(&chosen, setup.clone()) {
            Ok(m) => Ok((m, chosen)),
            Err(e) if backend == Backend::Auto => {
                warnings.push(format!(
                    "learned-template matching: {} could not be used ({e}); matching on the CPU",
                    chosen.device
                ));
                let cpu = crate::backend::choose(Backend::Cpu).map_err(|e| MatchError::Device {
                    device: "cpu".into(),
                    message: e.to_string(),
                })?;
                Ok((Matcher::Cpu(setup), cpu))
            }
            Err(e) => Err(e),
        }
    }

    #[cfg_attr(
        not(any(feature = "cuda", feature = "wgpu")),
        allow(unused_variables, clippy::unnecessary_wraps)
    )]
    fn device(chosen: &Chosen, setup: Arc<MatchingSetup>) -> Result<Matcher, MatchError> {
        match chosen.backend.as_str() {
            #[cfg(feature = "cuda")]
            "cuda" => Ok(Matcher::Cuda(Box::new(super::gpu::GpuMatcher::new(
                &crate::backend::cuda_device(),
                chosen.device.clone(),
                setup,
                super::gpu::GpuMatchOptions::from_env(),
            )?))),
            #[cfg(feature = "wgpu")]
            "wgpu" => Ok(Matcher::Wgpu(Box::new(super::gpu::GpuMatcher::new(
                &cubecl::wgpu::WgpuDevice::DefaultDevice,
                chosen.device.clone(),
                setup,
                super::gpu::GpuMatchOptions::from_env(),
            )?))),
            _ => Ok(Matcher::Cpu(setup)),
        }
    }

    /// The CPU twin's set-up when the matching runs on the CPU; `None` on a GPU.
    pub fn cpu_setup(&self) -> Option<&Arc<MatchingSetup>> {
        match self {
            Matcher::Cpu(s) => Some(s),
            #[cfg(any(feature = "cuda", feature = "wgpu"))]
            _ => None,
        }
    }

    /// Whether the matching runs on a GPU.
    pub fn is_gpu(&self) -> bool {
        !matches!(self, Matcher::Cpu(_))
    }

    /// [`super::match_window`] on this back end.
    ///
    /// # Errors
    /// As [`super::match_window`]; [`MatchError::Device`] when the GPU fails.
    pub fn match_window(&mut self, x: ArrayView2<f32>) -> Result<WindowSpikes, MatchError> {
        match self {
            Matcher::Cpu(s) => super::match_window(s, x),
            #[cfg(feature = "cuda")]
            Matcher::Cuda(m) => m.match_window(x),
            #[cfg(feature = "wgpu")]
            Matcher::Wgpu(m) => m.match_window(x),
        }
    }

    /// [`Matcher::match_window`] on a window the caller no longer needs: on
    /// the CPU it becomes the residual ([`super::match_window_in_place`]),
    /// saving a copy; a GPU leaves it as it was.
    ///
    /// # Errors
    /// As [`Matcher::match_window`].
    pub fn match_window_in_place(
        &mut self,
        x: &mut Array2<f32>,
    ) -> Result<WindowSpikes, MatchError> {
        match self {
            Matcher::Cpu(s) => super::match_window_in_place(s, x),
            #[cfg(feature = "cuda")]
            Matcher::Cuda(m) => m.match_window(x.view()),
            #[cfg(feature = "wgpu")]
            Matcher::Wgpu(m) => m.match_window(x.view()),
        }
    }

    /// Whether [`Matcher::match_raw`] can take its windows preprocessed on
    /// `feed`'s device: both on the same GPU back end.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn shares_device_with(&self, feed: &crate::backend::Detector) -> bool {
        use crate::backend::Detector;
        match (self, feed) {
            #[cfg(feature = "cuda")]
            (Matcher::Cuda(_), Detector::Cuda(_)) => true,
            #[cfg(feature = "wgpu")]
            (Matcher::Wgpu(_), Detector::Wgpu(_)) => true,
            _ => false,
        }
    }

    /// Whether `kept`'s windows are on this matcher's device (both CUDA or
    /// both wgpu: each back end uses its first device).
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn holds(&self, kept: &crate::stages::KeptWindows) -> bool {
        match self {
            #[cfg(feature = "cuda")]
            Matcher::Cuda(_) => kept.backend == "cuda",
            #[cfg(feature = "wgpu")]
            Matcher::Wgpu(_) => kept.backend == "wgpu",
            Matcher::Cpu(_) => false,
        }
    }

    /// Queues a whitened window already on this matcher's device (one the
    /// detection pass kept, [`crate::stages::KeptWindows`]), `n_t` samples;
    /// the buffer is copied, not changed, and may be freed on return
    /// ([`GpuMatcher::queue_device`]). Its spikes come from
    /// [`Matcher::take_done`] once the next window is queued, or from
    /// [`Matcher::flush`].
    ///
    /// # Errors
    /// [`MatchError::Device`] on the CPU or when the device fails; as
    /// [`Matcher::match_window`].
    ///
    /// [`GpuMatcher::queue_device`]: super::gpu::GpuMatcher::queue_device
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn queue_kept(&mut self, x: &cubecl::server::Handle, n_t: usize) -> Result<(), MatchError> {
        match self {
            #[cfg(feature = "cuda")]
            Matcher::Cuda(m) => m.queue_device(x, n_t),
            #[cfg(feature = "wgpu")]
            Matcher::Wgpu(m) => m.queue_device(x, n_t),
            Matcher::Cpu(_) => Err(MatchError::Device {
                device: "cpu".into(),
                message: "a window kept on a GPU cannot be matched on the CPU".into(),
            }),
        }
    }

    /// Preprocesses the raw window `raw` on `feed`'s device (its
    /// preprocessing and whitening as set) and queues its matching there,
    /// with no copy of the window through the host: the same spikes as
    /// [`Matcher::match_window`] on the window preprocessed on the device,
    /// taken as after [`Matcher::queue_kept`].
    ///
    /// # Errors
    /// When the two are not on one device ([`Matcher::shares_device_with`]),
    /// the preprocessing fails, or as [`Matcher::match_window`].
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn queue_raw(
        &mut self,
        feed: &mut crate::backend::Detector,
        mut raw: crate::detect::gpu::RawWindow,
        yc: &[f32],
    ) -> anyhow::Result<()> {
        use crate::backend::Detector;
        let n = raw.n_t;
        // A window sent ahead keeps its upload buffer until the device has
        // preprocessed it: the matching's first read of its state waits for
        // that (and the window can still be preprocessed again before).
        let claim = raw.take_claim();
        match (self, feed) {
            #[cfg(feature = "cuda")]
            (Matcher::Cuda(m), Detector::Cuda(d)) => queue_fed(m, d, raw, yc, n)?,
            #[cfg(feature = "wgpu")]
            (Matcher::Wgpu(m), Detector::Wgpu(d)) => queue_fed(m, d, raw, yc, n)?,
            _ => anyhow::bail!("the matcher and the preprocessing are not on one device"),
        }
        drop(claim);
        Ok(())
    }

    /// The spikes of queued windows that are complete, in window order
    /// (none on the CPU, which queues nothing).
    pub fn take_done(&mut self) -> Vec<WindowSpikes> {
        match self {
            Matcher::Cpu(_) => Vec::new(),
            #[cfg(feature = "cuda")]
            Matcher::Cuda(m) => m.take_done(),
            #[cfg(feature = "wgpu")]
            Matcher::Wgpu(m) => m.take_done(),
        }
    }

    /// Waits for the last queued window and returns the spikes of every
    /// queued window not yet taken, in window order.
    ///
    /// # Errors
    /// [`MatchError::Device`] when a read back fails.
    pub fn flush(&mut self) -> Result<Vec<WindowSpikes>, MatchError> {
        match self {
            Matcher::Cpu(_) => Ok(Vec::new()),
            #[cfg(feature = "cuda")]
            Matcher::Cuda(m) => m.flush(),
            #[cfg(feature = "wgpu")]
            Matcher::Wgpu(m) => m.flush(),
        }
    }
}

/// [`Matcher::queue_raw`] on one runtime: the detector's whitened window
/// becomes the residual; on the rare overflow of the device's spike capacity
/// the window is preprocessed again and queued from a copy (which ends on
/// the CPU). With [`super::gpu::GpuMatchOptions::copy_window`] the window is
/// kept and a copy matched (for measuring the copy; the spikes are the same).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn queue_fed<R: cubecl::Runtime>(
    m: &mut super::gpu::GpuMatcher<R>,
    d: &mut crate::detect::gpu::GpuDetector<R>,
    raw: crate::detect::gpu::RawWindow,
    yc: &[f32],
    n: usize,
) -> anyhow::Result<()> {
    let x = d.preprocess_to_device(raw, yc)?;
    if m.options().copy_window {
        m.queue_device(&x, n)?;
    } else if !m.queue_device_in_place(&x, n)? {
        m.queue_device(&d.preprocess_last_again()?, n)?;
    }
    Ok(())
}
