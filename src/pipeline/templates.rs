//! Stage 4, **universal templates**: wTEMP and wPCA learned from every 25th
//! window preprocessed exactly as detection sees it (Kilosort4's default),
//! built-in, or read from a file ([`crate::universal`]); the detector takes
//! them and `templates.npz` goes into the staged folder.

use anyhow::{Context, Result};
use ndarray::Array2;

use super::device::Device;
use super::job::DetectJob;
use super::open::OpenRun;
use crate::checks;
use crate::preprocess::Preprocessor;
use crate::recording::{WindowPlan, read_window};
use crate::universal::ChosenTemplates;

/// Chooses the run's templates (learning them from windows preprocessed by
/// `pre`), hands them to the detector and writes them into the staged folder.
///
/// # Errors
/// A failed read or preprocessing (naming the window), a failed learning
/// step, a detector that cannot be rebuilt, a file that cannot be written.
pub(crate) fn choose_templates(
    job: &DetectJob,
    run: &mut OpenRun,
    pre: &Preprocessor,
    device: &mut Device,
) -> Result<ChosenTemplates> {
    let plan = run.plan;
    let chosen = crate::universal::choose(
        &job.templates,
        plan.n_windows,
        job.detection.nt,
        job.detection.nt0min(),
        |i| {
            let mut w = read_masked(job, &plan, i)?;
            pre.apply_at(&mut w, window_first_sample(job, &plan, i))
                .with_context(|| format!("preprocessing window {i} for learning templates"))?;
            Ok(w)
        },
    )?;
    if let Some(w) = &chosen.warning {
        run.warnings.push(w.clone());
    }
    device.use_templates(&chosen.templates, &run.geometry, job)?;
    crate::universal::write_outputs(run.writer.partial_path(), &chosen)?;
    Ok(chosen)
}

/// Window `i` of `plan` as read, stuck stretches masked when the run masks
/// them (the learning steps' windows, before and after drift correction).
///
/// # Errors
/// A failed read.
pub(crate) fn read_masked(job: &DetectJob, plan: &WindowPlan, i: u64) -> Result<Array2<f32>> {
    let rec = job.recording.as_ref();
    let mut w = Array2::zeros((job.probe.n_sites(), plan.window_len()));
    read_window(rec, plan, i, &job.probe.chan_map, &mut w)?;
    if job.checks.mask_clipped {
        let cols = checks::WindowColumns::of(plan, i);
        let min_run = checks::stuck_min_run(rec.fs());
        checks::mask_stuck_runs(&mut w, cols.lo, cols.hi, cols.pad_repeats, min_run);
    }
    Ok(w)
}

/// Absolute sample of column 0 of window `i` (as [`crate::recording::Window::first_sample`]).
pub(crate) fn window_first_sample(job: &DetectJob, plan: &WindowPlan, i: u64) -> i64 {
    (job.recording.first_sample() + plan.window_start(i)) as i64 - plan.nt as i64
}
