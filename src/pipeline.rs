//! The main job: a recording to spikes on disk (Kilosort4's `run_kilosort` up to
//! and including the first detection pass, without drift correction).
//!
//! 1. Plan the windows ([`WindowPlan`]: `batch_size` own samples, `nt` on each side).
//! 2. Fit the whitening matrix on every `nskip`-th window ([`fit_whitening`]).
//! 3. For every window, read ahead on a thread ([`WindowLoader`]), preprocess
//!    ([`Preprocessor`]: channel means, median CAR, high-pass, whitening), detect
//!    ([`Detector`]: CPU or GPU) and stream the spikes to the output folder ([`OutputWriter`]).
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
use crate::detect::{DetectionSettings, Geometry, UniversalTemplates};
use crate::output::{OutputWriter, RunInfo, Summary};
use crate::preprocess::{PreprocessSettings, Preprocessor, fit_whitening};
use crate::probe::Probe;
use crate::recording::{Recording, WindowLoader, WindowPlan, read_window};

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
    let plan = plan_windows(
        rec.as_ref(),
        &job.probe,
        job.preprocess.batch_size,
        job.detection.nt,
    )?;
    let chan_map = job.probe.chan_map.clone();
    let n_sites = job.probe.n_sites();

    // Geometry first: a probe that cannot work fails before any data is read.
    let geometry = Geometry::new(&job.probe, &job.detection)?;
    let n_centres = geometry.n_centres();
    // So does an output folder that cannot be written.
    let mut writer = OutputWriter::create(&job.out, &job.probe, &geometry, job.detection.n_pcs)?;
    tracing::info!(
        "{} of {} samples; memory about {:.0} MB, fixed by the window size and the probe, not by the recording's length or spike count",
        crate::error::count(plan.n_windows, "window"),
        plan.window_len(),
        memory_estimate(n_sites, plan.window_len(), n_centres) as f64 / 1e6
    );

    let t_fit = Instant::now();
    let whiten_mat = fit(&rec, &plan, &job.probe, &job.preprocess)?;
    let fit_s = t_fit.elapsed().as_secs_f64();
    let pre = Preprocessor::new(&job.preprocess, whiten_mat.clone())?;

    let chosen = crate::backend::choose(job.backend)?;
    tracing::info!(
        "detection on {} ({}): {}",
        chosen.backend,
        chosen.device,
        chosen.reason
    );
    let mut detector = Detector::new(
        &chosen,
        geometry.clone(),
        UniversalTemplates::builtin(),
        job.detection.clone(),
    )?;
    let nt = job.detection.nt as u64;
    let t_detect = Instant::now();
    let (mut t_pre, mut t_det, mut t_write) = (0f64, 0f64, 0f64);
    let mut spikes = 0u64;
    let mut dropped = 0u64;
    let mut seconds_done = 0f64;
    let loader = WindowLoader::all(rec.clone(), plan, chan_map)?;
    for (done, window) in loader.enumerate() {
        let mut w = window?;
        let t0 = Instant::now();
        pre.apply(&mut w.data).with_context(|| {
            format!(
                "preprocessing window {} (samples from {})",
                w.index, w.own_start
            )
        })?;
        let t1 = Instant::now();
        let mut det = detector
            .detect(w.data.view(), &job.probe.yc)
            .with_context(|| {
                format!(
                    "detecting in window {} (samples from {})",
                    w.index, w.own_start
                )
            })?;
        let before = det.len();
        let own_end = nt + w.own_len;
        det.retain(|_, t| t >= nt && t < own_end);
        dropped += (before - det.len()) as u64;
        let t2 = Instant::now();
        writer.append(&det, w.first_sample)?;
        t_write += t2.elapsed().as_secs_f64();
        t_pre += (t1 - t0).as_secs_f64();
        t_det += (t2 - t1).as_secs_f64();
        spikes += det.len() as u64;
        seconds_done += w.own_len as f64 / fs;
        progress(Progress {
            windows_done: done as u64 + 1,
            windows_total: plan.n_windows,
            spikes,
            seconds_done,
            elapsed: t_detect.elapsed().as_secs_f64(),
        });
    }
    if dropped > 0 {
        tracing::info!(
            "{dropped} detections in the last window's padding (past the end of the recording) were dropped"
        );
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
    });
    info.versions
        .insert("spikecube".into(), env!("CARGO_PKG_VERSION").into());
    info.versions
        .insert("kilosort_reference".into(), "4.1.7".into());
    info.versions
        .insert("backend".into(), chosen.backend.clone());
    info.versions.insert("device".into(), chosen.device.clone());
    info.versions
        .insert("backend_reason".into(), chosen.reason.clone());
    for (k, v) in [
        ("whitening_fit", fit_s),
        ("preprocess", t_pre),
        ("detect", t_det),
        ("write", t_write),
        ("total", t_start.elapsed().as_secs_f64()),
    ] {
        info.timings.insert(k.into(), v);
    }
    let summary = writer.finish(&info)?;
    Ok(Report {
        summary,
        n_windows: plan.n_windows,
        seconds: seconds_done,
        wall: t_start.elapsed().as_secs_f64(),
        n_centres,
        dropped_in_padding: dropped,
    })
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
}

/// Kilosort4's preprocessing over a whole recording, written out: the whitening
/// fit, then every window's own samples (channel means, median CAR, high-pass,
/// whitening) in order, sample-major (`n_samples × n_sites`, interleaved like the
/// input), to `out`, written under a temporary name and renamed when complete.
///
/// # Errors
/// As [`run_detection`] for the recording, probe and settings; when `out` cannot be written.
pub fn write_whitened(
    recording: Arc<dyn Recording>,
    probe: &Probe,
    settings: &PreprocessSettings,
    format: WhitenedFormat,
    out: &std::path::Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<PreprocessReport> {
    use std::io::Write;
    let t_start = Instant::now();
    let mut settings = settings.clone();
    settings.fs = recording.fs();
    settings.validate()?;
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
        let whiten_mat = fit(&recording, &plan, probe, &settings)?;
        let pre = Preprocessor::new(&settings, whiten_mat.clone())?;
        for (done, window) in
            WindowLoader::all(recording.clone(), plan, chan_map.clone())?.enumerate()
        {
            let mut win = window?;
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
    })
}

/// Host memory a run holds at once, bytes: the windows in flight (one being read,
/// two queued, one being processed), the preprocessing scratch (about one window),
/// the detector's per-centre buffers (As and its template index), and per-thread
/// filter-bank tiles. It does not depend on the recording's length or spike count.
pub fn memory_estimate(n_sites: usize, window_len: usize, n_centres: usize) -> u64 {
    let window = (n_sites * window_len * 4) as u64;
    let detector = (n_centres * window_len.next_multiple_of(crate::detect::cpu::TILE) * 5) as u64;
    let tiles = (rayon::current_num_threads() * n_sites * 7 * crate::detect::cpu::TILE * 4) as u64;
    5 * window + detector + tiles
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

/// Kilosort4's whitening fit over the planned windows of `rec` (raw windows read
/// with the probe's channel map).
fn fit(
    rec: &Arc<dyn Recording>,
    plan: &WindowPlan,
    probe: &Probe,
    settings: &PreprocessSettings,
) -> Result<Array2<f32>> {
    fit_whitening(
        plan.n_windows,
        |i| -> Result<Array2<f32>> {
            let mut w = Array2::zeros((probe.n_sites(), plan.window_len()));
            read_window(rec.as_ref(), plan, i, &probe.chan_map, &mut w)?;
            Ok(w)
        },
        probe,
        settings,
    )
    .context("fitting the whitening matrix")
}
