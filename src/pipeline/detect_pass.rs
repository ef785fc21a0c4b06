//! Stage 6, **detection pass**: every window read and checked, preprocessed
//! (drift-corrected when the drift stage says so) and detected by the window
//! pass, the three overlapping on their own threads
//! ([`crate::stages::run_windows_prechecked`]). Detections are kept in the
//! window's own samples only, duplicates of one event across a window
//! boundary are removed, and the rest streams into the staged folder in
//! window order.

use std::time::Instant;

use anyhow::Result;

use super::drift_pass::DriftStep;
use super::job::{DetectJob, Progress};
use super::open::OpenRun;
use crate::checks::{self, ChannelHealth, Near, PassChecks, WindowCheck, WindowFound};
use crate::detect::Geometry;
use crate::detect::cpu::Detections;
use crate::output::OutputWriter;
use crate::stages::{StagesReport, WindowInfo, WindowPass};
use crate::timing::StageTimer;

/// What the detection pass found besides the spikes in the staged folder.
pub(crate) struct PassDetections {
    /// Detections dropped in the last window's padding, past the recording's end.
    pub dropped: u64,
    /// Duplicates of one event across a window boundary that were removed.
    pub duplicates: u64,
    /// Recording seconds processed.
    pub seconds_done: f64,
    /// The channel check over every window of the pass.
    pub health: ChannelHealth,
    /// Transients common to most channels ([`checks::transients`]): the
    /// absolute sample of each one's start, in order.
    pub transients: Vec<i64>,
}

impl PassDetections {
    /// [`PassDetections::transients`] in seconds (absolute, the file's clock).
    pub fn transient_seconds(&self, fs: f64) -> Vec<f64> {
        self.transients.iter().map(|&t| t as f64 / fs).collect()
    }
}

/// Runs the detection pass over every window (none with `--drift-only`,
/// whose first pass was the output), streaming detections into
/// `run.writer`; the per-window stages' busy seconds, their wall time and
/// overlap, and the device's per-window medians go into `timer`. `early`:
/// the input checks of every window, found by the drift step's first pass
/// on the same raw windows; then the windows are only masked as read, and
/// those the pass holds already ([`WindowPass::windows_held`]) are not read.
///
/// # Errors
/// The first failed read, check, pass or write.
pub(crate) fn detect_pass(
    job: &DetectJob,
    run: &mut OpenRun,
    pass: &mut dyn WindowPass,
    drift: &DriftStep,
    early: Option<PassChecks>,
    timer: &mut StageTimer,
    progress: &mut dyn FnMut(Progress),
) -> Result<PassDetections> {
    let plan = run.plan;
    let fs = job.recording.fs();
    let mut out = Emitter {
        writer: &mut run.writer,
        geometry: &run.geometry,
        nt: job.detection.nt as u64,
        nt0min: job.detection.nt0min(),
        remove_duplicates: job.checks.remove_boundary_duplicates,
        pending: None,
        spikes: 0,
        dropped: 0,
        duplicates: 0,
    };
    let t_detect = Instant::now();
    let mut seconds_done = 0f64;
    let mut windows_done = 0u64;
    pass.set_drift(Some(drift.run.clone()))?;
    if let Some(keep) = &job.keep_windows {
        pass.keep_windows(keep.budget);
    }
    for w in pass.take_warnings() {
        // The first pass may have said the same of its own keeping.
        if !run.warnings.0.contains(&w) {
            run.warnings.push(w);
        }
    }
    let check = WindowCheck::new(plan, fs, job.checks.mask_clipped);
    // Checks the first pass found for every window are used as they are.
    let early = early.filter(|c| c.windows() == plan.n_windows);
    let checked_below = if early.is_some() { plan.n_windows } else { 0 };
    let mut checks = PassChecks::new(&job.probe.chan_map);
    let checks_ref = &mut checks;
    // The checks' work on the reading threads; only adding each window's
    // channel facts to the run's is in window order.
    let full = early.is_none();
    let prepare = move |w: &mut crate::recording::Window| -> Result<Option<WindowFound>> {
        Ok(check.run_or_mask(w, full))
    };
    let merge = move |_: &mut crate::recording::Window, found: Option<WindowFound>| -> Result<()> {
        if let Some(f) = found {
            checks_ref.merge(f);
        }
        Ok(())
    };
    // `--drift-only`: the first pass's spikes are the output; no second pass.
    let stages = if drift.run.windows_to_detect() == 0 {
        StagesReport::default()
    } else {
        crate::stages::run_windows_prechecked(
            job.recording.clone(),
            plan,
            &job.probe.chan_map,
            &prepare,
            merge,
            checked_below,
            pass,
            |w: WindowInfo, det: Detections| -> Result<()> {
                out.window(w, det)?;
                seconds_done += w.own_len as f64 / fs;
                windows_done += 1;
                progress(Progress {
                    windows_done,
                    windows_total: plan.n_windows,
                    spikes: out.spikes_so_far(),
                    seconds_done,
                    elapsed: t_detect.elapsed().as_secs_f64(),
                    first_pass: false,
                });
                Ok(())
            },
        )?
    };
    let checks = early.unwrap_or(checks);
    out.flush()?;
    if let Some(keep) = &job.keep_windows {
        let kept = pass.take_kept();
        *keep.slot.lock().unwrap_or_else(|e| e.into_inner()) = kept;
    }
    record_stages(&stages, pass, timer);
    Ok(PassDetections {
        dropped: out.dropped,
        duplicates: out.duplicates,
        seconds_done,
        health: checks.health,
        transients: checks.transients,
    })
}

/// The per-window stages' busy seconds, their wall time and overlap, and the
/// device's per-window step medians (`device_window_median_<step>`, over
/// `device_windows_timed` sampled windows).
fn record_stages(stages: &StagesReport, pass: &dyn WindowPass, timer: &mut StageTimer) {
    for (k, v) in &stages.times.0 {
        timer.add(k.clone(), *v);
    }
    for (k, v) in pass.step_medians() {
        let key = match k.as_str() {
            "windows_timed" => "device_windows_timed".to_string(),
            _ => format!("device_window_median_{k}"),
        };
        timer.add(key, v);
    }
    timer.add("stages_wall", stages.wall);
    timer.add("overlap", stages.overlap());
}

/// Hands each window's detections on to the output folder in window order:
/// only those in the window's own samples, and (when asked) without the
/// duplicates of one event across the boundary with the next window, which
/// is why a window's detections are held back until the next has come.
struct Emitter<'a> {
    writer: &'a mut OutputWriter,
    geometry: &'a Geometry,
    nt: u64,
    nt0min: usize,
    remove_duplicates: bool,
    /// The previous window's detections, with its first sample.
    pending: Option<(Detections, i64)>,
    spikes: u64,
    dropped: u64,
    duplicates: u64,
}

impl Emitter<'_> {
    /// Takes window `w`'s detections (window-relative samples).
    fn window(&mut self, w: WindowInfo, mut det: Detections) -> Result<()> {
        let before = det.len();
        let (nt, own_end) = (self.nt, self.nt + w.own_len);
        det.retain(|_, t| t >= nt && t < own_end);
        self.dropped += (before - det.len()) as u64;
        if !self.remove_duplicates {
            self.writer.append(&det, w.first_sample)?;
            self.spikes += det.len() as u64;
            return Ok(());
        }
        if let Some((mut prev, prev_first)) = self.pending.take() {
            self.duplicates += remove_boundary_duplicates(
                &mut prev,
                prev_first,
                &mut det,
                w.first_sample,
                w.own_start as i64,
                self.geometry,
                self.nt0min,
            );
            self.writer.append(&prev, prev_first)?;
            self.spikes += prev.len() as u64;
        }
        self.pending = Some((det, w.first_sample));
        Ok(())
    }

    /// Spikes handed on or held back so far.
    fn spikes_so_far(&self) -> u64 {
        self.spikes + self.pending.as_ref().map_or(0, |p| p.0.len() as u64)
    }

    /// Hands on the last window's detections and reports what was dropped.
    fn flush(&mut self) -> Result<()> {
        if let Some((prev, prev_first)) = self.pending.take() {
            self.writer.append(&prev, prev_first)?;
            self.spikes += prev.len() as u64;
        }
        if self.dropped > 0 {
            tracing::info!(
                "{} detections in the last window's padding (past the end of the recording) were dropped",
                self.dropped
            );
        }
        if self.duplicates > 0 {
            tracing::info!(
                "{} duplicate detections of events straddling a window boundary were removed (--keep-boundary-duplicates keeps them, as Kilosort4 does)",
                self.duplicates
            );
        }
        Ok(())
    }
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
