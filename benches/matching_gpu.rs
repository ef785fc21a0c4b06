//! Time of the GPU learned-template matching on one default-size window
//! (384 sites × 60 122 samples, the window of `benches/matching.rs`: noise
//! plus spikes of the templates every ~40 samples), for K = 100, 400 and
//! 2 000 templates by default: set-up on the host, upload, the first window
//! (includes kernel compilation), then the mean of `REPS` windows for each
//! number of peels per state read; the device memory held; and, with
//! `--check`, whether the spikes equal the CPU's.
//!
//! Usage: `cargo bench --bench matching_gpu -- [--backend cuda|wgpu] [--check] [K...]`
//! (default back end: cuda when built with it, else wgpu).

use std::sync::Arc;
use std::time::Instant;

use cubecl::Runtime;
use ndarray::{Array2, Array3};
use spikecube::UniversalTemplates;
use spikecube::sort::matching::gpu::{GpuMatchOptions, GpuMatcher};
use spikecube::sort::matching::{MatchingSettings, MatchingSetup, match_window};

const REPS: usize = 5;

/// xorshift noise in [-0.5, 0.5).
struct Noise(u64);
impl Noise {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// Templates on ~10 neighbouring sites and a window with their spikes.
fn case(k: usize, n_c: usize, nt: usize, nt_win: usize) -> (Array3<f32>, Array2<f32>) {
    let wpca = UniversalTemplates::builtin().wpca;
    let mut rng = Noise(0x9e37_79b9_7f4a_7c15 ^ k as u64);
    let mut u = Array3::<f32>::zeros((k, 6, n_c));
    for j in 0..k {
        let centre = (j * 7919) % (n_c - 10);
        for c in centre..centre + 10 {
            let g = 10.0 * (-((c - centre) as f32 - 5.0).powi(2) / 8.0).exp();
            for p in 0..6 {
                u[[j, p, c]] = g * (if p == 0 { 1.0 } else { 0.4 * rng.next() });
            }
        }
    }
    let mut x = Array2::<f32>::zeros((n_c, nt_win));
    x.mapv_inplace(|_| 2.0 * rng.next());
    let (mut t, mut j) = (100, 0);
    while t + 100 < nt_win {
        for c in 0..n_c {
            for i in 0..nt {
                let w: f32 = (0..6).map(|p| u[[j % k, p, c]] * wpca[[p, i]]).sum();
                x[[c, t - nt / 2 + i]] += 1.5 * w;
            }
        }
        t += 40;
        j += 7;
    }
    (u, x)
}

fn run<R: Runtime>(device: &R::Device, name: &str, ks: &[usize], check: bool) {
    let (n_c, nt, nt_win) = (384usize, 61usize, 60_122usize);
    let wpca = UniversalTemplates::builtin().wpca;
    let xc: Vec<f32> = (0..n_c).map(|i| 32.0 * (i % 2) as f32).collect();
    let yc: Vec<f32> = (0..n_c).map(|i| 15.0 * (i / 2) as f32).collect();
    for &k in ks {
        let (u, x) = case(k, n_c, nt, nt_win);
        let t0 = Instant::now();
        let setup = Arc::new(
            MatchingSetup::new(
                u.view(),
                wpca.view(),
                &xc,
                &yc,
                &MatchingSettings::default(),
            )
            .expect("set-up"),
        );
        let t_setup = t0.elapsed().as_secs_f64();
        for every in [1usize, 4, 16, 100] {
            let t1 = Instant::now();
            let mut m = GpuMatcher::<R>::new(
                device,
                name.into(),
                setup.clone(),
                GpuMatchOptions {
                    peels_per_check: every,
                },
            )
            .expect("matcher");
            let t_up = t1.elapsed().as_secs_f64();
            let t2 = Instant::now();
            let first = m.match_window(x.view()).expect("window");
            let t_first = t2.elapsed().as_secs_f64();
            let t3 = Instant::now();
            for _ in 0..REPS {
                let again = m.match_window(x.view()).expect("window");
                assert_eq!(again, first, "K = {k}: a second run differs");
            }
            let t_win = t3.elapsed().as_secs_f64() / REPS as f64;
            println!(
                "{name} K = {k}, {every} peels per check: set-up {t_setup:.3} s (ctc precomputed: {}), upload {t_up:.3} s, first window {t_first:.3} s, window {:.2} ms (mean of {REPS}): {} spikes in {} peels, device memory {:.1} MB",
                setup.ctc_precomputed(),
                t_win * 1e3,
                first.len(),
                first.peels,
                m.device_bytes() as f64 / 1e6
            );
            if check && every == 4 {
                let t4 = Instant::now();
                let cpu = match_window(&setup, x.view()).expect("window");
                let same = cpu.col == first.col && cpu.template == first.template;
                println!(
                    "  CPU ({} threads) {:.3} s: {} spikes; same (col, template) as the GPU: {same}",
                    rayon::current_num_threads(),
                    t4.elapsed().as_secs_f64(),
                    cpu.len()
                );
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ks: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let ks = if ks.is_empty() {
        vec![100, 400, 2000]
    } else {
        ks
    };
    let check = args.iter().any(|a| a == "--check");
    let backend = args
        .iter()
        .position(|a| a == "--backend")
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| {
            if cfg!(feature = "cuda") {
                "cuda"
            } else {
                "wgpu"
            }
            .into()
        });
    match backend.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => {
            run::<cubecl::cuda::CudaRuntime>(&cubecl::cuda::CudaDevice::new(0), "cuda", &ks, check)
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => run::<cubecl::wgpu::WgpuRuntime>(
            &cubecl::wgpu::WgpuDevice::DefaultDevice,
            "wgpu",
            &ks,
            check,
        ),
        other => eprintln!("--backend {other}: not in this build"),
    }
}
