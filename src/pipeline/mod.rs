//! The main job: a recording to spikes on disk (Kilosort4's `run_kilosort` up
//! to and including the detection pass after drift correction), as a chain
//! of stages, each in its own module with typed inputs and outputs:
//!
//! ```text
//!  DetectJob
//!     │
//!  1. open ........ OpenRun        recording, probe and settings checked, windows
//!     │                            planned, geometry built, output folder staged
//!  2. device ...... Device         back end chosen (auto: CPU fallback), detector
//!     │                            built, a preprocessing GPU warmed up
//!  3. fit ......... Fitted         whitening matrix (on the device or the host),
//!     │                            scale check, channel check of the fit's windows
//!  4. templates ... ChosenTemplates wTEMP/wPCA learned, built-in or from a file
//!     │     └─ Device::into_pass ─▶ Box<dyn WindowPass> (host or device preprocessing)
//!  5. drift ....... DriftStep      first pass, estimate, drift files, correction,
//!     │                            templates learned again from corrected windows
//!     │                            (and the input checks, when the GPU holds the
//!     │                            windows high-passed for the next pass)
//!  6. detect pass . PassDetections spikes streamed into the staged folder; drops,
//!     │                            boundary duplicates, channel check (or the
//!     │                            first pass's, the held windows not read again)
//!     │  ◀── the sort stages plug in here (below)
//!  7. outputs ..... Report         spikecube.json, params.py, folder made final
//! ```
//!
//! [`run_detection`] chains them and reads top-down. One [`StageTimer`]
//! times every stage by the name it has in `spikecube.json`'s `timings_s`;
//! stages that measure their own parts hand them to it. What depends on the
//! back end (the CUDA page-locked pool, the `auto` fallback, the warm-up,
//! preprocessing on the device) stays behind [`device::Device`] and the
//! [`crate::stages::WindowPass`] it makes.
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
//!
//! # Where the sort stages plug in
//!
//! Kilosort4's sort (first clustering, template post-processing, learned
//! template matching, final clustering, merges and the Phy files) goes after
//! stage 6 and before stage 7, one module per stage under `src/sort/`, each
//! a function with the same shape as the stages here:
//!
//! ```text
//! fn stage(job: &DetectJob, run: &mut OpenRun, input: &Previous, timer: &mut StageTimer) -> Result<Next>
//! ```
//!
//! called in the chain as `timer.time("<key>", |t| stage(…, t))?`, its
//! output a type of its own that the next stage takes and [`Results`](outputs::Results)
//! carries to the outputs. Where a stage's output lives follows its size:
//!
//! * bounded by the probe and the templates (templates, cluster centroids,
//!   per-cluster statistics, merge decisions): in memory, in the output type;
//! * growing with the recording (per-spike labels, amplitudes, PC features):
//!   streamed into the staged folder (`run.writer.partial_path()`) as `.npy`
//!   files ([`crate::output::npy_stream`]) while the stage runs, and the
//!   output type holds their paths and counts. The next stage memory-maps
//!   them (as the detection pass's spikes are read back).
//!
//! The staged folder is made final only by stage 7, so a failed sort stage
//! leaves nothing at the output path, and every stage's files appear together.

mod detect_pass;
mod device;
mod drift_pass;
mod fit;
mod fit_device;
mod job;
mod open;
mod outputs;
mod templates;
mod whitened;

use anyhow::Result;

pub use fit::{WhiteningFit, channel_check, fit_whitening_for, fit_whitening_with};
pub use fit_device::{FIT_READERS, FIT_WINDOWS_IN_FLIGHT};
pub use job::{Checks, DetectJob, Progress, Report};
pub use open::{InputRequest, check_job, memory_estimate, open_for_detection};
pub use whitened::{PreprocessReport, WhitenedFormat, write_whitened};

use crate::preprocess::Preprocessor;
use crate::timing::StageTimer;

/// Runs the whole job — open, device, whitening fit, universal templates,
/// drift, detection pass, outputs — and writes the output folder atomically.
///
/// `progress` is called after each window of the first pass (the drift
/// estimate's, [`Progress::first_pass`]) and of the detection pass.
///
/// # Errors
/// When the probe does not fit the recording (a channel-map entry past the file's
/// channels), the settings are invalid, the recording holds less than one window
/// of at least `nt` samples, a read fails, or the output cannot be written. On
/// error nothing is left at `job.out` (a previous result there is kept).
pub fn run_detection(mut job: DetectJob, progress: &mut dyn FnMut(Progress)) -> Result<Report> {
    let mut timer = StageTimer::start();
    let mut run = open::open_run(&mut job)?;
    let mut device = device::Device::open(&job, &run, &mut timer)?;
    let fitted = timer.time("whitening_fit", |t| {
        fit::fit_run(&job, &mut run, &mut device, t)
    })?;
    let pre = Preprocessor::new(&job.preprocess, fitted.whitening.clone())?
        .with_blanking(job.checks.blanking.clone());
    let templates = timer.time("templates", |_| {
        templates::choose_templates(&job, &mut run, &pre, &mut device)
    })?;
    templates::record_seconds(&mut timer, "templates", &templates);
    let (mut pass, back_end) = device.into_pass(&pre, &job)?;
    // Whether the first learning fell back to the built-in templates.
    let fell_back = templates.description.get("fallback_from_learned").is_some();
    let mut drift = drift_pass::drift_step(
        &job,
        &mut run,
        &pre,
        pass.as_mut(),
        &mut timer,
        progress,
        fell_back,
    )?;
    let zeroed_before = pre.artifact_windows();
    let early = drift.checks.take();
    let found = detect_pass::detect_pass(
        &job,
        &mut run,
        pass.as_mut(),
        &drift,
        early,
        &mut timer,
        progress,
    )?;
    pass_warnings(
        &job,
        &mut run,
        &drift,
        &found,
        pre.artifact_windows() - zeroed_before,
    );
    let results = outputs::Results {
        fitted,
        templates,
        drift,
        found,
    };
    outputs::write_outputs(job, run, back_end, pass, results, timer)
}

/// Warnings about the detection pass's outcome: windows zeroed whole by
/// `--artifact-threshold`, transients common to most channels (stimulus
/// artifacts), and no spike at all in a recording of some length.
fn pass_warnings(
    job: &DetectJob,
    run: &mut open::OpenRun,
    drift: &drift_pass::DriftStep,
    found: &detect_pass::PassDetections,
    zeroed: u64,
) {
    let fs = job.recording.fs();
    let (thr, bs) = (job.preprocess.artifact_threshold, job.preprocess.batch_size);
    if let Some(w) =
        crate::checks::artifact_windows_warning(thr, zeroed, run.plan.n_windows, bs, fs)
    {
        run.warnings.push(w);
    }
    if let Some(w) = crate::checks::transients::transients_warning(
        &found.transient_seconds(fs),
        job.probe.n_sites(),
        job.checks.blanking.as_ref().is_some_and(|b| b.transients),
    ) {
        run.warnings.push(w);
    }
    if drift.run.windows_to_detect() > 0
        && let Some(w) = crate::checks::zero_spikes_warning(
            run.writer.n_spikes(),
            job.recording.n_samples() as f64 / fs,
        )
    {
        run.warnings.push(w);
    }
}
