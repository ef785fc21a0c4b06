//! The CCG-gated merges and the Phy export against Kilosort4 4.1.7's own
//! arrays (`tests/data/sort/<case>/`, written by `make_sort_fixtures.py`):
//! given Kilosort4's final clustering, our merges give Kilosort4's
//! `merge_out.npz`, and our Phy folder equals Kilosort4's `phy/` file by file
//! (integers, labels and `.tsv` files exactly, floats within the tolerances
//! below, each explained).

use std::path::{Path, PathBuf};

use ndarray::{ArrayD, IxDyn};
use spikecube::Probe;
use spikecube::sort::ks_arrays::{self, KilosortArrays};
use spikecube::sort::merge::merge_ccg;
use spikecube::sort::phy;

/// Every fixture case: a folder under tests/data/sort with Kilosort4's merged arrays and Phy folder.
fn cases() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/sort");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.retain(|p| p.join("merge_out.npz").is_file() && p.join("phy").is_dir());
    v.sort();
    assert!(
        !v.is_empty(),
        "no Kilosort4 sort fixture under {}",
        root.display()
    );
    v
}

/// The probe each case was sorted with (tests/data/sort/README.md).
fn probe_of(case: &Path) -> Probe {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let p = match case.file_name().and_then(|n| n.to_str()) {
        Some("oe16") => root.join("data/probes/openephys_16ch_linear.json"),
        _ => root.join("tests/data/sort/probe32.json"),
    };
    Probe::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn load(case: &Path) -> KilosortArrays {
    ks_arrays::load(case).unwrap_or_else(|e| panic!("{}: {e:#}", case.display()))
}

/// Max |a − b| and max |a − b| / max(|b|, 1e-3·max|b|) over two float arrays of one shape.
fn float_diff(a: &ArrayD<f32>, b: &ArrayD<f32>) -> (f64, f64) {
    assert_eq!(a.shape(), b.shape());
    let scale = b.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
    let mut abs = 0.0f64;
    let mut rel = 0.0f64;
    for (&x, &y) in a.iter().zip(b.iter()) {
        let d = (f64::from(x) - f64::from(y)).abs();
        abs = abs.max(d);
        rel = rel.max(d / f64::from(y).abs().max(1e-3 * scale).max(1e-30));
    }
    (abs, rel)
}

#[test]
fn merges_match_kilosort4() {
    for case in cases() {
        let ks = load(&case);
        let want = ks.merged.clone().unwrap();
        let r = ks.result;
        let got = merge_ccg(
            r.wall.clone(),
            &r.clu,
            r.st.clone(),
            r.tf.clone(),
            r.wpca.view(),
            ks.settings.fs,
            &ks.settings.merge,
        )
        .unwrap();
        let name = case.file_name().unwrap().to_string_lossy();
        println!(
            "{name}: {} clusters → {} units ({} merges; Kilosort4 {})",
            r.wall.shape()[0],
            got.wall.shape()[0],
            got.n_merges,
            want.wall.shape()[0]
        );
        assert_eq!(got.wall.shape(), want.wall.shape(), "{name}: units");
        assert_eq!(got.is_ref, want.is_ref, "{name}: is_ref");
        assert_eq!(got.clu, want.clu, "{name}: labels");
        assert_eq!(got.st, want.st, "{name}: st (times, templates, amplitudes)");
        let (wa, _) = float_diff(&got.wall.into_dyn(), &want.wall.into_dyn());
        let (fa, fr) = float_diff(&got.tf.into_dyn(), &want.tf.into_dyn());
        println!("{name}: Wall max |Δ| {wa:.2e}; tF max |Δ| {fa:.2e} (relative {fr:.2e})");
        assert!(wa <= 1e-5, "{name}: Wall differs by {wa}");
        // Shifted features: float64 roll here, three float32 matmuls in Kilosort4.
        assert!(fr <= 1e-4, "{name}: tF differs by {fa} ({fr} relative)");
    }
}

/// Kilosort4's dtype of each Phy file, and the tolerance for the float ones
/// (relative to the file's largest magnitude, or to each value).
#[derive(Clone, Copy)]
enum Kind {
    I64,
    I32,
    U32,
    Bool,
    /// Float32 within this relative tolerance (see each use).
    F32(f64),
}

const FILES: &[(&str, Kind)] = &[
    ("spike_times.npy", Kind::I64),
    ("spike_clusters.npy", Kind::I32),
    ("spike_templates.npy", Kind::I32),
    ("spike_detection_templates.npy", Kind::I32),
    ("kept_spikes.npy", Kind::Bool),
    ("templates_ind.npy", Kind::I64),
    ("pc_feature_ind.npy", Kind::U32),
    ("channel_map.npy", Kind::I32),
    ("channel_positions.npy", Kind::F32(0.0)),
    ("channel_shanks.npy", Kind::F32(0.0)),
    ("whitening_mat.npy", Kind::F32(0.0)),
    ("whitening_mat_dat.npy", Kind::F32(0.0)),
    // float32 LAPACK inverse in Kilosort4, float64 here.
    ("whitening_mat_inv.npy", Kind::F32(1e-4)),
    // float32 reductions (norms, sums) in a different order: a few ulps.
    ("amplitudes.npy", Kind::F32(1e-5)),
    ("spike_positions.npy", Kind::F32(1e-5)),
    ("templates.npy", Kind::F32(1e-5)),
    ("similar_templates.npy", Kind::F32(1e-5)),
    ("pc_features.npy", Kind::F32(1e-4)),
];

fn read<A: ndarray_npy::ReadableElement + Clone>(p: &Path) -> ArrayD<A> {
    spikecube::npy::read::<A, IxDyn>(p).unwrap_or_else(|e| panic!("{e:#}"))
}

/// Compares our folder with Kilosort4's, file by file; returns the report lines.
fn compare(ours: &Path, theirs: &Path, strict_tf: bool) -> Vec<String> {
    let mut lines = Vec::new();
    for &(name, kind) in FILES {
        let (a, b) = (ours.join(name), theirs.join(name));
        let line = match kind {
            Kind::I64 => {
                assert_eq!(read::<i64>(&a), read::<i64>(&b), "{name}");
                format!("{name}: identical")
            }
            Kind::I32 => {
                assert_eq!(read::<i32>(&a), read::<i32>(&b), "{name}");
                format!("{name}: identical")
            }
            Kind::U32 => {
                assert_eq!(read::<u32>(&a), read::<u32>(&b), "{name}");
                format!("{name}: identical")
            }
            Kind::Bool => {
                assert_eq!(read::<bool>(&a), read::<bool>(&b), "{name}");
                format!("{name}: identical")
            }
            Kind::F32(tol) => {
                let (x, y) = (read::<f32>(&a), read::<f32>(&b));
                let (abs, rel) = float_diff(&x, &y);
                let tol = if name == "pc_features.npy" && strict_tf {
                    0.0
                } else {
                    tol
                };
                assert!(
                    rel <= tol,
                    "{name}: max |Δ| {abs:e}, relative {rel:e} > {tol:e}"
                );
                format!("{name}: max |Δ| {abs:.2e}, relative {rel:.2e} (≤ {tol:e})")
            }
        };
        lines.push(line);
    }
    for name in [
        "cluster_KSLabel.tsv",
        "cluster_group.tsv",
        "cluster_ContamPct.tsv",
        "cluster_Amplitude.tsv",
    ] {
        let (a, b) = (
            std::fs::read_to_string(ours.join(name)).unwrap(),
            std::fs::read_to_string(theirs.join(name)).unwrap(),
        );
        assert_eq!(a, b, "{name}");
        lines.push(format!("{name}: identical bytes"));
    }
    // params.py: identical but for the recording's path (written absolute).
    let strip = |p: &Path| -> Vec<String> {
        std::fs::read_to_string(p.join("params.py"))
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("dat_path"))
            .map(String::from)
            .collect()
    };
    assert_eq!(strip(ours), strip(theirs), "params.py");
    lines.push("params.py: identical but dat_path".into());
    lines
}

fn export(case: &Path, merged: bool) -> (tempfile::TempDir, PathBuf) {
    let ks = load(case);
    let probe = probe_of(case);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("phy");
    let r = ks.result;
    let summary = if merged {
        phy::write_phy(
            &out,
            ks.merged.unwrap(),
            r.wpca.view(),
            r.wrot.view(),
            &r.sets,
            &probe,
            &ks.settings,
            serde_json::json!({}),
            "export-phy",
        )
    } else {
        phy::save_sorting(
            &out,
            r,
            &probe,
            &ks.settings,
            serde_json::json!({}),
            "export-phy",
        )
    }
    .unwrap();
    println!("{summary:?}");
    (tmp, out)
}

/// From Kilosort4's merged arrays: the export alone.
#[test]
fn phy_export_of_kilosort4_merges_matches() {
    for case in cases() {
        let (_tmp, out) = export(&case, true);
        for l in compare(&out, &case.join("phy"), true) {
            println!("{} (export only) {l}", case.display());
        }
    }
}

/// From Kilosort4's final clustering: our merges, then our export.
#[test]
fn phy_folder_matches_kilosort4() {
    for case in cases() {
        let (_tmp, out) = export(&case, false);
        for l in compare(&out, &case.join("phy"), false) {
            println!("{} {l}", case.display());
        }
    }
}

/// The merges and the Phy folder, from Kilosort4's final clustering, are the
/// same bytes on 1, 2 and 16 threads (every file but `spikecube.json`, whose
/// only varying field would be a path).
#[test]
fn phy_folder_is_the_same_on_every_thread_count() {
    for case in cases() {
        let folders: Vec<(usize, (tempfile::TempDir, PathBuf))> = [1usize, 2, 16]
            .into_iter()
            .map(|t| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(t)
                    .build()
                    .unwrap();
                (t, pool.install(|| export(&case, false)))
            })
            .collect();
        let (_, (_, first)) = &folders[0];
        let mut names: Vec<_> = std::fs::read_dir(first)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n != "spikecube.json")
            .collect();
        names.sort();
        assert!(names.len() > 20, "{names:?}");
        for (t, (_, dir)) in &folders[1..] {
            for name in &names {
                let a = std::fs::read(first.join(name)).unwrap();
                let b = std::fs::read(dir.join(name)).unwrap();
                assert!(
                    a == b,
                    "{}: {} differs between 1 and {t} threads",
                    case.display(),
                    name.to_string_lossy()
                );
            }
        }
    }
}
