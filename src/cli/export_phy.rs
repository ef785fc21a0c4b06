//! `spikecube export-phy` (hidden): the CCG-gated merges and the Phy folder
//! from Kilosort4's own arrays (a folder written by
//! `tests/data/sort/make_sort_fixtures.py`), for checking the export against
//! Kilosort4 and for the Phy and SpikeInterface reader tests.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use spikecube::Probe;
use spikecube::sort::ks_arrays;
use spikecube::sort::phy;

/// Flags of `export-phy`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Folder of Kilosort4's arrays (ops.npz, extract_out.npz, final_out.npz[, merge_out.npz]).
    #[arg(long)]
    from_npz: PathBuf,
    /// Probe file (Kilosort JSON or probeinterface JSON) the arrays were sorted with.
    #[arg(long)]
    probe: PathBuf,
    /// Output folder (created; an existing one is replaced only when it is an
    /// earlier `export-phy` result).
    #[arg(long)]
    out: PathBuf,
    /// Start from Kilosort4's merged arrays (merge_out.npz): no merges here.
    #[arg(long)]
    merged: bool,
    /// Raw recording written into params.py (default: the settings' filename).
    #[arg(long)]
    dat_path: Option<PathBuf>,
}

pub fn run(args: Args, quiet: bool) -> Result<ExitCode> {
    let probe = Probe::load(&args.probe)?;
    let ks = ks_arrays::load(&args.from_npz)
        .with_context(|| format!("--from-npz {}", args.from_npz.display()))?;
    let mut settings = ks.settings;
    if let Some(p) = args.dat_path {
        settings.dat_path = vec![p];
    }
    let manifest = serde_json::json!({
        "source": args.from_npz.display().to_string(),
        "version": env!("CARGO_PKG_VERSION"),
        "merged_by": if args.merged { "Kilosort4" } else { "spikecube" },
    });
    let summary = if args.merged {
        let merged = ks.merged.with_context(|| {
            format!("--merged: {} has no merge_out.npz", args.from_npz.display())
        })?;
        let r = ks.result;
        phy::write_phy(
            &args.out,
            merged,
            r.wpca.view(),
            r.wrot.view(),
            &r.sets,
            &probe,
            &settings,
            manifest,
            "export-phy",
        )?
    } else {
        phy::save_sorting(
            &args.out,
            ks.result,
            &probe,
            &settings,
            manifest,
            "export-phy",
        )?
    };
    if !quiet {
        say!(
            "{} units ({} good), {} spikes ({} duplicates removed), {} merges → {}",
            summary.n_units,
            summary.n_good,
            summary.n_spikes,
            summary.n_duplicates,
            summary.n_merges,
            summary.path.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
