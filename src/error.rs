//! Error types. Every error names the file, the field and the numbers involved.

use std::path::PathBuf;

/// Errors raised while loading or validating a probe (site geometry).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The file could not be read.
    #[error("cannot read probe file {path}: {source}")]
    Io {
        /// The probe file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// The file is not in a format we can parse.
    #[error("probe file {path}: {message}")]
    Parse {
        /// The probe file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A field has the wrong shape, type or value.
    #[error("probe file {path}: field `{field}`: {message}")]
    Field {
        /// The probe file (or a description of where the probe came from).
        path: PathBuf,
        /// The offending field, using the file's own name for it.
        field: String,
        /// What is wrong, with the numbers.
        message: String,
    },
}

/// Errors raised by detection: bad settings or inputs that do not fit each other.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    /// A setting is out of range.
    #[error("setting `{name}`: {message}")]
    Setting {
        /// Kilosort4's name of the setting.
        name: &'static str,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// An input array has the wrong shape or contents.
    #[error("{what}: {message}")]
    Input {
        /// Which input (file name or array name).
        what: String,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// The probe leaves no template centre within `max_channel_distance`.
    #[error(
        "no template centre lies within max_channel_distance = {max_channel_distance} µm of a site; check the probe's units (µm) and spacing"
    )]
    NoCentres {
        /// The setting in force, µm.
        max_channel_distance: f64,
    },
}
