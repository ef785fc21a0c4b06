//! Universal templates learned from the data (`templates_from_data`):
//! the clips against Kilosort4's own `extract_snippets`, wPCA and wTEMP against
//! Kilosort4's `TruncatedSVD` and `KMeans` runs on Kilosort4's clips
//! (`tests/data/learned/`, made by `make_learned_reference.py` there),
//! independence of the thread count and of the back end, and detection with
//! Kilosort4's own learned templates against Kilosort4's.

mod common;

use common::data;
use ndarray::{Array2, Array3, ArrayView2, Axis};
use spikecube::detect::learn::{
    ClipPool, LearnSettings, MAX_CLIPS, extract_clips, kmeans, learn_wpca, learn_wtemp,
};
use spikecube::npy;

/// The whitened windows of the fixtures and the name of their reference clips.
fn windows() -> Vec<(String, Array2<f32>)> {
    let mut out = Vec::new();
    for case in common::CASES {
        let x = npy::read(&data(&format!("fixtures/detection/{case}/X.npy"))).unwrap();
        out.push((case.to_string(), x));
    }
    for b in 0..4 {
        let x = npy::read(&data(&format!("fixtures/preprocessing/batch_{b}.npy"))).unwrap();
        out.push((format!("batch_{b}"), x));
    }
    out
}

#[test]
fn clips_match_kilosort4_exactly_on_every_fixture_window() {
    let mut total = 0;
    for (name, x) in windows() {
        let (peaks, clips) = extract_clips(x.view(), 6.0, 61, 20);
        let ref_clips: Array2<f32> =
            npy::read(&data(&format!("learned/clips/{name}_clips.npy"))).unwrap();
        let ref_xy: Array2<i64> =
            npy::read(&data(&format!("learned/clips/{name}_xy.npy"))).unwrap();
        let xy: Vec<(usize, usize)> = ref_xy
            .rows()
            .into_iter()
            .map(|r| (r[0] as usize, r[1] as usize))
            .collect();
        assert_eq!(peaks, xy, "{name}: isolated peaks (site, sample)");
        assert_eq!(clips, ref_clips, "{name}: clip values");
        total += clips.nrows();
    }
    assert_eq!(total, 275);
}

#[test]
fn normalised_clips_are_unit_norm_and_keep_the_sign() {
    let x: Array2<f32> = npy::read(&data("fixtures/preprocessing/batch_1.npy")).unwrap();
    let (_, clips) = extract_clips(x.view(), 6.0, 61, 20);
    let mut pool = ClipPool::new(61, MAX_CLIPS);
    assert!(pool.add_window(clips.view()));
    let n = pool.normalised();
    for (raw, unit) in clips.rows().into_iter().zip(n.rows()) {
        let norm: f64 = unit.iter().map(|&v| f64::from(v).powi(2)).sum();
        assert!((norm - 1.0).abs() < 1e-6);
        assert_eq!(raw[20].signum(), unit[20].signum());
        // Kilosort4 divides in float32 by a float32 norm: within 2 ulp of ours.
        let kn = raw.iter().map(|&v| v * v).sum::<f32>().sqrt();
        for (&r, &u) in raw.iter().zip(unit) {
            assert!(((r / kn) - u).abs() <= 2.5e-7 * u.abs().max(1e-3));
        }
    }
}

fn cos(a: ndarray::ArrayView1<f32>, b: ndarray::ArrayView1<f32>) -> f64 {
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum();
    let na: f64 = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    d / (na * nb)
}

/// k-means objective of unit-norm centroids `w` on `clips`.
fn objective(clips: ArrayView2<f32>, w: ArrayView2<f32>) -> f64 {
    clips
        .rows()
        .into_iter()
        .map(|c| {
            w.rows()
                .into_iter()
                .map(|t| {
                    c.iter()
                        .zip(t)
                        .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
                        .sum::<f64>()
                })
                .fold(f64::INFINITY, f64::min)
        })
        .sum()
}

struct Ks4Runs {
    clips: Array2<f32>,
    wtemp: Array3<f32>,
    wpca: Array3<f32>,
    inertia: ndarray::Array1<f64>,
}

fn ks4_runs() -> Ks4Runs {
    Ks4Runs {
        clips: npy::read(&data("learned/kmeans/clips.npy")).unwrap(),
        wtemp: npy::read(&data("learned/kmeans/wTEMP_runs.npy")).unwrap(),
        wpca: npy::read(&data("learned/kmeans/wPCA_runs.npy")).unwrap(),
        inertia: npy::read(&data("learned/kmeans/inertia_runs.npy")).unwrap(),
    }
}

#[test]
fn wpca_spans_kilosort4s_subspace() {
    let r = ks4_runs();
    let ours = learn_wpca(r.clips.view(), 6).unwrap();
    // Orthonormal rows; the largest-magnitude entry of each is positive.
    for i in 0..6 {
        for j in 0..6 {
            let c = cos(ours.row(i), ours.row(j));
            assert!((c - if i == j { 1.0 } else { 0.0 }).abs() < 1e-5);
        }
        let row = ours.row(i);
        let big = row
            .iter()
            .copied()
            .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
        assert!(big > 0.0);
    }
    // Against numpy's exact float64 SVD of the same clips: the same vectors.
    let exact: Array2<f64> = npy::read(&data("learned/kmeans/svd_exact_vt.npy")).unwrap();
    let exact = exact.mapv(|v| v as f32);
    for k in 0..6 {
        let c = cos(ours.row(k), exact.row(k)).abs();
        assert!(
            c >= 0.9999,
            "component {k}: |cos| = {c:.6} with the exact SVD"
        );
    }
    // Against Kilosort4's randomized TruncatedSVD runs: |cos| ≥ 0.99 for every
    // component whose singular value is separated from its neighbours by more
    // than 5 %. The others lie in a near-degenerate (noise) part of the
    // spectrum, where Kilosort4's own runs disagree with each other (|cos| down
    // to 0.14 on this reference); there, ours captures at least as much of the
    // clips' energy as any Kilosort4 run (it is the exact optimum).
    let sv: ndarray::Array1<f64> = npy::read(&data("learned/kmeans/singular_values.npy")).unwrap();
    let separated = |k: usize| {
        let gap_above = k == 0 || sv[k - 1] > 1.05 * sv[k];
        gap_above && sv[k] > 1.05 * sv[k + 1]
    };
    let energy = |w: ArrayView2<f32>| -> f64 {
        r.clips
            .rows()
            .into_iter()
            .map(|c| {
                w.rows()
                    .into_iter()
                    .map(|v| {
                        c.iter()
                            .zip(v)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                            .powi(2)
                    })
                    .sum::<f64>()
            })
            .sum()
    };
    let ours_e = energy(ours.view());
    let mut n_separated = 0;
    for run in r.wpca.axis_iter(Axis(0)) {
        for k in (0..6).filter(|&k| separated(k)) {
            n_separated += 1;
            let c = cos(ours.row(k), run.row(k)).abs();
            assert!(
                c >= 0.99,
                "component {k}: |cos| = {c:.4} with Kilosort4's run"
            );
        }
        let e = energy(run);
        assert!(
            ours_e >= e * (1.0 - 1e-6),
            "energy {ours_e} < Kilosort4's {e}"
        );
    }
    assert_eq!(
        n_separated,
        5 * 3,
        "components 0-2 are the separated ones here"
    );
}

#[test]
fn wtemp_reaches_kilosort4s_kmeans_objective_and_centroids() {
    let r = ks4_runs();
    let (w, km) = learn_wtemp(r.clips.view(), &LearnSettings::default()).unwrap();
    assert_eq!(w.dim(), (6, 61));
    let mut inertia = r.inertia.to_vec();
    inertia.sort_by(f64::total_cmp);
    let median = inertia[inertia.len() / 2];
    let ours = objective(r.clips.view(), w.view());
    eprintln!(
        "objective of unit-norm centroids: ours {ours:.3}, Kilosort4 runs {inertia:?}; restart kept {}",
        km.restart
    );
    assert!(ours <= 1.01 * median, "ours {ours} vs median {median}");
    for (k, t) in w.rows().into_iter().enumerate() {
        let best = r
            .wtemp
            .axis_iter(Axis(0))
            .flat_map(|run| {
                run.rows()
                    .into_iter()
                    .map(|c| cos(t, c).abs())
                    .collect::<Vec<_>>()
            })
            .fold(0f64, f64::max);
        assert!(best >= 0.95, "centroid {k}: best |cos| {best:.3}");
        let norm: f64 = t.iter().map(|&v| f64::from(v).powi(2)).sum();
        assert!((norm - 1.0).abs() < 1e-5);
    }
}

/// Kilosort4's 1500 reference clips and 6 perturbed copies of them (10 500
/// clips): more than two of the 4096-clip chunks every sum over clips is split
/// into, so the chunked sums are exercised.
fn many_clips() -> Array2<f32> {
    let base = ks4_runs().clips;
    let mut rng = common::Rng(12345);
    let mut all = base.clone();
    for _ in 0..6 {
        let copy = base.mapv(|v| v + 0.02 * rng.normal() as f32);
        all.append(Axis(0), copy.view()).unwrap();
    }
    all
}

#[test]
fn learning_gives_identical_results_with_1_2_and_16_threads() {
    let clips = many_clips();
    assert!(clips.nrows() > 2 * 4096);
    let x: Array2<f32> = npy::read(&data("fixtures/detection/np1/X.npy")).unwrap();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let (w, km) = learn_wtemp(clips.view(), &LearnSettings::default()).unwrap();
            let p = learn_wpca(clips.view(), 6).unwrap();
            let (peaks, c) = extract_clips(x.view(), 6.0, 61, 20);
            let mut pool = ClipPool::new(61, MAX_CLIPS);
            pool.add_window(c.view());
            (
                w,
                km.inertia.to_bits(),
                km.counts,
                p,
                peaks,
                pool.normalised(),
            )
        })
    };
    let one = run(1);
    for threads in [2, 16] {
        let other = run(threads);
        assert_eq!(one.0, other.0, "wTEMP, {threads} threads");
        assert_eq!(one.1, other.1, "k-means inertia, {threads} threads");
        assert_eq!(one.2, other.2, "cluster sizes, {threads} threads");
        assert_eq!(one.3, other.3, "wPCA, {threads} threads");
        assert_eq!(one.4, other.4, "isolated peaks, {threads} threads");
        assert_eq!(one.5, other.5, "normalised clips, {threads} threads");
    }
}

#[test]
fn kmeans_depends_only_on_the_seed() {
    let r = ks4_runs();
    let a = kmeans(r.clips.view(), 6, 5, 2, 300, 1e-4).unwrap();
    let b = kmeans(r.clips.view(), 6, 5, 2, 300, 1e-4).unwrap();
    assert_eq!(a.centres, b.centres);
    assert_eq!(a.inertia.to_bits(), b.inertia.to_bits());
}

/// `spikecube detect` on the tetrode example (4 sites, 15 kHz) into `out`.
fn detect_locust(
    out: &std::path::Path,
    extra: &[&str],
    threads: Option<&str>,
) -> serde_json::Value {
    let rec = data("data/real/locust_tetrode_tridesclous/locust_trial_01.raw");
    let probe = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("data/probes/locust_tetrode.json");
    let mut args = vec![
        "detect",
        common::s(&rec),
        "--n-channels",
        "4",
        "--fs",
        "15000",
        "--probe",
        common::s(&probe),
        "--out",
        common::s(out),
        "-q",
    ];
    args.extend_from_slice(extra);
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_spikecube"));
    cmd.args(&args);
    if let Some(t) = threads {
        cmd.env("RAYON_NUM_THREADS", t);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(out.join("spikecube.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

const SPIKE_FILES: [&str; 7] = [
    "spike_times.npy",
    "spike_centers.npy",
    "amplitudes.npy",
    "spike_detection_templates.npy",
    "spike_signs.npy",
    "spike_positions.npy",
    "pc_features.npy",
];

fn same_files(a: &std::path::Path, b: &std::path::Path, files: &[&str]) {
    for f in files {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

/// Too few isolated peaks on the tetrode example (Kilosort4 4.1.7 finds the
/// same 66 in the one window it reads): the default run warns, says so in
/// spikecube.json, and gives exactly the spikes of `--templates-from-data false`.
#[test]
fn tetrode_example_falls_back_to_builtin_templates_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("default"), dir.path().join("builtin"));
    let ja = detect_locust(&a, &[], None);
    let jb = detect_locust(&b, &["--templates-from-data", "false"], None);
    let t = &ja["settings"]["templates"];
    assert_eq!(t["source"], "builtin");
    assert_eq!(t["n_clips"], 66);
    assert_eq!(t["n_windows"], 1);
    let warnings = ja["warnings"].to_string();
    assert!(
        warnings.contains("only 66 isolated single-channel peaks"),
        "{warnings}"
    );
    assert_eq!(jb["settings"]["templates"]["source"], "builtin");
    assert!(!jb["warnings"].to_string().contains("isolated"));
    same_files(&a, &b, &SPIKE_FILES);
    same_files(&a, &b, &["wTEMP.npy", "wPCA.npy"]);
    let files = ja["files"].to_string();
    for f in ["wTEMP.npy", "wPCA.npy", "templates.png"] {
        assert!(files.contains(f), "{f} not listed: {files}");
    }
    let w: Array2<f32> = npy::read(&a.join("wTEMP.npy")).unwrap();
    assert_eq!(w, spikecube::UniversalTemplates::builtin().wtemp);
}

/// When both detection passes have too few isolated peaks, the second pass's
/// warning refers to the first's instead of repeating its explanation.
#[test]
fn second_pass_fallback_warning_is_short_after_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let sim = common::simulate32(dir.path(), "4", "5", "1");
    let out = dir.path().join("d");
    let rec = sim.join("sim_g0_t0.imec0.ap.bin");
    let o = common::spikecube(&["detect", common::s(&rec), "--out", common::s(&out), "-q"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("spikecube.json")).unwrap()).unwrap();
    let w: Vec<&str> = j["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(w[0].contains("isolated single-channel peaks") && w[0].contains("(--min-learn-clips)"));
    assert!(
        w[1].starts_with("second pass (drift-corrected): again too few isolated peaks")
            && w[1].contains("of the 300 needed")
            && !w[1].contains("Th_single_ch"),
        "{w:?}"
    );
}

/// Templates learned on the tetrode example (allowed with --min-learn-clips):
/// the same with 1, 2 and 16 threads, byte for byte (templates, spikes and
/// features); saved with np.savez's layout and given back with --templates, the
/// same spikes.
#[test]
fn learned_templates_are_thread_independent_and_reusable_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let learn = ["--min-learn-clips", "60"];
    let j1 = detect_locust(&d.join("t1"), &learn, Some("1"));
    detect_locust(&d.join("t2"), &learn, Some("2"));
    detect_locust(&d.join("t16"), &learn, Some("16"));
    let t = &j1["settings"]["templates"];
    assert_eq!(t["source"], "learned", "{t}");
    assert_eq!(t["n_clips"], 66);
    assert_eq!(t["seed"], 1);
    let mut all = SPIKE_FILES.to_vec();
    all.extend(["wTEMP.npy", "wPCA.npy"]);
    same_files(&d.join("t1"), &d.join("t2"), &all);
    same_files(&d.join("t1"), &d.join("t16"), &all);
    let wtemp: Array2<f32> = npy::read(&d.join("t1/wTEMP.npy")).unwrap();
    let wpca: Array2<f32> = npy::read(&d.join("t1/wPCA.npy")).unwrap();
    assert_ne!(wtemp, spikecube::UniversalTemplates::builtin().wtemp);
    assert_eq!((wtemp.dim(), wpca.dim()), ((6, 61), (6, 61)));
    // The first component is negative at the trough (nt0min = 20), as the
    // built-in one, so trough-first spikes get positive first PC features.
    assert!(wpca[[0, 20]] < 0.0, "{}", wpca.row(0));
    assert!(spikecube::UniversalTemplates::builtin().wpca[[0, 20]] < 0.0);

    let npz = d.join("learned.npz");
    let mut w = ndarray_npy::NpzWriter::new(std::fs::File::create(&npz).unwrap());
    w.add_array("wTEMP", &wtemp).unwrap();
    w.add_array("wPCA", &wpca).unwrap();
    w.finish().unwrap();
    let jf = detect_locust(&d.join("file"), &["--templates", common::s(&npz)], None);
    assert_eq!(jf["settings"]["templates"]["source"], "file");
    same_files(&d.join("t1"), &d.join("file"), &all);

    // A different seed is recorded (and may give other templates).
    let j3 = detect_locust(
        &d.join("s2"),
        &["--min-learn-clips", "60", "--seed", "2"],
        None,
    );
    assert_eq!(j3["settings"]["templates"]["seed"], 2);
}

/// A --templates file that does not fit is refused, naming the file and the shapes.
#[test]
fn a_templates_file_of_the_wrong_shape_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let npz = dir.path().join("bad.npz");
    let mut w = ndarray_npy::NpzWriter::new(std::fs::File::create(&npz).unwrap());
    w.add_array("wTEMP", &Array2::<f32>::zeros((6, 50)))
        .unwrap();
    w.add_array("wPCA", &Array2::<f32>::zeros((6, 61))).unwrap();
    w.finish().unwrap();
    let rec = data("data/real/locust_tetrode_tridesclous/locust_trial_01.raw");
    let o = common::spikecube(&[
        "detect",
        common::s(&rec),
        "--n-channels",
        "4",
        "--fs",
        "15000",
        "--probe",
        common::s(
            &std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("data/probes/locust_tetrode.json"),
        ),
        "--templates",
        common::s(&npz),
        "--out",
        common::s(&dir.path().join("o")),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("bad.npz") && err.contains("6 × 50"), "{err}");
    assert!(!dir.path().join("o").exists());
}

/// Kilosort4's detection with the templates it learned from a recording
/// (`tests/data/learned/detection/`, made by `make_learned_detection.py`): given
/// those wTEMP/wPCA through the `--templates` reader and Kilosort4's iC, iC2 and
/// weigh, our detector gives the same detections (centre, sample, imax, sign) on
/// Kilosort4's whitened windows, and amp, adist, yct and tF within the detection
/// fixtures' tolerance (|ours − Kilosort4| ≤ 1e-5 · max(|Kilosort4|, 1)).
#[test]
fn detections_with_kilosort4s_learned_templates_are_identical_to_kilosort4s() {
    const TOL: f64 = 1e-5;
    let max_rel = |a: &[f32], b: &[f32]| -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(&r, &o)| (f64::from(r) - f64::from(o)).abs() / f64::from(r).abs().max(1.0))
            .fold(0.0, f64::max)
    };
    let dir = data("learned/detection");
    let templates = spikecube::universal::load_npz(&dir.join("wTEMP.npz"), 6, 6, 61).unwrap();
    // They are learned ones, not the built-in templates.
    assert_ne!(
        templates.wtemp,
        spikecube::UniversalTemplates::builtin().wtemp
    );
    let probe = spikecube::Probe::load(&dir.join("probe.json")).unwrap();
    let i_c = npy::read::<i64, ndarray::Ix2>(&dir.join("iC.npy"))
        .unwrap()
        .mapv(|v| v as u32);
    let i_c2 = npy::read::<i64, ndarray::Ix2>(&dir.join("iC2.npy"))
        .unwrap()
        .mapv(|v| v as u32);
    let weigh: Array3<f32> = npy::read(&dir.join("weigh.npy")).unwrap();
    let settings = spikecube::DetectionSettings {
        nearest_chans: i_c.nrows(),
        ..Default::default()
    };
    let geometry =
        spikecube::Geometry::with_neighbourhoods(&probe, &settings, i_c, i_c2, weigh).unwrap();
    let mut det = spikecube::detect::cpu::CpuDetector::new(geometry, templates, settings).unwrap();
    let mut total = 0;
    for b in [0, 899] {
        let w = dir.join(format!("batch_{b}"));
        let x: Array2<f32> = npy::read(&w.join("X.npy")).unwrap();
        let d = det.detect(x.view(), &probe.yc).unwrap();
        let xy: Array2<i64> = npy::read(&w.join("xy.npy")).unwrap();
        let ours: Vec<(i64, i64)> = d
            .centre
            .iter()
            .zip(&d.sample)
            .map(|(&j, &t)| (i64::from(j), t as i64))
            .collect();
        let theirs: Vec<(i64, i64)> = xy.rows().into_iter().map(|r| (r[0], r[1])).collect();
        assert_eq!(ours, theirs, "batch {b}: (centre, sample)");
        let imax: ndarray::Array1<i64> = npy::read(&w.join("imax.npy")).unwrap();
        let our_imax: Vec<i64> = d.imax.iter().map(|&v| i64::from(v)).collect();
        assert_eq!(our_imax, imax.to_vec(), "batch {b}: imax");
        let sign: ndarray::Array1<i8> = npy::read(&w.join("sign.npy")).unwrap();
        assert_eq!(d.sign, sign.to_vec(), "batch {b}: sign");
        let amp: ndarray::Array1<f32> = npy::read(&w.join("amp.npy")).unwrap();
        let yct: ndarray::Array1<f32> = npy::read(&w.join("yct.npy")).unwrap();
        let adist: Array2<f32> = npy::read(&w.join("adist.npy")).unwrap();
        let tf: Array3<f32> = npy::read(&w.join("tF.npy")).unwrap();
        assert_eq!(tf.shape(), d.tf_array().shape(), "batch {b}: tF shape");
        let diffs = [
            ("amp", max_rel(amp.as_slice().unwrap(), &d.amp)),
            ("yct", max_rel(yct.as_slice().unwrap(), &d.yct)),
            (
                "adist",
                max_rel(
                    &adist.iter().copied().collect::<Vec<_>>(),
                    &d.adist_kilosort().iter().copied().collect::<Vec<_>>(),
                ),
            ),
            ("tF", max_rel(tf.as_slice().unwrap(), &d.tf)),
        ];
        eprintln!("batch {b}: {} detections identical; {diffs:?}", d.len());
        for (what, v) in diffs {
            assert!(v <= TOL, "batch {b}: {what} differs by {v:.3e} > {TOL:e}");
        }
        // Kilosort4's spike table of that batch: time (s from the recording's
        // start), yct, amp, imax, batch, centre.
        let st: Array2<f64> = npy::read(&w.join("st.npy")).unwrap();
        for (i, r) in st.rows().into_iter().enumerate() {
            let t = d.sample[i] as f64;
            assert_eq!(
                r[0],
                (t - 61.0) / 30000.0 + f64::from(b) * (2000.0 / 30000.0)
            );
            assert_eq!(
                (r[3], r[4], r[5]),
                (imax[i] as f64, f64::from(b), xy[[i, 0]] as f64)
            );
        }
        total += d.len();
    }
    assert_eq!(total, 25 + 27);
}

/// The whole pipeline on the two real example recordings with Kilosort4's own
/// learned templates (`tests/data/learned/real/*_ks4.npz`, written by
/// `benches/ks4_learned_detect.py`: Kilosort4 4.1.7 with `templates_from_data`
/// and `nblocks 0`, its learned wTEMP/wPCA and its spike table st0): given them
/// with `--templates`, every spike of Kilosort4 (sample, centre, winning filter)
/// and no other, amplitudes within 1e-5 relative.
#[test]
fn whole_recordings_with_kilosort4s_learned_templates_give_kilosort4s_spikes() {
    use ndarray::Array1;
    use ndarray_npy::NpzReader;
    let real = data("data/real");
    let probes = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/probes");
    let oe =
        real.join("openephys_example_16ch/binary_format/Record Node 101/experiment1/recording1");
    let locust = real.join("locust_tetrode_tridesclous/locust_trial_01.raw");
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, Vec<&str>, &str, f64, usize); 2] = [
        (
            "openephys",
            vec![common::s(&oe)],
            "openephys_16ch_linear.json",
            40_000.0,
            1511,
        ),
        (
            "locust",
            vec![common::s(&locust), "--n-channels", "4", "--fs", "15000"],
            "locust_tetrode.json",
            15_000.0,
            515,
        ),
    ];
    for (name, rec, probe, fs, n_ks4) in cases {
        let npz = data(&format!("learned/real/{name}_ks4.npz"));
        let out = dir.path().join(name);
        let probe = probes.join(probe);
        let mut args = vec!["detect"];
        args.extend(rec);
        args.extend([
            "--probe",
            common::s(&probe),
            "--templates",
            common::s(&npz),
            "--nblocks",
            "0",
            "--out",
            common::s(&out),
            "-q",
        ]);
        let o = common::spikecube(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let st0: Array2<f64> = NpzReader::new(std::fs::File::open(&npz).unwrap())
            .unwrap()
            .by_name("st0")
            .unwrap();
        assert_eq!(st0.nrows(), n_ks4);
        // Kilosort4's rows: (sample, centre, imax) and amp, sorted.
        let mut theirs: Vec<((i64, i64, i64), f64)> = st0
            .rows()
            .into_iter()
            .map(|r| {
                let t = (r[0] * fs).round() as i64;
                ((t, r[5] as i64, r[3] as i64), r[2])
            })
            .collect();
        theirs.sort_by_key(|a| a.0);
        let t: Array1<i64> = npy::read(&out.join("spike_times.npy")).unwrap();
        let c: Array1<i64> = npy::read(&out.join("spike_centers.npy")).unwrap();
        let k: Array1<i64> = npy::read(&out.join("spike_detection_templates.npy")).unwrap();
        let a: Array1<f32> = npy::read(&out.join("amplitudes.npy")).unwrap();
        let mut ours: Vec<((i64, i64, i64), f64)> = (0..t.len())
            .map(|i| ((t[i], c[i], k[i]), f64::from(a[i])))
            .collect();
        ours.sort_by_key(|a| a.0);
        let keys = |v: &[((i64, i64, i64), f64)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(keys(&ours), keys(&theirs), "{name}: (sample, centre, imax)");
        let worst = ours
            .iter()
            .zip(&theirs)
            .map(|(o, r)| (o.1 - r.1).abs() / r.1.abs().max(1.0))
            .fold(0.0, f64::max);
        eprintln!(
            "{name}: {} spikes identical to Kilosort4's; amplitudes within {worst:.1e}",
            ours.len()
        );
        assert!(worst <= 1e-5, "{name}: amplitude differs by {worst:e}");
    }
}

/// With `--preprocess-on host`, `--backend wgpu` learns from windows
/// preprocessed on the CPU and writes the same `wTEMP.npy`, `wPCA.npy`,
/// `templates.png` and `"templates"` record as `--backend cpu`, byte for
/// byte; by default the device preprocesses the learning's windows as it does
/// the pass's, and the templates agree with the CPU's to float32 rounding. In
/// the wgpu test group (Mesa's lavapipe in CI, like tests/gpu.rs).
#[cfg(feature = "wgpu")]
#[test]
fn the_template_step_gives_the_same_files_on_the_cpu_and_wgpu_back_ends() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cpu = detect_locust(
        &d.join("cpu"),
        &["--min-learn-clips", "60", "--backend", "cpu"],
        None,
    );
    // With the host's whitening fit (preprocessing on the host), the template
    // step sees the same windows: the same files, bit for bit.
    let host = detect_locust(
        &d.join("wgpu_host"),
        &[
            "--min-learn-clips",
            "60",
            "--backend",
            "wgpu",
            "--preprocess-on",
            "host",
        ],
        None,
    );
    assert_eq!(cpu["settings"]["templates"]["source"], "learned");
    assert_eq!(cpu["settings"]["templates"], host["settings"]["templates"]);
    same_files(
        &d.join("cpu"),
        &d.join("wgpu_host"),
        &["wTEMP.npy", "wPCA.npy", "templates.png", "spike_times.npy"],
    );
    // By default the device fits W (its covariance within float32 rounding of
    // the host's, README "GPU back ends") and preprocesses the learning's
    // windows: the templates agree to that rounding, and the spikes are the same.
    let gpu = detect_locust(
        &d.join("wgpu"),
        &["--min-learn-clips", "60", "--backend", "wgpu"],
        None,
    );
    assert_eq!(gpu["settings"]["templates"]["source"], "learned");
    assert_eq!(gpu["settings"]["templates"]["preprocessed_on"], "device");
    assert_eq!(host["settings"]["templates"]["preprocessed_on"], "host");
    same_files(&d.join("cpu"), &d.join("wgpu"), &["spike_times.npy"]);
    for f in ["wTEMP.npy", "wPCA.npy"] {
        let a: ndarray::Array2<f32> = ndarray_npy::read_npy(d.join("cpu").join(f)).unwrap();
        let b: ndarray::Array2<f32> = ndarray_npy::read_npy(d.join("wgpu").join(f)).unwrap();
        let top = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(b.iter())
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        eprintln!("{f}: CPU and wgpu differ by {worst:.2e} (largest entry {top:.2e})");
        assert!(
            worst <= 1e-5 * top,
            "{f}: differs by {worst} (largest {top})"
        );
    }
}
