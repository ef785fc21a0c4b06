//! The whitening fit of `spikecube detect` on its own (Kilosort4's
//! `get_whitening_matrix` over every `nskip`-th window, with spikecube's input
//! checks): wall time and each part's busy seconds, as medians.
//!
//! `cargo bench --bench whitening_fit` simulates a 384-channel SpikeGLX
//! recording (`spikecube simulate`'s defaults) of 26 s (13 windows) in a
//! temporary folder and fits W on 12 of its windows (`nskip` = 1), the count
//! the fit reads from a 10-minute recording with Kilosort4's `nskip` = 25.
//! Settings, by environment:
//!
//! * `SPIKECUBE_BENCH_RECORDING`: a SpikeGLX `.bin` (its `.meta` beside it) to
//!   use instead of a simulation;
//! * `SPIKECUBE_BENCH_SECONDS`: seconds to simulate (default 26);
//! * `SPIKECUBE_BENCH_NSKIP`: `nskip` (default 1);
//! * `SPIKECUBE_BENCH_RUNS`: rounds (default 3, after one warm-up run);
//! * `SPIKECUBE_BENCH_THREADS`: rayon threads (default: `RAYON_NUM_THREADS`,
//!   else one per core).
//!
//! Four schedules of the same fit run interleaved, `RUNS` rounds: before
//! the fit's speed work (one step at a time, faer's full `X·Xᵀ` on all
//! threads, a new buffer per window read), then with the changes added one
//! by one (`FitOptions`; the last is the default). All must give the same W:
//! its FNV-1a hash is printed for each.
//!
//! The process's CPU seconds (user + system) are printed beside the wall
//! time: on a machine shared with other work they vary less.
//!
//! Parts (busy seconds summed over the windows; they overlap in time): `read`
//! and `checks` (on the reading thread), `invert`, `car`, `highpass`,
//! `artifact`, `product` (with the f64 copy), `sum`, `zca`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use spikecube::Probe;
use spikecube::pipeline::{Checks, fit_whitening_with};
use spikecube::preprocess::{FitOptions, PreprocessSettings};
use spikecube::recording::{OpenOptions, Recording, open};
use spikecube::simulate::{SimConfig, default_probe, simulate};

mod common;
use common::median;

fn env<T: std::str::FromStr>(name: &str, default: T) -> Result<T> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name}={v}: not a valid value")),
        Err(_) => Ok(default),
    }
}

struct Run {
    wall: f64,
    /// CPU seconds of the process (user + system) during the run.
    cpu: f64,
    parts: BTreeMap<String, f64>,
    w_bits: u64,
}

/// User + system CPU seconds of this process so far (NaN where unknown).
#[cfg(unix)]
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return f64::NAN;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

#[cfg(not(unix))]
fn cpu_seconds() -> f64 {
    f64::NAN
}

fn one_run(
    rec: &Arc<dyn Recording>,
    probe: &Probe,
    settings: &PreprocessSettings,
    options: FitOptions,
) -> Result<Run> {
    let cpu0 = cpu_seconds();
    let t = Instant::now();
    let fit = fit_whitening_with(rec, probe, settings, &Checks::default(), options)?;
    let wall = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    // FNV-1a of W's bits: equal across runs, thread counts and versions.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in fit.whitening.iter() {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    Ok(Run {
        wall,
        cpu,
        parts: fit
            .times
            .0
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect(),
        w_bits: h,
    })
}

fn main() -> Result<()> {
    let seconds: f64 = env("SPIKECUBE_BENCH_SECONDS", 26.0)?;
    let nskip: usize = env("SPIKECUBE_BENCH_NSKIP", 1usize)?.max(1);
    let n_runs: usize = env("SPIKECUBE_BENCH_RUNS", 3usize)?.max(1);
    let threads: usize = env("SPIKECUBE_BENCH_THREADS", 0usize)?;
    if threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()?;
    }
    let tmp = tempfile::tempdir()?;
    let bin: PathBuf = match std::env::var("SPIKECUBE_BENCH_RECORDING") {
        Ok(p) => PathBuf::from(p),
        Err(_) => {
            let cfg = SimConfig {
                seconds,
                ..SimConfig::default()
            };
            eprintln!("simulating {seconds} s of a 384-channel recording …");
            simulate(&default_probe(), &cfg, tmp.path())?.bin_path
        }
    };
    let opened = open(&bin, &OpenOptions::default())?;
    let probe: Probe = opened
        .probe
        .context("the recording's .meta must hold the probe geometry (a SpikeGLX .bin)")?;
    let rec = opened.recording;
    let settings = PreprocessSettings {
        nskip,
        ..PreprocessSettings::default()
    };
    let n_windows = rec.n_samples().div_ceil(settings.batch_size as u64);
    let used = spikecube::preprocess::covariance_windows(n_windows, nskip as u64).len();
    println!(
        "{}: {} sites, {used} windows in the fit (nskip {nskip}), {} rayon threads, {n_runs} runs",
        bin.display(),
        probe.n_sites(),
        rayon::current_num_threads()
    );
    let plain = FitOptions::plain();
    let variants = [
        (
            "before: one step at a time, plain product, new buffers",
            plain,
        ),
        (
            "fast product",
            FitOptions {
                fast_product: true,
                ..plain
            },
        ),
        (
            "fast product, pipelined",
            FitOptions {
                fast_product: true,
                pipelined: true,
                ..plain
            },
        ),
        (
            "after: fast product, pipelined, reused buffers",
            FitOptions::default(),
        ),
    ];
    one_run(&rec, &probe, &settings, FitOptions::default())?; // warm-up: page cache
    // Runs interleaved (variant by variant, round by round) so that a change
    // of the machine's load touches every variant alike.
    let mut runs: Vec<Vec<Run>> = variants.iter().map(|_| Vec::new()).collect();
    for _ in 0..n_runs {
        for (v, (_, options)) in variants.iter().enumerate() {
            runs[v].push(one_run(&rec, &probe, &settings, *options)?);
        }
    }
    let hash = runs[0][0].w_bits;
    for ((name, _), runs) in variants.iter().zip(&runs) {
        let same = runs.iter().all(|r| r.w_bits == hash);
        let wall = median(runs.iter().map(|r| r.wall).collect());
        let cpu = median(runs.iter().map(|r| r.cpu).collect());
        println!(
            "{name}: median wall {wall:.3} s ({:.1} ms per window), CPU {cpu:.2} s, W hash {:016x}{}",
            wall * 1e3 / used as f64,
            runs[0].w_bits,
            if same { "" } else { " — W DIFFERS" }
        );
        let parts: Vec<String> = runs[0]
            .parts
            .keys()
            .filter_map(|k| {
                let m = median(
                    runs.iter()
                        .map(|r| r.parts.get(k).copied().unwrap_or(f64::NAN))
                        .collect(),
                );
                (m >= 0.0005).then(|| format!("{k} {m:.2}"))
            })
            .collect();
        println!("    busy s: {}", parts.join(", "));
    }
    Ok(())
}
