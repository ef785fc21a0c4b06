//! Throughput of Kilosort4 preprocessing on one default-size window:
//! 384 sites × 60 122 samples (batch_size 60 000 + 2·61), random data, a
//! synthetic two-column probe (32 µm apart, 20 µm rows), local whitening over
//! 32 sites. Reports the median over N runs of each stage and of the whole
//! chain, in ms per window and × realtime at 30 kHz (60 000 samples = 2 s),
//! the whitening fit's per-window product `X·Xᵀ` (plain and fast), and the
//! check for transients common to most channels on the raw window.
//!
//! Usage: `cargo bench --bench preprocess [-- RUNS]` (default 7 runs).

use std::path::PathBuf;
use std::time::Instant;

use ndarray::Array2;
use spikecube::Probe;
use spikecube::preprocess::{
    HighpassFilter, PreprocessSettings, Preprocessor, accumulate_covariance,
    accumulate_covariance_plain, common_reference, highpass_kernel, remove_channel_means,
    whitening_from_covariance,
};

const N_SITES: usize = 384;

fn probe() -> Probe {
    Probe {
        xc: (0..N_SITES).map(|i| 32.0 * (i % 2) as f32).collect(),
        yc: (0..N_SITES).map(|i| 20.0 * (i / 2) as f32).collect(),
        kcoords: vec![0; N_SITES],
        chan_map: (0..N_SITES as u64).collect(),
        n_chan: N_SITES as u64,
        source: PathBuf::from("synthetic two-column probe"),
    }
}

/// Deterministic uniform noise in [-50, 50) counts plus a per-channel offset.
fn random_window(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
    let mut state = seed;
    Array2::from_shape_fn((rows, cols), |(r, _)| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 100.0 + r as f32
    })
}

fn median_ms(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn time_runs(runs: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up: plans, buffers, page faults
    let times = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    median_ms(times)
}

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(7)
        .max(1);
    let settings = PreprocessSettings::default();
    let n = settings.window_len();
    let probe = probe();
    // A covariance with spatially decaying correlation, as a stand-in for a fit.
    let cc = Array2::from_shape_fn((N_SITES, N_SITES), |(i, j)| {
        let dx = f64::from(probe.xc[i] - probe.xc[j]);
        let dy = f64::from(probe.yc[i] - probe.yc[j]);
        400.0 * (-(dx * dx + dy * dy).sqrt() / 40.0).exp() + if i == j { 100.0 } else { 0.0 }
    });
    let t = Instant::now();
    let w = whitening_from_covariance(&cc, &probe, settings.whitening_range).expect("whitening");
    eprintln!(
        "local ZCA of a {N_SITES}-site covariance (range {}): {:.1} ms",
        settings.whitening_range,
        t.elapsed().as_secs_f64() * 1e3
    );
    let pre = Preprocessor::new(&settings, w).expect("preprocessor");
    let kernel = highpass_kernel(settings.fs, settings.highpass_cutoff).expect("kernel");
    let hp = HighpassFilter::new(&kernel, n).expect("filter");
    let raw = random_window(N_SITES, n, 0x9E37_79B9_7F4A_7C15);
    let window_s = settings.batch_size as f64 / settings.fs;
    println!(
        "window {N_SITES} × {n}, {runs} runs, {} rayon threads",
        rayon::current_num_threads()
    );

    let mut x = raw.clone();
    let car = time_runs(runs, || {
        x.assign(&raw);
        common_reference(&mut x, true).expect("car");
    });
    let mut y = raw.clone();
    let copy = time_runs(runs, || y.assign(&raw));
    let means = time_runs(runs, || {
        y.assign(&raw);
        remove_channel_means(&mut y);
    });
    let hp_ms = time_runs(runs, || hp.apply(&mut x).expect("hp"));
    // The same high-pass as the device's chunked f64 IIR (the form the CPU
    // runs, for the device's bits), rows side by side.
    let iir = pre.highpass_iir().expect("the IIR form").clone();
    let chunk = spikecube::preprocess::IIR_CHUNK;
    let iir_ms = time_runs(runs, || iir.apply_f64(&mut x, chunk).expect("iir"));
    let white = time_runs(runs, || pre.whitening().apply(&mut x).expect("whiten"));
    let all = time_runs(runs, || {
        x.assign(&raw);
        pre.apply(&mut x).expect("apply");
    });
    // The whitening fit's window term X·Xᵀ/NT over the central columns (f64):
    // the plain product (faer, all threads, per 4096 columns) and the fast
    // form (512-column blocks, lower triangle, same bits).
    let nt = settings.nt;
    let central = raw.slice(ndarray::s![.., nt..n - nt]);
    let mut cc = Array2::<f64>::zeros((N_SITES, N_SITES));
    let cov_plain = time_runs(runs, || {
        accumulate_covariance_plain(&mut cc, central).expect("covariance")
    });
    let mut cc_fast = Array2::<f64>::zeros((N_SITES, N_SITES));
    let cov_fast = time_runs(runs, || {
        accumulate_covariance(&mut cc_fast, central).expect("covariance")
    });
    // The check for transients common to most channels, on the raw window
    // as the reading thread sees it: f32 (CPU pass) and int16 (GPU pass).
    let gap = spikecube::checks::transients::transient_gap(settings.fs);
    let find = spikecube::checks::transients::find_transients::<f32>;
    let raw_slice = raw.as_slice().expect("standard layout");
    let transients_f32 = time_runs(runs, || {
        std::hint::black_box(find(raw_slice, (N_SITES, n, n), gap));
    });
    let raw16: Vec<i16> = raw_slice.iter().map(|&v| v as i16).collect();
    let transients_i16 = time_runs(runs, || {
        std::hint::black_box(spikecube::checks::transients::find_transients(
            &raw16,
            (N_SITES, n, n),
            gap,
        ));
    });
    let same = cc
        .iter()
        .zip(&cc_fast)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    let report = |name: &str, ms: f64| {
        println!(
            "{name:<28} {ms:9.1} ms/window  {:7.1} × realtime at 30 kHz",
            window_s * 1e3 / ms
        );
    };
    report("copy (baseline)", copy);
    report("channel means", (means - copy).max(0.0));
    report("channel means + median CAR", (car - copy).max(0.0));
    report("high-pass (FFT, f32)", hp_ms);
    report("high-pass (IIR, f64, the CPU's)", iir_ms);
    report("whitening W·X", white);
    report("CAR + HP + whitening", (all - copy).max(0.0));
    report("transients check (f32)", transients_f32);
    report("transients check (int16)", transients_i16);
    report("fit: X·Xᵀ plain (faer)", cov_plain);
    report("fit: X·Xᵀ fast (same bits)", cov_fast);
    println!(
        "fit covariance, fast vs plain: {}",
        if same {
            "bit-identical"
        } else {
            "DIFFERENT BITS"
        }
    );
}
