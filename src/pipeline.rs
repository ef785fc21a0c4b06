//! The main job: a recording to spikes on disk (Kilosort4's `run_kilosort` up to
//! and including the first detection pass, without drift correction).
//!
//! 1. Plan the windows ([`WindowPlan`]: `batch_size` own samples, `nt` on each side).
//! 2. Fit the whitening matrix on every `nskip`-th window ([`fit_whitening`](crate::preprocess::fit_whitening)).
//! 3. For every window, read it and run the input checks, preprocess
//!    ([`Preprocessor`]: channel means, median CAR, high-pass, whitening), detect
//!    ([`Detector`]: CPU or GPU) and stream the spikes to the output folder
//!    ([`OutputWriter`]); the three overlap across windows on their own threads
//!    ([`crate::stages`]).
//!
//! Before and during the run, the input checks of [`crate::checks`] run (see
//! [`Checks`]): the data's scale, channel health and stuck stretches, the
//! layout against the file, common referencing over too few sites; duplicate
//! detections of one event across a window boundary are removed. Their
//! warnings end up in [`Report::warnings`] and `spikecube.json`.
//!
//! Only detections within a window's own samples are kept, so every spike time t
//! satisfies 0 ≤ t < n_samples and no spike is reported twice (field failures
//! BR-17, BR-18). The last window's right pad repeats the last sample; Kilosort4
//! can report spikes there, past the end of the recording, and spikecube drops them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ndarray::Array2;

use crate::backend::{Backend, Detector};
use crate::checks::{self, ChannelHealth, Near};
use crate::detect::cpu::Detections;
use crate::detect::{DetectionSettings, Geometry, UniversalTemplates};
use crate::output::{OutputWriter, RunInfo, Summary};
use crate::preprocess::{FitOptions, PreprocessSettings, Preprocessor, whitening_from_covariance};
use crate::probe::Probe;
use crate::recording::{Recording, WindowLoader, WindowPlan, read_window};
use crate::stages::{HostPass, WindowInfo};

/// Everything one detection run needs.
pub struct DetectJob {
    /// The recording (after `tmin`/`tmax`).
    pub recording: Arc<dyn Recording>,
    /// Site geometry; `chan_map` indexes the recording's channels.
    pub probe: Probe,
    /// Detection settings (Kilosort4's names and defaults).
    pub detection: DetectionSettings,
    /// Preprocessing settings; `fs` is taken from the recording.
    pub preprocess: PreprocessSettings,
    /// Final output folder.
    pub out: PathBuf,
    /// What to record in `params.py` and `spikecube.json` about the input.
    pub run_info: RunInfo,
    /// Where detection runs (resolved with [`crate::backend::choose`]).
    pub backend: Backend,
    /// Input checks and the corrections that go beyond Kilosort4.
    pub checks: Checks,
    /// Universal templates: learned from the data (Kilosort4's default), built-in or a file (issue 11).
    pub templates: crate::universal::TemplateSource,
    /// Drift estimation and correction (issue 12, [`crate::drift`]);
    /// [`crate::drift::DriftSettings::off`] for a single pass.
    pub drift: crate::drift::DriftSettings,
    /// On a GPU back end, preprocess on the device too (default); false keeps
    /// preprocessing on the host (`--preprocess-on host`).
    pub device_preprocessing: bool,
    /// Whether the process ends after this run (`spikecube detect`): then
    /// a CUDA pass ends the device's context on a thread while the outputs
    /// are written ([`crate::backend::end_cuda_context`]) instead of at the
    /// process's exit. False wherever CUDA may run again in the process
    /// (Python, benches, tests).
    pub last_device_use: bool,
}

/// Input checks of a run and the corrections spikecube makes where Kilosort4
/// would return a quietly wrong result (README, "Where spikecube differs").
#[derive(Debug, Clone)]
pub struct Checks {
    /// Warnings found before the run (e.g. by the command line about the probe
    /// and the file); they are logged again and kept in `spikecube.json`.
    pub warnings: Vec<String>,
    /// Rescale data whose filtered channel sd is far outside int16 counts
    /// ([`checks::scale_factor`], BR-12). The command line turns it off when
    /// `--scale` is given.
    pub auto_scale: bool,
    /// Replace stuck (clipped) stretches by the channel's median before
    /// filtering ([`checks::mask_stuck_runs`], BR-22). `--mask-clipped false`.
    pub mask_clipped: bool,
    /// Remove duplicate detections of one event across window boundaries
    /// ([`checks::boundary_duplicates`], BR-19). `--keep-boundary-duplicates`.
    pub remove_boundary_duplicates: bool,
    /// The recording is a flat binary file: check that its channel count
    /// looks right ([`checks::channel_count_warning`], BR-26).
    pub check_channel_count: bool,
}

impl Default for Checks {
    fn default() -> Self {
        Checks {
            warnings: Vec::new(),
            auto_scale: true,
            mask_clipped: true,
            remove_boundary_duplicates: true,
            check_channel_count: false,
        }
    }
}

/// What a run asks of [`open_for_detection`]: the recording's files, how to
/// read them, the probe (or `None`: the one in the recording's metadata) and
/// the input checks (the command line's and the Python package's options).
#[derive(Debug, Clone, Default)]
pub struct InputRequest {
    /// Recording files or folders (several are concatenated in time).
    pub paths: Vec<std::path::PathBuf>,
    /// How to read them.
    pub open: crate::recording::OpenOptions,
    /// The probe given by the user.
    pub probe: Option<Probe>,
    /// How the user gives a probe (`--probe` or `probe=`), for the error
    /// when there is none.
    pub probe_hint: &'static str,
    /// File channels (raw-file columns) to leave out.
    pub exclude_channels: Vec<u64>,
    /// `Checks::mask_clipped`.
    pub mask_clipped: bool,
    /// Keep both detections of an event straddling a window boundary (Kilosort4).
    pub keep_boundary_duplicates: bool,
}

/// Opens the recording(s) of `req` and settles the probe and the input checks
/// of the run: the probe without the excluded channels, a warning when its
/// sites leave file channels unread (SpikeGLX's sync and LF channels are
/// expected to be), automatic rescaling unless a scale was given, and the
/// channel-count check for flat binary files.
///
/// # Errors
/// No recording given, a recording that cannot be opened, no probe (naming
/// `probe_hint`), or excluded channels the probe does not have.
pub fn open_for_detection(req: &InputRequest) -> Result<(crate::recording::Opened, Probe, Checks)> {
    let opened = match req.paths.as_slice() {
        [] => bail!("no recording given"),
        [one] => crate::recording::open(one, &req.open)?,
        many => crate::recording::open_many(many, &req.open)?,
    };
    let first = &req.paths[0];
    let probe = match (&req.probe, &opened.probe) {
        (Some(p), _) => p.clone(),
        (None, Some(p)) => p.clone(),
        (None, None) => bail!(
            "{}: no probe geometry: give one with {} (Kilosort JSON, probeinterface JSON or .prb)",
            first.display(),
            req.probe_hint
        ),
    };
    let probe = if req.exclude_channels.is_empty() {
        probe
    } else {
        checks::exclude_channels(&probe, &req.exclude_channels)?
    };
    let mut warnings = Vec::new();
    let n_file = opened.recording.n_channels();
    let expected_unused = opened
        .probe
        .as_ref()
        .map_or(0, |p| n_file.saturating_sub(p.n_sites()));
    if let Some(w) = checks::unused_channels_warning(
        &probe,
        n_file,
        expected_unused + req.exclude_channels.len(),
    ) {
        warnings.push(w);
    }
    let structured = first.is_dir()
        || first.extension().is_some_and(|e| e == "oebin")
        || first.with_extension("meta").is_file();
    if !structured && let Some(w) = checks::dtype::dtype_warning(first, &req.open) {
        warnings.insert(0, w); // before any rescaling's message
    }
    warnings.extend(crate::recording::junction_warnings(&req.paths, &req.open));
    let checks = Checks {
        warnings,
        auto_scale: req.open.scale.is_none(),
        mask_clipped: req.mask_clipped,
        remove_boundary_duplicates: !req.keep_boundary_duplicates,
        check_channel_count: !structured,
    };
    Ok((opened, probe, checks))
}

impl Checks {
    /// Kilosort4's behaviour: no correction (warnings are still collected).
    pub fn kilosort() -> Self {
        Checks {
            auto_scale: false,
            mask_clipped: false,
            remove_boundary_duplicates: false,
            ..Checks::default()
        }
    }
}

/// Progress of a run, reported once per window.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Windows done.
    pub windows_done: u64,
    /// Windows in the run.
    pub windows_total: u64,
    /// Spikes found so far.
    pub spikes: u64,
    /// Recording time processed, seconds.
    pub seconds_done: f64,
    /// Wall time since detection started, seconds.
    pub elapsed: f64,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Report {
    /// The output folder's summary.
    pub summary: Summary,
    /// Windows processed.
    pub n_windows: u64,
    /// Recording duration processed, seconds.
    pub seconds: f64,
    /// Wall time of the whole run, seconds.
    pub wall: f64,
    /// Template centres.
    pub n_centres: usize,
    /// Detections dropped because they fell in the padding past the recording's end.
    pub dropped_in_padding: u64,
    /// Duplicate detections of one event across a window boundary that were removed.
    pub boundary_duplicates_removed: u64,
    /// Stuck (clipped) samples replaced before filtering, summed over channels.
    pub clipped_samples_masked: u64,
    /// The factor the data were multiplied by before whitening (1 when none).
    pub scale_factor: f64,
    /// Warnings of the run, in the order raised (also in `spikecube.json`).
    pub warnings: Vec<String>,
}

/// Runs whitening fit, preprocessing and detection over the whole recording and
/// writes the output folder atomically.
///
/// `progress` is called after each window.
///
/// # Errors
/// When the probe does not fit the recording (a channel-map entry past the file's
/// channels), the settings are invalid, the recording holds less than one window
/// of at least `nt` samples, a read fails, or the output cannot be written. On
/// error nothing is left at `job.out` (a previous result there is kept).
pub fn run_detection(mut job: DetectJob, progress: &mut dyn FnMut(Progress)) -> Result<Report> {
    let t_start = Instant::now();
    let rec = job.recording.clone();
    let fs = rec.fs();
    job.preprocess.fs = fs;
    job.preprocess.nt = job.detection.nt;
    job.detection.validate()?;
    job.preprocess.validate()?;
    let mut warnings = Warnings::default();
    for w in std::mem::take(&mut job.checks.warnings) {
        warnings.push(w);
    }
    fit_batch_to_recording(rec.as_ref(), &mut job.preprocess);
    let plan = plan_windows(
        rec.as_ref(),
        &job.probe,
        job.preprocess.batch_size,
        job.detection.nt,
    )?;
    let chan_map = job.probe.chan_map.clone();
    let n_sites = job.probe.n_sites();
    layout_checks(
        rec.as_ref(),
        &job.probe,
        &job.preprocess,
        &job.checks,
        &mut warnings,
    )?;

    // Geometry first: a probe that cannot work fails before any data is read.
    let geometry = Geometry::new(&job.probe, &job.detection)?;
    // So does an --nblocks the probe cannot hold.
    if job.drift.nblocks > 0 {
        crate::drift::check_nblocks(&job.drift, &job.probe)?;
    }
    let n_centres = geometry.n_centres();
    // So does an output folder that cannot be written.
    let mut writer = OutputWriter::create(&job.out, &job.probe, &geometry, job.detection.n_pcs)?;
    tracing::info!(
        "{} of {} samples, {} in flight; memory about {:.0} MB, fixed by the window size and the probe, not by the recording's length or spike count",
        crate::error::count(plan.n_windows, "window"),
        plan.window_len(),
        crate::stages::WINDOWS_IN_FLIGHT,
        memory_estimate(n_sites, plan.window_len(), n_centres) as f64 / 1e6
    );

    // The back end next, before any data is read: a missing or too small device
    // fails (or, with `auto`, falls back to the CPU) at once.
    let t_probe = Instant::now();
    let mut chosen = crate::backend::choose(job.backend)?;
    let device_probe_s = t_probe.elapsed().as_secs_f64();
    // ---- issue 10 (page-locked pool): opened and filled on its own thread
    // while the device opens and warms up (`reserve_pinned`); kept to the end
    // of the run (dropping it stops the reservation).
    #[cfg(feature = "cuda")]
    let mut pinned = reserve_pinned(
        &chosen,
        job.device_preprocessing,
        rec.as_ref(),
        &plan,
        &chan_map,
    );
    // ---- end issue 10 (page-locked pool) ----
    let t_open = Instant::now();
    let mut detector = Detector::new(
        &chosen,
        geometry.clone(),
        UniversalTemplates::builtin(),
        job.detection.clone(),
    )?;
    let max_len = detector.max_window_samples(n_sites);
    if plan.window_len() > max_len {
        let why = format!(
            "{} holds windows of at most {max_len} samples for {n_sites} channels, these have {}",
            chosen.device,
            plan.window_len()
        );
        if job.backend == Backend::Auto {
            tracing::warn!("{why}; detecting on the CPU instead");
            chosen = crate::backend::choose(Backend::Cpu)?;
            chosen.reason = format!("auto: {why}");
            detector = Detector::new(
                &chosen,
                geometry.clone(),
                UniversalTemplates::builtin(),
                job.detection.clone(),
            )?;
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
    // ---- issue 10 (page-locked pool): the detector's packers share it ----
    #[cfg(feature = "cuda")]
    if chosen.backend != "cuda" {
        pinned = None; // `auto` went to the CPU: stop the reservation
    }
    #[cfg(feature = "cuda")]
    if let Some(p) = pinned.as_mut().and_then(|r| r.pool()) {
        detector.use_pinned_pool(p);
    }
    // ---- end issue 10 (page-locked pool) ----

    let device_open_s = t_open.elapsed().as_secs_f64();

    // ---- issue 10: on a GPU that preprocesses, the device starts (kernels
    // compiled, buffers allocated, with a stand-in whitening) and then fits
    // the whitening itself: the host only reads and checks the fit's windows.
    let warm_pre = if job.device_preprocessing && chosen.backend != "cpu" {
        Some(Preprocessor::new(&job.preprocess, Array2::eye(n_sites))?)
    } else {
        None
    };
    let t_warm = Instant::now();
    let mut warm_up_s = 0.0;
    if let Some(p) = &warm_pre {
        // A failure shows again, with its context, when the fit or the pass
        // sets the preprocessing: only logged here.
        if let Err(e) = detector.warm_up(p, &job.probe.yc) {
            tracing::debug!("device warm-up: {e}");
        }
        warm_up_s = t_warm.elapsed().as_secs_f64();
    }
    let t_fit = Instant::now();
    let fitted = fit_with_device(
        &rec,
        &plan,
        &job.probe,
        &job.preprocess,
        &job.checks,
        FitOptions::default(),
        warm_pre.as_ref().map(|p| (&mut detector, p)),
    )?;
    // ---- end issue 10 ----
    if let Some(w) = fitted
        .health
        .warning("the windows of the whitening fit", job.checks.mask_clipped)
    {
        tracing::warn!("{w}");
    }
    if let Some(m) = &fitted.scale_message {
        warnings.push(m.clone());
    }
    fitted
        .noisy_message
        .iter()
        .for_each(|m| warnings.push(m.clone()));
    let whiten_mat = fitted.whitening;
    let fit_times = fitted.times;
    let fit_s = t_fit.elapsed().as_secs_f64();
    let pre = Preprocessor::new(&job.preprocess, whiten_mat.clone())?;

    // ---- issue 11: universal templates learned from the data (or built-in, or a file) ----
    // Learning reads every 25th window, preprocessed exactly as detection sees it.
    let t_learn = Instant::now();
    // Window i as read, stuck stretches masked when the run masks them (the
    // learning steps' windows, before and after drift correction).
    let min_run_learn = checks::stuck_min_run(fs);
    let read_masked = |i: u64| -> Result<Array2<f32>> {
        let mut w = Array2::zeros((n_sites, plan.window_len()));
        read_window(rec.as_ref(), &plan, i, &chan_map, &mut w)?;
        if job.checks.mask_clipped {
            let cols = checks::WindowColumns::of(&plan, i);
            checks::mask_stuck_runs(&mut w, cols.lo, cols.hi, cols.pad_repeats, min_run_learn);
        }
        Ok(w)
    };
    let mut chosen_templates = {
        crate::universal::choose(
            &job.templates,
            plan.n_windows,
            job.detection.nt,
            job.detection.nt0min(),
            |i| {
                let mut w = read_masked(i)?;
                pre.apply(&mut w)
                    .with_context(|| format!("preprocessing window {i} for learning templates"))?;
                Ok(w)
            },
        )?
    };
    if let Some(w) = &chosen_templates.warning {
        warnings.push(w.clone());
    }
    if chosen_templates.templates != UniversalTemplates::builtin()
        && detector.set_templates(&chosen_templates.templates).is_err()
    {
        // Templates of other shapes than the detector's (a new one is made);
        // otherwise the same detector goes on, and a GPU keeps its buffers.
        detector = Detector::new(
            &chosen,
            geometry.clone(),
            chosen_templates.templates.clone(),
            job.detection.clone(),
        )?;
        // Issue 10: the run's page-locked pool goes on with the new detector.
        #[cfg(feature = "cuda")]
        if let Some(p) = pinned.as_mut().and_then(|r| r.pool()) {
            detector.use_pinned_pool(p);
        }
    }
    crate::universal::write_outputs(writer.partial_path(), &chosen_templates)?;
    let learn_s = t_learn.elapsed().as_secs_f64();
    // ---- end issue 11 ----
    // ---- issue 10: the pass (preprocessing + detection, on the host or the
    // device), used by the drift step's first pass and by the main pass. GPU
    // back ends preprocess on the device: each raw window goes up as it was
    // read (int16 values two per word; page-locked with CUDA).
    let host_pass = |detector: Detector| -> Box<dyn crate::stages::WindowPass> {
        Box::new(HostPass {
            pre: pre.clone(),
            detector,
            yc: job.probe.yc.clone(),
            drift: None,
        })
    };
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    let mut pass = if job.device_preprocessing {
        match crate::stages::DevicePass::new(detector, &pre, job.probe.yc.clone())? {
            Ok(p) => Box::new(p) as Box<dyn crate::stages::WindowPass>,
            Err(d) => host_pass(d),
        }
    } else {
        host_pass(detector)
    };
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    let mut pass = host_pass(detector);
    let preprocess_on = pass.preprocess_on();
    let device_highpass = pass.device_highpass();
    if let Some(h) = device_highpass {
        tracing::info!("high-pass on the device: {h}");
    }
    // ---- end issue 10 ----
    // ---- drift (issue 12, src/drift): first pass, estimate, drift files ----
    let drift = std::sync::Arc::new({
        let fp = crate::drift::FirstPass {
            recording: &rec,
            plan: &plan,
            probe: &job.probe,
            pre: &pre,
            nt: job.detection.nt as u64,
            mask_clipped: job.checks.mask_clipped,
        };
        let staged = writer.partial_path().to_path_buf();
        let mut found = Vec::new();
        let th = f64::from(job.detection.th_universal);
        let run = crate::drift::prepare(
            &fp,
            &job.drift,
            th,
            pass.as_mut(),
            &staged,
            &mut |d, first| writer.append(d, first),
            &mut |w| found.push(w),
        )?;
        found.into_iter().for_each(|w| warnings.push(w));
        run
    });
    // Kilosort4 learns wTEMP/wPCA again for the second pass, from the
    // drift-corrected windows (drift-spec.md §8); those templates are the output's.
    let mut templates_first_pass = None;
    let mut relearn_s = 0.0;
    if drift.correction.is_some()
        && drift.windows_to_detect() > 0
        && matches!(job.templates, crate::universal::TemplateSource::Learned(_))
    {
        let t = Instant::now();
        let second = crate::universal::choose(
            &job.templates,
            plan.n_windows,
            job.detection.nt,
            job.detection.nt0min(),
            |i| {
                let mut w = read_masked(i)?;
                drift.preprocess(&pre, i, &mut w).with_context(|| {
                    format!("preprocessing window {i} (drift-corrected) for learning templates")
                })?;
                Ok(w)
            },
        )?;
        let mut second = second;
        second.description["windows"] = "drift-corrected (second pass)".into();
        if let Some(w) = &second.warning {
            warnings.push(format!("second pass (drift-corrected): {w}"));
        }
        pass.set_templates(&second.templates)?;
        crate::universal::write_outputs(writer.partial_path(), &second)?;
        templates_first_pass = Some(std::mem::replace(&mut chosen_templates, second));
        relearn_s = t.elapsed().as_secs_f64();
    }
    // ---- end drift ----

    let nt = job.detection.nt as u64;
    let nt0min = job.detection.nt0min();
    let min_run = checks::stuck_min_run(fs);
    let mut health = ChannelHealth::new(&chan_map);
    let t_detect = Instant::now();
    let mut spikes = 0u64;
    let mut dropped = 0u64;
    let mut duplicates = 0u64;
    let mut seconds_done = 0f64;
    let mut windows_done = 0u64;
    // The previous window's detections, held back until the next window has
    // been compared with them (boundary duplicates), with its first sample.
    let mut pending: Option<(Detections, i64)> = None;
    // ---- issue 10: the pipelined window loop (src/stages.rs) ----
    // read + input checks | preprocess + detect | write, overlapping.
    pass.set_drift(Some(drift.clone()))?; // issue 12: M_b·W per window
    let mask_clipped = job.checks.mask_clipped;
    let health_ref = &mut health;
    // The checks' work on the reading threads; only adding each window's
    // channel facts to the run's is in window order.
    let prepare = move |w: &mut crate::recording::Window| -> Result<checks::WindowHealth> {
        let cols = checks::WindowColumns::of(&plan, w.index);
        Ok(checks::precheck_window(w, &cols, min_run, mask_clipped).1)
    };
    let merge = move |_: &mut crate::recording::Window, h: checks::WindowHealth| -> Result<()> {
        health_ref.merge(&h);
        Ok(())
    };
    let zeroed_before = pre.artifact_windows();
    // `--drift-only`: the first pass's spikes are the output; no second pass.
    let stages = if drift.windows_to_detect() == 0 {
        crate::stages::StagesReport::default()
    } else {
        crate::stages::run_windows_prechecked(
            rec.clone(),
            plan,
            &chan_map,
            &prepare,
            merge,
            pass.as_mut(),
            |w: WindowInfo, mut det: Detections| -> Result<()> {
                let before = det.len();
                let own_end = nt + w.own_len;
                det.retain(|_, t| t >= nt && t < own_end);
                dropped += (before - det.len()) as u64;
                if job.checks.remove_boundary_duplicates {
                    if let Some((mut prev, prev_first)) = pending.take() {
                        duplicates += remove_boundary_duplicates(
                            &mut prev,
                            prev_first,
                            &mut det,
                            w.first_sample,
                            w.own_start as i64,
                            &geometry,
                            nt0min,
                        );
                        writer.append(&prev, prev_first)?;
                        spikes += prev.len() as u64;
                    }
                    pending = Some((det, w.first_sample));
                } else {
                    writer.append(&det, w.first_sample)?;
                    spikes += det.len() as u64;
                }
                seconds_done += w.own_len as f64 / fs;
                windows_done += 1;
                progress(Progress {
                    windows_done,
                    windows_total: plan.n_windows,
                    spikes: spikes + pending.as_ref().map_or(0, |p| p.0.len() as u64),
                    seconds_done,
                    elapsed: t_detect.elapsed().as_secs_f64(),
                });
                Ok(())
            },
        )?
    };
    // ---- end issue 10 ----
    if let Some((prev, prev_first)) = pending.take() {
        writer.append(&prev, prev_first)?;
        spikes += prev.len() as u64;
    }
    let zeroed = pre.artifact_windows() - zeroed_before;
    let (thr, bs) = (job.preprocess.artifact_threshold, job.preprocess.batch_size);
    if let Some(w) = checks::artifact_windows_warning(thr, zeroed, plan.n_windows, bs, fs) {
        warnings.push(w);
    }
    if drift.windows_to_detect() > 0
        && let Some(w) = checks::zero_spikes_warning(spikes, rec.n_samples() as f64 / fs)
    {
        warnings.push(w);
    }
    if dropped > 0 {
        tracing::info!(
            "{dropped} detections in the last window's padding (past the end of the recording) were dropped"
        );
    }
    if duplicates > 0 {
        tracing::info!(
            "{duplicates} duplicate detections of events straddling a window boundary were removed (--keep-boundary-duplicates keeps them, as Kilosort4 does)"
        );
    }
    // Stuck samples are counted as masked only when they were (the channel
    // findings name them either way).
    let clipped = if job.checks.mask_clipped {
        health.stuck_samples()
    } else {
        0
    };
    if let Some(w) = health.warning("the whole recording", job.checks.mask_clipped) {
        warnings.push(w);
    }
    let mut info = job.run_info;
    info.fs = fs;
    info.n_samples = rec.n_samples();
    info.whitening = whiten_mat;
    info.settings = serde_json::json!({
        "detection": job.detection,
        "preprocessing": job.preprocess,
        "n_windows": plan.n_windows,
        "n_centres": n_centres,
        "nearest_chans_used": geometry.n_chans(),
        "dmin_used": geometry.dmin,
        "detections_dropped_in_padding": dropped,
        "templates": chosen_templates.description, // issue 11
        "preprocessing_on": preprocess_on,
        "device_highpass": device_highpass,
        "upload_bytes_per_window": pass.bytes_uploaded() / pass.windows_uploaded().max(1),
        "checks": {
            "auto_scale": job.checks.auto_scale,
            "scale_factor_applied": fitted.scale_factor,
            "mask_clipped": job.checks.mask_clipped,
            "clipped_samples_masked": clipped,
            "remove_boundary_duplicates": job.checks.remove_boundary_duplicates,
            "boundary_duplicates_removed": duplicates,
            "channel_findings": health.findings(),
        },
    });
    info.warnings = warnings.0.clone();
    info.versions
        .insert("spikecube".into(), env!("CARGO_PKG_VERSION").into());
    info.versions
        .insert("kilosort_reference".into(), "4.1.7".into());
    info.versions
        .insert("backend".into(), chosen.backend.clone());
    info.versions.insert("device".into(), chosen.device.clone());
    info.versions
        .insert("backend_reason".into(), chosen.reason.clone());
    // ---- issue 10: busy seconds per stage, the stages' wall and overlap ----
    info.timings.insert("whitening_fit".into(), fit_s);
    if chosen.backend != "cpu" {
        info.timings.insert("device_probe".into(), device_probe_s);
        info.timings.insert("device_open".into(), device_open_s);
    }
    if warm_up_s > 0.0 {
        info.timings.insert("device_warm_up".into(), warm_up_s);
    }
    for (part, v) in &fit_times.0 {
        info.timings.insert(format!("whitening_fit.{part}"), *v);
    }
    for (k, v) in &stages.times.0 {
        info.timings.insert(k.clone(), *v);
    }
    for (k, v) in pass.step_medians() {
        // Per-window medians of the device's steps (sampled windows).
        let key = match k.as_str() {
            "windows_timed" => "device_windows_timed".to_string(),
            _ => format!("device_window_median_{k}"),
        };
        info.timings.insert(key, v);
    }
    // ---- issue 10 (page-locked pool): blocks made ahead and on demand ----
    #[cfg(feature = "cuda")]
    if let Some(p) = pinned.as_mut().and_then(|r| r.pool()) {
        let st = p.stats();
        tracing::info!(
            "page-locked window buffers: {} made ahead ({:.3} s on their own thread), {} when needed ({:.3} s)",
            st.reserved,
            st.reserve_s,
            st.on_demand,
            st.on_demand_s
        );
        info.timings.insert("pinned_reserve".into(), st.reserve_s);
        info.timings
            .insert("pinned_on_demand".into(), st.on_demand_s);
    }
    // ---- end issue 10 (page-locked pool) ----
    info.timings.insert("stages_wall".into(), stages.wall);
    info.timings.insert("overlap".into(), stages.overlap());
    info.timings
        .insert("total".into(), t_start.elapsed().as_secs_f64());
    // ---- end issue 10 ----
    info.timings.insert("templates".into(), learn_s); // issue 11
    // ---- drift (issue 12) ----
    drift.record(&mut info, writer.n_spikes());
    if let Some(first) = &templates_first_pass {
        info.settings["drift"]["templates_first_pass"] = first.description.clone();
        info.settings["drift"]["templates_second_pass"] = chosen_templates.description.clone();
        info.timings
            .insert("templates_second_pass".into(), relearn_s);
    }
    // ---- end drift ----
    // ---- issue 10: the device's teardown beside the writing ----
    // Nothing uses the device past this point: the pass, its buffers and
    // the page-locked pool are dropped and the CUDA context ended on a
    // thread while the outputs are written and synced.
    let teardown = (job.last_device_use && chosen.backend == "cuda").then(|| {
        #[cfg(feature = "cuda")]
        let pinned = pinned.take();
        std::thread::spawn(move || {
            drop(pass);
            #[cfg(feature = "cuda")]
            drop(pinned);
            // SAFETY: the process ends after this run (`last_device_use`)
            // and the pass and the pool, the device's last users, are gone.
            unsafe { crate::backend::end_cuda_context() }
        })
    });
    let summary = writer.finish(&info);
    if let Some(t) = teardown {
        let ended = t.join().unwrap_or(false);
        tracing::debug!("CUDA context ended before exit: {ended}");
    }
    let summary = summary?;
    // ---- end issue 10 ----
    Ok(Report {
        summary,
        n_windows: plan.n_windows,
        // `--drift-only`: the first pass covered the recording.
        seconds: if drift.windows_to_detect() == 0 {
            plan.n_used as f64 / fs
        } else {
            seconds_done
        },
        wall: t_start.elapsed().as_secs_f64(),
        n_centres,
        dropped_in_padding: dropped,
        boundary_duplicates_removed: duplicates,
        clipped_samples_masked: clipped,
        scale_factor: fitted.scale_factor,
        warnings: warnings.0,
    })
}

// ==== issue 13 (Python package, spikecube-python): public entry points. ====
// Kept together here so that other edits of this file do not touch them.

/// What [`fit_whitening_for`] found.
#[derive(Debug, Clone)]
pub struct WhiteningFit {
    /// The whitening matrix to apply to the unscaled data, n_sites × n_sites
    /// (the scale factor is folded in, as in [`run_detection`]).
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
    /// Busy seconds of the fit's parts (issue 10): those of
    /// [`FitTimes`](crate::preprocess::FitTimes), plus `checks` (the input
    /// checks, out of `read`) and `zca` (the matrix from the covariance).
    pub times: crate::preprocess::FitTimes,
}

/// The whitening fit of [`run_detection`] on its own (Kilosort4's
/// `get_whitening_matrix` over every `nskip`-th window, with spikecube's input
/// checks), for callers that cut and preprocess windows themselves, such as
/// the SpikeInterface method of the Python package: the same settings checks,
/// the same window plan and the same matrix as a `detect` run on `rec`.
///
/// # Errors
/// As [`run_detection`] for the settings, the probe against the recording and
/// the reads.
pub fn fit_whitening_for(
    rec: &Arc<dyn Recording>,
    probe: &Probe,
    settings: &PreprocessSettings,
    checks: &Checks,
) -> Result<WhiteningFit> {
    fit_whitening_with(rec, probe, settings, checks, FitOptions::default())
}

/// [`fit_whitening_for`] scheduled as `options` says (issue 10: the same W
/// whatever the options; for benchmarks).
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
// ==== end issue 13 ====

/// Warnings of a run: each is logged (`tracing::warn!`, shown even with `-q`)
/// when raised and kept for `spikecube.json` and the final summary.
#[derive(Debug, Default)]
struct Warnings(Vec<String>);

impl Warnings {
    fn push(&mut self, w: String) {
        tracing::warn!("{w}");
        self.0.push(w);
    }
}

/// A recording shorter than one batch is processed as one window of exactly
/// its own length (BR-24): Kilosort4 would pad it (with zeros) to `batch_size`,
/// and the padding would then enter the whitening covariance and the channel
/// means, so the whitened scale, and the spike count, would depend on how far
/// the batch overhangs the data. Kilosort4 itself cannot whiten a
/// single-window recording (its covariance average is 0/0).
fn fit_batch_to_recording(rec: &dyn Recording, settings: &mut PreprocessSettings) {
    let n = rec.n_samples();
    if n > 0 && n < settings.batch_size as u64 && n >= settings.nt as u64 {
        tracing::info!(
            "the recording ({n} samples) is shorter than one batch ({}): batch_size is set to {n}, so the whitening is fitted on real samples only",
            settings.batch_size
        );
        settings.batch_size = n as usize;
    }
}

/// The layout checks (BR-26, BR-27) that need only the probe, the settings
/// and the file: millimetre coordinates, median CAR over too few sites, and
/// (flat binary files) a channel count that looks wrong.
fn layout_checks(
    rec: &dyn Recording,
    probe: &Probe,
    settings: &PreprocessSettings,
    checks: &Checks,
    warnings: &mut Warnings,
) -> Result<()> {
    if let Some(w) = checks::millimetre_warning(probe) {
        warnings.push(w);
    }
    if let Some(w) = checks::car_warning(probe, settings.do_car) {
        warnings.push(w);
    }
    if checks.check_channel_count
        && let Some(w) = checks::channel_count_warning(rec)?
    {
        warnings.push(w);
    }
    Ok(())
}

/// Removes duplicates of one event detected on both sides of the boundary at
/// absolute sample `boundary` ([`checks::boundary_duplicates`]); `prev` and
/// `next` hold window-relative samples, their windows' column 0 at `prev_first`
/// and `next_first`. Returns how many were removed.
fn remove_boundary_duplicates(
    prev: &mut Detections,
    prev_first: i64,
    next: &mut Detections,
    next_first: i64,
    boundary: i64,
    geometry: &Geometry,
    nt0min: usize,
) -> u64 {
    let near = |d: &Detections, first: i64, left: bool| -> (Vec<usize>, Vec<Near>) {
        let mut idx = Vec::new();
        let mut near = Vec::new();
        for i in 0..d.len() {
            let t = first + d.sample[i] as i64;
            // Candidates within nt0min of the boundary, partners within 3·nt0min.
            let close = if left {
                t >= boundary - 3 * nt0min as i64
            } else {
                t < boundary + 3 * nt0min as i64
            };
            if close {
                idx.push(i);
                near.push(Near {
                    t,
                    centre: d.centre[i],
                    amp: d.amp[i].abs(),
                });
            }
        }
        (idx, near)
    };
    let (li, ln) = near(prev, prev_first, true);
    let (ri, rn) = near(next, next_first, false);
    if ln.is_empty() || rn.is_empty() {
        return 0;
    }
    let (rl, rr) = checks::boundary_duplicates(&ln, &rn, boundary, geometry, nt0min);
    let mut removed = 0u64;
    for (d, idx, flags) in [(prev, li, rl), (next, ri, rr)] {
        let mut drop = vec![false; d.len()];
        for (k, &i) in idx.iter().enumerate() {
            drop[i] = flags[k];
        }
        removed += drop.iter().filter(|&&x| x).count() as u64;
        if drop.iter().any(|&x| x) {
            let pos = std::cell::Cell::new(0usize);
            d.retain(|_, _| {
                let k = pos.get();
                pos.set(k + 1);
                !drop[k]
            });
        }
    }
    removed
}

/// Sample type of the whitened recording written by [`write_whitened`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhitenedFormat {
    /// int16 holding 200 × the whitened value, truncated toward zero and saturated
    /// at ±32 767 (Kilosort4's `temp_wh.dat` convention).
    Int16x200,
    /// float32, the whitened values as they are.
    Float32,
}

/// What [`write_whitened`] wrote.
#[derive(Debug, Clone)]
pub struct PreprocessReport {
    /// Windows processed.
    pub n_windows: u64,
    /// Samples written per channel.
    pub n_samples: u64,
    /// Sites (channels) written per sample.
    pub n_sites: usize,
    /// Values that did not fit int16 and were saturated (int16 output only).
    pub saturated: u64,
    /// The whitening matrix, n_sites × n_sites.
    pub whitening: Array2<f32>,
    /// Wall time, seconds.
    pub wall: f64,
    /// Warnings of the run (input checks), in the order raised.
    pub warnings: Vec<String>,
}

/// Kilosort4's preprocessing over a whole recording, written out: the whitening
/// fit, then every window's own samples (channel means, median CAR, high-pass,
/// whitening) in order, sample-major (`n_samples × n_sites`, interleaved like the
/// input), to `out`, written under a temporary name and renamed when complete.
///
/// `checks` apply as in [`run_detection`]: a recording shorter than one batch is
/// one window of its own length, stuck stretches are masked
/// (`checks.mask_clipped`), data far from int16 scale are rescaled
/// (`checks.auto_scale`), and the layout warnings are logged and returned
/// ([`PreprocessReport::warnings`]). [`Checks::kilosort`] gives Kilosort4's output.
///
/// # Errors
/// As [`run_detection`] for the recording, probe and settings; when `out` cannot be written.
pub fn write_whitened(
    recording: Arc<dyn Recording>,
    probe: &Probe,
    settings: &PreprocessSettings,
    format: WhitenedFormat,
    out: &std::path::Path,
    checks: &Checks,
    progress: &mut dyn FnMut(Progress),
) -> Result<PreprocessReport> {
    use std::io::Write;
    let t_start = Instant::now();
    let mut settings = settings.clone();
    settings.fs = recording.fs();
    settings.validate()?;
    fit_batch_to_recording(recording.as_ref(), &mut settings);
    let mut warnings = Warnings::default();
    for w in &checks.warnings {
        warnings.push(w.clone());
    }
    layout_checks(recording.as_ref(), probe, &settings, checks, &mut warnings)?;
    let min_run = checks::stuck_min_run(settings.fs);
    let plan = plan_windows(recording.as_ref(), probe, settings.batch_size, settings.nt)?;
    let chan_map = probe.chan_map.clone();
    let n_sites = probe.n_sites();
    let tmp = out.with_extension("partial");
    let file =
        std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let nt = settings.nt;
    let mut saturated = 0u64;
    let mut written = 0u64;
    let mut bytes = Vec::new();
    let result: Result<Array2<f32>> = (|| {
        let fitted = fit(
            &recording,
            &plan,
            probe,
            &settings,
            checks,
            FitOptions::default(),
        )?;
        if let Some(m) = &fitted.scale_message {
            warnings.push(m.clone());
        }
        fitted
            .noisy_message
            .iter()
            .for_each(|m| warnings.push(m.clone()));
        if let Some(w) = fitted
            .health
            .warning("the windows of the whitening fit", checks.mask_clipped)
        {
            warnings.push(w);
        }
        let whiten_mat = fitted.whitening;
        let pre = Preprocessor::new(&settings, whiten_mat.clone())?;
        for (done, window) in
            WindowLoader::all(recording.clone(), plan, chan_map.clone())?.enumerate()
        {
            let mut win = window?;
            if checks.mask_clipped {
                let cols = checks::WindowColumns::of(&plan, win.index);
                checks::mask_stuck_runs(&mut win.data, cols.lo, cols.hi, cols.pad_repeats, min_run);
            }
            pre.apply(&mut win.data)?;
            let own = win.own_len as usize;
            bytes.clear();
            for t in nt..nt + own {
                for c in 0..n_sites {
                    let v = win.data[[c, t]];
                    match format {
                        WhitenedFormat::Float32 => bytes.extend_from_slice(&v.to_le_bytes()),
                        WhitenedFormat::Int16x200 => {
                            let s = (v * 200.0).trunc();
                            if s.abs() > i16::MAX as f32 {
                                saturated += 1;
                            }
                            let q = s.clamp(-(i16::MAX as f32), i16::MAX as f32) as i16;
                            bytes.extend_from_slice(&q.to_le_bytes());
                        }
                    }
                }
            }
            w.write_all(&bytes)
                .with_context(|| format!("cannot write {}", tmp.display()))?;
            written += own as u64;
            progress(Progress {
                windows_done: done as u64 + 1,
                windows_total: plan.n_windows,
                spikes: 0,
                seconds_done: written as f64 / settings.fs,
                elapsed: t_start.elapsed().as_secs_f64(),
            });
        }
        w.flush()
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        Ok(whiten_mat)
    })();
    let whiten_mat = match result {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    drop(w);
    std::fs::rename(&tmp, out)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()))?;
    if saturated > 0 {
        tracing::warn!(
            "{saturated} whitened values beyond ±163.8 did not fit int16 ×200 and were saturated; use --float32 to keep them"
        );
    }
    Ok(PreprocessReport {
        n_windows: plan.n_windows,
        n_samples: written,
        n_sites,
        saturated,
        whitening: whiten_mat,
        wall: t_start.elapsed().as_secs_f64(),
        warnings: warnings.0,
    })
}

/// Host memory a run holds at once, bytes: the windows in flight
/// ([`crate::stages::WINDOWS_IN_FLIGHT`]: one being read, one queued, one being
/// preprocessed and detected), one more window for scratch and the output
/// streams' buffers, the detector's per-centre buffers (As and its template
/// index), and per-thread filter-bank tiles. It does not depend on the
/// recording's length or spike count. (A GPU pass holds up to
/// [`crate::stages::windows_in_flight`]` = 6` int16 windows, and the device
/// whitening fit [`FIT_WINDOWS_IN_FLIGHT`]` = 5`: at most 3 f32 windows' bytes,
/// within this figure.)
pub fn memory_estimate(n_sites: usize, window_len: usize, n_centres: usize) -> u64 {
    let window = (n_sites * window_len * 4) as u64;
    let detector = (n_centres * window_len.next_multiple_of(crate::detect::cpu::TILE) * 5) as u64;
    let tiles = (rayon::current_num_threads() * n_sites * 7 * crate::detect::cpu::TILE * 4) as u64;
    (crate::stages::WINDOWS_IN_FLIGHT as u64 + 1) * window + detector + tiles
}

/// Checks that the probe reads only channels the recording has and plans its
/// windows (`batch_size` own samples, `nt` on each side).
///
/// # Errors
/// When a channel-map entry is past the recording's channels, or the recording
/// holds less than one window of at least `nt` samples.
fn plan_windows(
    rec: &dyn Recording,
    probe: &Probe,
    batch_size: usize,
    nt: usize,
) -> Result<WindowPlan> {
    let n_channels = rec.n_channels() as u64;
    if let Some((site, &c)) = probe
        .chan_map
        .iter()
        .enumerate()
        .find(|&(_, &c)| c >= n_channels)
    {
        bail!(
            "probe {}: site {site} reads channel {c}, but the recording has {n_channels} channels ({}); check the probe or --n-channels",
            probe.source.display(),
            rec.describe()
        );
    }
    let plan = WindowPlan::new(rec.n_samples(), batch_size as u64, nt as u64)?;
    if plan.n_windows == 0 {
        bail!(
            "not enough data: {} samples ({:.3} s) is less than one window's nt = {nt} samples ({})",
            rec.n_samples(),
            rec.n_samples() as f64 / rec.fs(),
            rec.describe()
        );
    }
    Ok(plan)
}

/// What [`fit`] found.
struct Fitted {
    /// W to apply to the (unscaled) data: `k·W(k²·C)`.
    whitening: Array2<f32>,
    /// The factor k (1 when the scale was fine or auto-scaling is off).
    scale_factor: f64,
    /// Why the data were rescaled.
    scale_message: Option<String>,
    /// Noisy channels found in the fit's covariance ([`checks::noisy_channels_warning`]).
    noisy_message: Option<String>,
    /// Channel check over the windows of the fit.
    health: ChannelHealth,
    /// Busy seconds of the fit's parts (`whitening_fit.<part>` in the timings).
    times: crate::preprocess::FitTimes,
}

/// Kilosort4's whitening fit over the planned windows of `rec` (raw windows read
/// with the probe's channel map; stuck stretches masked when
/// `checks.mask_clipped`), with the scale check: when the covariance says the
/// data are far from int16 scale ([`checks::scale_factor`]) and
/// `checks.auto_scale`, W is fitted to the data times k and multiplied by k,
/// which whitens exactly as scaling the input by k would.
fn fit(
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
    // ---- issue 10 (whitening fit speed): parts' busy seconds ----
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
            // issue 10 (reading thread): the checks in one pass over the rows.
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

/// Issue 10: with CUDA and device preprocessing, opens the run's page-locked
/// pool and allocates its window buffers on a thread of its own
/// ([`crate::detect::gpu::pinned::PinnedPool::open_reserving`]), as many as
/// the run holds at once: the larger of the pass's windows in flight
/// ([`crate::stages::windows_in_flight`] with a stager and
/// [`crate::stages::device_readers`]: 4 by default) and the device whitening
/// fit's ([`FIT_WINDOWS_IN_FLIGHT`]: 5); the warm-up's window is back in the pool
/// before the fit starts, and the fit's before the pass. Each holds one int16
/// window (`n_sites × Raw16::stride_for(window_len)` values: 46 MB for
/// 384 sites); `None` (nothing reserved: a buffer is made when first
/// needed, as before) on other back ends and for recordings that do not give
/// int16 values as they are (their windows are packed to other sizes).
///
/// Off unless `SPIKECUBE_PINNED_RESERVE=1` (eighth session: the driver
/// serialises the reservation against the device's opening; once the
/// reading thread got faster, making the buffers when first needed was
/// faster overall: medians of 4 in one call 1.96 s against 2.03 s, device
/// open 0.12 s against 0.19–0.27 s, whitening fit 0.22 s against 0.17 s).
#[cfg(feature = "cuda")]
fn reserve_pinned(
    chosen: &crate::backend::Chosen,
    device_preprocessing: bool,
    rec: &dyn Recording,
    plan: &WindowPlan,
    chan_map: &[u64],
) -> Option<crate::detect::gpu::pinned::ReservedPool> {
    if chosen.backend != "cuda"
        || !device_preprocessing
        || !crate::recording::gives_int16(rec, chan_map)
        || std::env::var("SPIKECUBE_PINNED_RESERVE").as_deref() != Ok("1")
    {
        return None;
    }
    let len = chan_map.len() * crate::recording::Raw16::stride_for(plan.window_len()) * 2;
    let n = crate::stages::windows_in_flight(true, crate::stages::device_readers())
        .max(FIT_WINDOWS_IN_FLIGHT);
    Some(crate::detect::gpu::pinned::PinnedPool::open_reserving(
        n, len,
    ))
}

/// Threads reading the device whitening fit's windows at once (issue 10;
/// [`fit_covariance_on_device`]) when the recording gives int16 values (one
/// otherwise).
pub const FIT_READERS: usize = 3;

/// Windows the device whitening fit holds at most (issue 10): one per reading
/// thread, one queued for the device, one on the device
/// ([`fit_covariance_on_device`]); with CUDA each is a page-locked buffer of
/// the run's pool.
pub const FIT_WINDOWS_IN_FLIGHT: usize = FIT_READERS + 2;

/// The whitening fit's covariance with the GPU doing the preprocessing and
/// the product (issue 10): every `nskip`-th window ([`crate::preprocess::covariance_windows`])
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
#[cfg(any(feature = "cuda", feature = "wgpu"))]
#[allow(clippy::too_many_arguments)]
fn fit_covariance_on_device(
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
    // Issue 10: the fit's windows are read on FIT_READERS threads at once
    // (`recording::read_in_order`), then checked, packed and queued for the
    // device in window order, one at a time, while the device works on an
    // earlier window: `health` sees the windows in the same order as a
    // single reading loop (its per-row hashes chain across windows), and the
    // device loop below adds the Gram matrices in window order (the same
    // covariance, bit for bit). At most FIT_WINDOWS_IN_FLIGHT windows exist
    // at once (a token per window, given back once the device is done with it).
    let (read_s, checks_s) = std::thread::scope(|scope| -> Result<(f64, f64)> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<crate::detect::gpu::RawWindow>>(1);
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
                        checks::check_window(&mut w, &cols, min_run, Some(&mut *health_r), mask);
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

/// The channel check of a run before it starts (BR-22): reads the windows the
/// whitening fit reads (every `nskip`-th window, as planned for `settings`'s
/// batch size) and returns what [`ChannelHealth`] finds there: all-zero,
/// constant and duplicated channels, stuck (clipped) stretches. `spikecube
/// probe REC` reports it; `detect` repeats it over the whole recording.
///
/// # Errors
/// As [`run_detection`] for the probe against the recording; when a read fails.
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
