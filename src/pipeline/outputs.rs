//! Stage 7, **outputs**: what the run did (settings as used, back end,
//! checks, drift, templates, warnings, timings) recorded into
//! `spikecube.json` and `params.py`, and the staged folder made final
//! ([`crate::output::OutputWriter::finish`]), with the device's teardown
//! beside the writing.

use anyhow::Result;

use super::detect_pass::PassDetections;
use super::device::BackEnd;
use super::drift_pass::DriftStep;
use super::fit::Fitted;
use super::job::{DetectJob, Report};
use super::open::OpenRun;
use crate::output::RunInfo;
use crate::stages::WindowPass;
use crate::timing::StageTimer;
use crate::universal::ChosenTemplates;

/// The stages' outputs the final stage records.
pub(crate) struct Results {
    /// Stage 3.
    pub fitted: Fitted,
    /// Stage 4's templates.
    pub templates: ChosenTemplates,
    /// Stage 5.
    pub drift: DriftStep,
    /// Stage 6.
    pub found: PassDetections,
}

/// Records the run into the staged folder's `spikecube.json` and makes the
/// folder final; `timer`'s seconds become `timings_s`, with `total`.
///
/// # Errors
/// When the folder cannot be written or renamed into place.
pub(crate) fn write_outputs(
    job: DetectJob,
    mut run: OpenRun,
    mut back_end: BackEnd,
    pass: Box<dyn WindowPass>,
    results: Results,
    mut timer: StageTimer,
) -> Result<Report> {
    let Results {
        fitted,
        templates,
        mut drift,
        found,
    } = results;
    // The templates the detection pass used: learned again from the
    // drift-corrected windows when the drift stage did so.
    let (templates, first_pass_templates) = match drift.relearned.take() {
        Some(second) => (second, Some(templates)),
        None => (templates, None),
    };
    let checks = &job.checks;
    // Stuck samples are counted as masked only when they were (the channel
    // findings name them either way).
    let clipped = if checks.mask_clipped {
        found.health.stuck_samples()
    } else {
        0
    };
    if let Some(w) = found
        .health
        .warning("the whole recording", checks.mask_clipped)
    {
        run.warnings.push(w);
    }
    let rec = &job.recording;
    let (plan, geometry) = (&run.plan, &run.geometry);
    let mut info = job.run_info;
    info.fs = rec.fs();
    info.n_samples = rec.n_samples();
    info.whitening = fitted.whitening;
    info.settings = serde_json::json!({
        "detection": job.detection,
        "preprocessing": job.preprocess,
        "n_windows": plan.n_windows,
        "n_centres": geometry.n_centres(),
        "nearest_chans_used": geometry.n_chans(),
        "dmin_used": geometry.dmin,
        "detections_dropped_in_padding": found.dropped,
        "templates": templates.description,
        "preprocessing_on": pass.preprocess_on(),
        "device_highpass": pass.device_highpass(),
        "upload_bytes_per_window": pass.bytes_uploaded() / pass.windows_uploaded().max(1),
        "checks": {
            "auto_scale": checks.auto_scale,
            "scale_factor_applied": fitted.scale_factor,
            "mask_clipped": checks.mask_clipped,
            "clipped_samples_masked": clipped,
            "remove_boundary_duplicates": checks.remove_boundary_duplicates,
            "boundary_duplicates_removed": found.duplicates,
            "channel_findings": found.health.findings(),
            "transients": transients_record(&found, checks, rec.fs()),
        },
    });
    info.warnings = run.warnings.0.clone();
    record_versions(&mut info, &back_end);
    back_end.record(&mut timer);
    drift.run.record(&mut info, run.writer.n_spikes());
    drift.run.record_timings(&mut timer);
    if let Some(first) = &first_pass_templates {
        info.settings["drift"]["templates_first_pass"] = first.description.clone();
        info.settings["drift"]["templates_second_pass"] = templates.description.clone();
    }
    let started = timer.started();
    info.timings.extend(timer.finish("total"));
    let summary = back_end.finish(pass, job.last_device_use, || run.writer.finish(&info))?;
    Ok(Report {
        summary,
        n_windows: plan.n_windows,
        // `--drift-only`: the first pass covered the recording.
        seconds: if drift.run.windows_to_detect() == 0 {
            plan.n_used as f64 / rec.fs()
        } else {
            found.seconds_done
        },
        wall: started.elapsed().as_secs_f64(),
        n_centres: geometry.n_centres(),
        dropped_in_padding: found.dropped,
        boundary_duplicates_removed: found.duplicates,
        clipped_samples_masked: clipped,
        scale_factor: fitted.scale_factor,
        warnings: run.warnings.0,
    })
}

/// The versions of `spikecube.json`: spikecube's, the Kilosort4 it follows,
/// and the back end, its device and why it was chosen.
fn record_versions(info: &mut RunInfo, back_end: &BackEnd) {
    let chosen = &back_end.chosen;
    let v = &mut info.versions;
    v.insert("spikecube".into(), env!("CARGO_PKG_VERSION").into());
    v.insert("kilosort_reference".into(), "4.1.7".into());
    v.insert("backend".into(), chosen.backend.clone());
    v.insert("device".into(), chosen.device.clone());
    v.insert("backend_reason".into(), chosen.reason.clone());
}

/// Times of transients recorded in `spikecube.json` at most.
const TRANSIENT_TIMES_KEPT: usize = 1000;

/// `spikecube.json`'s `checks.transients`: the transients common to most
/// channels (count, the first [`TRANSIENT_TIMES_KEPT`] start times in
/// seconds) and what was blanked (given events, the window, whether around
/// transients).
fn transients_record(
    found: &PassDetections,
    checks: &super::job::Checks,
    fs: f64,
) -> serde_json::Value {
    let times: Vec<f64> = found
        .transient_seconds(fs)
        .into_iter()
        .take(TRANSIENT_TIMES_KEPT)
        .collect();
    let blanking = checks.blanking.as_ref().map(|b| {
        serde_json::json!({
            "events_given": b.events.len(),
            "samples_before": b.before,
            "samples_after": b.after,
            "ms_before": b.before as f64 * 1e3 / fs,
            "ms_after": b.after as f64 * 1e3 / fs,
            "around_transients": b.transients,
        })
    });
    serde_json::json!({
        "count": found.transients.len(),
        "times_s": times,
        "blanking": blanking,
    })
}
