//! `spikecube sort`: a recording to a Phy folder (Kilosort4's whole sort).

use std::process::ExitCode;

use anyhow::Result;
use spikecube::sort::run::{SortFlags, SortJob, run_sort};

use super::common::progress_bar;
use super::detect::speed;

/// Flags of `sort`: those of `detect`, then those of the later stages.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    detect: super::detect::Args,
    #[command(flatten)]
    sort: SortFlags,
}

pub fn run(args: Args, quiet: bool) -> Result<ExitCode> {
    run_task(args, quiet, None)
}

/// Checks `sort ARGS` as the run would before reading any sample
/// ([`SortJob::check`]); returns the warnings so far.
pub fn check(args: &Args) -> Result<Vec<String>> {
    let detect = super::detect::job_to_check(&args.detect, "sort")?;
    let sort = args.sort.settings(detect.detection.nearest_chans);
    SortJob { detect, sort }.check()
}

/// `sort`, as line `task` of a `spikecube batch` run when given (recorded in
/// spikecube.json's provenance).
pub fn run_task(
    args: Args,
    quiet: bool,
    task: Option<spikecube::provenance::Task>,
) -> Result<ExitCode> {
    let detect = super::detect::build_job(&args.detect, quiet, "sort", task)?;
    let sort = args.sort.settings(detect.detection.nearest_chans);
    let bar = progress_bar(quiet);
    let report = run_sort(SortJob { detect, sort }, &mut |p| {
        if p.total > 0 {
            bar.set_length(p.total);
            bar.set_position(p.done);
        }
        let rt = if p.seconds_done > 0.0 {
            format!(
                "  {}× realtime",
                speed(p.seconds_done / p.elapsed.max(1e-9))
            )
        } else {
            String::new()
        };
        let units = if p.units > 0 {
            format!("  {} units so far", p.units)
        } else {
            String::new()
        };
        bar.set_message(format!("{}{rt}{units}", p.stage));
    })?;
    bar.finish_and_clear();
    let total: f64 = report.timings.iter().map(|t| t.1).sum();
    if args.detect.json {
        let v = serde_json::json!({
            "out": report.phy.path,
            "units": report.phy.n_units,
            "good_units": report.phy.n_good,
            "spikes": report.phy.n_spikes,
            "seconds": report.seconds,
            "wall_s": total,
            "realtime": report.seconds / total.max(1e-9),
            "timings_s": report.timings.iter().map(|(k, v)| ((*k).to_string(), serde_json::json!(v)))
                .collect::<serde_json::Map<_, _>>(),
            "warnings": report.warnings,
        });
        say!("{v}");
    } else if !quiet {
        tell!(
            "spikecube: {} units ({} good), {} spikes in {:.1} s of recording, sorted in {:.1} s ({}× realtime) → {}",
            report.phy.n_units,
            report.phy.n_good,
            report.phy.n_spikes,
            report.seconds,
            total,
            speed(report.seconds / total.max(1e-9)),
            report.phy.path.display()
        );
        let split: Vec<String> = report
            .timings
            .iter()
            .map(|(k, v)| format!("{k} {v:.2} s"))
            .collect();
        tell!("spikecube: {}", split.join(", "));
    }
    // Warnings are not progress: listed again at the end, and under -q those
    // not already shown as they happened.
    let listed = super::shown::to_list(&report.warnings, quiet);
    if !args.detect.json && !listed.is_empty() {
        tell!("spikecube: {} warning(s):", listed.len());
        for w in listed {
            tell!("  warning: {w}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
