//! Cost of Kilosort4's drift correction per window: 384 sites of a
//! Neuropixels 2.0-like probe (x ∈ {0, 32} µm, rows every 15 µm), 60 122
//! samples, local whitening over 32 sites (W from a spatially decaying
//! covariance), shifts of 0, 7.5, −19.5 and 40 µm. Reports medians over N runs,
//! ms per window:
//!
//! * `W·X`: the whitening the uncorrected pass does;
//! * `G_b` build: `M_b` (kernel, `K·iKxx`), `G_b = M_b·W`, the drop of entries
//!   below `COMBINED_EPS` and the CSR form (once per window, or per distinct shift);
//! * `G_b·X`: the sparse product that replaces `W·X` (default, and exact:
//!   every non-zero, `--drift-mode kilosort`);
//! * `M_b·(W·X)`: the previous correction (a dense sgemm after whitening);
//! * CPU detection on the whitened window, for the ratio "extra cost of the
//!   correction over the uncorrected whitening / detection".
//!
//! Times are CPU ms (all threads; `WALL=1`: wall ms), as the machine the
//! figures were taken on was shared.
//!
//! Usage: `cargo bench --bench drift_correct [-- RUNS]` (default 5 runs);
//! `-- parts [RUNS]`: the parts of building `G_b` (run with `RAYON_NUM_THREADS=1`).

use std::path::PathBuf;
use std::time::Instant;

use ndarray::Array2;
use spikecube::detect::cpu::CpuDetector;
use spikecube::drift::DriftCorrection;
use spikecube::drift::correct::apply_matrix;
use spikecube::preprocess::{PreprocessSettings, Whitening, whitening_from_covariance};
use spikecube::{DetectionSettings, Geometry, Probe, UniversalTemplates};

const N_SITES: usize = 384;

fn probe() -> Probe {
    Probe {
        xc: (0..N_SITES).map(|i| 32.0 * (i % 2) as f32).collect(),
        yc: (0..N_SITES).map(|i| 15.0 * (i / 2) as f32).collect(),
        kcoords: vec![0; N_SITES],
        chan_map: (0..N_SITES as u64).collect(),
        n_chan: N_SITES as u64,
        source: PathBuf::from("synthetic NP2.0-like probe"),
    }
}

fn random_window(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
    let mut state = seed;
    Array2::from_shape_fn((rows, cols), |_| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 100.0
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// CPU time of this process's threads, ns (Linux: the first field of each
/// thread's schedstat, time on a CPU); 0 elsewhere. On a machine shared with
/// other work this is steadier than the wall time.
fn cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Median CPU ms of `runs` calls (after a warm-up); `WALL=1` in the
/// environment: wall ms instead.
fn time_runs(runs: usize, mut f: impl FnMut()) -> f64 {
    let wall = std::env::var("WALL").is_ok_and(|v| v == "1");
    f();
    median(
        (0..runs)
            .map(|_| {
                let (t, c) = (Instant::now(), cpu_ns());
                f();
                if wall {
                    t.elapsed().as_secs_f64() * 1e3
                } else {
                    (cpu_ns() - c) as f64 * 1e-6
                }
            })
            .collect(),
    )
}

/// `parts`: CPU ms of each part of building one window's `G_b` (1 thread:
/// `RAYON_NUM_THREADS=1`), each marked with where it ran before and after the
/// sixth session's changes (serial: on the calling thread; pool: spread over
/// the thread pool), for the serial milliseconds per window (docs/benchmarks-history.md,
/// "Drift: the cost of the drift step, sixth session").
fn parts(runs: usize, corr: &DriftCorrection, w: &Whitening, p: &Probe) {
    use spikecube::drift::correct::{combine, kernel2d, site_shifts};
    let b = 3; // +40 µm
    let row = corr.dshift().row(b as usize).to_vec();
    let s = site_shifts(&row, corr.yblk(), &p.yc);
    let qy: Vec<f32> =
        p.yc.iter()
            .zip(&s)
            .map(|(&y, &d)| (y as f64 - d) as f32)
            .collect();
    let m = corr.matrix(b).expect("M_b");
    let g = combine(&m, w);
    let gw = corr.window_whitening(b, w).expect("G_b");
    let rows: Vec<(&str, &str, &str, f64)> = vec![
        (
            "site shifts, targets, sites outside",
            "serial",
            "serial",
            time_runs(runs, || {
                let s = site_shifts(&row, corr.yblk(), &p.yc);
                std::hint::black_box(&s);
                std::hint::black_box(corr.sites_outside(b, 15.0).expect("outside"));
            }),
        ),
        (
            "kernel K(Q, P)",
            "serial",
            "pool",
            time_runs(runs, || {
                std::hint::black_box(kernel2d(&p.xc, &qy, &p.xc, &p.yc, 20.0));
            }),
        ),
        (
            "M_b = K·iKxx (with the kernel)",
            "pool",
            "pool",
            time_runs(runs, || {
                std::hint::black_box(corr.matrix(b).expect("M_b"));
            }),
        ),
        (
            "copy of a C × C matrix (M_b, G_b: 2 before)",
            "serial",
            "none",
            time_runs(runs, || {
                std::hint::black_box(Array2::from_shape_fn(m.dim(), |(i, j)| m[[i, j]]));
            }),
        ),
        (
            "W's CSR (in M_b·W, and the cache key)",
            "serial",
            "serial",
            time_runs(runs, || {
                std::hint::black_box(w.csr());
            }),
        ),
        (
            "M_b·W (with W's CSR)",
            "pool",
            "pool",
            time_runs(runs, || {
                std::hint::black_box(combine(&m, w));
            }),
        ),
        (
            "drop below COMBINED_EPS, CSR rows",
            "serial",
            "pool",
            time_runs(runs, || {
                std::hint::black_box(
                    Whitening::sparse_with_floor(
                        g.clone(),
                        spikecube::drift::correct::COMBINED_EPS,
                    )
                    .expect("G_b"),
                );
            }),
        ),
        (
            "copy of G_b per window (before)",
            "serial",
            "none",
            time_runs(runs, || {
                std::hint::black_box(gw.clone());
            }),
        ),
        (
            "whole build (window_whitening)",
            "-",
            "-",
            time_runs(runs, || {
                std::hint::black_box(corr.window_whitening(b, w).expect("G_b"));
            }),
        ),
    ];
    println!(
        "G_b build, CPU ms per window on {} thread(s):",
        rayon::current_num_threads()
    );
    for (name, before, after, ms) in rows {
        println!("{name:<46} {ms:7.2} ms   before: {before:<6} after: {after}");
    }
}

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5)
        .max(1);
    let settings = PreprocessSettings::default();
    let n = settings.window_len();
    let p = probe();
    let cc = Array2::from_shape_fn((N_SITES, N_SITES), |(i, j)| {
        let dx = f64::from(p.xc[i] - p.xc[j]);
        let dy = f64::from(p.yc[i] - p.yc[j]);
        400.0 * (-(dx * dx + dy * dy).sqrt() / 40.0).exp() + if i == j { 100.0 } else { 0.0 }
    });
    let w = Whitening::new(
        whitening_from_covariance(&cc, &p, settings.whitening_range).expect("whitening"),
    )
    .expect("W");
    let shifts = [0.0, 7.5, -19.5, 40.0];
    let dshift = Array2::from_shape_fn((shifts.len(), 1), |(b, _)| shifts[b]);
    let corr = DriftCorrection::new(&p.xc, &p.yc, dshift, vec![1432.5], 20.0)
        .expect("correction")
        .with_zero_outside(Some(15.0));
    let exact = corr.clone().with_exact(true);
    let raw = random_window(N_SITES, n, 0x9E37_79B9_7F4A_7C15);
    println!(
        "window {N_SITES} × {n}, {runs} runs, {} rayon threads; W: {:.1} non-zeros per row",
        rayon::current_num_threads(),
        w.nnz() as f64 / N_SITES as f64
    );
    let mut x = raw.clone();
    // Warm-up of a few seconds.
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < 3.0 {
        x.assign(&raw);
        w.apply(&mut x).expect("W·X");
    }
    let white = time_runs(runs, || {
        x.assign(&raw);
        w.apply(&mut x).expect("W·X");
    });
    // Detection (CPU) on the whitened window, for the ratio.
    let ds = DetectionSettings::default();
    let mut det = CpuDetector::new(
        Geometry::new(&p, &ds).expect("geometry"),
        UniversalTemplates::builtin(),
        ds,
    )
    .expect("detector");
    x.assign(&raw);
    w.apply(&mut x).expect("W·X");
    let detect = time_runs(runs, || {
        det.detect(x.view(), &p.yc).expect("detect");
    });
    if std::env::args().any(|a| a == "parts") {
        parts(runs, &corr, &w, &p);
        return;
    }
    let copy = time_runs(runs, || x.assign(&raw));
    println!(
        "{:<34} {:8.1} ms",
        "detection (CPU), whitened window", detect
    );
    println!("{:<34} {:8.1} ms", "copy (subtracted below)", copy);
    println!("{:<34} {:8.1} ms", "W·X", white - copy);
    for b in 0..shifts.len() as u64 {
        let build = time_runs(runs, || {
            corr.window_whitening(b, &w).expect("G_b");
        });
        let g = corr.window_whitening(b, &w).expect("G_b");
        let ge = exact.window_whitening(b, &w).expect("G_b exact");
        // W·X again next to G_b·X: the machine's speed drifted over a run.
        let white = time_runs(runs, || {
            x.assign(&raw);
            w.apply(&mut x).expect("W·X");
        });
        let apply = time_runs(runs, || {
            x.assign(&raw);
            g.apply(&mut x).expect("G·X");
        });
        let apply_exact = time_runs(runs, || {
            x.assign(&raw);
            ge.apply(&mut x).expect("G·X");
        });
        let m = corr.matrix(b).expect("M_b");
        let sub = |a: &Array2<f32>| a.iter().filter(|v| v.is_subnormal()).count();
        eprintln!(
            "subnormal entries: M_b {}, G_b {}, G_b exact {}; G_b·X output {}",
            sub(&m),
            sub(g.matrix()),
            sub(ge.matrix()),
            {
                x.assign(&raw);
                g.apply(&mut x).expect("G·X");
                sub(&x)
            }
        );
        let old = time_runs(runs, || {
            x.assign(&raw);
            apply_matrix(m.view(), &mut x);
        });
        println!(
            "shift {:6.1} µm: W·X {:.1} ms; extra over W·X {:.1} ms ({:.1} % of detection)",
            shifts[b as usize],
            white - copy,
            build + apply - white,
            (build + apply - white) / detect * 100.0
        );
        println!(
            "shift {:6.1} µm: G_b build {build:7.1} ms; G_b·X {:7.1} ms ({:.1} per row), exact {:7.1} ms ({:.1} per row); previous M_b·(W·X) {:7.1} ms + W·X",
            shifts[b as usize],
            apply - copy,
            g.nnz() as f64 / N_SITES as f64,
            apply_exact - copy,
            ge.nnz() as f64 / N_SITES as f64,
            old - copy,
        );
    }
    let white2 = time_runs(runs, || {
        x.assign(&raw);
        w.apply(&mut x).expect("W·X");
    });
    let detect2 = time_runs(runs, || {
        det.detect(x.view(), &p.yc).expect("detect");
    });
    println!(
        "{:<34} {:8.1} ms, detection {:.1} ms (the machine's speed drifts: compare with the first)",
        "W·X again",
        white2 - copy,
        detect2
    );
}
