//! The GPU learned-template matching against its CPU twin
//! (`spikecube::sort::matching::match_window`, itself checked against
//! Kilosort4 in tests/matching.rs), on wgpu (Mesa lavapipe in CI) and, when
//! asked for, CUDA (`#[ignore]`d: `cargo test --release --test matching_gpu
//! -- --include-ignored` on a machine with an NVIDIA GPU).
//!
//! What must agree, bit for bit: every spike's window column and template, in
//! the same order, the peel count, amp, √Cf and tF (the kernels sum in the
//! CPU's order and round every product as it does, `detect::gpu::exact`).
//! Within a back end: the same bytes on two runs.
#![cfg(any(feature = "cuda", feature = "wgpu"))]

mod common;

use std::fs::File;
use std::sync::Arc;

use common::data;
use cubecl::Runtime;
use ndarray::{Array1, Array2, Array3, ArrayD, ArrayView2, Axis, Ix1, Ix2, Ix3};
use ndarray_npy::NpzReader;
use spikecube::sort::matching::gpu::{GpuMatchOptions, GpuMatcher};
use spikecube::sort::matching::{MatchingSettings, MatchingSetup, WindowSpikes, match_window};

fn get<A: ndarray_npy::ReadableElement, D: ndarray::Dimension>(
    z: &mut NpzReader<File>,
    name: &str,
) -> ndarray::Array<A, D> {
    z.by_name(name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

struct Unit {
    wpca: Array2<f32>,
    xc: Array1<f32>,
    yc: Array1<f32>,
    wall3: Array3<f32>,
    x: Array3<f32>,
    icc: Array2<i64>,
    batch_size: usize,
}

fn load_unit() -> Unit {
    let mut z = NpzReader::new(File::open(data("matching/unit.npz")).unwrap()).unwrap();
    let bs: ArrayD<i64> = get(&mut z, "batch_size");
    Unit {
        wpca: get::<f32, Ix2>(&mut z, "wPCA"),
        xc: get::<f32, Ix1>(&mut z, "xc"),
        yc: get::<f32, Ix1>(&mut z, "yc"),
        wall3: get::<f32, Ix3>(&mut z, "Wall3"),
        x: get::<f32, Ix3>(&mut z, "X"),
        icc: get::<i64, Ix2>(&mut z, "iCC"),
        batch_size: bs.iter().next().copied().unwrap() as usize,
    }
}

fn unit_setup(u: &Unit, ctc_budget_bytes: usize) -> Arc<MatchingSetup> {
    let settings = MatchingSettings {
        batch_size: u.batch_size,
        ctc_budget_bytes,
        ..MatchingSettings::default()
    };
    Arc::new(
        MatchingSetup::new(
            u.wall3.view(),
            u.wpca.view(),
            u.xc.as_slice().unwrap(),
            u.yc.as_slice().unwrap(),
            &settings,
        )
        .unwrap()
        .with_icc(u.icc.mapv(|v| v as u32))
        .unwrap(),
    )
}

fn same(label: &str, cpu: &WindowSpikes, gpu: &WindowSpikes) {
    assert_eq!(cpu.len(), gpu.len(), "{label}: spike count");
    assert_eq!(cpu.col, gpu.col, "{label}: columns");
    assert_eq!(cpu.template, gpu.template, "{label}: templates");
    assert_eq!(cpu.peels, gpu.peels, "{label}: peels");
    let bits = |what: &str, a: &[f32], b: &[f32]| {
        for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
            assert!(
                x.to_bits() == y.to_bits(),
                "{label} {what}[{i}]: CPU {x} vs GPU {y}"
            );
        }
    };
    bits("amp", &cpu.amp, &gpu.amp);
    bits("th_amp", &cpu.th_amp, &gpu.th_amp);
    bits("tF", &cpu.tf, &gpu.tf);
    eprintln!(
        "{label}: {} spikes, {} peels, the CPU's bits",
        cpu.len(),
        cpu.peels
    );
}

fn matcher<R: Runtime>(
    device: &R::Device,
    setup: &Arc<MatchingSetup>,
    peels_per_check: usize,
    peels_from_last: bool,
) -> GpuMatcher<R> {
    GpuMatcher::<R>::new(
        device,
        "test device".into(),
        setup.clone(),
        GpuMatchOptions {
            peels_per_check,
            peels_from_last,
            ..GpuMatchOptions::from_env()
        },
    )
    .unwrap()
}

/// Every window of the unit case (precomputed ctc and UtU-only set-ups, one
/// and all peels per state read, or the first read after one peel more than
/// the previous window's) equals the CPU; two runs give the same bytes.
fn check_unit<R: Runtime>(device: &R::Device) {
    let u = load_unit();
    for budget in [512usize << 20, 0] {
        let setup = unit_setup(&u, budget);
        assert_eq!(setup.ctc_precomputed(), budget > 0);
        for (every, from_last) in [(1usize, false), (4, false), (100, false), (1, true)] {
            let mut m = matcher::<R>(device, &setup, every, from_last);
            for (i, x) in u.x.axis_iter(Axis(0)).enumerate() {
                let cpu = match_window(&setup, x).unwrap();
                let gpu = m.match_window(x).unwrap();
                same(
                    &format!(
                        "unit window {i} (budget {budget}, every {every}, from last {from_last})"
                    ),
                    &cpu,
                    &gpu,
                );
                let again = m.match_window(x).unwrap();
                assert_eq!(gpu, again, "unit window {i}: second run");
            }
        }
    }
}

/// The sim32 recording's templates (Kilosort4's Wall3) on the first 20 000
/// samples of its first window, preprocessed with Kilosort4's Wrot.
fn check_sim32<R: Runtime>(device: &R::Device) {
    let dir = data("sort/sim32");
    let open = |f: &str| NpzReader::new(File::open(dir.join(f)).unwrap()).unwrap();
    let mut ops = open("ops.npz");
    let wpca: Array2<f32> = get(&mut ops, "wPCA");
    let wrot: Array2<f32> = get(&mut ops, "Wrot");
    let xc: Array1<f32> = get(&mut ops, "xc");
    let yc: Array1<f32> = get(&mut ops, "yc");
    let icc: Array2<i64> = get(&mut ops, "iCC");
    let wall3: Array3<f32> = get(&mut open("post_out.npz"), "Wall3");
    let x = sim32_window(wrot);
    let setup = Arc::new(
        MatchingSetup::new(
            wall3.view(),
            wpca.view(),
            xc.as_slice().unwrap(),
            yc.as_slice().unwrap(),
            &MatchingSettings::default(),
        )
        .unwrap()
        .with_icc(icc.mapv(|v| v as u32))
        .unwrap(),
    );
    let x: ArrayView2<f32> = x.slice(ndarray::s![.., ..20_000]);
    let cpu = match_window(&setup, x).unwrap();
    assert!(cpu.len() > 100, "sim32: only {} spikes", cpu.len());
    let mut m = matcher::<R>(device, &setup, 4, false);
    let gpu = m.match_window(x).unwrap();
    same("sim32 window 0", &cpu, &gpu);
    assert_eq!(gpu, m.match_window(x).unwrap(), "sim32: second run");
    // The tiled filter and the sliced best-template scans give the bytes of
    // their one-unit-per-sample forms, and the peels' first grids (one cube
    // per spike, one scan cube per possible spike) those of the sized ones.
    for (simple_kernels, peel_grid) in [
        ((true, false), true),
        ((false, true), true),
        ((true, true), true),
        ((false, false), false),
    ] {
        let mut s = GpuMatcher::<R>::new(
            device,
            "test device".into(),
            setup.clone(),
            GpuMatchOptions {
                peels_per_check: 4,
                peels_from_last: false,
                simple_kernels,
                copy_window: false,
                peel_grid,
            },
        )
        .unwrap();
        assert_eq!(
            gpu,
            s.match_window(x).unwrap(),
            "sim32: simple kernels {simple_kernels:?}, sized peel grids {peel_grid}"
        );
    }
}

/// The sim32 recording's window 0 sent raw to the device, preprocessed there
/// by a [`GpuDetector`] and matched there without a copy through the host
/// (`GpuMatcher::match_device`, as `spikecube sort` runs on a GPU): the same
/// bytes as matching the device's preprocessed window after a round trip
/// through the host, the device's buffer left as it was, and the same spikes
/// as the CPU matching the CPU's preprocessed window.
fn check_sim32_device_fed<R: Runtime>(device: &R::Device) {
    use spikecube::detect::gpu::{GpuDetector, GpuOptions, Packer};
    use spikecube::detect::{DetectionSettings, Geometry, UniversalTemplates};
    use spikecube::preprocess::{DEVICE_TAP_FLOOR, PreprocessSettings, Preprocessor};
    let dir = data("sort/sim32");
    let open = |f: &str| NpzReader::new(File::open(dir.join(f)).unwrap()).unwrap();
    let mut ops = open("ops.npz");
    let wpca: Array2<f32> = get(&mut ops, "wPCA");
    let wrot: Array2<f32> = get(&mut ops, "Wrot");
    let icc: Array2<i64> = get(&mut ops, "iCC");
    let wall3: Array3<f32> = get(&mut open("post_out.npz"), "Wall3");
    let probe = spikecube::Probe::load(&data("sort/probe32.json")).unwrap();
    let raw = sim32_raw_window();
    let settings = PreprocessSettings {
        fs: 30_000.0,
        ..PreprocessSettings::default()
    };
    let pre = Preprocessor::new(&settings, wrot).unwrap();
    let mut host_x = raw.clone();
    pre.apply(&mut host_x).unwrap();
    let setup = Arc::new(
        MatchingSetup::new(
            wall3.view(),
            wpca.view(),
            &probe.xc,
            &probe.yc,
            &MatchingSettings::default(),
        )
        .unwrap()
        .with_icc(icc.mapv(|v| v as u32))
        .unwrap(),
    );
    let s = DetectionSettings::default();
    let g = Geometry::new(&probe, &s).unwrap();
    let mut det = GpuDetector::<R>::new(
        device,
        "test device".into(),
        g,
        UniversalTemplates::builtin(),
        s,
        GpuOptions::default(),
    )
    .unwrap();
    det.set_preprocessing(&pre.device_form(DEVICE_TAP_FLOOR).unwrap())
        .unwrap();
    let packer = Packer::default();
    let n = raw.ncols();
    let x_dev = det
        .preprocess_to_device(packer.pack(raw.view()), &probe.yc)
        .unwrap();
    let mut m = matcher::<R>(device, &setup, 4, false);
    let fed = m.match_device(&x_dev, n).unwrap();
    assert!(fed.len() > 300, "sim32: only {} spikes", fed.len());
    // The device's window, read back and matched from the host.
    let pre_dev = det
        .preprocess_only(packer.pack(raw.view()), &probe.yc)
        .unwrap();
    let pre_dev = Array2::from_shape_vec((raw.nrows(), n), pre_dev).unwrap();
    let round_trip = m.match_window(pre_dev.view()).unwrap();
    assert_eq!(
        fed, round_trip,
        "sim32: device-fed against the host round trip"
    );
    let x_dev = det
        .preprocess_to_device(packer.pack(raw.view()), &probe.yc)
        .unwrap();
    assert_eq!(fed, m.match_device(&x_dev, n).unwrap(), "sim32: second run");
    assert_eq!(
        fed,
        m.match_device(&x_dev, n).unwrap(),
        "sim32: the buffer was left as it was"
    );
    // In place: the detector's buffer becomes the residual; the spikes are
    // the same, and preprocessing the window again restores it.
    let x_dev = det
        .preprocess_to_device(packer.pack(raw.view()), &probe.yc)
        .unwrap();
    let in_place = m.match_device_in_place(&x_dev, n).unwrap();
    assert_eq!(Some(&fed), in_place.as_ref(), "sim32: in place");
    let again = det.preprocess_last_again().unwrap();
    assert_eq!(
        fed,
        m.match_device(&again, n).unwrap(),
        "sim32: the window preprocessed again"
    );
    let cpu = match_window(&setup, host_x.view()).unwrap();
    same("sim32 window 0, device-fed", &cpu, &fed);
    // Queued (each window's download completing while the next window's
    // kernels run), copied or in place: the same spikes in the same order
    // as one window at a time, with a window of no spike among them.
    let windows = [
        raw.clone(),
        raw.mapv(|v| 0.5 * v),
        Array2::<f32>::zeros(raw.dim()),
        raw.mapv(|v| -v),
        raw.clone(),
    ];
    let one_at_a_time: Vec<WindowSpikes> = windows
        .iter()
        .map(|w| {
            let x = det
                .preprocess_to_device(packer.pack(w.view()), &probe.yc)
                .unwrap();
            m.match_device(&x, n).unwrap()
        })
        .collect();
    assert!(one_at_a_time[2].is_empty() && !one_at_a_time[1].is_empty());
    assert_ne!(one_at_a_time[0], one_at_a_time[3]);
    for in_place in [false, true] {
        let mut queued = Vec::new();
        for (i, w) in windows.iter().enumerate() {
            let x = det
                .preprocess_to_device(packer.pack(w.view()), &probe.yc)
                .unwrap();
            if in_place {
                assert!(m.queue_device_in_place(&x, n).unwrap());
            } else {
                m.queue_device(&x, n).unwrap();
            }
            queued.extend(m.take_done());
            assert!(queued.len() >= i && queued.len() <= i + 1);
        }
        queued.extend(m.flush().unwrap());
        assert_eq!(queued, one_at_a_time, "sim32: queued, in place {in_place}");
        assert!(m.flush().unwrap().is_empty());
    }
    // A matcher dropped with a window's download still queued (a pass
    // stopped by an error) waits for it; the device's next matcher is right.
    let x = det
        .preprocess_to_device(packer.pack(windows[3].view()), &probe.yc)
        .unwrap();
    m.queue_device(&x, n).unwrap();
    drop(m);
    let mut m = matcher::<R>(device, &setup, 4, false);
    let x = det
        .preprocess_to_device(packer.pack(windows[0].view()), &probe.yc)
        .unwrap();
    assert_eq!(m.match_device(&x, n).unwrap(), one_at_a_time[0]);
}

/// Window 0 of the sim32 recording, made again from its seed
/// (`tests/data/sort/README.md`).
fn sim32_window(wrot: Array2<f32>) -> Array2<f32> {
    use spikecube::preprocess::{PreprocessSettings, Preprocessor};
    let mut x = sim32_raw_window();
    let settings = PreprocessSettings {
        fs: 30_000.0,
        ..PreprocessSettings::default()
    };
    Preprocessor::new(&settings, wrot)
        .unwrap()
        .apply(&mut x)
        .unwrap();
    x
}

/// Window 0 of the sim32 recording as read (sites × (batch_size + 2·nt)),
/// made again from its seed (`tests/data/sort/README.md`).
fn sim32_raw_window() -> Array2<f32> {
    use spikecube::preprocess::PreprocessSettings;
    use spikecube::recording::{Dtype, Format, OpenOptions, WindowPlan, open};
    use spikecube::simulate::{SimConfig, simulate};
    let probe = spikecube::Probe::load(&data("sort/probe32.json")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = SimConfig {
        seconds: 30.0,
        n_units: 36,
        rate_hz: 15.0,
        seed: 7,
        ..SimConfig::default()
    };
    let sum = simulate(&probe, &cfg, &dir.path().join("sim")).unwrap();
    let opened = open(
        &sum.bin_path,
        &OpenOptions {
            format: Format::Binary,
            n_channels: Some(33),
            fs: Some(30_000.0),
            dtype: Dtype::Int16,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    let settings = PreprocessSettings::default();
    let rec = opened.recording;
    let plan = WindowPlan::new(
        rec.n_samples(),
        settings.batch_size as u64,
        settings.nt as u64,
    )
    .unwrap();
    let mut x = Array2::zeros((probe.chan_map.len(), plan.window_len()));
    spikecube::recording::read_window(rec.as_ref(), &plan, 0, &probe.chan_map, &mut x).unwrap();
    x
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    fn device() -> WgpuDevice {
        crate::common::require_vulkan();
        WgpuDevice::DefaultDevice
    }

    #[test]
    fn unit_case_equals_cpu() {
        check_unit::<WgpuRuntime>(&device());
    }

    #[test]
    fn sim32_window_equals_cpu() {
        check_sim32::<WgpuRuntime>(&device());
    }

    #[test]
    fn sim32_window_preprocessed_on_the_device_equals_cpu() {
        check_sim32_device_fed::<WgpuRuntime>(&device());
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cubecl::cuda::{CudaDevice, CudaRuntime};

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn unit_case_equals_cpu() {
        check_unit::<CudaRuntime>(&CudaDevice::new(0));
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn sim32_window_equals_cpu() {
        check_sim32::<CudaRuntime>(&CudaDevice::new(0));
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn sim32_window_preprocessed_on_the_device_equals_cpu() {
        check_sim32_device_fed::<CudaRuntime>(&CudaDevice::new(0));
    }
}
