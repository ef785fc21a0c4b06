//! Flag groups shared by the subcommands that read recordings. Each setting is
//! the kebab-case form of Kilosort4's name, with Kilosort4's default.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::builder::TypedValueParser;
use spikecube::pipeline::Checks;
use spikecube::preprocess::PreprocessSettings;
use spikecube::recording::{Dtype, OpenOptions, Opened};
use spikecube::{DetectionSettings, Probe};

/// Which recording to read and how (flat binary needs the first three).
#[derive(Debug, Clone, clap::Args)]
pub struct RecordingArgs {
    /// Channels in a flat binary file (Kilosort4's n_chan_bin); checked against
    /// the metadata of SpikeGLX / Open Ephys recordings.
    #[arg(long)]
    pub n_channels: Option<u64>,
    /// Sampling rate of a flat binary file, Hz.
    #[arg(allow_negative_numbers = true, long)]
    pub fs: Option<f64>,
    /// Sample type of a flat binary file: int16, uint16, int32 or float32 (Kilosort4's data_dtype).
    #[arg(long, default_value = "int16", value_parser = parse_dtype)]
    pub dtype: Dtype,
    /// Bytes to skip at the start of a flat binary file.
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// Multiply raw values by this (Kilosort4's scale); a non-zero number.
    #[arg(allow_negative_numbers = true, long, value_parser = parse_scale)]
    pub scale: Option<f32>,
    /// Add this to raw values after scaling (Kilosort4's shift).
    #[arg(allow_negative_numbers = true, long)]
    pub shift: Option<f32>,
    /// Start of the time range to process, seconds (Kilosort4's tmin).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.0)]
    pub tmin: f64,
    /// End of the time range, seconds, exclusive (Kilosort4's tmax).
    #[arg(allow_negative_numbers = true, long, default_value_t = f64::INFINITY)]
    pub tmax: f64,
    /// Probe file: Kilosort JSON, probeinterface JSON, .prb (read as data) or a
    /// SpikeGLX .meta. Default: the geometry in the recording's SpikeGLX metadata.
    #[arg(long)]
    pub probe: Option<PathBuf>,
}

fn parse_scale(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v != 0.0 => Ok(v),
        Ok(v) => Err(format!(
            "{v} would make every sample 0 or non-finite; give a finite, non-zero factor"
        )),
        Err(e) => Err(format!("{s:?} is not a number ({e})")),
    }
}

fn parse_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::parse(s)
        .ok_or_else(|| format!("unknown dtype {s:?}; use int16, uint16, int32 or float32"))
}

impl RecordingArgs {
    /// How to read the recording.
    pub fn open_options(&self) -> OpenOptions {
        OpenOptions {
            n_channels: self.n_channels,
            fs: self.fs,
            dtype: self.dtype,
            offset: self.offset,
            scale: self.scale,
            shift: self.shift,
            tmin: self.tmin,
            tmax: self.tmax,
            ..OpenOptions::default()
        }
    }
}

/// Opens the recording(s) (several files are concatenated in time) and settles
/// the probe and the input checks ([`spikecube::pipeline::open_for_detection`]).
pub fn open_input(
    rec: &RecordingArgs,
    checks: &CheckArgs,
    recs: &[PathBuf],
) -> Result<(Opened, Probe, Checks)> {
    let req = spikecube::pipeline::InputRequest {
        paths: recs.to_vec(),
        open: rec.open_options(),
        probe: rec.probe.as_deref().map(Probe::load).transpose()?,
        probe_hint: "--probe",
        exclude_channels: checks.exclude_channels.clone(),
        mask_clipped: checks.mask_clipped,
        keep_boundary_duplicates: checks.keep_boundary_duplicates,
    };
    spikecube::pipeline::open_for_detection(&req)
}

/// Preprocessing settings (Kilosort4's names).
#[derive(Debug, Clone, clap::Args)]
pub struct PreprocessArgs {
    /// Own samples per window (Kilosort4's batch_size).
    #[arg(long, default_value_t = 60_000)]
    pub batch_size: usize,
    /// High-pass cutoff, Hz (Kilosort4's highpass_cutoff).
    #[arg(allow_negative_numbers = true, long, default_value_t = 300.0)]
    pub highpass_cutoff: f64,
    /// Sites in each channel's local whitening (Kilosort4's whitening_range).
    #[arg(long, default_value_t = 32)]
    pub whitening_range: usize,
    /// Every nskip-th window enters the whitening covariance (Kilosort4's nskip).
    #[arg(long, default_value_t = 25)]
    pub nskip: usize,
    /// Median common reference across channels (Kilosort4's do_CAR).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub do_car: bool,
    /// Zero a window whose high-passed values reach this (Kilosort4's artifact_threshold; default: never).
    #[arg(allow_negative_numbers = true, long)]
    pub artifact_threshold: Option<f64>,
}

impl PreprocessArgs {
    /// The settings, with `fs` from the recording.
    pub fn settings(&self, fs: f64) -> PreprocessSettings {
        PreprocessSettings {
            fs,
            batch_size: self.batch_size,
            highpass_cutoff: self.highpass_cutoff,
            whitening_range: self.whitening_range,
            nskip: self.nskip,
            do_car: self.do_car,
            artifact_threshold: self.artifact_threshold,
            ..PreprocessSettings::default()
        }
    }
}

/// Detection settings (Kilosort4's names).
#[derive(Debug, Clone, clap::Args)]
pub struct DetectionArgs {
    /// Detection threshold on the best filter output (Kilosort4's Th_universal).
    #[arg(allow_negative_numbers = true, long, default_value_t = 9.0)]
    pub th_universal: f32,
    /// Vertical site pitch, µm (Kilosort4's dmin; default: the median spacing).
    #[arg(allow_negative_numbers = true, long)]
    pub dmin: Option<f64>,
    /// Horizontal site pitch, µm (Kilosort4's dminx).
    #[arg(allow_negative_numbers = true, long, default_value_t = 32.0)]
    pub dminx: f64,
    /// Smallest spatial template size, µm (Kilosort4's min_template_size).
    #[arg(allow_negative_numbers = true, long, default_value_t = 10.0)]
    pub min_template_size: f64,
    /// Number of spatial sizes (Kilosort4's template_sizes).
    #[arg(long, default_value_t = 5)]
    pub template_sizes: usize,
    /// Sites per template centre (Kilosort4's nearest_chans).
    #[arg(long, default_value_t = 10)]
    pub nearest_chans: usize,
    /// Centres compared in the neighbour max (Kilosort4's nearest_templates).
    #[arg(long, default_value_t = 100)]
    pub nearest_templates: usize,
    /// Drop template centres farther than this from every site, µm (Kilosort4's max_channel_distance).
    #[arg(allow_negative_numbers = true, long, default_value_t = 32.0)]
    pub max_channel_distance: f64,
    /// Keep each centre's neighbour centres on its own shank (spikecube's; false = Kilosort4's rule).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub separate_shanks: bool,
    /// Take iC.npy, iC2.npy and weigh.npy (Kilosort4's neighbourhoods, from its
    /// ops) from this folder: Kilosort4 orders equally distant sites by numpy's
    /// CPU-dependent unstable sort, spikecube by index (for exact comparisons).
    #[arg(long, value_name = "DIR")]
    pub neighbourhoods: Option<std::path::PathBuf>,
}

impl DetectionArgs {
    /// The settings.
    pub fn settings(&self) -> DetectionSettings {
        DetectionSettings {
            th_universal: self.th_universal,
            dmin: self.dmin,
            dminx: self.dminx,
            min_template_size: self.min_template_size,
            template_sizes: self.template_sizes,
            nearest_chans: self.nearest_chans,
            nearest_templates: self.nearest_templates,
            max_channel_distance: self.max_channel_distance,
            separate_shanks: self.separate_shanks,
            neighbourhoods: self.neighbourhoods.clone(),
            ..DetectionSettings::default()
        }
    }
}

/// The default output folder: `spikecube/` beside a recording file, or inside a
/// recording folder (Open Ephys).
pub fn default_out(rec: &Path) -> Result<PathBuf> {
    let meta = std::fs::metadata(rec).with_context(|| format!("cannot read {}", rec.display()))?;
    Ok(if meta.is_dir() {
        rec.join("spikecube")
    } else {
        match rec.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.join("spikecube"),
            _ => PathBuf::from("spikecube"),
        }
    })
}

/// A progress bar on standard error, hidden when quiet or not a terminal.
pub fn progress_bar(quiet: bool) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    let bar = if quiet || !std::io::stderr().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(0)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} windows  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .expect("valid template"),
    );
    bar
}

/// `--backend`: where detection runs. Only the back ends this build has are offered.
#[derive(Debug, clap::Args)]
pub struct BackendArg {
    /// Where the work runs (preprocessing and detection; in `sort` also the
    /// template matching and the clusterings' seeding): auto (CUDA if an
    /// NVIDIA driver is present, else a wgpu GPU, else the CPU), cpu, or a GPU
    /// back end this build has (see `spikecube info`). Every back end gives
    /// the same spikes and units.
    #[arg(long, default_value = "auto", value_parser = clap::builder::PossibleValuesParser::new(spikecube::backend::Backend::compiled()).map(|s| parse_backend(&s)))]
    pub backend: spikecube::backend::Backend,
}

fn parse_backend(s: &str) -> spikecube::backend::Backend {
    use spikecube::backend::Backend;
    match s {
        "cpu" => Backend::Cpu,
        "cuda" => Backend::Cuda,
        "wgpu" => Backend::Wgpu,
        _ => Backend::Auto,
    }
}

/// Input checks and corrections beyond Kilosort4 (README, "Where spikecube differs").
#[derive(Debug, Clone, clap::Args)]
pub struct CheckArgs {
    /// Leave out these file channels (columns of the raw file, comma-separated),
    /// e.g. dead, bridged or saturated channels named by the channel check
    /// (the role of Kilosort4's bad_channels).
    #[arg(long, value_delimiter = ',')]
    pub exclude_channels: Vec<u64>,
    /// Replace stuck (clipped) stretches by the channel's median before
    /// filtering (false: Kilosort4's behaviour).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub mask_clipped: bool,
    /// Keep both detections of an event that straddles a window boundary, as
    /// Kilosort4 does (default: keep the larger).
    #[arg(long)]
    pub keep_boundary_duplicates: bool,
    /// Stimulus / light artifact times, seconds from the start of the file: a
    /// .npy array, or a text or CSV file whose first column holds the times
    /// (a first line that does not start with a number is a header and
    /// skipped; other columns, e.g. labels, are ignored; with ; between
    /// columns a comma is a decimal mark; a line whose time is not a number is
    /// an error naming it). The preprocessed data of every site are set to
    /// zero over --artifact-window around each (Kilosort4 has no such step).
    #[arg(long, value_name = "FILE")]
    pub artifact_times: Option<PathBuf>,
    /// Stretch set to zero around each artifact: milliseconds before and after
    /// it (a transient's first and last sample).
    #[arg(long, value_name = "MS_BEFORE,MS_AFTER", default_value = "0.5,2", value_parser = parse_window, allow_hyphen_values = true)]
    pub artifact_window: (f64, f64),
    /// Also zero the preprocessed data around transients common to most
    /// channels (found in every run and warned about either way).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub blank_transients: bool,
}

fn parse_window(s: &str) -> Result<(f64, f64), String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let ms = |p: &str| {
        p.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("{p:?} is not a non-negative number of milliseconds"))
    };
    match parts.as_slice() {
        [b, a] => {
            let (b, a) = (ms(b)?, ms(a)?);
            if b + a > 0.0 {
                Ok((b, a))
            } else {
                Err("both sides are 0: nothing would be blanked".into())
            }
        }
        _ => Err(format!(
            "{s:?}: give MS_BEFORE,MS_AFTER, e.g. 0.5,2 (milliseconds before and after each event)"
        )),
    }
}

impl CheckArgs {
    /// The blanking these flags ask for on `rec` (`None`: none), with its
    /// warnings added to `warnings` ([`spikecube::preprocess::blanking::blanking_for`]).
    ///
    /// # Errors
    /// A times file that cannot be read or parsed, or holds no time inside the
    /// recording.
    pub fn blanking(
        &self,
        rec: &dyn spikecube::recording::Recording,
        warnings: &mut Vec<String>,
    ) -> Result<Option<std::sync::Arc<spikecube::preprocess::Blanking>>> {
        spikecube::preprocess::blanking::blanking_for(
            rec,
            self.artifact_times
                .as_deref()
                .map(spikecube::preprocess::blanking::TimesSource::File),
            self.artifact_window,
            self.blank_transients,
            warnings,
        )
    }
}
