//! GPU detection benchmark (detection with CubeCL).
//!
//! `cargo bench --bench gpu_detect -- DIR [--backend cuda|wgpu|both] [--repeat N]
//! [--kilosort-neighbourhoods] [--default-only]` on a folder holding `X.npy` (a whitened window,
//! channels × samples, float32) and `probe.json`, e.g. the full 384 × 60 122 window
//! on the two-column 1149-centre probe written by
//! `../shared/tools/ks4ref/make_window.py np2_1shank 60000 1500 1 DIR`. With
//! `--kilosort-neighbourhoods`, `iC.npy`, `iC2.npy` and `weigh.npy` from DIR are used
//! (Kilosort4's own, for a detection-for-detection comparison with it).
//!
//! Prints, per back end and per variant of steps 2–4 (dense or pruned step 2,
//! dense neighbour max or candidates-only):
//! * the detections, checked equal to the CPU detector's (count, centres, samples,
//!   imax, sign);
//! * per-step medians with a device sync after each step;
//! * the median of a whole `detect` call without those syncs (upload, kernels,
//!   the one download, sorting);
//! * the device memory CubeCL holds;
//!
//! then the raw-window path (`--raw`): a raw int16 window (noise of 15 counts
//! and a slow wave, the probe of DIR) packed on the host, uploaded, preprocessed
//! on the device and detected in: per-part seconds and the whole call, with the
//! CPU's preprocessing plus detection of the same window for comparison;
//!
//! then an upload benchmark: the window as float32 from a borrowed slice
//! (`create_from_slice`, which copies it), as owned bytes (`create`), and as int16
//! (half the bytes, the raw recording's own type).

use std::path::PathBuf;
use std::time::Instant;

use cubecl::Runtime;
use cubecl::prelude::CubeElement;
use ndarray::{Array2, Array3};
use spikecube::detect::cpu::{CpuDetector, Detections};
use spikecube::detect::gpu::{GpuDetector, GpuOptions, StepTimes};
use spikecube::{DetectionSettings, Geometry, Probe, UniversalTemplates, npy};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn check(cpu: &Detections, gpu: &Detections) -> Result<(), String> {
    if cpu.len() != gpu.len() {
        return Err(format!(
            "{} detections on the CPU, {} on the GPU",
            cpu.len(),
            gpu.len()
        ));
    }
    if cpu.centre != gpu.centre || cpu.sample != gpu.sample {
        return Err("(centre, sample) differ".into());
    }
    if cpu.imax != gpu.imax || cpu.sign != gpu.sign {
        return Err("imax or sign differ".into());
    }
    let rel = cpu
        .amp
        .iter()
        .zip(&gpu.amp)
        .chain(cpu.tf.iter().zip(&gpu.tf))
        .chain(cpu.adist.iter().zip(&gpu.adist))
        .chain(cpu.yct.iter().zip(&gpu.yct))
        .map(|(a, b)| ((a - b).abs() / a.abs().max(1.0)) as f64)
        .fold(0f64, f64::max);
    if rel > 1e-5 {
        return Err(format!("floats differ by {rel:.2e} relative"));
    }
    Ok(())
}

struct Setup {
    x: Array2<f32>,
    probe: Probe,
    geometry: Geometry,
    settings: DetectionSettings,
    cpu: Detections,
}

fn bench<R: Runtime>(device: &R::Device, name: &str, s: &Setup, repeat: usize, only_default: bool) {
    // The straightforward port first, then one optimisation at a time, then the
    // default without each one.
    let plain = GpuOptions {
        pruned: false,
        sparse_peaks: false,
        fb_per_unit: 1,
        upload_chunk: 0,
        hp_per_unit: 8,
        highpass: spikecube::detect::gpu::highpass_iir::HighpassMode::Direct,
        whiten_rows_first: false,
        device_f64: true,
    };
    let full = GpuOptions::default();
    let variants = [
        ("A plain port (dense everything)", plain),
        (
            "B A + candidates-only neighbour max",
            GpuOptions {
                sparse_peaks: true,
                ..plain
            },
        ),
        (
            "C B + pruned step 2",
            GpuOptions {
                sparse_peaks: true,
                pruned: true,
                ..plain
            },
        ),
        (
            "E default: C + 4 samples per unit in step 1 + chunked upload",
            full,
        ),
        (
            "F default without pruning",
            GpuOptions {
                pruned: false,
                ..full
            },
        ),
        (
            "G default with 2 samples per unit",
            GpuOptions {
                fb_per_unit: 2,
                ..full
            },
        ),
    ];
    for (label, options) in variants {
        if only_default && options != full {
            continue;
        }
        let mut det = GpuDetector::<R>::new(
            device,
            name.into(),
            s.geometry.clone(),
            UniversalTemplates::builtin(),
            s.settings.clone(),
            options,
        )
        .expect("detector");
        let first = det.detect(s.x.view(), &s.probe.yc).expect("detect");
        let verdict = match check(&s.cpu, &first) {
            Ok(()) => "identical to the CPU".to_string(),
            Err(e) => format!("MISMATCH: {e}"),
        };
        let mut profiles: Vec<(StepTimes, f64)> = Vec::new();
        for _ in 0..3 {
            profiles.push(
                det.profile(s.x.view(), &s.probe.yc, repeat)
                    .expect("profile"),
            );
        }
        let mut whole = Vec::new();
        for _ in 0..repeat.min(10) {
            let t = Instant::now();
            let d = det.detect(s.x.view(), &s.probe.yc).expect("detect");
            whole.push(t.elapsed().as_secs_f64());
            assert_eq!(d, first, "repeatable");
        }
        let m = |f: fn(&StepTimes) -> f64| median(profiles.iter().map(|p| f(&p.0)).collect()) * 1e3;
        let total = median(profiles.iter().map(|p| p.1).collect()) * 1e3;
        println!("\n## {name}: {label}");
        println!("detections: {} ({verdict})", first.len());
        println!("| step | ms per launch (median of 3 × {repeat} launches) |\n|---|---|");
        println!(
            "| upload (float32, {:.1} MB) | {:.3} |",
            (s.x.len() * 4) as f64 / 1e6,
            m(|t| t.upload)
        );
        println!("| 1 filter_bank | {:.3} |", m(|t| t.filter_bank));
        println!("| 2 centre_response | {:.3} |", m(|t| t.centre_response));
        println!("| 3 neighbour_max | {:.3} |", m(|t| t.neighbour_max));
        println!(
            "| 4 local_peaks + compaction | {:.3} |",
            m(|t| t.local_peaks)
        );
        println!("| 5 features | {:.3} |", m(|t| t.features));
        println!("| download + sort | {:.3} |", m(|t| t.download));
        println!("| steps 1–5 back to back, no sync between | {total:.3} |");
        println!(
            "whole detect() (upload, kernels, download), median of {}: {:.3} ms",
            whole.len(),
            median(whole.clone()) * 1e3
        );
        if let Some(b) = det.memory_in_use() {
            println!("device memory held by CubeCL: {:.0} MB", b as f64 / 1e6);
        }
        println!(
            "SUMMARY {{\"backend\":\"{name}\",\"variant\":\"{label}\",\"detections\":{},\"ok\":{},\"kernels_ms\":{total:.4},\"whole_ms\":{:.4},\"fb\":{:.4},\"cr\":{:.4},\"nm\":{:.4},\"lp\":{:.4},\"ft\":{:.4},\"up\":{:.4},\"down\":{:.4},\"mem_mb\":{:.1}}}",
            first.len(),
            verdict.starts_with("identical"),
            median(whole) * 1e3,
            m(|t| t.filter_bank),
            m(|t| t.centre_response),
            m(|t| t.neighbour_max),
            m(|t| t.local_peaks),
            m(|t| t.features),
            m(|t| t.upload),
            m(|t| t.download),
            det.memory_in_use().unwrap_or(0) as f64 / 1e6
        );
    }
    upload::<R>(device, name, s, repeat);
}

fn upload<R: Runtime>(device: &R::Device, name: &str, s: &Setup, repeat: usize) {
    let client = R::client(device);
    let xs = s.x.as_standard_layout().to_owned();
    let xs = xs.as_slice().unwrap();
    let int16: Vec<i16> = xs.iter().map(|&v| (v * 200.0) as i16).collect();
    let sync = || cubecl::future::block_on(client.sync()).unwrap();
    let time = |f: &dyn Fn()| {
        let mut v = Vec::new();
        for _ in 0..repeat {
            sync();
            let t = Instant::now();
            f();
            sync();
            v.push(t.elapsed().as_secs_f64() * 1e3);
        }
        median(v)
    };
    let a = time(&|| drop(client.create_from_slice(f32::as_bytes(xs))));
    let b = time(&|| {
        drop(client.create(cubecl::bytes::Bytes::from_elems(xs.to_vec())));
    });
    let c = time(&|| drop(client.create_from_slice(i16::as_bytes(&int16))));
    let d = time(&|| {
        drop(client.create(cubecl::bytes::Bytes::from_elems(int16.clone())));
    });
    println!("\n## {name}: upload of one window, median of {repeat} (ms)");
    println!("| what | bytes | ms |\n|---|---|---|");
    println!(
        "| float32, create_from_slice (borrowed) | {} | {a:.3} |",
        xs.len() * 4
    );
    println!(
        "| float32, create(Bytes) owned (includes the Vec copy) | {} | {b:.3} |",
        xs.len() * 4
    );
    println!("| int16, create_from_slice | {} | {c:.3} |", xs.len() * 2);
    println!(
        "| int16, create(Bytes) owned (includes the Vec copy) | {} | {d:.3} |",
        xs.len() * 2
    );
}

/// The raw-window path: packing, upload, device preprocessing kernel by kernel,
/// then whole `detect_raw` calls; checked against the CPU's preprocessing and
/// detection of the same window.
fn bench_raw<R: Runtime>(
    device: &R::Device,
    name: &str,
    s: &Setup,
    packer: spikecube::detect::gpu::Packer,
    setup: &dyn Fn(&mut GpuDetector<R>),
    repeat: usize,
) {
    use spikecube::preprocess::{PreprocessSettings, Preprocessor};
    let (c, n) = s.x.dim();
    let mut state = 12345u64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 33) as f64 / (1u64 << 31) as f64) - 0.5
    };
    let raw = Array2::from_shape_fn((c, n), |(r, t)| {
        let wave = 300.0 * (t as f64 * 0.0021).sin() + r as f64;
        (wave + 15.0 * 3.46 * next() + 40.0 * s.x[[r, t]] as f64).round() as f32
    });
    let settings = PreprocessSettings {
        batch_size: n - 122,
        ..PreprocessSettings::default()
    };
    let pre = Preprocessor::fit(
        1,
        |_| -> Result<Array2<f32>, spikecube::error::PreprocessError> { Ok(raw.clone()) },
        &s.probe,
        &settings,
    )
    .unwrap();
    let t = Instant::now();
    let mut host = raw.clone();
    pre.apply(&mut host).unwrap();
    let host_pre = t.elapsed().as_secs_f64();
    let mut cpu = CpuDetector::new(
        s.geometry.clone(),
        UniversalTemplates::builtin(),
        s.settings.clone(),
    )
    .unwrap();
    let want = cpu.detect(host.view(), &s.probe.yc).unwrap();
    let mut det = GpuDetector::<R>::new(
        device,
        name.into(),
        s.geometry.clone(),
        UniversalTemplates::builtin(),
        s.settings.clone(),
        GpuOptions::default(),
    )
    .unwrap();
    let form = pre
        .device_form(spikecube::preprocess::DEVICE_TAP_FLOOR)
        .unwrap();
    det.set_preprocessing(&form).unwrap();
    setup(&mut det);
    let got = det
        .detect_raw(packer.pack(raw.view()), &s.probe.yc, None)
        .unwrap();
    let verdict = match check(&want, &got) {
        Ok(()) => "same as the CPU".to_string(),
        Err(e) => format!("DIFFERENT from the CPU: {e}"),
    };
    println!(
        "\n## {name}: raw window {c} × {n} (int16 values, {} taps in the high-pass, pinned upload: {})\n\n{} detections, {verdict}; CPU preprocessing of this window: {:.1} ms ({} threads)\n",
        form.taps.len(),
        packer.is_pinned(),
        got.len(),
        host_pre * 1e3,
        rayon::current_num_threads()
    );
    let mut parts = Vec::new();
    for _ in 0..3 {
        parts.push(
            det.profile_raw(&mut || packer.pack(raw.view()), &s.probe.yc, repeat)
                .unwrap(),
        );
    }
    let med = |i: usize| median(parts.iter().map(|p| p[i]).collect()) * 1e3;
    println!("| part | ms (median of 3 × {repeat}) |\n|---|---|");
    println!(
        "| pack on the host ({} MB) | {:.3} |",
        (c * n.div_ceil(2) * 4) as f64 / 1e6,
        med(0)
    );
    println!("| upload | {:.3} |", med(1));
    let labels = [
        "channel means",
        "+ mean removal and median CAR",
        "+ high-pass",
        "+ whitening",
    ];
    for (k, l) in labels.iter().enumerate() {
        println!("| {l} (cumulative) | {:.3} |", med(2 + k));
    }
    let mut whole = Vec::new();
    for _ in 0..repeat {
        let raw_w = packer.pack(raw.view());
        let t = Instant::now();
        let d = det.detect_raw(raw_w, &s.probe.yc, None).unwrap();
        whole.push(t.elapsed().as_secs_f64());
        assert_eq!(d.len(), got.len());
    }
    let mut whole_pack = Vec::new();
    for _ in 0..repeat {
        let t = Instant::now();
        let d = det
            .detect_raw(packer.pack(raw.view()), &s.probe.yc, None)
            .unwrap();
        whole_pack.push(t.elapsed().as_secs_f64());
        assert_eq!(d.len(), got.len());
    }
    println!(
        "| whole detect_raw (upload, preprocessing, detection, download) | {:.3} |\n| the same with packing | {:.3} |",
        median(whole) * 1e3,
        median(whole_pack) * 1e3
    );
    println!(
        "device memory held by CubeCL: {:.0} MB",
        det.memory_in_use().unwrap_or(0) as f64 / 1e6
    );
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let dir = PathBuf::from(args.first().expect(
        "usage: gpu_detect DIR [--backend cuda|wgpu|both] [--repeat N] [--kilosort-neighbourhoods]",
    ));
    let opt = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let backend = opt("--backend").unwrap_or_else(|| "both".into());
    let repeat: usize = opt("--repeat").map_or(20, |v| v.parse().unwrap());
    let ks = args.iter().any(|a| a == "--kilosort-neighbourhoods");
    let only_default = args.iter().any(|a| a == "--default-only");
    let raw_only = args.iter().any(|a| a == "--raw");
    let x: Array2<f32> = npy::read(&dir.join("X.npy")).expect("X.npy");
    let probe = Probe::load(&dir.join("probe.json")).expect("probe.json");
    let mut settings = DetectionSettings::default();
    let geometry = if ks {
        let i_c = npy::read::<i64, _>(&dir.join("iC.npy"))
            .unwrap()
            .mapv(|v| v as u32);
        let i_c2 = npy::read::<i64, _>(&dir.join("iC2.npy"))
            .unwrap()
            .mapv(|v| v as u32);
        let weigh: Array3<f32> = npy::read(&dir.join("weigh.npy")).unwrap();
        settings.nearest_chans = i_c.nrows();
        Geometry::with_neighbourhoods(&probe, &settings, i_c, i_c2, weigh).unwrap()
    } else {
        Geometry::new(&probe, &settings).unwrap()
    };
    println!(
        "window {} × {}, {} template centres, neighbourhoods: {}",
        x.nrows(),
        x.ncols(),
        geometry.n_centres(),
        if ks {
            "Kilosort4's (iC/iC2/weigh from DIR)"
        } else {
            "spikecube's own"
        }
    );
    let mut cpu = CpuDetector::new(
        geometry.clone(),
        UniversalTemplates::builtin(),
        settings.clone(),
    )
    .unwrap();
    let t = Instant::now();
    let reference = cpu.detect(x.view(), &probe.yc).unwrap();
    println!(
        "CPU reference: {} detections in {:.3} s ({} threads)",
        reference.len(),
        t.elapsed().as_secs_f64(),
        rayon::current_num_threads()
    );
    let s = Setup {
        x,
        probe,
        geometry,
        settings,
        cpu: reference,
    };
    if backend == "cuda" || backend == "both" {
        match spikecube::backend::probe_cuda() {
            #[cfg(feature = "cuda")]
            Ok(name) => {
                if raw_only {
                    let packer = spikecube::detect::gpu::Packer::pinned_cuda();
                    let pool = packer.pool();
                    bench_raw::<cubecl::cuda::CudaRuntime>(
                        &Default::default(),
                        &format!("cuda {name}"),
                        &s,
                        packer,
                        &|d| {
                            if let Some(p) = pool.clone() {
                                d.use_direct_upload(p)
                            }
                        },
                        repeat,
                    );
                    bench_raw::<cubecl::cuda::CudaRuntime>(
                        &Default::default(),
                        &format!("cuda {name}, pageable upload"),
                        &s,
                        Default::default(),
                        &|_| {},
                        repeat,
                    );
                } else {
                    bench::<cubecl::cuda::CudaRuntime>(
                        &Default::default(),
                        &format!("cuda {name}"),
                        &s,
                        repeat,
                        only_default,
                    )
                }
            }
            #[cfg(not(feature = "cuda"))]
            Ok(_) => println!("cuda: not in this build"),
            Err(why) => println!("cuda: {why}"),
        }
    }
    if backend == "wgpu" || backend == "both" {
        #[cfg(feature = "wgpu")]
        {
            let a = spikecube::backend::probe_wgpu();
            match a.first() {
                Some(a) if raw_only => bench_raw::<cubecl::wgpu::WgpuRuntime>(
                    &Default::default(),
                    &format!("wgpu {} ({})", a.name, a.api),
                    &s,
                    Default::default(),
                    &|_| {},
                    repeat,
                ),
                Some(a) => bench::<cubecl::wgpu::WgpuRuntime>(
                    &Default::default(),
                    &format!("wgpu {} ({})", a.name, a.api),
                    &s,
                    repeat,
                    only_default,
                ),
                None => println!("wgpu: no adapter"),
            }
        }
    }
}
