//! Drift estimation and correction against Kilosort4 4.1.7 (tests/data/drift/,
//! made by make_drift_fixtures.py from Kilosort4's own first-pass spikes st0 on
//! three simulated drifting recordings), and the sharp edges where spikecube
//! differs from Kilosort4 (README, "Where spikecube differs").

mod common;

use common::{data, probe, s, spikecube};
use ndarray::{Array1, Array2};
use spikecube::drift::estimate::{bin_spikes, reference_batch, register};
use spikecube::drift::{
    DriftCorrection, DriftMode, DriftSettings, Estimated, FirstPassSpikes, correct, estimate,
};
use spikecube::{Probe, npy};

const CASES: [&str; 3] = ["simA", "simB", "simC"];

fn fixture_probe() -> Probe {
    Probe::load(&data("drift/probe.json")).unwrap()
}

fn st0(case: &str) -> FirstPassSpikes {
    let t: Array2<f32> = npy::read(&data(&format!("drift/{case}/st0.npy"))).unwrap();
    FirstPassSpikes {
        y: t.column(0).to_vec(),
        amp: t.column(1).to_vec(),
        batch: t.column(2).iter().map(|&b| b as u32).collect(),
        sample: vec![0; t.nrows()],
    }
}

fn f64_1(case: &str, f: &str) -> Array1<f64> {
    npy::read(&data(&format!("drift/{case}/{f}"))).unwrap()
}

fn f64_2(case: &str, f: &str) -> Array2<f64> {
    npy::read(&data(&format!("drift/{case}/{f}"))).unwrap()
}

fn n_batches(case: &str) -> usize {
    let shape: Array1<i64> = npy::read(&data(&format!("drift/{case}/F_shape.npy"))).unwrap();
    shape[0] as usize
}

/// F (exact) and ysamp (1e-12 µm) equal Kilosort4's `bin_spikes` on its own st0.
#[test]
fn histograms_equal_kilosort() {
    let p = fixture_probe();
    for case in CASES {
        let shape: Array1<i64> = npy::read(&data(&format!("drift/{case}/F_shape.npy"))).unwrap();
        let h = bin_spikes(&st0(case), &p.yc, 5.0, 9.0, n_batches(case)).unwrap();
        assert_eq!(
            h.f.shape(),
            &[shape[0] as usize, shape[1] as usize, shape[2] as usize],
            "{case}"
        );
        let idx: Array2<i32> = npy::read(&data(&format!("drift/{case}/F_index.npy"))).unwrap();
        let val = f64_1(case, "F_value.npy");
        let mut expect = ndarray::Array3::<f64>::zeros(h.f.dim());
        for (k, r) in idx.rows().into_iter().enumerate() {
            expect[[r[0] as usize, r[1] as usize, r[2] as usize]] = val[k];
        }
        let bad =
            h.f.iter()
                .zip(expect.iter())
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
        assert_eq!(bad, 0, "{case}: F cells differing from Kilosort4");
        let ysamp = f64_1(case, "ysamp.npy");
        for (a, b) in h.ysamp.iter().zip(ysamp.iter()) {
            assert!((a - b).abs() < 1e-12, "{case}: ysamp {a} vs {b}");
        }
    }
}

/// dshift and yblk equal Kilosort4's `align_block2` for nblocks 1, 3, 5 on
/// three recordings: yblk to 1e-12 µm; dshift exactly, except rare ±0.5 µm
/// (±0.1 bin) flips of the fine step on near-ties (spec §11), at most 0.1 % of
/// cells, which are counted and printed.
#[test]
fn dshift_and_yblk_equal_kilosort() {
    let p = fixture_probe();
    let mut flips = 0usize;
    let mut cells = 0usize;
    for case in CASES {
        let nb_ = n_batches(case);
        let h = bin_spikes(&st0(case), &p.yc, 5.0, 9.0, nb_).unwrap();
        for nblocks in [1, 3, 5] {
            let r = register(&h, nblocks, [0.5; 3], reference_batch(nb_)).unwrap();
            let dshift = r.imin.mapv(|v| v * 5.0);
            let expect = f64_2(case, &format!("dshift_nb{nblocks}.npy"));
            assert_eq!(dshift.dim(), expect.dim(), "{case} nblocks {nblocks}");
            for (a, b) in dshift.iter().zip(expect.iter()) {
                cells += 1;
                if a != b {
                    assert!(
                        (a - b).abs() <= 0.5 + 1e-9,
                        "{case} nblocks {nblocks}: dshift {a} vs Kilosort4 {b}"
                    );
                    flips += 1;
                }
            }
            let yblk = f64_1(case, &format!("yblk_nb{nblocks}.npy"));
            assert_eq!(r.yblk.len(), yblk.len());
            for (a, b) in r.yblk.iter().zip(yblk.iter()) {
                assert!(
                    (a - b).abs() < 1e-12,
                    "{case} nblocks {nblocks}: yblk {a} vs {b}"
                );
            }
            // The whole estimate, in both modes, gives the same on these
            // recordings (no empty windows, a probe deep enough).
            for mode in [DriftMode::Kilosort, DriftMode::Spikecube] {
                let settings = DriftSettings {
                    nblocks,
                    mode,
                    ..DriftSettings::default()
                };
                let Estimated::Drift(e) =
                    estimate(&st0(case), &p, &settings, 9.0, nb_, &mut |_| {}).unwrap()
                else {
                    panic!("{case}: drift estimate switched off");
                };
                assert_eq!(e.dshift, dshift, "{case} nblocks {nblocks} {mode:?}");
            }
        }
    }
    eprintln!("dshift: {flips} of {cells} cells differ from Kilosort4 by 0.5 µm");
    assert!(flips * 1000 <= cells, "{flips} of {cells} cells differ");
}

/// iKxx (relative to its largest element, 1e-4) and the interpolation
/// matrix M_b of two windows (absolute 1e-5: nblocks 1 at the largest shift,
/// nblocks 3 at the largest spread between blocks) equal Kilosort4's.
#[test]
fn interpolation_matrix_equals_kilosort() {
    let p = fixture_probe();
    let case = "simA";
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data("drift/simA/meta.json")).unwrap())
            .unwrap();
    let ik: Array2<f32> = npy::read(&data("drift/simA/iKxx.npy")).unwrap();
    for (nb, key) in [(1usize, "nb1"), (3, "nb3")] {
        let dshift = f64_2(case, &format!("dshift_nb{nb}.npy"));
        let yblk = f64_1(case, &format!("yblk_nb{nb}.npy")).to_vec();
        let c = DriftCorrection::new(&p.xc, &p.yc, dshift, yblk, 20.0).unwrap();
        let max = ik.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = c
            .ikxx()
            .iter()
            .zip(ik.iter())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d <= 1e-4 * max, "iKxx differs by {d} (max {max})");
        let b = meta["matrix_batches"][key].as_u64().unwrap();
        let m = c.matrix(b).unwrap();
        let expect: Array2<f32> = npy::read(&data(&format!("drift/simA/M_{key}.npy"))).unwrap();
        let d = m
            .iter()
            .zip(expect.iter())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d <= 1e-5, "M_b (nblocks {nb}, window {b}) differs by {d}");
    }
}

/// `M_b` keeps its bits (and so the second pass its spikes) whatever loop
/// computes it: each entry is Σ_k K(Q_c, P_k)·iKxx[k, j] accumulated in f64
/// in increasing k, zero kernel values skipped, rounded to float32 — checked
/// entry for entry against that sum written out here, for rigid and
/// non-rigid shifts.
#[test]
fn interpolation_matrix_is_the_f64_sum_in_site_order() {
    let p = fixture_probe();
    for (nb, shifts) in [(1usize, vec![-17.3]), (3, vec![4.0, -9.5, 22.0])] {
        let yblk: Vec<f64> = if nb == 1 {
            vec![172.5]
        } else {
            vec![60.0, 172.5, 285.0]
        };
        let dshift = Array2::from_shape_vec((1, shifts.len()), shifts.clone()).unwrap();
        let c = DriftCorrection::new(&p.xc, &p.yc, dshift, yblk.clone(), 20.0).unwrap();
        let m = c.matrix(0).unwrap();
        let s = correct::site_shifts(&shifts, &yblk, &p.yc);
        let qy: Vec<f32> =
            p.yc.iter()
                .zip(&s)
                .map(|(&y, &d)| (y as f64 - d) as f32)
                .collect();
        let k = correct::kernel2d(&p.xc, &qy, &p.xc, &p.yc, 20.0);
        let n = p.n_sites();
        for r in 0..n {
            for j in 0..n {
                let mut acc = 0f64;
                for q in 0..n {
                    let a = k[[r, q]] as f64;
                    if a != 0.0 {
                        acc += a * c.ikxx()[[q, j]] as f64;
                    }
                }
                assert_eq!(
                    m[[r, j]].to_bits(),
                    (acc as f32).to_bits(),
                    "M_b[{r}, {j}], nblocks {nb}"
                );
            }
        }
    }
}

/// Correction with a zero shift is K(K + 0.01 I)⁻¹, not the identity (spec §7),
/// and applying it multiplies the window by M_b.
#[test]
fn correction_applies_the_matrix() {
    let p = fixture_probe();
    let n = p.n_sites();
    let c = DriftCorrection::new(
        &p.xc,
        &p.yc,
        Array2::from_elem((2, 1), 0.0),
        vec![100.0],
        20.0,
    )
    .unwrap();
    let m = c.matrix(0).unwrap();
    let mean_diag = (0..n).map(|i| m[[i, i]] as f64).sum::<f64>() / n as f64;
    assert!(
        mean_diag > 0.5 && mean_diag < 0.99,
        "mean diagonal {mean_diag}"
    );
    let x = common::noise(n, 700, 3);
    let mut y = x.clone();
    c.apply(0, &mut y).unwrap();
    let expect = m.dot(&x);
    let d = (&y - &expect).mapv(f32::abs).fold(0f32, |a, &b| a.max(b));
    assert!(d < 1e-4, "{d}");
    assert!(c.apply(2, &mut y).is_err(), "window past dshift");
}

/// 384 sites of a 2-column probe, 15 µm rows (2865 µm).
fn np2() -> Probe {
    let xy: Vec<(f32, f32)> = (0..384)
        .map(|i| (32.0 * (i % 2) as f32, 15.0 * (i / 2) as f32))
        .collect();
    probe(&xy, &[0; 384])
}

/// Spikes of `n_units` fixed units (depth, amplitude), `per` spikes each per
/// window, in every window but `empty`, the pattern shifted up by `shift(b)` µm.
fn synthetic(
    n_windows: usize,
    empty: &[usize],
    shift: impl Fn(usize) -> f32,
    yrange: (f32, f32),
) -> FirstPassSpikes {
    let mut sp = FirstPassSpikes::default();
    let mut rng = common::Rng(7);
    let units: Vec<(f32, f32)> = (0..40)
        .map(|_| {
            (
                yrange.0 + (yrange.1 - yrange.0) * rng.uniform() as f32,
                10.0 + 60.0 * rng.uniform() as f32,
            )
        })
        .collect();
    for b in 0..n_windows {
        if empty.contains(&b) {
            continue;
        }
        for &(y, a) in &units {
            for _ in 0..5 {
                let yy = (y + shift(b) + 2.0 * rng.normal() as f32).clamp(yrange.0, yrange.1);
                sp.y.push(yy);
                sp.amp
                    .push(a * (1.0 + 0.05 * rng.normal() as f32).max(0.2) + 9.01);
                sp.batch.push(b as u32);
                sp.sample.push(b as i64 * 60_000);
            }
        }
    }
    sp
}

/// A window without first-pass spikes: Kilosort4 gives it an arbitrary
/// extreme shift (all scores tie, the most negative lag wins: hundreds of µm);
/// spikecube interpolates it from its neighbours, with a warning.
#[test]
fn empty_window_gets_interpolated_shift() {
    let p = np2();
    let sp = synthetic(12, &[5], |b| b as f32 * 2.0, (100.0, 2700.0));
    let run = |mode| {
        let mut warned = Vec::new();
        let settings = DriftSettings {
            mode,
            ..DriftSettings::default()
        };
        let Estimated::Drift(e) =
            estimate(&sp, &p, &settings, 9.0, 12, &mut |w| warned.push(w)).unwrap()
        else {
            panic!("estimate off")
        };
        (e, warned)
    };
    let (ks, _) = run(DriftMode::Kilosort);
    assert!(
        ks.dshift[[5, 0]] < -300.0,
        "Kilosort4's empty-window shift {}",
        ks.dshift[[5, 0]]
    );
    let (sc, warned) = run(DriftMode::Spikecube);
    assert_eq!(sc.empty_windows, vec![5]);
    let (lo, hi) = (sc.dshift[[4, 0]], sc.dshift[[6, 0]]);
    assert!(
        (sc.dshift[[5, 0]] - (lo + hi) / 2.0).abs() < 1e-9,
        "{lo} {} {hi}",
        sc.dshift[[5, 0]]
    );
    // Units drifting up 2 µm per window: dshift falls by about 2 µm per window.
    let slope = (sc.dshift[[11, 0]] - sc.dshift[[0, 0]]) / 11.0;
    assert!((slope + 2.0).abs() < 0.5, "slope {slope}");
    assert!(
        warned.iter().any(|w| w.contains("no first-pass spikes")),
        "{warned:?}"
    );
}

/// The reference window itself empty: Kilosort4 leaves a common offset; spikecube
/// registers against the nearest window with spikes.
#[test]
fn empty_reference_window_is_replaced() {
    let p = np2();
    let sp = synthetic(12, &[6], |_| 0.0, (100.0, 2700.0));
    let settings = DriftSettings::default();
    let Estimated::Drift(e) = estimate(&sp, &p, &settings, 9.0, 12, &mut |_| {}).unwrap() else {
        panic!("estimate off")
    };
    assert_ne!(e.reference, 6);
    assert!(e.dshift.iter().all(|v| v.abs() <= 5.0), "{:?}", e.dshift);
}

/// A probe spanning fewer than 31 depth bins (8 sites over 35 µm): Kilosort4's
/// circular ±15-bin search aliases to shifts of hundreds of µm; spikecube
/// switches drift correction off with a warning naming the reason.
#[test]
fn short_probe_turns_drift_off() {
    let xy: Vec<(f32, f32)> = (0..8).map(|i| (0.0, 5.0 * i as f32)).collect();
    let p = probe(&xy, &[0; 8]);
    let sp = synthetic(6, &[], |_| 0.0, (0.0, 35.0));
    let off = estimate(&sp, &p, &DriftSettings::default(), 9.0, 6, &mut |_| {}).unwrap();
    match off {
        Estimated::Off(why) => assert!(why.contains("depth bins"), "{why}"),
        Estimated::Drift(_) => panic!("drift estimated on an 8-bin probe"),
    }
    let ks = DriftSettings {
        mode: DriftMode::Kilosort,
        ..DriftSettings::default()
    };
    let mut warned = Vec::new();
    let Estimated::Drift(e) = estimate(&sp, &p, &ks, 9.0, 6, &mut |w| warned.push(w)).unwrap()
    else {
        panic!("kilosort mode must estimate")
    };
    assert!(
        e.dshift.iter().any(|v| v.abs() > 100.0),
        "expected Kilosort4's aliased shifts: {:?}",
        e.dshift
    );
    assert!(warned.iter().any(|w| w.contains("alias")), "{warned:?}");
}

/// nblocks beyond what the depth bins allow is an error naming the limit
/// (blocks of fewer than 11 bins alias in the ±5-bin search; in kilosort mode,
/// empty blocks, which give NaN in Kilosort4).
#[test]
fn too_many_blocks_is_an_error() {
    let p = np2(); // D = 1 + ceil(2866 / 5) = 575 bins
    let sp = synthetic(4, &[], |_| 0.0, (100.0, 2700.0));
    let set = |nblocks, mode| DriftSettings {
        nblocks,
        mode,
        ..DriftSettings::default()
    };
    let e = estimate(&sp, &p, &set(53, DriftMode::Spikecube), 9.0, 4, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--nblocks 53") && e.contains("at most 52"),
        "{e}"
    );
    assert!(estimate(&sp, &p, &set(52, DriftMode::Spikecube), 9.0, 4, &mut |_| {}).is_ok());
    let e = estimate(&sp, &p, &set(576, DriftMode::Kilosort), 9.0, 4, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most 575"), "{e}");
    assert!(estimate(&sp, &p, &set(53, DriftMode::Kilosort), 9.0, 4, &mut |_| {}).is_ok());
    // The same limits before any data is read (`detect` checks first).
    use spikecube::drift::check_nblocks;
    assert!(check_nblocks(&set(53, DriftMode::Spikecube), &p).is_err());
    assert!(check_nblocks(&set(52, DriftMode::Spikecube), &p).is_ok());
    assert!(check_nblocks(&set(576, DriftMode::Kilosort), &p).is_err());
    assert!(check_nblocks(&set(575, DriftMode::Kilosort), &p).is_ok());
}

/// Several shanks are pooled into one histogram, as Kilosort4 does, with a
/// warning saying so.
#[test]
fn multi_shank_is_pooled_with_a_warning() {
    let xy: Vec<(f32, f32)> = (0..384)
        .map(|i| {
            (
                250.0 * (i / 96) as f32 + 32.0 * (i % 2) as f32,
                15.0 * ((i % 96) / 2) as f32,
            )
        })
        .collect();
    let shanks: Vec<i64> = (0..384).map(|i| i / 96).collect();
    let p = probe(&xy, &shanks);
    let sp = synthetic(4, &[], |_| 0.0, (20.0, 700.0));
    let mut warned = Vec::new();
    let r = estimate(&sp, &p, &DriftSettings::default(), 9.0, 4, &mut |w| {
        warned.push(w)
    })
    .unwrap();
    assert!(matches!(r, Estimated::Drift(_)));
    assert!(
        warned.iter().any(|w| w.contains("4 shanks are pooled")),
        "{warned:?}"
    );
}

/// The interpolant of per-block shifts at the sites extends the end segments
/// linearly (scipy's interp1d with fill_value="extrapolate").
#[test]
fn site_shifts_extrapolate_linearly() {
    let s = correct::site_shifts(
        &[0.0, 10.0, 30.0],
        &[100.0, 200.0, 300.0],
        &[0.0, 150.0, 250.0, 400.0],
    );
    assert_eq!(s, vec![-10.0, 5.0, 20.0, 50.0]);
}

/// End to end on a short simulated drifting recording: `detect` writes
/// drift.npy / drift_blocks.npy / drift.png and both passes' counts;
/// `--nblocks 0` writes no drift files; `--drift-only` writes the drift files
/// and the first pass's spikes; `simulate --drift` writes the true motion.
#[test]
fn detect_writes_drift_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let sim = tmp.path().join("sim");
    let o = spikecube(&[
        "simulate",
        "--probe",
        s(&data("drift/probe.json")),
        "--seconds",
        "3",
        "--n-units",
        "12",
        "--rate",
        "10",
        "--drift",
        "rigid",
        "--out",
        s(&sim),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let truth: Array2<f64> = npy::read(&sim.join("drift_truth.npy")).unwrap();
    let times: Array1<f64> = npy::read(&sim.join("drift_truth_times.npy")).unwrap();
    assert_eq!(truth.nrows(), times.len());
    // At the end: 40 µm linear + the 20 µm step + sin(2π·3 s / 1 s) = 0.
    assert!((truth[[truth.nrows() - 1, 0]] - 60.0).abs() < 1e-6);
    let bin = sim.join("sim_g0_t0.imec0.ap.bin");
    let run = |name: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut args = vec![
            "detect",
            s(&bin),
            "--out",
            s(&out),
            "--batch-size",
            "7500",
            "-q",
            // Few isolated peaks in 3 s: learn templates from as few as 6.
            "--min-learn-clips",
            "6",
        ];
        args.extend_from_slice(extra);
        let o = spikecube(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
                .unwrap();
        (out, j)
    };
    let (out, j) = run("on", &[]);
    let dshift: Array2<f64> = npy::read(&out.join("drift.npy")).unwrap();
    assert_eq!(dshift.dim(), (12, 1));
    let yblk: Array1<f64> = npy::read(&out.join("drift_blocks.npy")).unwrap();
    assert_eq!(yblk.len(), 1);
    assert!(out.join("drift.png").exists());
    let d = &j["settings"]["drift"];
    assert_eq!(d["applied"], true);
    assert!(d["first_pass_spikes"].as_u64().unwrap() > 0);
    assert_eq!(d["second_pass_spikes"], j["counts"]["n_spikes"]);
    assert!(j["timings_s"]["drift_first_pass"].as_f64().is_some());

    // Byte-identical with one thread.
    let (t1, _) = run("t1", &["--threads", "1"]);
    for f in [
        "spike_times.npy",
        "amplitudes.npy",
        "pc_features.npy",
        "wTEMP.npy",
    ] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(t1.join(f)).unwrap(),
            "{f} differs between 2 threads and 1"
        );
    }
    // The second pass re-learns wTEMP/wPCA from the corrected windows
    // (Kilosort4, drift-spec §8); the output's wTEMP.npy are those.
    let first = &d["templates_first_pass"];
    let second = &d["templates_second_pass"];
    assert!(first["n_clips"].as_u64().is_some(), "{d}");
    assert_eq!(second, &j["settings"]["templates"]);
    assert_eq!(second["windows"], "drift-corrected (second pass)");
    assert_eq!(first["seed"], second["seed"]);
    assert!(j["timings_s"]["templates_second_pass"].as_f64().is_some());

    let (off, j) = run("off", &["--nblocks", "0"]);
    assert!(!off.join("drift.npy").exists());
    assert_eq!(j["settings"]["drift"]["applied"], false);

    let (only, j) = run("only", &["--drift-only"]);
    assert!(only.join("drift.npy").exists());
    assert_eq!(
        j["counts"]["n_spikes"],
        j["settings"]["drift"]["first_pass_spikes"]
    );
    // --drift-only outputs the first pass, with the first pass's templates.
    assert_eq!(j["settings"]["templates"], *first);
    eprintln!("templates: first pass {first}, second pass {second}");
    assert_eq!(second["source"], "learned");
    if first["source"] == "learned" {
        assert_ne!(
            std::fs::read(only.join("wTEMP.npy")).unwrap(),
            std::fs::read(out.join("wTEMP.npy")).unwrap(),
            "the second pass's templates were not re-learned"
        );
    }

    let (_, j) = run("nb3", &["--nblocks", "3"]);
    assert_eq!(
        j["settings"]["drift"]["n_blocks_used"], 5,
        "2·nblocks − 1 blocks"
    );
}

/// Sites whose target lies beyond the probe's end read zero (spikecube), not
/// Kilosort4's extrapolated near-copies of the last sites (whose correlated
/// noise gives false detections there); `with_zero_outside(false)` and the
/// dense product give Kilosort4's arithmetic. The sparse product agrees with
/// the dense one to float32 rounding.
#[test]
fn sites_beyond_the_probe_end_read_zero() {
    let p = fixture_probe(); // 0–345 µm, rows every 15 µm
    let n = p.n_sites();
    // dshift −40 µm: every site samples 40 µm higher, so the top 6 sites
    // (y = 315, 330, 345 in two columns) sample above 345 µm.
    let c = DriftCorrection::new(
        &p.xc,
        &p.yc,
        Array2::from_elem((1, 1), -40.0),
        vec![170.0],
        20.0,
    )
    .unwrap();
    let outside = c.sites_outside(0, 0.0).unwrap();
    assert_eq!(
        c.sites_outside(0, 20.0).unwrap(),
        (44..48).collect::<Vec<_>>()
    );
    assert_eq!(outside, (42..48).collect::<Vec<_>>());
    let x = common::noise(n, 900, 5);
    let mut y = x.clone();
    let c0 = c.clone().with_zero_outside(Some(0.0));
    c0.apply(0, &mut y).unwrap();
    for &s in &outside {
        assert!(y.row(s).iter().all(|&v| v == 0.0), "site {s}");
    }
    let ks = c.clone().with_zero_outside(None).with_dense(true);
    let mut yk = x.clone();
    ks.apply(0, &mut yk).unwrap();
    assert!(yk.row(47).iter().any(|&v| v != 0.0));
    let expect = c.matrix(0).unwrap().dot(&x);
    let d = (&yk - &expect).mapv(f32::abs).fold(0f32, |a, &b| a.max(b));
    assert!(d < 1e-4, "dense {d}");
    // Sparse (default) against dense, inside the probe.
    let rms =
        (expect.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / expect.len() as f64).sqrt();
    for s in 0..42 {
        for t in 0..900 {
            let e = (y[[s, t]] - expect[[s, t]]).abs() as f64;
            assert!(e < 1e-5 * rms, "site {s} t {t}: {e} (rms {rms})");
        }
    }
}

/// A local whitening matrix (32 nearest sites) of a spatially decaying
/// covariance on `p`, as a stand-in for a fit.
fn local_whitening(p: &Probe) -> spikecube::preprocess::Whitening {
    let n = p.n_sites();
    let cc = Array2::from_shape_fn((n, n), |(i, j)| {
        let dx = f64::from(p.xc[i] - p.xc[j]);
        let dy = f64::from(p.yc[i] - p.yc[j]);
        400.0 * (-(dx * dx + dy * dy).sqrt() / 40.0).exp() + if i == j { 100.0 } else { 0.0 }
    });
    let w = spikecube::preprocess::whitening_from_covariance(&cc, p, 32).unwrap();
    spikecube::preprocess::Whitening::new(w).unwrap()
}

/// (RMS, largest) of `y − reference` over the RMS of `reference`.
fn rel_error(y: &Array2<f32>, reference: &Array2<f64>) -> (f64, f64) {
    let rms = (reference.iter().map(|v| v * v).sum::<f64>() / reference.len() as f64).sqrt();
    let (mut s, mut m) = (0f64, 0f64);
    for (a, b) in y.iter().zip(reference.iter()) {
        let e = (f64::from(*a) - b).abs();
        s += e * e;
        m = m.max(e);
    }
    ((s / reference.len() as f64).sqrt() / rms, m / rms)
}

/// The drift-corrected whitening `G_b = M_b·W` applied to a high-passed
/// window (Kilosort4's `(M_b·W)·X`, spec §7 step 8) against the product in
/// float64 of the same float32 M_b, W and X, on a Neuropixels 2.0-like probe
/// (384 sites, W over 32 sites) for several shifts: within float32 rounding
/// (measured 1e-7 RMS, 1.5e-6 at most, of the output RMS), and the entries
/// dropped below `COMBINED_EPS` change it by no more than that rounding.
#[test]
fn combined_whitening_matches_float64() {
    let p = np2();
    let n = p.n_sites();
    let w = local_whitening(&p);
    let w64 = w.matrix().mapv(f64::from);
    let shifts = [0.0, 7.5, -19.5, 40.0];
    let dshift = Array2::from_shape_fn((shifts.len(), 1), |(b, _)| shifts[b]);
    let c = DriftCorrection::new(&p.xc, &p.yc, dshift, vec![1432.5], 20.0)
        .unwrap()
        .with_zero_outside(None);
    let x = common::noise(n, 1500, 11).mapv(|v| v * 30.0);
    let x64 = x.mapv(f64::from);
    for b in 0..shifts.len() as u64 {
        let m64 = c.matrix(b).unwrap().mapv(f64::from);
        let reference = m64.dot(&w64).dot(&x64);
        let g = c.window_whitening(b, &w).unwrap();
        let per_row = g.nnz() as f64 / n as f64;
        assert!(per_row > 60.0 && per_row < 120.0, "{per_row} per row");
        let mut y = x.clone();
        g.apply(&mut y).unwrap();
        let (rms, max) = rel_error(&y, &reference);
        assert!(
            rms < 3e-7 && max < 5e-6,
            "shift {}: {rms:e} {max:e}",
            shifts[b as usize]
        );
        let ge = c.clone().with_exact(true).window_whitening(b, &w).unwrap();
        assert!(ge.nnz() > g.nnz());
        let mut ye = x.clone();
        ge.apply(&mut ye).unwrap();
        let (rms_e, max_e) = rel_error(&ye, &reference);
        eprintln!(
            "shift {:5.1} µm: {per_row:.1} of {n} per row, error {rms:.2e} RMS, {max:.2e} max; every non-zero ({:.1} per row): {rms_e:.2e}, {max_e:.2e}",
            shifts[b as usize],
            ge.nnz() as f64 / n as f64
        );
        assert!(
            rms < 1.5 * rms_e && max < 2.0 * max_e.max(1e-6),
            "dropping adds error: {rms:e} {max:e} against every non-zero's {rms_e:e} {max_e:e}"
        );
    }
    // The edge margin zeroes the rows of sites that sample beyond the end.
    let cz = c.clone().with_zero_outside(Some(15.0));
    let g = cz.window_whitening(3, &w).unwrap(); // +40 µm: the bottom samples below 0
    let outside = cz.sites_outside(3, 15.0).unwrap();
    assert!(!outside.is_empty());
    let (start, _, _) = g.csr();
    for s in outside {
        assert_eq!(start[s], start[s + 1], "site {s} is not zeroed");
    }
}

/// With Kilosort4's own M_b (the fixture window of largest shift, simA),
/// `G_b·X` equals `M_b·(W·X)` in float64 within the spec's tolerance for a
/// corrected batch (1e-4 of the RMS).
#[test]
fn combined_whitening_with_kilosorts_matrix() {
    let p = fixture_probe();
    let n = p.n_sites();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data("drift/simA/meta.json")).unwrap())
            .unwrap();
    let b = meta["matrix_batches"]["nb1"].as_u64().unwrap();
    let m_ks: Array2<f32> = npy::read(&data("drift/simA/M_nb1.npy")).unwrap();
    let c = DriftCorrection::new(
        &p.xc,
        &p.yc,
        f64_2("simA", "dshift_nb1.npy"),
        f64_1("simA", "yblk_nb1.npy").to_vec(),
        20.0,
    )
    .unwrap()
    .with_zero_outside(None);
    let w = local_whitening(&p);
    let g = c.window_whitening(b, &w).unwrap();
    let x = common::noise(n, 1200, 5);
    let reference = m_ks
        .mapv(f64::from)
        .dot(&w.matrix().mapv(f64::from))
        .dot(&x.mapv(f64::from));
    let mut y = x.clone();
    g.apply(&mut y).unwrap();
    let (rms, max) = rel_error(&y, &reference);
    eprintln!("with Kilosort4's M_b: {rms:.2e} RMS, {max:.2e} max");
    assert!(rms < 1e-4 && max < 1e-3, "{rms:e} {max:e}");
}

/// `--neighbourhoods DIR` (`DetectionSettings::neighbourhoods`): every
/// geometry of a run takes Kilosort4's own iC, iC2 and weigh (its order
/// among equally distant sites, which depends on the CPU's numpy code path),
/// so a comparison with Kilosort4 needs no tie rule (BENCHMARKS.md, "every
/// difference with Kilosort4 explained"). A folder without the files is an
/// error naming the file.
#[test]
fn neighbourhoods_from_kilosort_replace_the_tie_rule() {
    let dir = data("learned/detection");
    let p = Probe::load(&dir.join("probe.json")).unwrap();
    let settings = spikecube::DetectionSettings {
        neighbourhoods: Some(dir.clone()),
        ..spikecube::DetectionSettings::default()
    };
    let g = spikecube::Geometry::new(&p, &settings).unwrap();
    let i_c: Array2<i64> = npy::read(&dir.join("iC.npy")).unwrap();
    let i_c2: Array2<i64> = npy::read(&dir.join("iC2.npy")).unwrap();
    let weigh: ndarray::Array3<f32> = npy::read(&dir.join("weigh.npy")).unwrap();
    assert_eq!(g.i_c.mapv(i64::from), i_c);
    assert_eq!(g.i_c2.mapv(i64::from), i_c2);
    assert_eq!(g.weigh, weigh);
    let own = spikecube::Geometry::new(&p, &spikecube::DetectionSettings::default()).unwrap();
    assert_eq!(
        (own.xcup.clone(), own.ycup.clone()),
        (g.xcup.clone(), g.ycup.clone())
    );
    let missing = spikecube::DetectionSettings {
        neighbourhoods: Some(data("drift")),
        ..spikecube::DetectionSettings::default()
    };
    let err = spikecube::Geometry::new(&p, &missing)
        .unwrap_err()
        .to_string();
    assert!(err.contains("iC.npy"), "{err}");
}

/// The drift step's first pass goes without PC features (they cost time
/// it does not need): on a simulated drifting recording (tests/data/drift/probe.json),
/// the first pass with and without them gives the same detections bit for
/// bit (times, centres, amplitudes, depths yct, adist, ...; only `tF` is left
/// out), the same first-pass spikes and the same drift estimate.
#[test]
fn first_pass_without_pc_features_gives_the_same_spikes_and_drift() {
    use spikecube::backend::{Backend, Detector, choose};
    use spikecube::drift::{FirstPass, first_pass_with};
    use spikecube::pipeline::{InputRequest, fit_whitening_for, open_for_detection};
    use spikecube::preprocess::Preprocessor;
    use spikecube::stages::HostPass;
    use spikecube::{DetectionSettings, Detections, Geometry, UniversalTemplates};

    let tmp = tempfile::tempdir().unwrap();
    let p = fixture_probe();
    let cfg = spikecube::simulate::SimConfig {
        seconds: 3.0,
        n_units: 12,
        rate_hz: 10.0,
        seed: 3,
        drift: Some(spikecube::simulate::DriftModel::rigid(3.0)),
        ..Default::default()
    };
    spikecube::simulate::simulate(&p, &cfg, tmp.path()).unwrap();
    let req = InputRequest {
        paths: vec![tmp.path().join("sim_g0_t0.imec0.ap.bin")],
        probe: Some(p),
        probe_hint: "--probe",
        ..InputRequest::default()
    };
    let (opened, probe, checks) = open_for_detection(&req).unwrap();
    let settings = spikecube::preprocess::PreprocessSettings {
        batch_size: 7500,
        ..Default::default()
    };
    let fit = fit_whitening_for(&opened.recording, &probe, &settings, &checks).unwrap();
    let pre = Preprocessor::new(&fit.settings, fit.whitening.clone()).unwrap();
    let ds = DetectionSettings::default();
    let run = |pc_features: bool| -> (FirstPassSpikes, Vec<(Detections, i64)>) {
        let detector = Detector::new(
            &choose(Backend::Cpu).unwrap(),
            Geometry::new(&probe, &ds).unwrap(),
            UniversalTemplates::builtin(),
            ds.clone(),
        )
        .unwrap();
        let mut pass = HostPass::new(pre.clone(), detector, probe.yc.clone());
        let fp = FirstPass {
            recording: &opened.recording,
            plan: &fit.plan,
            probe: &probe,
            pre: &pre,
            nt: ds.nt as u64,
            mask_clipped: checks.mask_clipped,
            checks: None,
            on_window: None,
        };
        let mut dets = Vec::new();
        let mut keep = |d: &Detections, first: i64| -> anyhow::Result<()> {
            dets.push((d.clone(), first));
            Ok(())
        };
        let spikes = first_pass_with(&fp, &mut pass, Some(&mut keep), pc_features).unwrap();
        (spikes, dets)
    };
    let (with, dets_with) = run(true);
    let (without, dets_without) = run(false);
    assert!(with.len() > 50, "{} first-pass spikes", with.len());
    assert_eq!(dets_with.len(), dets_without.len());
    let mut n_pcs = 0;
    for ((a, fa), (b, fb)) in dets_with.iter().zip(&dets_without) {
        assert_eq!(fa, fb);
        assert_eq!(b.n_pcs, 0);
        assert!(b.tf.is_empty());
        n_pcs = n_pcs.max(a.n_pcs);
        assert_eq!(a.tf.len(), a.len() * a.n_chans * a.n_pcs);
        let without_tf = Detections {
            tf: Vec::new(),
            n_pcs: 0,
            ..a.clone()
        };
        // Bitwise: f32 fields compared through their bits.
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&without_tf.amp), bits(&b.amp));
        assert_eq!(bits(&without_tf.yct), bits(&b.yct));
        assert_eq!(bits(&without_tf.adist), bits(&b.adist));
        assert_eq!(&without_tf, b);
    }
    assert_eq!(n_pcs, ds.n_pcs, "the run with features has them");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&with.y), bits(&without.y));
    assert_eq!(bits(&with.amp), bits(&without.amp));
    assert_eq!(with.batch, without.batch);
    assert_eq!(with.sample, without.sample);

    let est = |sp: &FirstPassSpikes| match estimate(
        sp,
        &probe,
        &DriftSettings::default(),
        f64::from(ds.th_universal),
        fit.plan.n_windows as usize,
        &mut |_| {},
    )
    .unwrap()
    {
        Estimated::Drift(e) => e,
        Estimated::Off(why) => panic!("drift off: {why}"),
    };
    let (a, b) = (est(&with), est(&without));
    let bits64 = |v: &Array2<f64>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits64(&a.dshift), bits64(&b.dshift));
    assert_eq!(a.yblk, b.yblk);
    assert_eq!(a.counts, b.counts);
}
