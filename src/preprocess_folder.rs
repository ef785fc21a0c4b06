//! The output folder of `spikecube preprocess` (and of the Python package's
//! `spikecube.preprocess`): one function writes it for both, through a
//! [`StagedFolder`], so both follow the same rule (a user's file in the folder
//! is never overwritten or removed; the folder appears only when complete) and
//! write the same files:
//!
//! * `temp_wh.dat`: the whitened recording, `n_samples × n_sites`, sample-major
//!   ([`write_whitened`]);
//! * `whitening_mat.npy`: the whitening matrix, `n_sites × n_sites` float32;
//! * `hp_filter.npy`: the high-pass filter's impulse response (Kilosort4's
//!   `get_highpass_filter`);
//! * `spikecube.json`: input, settings, sample type, warnings, and the list of files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use ndarray::Array1;

use crate::Probe;
use crate::npy;
use crate::output::folder::StagedFolder;
use crate::pipeline::{Checks, PreprocessReport, Progress, WhitenedFormat, write_whitened};
use crate::preprocess::{PreprocessSettings, highpass_kernel};
use crate::recording::Recording;

/// Subcommand name recorded in the folder's `spikecube.json` (`command`).
pub const COMMAND: &str = "preprocess";

/// Name of the whitened recording inside the folder.
pub const WHITENED_FILE: &str = "temp_wh.dat";

/// Writes the preprocessing folder `out` (files in the module docs) for
/// `recording` read through `probe`, and returns what [`write_whitened`]
/// reported. `settings.fs` is taken from the recording.
///
/// # Errors
/// As [`StagedFolder::create`] (checked before anything is read: e.g. `out`
/// holds a file spikecube did not write there) and [`write_whitened`]; when a
/// file cannot be written. Nothing is left at `out` then (an earlier
/// `preprocess` result there is kept).
pub fn write_preprocess_folder(
    recording: Arc<dyn Recording>,
    probe: &Probe,
    settings: &PreprocessSettings,
    format: WhitenedFormat,
    out: &Path,
    checks: &Checks,
    progress: &mut dyn FnMut(Progress),
) -> Result<(PathBuf, PreprocessReport)> {
    let settings = PreprocessSettings {
        fs: recording.fs(),
        ..settings.clone()
    };
    let staged = StagedFolder::create(out, COMMAND)?;
    let dir = staged.path().to_path_buf();
    let report = write_whitened(
        recording.clone(),
        probe,
        &settings,
        format,
        &dir.join(WHITENED_FILE),
        checks,
        progress,
    )?;
    npy::write(&dir.join("whitening_mat.npy"), &report.whitening)?;
    let kernel = highpass_kernel(settings.fs, settings.highpass_cutoff)?;
    npy::write(&dir.join("hp_filter.npy"), &Array1::from(kernel))?;
    let path = staged.publish(serde_json::json!({
        "program": "spikecube",
        "version": env!("CARGO_PKG_VERSION"),
        "input": recording.describe(),
        "temp_wh_dtype": match format {
            WhitenedFormat::Float32 => "float32",
            WhitenedFormat::Int16x200 => "int16 holding 200 x the whitened value",
        },
        "n_samples": report.n_samples,
        "n_sites": report.n_sites,
        "n_windows": report.n_windows,
        "saturated": report.saturated,
        "channel_map": probe.chan_map,
        "settings": settings,
        "warnings": report.warnings,
    }))?;
    Ok((path, report))
}
