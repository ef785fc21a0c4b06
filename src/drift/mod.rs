//! Drift estimation and correction, as Kilosort4 4.1.7 does it by default
//! (`nblocks = 1`), with the sharp edges made
//! safe (README, "Where spikecube differs"; `--drift-mode kilosort` restores
//! Kilosort4's behaviour).
//!
//! The run ([`prepare`], called by [`crate::pipeline`]):
//!
//! 1. a first detection pass over every whitened window, keeping each spike's
//!    depth, amplitude and window in memory ([`FirstPassSpikes`], 12 bytes a spike);
//! 2. the per-window depth × amplitude histogram, rigid and block registration
//!    ([`estimate`]): `dshift` (windows × blocks, µm) and `yblk` (µm);
//! 3. `drift.npy`, `drift_blocks.npy` and `drift.png` in the output folder;
//! 4. the [`DriftCorrection`] of the second (reported) pass: each window is
//!    high-passed and then multiplied by `G_b = M_b·W` instead of W
//!    ([`DriftRun::window_whitening`], [`DriftRun::preprocess`]).

pub mod correct;
pub mod estimate;
pub mod plot;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ndarray::Array2;

pub use correct::DriftCorrection;
pub use estimate::{FirstPassSpikes, Histogram, Registration, bin_spikes, register};

use crate::checks::WindowFound;
use crate::preprocess::Preprocessor;
use crate::probe::Probe;
use crate::recording::{Recording, WindowPlan};

/// Which behaviour at Kilosort4's sharp edges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum DriftMode {
    /// Safe: empty windows get a shift interpolated from their neighbours (and
    /// the reference window is the nearest non-empty one), a probe spanning
    /// too few depth bins for the ±15-bin search gets no drift correction
    /// (warning), blocks too short for the ±5-bin search are an error.
    #[default]
    Spikecube,
    /// Exactly Kilosort4 4.1.7, sharp edges included (with warnings).
    Kilosort,
}

/// Drift settings, Kilosort4's names and defaults.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DriftSettings {
    /// `nblocks`: 0 turns drift correction off; n ≥ 1 gives 2n − 1 overlapping blocks.
    pub nblocks: usize,
    /// `binning_depth` (dd), µm: height of the histogram's depth bins.
    pub binning_depth: f64,
    /// `drift_smoothing`: Gaussian σ on the (lag, window, block) axes of the fine scores.
    pub drift_smoothing: [f64; 3],
    /// `sig_interp`, µm: width of the interpolation kernel.
    pub sig_interp: f64,
    /// Stop after estimating drift: the output holds the first pass's
    /// (uncorrected) spikes and the drift files.
    pub drift_only: bool,
    /// Behaviour at the sharp edges.
    pub mode: DriftMode,
    /// µm: in spikecube mode, sites whose corrected position lies more than
    /// this beyond the probe's end read zero (infinite: Kilosort4's
    /// extrapolation everywhere).
    pub edge_margin: f64,
}

impl Default for DriftSettings {
    fn default() -> Self {
        DriftSettings {
            nblocks: 1,
            binning_depth: 5.0,
            drift_smoothing: [0.5, 0.5, 0.5],
            sig_interp: 20.0,
            drift_only: false,
            mode: DriftMode::Spikecube,
            edge_margin: correct::DEFAULT_EDGE_MARGIN,
        }
    }
}

/// Checks `--nblocks` against the probe's depth (before any data is read):
/// each block needs [`MIN_BLOCK_BINS`] depth bins of `binning_depth` µm (one
/// with `--drift-mode kilosort`). A probe too short for drift estimation
/// passes (the run turns drift off, or runs it anyway in Kilosort4's mode).
///
/// # Errors
/// When `nblocks` is 0 or above the probe's limit; the message names the flag
/// and the limit.
pub fn check_nblocks(settings: &DriftSettings, probe: &Probe) -> Result<()> {
    let dd = settings.binning_depth;
    let kilosort = settings.mode == DriftMode::Kilosort;
    let (d, _) = estimate::depth_bins(&probe.yc, dd);
    if d < MIN_DEPTH_BINS && !kilosort {
        return Ok(());
    }
    let nb = settings.nblocks;
    let max_nb = if kilosort { d } else { d / MIN_BLOCK_BINS };
    if nb > max_nb || nb == 0 {
        bail!(
            "--nblocks {nb}: the probe spans {d} depth bins of {dd} µm, and each block needs {} bins{}, so --nblocks can be at most {max_nb}",
            if kilosort { 1 } else { MIN_BLOCK_BINS },
            if kilosort {
                ""
            } else {
                " (fewer alias in the ±5-bin fine search)"
            }
        );
    }
    Ok(())
}

impl DriftSettings {
    /// No drift correction (`nblocks = 0`), as Kilosort4's `nblocks = 0`.
    pub fn off() -> Self {
        DriftSettings {
            nblocks: 0,
            ..DriftSettings::default()
        }
    }

    /// Checks the numbers.
    ///
    /// # Errors
    /// Names the flag when `binning_depth` or `sig_interp` is not positive or
    /// a `drift_smoothing` σ is negative or not finite.
    pub fn validate(&self) -> Result<()> {
        if !(self.binning_depth.is_finite() && self.binning_depth > 0.0) {
            bail!(
                "--binning-depth = {} µm must be positive",
                self.binning_depth
            );
        }
        if !(self.sig_interp.is_finite() && self.sig_interp > 0.0) {
            bail!("--sig-interp = {} µm must be positive", self.sig_interp);
        }
        if self
            .drift_smoothing
            .iter()
            .any(|s| !(s.is_finite() && *s >= 0.0))
        {
            bail!(
                "--drift-smoothing = {:?}: three σ ≥ 0 (lag, window, block)",
                self.drift_smoothing
            );
        }
        if self.edge_margin.is_nan() || self.edge_margin < 0.0 {
            bail!(
                "--drift-edge-margin = {} µm must be ≥ 0 (inf: no zeroing)",
                self.edge_margin
            );
        }
        if self.drift_only && self.nblocks == 0 {
            bail!("--drift-only needs drift estimation: --nblocks must be at least 1");
        }
        Ok(())
    }
}

/// Smallest number of depth bins for which the ±15-bin rigid search does not
/// alias (rolls are circular: lags k and k + D tie when D ≤ 30).
pub const MIN_DEPTH_BINS: usize = 2 * estimate::RIGID_LAGS as usize + 1;
/// Smallest block height (bins) for which the ±5-bin fine search does not alias.
pub const MIN_BLOCK_BINS: usize = 2 * estimate::FINE_LAGS as usize + 1;

/// The drift estimate of a run.
#[derive(Debug, Clone)]
pub struct DriftEstimate {
    /// `dshift`, windows × (2·nblocks − 1), µm. dshift > 0: in that window
    /// the spikes around `yblk` sit lower (smaller y) than in the template.
    pub dshift: Array2<f64>,
    /// `yblk`, block centres, µm.
    pub yblk: Vec<f64>,
    /// The registration's intermediate values.
    pub registration: Registration,
    /// First-pass spikes per window.
    pub counts: Vec<u64>,
    /// Windows without first-pass spikes (their shift was interpolated in
    /// spikecube mode).
    pub empty_windows: Vec<usize>,
    /// Reference window of the rigid registration.
    pub reference: usize,
}

/// What [`estimate`] decided.
#[derive(Debug, Clone)]
pub enum Estimated {
    /// Drift was estimated.
    Drift(Box<DriftEstimate>),
    /// Drift correction is off for this run; the reason (a warning).
    Off(String),
}

/// Kilosort4's drift estimate from the first pass's spikes (§3–§6), with
/// spikecube's safeguards unless `settings.mode` is [`DriftMode::Kilosort`].
/// Warnings (multi-shank pooling, aliasing in kilosort mode, empty windows)
/// go to `warn`.
///
/// `probe`: every site (all shanks); `th` = `Th_universal`; `n_windows` = Nbatches.
///
/// # Errors
/// When `nblocks` leaves blocks of fewer than 11 depth bins (spikecube mode)
/// or of none (kilosort mode), naming the largest `nblocks` allowed; when the
/// spikes do not fit the probe ([`bin_spikes`]).
pub fn estimate(
    spikes: &FirstPassSpikes,
    probe: &Probe,
    settings: &DriftSettings,
    th: f64,
    n_windows: usize,
    warn: &mut dyn FnMut(String),
) -> Result<Estimated> {
    settings.validate()?;
    let dd = settings.binning_depth;
    let kilosort = settings.mode == DriftMode::Kilosort;
    let (d, _) = estimate::depth_bins(&probe.yc, dd);
    let mut shanks = probe.kcoords.clone();
    shanks.sort_unstable();
    shanks.dedup();
    if shanks.len() > 1 {
        warn(format!(
            "drift: the {} shanks are pooled into one depth histogram, so every shank gets the same shift at a given depth (as Kilosort4 does); if the shanks may move independently, sort each shank on its own",
            shanks.len()
        ));
    }
    if d < MIN_DEPTH_BINS {
        let span = d as f64 * dd;
        let msg = format!(
            "drift: the probe spans only {d} depth bins of {dd} µm (about {span:.0} µm), fewer than the {MIN_DEPTH_BINS} the ±15-bin rigid search needs; its circular search would alias to shifts of hundreds of µm"
        );
        if !kilosort {
            return Ok(Estimated::Off(format!(
                "{msg}, so drift correction is off for this run (--nblocks 0; --drift-mode kilosort runs it anyway)"
            )));
        }
        warn(format!("{msg} (--drift-mode kilosort: running it anyway)"));
    }
    check_nblocks(settings, probe)?;
    let nb = settings.nblocks;
    let hist = bin_spikes(spikes, &probe.yc, dd, th, n_windows)?;
    let empty: Vec<usize> = (0..n_windows).filter(|&b| hist.counts[b] == 0).collect();
    let i0 = estimate::reference_batch(n_windows);
    let reference = if kilosort || hist.counts[i0] > 0 {
        i0
    } else {
        match (0..n_windows)
            .filter(|&b| hist.counts[b] > 0)
            .min_by_key(|&b| (b as i64 - i0 as i64).abs())
        {
            Some(b) => b,
            None => {
                return Ok(Estimated::Off(
                    "drift: the first pass found no spikes, so drift cannot be estimated and correction is off for this run".into(),
                ));
            }
        }
    };
    if !empty.is_empty() {
        warn(format!(
            "drift: {} of {n_windows} windows had no first-pass spikes ({}){}",
            empty.len(),
            list(&empty),
            if kilosort {
                "; --drift-mode kilosort gives them Kilosort4's arbitrary extreme shift (−135 bins before the fine step)"
            } else {
                "; their shift is interpolated from the nearest windows with spikes"
            }
        ));
    }
    let registration = register(&hist, nb, settings.drift_smoothing, reference)?;
    let range = estimate::check_search_range(&hist, &registration, reference);
    if let Some(w) = estimate::range_warning(&range, dd, n_windows) {
        warn(w);
    }
    let mut dshift = registration.imin.mapv(|v| v * dd);
    if !kilosort && !empty.is_empty() {
        interpolate_empty(&mut dshift, &hist.counts);
    }
    Ok(Estimated::Drift(Box::new(DriftEstimate {
        dshift,
        yblk: registration.yblk.clone(),
        registration,
        counts: hist.counts,
        empty_windows: empty,
        reference,
    })))
}

/// Replaces the rows of windows without spikes by linear interpolation (over
/// the window index) between the nearest windows with spikes; before the
/// first and after the last such window, their value.
pub fn interpolate_empty(dshift: &mut Array2<f64>, counts: &[u64]) {
    let full: Vec<usize> = (0..counts.len()).filter(|&b| counts[b] > 0).collect();
    if full.is_empty() {
        return;
    }
    for b in 0..counts.len() {
        if counts[b] > 0 {
            continue;
        }
        let after = full.partition_point(|&f| f < b);
        for j in 0..dshift.ncols() {
            dshift[[b, j]] = match (after.checked_sub(1).map(|i| full[i]), full.get(after)) {
                (Some(lo), Some(&hi)) => {
                    let w = (b - lo) as f64 / (hi - lo) as f64;
                    dshift[[lo, j]] * (1.0 - w) + dshift[[hi, j]] * w
                }
                (Some(lo), None) => dshift[[lo, j]],
                (None, Some(&hi)) => dshift[[hi, j]],
                (None, None) => 0.0,
            };
        }
    }
}

/// "3, 7, 12" (at most 10, then "…").
fn list(v: &[usize]) -> String {
    let mut s: Vec<String> = v.iter().take(10).map(|b| b.to_string()).collect();
    if v.len() > 10 {
        s.push("…".into());
    }
    s.join(", ")
}

/// Receives one window's detections and the absolute sample of its column 0
/// (as [`crate::output::OutputWriter::append`]).
pub type AppendDetections<'a> = dyn FnMut(&crate::Detections, i64) -> Result<()> + 'a;

/// Everything the first pass needs from the run.
pub struct FirstPass<'a> {
    /// The recording.
    pub recording: &'a Arc<dyn Recording>,
    /// Its windows.
    pub plan: &'a WindowPlan,
    /// The probe (chan_map, site positions).
    pub probe: &'a Probe,
    /// Preprocessing with the run's whitening matrix.
    pub pre: &'a Preprocessor,
    /// `nt`, samples.
    pub nt: u64,
    /// Replace stuck stretches as the main pass does.
    pub mask_clipped: bool,
    /// When given, each window gets the detection pass's input checks
    /// ([`crate::checks::WindowCheck::run`], which masks as `mask_clipped`
    /// says) in place of the masking alone, added up here in window order:
    /// for a detection pass that will not read the windows again.
    pub checks: Option<&'a std::sync::Mutex<crate::checks::PassChecks>>,
    /// Called after each window, in window order, with its
    /// [`crate::stages::WindowInfo`] (for progress reports).
    pub on_window: Option<&'a dyn Fn(&crate::stages::WindowInfo)>,
}

/// The first detection pass (Kilosort4's `datashift.run` step 2): every
/// window read, preprocessed as the main pass does (without drift), detected
/// by `pass` (on the host or the device), pipelined as the main pass
/// ([`crate::stages::run_windows`]); detections in the window's own samples
/// are kept. When `also` is given (`--drift-only`), each window's detections
/// are passed to it too, with their PC features; otherwise the pass goes
/// without PC features ([`first_pass_with`]).
///
/// # Errors
/// When a read, the preprocessing or the detection fails (naming the window).
pub fn first_pass(
    fp: &FirstPass<'_>,
    pass: &mut dyn crate::stages::WindowPass,
    also: Option<&mut AppendDetections<'_>>,
) -> Result<FirstPassSpikes> {
    let pc_features = also.is_some();
    first_pass_with(fp, pass, also, pc_features)
}

/// [`first_pass`], with the detections' PC features (`tF`) computed or not
/// (`pc_features`; the drift estimate needs only each spike's sample, depth
/// and amplitude, which do not depend on it: tests/drift.rs). The pass
/// computes them again afterwards, whatever happened.
///
/// # Errors
/// As [`first_pass`].
pub fn first_pass_with(
    fp: &FirstPass<'_>,
    pass: &mut dyn crate::stages::WindowPass,
    also: Option<&mut AppendDetections<'_>>,
    pc_features: bool,
) -> Result<FirstPassSpikes> {
    pass.set_pc_features(pc_features);
    let res = first_pass_run(fp, pass, also);
    pass.set_pc_features(true);
    res
}

fn first_pass_run(
    fp: &FirstPass<'_>,
    pass: &mut dyn crate::stages::WindowPass,
    mut also: Option<&mut AppendDetections<'_>>,
) -> Result<FirstPassSpikes> {
    let mut out = FirstPassSpikes::default();
    let plan = *fp.plan;
    let check = crate::checks::WindowCheck::new(plan, fp.recording.fs(), fp.mask_clipped);
    let checks = fp.checks;
    let full = checks.is_some();
    // The masking (and the checks, when asked) depend on the window alone:
    // they run on the reading threads right after each read, several windows
    // at once when the pass reads on several threads; the checks' totals
    // are added up in window order.
    let prepare = move |w: &mut crate::recording::Window| -> Result<Option<WindowFound>> {
        Ok(check.run_or_mask(w, full))
    };
    let merge = move |_: &mut crate::recording::Window, found: Option<WindowFound>| -> Result<()> {
        if let (Some(c), Some(f)) = (checks, found) {
            c.lock().unwrap_or_else(|e| e.into_inner()).merge(f);
        }
        Ok(())
    };
    let nt = fp.nt;
    let report = crate::stages::run_windows_prechecked(
        fp.recording.clone(),
        plan,
        &fp.probe.chan_map,
        &prepare,
        merge,
        0,
        pass,
        |w: crate::stages::WindowInfo, mut det: crate::Detections| -> Result<()> {
            let own_end = nt + w.own_len;
            det.retain(|_, t| t >= nt && t < own_end);
            for i in 0..det.len() {
                out.y.push(det.yct[i]);
                out.amp.push(det.amp[i].abs());
                out.batch.push(w.index as u32);
                out.sample.push(w.first_sample + det.sample[i] as i64);
            }
            if let Some(f) = also.as_mut() {
                f(&det, w.first_sample)?;
            }
            if let Some(f) = fp.on_window {
                f(&w);
            }
            Ok(())
        },
    )
    .context("drift first pass")?;
    let busy: Vec<String> = report
        .times
        .0
        .iter()
        .filter(|(k, _)| !k.contains('.'))
        .map(|(k, v)| format!("{k} {v:.3}"))
        .collect();
    tracing::debug!(
        "drift first pass: {:.3} s from the first read to the last window; busy seconds: {}",
        report.wall,
        busy.join(", ")
    );
    Ok(out)
}

/// What the drift step of a run did, for `spikecube.json` and the pipeline.
#[derive(Debug, Default)]
pub struct DriftRun {
    /// The correction the second pass applies (None: no correction).
    pub correction: Option<DriftCorrection>,
    /// `--drift-only`: the first pass's spikes are the run's output; skip the second pass.
    pub drift_only: bool,
    /// Summary for `spikecube.json` (`settings.drift`).
    pub summary: serde_json::Value,
    /// Timings, seconds: first pass, estimate.
    pub timings: Vec<(&'static str, f64)>,
    /// Time spent in [`DriftRun::window_whitening`], nanoseconds.
    correct_ns: std::sync::atomic::AtomicU64,
    /// The last matrices of [`DriftRun::window_whitening`], by shifts and W.
    cache: std::sync::Mutex<Vec<(Vec<u64>, std::sync::Arc<crate::preprocess::Whitening>)>>,
}

/// Drift-corrected whitening matrices a [`DriftRun`] keeps for reuse
/// (windows with equal shifts: dshift moves in steps of 0.1·dd).
pub const CACHED_MATRICES: usize = 8;

/// The window's shifts (bits) followed by a fingerprint of W's non-zeros.
fn cache_key(dshift_row: &[f64], w: &crate::preprocess::Whitening) -> Vec<u64> {
    let (start, cols, vals) = w.csr();
    // FNV-1a over W's structure and values.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in start
        .iter()
        .chain(&cols)
        .copied()
        .chain(vals.iter().map(|v| v.to_bits()))
    {
        h = (h ^ u64::from(v)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut k: Vec<u64> = dshift_row.iter().map(|v| v.to_bits()).collect();
    k.push(h);
    k
}

impl DriftRun {
    /// Windows the second pass should process: all, or none with `--drift-only`.
    pub fn windows_to_detect(&self) -> usize {
        if self.drift_only { 0 } else { usize::MAX }
    }

    /// The drift-corrected whitening of window `window_index`: `G_b = M_b·W`
    /// ([`DriftCorrection::window_whitening`]), to apply to the high-passed
    /// window ([`Preprocessor::filter_only`]) in place of `w`; `None` when
    /// this run does not correct drift. Windows with the same shifts (and the
    /// same `w`) share one matrix: the last [`CACHED_MATRICES`] are kept.
    ///
    /// # Errors
    /// When the window index is past the estimate's windows or `w` does not
    /// fit the probe.
    pub fn window_whitening(
        &self,
        window_index: u64,
        w: &crate::preprocess::Whitening,
    ) -> Result<Option<Arc<crate::preprocess::Whitening>>> {
        let Some(c) = &self.correction else {
            return Ok(None);
        };
        let t = Instant::now();
        let b = window_index as usize;
        if b >= c.dshift().nrows() {
            bail!(
                "drift correction of window {window_index}: the drift estimate has {} windows",
                c.dshift().nrows()
            );
        }
        let key = cache_key(c.dshift().row(b).as_slice().unwrap_or(&[]), w);
        let cached = self
            .cache
            .lock()
            .ok()
            .and_then(|m| m.iter().find(|(k, _)| *k == key).map(|(_, g)| g.clone()));
        let g = match cached {
            Some(g) => g,
            None => {
                let g = std::sync::Arc::new(
                    c.window_whitening(window_index, w)
                        .with_context(|| format!("drift correction of window {window_index}"))?,
                );
                if let Ok(mut m) = self.cache.lock() {
                    if m.len() >= CACHED_MATRICES {
                        m.remove(0);
                    }
                    m.push((key, g.clone()));
                }
                g
            }
        };
        self.correct_ns.fetch_add(
            t.elapsed().as_nanos() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(Some(g))
    }

    /// Preprocesses one raw window as the second pass sees it: with drift
    /// correction, channel means, CAR, high-pass and artifact check
    /// ([`Preprocessor::filter_only`]), then `G_b`
    /// ([`DriftRun::window_whitening`]); without, [`Preprocessor::apply`].
    /// `G_b` is built while the window is filtered (both on the thread pool,
    /// so that the build's serial parts leave no core idle).
    ///
    /// # Errors
    /// As those (the matrix's error first).
    pub fn preprocess(
        &self,
        pre: &Preprocessor,
        window_index: u64,
        x: &mut Array2<f32>,
    ) -> Result<()> {
        if self.correction.is_none() {
            pre.apply(x)?;
            return Ok(());
        }
        let (g, filtered) = rayon::join(
            || self.window_whitening(window_index, pre.whitening()),
            || pre.filter_only(x),
        );
        let g = g?;
        filtered?;
        if let Some(g) = g {
            g.apply(x)?;
        }
        Ok(())
    }

    /// The whitening half of [`DriftRun::preprocess`] on window
    /// `window_index` already high-passed by `pre`
    /// ([`Preprocessor::filter_timed`], which said whether the artifact check
    /// zeroed it: `artifact`): `G_b·X` in place; without a correction `W·X`,
    /// or nothing for a zeroed window, as [`Preprocessor::apply`]. The same
    /// bits as `preprocess` on the raw window.
    ///
    /// # Errors
    /// As [`DriftRun::preprocess`].
    pub fn whiten_filtered(
        &self,
        pre: &Preprocessor,
        window_index: u64,
        x: &mut Array2<f32>,
        artifact: bool,
    ) -> Result<()> {
        if self.correction.is_none() {
            if !artifact {
                pre.whitening().apply(x)?;
            }
            return Ok(());
        }
        if let Some(g) = self.window_whitening(window_index, pre.whitening())? {
            g.apply(x)?;
        }
        Ok(())
    }

    /// Adds the drift step to the run's `spikecube.json`: `settings.drift`
    /// (settings, both passes' spike counts, shifts). `second_pass_spikes`:
    /// the output's count.
    pub fn record(&self, info: &mut crate::output::RunInfo, second_pass_spikes: u64) {
        let mut summary = self.summary.clone();
        if self.correction.is_some() {
            summary["second_pass_spikes"] = second_pass_spikes.into();
        }
        if let serde_json::Value::Object(m) = &mut info.settings {
            m.insert("drift".into(), summary);
        }
    }

    /// Records the drift step's seconds: `drift_first_pass`,
    /// `drift_estimate` (with its parts `drift_estimate.register`, `.files`
    /// (drift.npy, drift_blocks.npy, drift.png), `.correction` (iKxx)) and,
    /// after the second pass, `drift_correct` (the corrected whitening
    /// matrices' builds, also inside the pass's `preprocess`).
    pub fn record_timings(&self, timer: &mut crate::timing::StageTimer) {
        for (k, v) in &self.timings {
            timer.add(*k, *v);
        }
        if self.correction.is_some() {
            let ns = self.correct_ns.load(std::sync::atomic::Ordering::Relaxed);
            timer.add("drift_correct", ns as f64 * 1e-9);
        }
    }
}

impl crate::stages::WindowWhitening for DriftRun {
    fn corrects(&self) -> bool {
        self.correction.is_some()
    }

    fn window_whitening(
        &self,
        index: u64,
        w: &crate::preprocess::Whitening,
    ) -> Result<Option<Arc<crate::preprocess::Whitening>>> {
        DriftRun::window_whitening(self, index, w)
    }

    fn preprocess(&self, pre: &Preprocessor, index: u64, x: &mut Array2<f32>) -> Result<()> {
        DriftRun::preprocess(self, pre, index, x)
    }

    fn whiten_filtered(
        &self,
        pre: &Preprocessor,
        index: u64,
        x: &mut Array2<f32>,
        artifact: bool,
    ) -> Result<()> {
        DriftRun::whiten_filtered(self, pre, index, x, artifact)
    }
}

/// The drift step of a run: nothing when `nblocks = 0`; otherwise the first
/// pass, the estimate, `drift.npy` (dshift, float64 windows × blocks, µm),
/// `drift_blocks.npy` (yblk, float64, µm) and `drift.png` written into
/// `folder` (the staged output folder), and the correction for the second
/// pass. With `--drift-only`, `append` receives the first pass's detections.
///
/// # Errors
/// As [`first_pass`] and [`estimate`]; when a file cannot be written.
pub fn prepare(
    fp: &FirstPass<'_>,
    settings: &DriftSettings,
    th: f64,
    pass: &mut dyn crate::stages::WindowPass,
    folder: &Path,
    append: &mut AppendDetections<'_>,
    warn: &mut dyn FnMut(String),
) -> Result<DriftRun> {
    settings.validate()?;
    if settings.nblocks == 0 {
        return Ok(DriftRun {
            summary: serde_json::json!({ "settings": settings, "applied": false }),
            ..DriftRun::default()
        });
    }
    let t0 = Instant::now();
    tracing::info!(
        "drift: first detection pass (nblocks = {})",
        settings.nblocks
    );
    let spikes = first_pass(
        fp,
        pass,
        if settings.drift_only {
            Some(append)
        } else {
            None
        },
    )?;
    let t_first = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let n_windows = fp.plan.n_windows as usize;
    let est = estimate(&spikes, fp.probe, settings, th, n_windows, warn)?;
    let t_register = t1.elapsed().as_secs_f64();
    let mut run = DriftRun {
        drift_only: settings.drift_only,
        ..DriftRun::default()
    };
    let mut summary = serde_json::json!({
        "settings": settings,
        "first_pass_spikes": spikes.len(),
        "first_pass_s": t_first,
    });
    let mut parts = vec![("drift_estimate.register", t_register)];
    match est {
        Estimated::Off(why) => {
            warn(why.clone());
            summary["applied"] = false.into();
            summary["off_because"] = why.into();
        }
        Estimated::Drift(e) => {
            let t = Instant::now();
            crate::npy::write(&folder.join("drift.npy"), &e.dshift)?;
            crate::npy::write(
                &folder.join("drift_blocks.npy"),
                &ndarray::Array1::from(e.yblk.clone()),
            )?;
            let fs = fp.recording.fs();
            plot::render(
                &folder.join("drift.png"),
                &spikes,
                &e,
                fp.plan.batch_size as f64 / fs,
                fs,
                fp.probe,
            )?;
            parts.push(("drift_estimate.files", t.elapsed().as_secs_f64()));
            let t = Instant::now();
            let corr = DriftCorrection::new(
                &fp.probe.xc,
                &fp.probe.yc,
                e.dshift.clone(),
                e.yblk.clone(),
                settings.sig_interp,
            )?
            // The sparse G_b in both modes: on the fixture recordings it gives
            // the same spike times as every non-zero (docs/benchmarks-history.md, "Drift").
            .with_zero_outside(
                (settings.mode != DriftMode::Kilosort && settings.edge_margin.is_finite())
                    .then_some(settings.edge_margin),
            );
            parts.push(("drift_estimate.correction", t.elapsed().as_secs_f64()));
            let col0 = e.dshift.column(0);
            summary["applied"] = (!settings.drift_only).into();
            summary["n_blocks_used"] = e.yblk.len().into();
            summary["yblk_um"] = e.yblk.clone().into();
            summary["mean_abs_drift_um"] =
                (col0.iter().map(|v| v.abs()).sum::<f64>() / col0.len().max(1) as f64).into();
            summary["dshift_range_um"] = serde_json::json!([
                e.dshift.iter().copied().fold(f64::INFINITY, f64::min),
                e.dshift.iter().copied().fold(f64::NEG_INFINITY, f64::max)
            ]);
            summary["empty_windows"] = e.empty_windows.len().into();
            summary["reference_window"] = e.reference.into();
            run.correction = (!settings.drift_only).then_some(corr);
        }
    }
    let t_est = t1.elapsed().as_secs_f64();
    summary["estimate_s"] = t_est.into();
    run.summary = summary;
    run.timings = vec![("drift_first_pass", t_first), ("drift_estimate", t_est)];
    run.timings.extend(parts);
    Ok(run)
}
