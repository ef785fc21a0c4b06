//! `spikecube preprocess`: Kilosort4's preprocessing over a whole recording,
//! written out as one whitened file (the open and whitening-fit stages of a
//! run, then every window preprocessed in order).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use ndarray::Array2;

use super::fit::fit;
use super::job::{Checks, Progress, Warnings};
use super::open::{fit_batch_to_recording, layout_checks, plan_windows};
use crate::checks;
use crate::preprocess::{FitOptions, PreprocessSettings, Preprocessor};
use crate::probe::Probe;
use crate::recording::{Recording, WindowLoader};

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
/// `checks` apply as in [`run_detection`](super::run_detection): a recording shorter than one batch is
/// one window of its own length, stuck stretches are masked
/// (`checks.mask_clipped`), data far from int16 scale are rescaled
/// (`checks.auto_scale`), the stretches of `checks.blanking` (stimulus
/// artifacts) are zeroed, and the layout warnings are logged and returned
/// ([`PreprocessReport::warnings`]). [`Checks::kilosort`] gives Kilosort4's output.
///
/// # Errors
/// As [`run_detection`](super::run_detection) for the recording, probe and settings; when `out` cannot be written.
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
    for w in layout_checks(recording.as_ref(), probe, &settings, checks)? {
        warnings.push(w);
    }
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
        if let Some(m) = &fitted.noisy_message {
            warnings.push(m.clone());
        }
        if let Some(w) = fitted
            .health
            .warning("the windows of the whitening fit", checks.mask_clipped)
        {
            warnings.push(w);
        }
        let whiten_mat = fitted.whitening;
        let pre = Preprocessor::new(&settings, whiten_mat.clone())?
            .with_blanking(checks.blanking.clone());
        for (done, window) in
            WindowLoader::all(recording.clone(), plan, chan_map.clone())?.enumerate()
        {
            let mut win = window?;
            if checks.mask_clipped {
                let cols = checks::WindowColumns::of(&plan, win.index);
                checks::mask_stuck_runs(&mut win.data, cols.lo, cols.hi, cols.pad_repeats, min_run);
            }
            pre.apply_at(&mut win.data, win.first_sample)?;
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
                first_pass: false,
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
