//! Error types. Every error names the file, the field and the numbers involved.

use std::path::PathBuf;

/// The command-line flag that sets the setting Kilosort4 calls `name`
/// (`n_chan_bin` → `--n-channels`), or `None` when no flag sets it.
pub fn cli_flag(name: &str) -> Option<&'static str> {
    Some(match name {
        "n_chan_bin" | "n_channels" | "nSavedChans" => "--n-channels",
        "fs" => "--fs",
        "dtype" => "--dtype",
        "offset" => "--offset",
        "scale" => "--scale",
        "shift" => "--shift",
        "tmin" => "--tmin",
        "tmax" => "--tmax",
        "batch_size" => "--batch-size",
        "highpass_cutoff" => "--highpass-cutoff",
        "whitening_range" => "--whitening-range",
        "nskip" => "--nskip",
        "do_CAR" | "do_car" => "--do-car",
        "artifact_threshold" => "--artifact-threshold",
        "Th_universal" | "th_universal" => "--th-universal",
        "dmin" => "--dmin",
        "dminx" => "--dminx",
        "min_template_size" => "--min-template-size",
        "template_sizes" => "--template-sizes",
        "nearest_chans" => "--nearest-chans",
        "nearest_templates" => "--nearest-templates",
        "max_channel_distance" => "--max-channel-distance",
        "Th_single_ch" | "th_single_ch" => "--th-single-ch",
        "n_templates" => "--n-templates",
        "n_pcs" => "--n-pcs",
        _ => return None,
    })
}

/// How an error names a setting: its command-line flag (`--n-channels`) when
/// one sets it, else `` setting `name` ``.
pub fn setting_label(name: &str) -> String {
    match cli_flag(name) {
        Some(flag) => flag.to_string(),
        None => format!("setting `{name}`"),
    }
}

/// `n` and `word`, plural when `n` ≠ 1: `count(1, "window")` = `1 window`,
/// `count(3, "window")` = `3 windows`.
pub fn count(n: impl Into<u128>, word: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

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
    /// A setting is out of range (shown with its command-line flag).
    #[error("{}: {message}", setting_label(name))]
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
    /// A GPU back end could not be used or failed during a window.
    #[error("GPU: {message}")]
    Device {
        /// What failed, naming the device.
        message: String,
    },
}

/// Errors raised while opening or reading a recording. Every variant names the
/// file (or the setting) and carries the numbers needed to fix the input.
#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    /// The file could not be opened, mapped or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// The data size is not a whole number of frames (one sample of every channel).
    #[error(
        "{path}: {data_bytes} data bytes (file size {file_bytes} minus offset {offset}) is not a multiple of the frame size {frame_bytes} bytes ({n_channels} channels × {itemsize} bytes of {dtype}): {remainder} bytes are left over: the file looks truncated (a recording or copy cut short) unless the channel count, dtype or offset is wrong; channel counts that divide the data evenly near {n_channels}: {nearest}"
    )]
    Size {
        /// The file.
        path: PathBuf,
        /// Size of the whole file, bytes.
        file_bytes: u64,
        /// Header bytes skipped before the data.
        offset: u64,
        /// Bytes after the offset.
        data_bytes: u64,
        /// Sample type name (`int16`, ...).
        dtype: &'static str,
        /// Bytes per value of `dtype`.
        itemsize: u64,
        /// Channel count in force.
        n_channels: u64,
        /// `n_channels × itemsize`.
        frame_bytes: u64,
        /// `data_bytes mod frame_bytes`.
        remainder: u64,
        /// Nearest channel counts that divide the data evenly, as text (e.g. `63, 65`).
        nearest: String,
    },
    /// A metadata file (SpikeGLX `.meta`, Open Ephys `structure.oebin`, ...) is
    /// missing a field or has a value that cannot be used.
    #[error("{path}: field `{field}`: {message}")]
    Meta {
        /// The metadata file.
        path: PathBuf,
        /// The field, spelled as in the file.
        field: String,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// The recording path given does not exist.
    #[error("no such file or folder: {path}")]
    NotFound {
        /// The path given.
        path: PathBuf,
    },
    /// A companion file (e.g. the `.meta` beside a SpikeGLX `.bin`) is missing.
    #[error("{path}: {message}")]
    Missing {
        /// The file that was expected.
        path: PathBuf,
        /// Why it is needed.
        message: String,
    },
    /// A setting given by the user contradicts the file or its metadata.
    #[error("{path}: {}: {message}", setting_label(setting))]
    Setting {
        /// The file (or the first file) concerned.
        path: PathBuf,
        /// The setting's name (Kilosort4's where it has one).
        setting: &'static str,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// A read outside the recording or with inconsistent buffer sizes.
    #[error("{what}: {message}")]
    Read {
        /// The recording (its description).
        what: String,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// Probe geometry derived from metadata is invalid.
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// The read-ahead thread stopped without a result (it panicked).
    #[error("the window read-ahead thread stopped unexpectedly: {0}")]
    Loader(String),
}

/// Errors raised by preprocessing (channel mean, median CAR, high-pass,
/// whitening and the whitening fit).
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// A setting is out of range (shown with its command-line flag).
    #[error("{}: {message}", setting_label(name))]
    Setting {
        /// Kilosort4's name of the setting.
        name: &'static str,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// A window (or another array) does not have the shape the step expects.
    #[error("{what} has shape {rows} × {cols}, expected {expected_rows} × {expected_cols}")]
    Shape {
        /// Which array.
        what: &'static str,
        /// Rows received.
        rows: usize,
        /// Columns received.
        cols: usize,
        /// Rows expected.
        expected_rows: usize,
        /// Columns expected.
        expected_cols: usize,
    },
    /// The probe does not fit the other inputs.
    #[error("probe: {message}")]
    Probe {
        /// What is wrong, with the numbers.
        message: String,
    },
    /// The recording has no window at all, so nothing can be fitted.
    #[error("cannot fit the whitening matrix: the recording has {}", count(*n_windows, "window"))]
    NoWindows {
        /// The number of windows reported by the caller.
        n_windows: u64,
    },
    /// The whitening covariance holds a NaN or an infinity (bad input data).
    #[error(
        "whitening covariance entry ({row}, {col}) is {value}, not finite; the input windows hold NaN or infinite samples"
    )]
    NonFiniteCovariance {
        /// Row of the first bad entry.
        row: usize,
        /// Column of the first bad entry.
        col: usize,
        /// The entry.
        value: f64,
    },
    /// The eigen-decomposition of a neighbourhood covariance failed.
    #[error(
        "eigen-decomposition of the {size} × {size} covariance around channel {channel} did not converge"
    )]
    Eigen {
        /// The channel (row of the whitening matrix) being computed.
        channel: usize,
        /// Size of its neighbourhood.
        size: usize,
    },
}
