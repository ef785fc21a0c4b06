//! `spikecube simulate`: writes a synthetic SpikeGLX-style recording with ground truth.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use spikecube::Probe;
use spikecube::simulate::{DriftModel, SimConfig, default_probe, simulate};

/// Flags of `simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Probe file (Kilosort JSON, probeinterface JSON or .prb). Default: a
    /// Neuropixels 2.0-like single shank, 384 sites, x ∈ {0, 32} µm, rows every 15 µm.
    #[arg(long)]
    probe: Option<PathBuf>,
    /// Length of the recording, seconds.
    #[arg(allow_negative_numbers = true, long)]
    seconds: f64,
    /// Output folder (created if missing): sim_g0_t0.imec0.ap.bin/.meta,
    /// ground_truth.npy, ground_truth_units.npy, probe.json.
    #[arg(long)]
    out: PathBuf,
    /// Sample rate, Hz.
    #[arg(allow_negative_numbers = true, long, default_value_t = 30_000.0)]
    fs: f64,
    /// Number of units.
    #[arg(long, default_value_t = 30)]
    n_units: usize,
    /// Mean firing rate per unit, Hz.
    #[arg(allow_negative_numbers = true, long, default_value_t = 5.0)]
    rate: f64,
    /// Seed of the random draws (same seed, same file).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Noise standard deviation, counts.
    #[arg(allow_negative_numbers = true, long, default_value_t = 10.0)]
    noise_sd: f32,
    /// Units move relative to the probe: `rigid` (all depths alike) or
    /// `nonrigid` (the top moves 9× as much as the bottom). Defaults: 40 µm
    /// linear over the recording, a 20 µm step at 60 % of it, a 10 µm sinusoid
    /// of a third of its length (change them with the flags below). The true
    /// motion is written to drift_truth.npy (+ _times, _depths), µm, positive up.
    #[arg(long, value_enum)]
    drift: Option<DriftKind>,
    /// Linear drift over the whole recording, µm (with --drift).
    #[arg(allow_negative_numbers = true, long, requires = "drift")]
    drift_linear: Option<f64>,
    /// Size of the step, µm (with --drift).
    #[arg(allow_negative_numbers = true, long, requires = "drift")]
    drift_step: Option<f64>,
    /// Time of the step, seconds (with --drift).
    #[arg(allow_negative_numbers = true, long, requires = "drift")]
    drift_step_at: Option<f64>,
    /// Amplitude of the sinusoid, µm (with --drift).
    #[arg(allow_negative_numbers = true, long, requires = "drift")]
    drift_sine: Option<f64>,
    /// Period of the sinusoid, seconds (with --drift).
    #[arg(allow_negative_numbers = true, long, requires = "drift")]
    drift_period: Option<f64>,
}

/// Kind of simulated motion.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum DriftKind {
    /// Every unit moves alike.
    Rigid,
    /// Motion grows with depth.
    Nonrigid,
}

pub fn run(args: Args, quiet: bool) -> Result<ExitCode> {
    let probe = match &args.probe {
        Some(p) => Probe::load(p)?,
        None => default_probe(),
    };
    let cfg = SimConfig {
        seconds: args.seconds,
        fs: args.fs,
        n_units: args.n_units,
        rate_hz: args.rate,
        seed: args.seed,
        noise_sd: args.noise_sd,
        drift: args.drift.map(|k| {
            let mut d = match k {
                DriftKind::Rigid => DriftModel::rigid(args.seconds),
                DriftKind::Nonrigid => DriftModel::nonrigid(args.seconds),
            };
            d.linear_um = args.drift_linear.unwrap_or(d.linear_um);
            d.step_um = args.drift_step.unwrap_or(d.step_um);
            d.step_at_s = args.drift_step_at.unwrap_or(d.step_at_s);
            d.sine_um = args.drift_sine.unwrap_or(d.sine_um);
            d.sine_period_s = args.drift_period.unwrap_or(d.sine_period_s);
            d
        }),
        ..SimConfig::default()
    };
    let t0 = Instant::now();
    let s = simulate(&probe, &cfg, &args.out)
        .with_context(|| format!("simulating into {}", args.out.display()))?;
    let dt = t0.elapsed().as_secs_f64();
    if quiet {
        return Ok(ExitCode::SUCCESS);
    }
    say!(
        "{}: {} channels × {} samples ({:.1} s), {} spikes from {} units; {:.1} MB in {:.2} s ({:.0}× realtime)",
        s.bin_path.display(),
        s.n_channels,
        s.n_samples,
        args.seconds,
        s.n_spikes,
        s.units.len(),
        s.file_bytes as f64 / 1e6,
        dt,
        args.seconds / dt.max(1e-9)
    );
    Ok(ExitCode::SUCCESS)
}
