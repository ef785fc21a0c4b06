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
use crate::detect::learn::ClipCut;
use crate::preprocess::Preprocessor;
use crate::recording::{WindowPlan, read_window};
use crate::timing::StageTimer;
use crate::universal::{ChosenTemplates, TemplateSource};

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
    let (nt, nt0min) = (job.detection.nt, job.detection.nt0min());
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    let on_device = device.for_learning(pre)?;
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    let on_device: Option<std::convert::Infallible> = None;
    let learned_on = if on_device.is_some() {
        "device"
    } else {
        "host"
    };
    let mut chosen = match on_device {
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        Some((detector, packer)) => {
            let p = packer.clone();
            let mut raw16: Option<crate::stages::Raw16Alloc> = Some(Box::new(move |n| {
                Box::new(p.raw16_buffer(n)) as Box<dyn crate::recording::Raw16Buffer>
            }));
            let yc = &job.probe.yc;
            let chosen = choose_on_device(job, &plan, &mut raw16, &mut |w, cut| {
                let raw = packer.raw_window(w);
                detector
                    .learning_clips(raw, yc, cut)?
                    .context("the detector is not on a device")
            });
            detector.end_whitened();
            chosen?
        }
        #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
        Some(never) => match never {},
        None => crate::universal::choose(&job.templates, plan.n_windows, nt, nt0min, |i| {
            let mut w = read_masked(job, &plan, i)?;
            pre.apply_at(&mut w, window_first_sample(job, &plan, i))
                .with_context(|| format!("preprocessing window {i} for learning templates"))?;
            Ok(w)
        })?,
    };
    mark_learned_on(&mut chosen, &job.templates, learned_on);
    if let Some(w) = &chosen.warning {
        run.warnings.push(w.clone());
    }
    device.use_templates(&chosen.templates, &run.geometry, job)?;
    crate::universal::write_outputs(run.writer.partial_path(), &chosen)?;
    Ok(chosen)
}

/// Notes where a learning's windows were preprocessed (`"preprocessed_on"`
/// in the `"templates"` record: `device` or `host`); nothing for templates
/// built in or from a file.
pub(crate) fn mark_learned_on(chosen: &mut ChosenTemplates, source: &TemplateSource, on: &str) {
    if matches!(source, TemplateSource::Learned(_)) {
        chosen.description["preprocessed_on"] = on.into();
    }
}

/// Records a learning's parts under `stage.windows`, `stage.wpca` and
/// `stage.wtemp` (nothing for templates not learned).
pub(crate) fn record_seconds(timer: &mut StageTimer, stage: &str, chosen: &ChosenTemplates) {
    if chosen.seconds[0] > 0.0 {
        for (part, s) in ["windows", "wpca", "wtemp"].iter().zip(chosen.seconds) {
            timer.add(format!("{stage}.{part}"), s);
        }
    }
}

/// Threads reading a learning's windows ahead of the device
/// ([`choose_on_device`]), as the whitening fit reads its windows
/// ([`super::FIT_READERS`]).
const LEARN_READERS: usize = super::FIT_READERS;

/// The run's templates as [`crate::universal::choose`] chooses them, a
/// learning's windows preprocessed on a device one at a time on this thread:
/// each read as the passes read it (int16 values into `raw16`'s storage when
/// the recording gives them, else f32; stuck stretches masked when the run
/// masks them) on [`LEARN_READERS`] threads ahead of the device, then
/// handed to `whiten` in window order with the learning's clip settings
/// ([`ClipCut`]): it returns the clips of the window whitened on the device. At most `LEARN_READERS + 2` windows
/// are read and not yet whitened. A window after one that fails is not
/// handed on.
///
/// # Errors
/// The first window's error (read or device), or the learning's.
pub(crate) fn choose_on_device(
    job: &DetectJob,
    plan: &WindowPlan,
    raw16: &mut Option<crate::stages::Raw16Alloc>,
    whiten: &mut dyn FnMut(&mut crate::recording::Window, &ClipCut) -> Result<Array2<f32>>,
) -> Result<ChosenTemplates> {
    let (nt, nt0min) = (job.detection.nt, job.detection.nt0min());
    let rec = job.recording.as_ref();
    let min_run = checks::stuck_min_run(rec.fs());
    // Every reading thread takes storage from the one allocator.
    let shared = std::sync::Arc::new(std::sync::Mutex::new(raw16.take()));
    let readers = if crate::recording::gives_int16(rec, &job.probe.chan_map) {
        LEARN_READERS
    } else {
        1
    };
    crate::universal::choose_with(&job.templates, nt0min, |s| {
        let cut = ClipCut {
            th_single_ch: s.th_single_ch,
            nt,
            nt0min,
        };
        crate::detect::learn::learn_from_clips(plan.n_windows, nt, nt0min, s, |js| {
            let read_one = |alloc: &mut Option<crate::stages::Raw16Alloc>, i: u64| {
                let mut data = Array2::zeros((0, 0));
                let r16 =
                    crate::stages::read_any(rec, plan, i, &job.probe.chan_map, &mut data, alloc)?;
                let mut w = crate::recording::Window::of(rec.first_sample(), plan, i, data, r16);
                if job.checks.mask_clipped {
                    let cols = checks::WindowColumns::of(plan, i);
                    checks::mask_stuck_window(&mut w, &cols, min_run);
                }
                Ok(w)
            };
            let mut out = Vec::with_capacity(js.len());
            std::thread::scope(|scope| {
                let (tx, rx) = std::sync::mpsc::sync_channel::<Result<crate::recording::Window>>(1);
                let (token_tx, token_rx) = crossbeam_channel::bounded::<()>(readers + 2);
                for _ in 0..readers + 2 {
                    let _ = token_tx.send(());
                }
                let states: Vec<Option<crate::stages::Raw16Alloc>> = (0..readers)
                    .map(|_| {
                        let shared = shared.clone();
                        let has = shared.lock().map(|a| a.is_some()).unwrap_or(false);
                        has.then(|| {
                            Box::new(move |n: usize| {
                                let mut a = shared.lock().unwrap_or_else(|e| e.into_inner());
                                (a.as_mut().expect("an allocator"))(n)
                            }) as crate::stages::Raw16Alloc
                        })
                    })
                    .collect();
                let read_one = &read_one;
                let reader = scope.spawn(move || {
                    crate::recording::read_in_order(
                        "spikecube-learn-read",
                        js.len() as u64,
                        states,
                        |_| token_rx.recv().ok(),
                        |alloc, k, ()| read_one(alloc, js[k as usize]),
                        |_, res: Result<crate::recording::Window>| {
                            let failed = res.is_err();
                            tx.send(res).is_ok() && !failed
                        },
                    )
                });
                for &i in js {
                    let Ok(res) = rx.recv() else { break };
                    let res = res
                        .and_then(|mut w| whiten(&mut w, &cut))
                        .with_context(|| format!("window {i} for learning templates"));
                    let failed = res.is_err();
                    out.push(res);
                    // The window's storage is back: the next may be read.
                    let _ = token_tx.send(());
                    if failed {
                        break;
                    }
                }
                drop(rx);
                drop(token_tx);
                match reader.join() {
                    Ok(Ok(_)) => {}
                    // A thread that could not start: the windows it did not
                    // read are missing, which the learning reports.
                    Ok(Err(e)) => tracing::warn!("a learning's reading thread did not start: {e}"),
                    Err(p) => std::panic::resume_unwind(p),
                }
            });
            out
        })
    })
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
