//! `spikecube preprocess`: Kilosort4's preprocessing of a whole recording, written
//! out for inspection or for other tools.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use spikecube::error::count;
use spikecube::pipeline::WhitenedFormat;
use spikecube::preprocess_folder::write_preprocess_folder;

use super::common::{CheckArgs, PreprocessArgs, RecordingArgs, open_input, progress_bar};

/// Flags of `preprocess`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The recording (as for `detect`); several files are read as one.
    #[arg(required = true)]
    recording: Vec<PathBuf>,
    /// Output folder: whitening_mat.npy, hp_filter.npy, temp_wh.dat and spikecube.json.
    /// An existing folder is replaced only when it is an earlier `preprocess` result.
    #[arg(long)]
    out: PathBuf,
    /// Write temp_wh.dat as float32 instead of int16 holding 200 × the whitened value.
    #[arg(long)]
    float32: bool,
    #[command(flatten)]
    rec: RecordingArgs,
    #[command(flatten)]
    pre: PreprocessArgs,
    #[command(flatten)]
    checks: CheckArgs,
}

pub fn run(args: Args, quiet: bool) -> Result<ExitCode> {
    let (opened, probe, mut checks) = open_input(&args.rec, &args.checks, &args.recording)?;
    let rec = opened.recording.clone();
    checks.blanking = args.checks.blanking(rec.as_ref(), &mut checks.warnings)?;
    let settings = args.pre.settings(rec.fs());
    let bar = progress_bar(quiet);
    let format = if args.float32 {
        WhitenedFormat::Float32
    } else {
        WhitenedFormat::Int16x200
    };
    let (_, report) = write_preprocess_folder(
        rec.clone(),
        &probe,
        &settings,
        format,
        &args.out,
        &checks,
        &mut |p| {
            bar.set_length(p.windows_total);
            bar.set_position(p.windows_done);
            bar.set_message(format!(
                "{:.1}× realtime",
                p.seconds_done / p.elapsed.max(1e-9)
            ));
        },
    )?;
    bar.finish_and_clear();
    if !quiet {
        tell!(
            "spikecube: {} × {} whitened ({}, {}) in {:.1} s → {}",
            count(report.n_samples, "sample"),
            count(report.n_sites as u64, "channel"),
            count(report.n_windows, "window"),
            if args.float32 {
                "float32"
            } else {
                "int16 ×200"
            },
            report.wall,
            args.out.join("temp_wh.dat").display()
        );
    }
    // Warnings are not progress: listed again at the end, and under -q those
    // not already shown as they happened.
    let listed = super::shown::to_list(&report.warnings, quiet);
    if !listed.is_empty() {
        tell!("spikecube: {} warning(s):", listed.len());
        for w in listed {
            tell!("  warning: {w}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
