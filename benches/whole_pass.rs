//! The whole detection pass of `spikecube detect` (whitening fit, read,
//! preprocessing, detection, writing the output folder) on one recording,
//! repeated: × realtime and the per-stage busy seconds, as medians.
//!
//! `cargo bench --bench whole_pass` simulates a 384-channel SpikeGLX recording
//! (`spikecube simulate`'s defaults) in a temporary folder and runs the pass
//! `RUNS` times from the page cache (after one warm-up run), then `RUNS` times
//! with the file's pages dropped from the page cache first (`posix_fadvise`
//! `POSIX_FADV_DONTNEED`; how much of the file stayed cached anyway is printed,
//! as the OS may keep pages another process holds). Settings, by environment:
//!
//! * `SPIKECUBE_BENCH_RECORDING`: a SpikeGLX `.bin` (its `.meta` beside it) to
//!   use instead of a simulation;
//! * `SPIKECUBE_BENCH_SECONDS`: seconds to simulate (default 60);
//! * `SPIKECUBE_BENCH_RUNS`: runs per mode (default 3);
//! * `SPIKECUBE_BENCH_THREADS`: rayon threads (default: `RAYON_NUM_THREADS`,
//!   else one per core);
//! * `SPIKECUBE_BENCH_BACKEND`: `cpu` (default), `auto`, `cuda`, `wgpu` (the
//!   GPU ones when compiled in);
//! * `SPIKECUBE_BENCH_COLD`: `0` skips the dropped-cache runs.
//!
//! The per-stage figures are the `timings_s` of each run's `spikecube.json`:
//! busy seconds per stage (stages overlap, so they add up to more than the
//! wall time), `stages_wall` and `overlap` (their sum over the wall time).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use spikecube::backend::Backend;
use spikecube::output::RunInfo;
use spikecube::pipeline::{Checks, DetectJob, run_detection};
use spikecube::preprocess::PreprocessSettings;
use spikecube::recording::{OpenOptions, open};
use spikecube::simulate::{SimConfig, default_probe, simulate};
use spikecube::{DetectionSettings, Probe};

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

/// Drops the file's pages from the page cache (after writing back dirty
/// ones) and returns the fraction still resident, when the OS says.
#[cfg(target_os = "linux")]
fn drop_cached_pages(path: &Path) -> Result<Option<f64>> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    f.sync_all().ok();
    // SAFETY: a valid open descriptor; the call only gives advice to the kernel.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Ok(None);
    }
    Ok(resident_fraction(&f))
}

#[cfg(not(target_os = "linux"))]
fn drop_cached_pages(_path: &Path) -> Result<Option<f64>> {
    Ok(None)
}

/// Fraction of the file's pages in the page cache (`mincore` on a mapping).
#[cfg(target_os = "linux")]
fn resident_fraction(f: &std::fs::File) -> Option<f64> {
    let map = unsafe { memmap2::Mmap::map(f) }.ok()?;
    if map.is_empty() {
        return None;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let n = map.len().div_ceil(page);
    let mut vec = vec![0u8; n];
    // SAFETY: the mapping is live for the call and `vec` has one byte per page.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            vec.as_mut_ptr(),
        )
    };
    (rc == 0).then(|| vec.iter().filter(|&&b| b & 1 == 1).count() as f64 / n as f64)
}

struct Run {
    wall: f64,
    seconds: f64,
    timings: BTreeMap<String, f64>,
}

fn one_run(bin: &Path, probe: &Probe, backend: Backend, out: &Path) -> Result<Run> {
    let opened = open(bin, &OpenOptions::default())?;
    let t = Instant::now();
    let report = run_detection(
        DetectJob {
            recording: opened.recording.clone(),
            probe: probe.clone(),
            detection: DetectionSettings::default(),
            preprocess: PreprocessSettings::default(),
            out: out.to_path_buf(),
            run_info: RunInfo::default(),
            checks: Checks::default(),
            backend,
            // One detection pass with the built-in templates (Kilosort4's
            // `templates_from_data = False`, `nblocks = 0`), unless
            // SPIKECUBE_BENCH_DEFAULTS is set: then learned templates and drift
            // correction, as `spikecube detect` does by default.
            templates: if std::env::var_os("SPIKECUBE_BENCH_DEFAULTS").is_some() {
                spikecube::universal::TemplateSource::Learned(Default::default())
            } else {
                spikecube::universal::TemplateSource::Builtin
            },
            drift: if std::env::var_os("SPIKECUBE_BENCH_DEFAULTS").is_some() {
                spikecube::drift::DriftSettings::default()
            } else {
                spikecube::drift::DriftSettings::off()
            },
            device_preprocessing: true,
            last_device_use: false,
            scratch: false,
            keep_windows: None,
        },
        &mut |_| {},
    )?;
    let wall = t.elapsed().as_secs_f64();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json"))?)?;
    let timings = json["timings_s"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                .collect()
        })
        .unwrap_or_default();
    Ok(Run {
        wall,
        seconds: report.seconds,
        timings,
    })
}

fn summarise(mode: &str, runs: &[Run]) {
    if runs.is_empty() {
        return;
    }
    let rt = median(runs.iter().map(|r| r.seconds / r.wall).collect());
    let wall = median(runs.iter().map(|r| r.wall).collect());
    println!(
        "{mode}: {} runs, median wall {wall:.2} s = {rt:.1}× realtime ({:.1} s of recording)",
        runs.len(),
        runs[0].seconds
    );
    let keys: Vec<&String> = runs[0].timings.keys().collect();
    for k in keys {
        let m = median(
            runs.iter()
                .map(|r| r.timings.get(k).copied().unwrap_or(f64::NAN))
                .collect(),
        );
        let unit = if k == "overlap" { "×" } else { "s" };
        println!("  {k:<14} {m:8.2} {unit}");
    }
}

fn main() -> Result<()> {
    let seconds: f64 = env("SPIKECUBE_BENCH_SECONDS", 60.0)?;
    let n_runs: usize = env("SPIKECUBE_BENCH_RUNS", 3usize)?.max(1);
    let threads: usize = env("SPIKECUBE_BENCH_THREADS", 0usize)?;
    let cold: u8 = env("SPIKECUBE_BENCH_COLD", 1u8)?;
    let backend = match std::env::var("SPIKECUBE_BENCH_BACKEND").as_deref() {
        Err(_) | Ok("cpu") => Backend::Cpu,
        Ok("auto") => Backend::Auto,
        Ok("cuda") => Backend::Cuda,
        Ok("wgpu") => Backend::Wgpu,
        Ok(other) => bail!("SPIKECUBE_BENCH_BACKEND={other}: use cpu, auto, cuda or wgpu"),
    };
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
    let probe: Probe = open(&bin, &OpenOptions::default())?
        .probe
        .context("the recording's .meta must hold the probe geometry (a SpikeGLX .bin)")?;
    println!(
        "{}: backend {backend:?}, {} rayon threads",
        bin.display(),
        rayon::current_num_threads()
    );
    let out = tmp.path().join("out");
    one_run(&bin, &probe, backend, &out)?; // warm-up: fills the page cache
    let warm: Vec<Run> = (0..n_runs)
        .map(|_| one_run(&bin, &probe, backend, &out))
        .collect::<Result<_>>()?;
    summarise("page cache", &warm);
    if cold != 0 {
        let mut runs = Vec::new();
        let mut left = Vec::new();
        for _ in 0..n_runs {
            match drop_cached_pages(&bin)? {
                Some(f) => left.push(f),
                None => {
                    println!("dropped pages: not supported here");
                    break;
                }
            }
            runs.push(one_run(&bin, &probe, backend, &out)?);
        }
        if !runs.is_empty() {
            summarise(
                &format!(
                    "pages dropped first ({:.0} % of the file still cached after the drop)",
                    100.0 * median(left)
                ),
                &runs,
            );
        }
    }
    Ok(())
}
