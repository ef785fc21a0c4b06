//! Recall and precision of `spikecube detect` on a simulated recording with known
//! spikes, plus the whole-run speed.
//!
//! `cargo bench --bench ground_truth -- [--seconds S] [--seed N] [--dir DIR]`
//! simulates a 384-channel Neuropixels-2.0-like SpikeGLX recording (default 60 s,
//! 30 units at 5 Hz, noise sd 10 counts; `spikecube simulate`'s defaults) into DIR
//! (default a temporary folder), runs detection with default settings on the CPU,
//! and matches detections to true spikes one to one: a detection matches a true
//! spike when its trough time (detection sample − 10, Kilosort4's offset) is within
//! ±0.5 ms of the true trough and its centre's nearest site lies within 50 µm of
//! the unit. Recall = matched true spikes / true spikes; precision = matched
//! detections / detections.

use std::path::PathBuf;

use ndarray::{Array1, Array2};
use spikecube::npy;
use spikecube::output::RunInfo;
use spikecube::pipeline::{Checks, DetectJob, run_detection};
use spikecube::preprocess::PreprocessSettings;
use spikecube::recording::{OpenOptions, open};
use spikecube::simulate::{SimConfig, default_probe, simulate};
use spikecube::{DetectionSettings, Probe};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let mut seconds = 60.0;
    let mut seed = 1u64;
    let mut dir: Option<PathBuf> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => seconds = args.next().and_then(|v| v.parse().ok()).unwrap_or(seconds),
            "--seed" => seed = args.next().and_then(|v| v.parse().ok()).unwrap_or(seed),
            "--dir" => dir = args.next().map(PathBuf::from),
            _ => {}
        }
    }
    let tmp = tempfile::tempdir()?;
    let dir = dir.unwrap_or_else(|| tmp.path().to_path_buf());
    let probe = default_probe();
    let cfg = SimConfig {
        seconds,
        seed,
        ..SimConfig::default()
    };
    let sim = simulate(&probe, &cfg, &dir)?;
    let opened = open(&sim.bin_path, &OpenOptions::default())?;
    let probe: Probe = opened
        .probe
        .clone()
        .expect("the simulated .meta holds the geometry");
    let out = dir.join("spikecube");
    let report = run_detection(
        DetectJob {
            recording: opened.recording.clone(),
            probe: probe.clone(),
            detection: DetectionSettings::default(),
            preprocess: PreprocessSettings::default(),
            out: out.clone(),
            run_info: RunInfo::default(),
            checks: Checks::default(),
            backend: spikecube::backend::Backend::Cpu,
            // The default, as `spikecube detect`: learned from the data.
            templates: spikecube::universal::TemplateSource::Learned(Default::default()),
            // No drift in this simulation: one detection pass, as before.
            drift: spikecube::drift::DriftSettings::off(),
            device_preprocessing: true,
            last_device_use: false,
            scratch: false,
            keep_windows: None,
        },
        &mut |_| {},
    )?;
    let times: Array1<i64> = npy::read(&out.join("spike_times.npy"))?;
    let centres: Array1<i64> = npy::read(&out.join("spike_centers.npy"))?;
    let cc: Array2<i64> = npy::read(&out.join("center_channels.npy"))?;
    let truth: Array2<f64> = npy::read(&dir.join("ground_truth.npy"))?;
    let fs = 30_000.0;
    let tol = 0.5e-3 * fs;
    let n_det = times.len();
    let mut used = vec![false; n_det];
    let mut matched = 0usize;
    for row in truth.rows() {
        let t_true = row[0];
        // Detections are sorted by time: search the ones within tolerance.
        let lo = times
            .as_slice()
            .unwrap()
            .partition_point(|&t| ((t - 10) as f64) < t_true - tol);
        let mut best: Option<(f64, usize)> = None;
        for i in lo..n_det {
            let dt = (times[i] - 10) as f64 - t_true;
            if dt > tol {
                break;
            }
            if used[i] {
                continue;
            }
            let site = cc[[centres[i] as usize, 0]] as usize;
            let d2 =
                (probe.xc[site] as f64 - row[1]).powi(2) + (probe.yc[site] as f64 - row[2]).powi(2);
            if d2 <= 50.0 * 50.0 && best.is_none_or(|(b, _)| dt.abs() < b) {
                best = Some((dt.abs(), i));
            }
        }
        if let Some((_, i)) = best {
            used[i] = true;
            matched += 1;
        }
    }
    let recall = matched as f64 / truth.nrows() as f64;
    let precision = matched as f64 / n_det.max(1) as f64;
    println!(
        "ground_truth: {seconds} s × 384 channels, seed {seed}: {} true spikes, {n_det} detections, {matched} matched; recall {recall:.3}, precision {precision:.3}",
        truth.nrows()
    );
    println!(
        "ground_truth: whole run {:.2} s ({:.2}× realtime), {} windows, {} threads",
        report.wall,
        report.seconds / report.wall,
        report.n_windows,
        rayon::current_num_threads()
    );
    Ok(())
}
