//! `spikecube sort`: a recording to a Phy folder (Kilosort4's whole sort).

use std::process::ExitCode;

use anyhow::Result;
use spikecube::sort::run::{SortJob, SortSettings, run_sort};

use super::common::progress_bar;
use super::detect::speed;

/// Flags of the stages after detection (Kilosort4's setting names).
#[derive(Debug, clap::Args)]
pub struct SortArgs {
    /// `Th_learned`: a learned-template spike needs relu(B)²/‖U‖² above its square.
    #[arg(long, default_value_t = 8.0)]
    th_learned: f64,
    /// `max_peels`: rounds of the matching pursuit per window.
    #[arg(long, default_value_t = 100)]
    max_peels: usize,
    /// `position_limit`, µm: sites within this of a spike's site count for its position.
    #[arg(long, default_value_t = 100.0)]
    position_limit: f64,
    /// `cluster_downsampling`: every N-th spike of a group is a landmark of the neighbour graph.
    #[arg(long, default_value_t = 20)]
    cluster_downsampling: usize,
    /// `max_cluster_subset`: at most this many landmarks per group (0: no limit).
    #[arg(long, default_value_t = 25_000)]
    max_cluster_subset: usize,
    /// `cluster_neighbors`: neighbours (landmarks) per spike in the graph.
    #[arg(long, default_value_t = 10)]
    cluster_neighbors: usize,
    /// `cluster_init_seed`: seed of the clusters' seeding, used afresh in every group.
    #[arg(long, default_value_t = 5)]
    cluster_init_seed: u64,
    /// `duplicate_spike_ms`: spikes of one unit closer than this are duplicates, ms.
    #[arg(long, default_value_t = 0.25)]
    duplicate_spike_ms: f64,
    /// `acg_threshold`: a unit is `good` when its autocorrelogram's R12 is below it.
    #[arg(long, default_value_t = 0.2)]
    acg_threshold: f64,
    /// `ccg_threshold`: two units merge when their cross-correlogram's R12 is below it.
    #[arg(long, default_value_t = 0.25)]
    ccg_threshold: f64,
    /// Reproduce Kilosort4 4.1.5–4.1.7's `swarmsplitter.check_CCG` guard, which
    /// switches the refractory test inside the final clustering's tree off
    /// (Kilosort issue #1042). Off by default: spikecube runs the intended test.
    #[arg(long)]
    ks4_swarm_ccg_bug: bool,
}

impl SortArgs {
    fn settings(&self, nearest_chans: usize) -> SortSettings {
        let mut s = SortSettings::kilosort();
        s.matching.th_learned = self.th_learned;
        s.matching.max_peels = self.max_peels;
        s.matching.position_limit = self.position_limit;
        s.matching.nearest_chans = nearest_chans;
        s.clustering.cluster_downsampling = self.cluster_downsampling;
        s.clustering.max_cluster_subset =
            (self.max_cluster_subset > 0).then_some(self.max_cluster_subset);
        s.clustering.cluster_neighbors = self.cluster_neighbors;
        s.clustering.cluster_init_seed = self.cluster_init_seed;
        s.clustering.ks4_swarm_ccg_bug = self.ks4_swarm_ccg_bug;
        s.duplicate_spike_ms = self.duplicate_spike_ms;
        s.acg_threshold = self.acg_threshold;
        s.ccg_threshold = self.ccg_threshold;
        s
    }
}

/// Flags of `sort`: those of `detect`, then those of the later stages.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    detect: super::detect::Args,
    #[command(flatten)]
    sort: SortArgs,
}

pub fn run(args: Args, quiet: bool) -> Result<ExitCode> {
    run_task(args, quiet, None)
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
    if !args.detect.json && !report.warnings.is_empty() {
        tell!("spikecube: {} warning(s):", report.warnings.len());
        for w in &report.warnings {
            tell!("  warning: {w}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
