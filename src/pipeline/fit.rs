//! Stage 3, **whitening fit**: Kilosort4's `get_whitening_matrix` over every
//! `nskip`-th window, with spikecube's input checks (stuck stretches masked,
//! channel health, the data's scale). On a GPU that preprocesses, the device
//! preprocesses the fit's windows and forms their products
//! ([`super::fit_device`]); the host reads and checks them.
//!
//! Also the fit on its own ([`fit_whitening_for`]) for callers that cut and
//! preprocess windows themselves (the Python package's SpikeInterface
//! method), and the channel check of `spikecube probe` ([`channel_check`]).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use ndarray::Array2;

use super::device::Device;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
use super::fit_device::fit_covariance_on_device;
use super::job::{Checks, DetectJob};
use super::open::OpenRun;
use super::open::{fit_batch_to_recording, plan_windows};
use crate::backend::Detector;
use crate::checks::{self, ChannelHealth};
use crate::preprocess::{FitOptions, PreprocessSettings, Preprocessor, whitening_from_covariance};
use crate::probe::Probe;
use crate::recording::{Recording, WindowPlan, read_window};
use crate::timing::StageTimer;

/// What [`fit_whitening_for`] found.
#[derive(Debug, Clone)]
pub struct WhiteningFit {
    /// The whitening matrix to apply to the unscaled data, n_sites × n_sites
    /// (the scale factor is folded in, as in [`run_detection`](super::run_detection)).
    pub whitening: Array2<f32>,
    /// The factor k the data were whitened as if multiplied by (1 when none).
    pub scale_factor: f64,
    /// The windows of the run (`batch_size` own samples, `nt` on each side).
    pub plan: WindowPlan,
    /// The settings as used: `fs` from the recording, `batch_size` lowered to a
    /// recording shorter than one batch.
    pub settings: PreprocessSettings,
    /// Warnings of the fit (scale, channel check over the fit's windows).
    pub warnings: Vec<String>,
    /// Busy seconds of the fit's parts: those of
    /// [`FitTimes`](crate::preprocess::FitTimes), plus `checks` (the input
    /// checks, out of `read`) and `zca` (the matrix from the covariance).
    pub times: crate::preprocess::FitTimes,
}

/// The whitening fit of [`run_detection`](super::run_detection) on its own (Kilosort4's
/// `get_whitening_matrix` over every `nskip`-th window, with spikecube's input
/// checks), for callers that cut and preprocess windows themselves, such as
/// the SpikeInterface method of the Python package: the same settings checks,
/// the same window plan and the same matrix as a `detect` run on `rec`.
///
/// # Errors
/// As [`run_detection`](super::run_detection) for the settings, the probe against the recording and
/// the reads.
pub fn fit_whitening_for(
    rec: &Arc<dyn Recording>,
    probe: &Probe,
    settings: &PreprocessSettings,
    checks: &Checks,
) -> Result<WhiteningFit> {
    fit_whitening_with(rec, probe, settings, checks, FitOptions::default())
}

/// [`fit_whitening_for`] scheduled as `options` says (the same W whatever
/// the options; for benchmarks).
///
/// # Errors
/// As [`fit_whitening_for`].
pub fn fit_whitening_with(
    rec: &Arc<dyn Recording>,
    probe: &Probe,
    settings: &PreprocessSettings,
    checks: &Checks,
    options: FitOptions,
) -> Result<WhiteningFit> {
    let mut settings = settings.clone();
    settings.fs = rec.fs();
    settings.validate()?;
    fit_batch_to_recording(rec.as_ref(), &mut settings);
    let plan = plan_windows(rec.as_ref(), probe, settings.batch_size, settings.nt)?;
    let fitted = fit(rec, &plan, probe, &settings, checks, options)?;
    let mut warnings: Vec<String> = fitted.scale_message.iter().cloned().collect();
    warnings.extend(fitted.noisy_message.iter().cloned());
    if let Some(w) = fitted
        .health
        .warning("the windows of the whitening fit", checks.mask_clipped)
    {
        warnings.push(w);
    }
    Ok(WhiteningFit {
        whitening: fitted.whitening,
        scale_factor: fitted.scale_factor,
        plan,
        settings,
        warnings,
        times: fitted.times,
    })
}

/// What the whitening fit found (stage 3's output).
pub(crate) struct Fitted {
    /// W to apply to the (unscaled) data: `k·W(k²·C)`.
    pub whitening: Array2<f32>,
    /// The factor k (1 when the scale was fine or auto-scaling is off).
    pub scale_factor: f64,
    /// Why the data were rescaled.
    pub scale_message: Option<String>,
    /// Noisy channels found in the fit's covariance ([`checks::noisy_channels_warning`]).
    pub noisy_message: Option<String>,
    /// Channel check over the windows of the fit.
    pub health: ChannelHealth,
    /// Busy seconds of the fit's parts (`whitening_fit.<part>` in the timings).
    pub times: crate::preprocess::FitTimes,
}

/// The whitening fit of a run: on the device when `device` preprocesses
/// ([`Device::for_fit`]), on the host otherwise. The channel check over the
/// fit's windows is logged (the pass repeats it over every window), a
/// rescaling is a warning of the run, and the fit's parts go into `timer`
/// as `whitening_fit.<part>`.
///
/// # Errors
/// A failed read or device step; a covariance that cannot be whitened.
pub(crate) fn fit_run(
    job: &DetectJob,
    run: &mut OpenRun,
    device: &mut Device,
    timer: &mut StageTimer,
) -> Result<Fitted> {
    let fitted = fit_with_device(
        &job.recording,
        &run.plan,
        &job.probe,
        &job.preprocess,
        &job.checks,
        FitOptions::default(),
        device.for_fit(),
    )?;
    if let Some(w) = fitted
        .health
        .warning("the windows of the whitening fit", job.checks.mask_clipped)
    {
        tracing::warn!("{w}");
    }
    if let Some(m) = &fitted.scale_message {
        run.warnings.push(m.clone());
    }
    if let Some(m) = &fitted.noisy_message {
        run.warnings.push(m.clone());
    }
    for (part, v) in &fitted.times.0 {
        timer.add(format!("whitening_fit.{part}"), *v);
    }
    Ok(fitted)
}

/// Kilosort4's whitening fit over the planned windows of `rec` (raw windows read
/// with the probe's channel map; stuck stretches masked when
/// `checks.mask_clipped`), with the scale check: when the covariance says the
/// data are far from int16 scale ([`checks::scale_factor`]) and
/// `checks.auto_scale`, W is fitted to the data times k and multiplied by k,
/// which whitens exactly as scaling the input by k would.
pub(crate) fn fit(
    rec: &Arc<dyn Recording>,
    plan: &WindowPlan,
    probe: &Probe,
    settings: &PreprocessSettings,
    checks: &Checks,
    options: FitOptions,
) -> Result<Fitted> {
    fit_with_device(rec, plan, probe, settings, checks, options, None)
}

/// [`fit`], the covariance computed on `device`'s GPU when one is given and can
/// ([`fit_covariance_on_device`]); on the host otherwise.
fn fit_with_device(
    rec: &Arc<dyn Recording>,
    plan: &WindowPlan,
    probe: &Probe,
    settings: &PreprocessSettings,
    checks: &Checks,
    options: FitOptions,
    device: Option<(&mut Detector, &Preprocessor)>,
) -> Result<Fitted> {
    let min_run = checks::stuck_min_run(rec.fs());
    let mut health = ChannelHealth::new(&probe.chan_map);
    // The parts' busy seconds (`whitening_fit.<part>` in the timings).
    let mut times = crate::preprocess::FitTimes::default();
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if let Some((detector, pre)) = device
        && let Some(cc) = fit_covariance_on_device(
            rec,
            plan,
            probe,
            settings,
            checks,
            detector,
            pre,
            &mut health,
            &mut times,
        )?
    {
        return finish_fit(cc, probe, settings, checks, health, times);
    }
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    let _ = device;
    let mut checks_s = 0.0;
    let cc = crate::preprocess::whitening_covariance_into(
        plan.n_windows,
        |i, w: &mut Array2<f32>| -> Result<()> {
            read_window(rec.as_ref(), plan, i, &probe.chan_map, w)?;
            let t_checks = Instant::now();
            let cols = checks::WindowColumns::of(plan, i);
            let first = rec.first_sample() as i64 + plan.window_first_column(i);
            // The checks in one pass over the rows, on the reading thread.
            checks::check_array(
                w,
                first,
                &cols,
                min_run,
                Some(&mut health),
                checks.mask_clipped,
            );
            checks_s += t_checks.elapsed().as_secs_f64();
            Ok(())
        },
        probe,
        settings,
        options,
        &mut times,
    )
    .context("fitting the whitening matrix")?;
    // `read` (the closure) includes the checks: split them.
    times.add("read", -checks_s);
    times.add("checks", checks_s);
    finish_fit(cc, probe, settings, checks, health, times)
}

/// The fit's last steps from the covariance `cc`: the scale check and W.
fn finish_fit(
    cc: Array2<f64>,
    probe: &Probe,
    settings: &PreprocessSettings,
    checks: &Checks,
    health: ChannelHealth,
    mut times: crate::preprocess::FitTimes,
) -> Result<Fitted> {
    let t_zca = Instant::now();
    let (k, message) = match checks::scale_factor(&cc) {
        Some((k, sd)) if checks.auto_scale => (k, Some(checks::scale_message(k, sd))),
        _ => (1.0, None),
    };
    let whitening = if k == 1.0 {
        whitening_from_covariance(&cc, probe, settings.whitening_range)
    } else {
        whitening_from_covariance(&cc.mapv(|v| v * k * k), probe, settings.whitening_range)
            .map(|w| w.mapv(|v| (f64::from(v) * k) as f32))
    }
    .context("fitting the whitening matrix")?;
    times.lap("zca", t_zca);
    Ok(Fitted {
        whitening,
        scale_factor: k,
        scale_message: message,
        noisy_message: checks::noisy_channels_warning(&cc, &probe.chan_map),
        health,
        times,
    })
}

/// The channel check of a run before it starts (BR-22): reads the windows the
/// whitening fit reads (every `nskip`-th window, as planned for `settings`'s
/// batch size) and returns what [`ChannelHealth`] finds there: all-zero,
/// constant and duplicated channels, stuck (clipped) stretches. `spikecube
/// probe REC` reports it; `detect` repeats it over the whole recording.
///
/// # Errors
/// As [`run_detection`](super::run_detection) for the probe against the recording; when a read fails.
pub fn channel_check(
    rec: &dyn Recording,
    probe: &Probe,
    settings: &PreprocessSettings,
) -> Result<ChannelHealth> {
    let mut settings = settings.clone();
    fit_batch_to_recording(rec, &mut settings);
    let plan = plan_windows(rec, probe, settings.batch_size, settings.nt)?;
    let min_run = checks::stuck_min_run(rec.fs());
    let mut health = ChannelHealth::new(&probe.chan_map);
    let mut w = Array2::zeros((probe.n_sites(), plan.window_len()));
    for i in crate::preprocess::covariance_windows(plan.n_windows, settings.nskip as u64) {
        read_window(rec, &plan, i, &probe.chan_map, &mut w)?;
        let cols = checks::WindowColumns::of(&plan, i);
        let runs = checks::find_stuck_runs(&w, cols.lo, cols.hi, min_run);
        let first = rec.first_sample() as i64 + plan.window_first_column(i);
        health.observe(w.view(), cols.own, first, &runs);
    }
    Ok(health)
}
