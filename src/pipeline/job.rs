//! What a run is given and what it gives back: [`DetectJob`], the input
//! [`Checks`], [`Progress`] and [`Report`], and the run's [`Warnings`]. The
//! lowest module of [`crate::pipeline`]: every stage reads these types, none
//! of them knows a stage.

use std::path::PathBuf;
use std::sync::Arc;

use crate::backend::Backend;
use crate::detect::DetectionSettings;
use crate::output::{RunInfo, Summary};
use crate::preprocess::PreprocessSettings;
use crate::probe::Probe;
use crate::recording::Recording;

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
    /// Input checks and the corrections that go beyond Kilosort4.
    pub checks: Checks,
    /// Universal templates: learned from the data (Kilosort4's default), built-in or a file
    /// ([`crate::universal`]).
    pub templates: crate::universal::TemplateSource,
    /// Drift estimation and correction ([`crate::drift`]);
    /// [`crate::drift::DriftSettings::off`] for a single pass.
    pub drift: crate::drift::DriftSettings,
    /// On a GPU back end, preprocess on the device too (default); false keeps
    /// preprocessing on the host (`--preprocess-on host`).
    pub device_preprocessing: bool,
    /// Whether the process ends after this run (`spikecube detect`): then
    /// a CUDA pass ends the device's context on a thread while the outputs
    /// are written ([`crate::backend::end_cuda_context`]) instead of at the
    /// process's exit. False wherever CUDA may run again in the process
    /// (Python, benches, tests).
    pub last_device_use: bool,
    /// Keep the detection pass's whitened windows on the device for a later
    /// stage (the sort's matching); `None` (the default) keeps none.
    pub keep_windows: Option<crate::stages::KeepWindows>,
    /// The output folder is a later stage's working folder (the sort's
    /// detection stage, read back by the same process and removed when it
    /// ends): its spike files are not synced to the disk and its drift map is
    /// not drawn ([`crate::output::OutputWriter::set_scratch`]). False for
    /// `spikecube detect` and the Python package's `detect`.
    pub scratch: bool,
}

/// Input checks of a run and the corrections spikecube makes where Kilosort4
/// would return a quietly wrong result (README, "Where spikecube differs").
#[derive(Debug, Clone)]
pub struct Checks {
    /// Warnings found before the run (e.g. by the command line about the probe
    /// and the file); they are logged again and kept in `spikecube.json`.
    pub warnings: Vec<String>,
    /// Rescale data whose filtered channel sd is far outside int16 counts
    /// ([`crate::checks::scale_factor`], BR-12). The command line turns it off when
    /// `--scale` is given.
    pub auto_scale: bool,
    /// Replace stuck (clipped) stretches by the channel's median before
    /// filtering ([`crate::checks::mask_stuck_runs`], BR-22). `--mask-clipped false`.
    pub mask_clipped: bool,
    /// Remove duplicate detections of one event across window boundaries
    /// ([`crate::checks::boundary_duplicates`], BR-19). `--keep-boundary-duplicates`.
    pub remove_boundary_duplicates: bool,
    /// The recording is a flat binary file: check that its channel count
    /// looks right ([`crate::checks::channel_count_warning`], BR-26).
    pub check_channel_count: bool,
    /// Stimulus-artifact blanking (`--artifact-times`, `--blank-transients`):
    /// stretches of the preprocessed data set to zero
    /// ([`crate::preprocess::Blanking`]); `None` (the default) blanks nothing.
    /// Transients common to most channels are looked for and warned about
    /// either way ([`crate::checks::transients`]).
    pub blanking: Option<Arc<crate::preprocess::Blanking>>,
}

impl Default for Checks {
    fn default() -> Self {
        Checks {
            warnings: Vec::new(),
            auto_scale: true,
            mask_clipped: true,
            remove_boundary_duplicates: true,
            check_channel_count: false,
            blanking: None,
        }
    }
}

impl Checks {
    /// Kilosort4's behaviour: no correction (warnings are still collected).
    pub fn kilosort() -> Self {
        Checks {
            auto_scale: false,
            mask_clipped: false,
            remove_boundary_duplicates: false,
            ..Checks::default()
        }
    }
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
    /// Whether this is the first pass (the drift estimate's, whose spikes
    /// are not the output; `spikes` is 0 there), else the detection pass.
    pub first_pass: bool,
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
    /// Duplicate detections of one event across a window boundary that were removed.
    pub boundary_duplicates_removed: u64,
    /// Stuck (clipped) samples replaced before filtering, summed over channels.
    pub clipped_samples_masked: u64,
    /// The factor the data were multiplied by before whitening (1 when none).
    pub scale_factor: f64,
    /// Warnings of the run, in the order raised (also in `spikecube.json`).
    pub warnings: Vec<String>,
}

/// Warnings of a run: each is logged (`tracing::warn!`, shown even with `-q`)
/// when raised and kept for `spikecube.json` and the final summary.
#[derive(Debug, Default)]
pub(crate) struct Warnings(pub(crate) Vec<String>);

impl Warnings {
    pub(crate) fn push(&mut self, w: String) {
        tracing::warn!("{w}");
        self.0.push(w);
    }
}
