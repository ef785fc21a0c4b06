//! The whitening fit's covariance on a GPU (part of stage 3,
//! [`super::fit`]): the host reads and checks the fit's windows on several
//! threads, the device preprocesses them and forms their products.

/// Threads reading the device whitening fit's windows at once
/// ([`fit_covariance_on_device`]) when the recording gives int16 values (one
/// otherwise).
pub const FIT_READERS: usize = 3;

/// Windows the device whitening fit holds at most: one per reading
/// thread, one queued for the device, one on the device
/// ([`fit_covariance_on_device`]); with CUDA each is a page-locked buffer of
/// the run's pool.
pub const FIT_WINDOWS_IN_FLIGHT: usize = FIT_READERS + 2;

#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub(crate) use on_device::fit_covariance_on_device;

/// The GPU's part, built with a GPU back end only.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod on_device {
    use std::sync::Arc;
    use std::time::Instant;

    use anyhow::{Context, Result};
    use ndarray::Array2;

    use super::super::job::Checks;
    use crate::backend::Detector;
    use crate::checks::{self, ChannelHealth};
    use crate::preprocess::{PreprocessSettings, Preprocessor};
    use crate::probe::Probe;
    use crate::recording::{Recording, WindowPlan};

    use super::{FIT_READERS, FIT_WINDOWS_IN_FLIGHT};

    /// The whitening fit's covariance with the GPU doing the preprocessing and
    /// the product: every `nskip`-th window ([`crate::preprocess::covariance_windows`])
    /// is read and checked on the host exactly as [`fit`] does (int16 rows
    /// straight into page-locked memory when the recording is int16; read on
    /// [`FIT_READERS`] threads at once, checked in window order), sent up,
    /// preprocessed as the detection pass does it on the device (channel means,
    /// median CAR, high-pass; `pre`'s whitening is not used) and multiplied there
    /// ([`crate::detect::gpu::GpuDetector::window_gram`]); the host adds each
    /// window's Gram matrix / NT in f64 and divides by the number of windows, as
    /// [`crate::preprocess::whitening_covariance`] does. The covariance equals
    /// the host's within float32 rounding (the device's truncated high-pass and
    /// its order of sums; tests/gpu.rs).
    ///
    /// `Ok(None)` (nothing read) when the device cannot: a CPU detector, or a
    /// setting with no device form (`invert_sign`, `artifact_threshold`).
    ///
    /// # Errors
    /// A failed read, or the device failing.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fit_covariance_on_device(
        rec: &Arc<dyn Recording>,
        plan: &WindowPlan,
        probe: &Probe,
        settings: &PreprocessSettings,
        checks: &Checks,
        detector: &mut Detector,
        pre: &Preprocessor,
        health: &mut ChannelHealth,
        times: &mut crate::preprocess::FitTimes,
    ) -> Result<Option<Array2<f64>>> {
        if settings.invert_sign || matches!(detector, Detector::Cpu(_)) {
            return Ok(None);
        }
        if !detector.set_preprocessing(pre)? {
            return Ok(None);
        }
        let Some(packer) = detector.packer() else {
            return Ok(None);
        };
        settings.validate()?;
        let c = probe.n_sites();
        let n = plan.window_len();
        let nt = settings.nt;
        let windows = crate::preprocess::covariance_windows(plan.n_windows, settings.nskip as u64);
        tracing::info!(
            n_windows = plan.n_windows,
            nskip = settings.nskip,
            used = windows.len(),
            "fitting the whitening matrix (preprocessing and products on the device)"
        );
        let min_run = checks::stuck_min_run(rec.fs());
        let mask = checks.mask_clipped;
        let chan_map = &probe.chan_map;
        let mut cc = Array2::<f64>::zeros((c, c));
        let inv_t = 1.0 / (n - 2 * nt) as f64;
        let rec = rec.as_ref();
        // The fit's windows are read on FIT_READERS threads at once
        // (`recording::read_in_order`), then checked, packed and queued for the
        // device in window order, one at a time, while the device works on an
        // earlier window: `health` sees the windows in the same order as a
        // single reading loop (its per-row hashes chain across windows), and the
        // device loop below adds the Gram matrices in window order (the same
        // covariance, bit for bit). At most FIT_WINDOWS_IN_FLIGHT windows exist
        // at once (a token per window, given back once the device is done with it).
        let (read_s, checks_s) = std::thread::scope(|scope| -> Result<(f64, f64)> {
            let (tx, rx) =
                std::sync::mpsc::sync_channel::<Result<crate::detect::gpu::RawWindow>>(1);
            let (token_tx, token_rx) = crossbeam_channel::bounded::<()>(FIT_WINDOWS_IN_FLIGHT);
            for _ in 0..FIT_WINDOWS_IN_FLIGHT {
                let _ = token_tx.send(());
            }
            let list = windows.clone();
            let packer = &packer;
            let health_r = &mut *health;
            let reader = scope.spawn(move || {
                // Int16 rows straight into page-locked memory when the recording
                // gives them (the pass's read, `stages::read_any`).
                // Several readers for int16 windows; one for f32 windows (twice
                // the bytes), as in the pass (`stages::DEVICE_READERS`).
                let readers = if crate::recording::gives_int16(rec, chan_map) {
                    FIT_READERS
                } else {
                    1
                };
                let states: Vec<(Option<crate::stages::Raw16Alloc>, f64)> = (0..readers)
                    .map(|_| {
                        let p = packer.clone();
                        let alloc: crate::stages::Raw16Alloc = Box::new(move |len| {
                            Box::new(p.raw16_buffer(len)) as Box<dyn crate::recording::Raw16Buffer>
                        });
                        (Some(alloc), 0.0)
                    })
                    .collect();
                let mut checks_s = 0.0;
                let tx = &tx;
                let done = crate::recording::read_in_order(
                    "spikecube-fit-read",
                    list.len() as u64,
                    states,
                    |_| token_rx.recv().ok(),
                    |(raw16, read_s), k, ()| {
                        let i = list[k as usize];
                        let t0 = Instant::now();
                        let mut data = Array2::zeros((0, 0));
                        let res = crate::stages::read_any(rec, plan, i, chan_map, &mut data, raw16)
                            .map(|r16| {
                                crate::recording::Window::of(rec.first_sample(), plan, i, data, r16)
                            });
                        *read_s += t0.elapsed().as_secs_f64();
                        res
                    },
                    |k, res: Result<crate::recording::Window>| {
                        let i = list[k as usize];
                        let res = res.map(|mut w| {
                            let t1 = Instant::now();
                            let cols = checks::WindowColumns::of(plan, i);
                            checks::check_window(
                                &mut w,
                                &cols,
                                min_run,
                                Some(&mut *health_r),
                                mask,
                            );
                            checks_s += t1.elapsed().as_secs_f64();
                            packer.raw_window(&mut w)
                        });
                        let failed = res.is_err();
                        tx.send(res).is_ok() && !failed
                    },
                );
                match done {
                    Ok(states) => Ok((states.iter().map(|s| s.1).sum::<f64>(), checks_s)),
                    Err(e) => Err(e),
                }
            });
            for &i in &windows {
                let Ok(raw) = rx.recv() else { break };
                let raw = raw?;
                let t = Instant::now();
                let g = detector
                    .window_gram(raw, &probe.yc, nt, n - nt)
                    .with_context(|| format!("the whitening fit's window {i} on the device"))?
                    .expect("a GPU detector");
                for ((a, b), v) in cc.indexed_iter_mut() {
                    *v += g[(a, b)] * inv_t;
                }
                times.add("device", t.elapsed().as_secs_f64());
                // The window's storage is back in the pool: the next may be read.
                let _ = token_tx.send(());
            }
            drop(rx);
            drop(token_tx);
            reader
                .join()
                .map_err(|_| anyhow::anyhow!("the whitening fit's reading thread panicked"))?
                .context("cannot start the whitening fit's reading threads")
        })?;
        // Busy seconds summed over the reading threads.
        times.add("read", read_s);
        times.add("checks", checks_s);
        let [up, pre_s, gram_s] = detector.take_gram_seconds();
        times.add("device.upload", up);
        times.add("device.preprocess", pre_s);
        times.add("device.gram", gram_s);
        cc.mapv_inplace(|v| v / windows.len() as f64);
        Ok(Some(cc))
    }
}
