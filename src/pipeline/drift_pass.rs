//! Stage 5, **drift**: Kilosort4's `datashift` — a first detection pass with
//! the run's whitening, the drift estimate, `drift.npy`, `drift_blocks.npy`
//! and `drift.png` in the staged folder, and the correction the detection
//! pass applies ([`crate::drift`]). When the run learns its templates,
//! Kilosort4 learns them again from the drift-corrected windows for the
//! second pass (drift-spec.md §8); those are the output's.

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};

use super::job::{DetectJob, Progress};
use super::open::OpenRun;
use super::templates::{choose_on_device, read_masked, window_first_sample};
use crate::checks::PassChecks;
use crate::drift::{DriftRun, FirstPass};
use crate::preprocess::Preprocessor;
use crate::stages::WindowPass;
use crate::timing::StageTimer;
use crate::universal::{ChosenTemplates, TemplateSource};

/// What the drift stage leaves for the detection pass and the outputs.
pub(crate) struct DriftStep {
    /// The estimate and the correction (none when `nblocks = 0` or the
    /// estimate was turned off); shared with the window pass.
    pub run: Arc<DriftRun>,
    /// The templates learned again from the drift-corrected windows, which
    /// the detection pass uses (and the output records) in place of stage
    /// 4's; `None` when the run did not learn them again.
    pub relearned: Option<ChosenTemplates>,
    /// The detection pass's input checks of every window, found by the
    /// first pass (which read the same raw windows) when the detection pass
    /// starts from windows kept high-passed and so does not read them again.
    pub checks: Option<PassChecks>,
}

/// Runs the drift step: the first pass through `pass` (with `--drift-only`
/// its spikes stream into the staged folder as the output), the estimate and
/// its files; then, when the detection pass corrects drift and the templates
/// are learned, the templates learned again from the corrected windows
/// (`templates_second_pass` in the timings), handed to `pass` and kept in
/// [`DriftStep::relearned`]. `first_fell_back`: the run's first templates
/// are the built-in ones because too few peaks were found to learn them.
///
/// # Errors
/// As [`crate::drift::prepare`]; a failed read or learning step.
pub(crate) fn drift_step(
    job: &DetectJob,
    run: &mut OpenRun,
    pre: &Preprocessor,
    pass: &mut dyn WindowPass,
    timer: &mut StageTimer,
    progress: &mut dyn FnMut(Progress),
    first_fell_back: bool,
) -> Result<DriftStep> {
    // When the detection pass keeps its windows for the sort and will pass
    // over the same raw windows again, the first pass keeps them high-passed
    // (where the pass preprocesses: the GPU) so that the second pass whitens
    // them again with the drift-corrected matrices instead of reading,
    // sending and filtering the raw windows; the first pass then runs the
    // detection pass's input checks on them too.
    let keeps_filtered = match &job.keep_windows {
        Some(keep) if job.drift.nblocks > 0 && !job.drift.drift_only => {
            pass.keep_filtered(keep.budget)
        }
        _ => false,
    };
    for w in pass.take_warnings() {
        run.warnings.push(w);
    }
    let checks = keeps_filtered.then(|| Mutex::new(PassChecks::new(&job.probe.chan_map)));
    // The first pass's windows reported as they finish, as the detection
    // pass's are (`first_pass` set).
    let progress = std::cell::RefCell::new(progress);
    let (done, seconds_done, t_first) = (
        std::cell::Cell::new(0u64),
        std::cell::Cell::new(0.0f64),
        std::time::Instant::now(),
    );
    let fs = job.recording.fs();
    let n_windows = run.plan.n_windows;
    let on_window = |w: &crate::stages::WindowInfo| {
        done.set(done.get() + 1);
        seconds_done.set(seconds_done.get() + w.own_len as f64 / fs);
        (progress.borrow_mut())(Progress {
            windows_done: done.get(),
            windows_total: n_windows,
            spikes: 0,
            seconds_done: seconds_done.get(),
            elapsed: t_first.elapsed().as_secs_f64(),
            first_pass: true,
        });
    };
    let fp = FirstPass {
        recording: &job.recording,
        plan: &run.plan,
        probe: &job.probe,
        pre,
        nt: job.detection.nt as u64,
        mask_clipped: job.checks.mask_clipped,
        checks: checks.as_ref(),
        on_window: Some(&on_window),
    };
    let staged = run.writer.partial_path().to_path_buf();
    let mut found = Vec::new();
    let writer = &mut run.writer;
    let drift = crate::drift::prepare(
        &fp,
        &job.drift,
        f64::from(job.detection.th_universal),
        pass,
        &staged,
        &mut |d, first| writer.append(d, first),
        &mut |w| found.push(w),
    )?;
    found.into_iter().for_each(|w| run.warnings.push(w));
    let drift = Arc::new(drift);
    let mut relearned = None;
    if drift.correction.is_some()
        && drift.windows_to_detect() > 0
        && matches!(job.templates, TemplateSource::Learned(_))
    {
        let second = timer.time("templates_second_pass", |_| {
            relearn(job, run, pre, &drift, pass, first_fell_back)
        })?;
        super::templates::record_seconds(timer, "templates_second_pass", &second);
        relearned = Some(second);
    }
    Ok(DriftStep {
        run: drift,
        relearned,
        checks: checks.map(|c| c.into_inner().unwrap_or_else(|e| e.into_inner())),
    })
}

/// The templates learned again from the drift-corrected windows, handed to
/// `pass` and written into the staged folder. `first_fell_back`: the first
/// learning fell back to the built-in templates (and warned why), so a second
/// fallback is said in short.
fn relearn(
    job: &DetectJob,
    run: &mut OpenRun,
    pre: &Preprocessor,
    drift: &DriftRun,
    pass: &mut dyn WindowPass,
    first_fell_back: bool,
) -> Result<ChosenTemplates> {
    let plan = run.plan;
    let (nt, nt0min) = (job.detection.nt, job.detection.nt0min());
    let on = pass.preprocess_on();
    let mut second = if on == "device" {
        // The windows preprocessed on the pass's device, as the pass will
        // preprocess them (one at a time on this thread).
        let mut raw16 = pass.raw16_buffers();
        let chosen = choose_on_device(job, &plan, &mut raw16, &mut |w, cut| {
            pass.learning_window(w, Some(drift), cut)
                .context("the pass does not preprocess on a device")?
        });
        pass.end_learning();
        chosen?
    } else {
        crate::universal::choose(&job.templates, plan.n_windows, nt, nt0min, |i| {
            let mut w = read_masked(job, &plan, i)?;
            let blank = pre.blank_ranges(&w, window_first_sample(job, &plan, i));
            drift.preprocess(pre, i, &mut w).with_context(|| {
                format!("preprocessing window {i} (drift-corrected) for learning templates")
            })?;
            crate::preprocess::zero_columns(&mut w, &blank);
            Ok(w)
        })?
    };
    second.description["windows"] = "drift-corrected (second pass)".into();
    super::templates::mark_learned_on(&mut second, &job.templates, on);
    if let Some(w) = &second.warning {
        let w = if first_fell_back && second.description["source"] == "builtin" {
            // The first pass's warning already says what was counted and why.
            format!(
                "again too few isolated peaks to learn templates ({} of the {} needed): the built-in universal templates again",
                second.description["n_clips"], second.description["min_clips"]
            )
        } else {
            w.clone()
        };
        run.warnings
            .push(format!("second pass (drift-corrected): {w}"));
    }
    pass.set_templates(&second.templates)?;
    crate::universal::write_outputs(run.writer.partial_path(), &second)?;
    Ok(second)
}
