//! Benchmark of the CPU detector on a full-size window: 384 sites × 60 122 samples
//! (batch_size 60 000 + 2·nt), the two-column 1149-centre probe (x ∈ {0, 32} µm,
//! rows every 15 µm), whitened noise with injected spikes.
//!
//! `cargo bench --bench detect_window` generates that window itself. To time the
//! exact window Kilosort4 was timed on, pass a folder holding `X.npy` and
//! `probe.json` (as written by `../shared/tools/ks4ref/make_window.py np2_1shank
//! 60000 1500 1 DIR`): `cargo bench --bench detect_window -- DIR`. Options:
//! `--repeat N` (default 7), `--out DIR` (write xy.npy, imax.npy, amp.npy there).
//!
//! Prints the median, minimum and maximum wall time of `CpuDetector::detect` on a
//! detector whose buffers persist across calls (as in a streaming run), after one
//! warm-up call, and the mean busy seconds of each of its steps per call.

use std::path::PathBuf;
use std::time::Instant;

use ndarray::{Array1, Array2};
use spikecube::detect::cpu::CpuDetector;
use spikecube::{DetectionSettings, Geometry, Probe, UniversalTemplates, npy};

/// The NP2-like probe of the benchmark: 384 sites, x ∈ {0, 32} µm, rows every 15 µm.
fn np2_probe() -> Probe {
    Probe {
        xc: (0..384)
            .map(|i| if i % 2 == 0 { 0.0 } else { 32.0 })
            .collect(),
        yc: (0..384).map(|i| 15.0 * (i / 2) as f32).collect(),
        kcoords: vec![0; 384],
        chan_map: (0..384).collect(),
        n_chan: 384,
        source: "benchmark NP2-like probe".into(),
    }
}

/// Small deterministic generator (xorshift64*), with Box–Muller normals.
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// Unit-variance noise plus 1500 spikes shaped like the universal templates,
/// Gaussian in space (σ 10–25 µm), amplitudes 8–30, 20 % inverted.
fn synthetic_window(probe: &Probe, n_samples: usize) -> Array2<f32> {
    let t = UniversalTemplates::builtin();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let n = probe.n_sites();
    let mut x = Array2::from_shape_fn((n, n_samples), |_| rng.normal() as f32);
    for _ in 0..1500 {
        let t0 = 20 + (rng.uniform() * (n_samples - 61) as f64) as usize;
        let (sx, sy) = (rng.uniform() * 32.0, rng.uniform() * 2865.0);
        let amp = 8.0 + 22.0 * rng.uniform();
        let pol = if rng.uniform() < 0.2 { -1.0 } else { 1.0 };
        let sigma = 10.0 + 15.0 * rng.uniform();
        let k = (rng.uniform() * 6.0) as usize % 6;
        for c in 0..n {
            let d2 = (probe.xc[c] as f64 - sx).powi(2) + (probe.yc[c] as f64 - sy).powi(2);
            if d2 > 100.0 * 100.0 {
                continue;
            }
            let g = pol * amp * (-d2 / (2.0 * sigma * sigma)).exp();
            for i in 0..61 {
                let s = t0 + i - 20;
                if s < n_samples {
                    x[[c, s]] += (g * t.wtemp[[k, i]] as f64) as f32;
                }
            }
        }
    }
    x
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let mut dir: Option<PathBuf> = None;
    let mut repeat = 7usize;
    let mut out: Option<PathBuf> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--repeat" => repeat = args.next().and_then(|v| v.parse().ok()).unwrap_or(7),
            "--out" => out = args.next().map(PathBuf::from),
            _ => dir = Some(PathBuf::from(a)),
        }
    }
    let (probe, x, source) = match &dir {
        Some(d) => (
            Probe::load(&d.join("probe.json"))?,
            npy::read::<f32, _>(&d.join("X.npy"))?,
            d.display().to_string(),
        ),
        None => {
            let p = np2_probe();
            let x = synthetic_window(&p, 60_122);
            (p, x, "generated".into())
        }
    };
    let settings = DetectionSettings::default();
    let geometry = Geometry::new(&probe, &settings)?;
    let nf = geometry.n_centres();
    let mut det = CpuDetector::new(geometry, UniversalTemplates::builtin(), settings)?;
    let warm = Instant::now();
    let first = det.detect(x.view(), &probe.yc)?;
    let warm = warm.elapsed().as_secs_f64();
    det.take_step_seconds();
    let mut times = Vec::with_capacity(repeat);
    for _ in 0..repeat {
        let t = Instant::now();
        let d = det.detect(x.view(), &probe.yc)?;
        times.push(t.elapsed().as_secs_f64());
        assert_eq!(d, first, "repeated detection must be identical");
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "detect_window: {} × {} window ({source}), {nf} centres, {} detections, {} threads",
        x.nrows(),
        x.ncols(),
        first.len(),
        rayon::current_num_threads()
    );
    println!(
        "detect_window: median {median:.3} s, min {:.3} s, max {:.3} s over {repeat} runs (first call {warm:.3} s); {:.1}× realtime at 30 kHz",
        times[0],
        times[times.len() - 1],
        (x.ncols() - 122) as f64 / 30_000.0 / median
    );
    let steps: Vec<String> = det
        .take_step_seconds()
        .into_iter()
        .map(|(name, s)| format!("{name} {:.3} s", s / repeat as f64))
        .collect();
    println!(
        "detect_window: busy seconds per call by step: {}",
        steps.join(", ")
    );
    if let Some(o) = out {
        std::fs::create_dir_all(&o)?;
        let n = first.len();
        let xy = Array2::from_shape_fn((n, 2), |(i, c)| {
            if c == 0 {
                first.centre[i] as i64
            } else {
                first.sample[i] as i64
            }
        });
        npy::write(&o.join("xy.npy"), &xy)?;
        npy::write(
            &o.join("imax.npy"),
            &Array1::from_iter(first.imax.iter().map(|&v| v as i64)),
        )?;
        npy::write(&o.join("amp.npy"), &Array1::from(first.amp.clone()))?;
    }
    Ok(())
}
