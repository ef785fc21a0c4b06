//! Stage 1, **open**: the recording and its probe settled
//! ([`open_for_detection`]), then a run's settings completed and checked, its
//! windows planned, the geometry built and the output folder staged
//! ([`open_run`]) — everything that can fail on the inputs alone fails here,
//! before a device is opened or a sample read.

use anyhow::{Result, bail};

use super::job::{Checks, DetectJob, Warnings};
use crate::checks;
use crate::detect::Geometry;
use crate::output::OutputWriter;
use crate::preprocess::PreprocessSettings;
use crate::probe::Probe;
use crate::recording::{Recording, WindowPlan};

/// What [`open_run`] settles: the run's windows, geometry, staged output
/// folder and the warnings raised so far.
pub(crate) struct OpenRun {
    /// The windows (`batch_size` own samples, `nt` on each side).
    pub plan: WindowPlan,
    /// Template centres and neighbourhoods of the probe.
    pub geometry: Geometry,
    /// The staged output folder; detections stream into it.
    pub writer: OutputWriter,
    /// Warnings of the run so far (the job's, then the layout checks').
    pub warnings: Warnings,
}

/// Completes `job`'s settings from the recording (`fs`, `nt`, a batch no
/// longer than the recording), validates them, plans the windows, runs the
/// layout checks, builds the geometry, checks `--nblocks` against the probe
/// and stages the output folder.
///
/// # Errors
/// Invalid settings; a probe that does not fit the recording or gives no
/// template centres; a recording shorter than one window; an `--nblocks` the
/// probe cannot hold; an output folder that cannot be made.
pub(crate) fn open_run(job: &mut DetectJob) -> Result<OpenRun> {
    let mut warnings = Warnings::default();
    let (plan, geometry) = settle(job, &mut |w| warnings.push(w), true)?;
    // So does an output folder that cannot be written.
    let mut writer = OutputWriter::create(&job.out, &job.probe, &geometry, job.detection.n_pcs)?;
    writer.set_scratch(job.scratch);
    tracing::info!(
        "{} of {} samples, {} in flight; their memory about {:.0} MB, fixed by the window size and the probe, not by the recording's length or spike count{}",
        crate::error::count(plan.n_windows, "window"),
        plan.window_len(),
        crate::stages::WINDOWS_IN_FLIGHT,
        memory_estimate(job.probe.n_sites(), plan.window_len(), geometry.n_centres()) as f64 / 1e6,
        if job.keep_windows.is_some() {
            " (the preprocessed windows kept for the matching come on top, within --keep-windows-gb)"
        } else {
            ""
        }
    );
    Ok(OpenRun {
        plan,
        geometry,
        writer,
        warnings,
    })
}

/// Checks `job` as [`run_detection`](super::run_detection) checks it before
/// it reads any sample — the settings' ranges, the probe against the
/// recording, the windows, the geometry, `--nblocks` and the drift settings —
/// without reading samples, staging an output folder or opening a device.
/// For planning many runs (`spikecube batch plan`) that must not fail later
/// on a value a run refuses at its start. The job is used up: its settings
/// are completed as a run completes them.
///
/// Returns the warnings a run would raise before reading samples (the job's
/// own, then the layout checks'), not logged; the channel-count check of a
/// flat file, which reads samples, is left out.
///
/// # Errors
/// As [`run_detection`](super::run_detection) before it reads the data:
/// invalid settings, a probe that does not fit the recording or gives no
/// template centres, a recording shorter than one window, an `--nblocks` the
/// probe cannot hold, drift settings out of range.
pub fn check_job(mut job: DetectJob) -> Result<Vec<String>> {
    job.checks.check_channel_count = false;
    let mut warnings = Vec::new();
    settle(&mut job, &mut |w| warnings.push(w), false)?;
    Ok(warnings)
}

/// Everything [`open_run`] checks and builds before it stages the output
/// folder: `job`'s settings completed from the recording and validated, the
/// windows planned, the layout checked, the geometry built, the drift
/// settings and `--nblocks` checked. The job's warnings, then the layout
/// checks', go to `warn` as they are found; `log` logs the information that
/// the batch was shortened to the recording.
fn settle(
    job: &mut DetectJob,
    warn: &mut dyn FnMut(String),
    log: bool,
) -> Result<(WindowPlan, Geometry)> {
    let rec = job.recording.clone();
    job.preprocess.fs = rec.fs();
    job.preprocess.nt = job.detection.nt;
    job.detection.validate()?;
    job.preprocess.validate()?;
    for w in std::mem::take(&mut job.checks.warnings) {
        warn(w);
    }
    if let Some(m) = fit_batch_quietly(rec.as_ref(), &mut job.preprocess)
        && log
    {
        tracing::info!("{m}");
    }
    let plan = plan_windows(
        rec.as_ref(),
        &job.probe,
        job.preprocess.batch_size,
        job.detection.nt,
    )?;
    for w in layout_checks(rec.as_ref(), &job.probe, &job.preprocess, &job.checks)? {
        warn(w);
    }
    // Geometry first: a probe that cannot work fails before any data is read.
    let geometry = Geometry::new(&job.probe, &job.detection)?;
    // So do drift settings out of range (else found only after the
    // whitening fit and the templates) and an --nblocks the probe cannot hold.
    job.drift.validate()?;
    if job.drift.nblocks > 0 {
        crate::drift::check_nblocks(&job.drift, &job.probe)?;
    }
    Ok((plan, geometry))
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
            "{}: no probe geometry: give one with {} (Kilosort JSON, probeinterface JSON, .prb or a SpikeGLX .meta)",
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
    // A probe made for a file of more columns than this one: the sites are
    // likely read from the wrong columns (a wrong --n-channels, or a probe of
    // another recording), which no later check can see on noise-like data.
    // A probe that declares columns past its last site (a file width, as a
    // SpikeGLX .meta's nSavedChans or a probe JSON written with the sync
    // column counted) made for a wider file than this: the same. (Kilosort's
    // own n_chan, the number of sites, declares none past the last site.)
    let last_site_column = probe.chan_map.iter().max().map_or(0, |&c| c + 1);
    let declares_width = probe.n_chan > last_site_column;
    if probe.n_chan > n_file as u64 || (declares_width && probe.n_chan < n_file as u64) {
        warnings.push(format!(
            "the probe {} describes a file of n_chan = {} channels, but {} has {n_file}: its sites may be read from the wrong columns; check --n-channels and the probe",
            probe.source.display(),
            probe.n_chan,
            first.display()
        ));
    } else if let Some(w) = checks::unused_channels_warning(
        &probe,
        n_file,
        expected_unused + req.exclude_channels.len(),
    ) {
        // Columns the probe leaves unread, when its width is not in doubt
        // (else "give a probe that covers them" would point the wrong way).
        warnings.push(w);
    }
    let structured = first.is_dir()
        || first.extension().is_some_and(|e| e == "oebin")
        || first.with_extension("meta").is_file();
    if !structured && let Some(w) = checks::dtype::dtype_warning(first, &req.open) {
        warnings.insert(0, w); // before any rescaling's message
    }
    warnings.extend(opened.warnings.iter().cloned());
    // A --dtype or --offset that the file's format overrode: the outputs
    // that describe the raw file (params.py, spikecube.json) name what was read.
    warnings.extend(opened.overridden(&req.open, first));
    warnings.extend(crate::recording::junction_warnings(
        &req.paths,
        &req.open,
        &probe.chan_map,
    ));
    let checks = Checks {
        warnings,
        auto_scale: req.open.scale.is_none(),
        mask_clipped: req.mask_clipped,
        remove_boundary_duplicates: !req.keep_boundary_duplicates,
        check_channel_count: !structured,
        blanking: None,
    };
    Ok((opened, probe, checks))
}

/// A recording shorter than one batch is processed as one window of exactly
/// its own length (BR-24): Kilosort4 would pad it (with zeros) to `batch_size`,
/// and the padding would then enter the whitening covariance and the channel
/// means, so the whitened scale, and the spike count, would depend on how far
/// the batch overhangs the data. Kilosort4 itself cannot whiten a
/// single-window recording (its covariance average is 0/0).
pub(crate) fn fit_batch_to_recording(rec: &dyn Recording, settings: &mut PreprocessSettings) {
    if let Some(m) = fit_batch_quietly(rec, settings) {
        tracing::info!("{m}");
    }
}

/// [`fit_batch_to_recording`], its message returned instead of logged.
fn fit_batch_quietly(rec: &dyn Recording, settings: &mut PreprocessSettings) -> Option<String> {
    let n = rec.n_samples();
    if n > 0 && n < settings.batch_size as u64 && n >= settings.nt as u64 {
        let m = format!(
            "the recording ({n} samples) is shorter than one batch ({}): batch_size is set to {n}, so the whitening is fitted on real samples only",
            settings.batch_size
        );
        settings.batch_size = n as usize;
        return Some(m);
    }
    None
}

/// The layout checks (BR-26, BR-27) that need only the probe, the settings
/// and the file: millimetre coordinates, median CAR over too few sites, and
/// (flat binary files) a channel count that looks wrong. Returns the
/// warnings, not logged.
pub(crate) fn layout_checks(
    rec: &dyn Recording,
    probe: &Probe,
    settings: &PreprocessSettings,
    checks: &Checks,
) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    if let Some(w) = checks::millimetre_warning(probe) {
        warnings.push(w);
    }
    if settings.do_car && probe.n_sites() == 1 {
        bail!(
            "the probe {} has one site (after any --exclude-channels): its median common reference is the site itself and would zero every sample; give --do-car false",
            probe.source.display()
        );
    }
    if let Some(w) = checks::car_warning(probe, settings.do_car) {
        warnings.push(w);
    }
    if checks.check_channel_count
        && let Some(w) = checks::channel_count_warning(rec)?
    {
        warnings.push(w);
    }
    Ok(warnings)
}

/// Host memory a run holds at once, bytes: the windows in flight
/// ([`crate::stages::WINDOWS_IN_FLIGHT`]: one being read, one queued, one being
/// preprocessed and detected), one more window for scratch and the output
/// streams' buffers, the detector's per-centre buffers (As and its template
/// index), and per-thread filter-bank tiles. It does not depend on the
/// recording's length or spike count. (A GPU pass holds up to
/// [`crate::stages::windows_in_flight`]` = 6` int16 windows, and the device
/// whitening fit [`FIT_WINDOWS_IN_FLIGHT`]` = 5`: at most 3 f32 windows' bytes,
/// within this figure.) Learning the universal templates, before the pass,
/// holds [`crate::detect::learn::learn_windows_at_once`] windows (4 to 16,
/// one per thread) instead, when that is more.
pub fn memory_estimate(n_sites: usize, window_len: usize, n_centres: usize) -> u64 {
    let window = (n_sites * window_len * 4) as u64;
    let detector = (n_centres * window_len.next_multiple_of(crate::detect::cpu::TILE) * 5) as u64;
    let tiles = (rayon::current_num_threads() * n_sites * 7 * crate::detect::cpu::TILE * 4) as u64;
    let windows =
        (crate::stages::WINDOWS_IN_FLIGHT + 1).max(crate::detect::learn::learn_windows_at_once());
    windows as u64 * window + detector + tiles
}

/// Checks that the probe reads only channels the recording has and plans its
/// windows (`batch_size` own samples, `nt` on each side).
///
/// # Errors
/// When a channel-map entry is past the recording's channels, or the recording
/// holds less than one window of at least `nt` samples.
pub(crate) fn plan_windows(
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
