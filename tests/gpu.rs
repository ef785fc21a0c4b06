//! The GPU detector against its CPU twin (`src/detect/cpu.rs`, itself checked
//! against Kilosort4 in tests/fixtures.rs), on every detection fixture and on
//! random windows and probes.
//!
//! Written once, generic over the CubeCL runtime, and instantiated for wgpu (in
//! CI on Mesa's lavapipe, a software Vulkan: `.ci/run` installs it; a machine
//! without any Vulkan adapter fails these tests with a message saying so) and for
//! CUDA (`#[ignore]`d: they need an NVIDIA GPU; run them there with
//! `cargo test --release --test gpu -- --include-ignored`).
//!
//! What must agree: the detections — (centre, sample), imax and sign — and
//! amp, adist, yct, tF and the dense intermediates, bit for bit. The kernels
//! sum in the CPU's order and round every product as the CPU does
//! (`detect::gpu::exact`), so no compiler's fused multiply-adds change a value.
//! The preprocessing with the f64 IIR high-pass on int16 input, and the
//! whitening fit's covariance where the device has doubles, are the CPU's bits
//! too; the direct high-pass kernel and float input agree to about 1e-6.
#![cfg(any(feature = "cuda", feature = "wgpu"))]

mod common;

use common::{Case, Rng, inject, noise, probe};
use cubecl::Runtime;
use ndarray::Array2;
use spikecube::detect::cpu::{CpuDetector, Detections};
use spikecube::detect::gpu::highpass_iir::HighpassMode;
use spikecube::detect::gpu::{GpuDetector, GpuOptions};
use spikecube::{DetectionSettings, Geometry, Probe, UniversalTemplates};

/// Device IIR high-pass with f64 state against its CPU twin: the same f64
/// recursion up to fused multiply-adds (~1e-12 of max|x|), so the f32 outputs
/// are equal or one rounding apart: |Δ| ≤ 2⁻²³·|y| + 1e-10·max|x|.
const TWIN_F64_REL: f64 = 1.0 / 8_388_608.0;
const TWIN_F64_ABS: f64 = 1e-10;
/// The same with f32 state: bit-identical, as measured on lavapipe (which
/// does not fuse these multiply-adds; f64 state was bit-identical there too).
/// A device that fuses them would differ by up to the f32 recursion's own
/// rounding (3e-4 of max|x|, `src/preprocess/highpass_iir.rs`), and fail here.
const TWIN_F32_REL: f64 = 0.0;
const TWIN_F32_ABS: f64 = 0.0;

/// Every step in its plainest form (Kilosort4's dense arrays).
const DENSE: GpuOptions = GpuOptions {
    pruned: false,
    sparse_peaks: false,
    fb_per_unit: 1,
    upload_chunk: 0,
    hp_per_unit: 8,
    highpass: HighpassMode::Auto,
    whiten_rows_first: false,
    device_f64: true,
};
/// The default: every optimisation on.
const FAST: GpuOptions = GpuOptions {
    pruned: true,
    sparse_peaks: true,
    fb_per_unit: 4,
    upload_chunk: 1 << 20,
    hp_per_unit: 16,
    highpass: HighpassMode::Auto,
    whiten_rows_first: true,
    device_f64: true,
};
/// The other combinations, mixed.
const MIXED: GpuOptions = GpuOptions {
    pruned: false,
    sparse_peaks: true,
    fb_per_unit: 3,
    upload_chunk: 1000,
    hp_per_unit: 16,
    highpass: HighpassMode::Auto,
    whiten_rows_first: true,
    device_f64: true,
};
const MIXED2: GpuOptions = GpuOptions {
    pruned: true,
    sparse_peaks: false,
    fb_per_unit: 2,
    upload_chunk: 0,
    hp_per_unit: 8,
    highpass: HighpassMode::Auto,
    whiten_rows_first: false,
    device_f64: true,
};

fn close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits(),
            "{what}[{i}]: CPU {x} vs GPU {y}"
        );
    }
}

fn same(cpu: &Detections, gpu: &Detections, label: &str) {
    assert_eq!(cpu.len(), gpu.len(), "{label}: detection count");
    assert_eq!(cpu.centre, gpu.centre, "{label}: centres");
    assert_eq!(cpu.sample, gpu.sample, "{label}: samples");
    assert_eq!(cpu.imax, gpu.imax, "{label}: imax");
    assert_eq!(cpu.sign, gpu.sign, "{label}: sign");
    close(&format!("{label} amp"), &cpu.amp, &gpu.amp);
    close(&format!("{label} adist"), &cpu.adist, &gpu.adist);
    close(&format!("{label} yct"), &cpu.yct, &gpu.yct);
    close(&format!("{label} tF"), &cpu.tf, &gpu.tf);
}

fn gpu<R: Runtime>(
    device: &R::Device,
    g: &Geometry,
    s: &DetectionSettings,
    options: GpuOptions,
) -> GpuDetector<R> {
    GpuDetector::<R>::new(
        device,
        "test device".into(),
        g.clone(),
        UniversalTemplates::builtin(),
        s.clone(),
        options,
    )
    .unwrap()
}

/// Every Kilosort4 fixture, with Kilosort4's own neighbourhoods: GPU (fast and
/// dense) equals the CPU detector.
fn check_fixtures<R: Runtime>(device: &R::Device, cases: &[&str]) {
    for name in cases {
        let case = Case::load(name);
        let g = case.kilosort_geometry();
        let s = DetectionSettings {
            nearest_chans: g.n_chans(),
            ..case.settings.clone()
        };
        let mut cpu =
            CpuDetector::new(g.clone(), UniversalTemplates::builtin(), s.clone()).unwrap();
        let want = cpu.detect(case.x.view(), &case.probe.yc).unwrap();
        assert!(!want.is_empty(), "{name}: the fixture has detections");
        for (label, opt) in [
            ("fast", FAST),
            ("dense", DENSE),
            ("mixed", MIXED),
            ("mixed2", MIXED2),
        ] {
            let mut det = gpu::<R>(device, &g, &s, opt);
            let got = det.detect(case.x.view(), &case.probe.yc).unwrap();
            same(&want, &got, &format!("{name} {label}"));
            // Buffers persist across windows: a second window gives the same again.
            let again = det.detect(case.x.view(), &case.probe.yc).unwrap();
            assert_eq!(got, again, "{name} {label}: second call");
        }
    }
}

/// Dense intermediates (As, imaxs, neighbour max) against the CPU's dense arrays.
fn check_intermediates<R: Runtime>(device: &R::Device, name: &str) {
    let case = Case::load(name);
    let g = case.kilosort_geometry();
    let s = DetectionSettings {
        nearest_chans: g.n_chans(),
        ..case.settings.clone()
    };
    let mut cpu = CpuDetector::new(g.clone(), UniversalTemplates::builtin(), s.clone()).unwrap();
    let want = cpu.intermediates(case.x.view(), &case.probe.yc).unwrap();
    for opt in [DENSE, FAST] {
        let mut det = gpu::<R>(device, &g, &s, opt);
        let (as_, imax, amax) = det.intermediates(case.x.view(), &case.probe.yc).unwrap();
        let nt_w = case.x.ncols();
        let nt = s.nt;
        let mut imax_diff = 0;
        for j in 0..g.n_centres() {
            for t in 0..nt_w {
                let i = j * nt_w + t;
                let (a, b) = (want.as_[[j, t]], as_[i]);
                assert!(
                    a.to_bits() == b.to_bits(),
                    "{name} As[{j}, {t}]: {a} vs {b}"
                );
                let (rc, rg) = (want.imax_signed[[j, t]] as i32, imax[i]);
                if rc != rg {
                    // Only a float tie may pick another winner: the two filters' |A|
                    // (recomputed in float64) must agree to float32 rounding.
                    imax_diff += 1;
                    let a = a_values_f64(&case.x, &g, j, t);
                    let best = a.iter().fold(0f64, |m, v| m.max(v.abs()));
                    let (vc, vg) = (
                        a[rc.unsigned_abs() as usize - 1].abs(),
                        a[rg.unsigned_abs() as usize - 1].abs(),
                    );
                    assert!(
                        (vc - vg).abs() <= 1e-5 * best.max(1.0),
                        "{name} imaxs[{j}, {t}]: CPU {rc} (|A| {vc}), GPU {rg} (|A| {vg}): not a tie"
                    );
                }
                let edge = t < nt || t + nt >= nt_w;
                if !edge {
                    let (a, b) = (want.amax_prepool[[j, t]], amax[i]);
                    assert!(
                        a.to_bits() == b.to_bits(),
                        "{name} Amax[{j}, {t}]: {a} vs {b}"
                    );
                }
            }
        }
        // A different winner is possible only where two of the 30 filters tie to float32
        // rounding (checked above); such points are rare.
        assert!(
            imax_diff * 10_000 <= g.n_centres() * nt_w,
            "{name}: imaxs differs at {imax_diff} points"
        );
        if imax_diff > 0 {
            eprintln!(
                "{name}: imaxs differs at {imax_diff} points, each a float32 tie between two filters"
            );
        }
    }
}

/// The nsz·6 filter outputs A[r] at (centre j, sample t) in float64, from the window.
fn a_values_f64(x: &Array2<f32>, g: &Geometry, j: usize, t: usize) -> Vec<f64> {
    let tpl = UniversalTemplates::builtin();
    let (nk, ntaps, nc, nsz) = (6, tpl.wtemp.ncols(), g.n_chans(), g.n_sizes());
    let half = (ntaps / 2) as isize;
    let mut b = vec![0f64; nc * nk];
    for c in 0..nc {
        let s = g.i_c[[c, j]] as usize;
        for k in 0..nk {
            b[c * nk + k] = (0..ntaps)
                .map(|m| {
                    let tt = t as isize + m as isize - half;
                    if tt >= 0 && (tt as usize) < x.ncols() {
                        tpl.wtemp[[k, m]] as f64 * x[[s, tt as usize]] as f64
                    } else {
                        0.0
                    }
                })
                .sum();
        }
    }
    (0..nsz * nk)
        .map(|r| {
            let (z, k) = (r / nk, r % nk);
            (0..nc)
                .map(|c| g.weigh[[z, c, j]] as f64 * b[c * nk + k])
                .sum()
        })
        .collect()
}

/// Random small probes and windows with odd sizes (not multiples of any tile),
/// spikes injected at random places including the window edges.
fn check_random<R: Runtime>(device: &R::Device, n_cases: u64) {
    for seed in 1..=n_cases {
        let mut rng = Rng(seed * 7919 + 13);
        let n_col = 1 + (rng.uniform() * 3.0) as usize;
        let n_row = 3 + (rng.uniform() * 12.0) as usize;
        let pitch = [10.0f32, 15.0, 20.0, 25.0][(rng.uniform() * 4.0) as usize];
        let mut xy = Vec::new();
        for r in 0..n_row {
            for c in 0..n_col {
                xy.push((c as f32 * 16.0 + (r % 2) as f32 * 8.0, r as f32 * pitch));
            }
        }
        let p: Probe = probe(&xy, &vec![0; xy.len()]);
        let s = DetectionSettings {
            nearest_chans: 10.min(xy.len()),
            nearest_templates: 5 + (rng.uniform() * 100.0) as usize,
            ..DetectionSettings::default()
        };
        let g = Geometry::new(&p, &s).unwrap();
        let nt_w = 2 * 61 + 200 + (rng.uniform() * 900.0) as usize;
        let mut x: Array2<f32> = noise(xy.len(), nt_w, seed);
        for _ in 0..(3 + (rng.uniform() * 10.0) as usize) {
            let t0 = (rng.uniform() * nt_w as f64) as usize;
            let centre = (rng.uniform() * xy.len() as f64) as usize;
            let (cx, cy) = xy[centre];
            let gains: Vec<f32> = xy
                .iter()
                .map(|&(x, y)| (-((x - cx).powi(2) + (y - cy).powi(2)) / 900.0).exp())
                .collect();
            let k = (rng.uniform() * 6.0) as usize;
            let amp =
                (12.0 + rng.uniform() * 40.0) as f32 * if rng.uniform() < 0.2 { -1.0 } else { 1.0 };
            inject(&mut x, t0, k, amp, &gains);
        }
        let mut cpu =
            CpuDetector::new(g.clone(), UniversalTemplates::builtin(), s.clone()).unwrap();
        let want = cpu.detect_dense(x.view(), &p.yc).unwrap();
        for (label, opt) in [
            ("fast", FAST),
            ("dense", DENSE),
            ("mixed", MIXED),
            ("mixed2", MIXED2),
        ] {
            let mut det = gpu::<R>(device, &g, &s, opt);
            let got = det.detect(x.view(), &p.yc).unwrap();
            same(
                &want,
                &got,
                &format!("random case {seed} ({n_col}×{n_row}, NT {nt_w}) {label}"),
            );
        }
    }
}

/// More detections than the first buffers hold: the buffers grow and nothing is dropped.
fn check_overflow<R: Runtime>(device: &R::Device) {
    let xy: Vec<(f32, f32)> = (0..8).map(|r| (0.0, r as f32 * 20.0)).collect();
    let p = probe(&xy, &[0; 8]);
    // A low threshold on noise: thousands of local maxima.
    let s = DetectionSettings {
        th_universal: 0.5,
        nearest_chans: 8,
        nearest_templates: 1,
        ..DetectionSettings::default()
    };
    let g = Geometry::new(&p, &s).unwrap();
    let x = noise(8, 2 * 61 + 40_000, 99);
    let mut cpu = CpuDetector::new(g.clone(), UniversalTemplates::builtin(), s.clone()).unwrap();
    let want = cpu.detect(x.view(), &p.yc).unwrap();
    assert!(
        want.len() > 4096,
        "the case must overflow the first buffers: {}",
        want.len()
    );
    let mut det = gpu::<R>(device, &g, &s, FAST);
    let got = det.detect(x.view(), &p.yc).unwrap();
    same(&want, &got, "overflow");
}

/// Bad input is the CPU's error, not a device failure.
fn check_bad_input<R: Runtime>(device: &R::Device) {
    let case = Case::load("tetrode_like");
    let g = case.kilosort_geometry();
    let s = DetectionSettings {
        nearest_chans: g.n_chans(),
        ..DetectionSettings::default()
    };
    let mut det = gpu::<R>(device, &g, &s, FAST);
    let mut x = case.x.clone();
    x[[1, 100]] = f32::NAN;
    let e = det
        .detect(x.view(), &case.probe.yc)
        .unwrap_err()
        .to_string();
    assert!(e.contains("non-finite"), "{e}");
    // A window larger than the device's largest buffer is an error that names
    // the batch size that fits, never a failure inside the GPU library.
    let too_long = det.max_window_samples(case.x.nrows()) + 1;
    if too_long < 50_000_000 {
        let big = Array2::<f32>::zeros((case.x.nrows(), too_long));
        let e = det
            .detect(big.view(), &case.probe.yc)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--batch-size") && e.contains("--backend cpu"),
            "{e}"
        );
    }
    let short = Array2::<f32>::zeros((case.x.nrows(), 100));
    let e = det
        .detect(short.view(), &case.probe.yc)
        .unwrap_err()
        .to_string();
    assert!(e.contains("2·nt + 1"), "{e}");
}

/// A raw int16-valued window (C × n) like a probe's: a slow LFP-like wave shared
/// by all channels plus per-channel offsets, noise of sd 15 counts and spikes of
/// 40–200 counts spread over nearby sites.
fn raw_window(xy: &[(f32, f32)], n: usize, seed: u64) -> Array2<f32> {
    let mut rng = Rng(seed * 104_729 + 7);
    let c = xy.len();
    let mut x = noise(c, n, seed).mapv(|v| v * 15.0);
    for ch in 0..c {
        let offset = (rng.uniform() * 400.0 - 200.0) as f32;
        for t in 0..n {
            let lfp = 300.0 * (t as f32 * 0.0021).sin()
                + 80.0 * (t as f32 * 0.013 + ch as f32 * 0.01).cos();
            x[[ch, t]] += lfp + offset;
        }
    }
    for _ in 0..(n / 400).max(3) {
        let t0 = (rng.uniform() * n as f64) as usize;
        let centre = (rng.uniform() * c as f64) as usize;
        let (cx, cy) = xy[centre];
        let gains: Vec<f32> = xy
            .iter()
            .map(|&(x, y)| (-((x - cx).powi(2) + (y - cy).powi(2)) / 900.0).exp())
            .collect();
        let k = (rng.uniform() * 6.0) as usize;
        let amp = (40.0 + rng.uniform() * 160.0) as f32;
        inject(&mut x, t0, k, amp, &gains);
    }
    x.mapv(|v| v.round().clamp(-32768.0, 32767.0))
}

/// Device preprocessing (means, median CAR, high-pass, whitening) against the
/// CPU's [`Preprocessor`], then detection on each: whitened values within 1e-4 of
/// the window's largest magnitude, and the same detections. Cases: int16 values
/// (packed two per word) and float32 values, even and odd window lengths, CAR
/// on and off, an even and an odd number of sites; the high-pass the device
/// picks (the f64 IIR where it has doubles) and the direct kernel, alternately.
fn check_preprocessing<R: Runtime>(
    device: &R::Device,
    n: usize,
    packer: &spikecube::detect::gpu::Packer,
    setup: &dyn Fn(&mut GpuDetector<R>),
) {
    use spikecube::preprocess::{DEVICE_TAP_FLOOR, PreprocessSettings, Preprocessor};
    for (case, (n_sites, odd, do_car, float)) in [
        (32usize, false, true, false),
        (31, true, true, false),
        (32, false, false, false),
        (17, true, true, true),
        (161, false, true, false),
        (23, true, true, true),
    ]
    .into_iter()
    .enumerate()
    {
        let xy: Vec<(f32, f32)> = (0..n_sites)
            .map(|r| ((r % 2) as f32 * 32.0, (r / 2) as f32 * 20.0))
            .collect();
        let p: Probe = probe(&xy, &vec![0; n_sites]);
        let batch = n - 122 + usize::from(odd);
        let settings = PreprocessSettings {
            batch_size: batch,
            do_car,
            ..PreprocessSettings::default()
        };
        let nw = settings.window_len();
        let mut raw = raw_window(&xy, nw, case as u64 + 1);
        if float {
            raw.mapv_inplace(|v| v * 0.37 + 0.1);
        }
        if case == 0 {
            // A DC offset, as probes have: channel sums past 2²⁴, which float32
            // would round before the mean.
            raw.mapv_inplace(|v| v + 3000.0);
        }
        let pre = Preprocessor::fit(
            1,
            |_| -> Result<Array2<f32>, spikecube::error::PreprocessError> { Ok(raw.clone()) },
            &p,
            &settings,
        )
        .unwrap();
        let mut want = raw.clone();
        pre.apply(&mut want).unwrap();
        let s = DetectionSettings {
            nearest_chans: 10.min(n_sites),
            ..DetectionSettings::default()
        };
        let g = Geometry::new(&p, &s).unwrap();
        // The IIR high-pass where the device has doubles, and the direct kernel
        // with both tilings (8 and 16 outputs per unit), alternately; with the
        // direct kernel also the float32 covariance and means of devices
        // without doubles.
        let f64_forms = case % 2 == 0 || float && case > 4;
        let options = GpuOptions {
            device_f64: f64_forms,
            hp_per_unit: if case % 4 == 1 { 8 } else { 16 },
            highpass: if f64_forms {
                HighpassMode::Auto
            } else {
                HighpassMode::Direct
            },
            ..FAST
        };
        let mut det = gpu::<R>(device, &g, &s, options);
        let form = pre.device_form(DEVICE_TAP_FLOOR).unwrap();
        det.set_preprocessing(&form).unwrap();
        setup(&mut det);
        let packed = packer.pack(raw.view());
        assert_eq!(packed.packed, !float, "case {case}: packing");
        let got = det.preprocess_only(packed, &p.yc).unwrap();
        let peak = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let (mut worst, mut ss) = (0f32, 0f64);
        for (a, b) in want.iter().zip(&got) {
            worst = worst.max((a - b).abs());
            ss += f64::from(a - b).powi(2);
        }
        let rms = (ss / got.len() as f64).sqrt();
        eprintln!(
            "device preprocessing case {case} ({n_sites} sites, N {nw}, CAR {do_car}, float {float}, high-pass {}): max |Δ| {worst:.3e} = {:.2e} of the peak {peak:.1}, rms Δ {rms:.2e}; direct kernel's tail bound {:.1e}",
            det.highpass_form(),
            worst / peak,
            form.dropped_tail
        );
        // With the f64 IIR the device runs the CPU's arithmetic (channel
        // means from the CPU's f64 sums: exact for int16 input, in its order
        // for float input; the same median, the IIR twin's f64 recursion with
        // each product rounded, the CSR whitening's sums): the same bits. The
        // direct kernel and the float32 forms round differently.
        if det.highpass_form() == "iir-f64" {
            let differ = want
                .iter()
                .zip(&got)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "case {case}: {differ} preprocessed values differ from the CPU's"
            );
        }
        if worst > 1e-4 * peak {
            // Where does the device depart from the CPU?
            let mut car = raw.clone();
            spikecube::preprocess::common_reference(&mut car, do_car).unwrap();
            let mut hp = car.clone();
            pre.highpass().apply(&mut hp).unwrap();
            for (stage, want) in [(2, &car), (3, &hp)] {
                let got = det
                    .preprocess_stage(packer.pack(raw.view()), &p.yc, stage)
                    .unwrap();
                let mut bad = 0;
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    if (a - b).abs() > 1e-3 * a.abs().max(1.0) {
                        if bad < 4 {
                            eprintln!("stage {stage} [{}, {}]: CPU {a} device {b}", i / nw, i % nw);
                        }
                        bad += 1;
                    }
                }
                eprintln!("stage {stage}: {bad} values differ");
            }
        }
        assert!(
            worst <= 1e-4 * peak,
            "case {case}: max |Δ| {worst} vs peak {peak}"
        );
        // The median CAR alone: the device's lower median is the CPU's (the
        // means may differ by an ulp or two, nothing more).
        if do_car {
            let mut car = raw.clone();
            spikecube::preprocess::common_reference(&mut car, true).unwrap();
            let got = det
                .preprocess_stage(packer.pack(raw.view()), &p.yc, 2)
                .unwrap();
            // Bound: a few ulps of the row's largest raw value (its mean is
            // below that) plus of the value itself.
            let nw = raw.ncols();
            let big: Vec<f32> = raw
                .rows()
                .into_iter()
                .map(|row| row.iter().fold(0f32, |m, v| m.max(v.abs())))
                .collect();
            for (i, (a, b)) in car.iter().zip(&got).enumerate() {
                let r = i / nw;
                let bound = 4.0 * f32::EPSILON * (big[r] + a.abs());
                assert!(
                    (a - b).abs() <= bound,
                    "case {case}: median CAR at [{r}, {}]: CPU {a}, device {b}",
                    i % nw
                );
            }
        }
        let mut cpu =
            CpuDetector::new(g.clone(), UniversalTemplates::builtin(), s.clone()).unwrap();
        let want_det = cpu.detect(want.view(), &p.yc).unwrap();
        let got_det = det
            .detect_raw(packer.pack(raw.view()), &p.yc, None)
            .unwrap();
        assert!(
            !want_det.is_empty(),
            "case {case}: no detections to compare"
        );
        assert_eq!(want_det.centre, got_det.centre, "case {case}: centres");
        assert_eq!(want_det.sample, got_det.sample, "case {case}: samples");
        assert_eq!(want_det.imax, got_det.imax, "case {case}: imax");
        assert_eq!(want_det.sign, got_det.sign, "case {case}: sign");
        // Buffers persist: a second window gives the same detections again.
        let again = det
            .detect_raw(packer.pack(raw.view()), &p.yc, None)
            .unwrap();
        assert_eq!(got_det, again, "case {case}: second call");
        // The whitening fit's covariance of this window, device against CPU.
        let cpu_cc = spikecube::preprocess::whitening_covariance(
            1,
            |_| -> Result<Array2<f32>, spikecube::error::PreprocessError> { Ok(raw.clone()) },
            &p,
            &settings,
        )
        .unwrap();
        let nt = settings.nt;
        let gram = det
            .window_gram(packer.pack(raw.view()), &p.yc, nt, nw - nt)
            .unwrap();
        let inv_t = 1.0 / (nw - 2 * nt) as f64;
        let top = cpu_cc.iter().fold(0f64, |a, v| a.max(v.abs()));
        let worst = cpu_cc
            .iter()
            .zip(gram.iter())
            .fold(0f64, |a, (w, g)| a.max((w - g * inv_t).abs()));
        eprintln!(
            "whitening covariance case {case}: max |Δ| {worst:.3e} = {:.2e} of the largest entry {top:.3e}",
            worst / top
        );
        assert!(
            worst <= 1e-5 * top,
            "case {case}: covariance differs by {worst} (largest entry {top})"
        );
        // From the same high-passed window, the device's Gram matrix has the
        // CPU's bits where the device has doubles.
        if f64_forms && spikecube::detect::gpu::highpass_iir::supports_f64(&R::client(device)) {
            let filtered = det
                .preprocess_stage(packer.pack(raw.view()), &p.yc, 3)
                .unwrap();
            let filtered = Array2::from_shape_vec((n_sites, nw), filtered).unwrap();
            let gram = det
                .window_gram(packer.pack(raw.view()), &p.yc, nt, nw - nt)
                .unwrap();
            let mut cc = Array2::<f64>::zeros((n_sites, n_sites));
            spikecube::preprocess::accumulate_covariance(
                &mut cc,
                filtered.slice(ndarray::s![.., nt..nw - nt]),
            )
            .unwrap();
            let differ = cc
                .iter()
                .zip(gram.iter())
                .filter(|(w, g)| w.to_bits() != (*g * inv_t).to_bits())
                .count();
            assert_eq!(
                differ, 0,
                "case {case}: {differ} covariance entries differ from the CPU's"
            );
        }
    }
}

/// The device's IIR high-pass (`mode`: f64 or f32 state) against its CPU twin
/// (`CircularIir`, same state type and chunks) run on the device's own CAR
/// output, so that only the high-pass is compared: |Δ| ≤ `rel`·|y| + `abs`·max|x|
/// per value. With f64 state, also the device's high-pass against the CPU's FFT
/// high-pass ([`Preprocessor::highpass`]) on the CPU's CAR output: within 1e-5
/// of max|x| (the twin measured 8.4e-7; the CARs differ by a few f32 ulps).
/// Cases: (sites, N) with even and odd N (shift 1), N a multiple of the chunk
/// or not, N below one chunk.
fn check_highpass_iir<R: Runtime>(
    device: &R::Device,
    mode: HighpassMode,
    cases: &[(usize, usize)],
    rel: f64,
    abs: f64,
) {
    use spikecube::detect::gpu::highpass_iir::iir_chunk;
    use spikecube::preprocess::{DEVICE_TAP_FLOOR, PreprocessSettings, Preprocessor};
    let f64_state = mode != HighpassMode::IirF32;
    let chunk = iir_chunk();
    for (case, &(n_sites, nw)) in cases.iter().enumerate() {
        let xy: Vec<(f32, f32)> = (0..n_sites)
            .map(|r| ((r % 2) as f32 * 32.0, (r / 2) as f32 * 20.0))
            .collect();
        let p: Probe = probe(&xy, &vec![0; n_sites]);
        let settings = PreprocessSettings {
            batch_size: nw - 122,
            ..PreprocessSettings::default()
        };
        assert_eq!(settings.window_len(), nw);
        let raw = raw_window(&xy, nw, case as u64 + 40);
        let pre = Preprocessor::new(&settings, Array2::eye(n_sites)).unwrap();
        let iir = pre
            .highpass_iir()
            .expect("an IIR form for this window")
            .clone();
        let s = DetectionSettings {
            nearest_chans: 10.min(n_sites),
            ..DetectionSettings::default()
        };
        let g = Geometry::new(&p, &s).unwrap();
        let options = GpuOptions {
            highpass: mode,
            ..FAST
        };
        let mut det = gpu::<R>(device, &g, &s, options);
        det.set_preprocessing(&pre.device_form(DEVICE_TAP_FLOOR).unwrap())
            .unwrap();
        let want_form = if f64_state { "iir-f64" } else { "iir-f32" };
        assert_eq!(det.highpass_form(), want_form, "case {case}");
        let packer = spikecube::detect::gpu::Packer::default();
        let car = det
            .preprocess_stage(packer.pack(raw.view()), &p.yc, 2)
            .unwrap();
        let got = det
            .preprocess_stage(packer.pack(raw.view()), &p.yc, 3)
            .unwrap();
        let mut twin = Array2::from_shape_vec((n_sites, nw), car.clone()).unwrap();
        if f64_state {
            iir.apply::<f64>(&mut twin, chunk).unwrap();
        } else {
            iir.apply::<f32>(&mut twin, chunk).unwrap();
        }
        let scale = car.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
        let mut worst = 0f64;
        for (i, (&w, &d)) in twin.iter().zip(&got).enumerate() {
            let diff = f64::from((w - d).abs());
            worst = worst.max(diff / scale);
            assert!(
                diff <= rel * f64::from(w.abs()) + abs * scale,
                "case {case} ({n_sites} × {nw}, {want_form}) at [{}, {}]: twin {w}, device {d}",
                i / nw,
                i % nw
            );
        }
        eprintln!(
            "IIR high-pass case {case} ({n_sites} × {nw}, {want_form}, chunk {chunk}): max |device − twin| = {worst:.2e} of max|x| {scale:.1}"
        );
        if f64_state {
            let mut cpu_car = raw.clone();
            spikecube::preprocess::common_reference(&mut cpu_car, true).unwrap();
            let mut cpu_hp = cpu_car.clone();
            pre.highpass().apply(&mut cpu_hp).unwrap();
            let worst = cpu_hp
                .iter()
                .zip(&got)
                .fold(0f64, |m, (a, b)| m.max(f64::from((a - b).abs())))
                / scale;
            eprintln!("IIR high-pass case {case}: max |device − CPU| = {worst:.2e} of max|x|");
            assert!(
                worst <= 1e-5,
                "case {case}: device − CPU {worst:.2e} of max|x|"
            );
        }
    }
}

// ---- windows queued on the device (submit_raw / collect) ----
/// The set-up of the checks of windows run on the device as a pass runs
/// them: a probe of `n_sites` sites in two columns, rows `pitch` µm apart;
/// `n_windows` raw windows of 6 000 samples plus padding (seeds from `seed`);
/// W fitted on the first; the device form of that preprocessing; detection
/// settings with 10 nearest channels, and their geometry.
struct Windows {
    p: Probe,
    windows: Vec<Array2<f32>>,
    pre: spikecube::preprocess::Preprocessor,
    form: spikecube::preprocess::DevicePreprocessing,
    s: DetectionSettings,
    g: Geometry,
}

fn small_windows(n_sites: usize, pitch: f32, n_windows: u64, seed: u64) -> Windows {
    use spikecube::preprocess::{DEVICE_TAP_FLOOR, PreprocessSettings, Preprocessor};
    let xy: Vec<(f32, f32)> = (0..n_sites)
        .map(|r| ((r % 2) as f32 * 32.0, (r / 2) as f32 * pitch))
        .collect();
    let p: Probe = probe(&xy, &vec![0; n_sites]);
    let settings = PreprocessSettings {
        batch_size: 6000,
        ..PreprocessSettings::default()
    };
    let nw = settings.window_len();
    let windows: Vec<Array2<f32>> = (0..n_windows)
        .map(|k| raw_window(&xy, nw, seed + k))
        .collect();
    let first = windows[0].clone();
    let pre = Preprocessor::fit(
        1,
        |_| -> Result<Array2<f32>, spikecube::error::PreprocessError> { Ok(first.clone()) },
        &p,
        &settings,
    )
    .unwrap();
    let form = pre.device_form(DEVICE_TAP_FLOOR).unwrap();
    let s = DetectionSettings {
        nearest_chans: 10,
        ..DetectionSettings::default()
    };
    let g = Geometry::new(&p, &s).unwrap();
    Windows {
        p,
        windows,
        pre,
        form,
        s,
        g,
    }
}

/// Windows queued on the device ([`GpuDetector::submit_raw`] and
/// [`GpuDetector::collect`], the pipelined pass) give, in order, exactly each
/// window's [`GpuDetector::detect_raw`] detections; also when a window has
/// more detections than the peak buffers hold, so that it and the window
/// queued after it run again. `prepare` sets up the detector and returns the
/// packer to use (CUDA: page-locked memory and the two upload buffers, whose
/// windows `sent` says must go ahead).
fn check_queue<R: Runtime>(
    device: &R::Device,
    prepare: &dyn Fn(&mut GpuDetector<R>, usize) -> spikecube::detect::gpu::Packer,
    sent: bool,
) {
    let Windows {
        p,
        windows,
        form,
        s,
        g,
        ..
    } = small_windows(32, 20.0, 5, 40);
    let plain = spikecube::detect::gpu::Packer::default();
    let mut one = gpu::<R>(device, &g, &s, FAST);
    one.set_preprocessing(&form).unwrap();
    let want: Vec<Detections> = windows
        .iter()
        .map(|w| one.detect_raw(plain.pack(w.view()), &p.yc, None).unwrap())
        .collect();
    assert!(
        want.iter().all(|d| !d.is_empty()),
        "windows without detections"
    );
    let bytes = plain.pack(windows[0].view()).n_bytes();
    for cap in [None, Some(1)] {
        let mut det = gpu::<R>(device, &g, &s, FAST);
        det.set_preprocessing(&form).unwrap();
        let packer = prepare(&mut det, bytes);
        if let Some(c) = cap {
            det.set_peak_capacity(c);
        }
        let mut got = Vec::new();
        for w in &windows {
            let raw = packer.send_ahead(packer.pack(w.view()));
            assert_eq!(raw.is_sent(), sent, "window sent ahead");
            det.submit_raw(raw, &p.yc).unwrap();
            // One window stays queued, as in the pass.
            while det.pending_windows() > 1 {
                got.push(det.collect().unwrap().expect("a queued window"));
            }
        }
        while let Some(d) = det.collect().unwrap() {
            got.push(d);
        }
        assert_eq!(got.len(), windows.len(), "capacity {cap:?}: windows back");
        for (k, (a, b)) in want.iter().zip(&got).enumerate() {
            assert_eq!(a, b, "capacity {cap:?}: window {k}");
        }
    }
}

/// A window started from the copy of its high-passed samples the first pass
/// kept ([`GpuDetector::copy_filtered_next`], [`GpuDetector::submit_filtered`]:
/// the drift-corrected pass of a sort) gives exactly the detections of the raw
/// window preprocessed with the same (other) whitening; also when a window has
/// more detections than the peak buffers hold and runs again after its buffer
/// was overwritten with its whitened samples. The first pass, which makes the
/// copies, is unchanged by them.
fn check_filtered<R: Runtime>(device: &R::Device) {
    let Windows {
        p,
        windows,
        pre,
        form,
        s,
        g,
    } = small_windows(32, 20.0, 4, 60);
    // Another whitening for the second pass, as a drift-corrected matrix
    // replaces W: W's entries scaled by 1.10, 1.15 or 1.20 in turn.
    let (start, cols, vals) = pre.whitening().csr();
    let vals2: Vec<f32> = vals
        .iter()
        .enumerate()
        .map(|(i, v)| v * (1.1 + 0.05 * (i % 3) as f32))
        .collect();
    let plain = spikecube::detect::gpu::Packer::default();
    let mut one = gpu::<R>(device, &g, &s, FAST);
    one.set_preprocessing(&form).unwrap();
    let want1: Vec<Detections> = windows
        .iter()
        .map(|w| one.detect_raw(plain.pack(w.view()), &p.yc, None).unwrap())
        .collect();
    one.set_whitening(&start, &cols, &vals2).unwrap();
    let want2: Vec<Detections> = windows
        .iter()
        .map(|w| one.detect_raw(plain.pack(w.view()), &p.yc, None).unwrap())
        .collect();
    assert!(
        want2.iter().all(|d| !d.is_empty()) && want1 != want2,
        "the second whitening detects, and differently"
    );
    for cap in [None, Some(1)] {
        let mut det = gpu::<R>(device, &g, &s, FAST);
        det.set_preprocessing(&form).unwrap();
        if let Some(c) = cap {
            det.set_peak_capacity(c);
        }
        let mut copies = Vec::new();
        let mut got = Vec::new();
        for w in &windows {
            det.copy_filtered_next();
            det.submit_raw(plain.pack(w.view()), &p.yc).unwrap();
            copies.push(
                det.take_filtered_copy()
                    .expect("a copy of the high-passed window"),
            );
            while det.pending_windows() > 1 {
                got.push(det.collect().unwrap().expect("a queued window"));
            }
        }
        while let Some(d) = det.collect().unwrap() {
            got.push(d);
        }
        assert_eq!(got, want1, "capacity {cap:?}: the first pass");
        assert!(det.take_filtered_copy().is_none(), "one copy per request");
        det.set_whitening(&start, &cols, &vals2).unwrap();
        let mut got = Vec::new();
        for h in &copies {
            det.submit_filtered(h.clone(), &p.yc).unwrap();
            while det.pending_windows() > 1 {
                got.push(det.collect().unwrap().expect("a queued window"));
            }
        }
        while let Some(d) = det.collect().unwrap() {
            got.push(d);
        }
        for (k, (a, b)) in want2.iter().zip(&got).enumerate() {
            assert_eq!(
                a, b,
                "capacity {cap:?}: window {k} from its high-passed copy"
            );
        }
        assert_eq!(got.len(), windows.len());
    }
}

/// The whitening kernel's layouts of cubes (rows first, the default, and
/// samples first) give the same whitened window
/// bit for bit, with the fitted W and with a wider matrix (as drift
/// correction's M_b·W is).
fn check_whiten_grid<R: Runtime>(device: &R::Device) {
    let Windows {
        p,
        windows,
        form,
        s,
        g,
        ..
    } = small_windows(48, 15.0, 1, 77);
    let raw = &windows[0];
    let packer = spikecube::detect::gpu::Packer::default();
    // A dense 48 × 48 matrix: every row reads every row.
    let (c, _) = raw.dim();
    let start: Vec<u32> = (0..=c as u32).map(|r| r * c as u32).collect();
    let cols: Vec<u32> = (0..c * c).map(|i| (i % c) as u32).collect();
    let vals: Vec<f32> = (0..c * c)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 500.0)
        .collect();
    let mut outs = Vec::new();
    for rows_first in [true, false] {
        let options = GpuOptions {
            whiten_rows_first: rows_first,
            device_f64: true,
            ..FAST
        };
        let mut det = gpu::<R>(device, &g, &s, options);
        det.set_preprocessing(&form).unwrap();
        let fitted = det.preprocess_only(packer.pack(raw.view()), &p.yc).unwrap();
        det.set_whitening(&start, &cols, &vals).unwrap();
        let dense = det.preprocess_only(packer.pack(raw.view()), &p.yc).unwrap();
        outs.push((fitted, dense));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    assert!(outs[0].0.iter().any(|&v| v != 0.0), "a whitened window");
    assert_eq!(
        bits(&outs[0].0),
        bits(&outs[1].0),
        "fitted W, samples first"
    );
    assert_eq!(
        bits(&outs[0].1),
        bits(&outs[1].1),
        "dense matrix, samples first"
    );
}
/// The template learning's clips cut on the device
/// ([`GpuDetector::learning_clips`]) are, bit for bit, the host's
/// ([`ClipCut::cut`]) on the same window whitened on the device and read
/// back ([`GpuDetector::preprocess_only`]); at Kilosort4's `Th_single_ch` (6) and at lower thresholds, where
/// many peaks are close together and fewer are isolated (at 2, none here:
/// the window with no clips).
fn check_learning_clips<R: Runtime>(device: &R::Device) {
    use spikecube::detect::learn::ClipCut;
    let Windows {
        p,
        windows,
        form,
        s,
        g,
        ..
    } = small_windows(48, 15.0, 3, 91);
    let packer = spikecube::detect::gpu::Packer::default();
    let mut det = gpu::<R>(device, &g, &s, FAST);
    det.set_preprocessing(&form).unwrap();
    let mut clips = [0usize; 4];
    for (k, th) in [6.0f32, 4.0, 3.0, 2.0].into_iter().enumerate() {
        let cut = ClipCut {
            th_single_ch: th,
            nt: s.nt,
            nt0min: s.nt0min(),
        };
        for (i, w) in windows.iter().enumerate() {
            let mut x = det.preprocess_only(packer.pack(w.view()), &p.yc).unwrap();
            x.truncate(w.len());
            let x = Array2::from_shape_vec(w.dim(), x).unwrap();
            let want = cut.cut(x.view());
            let got = det
                .learning_clips(packer.pack(w.view()), &p.yc, &cut)
                .unwrap();
            assert_eq!(got.dim(), want.dim(), "th {th}, window {i}");
            let bits = |a: &Array2<f32>| a.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&got), bits(&want), "th {th}, window {i}");
            clips[k] += got.nrows();
        }
    }
    assert!(
        clips[..3].iter().all(|&n| n > 0),
        "clips at thresholds 6, 4, 3, 2: {clips:?}"
    );
}
// ---- end of the queued windows ----

#[cfg(feature = "wgpu")]
mod wgpu {
    use super::*;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    /// lavapipe runs about 1 GFLOP/s: the 384-channel fixtures take a few seconds each.
    fn device() -> WgpuDevice {
        crate::common::require_vulkan();
        WgpuDevice::DefaultDevice
    }

    #[test]
    fn fixtures_small() {
        check_fixtures::<WgpuRuntime>(&device(), &["tetrode_like", "linear32"]);
    }
    #[test]
    fn fixtures_np() {
        check_fixtures::<WgpuRuntime>(
            &device(),
            &["np2_1shank", "np1", "np2_4shank", "np2_4shank_staggered"],
        );
    }
    #[test]
    fn intermediates() {
        check_intermediates::<WgpuRuntime>(&device(), "tetrode_like");
        check_intermediates::<WgpuRuntime>(&device(), "linear32");
    }
    #[test]
    fn random() {
        check_random::<WgpuRuntime>(&device(), 12);
    }
    #[test]
    fn overflow() {
        check_overflow::<WgpuRuntime>(&device());
    }
    #[test]
    fn bad_input() {
        check_bad_input::<WgpuRuntime>(&device());
    }
    #[test]
    fn preprocessing() {
        check_preprocessing::<WgpuRuntime>(&device(), 6122, &Default::default(), &|_| {});
    }
    /// The IIR with f64 state: lavapipe advertises doubles (`SHADER_F64`), so
    /// this is also the high-pass `Auto` picks there.
    #[test]
    fn highpass_iir_f64() {
        check_highpass_iir::<WgpuRuntime>(
            &device(),
            HighpassMode::Iir,
            &[(5, 6122), (3, 6123)],
            TWIN_F64_REL,
            TWIN_F64_ABS,
        );
    }
    /// The IIR kernels' indexing with f32 state (the form for devices without
    /// doubles, for tests only) against the CPU twin with f32 state.
    #[test]
    fn highpass_iir_f32() {
        check_highpass_iir::<WgpuRuntime>(
            &device(),
            HighpassMode::IirF32,
            &[(5, 6122), (3, 6123), (4, 1500), (2, 3000)],
            TWIN_F32_REL,
            TWIN_F32_ABS,
        );
    }
    #[test]
    fn queued_windows() {
        check_queue::<WgpuRuntime>(&device(), &|_, _| Default::default(), false);
    }
    #[test]
    fn windows_from_their_high_passed_copies() {
        check_filtered::<WgpuRuntime>(&device());
    }
    #[test]
    fn whitening_grid_layouts() {
        check_whiten_grid::<WgpuRuntime>(&device());
    }
    #[test]
    fn learning_clips_on_the_device() {
        check_learning_clips::<WgpuRuntime>(&device());
    }

    /// The whole `spikecube detect` run with `--backend wgpu` writes the same
    /// spikes as `--backend cpu` (a simulated 32-site recording, 10 windows).
    #[test]
    fn detect_command_matches_cpu() {
        device();
        let dir = tempfile::tempdir().unwrap();
        let probe = common::data("fixtures/detection/linear32/probe.json");
        let sim = dir.path().join("sim");
        let run = |args: &[&str]| {
            let o = common::spikecube(args);
            assert!(
                o.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        };
        run(&[
            "simulate",
            "--seconds",
            "2",
            "--probe",
            probe.to_str().unwrap(),
            "--n-units",
            "8",
            "--rate",
            "15",
            "--seed",
            "3",
            "--out",
            sim.to_str().unwrap(),
            "-q",
        ]);
        let bin = sim.join("sim_g0_t0.imec0.ap.bin");
        for b in ["cpu", "wgpu"] {
            let out = dir.path().join(b);
            run(&[
                "detect",
                bin.to_str().unwrap(),
                "--batch-size",
                "6000",
                "--backend",
                b,
                "--out",
                out.to_str().unwrap(),
                "-q",
                // One pass: this compares the back ends' detections (the drift
                // correction stage runs on the CPU for both).
                "--nblocks",
                "0",
            ]);
        }
        let read = |b: &str, f: &str| std::fs::read(dir.path().join(b).join(f)).unwrap();
        for f in [
            "spike_times.npy",
            "spike_centers.npy",
            "spike_detection_templates.npy",
            "spike_signs.npy",
        ] {
            assert_eq!(
                read("cpu", f),
                read("wgpu", f),
                "{f} differs between cpu and wgpu"
            );
        }
        let amp = |b: &str| -> ndarray::Array1<f32> {
            spikecube::npy::read(&dir.path().join(b).join("amplitudes.npy")).unwrap()
        };
        let (a, g) = (amp("cpu"), amp("wgpu"));
        assert!(a.len() > 50, "the recording has spikes: {}", a.len());
        close("amplitudes", a.as_slice().unwrap(), g.as_slice().unwrap());
        let json = String::from_utf8(read("wgpu", "spikecube.json")).unwrap();
        assert!(json.contains("\"backend\": \"wgpu\""), "{json}");
    }

    /// Drift correction on the device ((M_b·W)·X per window) against
    /// the CPU's, through the command line on a drifting recording: the same
    /// drift estimate, the same spikes.
    #[test]
    fn drift_corrected_detection_matches_cpu() {
        device();
        let dir = tempfile::tempdir().unwrap();
        let probe = common::data("drift/probe.json");
        let sim = dir.path().join("sim");
        let run = |args: &[&str]| {
            let o = common::spikecube(args);
            assert!(
                o.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        };
        run(&[
            "simulate",
            "--seconds",
            "4",
            "--probe",
            probe.to_str().unwrap(),
            "--n-units",
            "12",
            "--rate",
            "15",
            "--seed",
            "5",
            "--drift",
            "rigid",
            "--out",
            sim.to_str().unwrap(),
            "-q",
        ]);
        let bin = sim.join("sim_g0_t0.imec0.ap.bin");
        for b in ["cpu", "wgpu"] {
            let out = dir.path().join(b);
            run(&[
                "detect",
                bin.to_str().unwrap(),
                "--batch-size",
                "6000",
                "--backend",
                b,
                "--templates-from-data",
                "false",
                "--out",
                out.to_str().unwrap(),
                "-q",
            ]);
        }
        let read = |b: &str, f: &str| std::fs::read(dir.path().join(b).join(f)).unwrap();
        let json = String::from_utf8(read("wgpu", "spikecube.json")).unwrap();
        assert!(json.contains("\"preprocessing_on\": \"device\""), "{json}");
        assert!(json.contains("\"applied\": true"), "{json}");
        for f in [
            "drift.npy",
            "spike_times.npy",
            "spike_centers.npy",
            "spike_detection_templates.npy",
        ] {
            assert_eq!(
                read("cpu", f),
                read("wgpu", f),
                "{f} differs between cpu and wgpu"
            );
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cubecl::cuda::{CudaDevice, CudaRuntime};

    fn device() -> CudaDevice {
        if let Err(why) = spikecube::backend::probe_cuda() {
            panic!("CUDA tests need an NVIDIA GPU: {why}");
        }
        CudaDevice::new(0)
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_fixtures() {
        check_fixtures::<CudaRuntime>(&device(), &common::CASES);
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_intermediates() {
        for name in common::CASES {
            check_intermediates::<CudaRuntime>(&device(), name);
        }
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_random() {
        check_random::<CudaRuntime>(&device(), 200);
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_overflow() {
        check_overflow::<CudaRuntime>(&device());
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_bad_input() {
        check_bad_input::<CudaRuntime>(&device());
    }
    /// The f64 IIR high-pass (the default on CUDA) against its CPU twin and
    /// the CPU's FFT high-pass.
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_highpass_iir() {
        check_highpass_iir::<CudaRuntime>(
            &device(),
            HighpassMode::Auto,
            &[
                (384, 60_122),
                (384, 60_123),
                (32, 6122),
                (31, 6123),
                (4, 1500),
            ],
            TWIN_F64_REL,
            TWIN_F64_ABS,
        );
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_queued_windows() {
        // Windows through CubeCL's own upload, then through the upload buffers.
        check_queue::<CudaRuntime>(&device(), &|_, _| Default::default(), false);
        check_queue::<CudaRuntime>(
            &device(),
            &|d, bytes| {
                let mut packer = spikecube::detect::gpu::Packer::pinned_cuda();
                let pool = packer.pool().expect("page-locked memory from the driver");
                d.use_direct_upload(pool.clone());
                let ptrs = d.upload_slot_ptrs(bytes).expect("upload buffers");
                packer.set_slots(pool.upload_slots(ptrs, bytes).expect("a copy stream"));
                packer
            },
            true,
        );
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_windows_from_their_high_passed_copies() {
        check_filtered::<CudaRuntime>(&device());
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_whitening_grid_layouts() {
        check_whiten_grid::<CudaRuntime>(&device());
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_learning_clips_on_the_device() {
        check_learning_clips::<CudaRuntime>(&device());
    }
    #[test]
    #[ignore = "needs an NVIDIA GPU: cargo test --release --test gpu -- --include-ignored"]
    fn cuda_preprocessing() {
        for n in [6122, 60_122] {
            // Ordinary memory through CubeCL, then page-locked memory copied directly.
            check_preprocessing::<CudaRuntime>(&device(), n, &Default::default(), &|_| {});
            let packer = spikecube::detect::gpu::Packer::pinned_cuda();
            let pool = packer.pool().expect("page-locked memory from the driver");
            check_preprocessing::<CudaRuntime>(&device(), n, &packer, &|d| {
                d.use_direct_upload(pool.clone())
            });
        }
    }
}
