//! Recording readers and windows: flat binary, SpikeGLX, Open Ephys; Kilosort4 batching.
//!
//! * [`open`] / [`open_many`] pick a reader from the path (and [`OpenOptions`]) and
//!   return an [`Opened`] recording, with a [`Probe`] when the metadata describes
//!   the geometry (SpikeGLX).
//! * Every reader memory-maps its file (int16 files are read with positional
//!   reads on unix) and converts samples to `f32` only when a window is read
//!   ([`Recording::read_channels`]). Sample indices are `u64`
//!   throughout, so recordings longer than 2³¹ samples work.
//! * [`WindowPlan`] and [`read_window`] cut windows exactly as Kilosort4 4.1.7
//!   cuts its batches (edge repeat, dropped short tail); [`WindowLoader`] reads
//!   them ahead on a thread.
//!
//! Sample numbering: a [`Recording`] counts its samples `0..n_samples()`
//! (relative to `tmin`). [`Recording::first_sample`] is the absolute index in the
//! file (or in the concatenation of files) of relative sample 0; every
//! [`Window`] reports absolute indices.

mod binary;
mod concat;
pub mod np_parts;
pub mod openephys;
pub mod ordered;
mod probe_file;
pub mod spikeglx;
mod window;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use binary::BinaryRecording;
pub use concat::{
    ConcatRecording, JUNCTION_EDGE, JUNCTION_NOISE, JUNCTION_STEP_SDS, junction_warnings,
};
pub use ordered::read_in_order;
pub use window::{
    Raw16, Raw16Buffer, Window, WindowLoader, WindowPlan, gives_int16, read_window, read_window_i16,
};

use crate::error::RecordingError;
use crate::probe::Probe;

/// Sample type of a flat binary file (little-endian). Kilosort4's `data_dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// Signed 16-bit (`int16`), Kilosort4's default.
    #[default]
    Int16,
    /// Unsigned 16-bit (`uint16`); a value v is read as `v − 32768` (exact in f32).
    Uint16,
    /// Signed 32-bit (`int32`), converted to the nearest f32.
    Int32,
    /// 32-bit float (`float32`).
    Float32,
}

impl Dtype {
    /// Bytes per value.
    pub fn itemsize(self) -> u64 {
        match self {
            Dtype::Int16 | Dtype::Uint16 => 2,
            Dtype::Int32 | Dtype::Float32 => 4,
        }
    }

    /// numpy's name (`int16`, `uint16`, `int32`, `float32`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Int16 => "int16",
            Dtype::Uint16 => "uint16",
            Dtype::Int32 => "int32",
            Dtype::Float32 => "float32",
        }
    }

    /// Parses numpy's names (`int16`, `<i2`, `i2`, `uint16`, `<u2`, `int32`, `<i4`,
    /// `float32`, `<f4`, `single`); `None` for anything else.
    pub fn parse(s: &str) -> Option<Dtype> {
        match s.trim().trim_start_matches(['<', '=']) {
            "int16" | "i2" | "short" => Some(Dtype::Int16),
            "uint16" | "u2" | "ushort" => Some(Dtype::Uint16),
            "int32" | "i4" => Some(Dtype::Int32),
            "float32" | "f4" | "single" => Some(Dtype::Float32),
            _ => None,
        }
    }
}

/// A multichannel recording: `n_samples()` frames of `n_channels()` values.
///
/// Implementations are cheap to share between threads (`Send + Sync`); reads take
/// `&self`.
pub trait Recording: Send + Sync {
    /// Channels (columns) per frame in the file: Kilosort4's `n_chan_bin`.
    fn n_channels(&self) -> usize;
    /// Samples available, after `tmin`/`tmax` and after ignoring any partial frame.
    fn n_samples(&self) -> u64;
    /// Sampling rate, Hz (non-integer rates allowed).
    fn fs(&self) -> f64;
    /// Absolute index (in the file, or in the concatenation of files) of relative
    /// sample 0; `floor(tmin·fs)` for a single file opened with `tmin`.
    fn first_sample(&self) -> u64;
    /// Reads relative samples `start .. start + count` of the file columns
    /// `chan_map` into `out`, row-major `chan_map.len() × count` (row i = column
    /// `chan_map[i]`), converted to f32 with `scale`/`shift` applied.
    ///
    /// # Errors
    /// [`RecordingError::Read`] when the range passes `n_samples()`, a column is
    /// not below `n_channels()` or `out` has the wrong length.
    fn read_channels(
        &self,
        start: u64,
        count: usize,
        chan_map: &[u64],
        out: &mut [f32],
    ) -> Result<(), RecordingError>;
    /// Reads as [`Recording::read_channels`] does, but as the file's int16
    /// values unchanged, into rows of `stride` values: row i (file column
    /// `chan_map[i]`) in `out[i·stride .. i·stride + count]` (a
    /// window goes to the GPU as it lies in the file, with no float copy).
    ///
    /// Returns `Ok(false)`, leaving `out` alone, when the recording's values
    /// are not int16 read unchanged (another dtype, a `scale` or `shift`, a
    /// read across files); the caller then uses [`Recording::read_channels`].
    ///
    /// # Errors
    /// As [`Recording::read_channels`]; also when `stride < count` or `out`
    /// does not hold `chan_map.len()` rows of `stride`.
    fn read_channels_i16(
        &self,
        start: u64,
        count: usize,
        chan_map: &[u64],
        out: &mut [i16],
        stride: usize,
    ) -> Result<bool, RecordingError> {
        let _ = (start, count, chan_map, out, stride);
        Ok(false)
    }
    /// One line naming the file(s), dtype, channels, samples and rate, for messages.
    fn describe(&self) -> String;
}

/// [`raw_data_file`] of each of a recording's files, in order: the first
/// (Phy's `dat_path`) and the others (concatenated after it). An empty list
/// gives an empty path and no others.
pub fn raw_data_files<P: AsRef<Path>>(recs: &[P]) -> (PathBuf, Vec<PathBuf>) {
    let mut all = recs.iter().map(|p| raw_data_file(p.as_ref()));
    (all.next().unwrap_or_default(), all.collect())
}

/// The file holding a recording's raw samples, as an absolute path (for Phy's
/// `params.py`, `dat_path`): `continuous.dat` of the first stream for an Open
/// Ephys folder or `structure.oebin`, the path itself otherwise (also when the
/// Open Ephys metadata cannot be read).
pub fn raw_data_file(rec: &Path) -> PathBuf {
    let abs = std::fs::canonicalize(rec).unwrap_or_else(|_| rec.to_path_buf());
    let is_oe = abs.is_dir() || abs.extension().is_some_and(|e| e == "oebin");
    if is_oe
        && let Ok(oebin) = openephys::find_oebin(&abs)
        && let Ok(text) = std::fs::read_to_string(&oebin)
        && let Ok(parsed) = openephys::parse_oebin_text(&text, &oebin)
        && let (Some(stream), Some(dir)) = (parsed.streams.first(), oebin.parent())
    {
        return dir
            .join("continuous")
            .join(&stream.folder_name)
            .join("continuous.dat");
    }
    abs
}

/// Checks the arguments of [`Recording::read_channels`] against a recording's size.
pub(crate) fn check_read(
    rec: &dyn Recording,
    start: u64,
    count: usize,
    chan_map: &[u64],
    out_len: usize,
) -> Result<(), RecordingError> {
    let err = |message: String| RecordingError::Read {
        what: rec.describe(),
        message,
    };
    let end = start.checked_add(count as u64);
    if end.is_none_or(|e| e > rec.n_samples()) {
        return Err(err(format!(
            "read of {count} samples from sample {start} passes the end ({} samples)",
            rec.n_samples()
        )));
    }
    if let Some(&c) = chan_map.iter().find(|&&c| c >= rec.n_channels() as u64) {
        return Err(err(format!(
            "channel map entry {c} is not below the file's {} channels",
            rec.n_channels()
        )));
    }
    if chan_map.len().checked_mul(count) != Some(out_len) {
        return Err(err(format!(
            "output buffer holds {out_len} values, expected {} channels × {count} samples",
            chan_map.len()
        )));
    }
    Ok(())
}

/// Checks the arguments of [`Recording::read_channels_i16`]: as
/// [`check_read`], with rows of `stride ≥ count` values.
pub(crate) fn check_read_strided(
    rec: &dyn Recording,
    start: u64,
    count: usize,
    chan_map: &[u64],
    out_len: usize,
    stride: usize,
) -> Result<(), RecordingError> {
    if stride < count {
        return Err(RecordingError::Read {
            what: rec.describe(),
            message: format!("rows of {stride} values cannot hold {count} samples"),
        });
    }
    // The range and the columns; the size is checked for rows of `stride`.
    check_read(rec, start, count, chan_map, chan_map.len() * count)?;
    if chan_map.len().checked_mul(stride) != Some(out_len) {
        return Err(RecordingError::Read {
            what: rec.describe(),
            message: format!(
                "output buffer holds {out_len} values, expected {} rows × {stride}",
                chan_map.len()
            ),
        });
    }
    Ok(())
}

/// Which reader to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// Choose from the path: a folder or `.oebin` → Open Ephys; a file with a
    /// `.meta` beside it → SpikeGLX; anything else → flat binary.
    #[default]
    Auto,
    /// Flat headerless binary; needs `n_channels` and `fs`.
    Binary,
    /// SpikeGLX `.bin` with its `.meta`.
    SpikeGlx,
    /// Open Ephys binary format (`structure.oebin`).
    OpenEphys,
}

/// How to open a recording. Field names follow Kilosort4's settings where it has them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OpenOptions {
    /// Reader to use.
    pub format: Format,
    /// Channels in the file (Kilosort4: `n_chan_bin`). Required for flat binary; for
    /// SpikeGLX / Open Ephys it must agree with the metadata if given.
    pub n_channels: Option<u64>,
    /// Sampling rate, Hz. Required for flat binary; for SpikeGLX / Open Ephys the
    /// metadata's rate is used and a disagreeing value is reported with a warning.
    pub fs: Option<f64>,
    /// Sample type of a flat binary file (Kilosort4: `data_dtype`). SpikeGLX and
    /// Open Ephys files are always int16.
    pub dtype: Dtype,
    /// Bytes to skip at the start of every file (a header), flat binary only.
    pub offset: u64,
    /// Multiply every value by this (Kilosort4: `scale`); applied before `shift`.
    pub scale: Option<f32>,
    /// Add this to every value after `scale` (Kilosort4: `shift`).
    pub shift: Option<f32>,
    /// Start of the time range, seconds (Kilosort4: `tmin`); sample `floor(tmin·fs)`.
    pub tmin: f64,
    /// End of the time range, seconds, exclusive (Kilosort4: `tmax`); `inf` for the end.
    pub tmax: f64,
    /// Open Ephys stream (folder or stream name); the first stream when `None`.
    pub stream: Option<String>,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            format: Format::Auto,
            n_channels: None,
            fs: None,
            dtype: Dtype::Int16,
            offset: 0,
            scale: None,
            shift: None,
            tmin: 0.0,
            tmax: f64::INFINITY,
            stream: None,
        }
    }
}

/// An opened recording and what its metadata says about it.
pub struct Opened {
    /// The samples (shared, so a [`WindowLoader`] thread can read them).
    pub recording: Arc<dyn Recording>,
    /// Probe geometry from SpikeGLX metadata (`None` for other formats, or when the
    /// metadata does not describe it; a warning says why).
    pub probe: Option<Probe>,
    /// Open Ephys: microvolts per count of each channel (`bit_volts`).
    pub bit_volts: Option<Vec<f64>>,
    /// Open Ephys: the acquisition's sample number of the file's first sample
    /// (`sample_numbers.npy[0]`), when that file exists. Window and spike indices do
    /// not include it.
    pub first_sample_number: Option<i64>,
    /// The sample type the file was read as: int16 for SpikeGLX and Open Ephys
    /// whatever [`OpenOptions::dtype`] asked, the asked one for flat binary.
    /// Outputs that describe the raw file (Phy's `params.py`) must name this.
    pub dtype: Dtype,
    /// Header bytes skipped at the start of the file: 0 for SpikeGLX and Open
    /// Ephys, [`OpenOptions::offset`] for flat binary.
    pub offset: u64,
    /// What opening found worth a warning (a partial last frame, a size the
    /// metadata contradicts, a rate that differs from the one given, …), one
    /// line each naming the file: a run adds them to its warnings, which are
    /// printed once and kept in `spikecube.json`.
    pub warnings: Vec<String>,
}

impl Opened {
    /// Warnings for a `--dtype` or `--offset` in `asked` that the file's format
    /// overrode (`path` is the recording as given): the samples were read as
    /// [`Opened::dtype`] from byte [`Opened::offset`], and the outputs that
    /// describe the raw file say so.
    pub fn overridden(&self, asked: &OpenOptions, path: &Path) -> Vec<String> {
        let mut w = Vec::new();
        if asked.dtype != self.dtype {
            w.push(format!(
                "--dtype {} was given but {} holds {} samples (its format's only type); they were read as {}, and params.py says so",
                asked.dtype.name(),
                path.display(),
                self.dtype.name(),
                self.dtype.name()
            ));
        }
        if asked.offset != self.offset {
            w.push(format!(
                "--offset {} was given but {} has no header to skip (only flat binary files take --offset); it was read from byte {}",
                asked.offset,
                path.display(),
                self.offset
            ));
        }
        w
    }
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("recording", &self.recording.describe())
            .field("probe", &self.probe.as_ref().map(|p| p.n_sites()))
            .field("first_sample_number", &self.first_sample_number)
            .finish()
    }
}

thread_local! {
    /// Warnings of the [`open`] or [`open_many`] running on this thread.
    static OPEN_WARNINGS: std::cell::RefCell<Option<Vec<String>>> = const { std::cell::RefCell::new(None) };
}

/// A fact about a file being opened that deserves a warning: kept for
/// [`Opened::warnings`] while [`open`] or [`open_many`] runs on this thread,
/// else logged at once.
pub(crate) fn open_warning(message: String) {
    let unclaimed = OPEN_WARNINGS.with_borrow_mut(|w| match w {
        Some(list) => {
            list.push(message);
            None
        }
        None => Some(message),
    });
    if let Some(m) = unclaimed {
        tracing::warn!("{m}");
    }
}

/// Runs `f` with this thread's opening warnings collected: its result and
/// the warnings.
pub(crate) fn with_warning_sink<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    let outer = OPEN_WARNINGS.with_borrow_mut(|w| w.replace(Vec::new()));
    let result = f();
    let found = OPEN_WARNINGS
        .with_borrow_mut(|w| std::mem::replace(w, outer))
        .unwrap_or_default();
    (result, found)
}

/// Runs `f` with this thread's opening warnings collected, and puts them in
/// its [`Opened`].
fn collecting_warnings(
    f: impl FnOnce() -> Result<Opened, RecordingError>,
) -> Result<Opened, RecordingError> {
    let (result, mut found) = with_warning_sink(f);
    result.map(|mut opened| {
        found.append(&mut opened.warnings);
        opened.warnings = found;
        opened
    })
}

/// Opens one recording; see [`Format::Auto`] for how the reader is chosen.
///
/// # Errors
/// [`RecordingError`] naming the file: missing settings (`n_channels`, `fs` for
/// flat binary), sizes that are not whole frames (flat binary), metadata that is
/// missing, unreadable or contradicts the settings, an empty `tmin`/`tmax` range.
pub fn open(path: &Path, opts: &OpenOptions) -> Result<Opened, RecordingError> {
    collecting_warnings(|| {
        let base = open_untrimmed(path, opts)?;
        let rec = trim(base.recording, path, opts)?;
        Ok(Opened {
            recording: rec,
            ..base
        })
    })
}

/// Opens several files of one recording, concatenated in time (all the same
/// format, channel count and rate). The probe and Open Ephys facts come from the
/// first file; `tmin`/`tmax` apply to the concatenation.
///
/// # Errors
/// As [`open`], and [`RecordingError::Setting`] when the files differ in channel
/// count or rate, or when `paths` is empty.
pub fn open_many(paths: &[PathBuf], opts: &OpenOptions) -> Result<Opened, RecordingError> {
    let Some(first_path) = paths.first() else {
        return Err(RecordingError::Setting {
            path: PathBuf::new(),
            setting: "files",
            message: "no recording files given".into(),
        });
    };
    if paths.len() == 1 {
        return open(first_path, opts);
    }
    collecting_warnings(|| {
        let first = open_untrimmed(first_path, opts)?;
        let mut parts = vec![first.recording.clone()];
        for p in &paths[1..] {
            parts.push(open_untrimmed(p, opts)?.recording);
        }
        let cat: Arc<dyn Recording> = Arc::new(ConcatRecording::new(parts, paths)?);
        let rec = trim(cat, first_path, opts)?;
        Ok(Opened {
            recording: rec,
            ..first
        })
    })
}

fn open_untrimmed(path: &Path, opts: &OpenOptions) -> Result<Opened, RecordingError> {
    if let Err(e) = std::fs::metadata(path)
        && e.kind() == std::io::ErrorKind::NotFound
    {
        return Err(RecordingError::NotFound {
            path: path.to_owned(),
        });
    }
    let format = match opts.format {
        Format::Auto => {
            if path.is_dir() || path.extension().is_some_and(|e| e == "oebin") {
                Format::OpenEphys
            } else if path.with_extension("meta").is_file() {
                Format::SpikeGlx
            } else {
                Format::Binary
            }
        }
        f => f,
    };
    match format {
        Format::OpenEphys => openephys::open(path, opts),
        Format::SpikeGlx => spikeglx::open(path, opts),
        _ => {
            let n_channels = opts.n_channels.ok_or_else(|| RecordingError::Setting {
                path: path.to_owned(),
                setting: "n_chan_bin",
                message: format!(
                    "no such file {} (its SpikeGLX metadata), nor an Open Ephys structure.oebin, so it is read as a flat binary file, which needs the number of channels in the file (--n-channels) and the sampling rate (--fs)",
                    path.with_extension("meta").display()
                ),
            })?;
            let fs = opts.fs.ok_or_else(|| RecordingError::Setting {
                path: path.to_owned(),
                setting: "fs",
                message: "a flat binary file needs the sampling rate in Hz (--fs)".into(),
            })?;
            let rec = BinaryRecording::open(
                path,
                &binary::BinaryParams {
                    n_channels,
                    fs,
                    dtype: opts.dtype,
                    offset: opts.offset,
                    scale: opts.scale,
                    shift: opts.shift,
                    partial_frame: binary::PartialFrame::Error,
                },
            )?;
            Ok(Opened {
                recording: Arc::new(rec),
                probe: None,
                bit_volts: None,
                first_sample_number: None,
                dtype: opts.dtype,
                offset: opts.offset,
                warnings: Vec::new(),
            })
        }
    }
}

/// Restricts a recording to `[floor(tmin·fs), min(floor(tmax·fs), n))`.
fn trim(
    rec: Arc<dyn Recording>,
    path: &Path,
    opts: &OpenOptions,
) -> Result<Arc<dyn Recording>, RecordingError> {
    let (tmin, tmax) = (opts.tmin, opts.tmax);
    let bad = |message: String| RecordingError::Setting {
        path: path.to_owned(),
        setting: "tmin",
        message,
    };
    if !(tmin.is_finite() && tmin >= 0.0) || tmax.is_nan() || tmax <= tmin {
        return Err(bad(format!(
            "tmin = {tmin} s and tmax = {tmax} s do not make a range: need 0 ≤ tmin < tmax"
        )));
    }
    if tmin == 0.0 && tmax == f64::INFINITY {
        return Ok(rec);
    }
    let n = rec.n_samples();
    let fs = rec.fs();
    let start = ((tmin * fs).floor() as u64).min(n);
    let end = if tmax.is_finite() {
        let asked = (tmax * fs).floor();
        if asked > n as f64 {
            open_warning(format!(
                "tmax = {tmax} s is past the end of {} ({:.6} s): the run stops at the end",
                path.display(),
                n as f64 / fs
            ));
        }
        (asked as u64).min(n)
    } else {
        n
    };
    if end <= start {
        return Err(bad(format!(
            "tmin = {tmin} s, tmax = {tmax} s select samples [{start}, {end}) of {n} at fs = {fs} Hz: no samples; the recording lasts {:.6} s",
            n as f64 / fs
        )));
    }
    Ok(Arc::new(concat::TimeSlice::new(rec, start, end - start)))
}

/// Channel counts near `n` that divide `data_bytes` into whole frames of
/// `itemsize`-byte values: up to two below and two above `n`, as text.
pub fn nearest_channel_counts(data_bytes: u64, itemsize: u64, n: u64) -> String {
    let fits = |c: u64| c > 0 && data_bytes.is_multiple_of(c * itemsize);
    let below: Vec<u64> = (1..n).rev().filter(|&c| fits(c)).take(2).collect();
    let limit = n.saturating_mul(4).max(n + 1024).min(1 << 20);
    let above: Vec<u64> = (n + 1..=limit).filter(|&c| fits(c)).take(2).collect();
    let mut all: Vec<u64> = below.into_iter().rev().chain(above).collect();
    all.sort_unstable();
    if all.is_empty() {
        "none".into()
    } else {
        all.iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Checks the user's channel count and rate against a recording's metadata
/// (`n_field`/`fs_field`: the metadata's own names for them, e.g. `nSavedChans`).
/// A different channel count is an error (the file's layout cannot change: field
/// failure BR-13); a different rate is a warning and the metadata's rate is used.
///
/// # Errors
/// [`RecordingError::Setting`] when `opts.n_channels` disagrees with `n`.
pub(crate) fn check_against_metadata(
    opts: &OpenOptions,
    data: &Path,
    meta: &Path,
    (n_field, n): (&str, u64),
    (fs_field, fs): (&str, f64),
) -> Result<(), RecordingError> {
    if let Some(asked) = opts.n_channels
        && asked != n
    {
        return Err(RecordingError::Setting {
            path: data.to_owned(),
            setting: "n_chan_bin",
            message: format!(
                "{asked} channels requested but {} says {n_field} = {n}; the channel count of the file cannot be changed, exclude channels through the probe instead",
                meta.display()
            ),
        });
    }
    if let Some(asked) = opts.fs
        && (asked - fs).abs() > 1e-9 * fs
    {
        open_warning(format!(
            "{}: fs = {asked} Hz was given but {fs_field} is {fs} Hz; using the metadata's rate",
            meta.display()
        ));
    }
    Ok(())
}
