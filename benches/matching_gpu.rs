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
use spikecube::UniversalTemplates;
use spikecube::sort::matching::gpu::{GpuMatchOptions, GpuMatcher};
use spikecube::sort::matching::{MatchingSettings, MatchingSetup, match_window};

const REPS: usize = 5;

#[path = "common/matching_case.rs"]
mod matching_case;
use matching_case::case;

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
                    peels_from_last: false,
                    ..GpuMatchOptions::from_env()
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
