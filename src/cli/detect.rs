//! `spikecube detect`: a recording to spikes on disk.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use spikecube::error::count;
use spikecube::output::RunInfo;
use spikecube::pipeline::{DetectJob, run_detection};

use super::common::{
    BackendArg, CheckArgs, DetectionArgs, PreprocessArgs, RecordingArgs, default_out, open_input,
    progress_bar,
};

/// Flags of `detect`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The recording: a SpikeGLX .bin (its .meta beside it), an Open Ephys folder
    /// or structure.oebin, or a flat binary file (with --n-channels, --fs, --dtype).
    /// Several files are read one after the other as one recording.
    #[arg(required = true)]
    recording: Vec<PathBuf>,
    /// Output folder. Default: spikecube/ (detect) or spikecube_sort/ (sort) beside the
    /// recording (inside an Open Ephys folder).
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    backend: BackendArg,
    /// Where a GPU back end preprocesses (channel means, median CAR, high-pass,
    /// whitening): on the device, from the raw window as read (default), or on
    /// the host, as the CPU back end does (for comparisons). The CPU back end
    /// always preprocesses on the host.
    #[arg(long, default_value = "device", value_parser = ["device", "host"])]
    preprocess_on: String,
    /// Print a machine-readable summary (JSON) on standard output.
    #[arg(long)]
    pub(super) json: bool,
    #[command(flatten)]
    rec: RecordingArgs,
    #[command(flatten)]
    pre: PreprocessArgs,
    #[command(flatten)]
    det: DetectionArgs,
    #[command(flatten)]
    checks: CheckArgs,
    #[command(flatten)]
    templates: super::templates::TemplateArgs,
    #[command(flatten)]
    drift: super::drift::DriftArgs,
    /// CPU worker threads (preprocessing and detection on the CPU; in `sort`
    /// also the clusterings, merges and export). Default: the
    /// RAYON_NUM_THREADS environment variable, else one per core. The output
    /// is the same for any number.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

/// A speed as × realtime: one decimal, two decimals below 1 (a
/// software GPU runs at a few hundredths of realtime).
pub(super) fn speed(x: f64) -> String {
    if x < 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.1}")
    }
}

/// Refuses `--threads 0`.
fn check_threads(threads: Option<usize>) -> Result<()> {
    if threads == Some(0) {
        anyhow::bail!("--threads 0: give at least 1 thread (or leave it out for one per core)");
    }
    Ok(())
}

/// Starts the global thread pool with `--threads` (the size every parallel step uses).
pub(super) fn start_threads(threads: Option<usize>) -> Result<()> {
    check_threads(threads)?;
    if let Some(n) = threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| anyhow::anyhow!("--threads {n}: cannot start the thread pool: {e}"))?;
    }
    Ok(())
}

/// Opens the recording and builds the detection job the flags ask for
/// (shared by `detect` and `sort`).
pub(super) fn build_job(
    args: &Args,
    quiet: bool,
    command: &str,
    task: Option<spikecube::provenance::Task>,
) -> Result<DetectJob> {
    start_threads(args.threads)?;
    job_of(args, quiet, command, task)
}

/// The detection job of `args` for checking, as `spikecube batch plan` checks
/// each task: the recording opened (its metadata, not its samples) and every
/// flag turned into settings as [`build_job`] does, without starting the
/// thread pool or printing anything.
pub(super) fn job_to_check(args: &Args, command: &str) -> Result<DetectJob> {
    check_threads(args.threads)?;
    job_of(args, true, command, None)
}

/// [`build_job`] after the thread pool is started.
fn job_of(
    args: &Args,
    quiet: bool,
    command: &str,
    task: Option<spikecube::provenance::Task>,
) -> Result<DetectJob> {
    let (opened, probe, mut checks) = open_input(&args.rec, &args.checks, &args.recording)?;
    let rec = opened.recording.clone();
    checks.blanking = args.checks.blanking(rec.as_ref(), &mut checks.warnings)?;
    let out = match &args.out {
        Some(o) => o.clone(),
        None => {
            let d = default_out(&args.recording[0])?;
            if command == "detect" {
                d
            } else {
                d.with_file_name(format!("spikecube_{command}"))
            }
        }
    };
    let fs = rec.fs();
    let (dat_path, more_dat_paths) = spikecube::recording::raw_data_files(&args.recording);
    let run_info = RunInfo {
        input_description: rec.describe(),
        dat_path,
        more_dat_paths,
        n_channels_dat: rec.n_channels() as u64,
        dtype: opened.dtype.name().into(),
        offset: opened.offset,
        hp_filtered: false,
        task,
        ..RunInfo::default()
    };
    if !quiet {
        tell!(
            "spikecube: {} — {} sites, probe {}",
            rec.describe(),
            probe.n_sites(),
            probe.source.display()
        );
    }
    let mut detection = args.det.settings();
    let templates = args.templates.apply(&mut detection)?;
    Ok(DetectJob {
        recording: rec,
        probe,
        detection,
        templates,
        preprocess: args.pre.settings(fs),
        out,
        run_info,
        backend: args.backend.backend,
        checks,
        drift: args.drift.settings()?,
        device_preprocessing: args.preprocess_on == "device",
        last_device_use: true,
        scratch: false,
        keep_windows: None,
    })
}

pub fn run(args: Args, quiet: bool) -> Result<ExitCode> {
    run_task(args, quiet, None)
}

/// Checks `detect ARGS` as the run would before reading any sample
/// ([`spikecube::pipeline::check_job`]); returns its warnings so far.
pub fn check(args: &Args) -> Result<Vec<String>> {
    spikecube::pipeline::check_job(job_to_check(args, "detect")?)
}

/// `detect`, as line `task` of a `spikecube batch` run when given (recorded in
/// spikecube.json's provenance).
pub fn run_task(
    args: Args,
    quiet: bool,
    task: Option<spikecube::provenance::Task>,
) -> Result<ExitCode> {
    let job = build_job(&args, quiet, "detect", task)?;
    let bar = progress_bar(quiet);
    let report = run_detection(job, &mut |p| {
        bar.set_length(p.windows_total);
        bar.set_position(p.windows_done);
        let rt = p.seconds_done / p.elapsed.max(1e-9);
        bar.set_message(if p.first_pass {
            format!("first pass (drift estimate)  {rt:.1}× realtime")
        } else {
            format!("{} spikes  {rt:.1}× realtime", p.spikes)
        });
    })?;
    bar.finish_and_clear();
    let s = &report.summary;
    if args.json {
        let v = serde_json::json!({
            "out": s.path,
            "spikes": s.n_spikes,
            "windows": report.n_windows,
            "seconds": report.seconds,
            "wall_s": report.wall,
            "realtime": report.seconds / report.wall.max(1e-9),
            "template_centres": report.n_centres,
            "time_sorted": s.time_sorted,
            "boundary_duplicates_removed": report.boundary_duplicates_removed,
            "clipped_samples_masked": report.clipped_samples_masked,
            "scale_factor": report.scale_factor,
            "warnings": report.warnings,
        });
        say!("{v}");
    } else if !quiet {
        tell!(
            "spikecube: {} in {:.1} s of recording ({}, {}) in {:.1} s, {}× realtime → {}",
            count(s.n_spikes, "spike"),
            report.seconds,
            count(report.n_windows, "window"),
            count(report.n_centres as u64, "template centre"),
            report.wall,
            speed(report.seconds / report.wall.max(1e-9)),
            s.path.display()
        );
        if report.boundary_duplicates_removed > 0 || report.clipped_samples_masked > 0 {
            tell!(
                "spikecube: {} boundary duplicates removed, {} clipped samples masked",
                report.boundary_duplicates_removed,
                report.clipped_samples_masked
            );
        }
    }
    // Warnings are not progress: listed again at the end, and under -q those
    // not already shown as they happened.
    let listed = super::shown::to_list(&report.warnings, quiet);
    if !args.json && !listed.is_empty() {
        tell!("spikecube: {} warning(s):", listed.len());
        for w in listed {
            tell!("  warning: {w}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
