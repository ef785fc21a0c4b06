//! Stage 2, **device**: the back end chosen and opened before any data is
//! read (a missing or too small device fails at once, or with `auto` falls
//! back to the CPU), the detector built on it and, on a GPU that
//! preprocesses, warmed up (kernels compiled, buffers allocated).
//!
//! Everything that depends on the back end stays behind [`Device`] and
//! [`BackEnd`]: the CUDA page-locked pool, the `auto` fallback, the
//! device's warm-up and the choice of the window pass on the host or the
//! device ([`crate::stages::window_pass`]); the run that chains the stages
//! sees none of it.

use anyhow::{Result, bail};
use ndarray::Array2;

use super::job::DetectJob;
use super::open::OpenRun;
use crate::backend::{Backend, Chosen, Detector};
use crate::detect::{Geometry, UniversalTemplates};
use crate::preprocess::Preprocessor;
use crate::stages::WindowPass;
use crate::timing::StageTimer;

/// The chosen back end with its detector (stage 2's output).
pub(crate) struct Device {
    /// The back end and what it holds for the whole run.
    pub back_end: BackEnd,
    /// The detector on it (built-in templates until [`Device::use_templates`]).
    pub detector: Detector,
    /// On a GPU that preprocesses: the stand-in preprocessing (identity
    /// whitening) the device was warmed up with, which the whitening fit
    /// then uses on the device ([`Device::for_fit`]).
    warm_pre: Option<Preprocessor>,
}

/// The back end of a run past the detector: which one ([`Chosen`]) and the
/// CUDA page-locked pool kept to the end of the run.
pub(crate) struct BackEnd {
    /// The back end, its device and why it was chosen.
    pub chosen: Chosen,
    pinned: Pinned,
}

impl Device {
    /// Chooses the back end (`device_probe` in the timings), builds the
    /// detector (`device_open`; with `auto`, the CPU when the device cannot
    /// hold the run's windows) and warms a preprocessing GPU up
    /// (`device_warm_up`). On the CPU the first two are not recorded.
    ///
    /// # Errors
    /// A back end that is not there, a device that cannot hold the windows
    /// (unless `auto`), or a detector that cannot be built.
    pub fn open(job: &DetectJob, run: &OpenRun, timer: &mut StageTimer) -> Result<Device> {
        let mut chosen = timer.time("device_probe", |_| crate::backend::choose(job.backend))?;
        // The page-locked pool, opened and filled on its own thread while the
        // device opens and warms up; kept to the end of the run (dropping it
        // stops the reservation).
        let mut pinned = Pinned::reserve(&chosen, job, run);
        let detector = timer.time("device_open", |_| {
            open_detector(job, run, &mut chosen, &mut pinned)
        })?;
        if chosen.backend == "cpu" {
            // No device was probed or opened: nothing to report.
            timer.discard("device_probe");
            timer.discard("device_open");
        }
        let mut device = Device {
            back_end: BackEnd { chosen, pinned },
            detector,
            warm_pre: None,
        };
        device.warm_up(job, timer)?;
        Ok(device)
    }

    /// On a GPU that preprocesses, the device starts (kernels compiled,
    /// buffers allocated, with a stand-in whitening) before the whitening
    /// fit, which it then does itself: the host only reads and checks the
    /// fit's windows.
    fn warm_up(&mut self, job: &DetectJob, timer: &mut StageTimer) -> Result<()> {
        if !job.device_preprocessing || self.back_end.chosen.backend == "cpu" {
            return Ok(());
        }
        let pre = Preprocessor::new(&job.preprocess, Array2::eye(job.probe.n_sites()))?;
        timer.time("device_warm_up", |_| {
            // A failure shows again, with its context, when the fit or the
            // pass sets the preprocessing: only logged here.
            if let Err(e) = self.detector.warm_up(&pre, &job.probe.yc) {
                tracing::debug!("device warm-up: {e}");
            }
        });
        self.warm_pre = Some(pre);
        Ok(())
    }

    /// The detector and the warm-up's preprocessing when the whitening fit
    /// runs on the device; `None` when it runs on the host.
    pub fn for_fit(&mut self) -> Option<(&mut Detector, &Preprocessor)> {
        let pre = self.warm_pre.as_ref()?;
        Some((&mut self.detector, pre))
    }

    /// The detector, with `pre` set on it, and a packer for its windows when
    /// the template learning's windows are preprocessed on the device, as
    /// the pass's will be (a GPU that preprocesses, for a `pre` with a device
    /// form); `None` when they are preprocessed on the host.
    ///
    /// # Errors
    /// When the device cannot take `pre`'s constants.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub fn for_learning(
        &mut self,
        pre: &Preprocessor,
    ) -> Result<Option<(&mut Detector, crate::detect::gpu::Packer)>> {
        if self.warm_pre.is_none() || !self.detector.set_preprocessing(pre)? {
            return Ok(None);
        }
        Ok(self.detector.packer().map(|p| (&mut self.detector, p)))
    }

    /// Detects with `templates` from now on: the same detector when they
    /// have its shapes (a GPU keeps its buffers), a new one otherwise (with
    /// the run's page-locked pool).
    ///
    /// # Errors
    /// When a new detector cannot be built.
    pub fn use_templates(
        &mut self,
        templates: &UniversalTemplates,
        geometry: &Geometry,
        job: &DetectJob,
    ) -> Result<()> {
        if *templates != UniversalTemplates::builtin()
            && self.detector.set_templates(templates).is_err()
        {
            self.detector = Detector::new(
                &self.back_end.chosen,
                geometry.clone(),
                templates.clone(),
                job.detection.clone(),
            )?;
            self.back_end.pinned.give_to(&mut self.detector);
        }
        Ok(())
    }

    /// The window pass of the run (preprocessing and detection of one raw
    /// window; on the device when the job asks and the back end can), and
    /// the back end it leaves.
    ///
    /// # Errors
    /// When the device cannot take the preprocessing constants.
    pub fn into_pass(
        self,
        pre: &Preprocessor,
        job: &DetectJob,
    ) -> Result<(Box<dyn WindowPass>, BackEnd)> {
        let pass = crate::stages::window_pass(
            self.detector,
            pre,
            job.probe.yc.clone(),
            job.device_preprocessing,
        )?;
        if let Some(h) = pass.device_highpass() {
            tracing::info!("high-pass on the device: {h}");
        }
        Ok((pass, self.back_end))
    }
}

/// The detector for `chosen`, with the built-in templates; with `auto`, the
/// CPU's (and `chosen` says so) when the device cannot hold the run's windows.
fn open_detector(
    job: &DetectJob,
    run: &OpenRun,
    chosen: &mut Chosen,
    pinned: &mut Pinned,
) -> Result<Detector> {
    let new = |chosen: &Chosen| {
        Detector::new(
            chosen,
            run.geometry.clone(),
            UniversalTemplates::builtin(),
            job.detection.clone(),
        )
    };
    let mut detector = new(chosen)?;
    let n_sites = job.probe.n_sites();
    let max_len = detector.max_window_samples(n_sites);
    if run.plan.window_len() > max_len {
        let why = format!(
            "{} holds windows of at most {max_len} samples for {n_sites} channels, these have {}",
            chosen.device,
            run.plan.window_len()
        );
        if job.backend == Backend::Auto {
            tracing::warn!("{why}; detecting on the CPU instead");
            *chosen = crate::backend::choose(Backend::Cpu)?;
            chosen.reason = format!("auto: {why}");
            detector = new(chosen)?;
        } else {
            bail!(
                "--backend {}: {why}; use --batch-size {} or less, or --backend cpu",
                chosen.backend,
                max_len.saturating_sub(2 * job.detection.nt) / 1000 * 1000
            );
        }
    }
    tracing::info!(
        "detection on {} ({}): {}",
        chosen.backend,
        chosen.device,
        chosen.reason
    );
    if chosen.backend != "cuda" {
        // `auto` went to the CPU: stop the reservation.
        pinned.stop();
    }
    pinned.give_to(&mut detector);
    Ok(detector)
}

impl BackEnd {
    /// Records the page-locked pool's seconds (`pinned_reserve`: blocks made
    /// ahead on their own thread, `pinned_on_demand`: blocks made when first
    /// needed) when the run has one.
    pub fn record(&mut self, timer: &mut StageTimer) {
        self.pinned.record(timer);
    }

    /// Runs `write` (the outputs' writing), dropping `pass` beside it: when
    /// the process ends after this run on CUDA (`last_device_use`), the pass,
    /// its buffers and the page-locked pool are dropped and the CUDA context
    /// ended on a thread while the outputs are written and synced; otherwise
    /// they are dropped after `write`.
    // The page-locked pool is a real resource in CUDA builds and an empty
    // stand-in without them, where dropping it is a no-op.
    #[allow(clippy::drop_non_drop)]
    pub fn finish<T>(
        self,
        pass: Box<dyn WindowPass>,
        last_device_use: bool,
        write: impl FnOnce() -> T,
    ) -> T {
        let BackEnd { chosen, pinned } = self;
        if !(last_device_use && chosen.backend == "cuda") {
            let out = write();
            drop(pass);
            drop(pinned);
            return out;
        }
        let teardown = std::thread::spawn(move || {
            drop(pass);
            drop(pinned);
            // SAFETY: the process ends after this run (`last_device_use`)
            // and the pass and the pool, the device's last users, are gone.
            unsafe { crate::backend::end_cuda_context() }
        });
        let out = write();
        let ended = teardown.join().unwrap_or(false);
        tracing::debug!("CUDA context ended before exit: {ended}");
        out
    }
}

/// The run's CUDA page-locked pool when one is reserved ahead
/// ([`Pinned::reserve`]); nothing on builds without CUDA.
#[derive(Default)]
struct Pinned {
    #[cfg(feature = "cuda")]
    pool: Option<crate::detect::gpu::pinned::ReservedPool>,
}

impl Pinned {
    /// With CUDA and device preprocessing, opens the run's page-locked pool
    /// and allocates its window buffers on a thread of its own
    /// ([`crate::detect::gpu::pinned::PinnedPool::open_reserving`]), as many
    /// as the run holds at once: the larger of the pass's windows in flight
    /// ([`crate::stages::windows_in_flight`] with a stager and
    /// [`crate::stages::device_readers`]: 4 by default) and the device
    /// whitening fit's ([`FIT_WINDOWS_IN_FLIGHT`](super::FIT_WINDOWS_IN_FLIGHT):
    /// 5); the warm-up's window is back in the pool before the fit starts, and
    /// the fit's before the pass. Each holds one int16 window (`n_sites ×
    /// Raw16::stride_for(window_len)` values: 46 MB for 384 sites). Nothing is
    /// reserved (a buffer is made when first needed) on other back ends and
    /// for recordings that do not give int16 values as they are (their
    /// windows are packed to other sizes).
    ///
    /// Off unless `SPIKECUBE_PINNED_RESERVE=1`: the driver serialises the
    /// reservation against the device's opening, and with a fast reading
    /// thread, making the buffers when first needed was faster overall on
    /// the H200 (medians of 4 in one call: 1.96 s against 2.03 s; device open
    /// 0.12 s against 0.19–0.27 s; whitening fit 0.22 s against 0.17 s).
    fn reserve(chosen: &Chosen, job: &DetectJob, run: &OpenRun) -> Pinned {
        #[cfg(feature = "cuda")]
        {
            let chan_map = &job.probe.chan_map;
            if chosen.backend != "cuda"
                || !job.device_preprocessing
                || !crate::recording::gives_int16(job.recording.as_ref(), chan_map)
                || std::env::var("SPIKECUBE_PINNED_RESERVE").as_deref() != Ok("1")
            {
                return Pinned::default();
            }
            let len =
                chan_map.len() * crate::recording::Raw16::stride_for(run.plan.window_len()) * 2;
            let n = crate::stages::windows_in_flight(true, crate::stages::device_readers())
                .max(super::fit_device::FIT_WINDOWS_IN_FLIGHT);
            Pinned {
                pool: Some(crate::detect::gpu::pinned::PinnedPool::open_reserving(
                    n, len,
                )),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (chosen, job, run);
            Pinned::default()
        }
    }

    /// Stops the reservation (the run does not use CUDA after all).
    fn stop(&mut self) {
        *self = Pinned::default();
    }

    /// Makes the pool `detector`'s, whose packers then share it.
    fn give_to(&mut self, detector: &mut Detector) {
        #[cfg(feature = "cuda")]
        if let Some(p) = self.pool.as_mut().and_then(|r| r.pool()) {
            detector.use_pinned_pool(p);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = detector;
    }

    /// See [`BackEnd::record`].
    fn record(&mut self, timer: &mut StageTimer) {
        #[cfg(feature = "cuda")]
        if let Some(p) = self.pool.as_mut().and_then(|r| r.pool()) {
            let st = p.stats();
            tracing::info!(
                "page-locked window buffers: {} made ahead ({:.3} s on their own thread), {} when needed ({:.3} s)",
                st.reserved,
                st.reserve_s,
                st.on_demand,
                st.on_demand_s
            );
            timer.add("pinned_reserve", st.reserve_s);
            timer.add("pinned_on_demand", st.on_demand_s);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = timer;
    }
}
