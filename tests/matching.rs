//! Template post-processing and learned-template matching against Kilosort4
//! 4.1.7's own `postprocess_templates` and `extract`.
//!
//! `tests/data/matching/unit.npz` (made by `make_matching_unit.py` there):
//! synthetic templates and windows with Kilosort4's outputs on them, so
//! both sides see the same float32 windows.

mod common;

use std::fs::File;

use common::data;
use ndarray::{Array1, Array2, Array3, ArrayD, Axis, Ix1, Ix2, Ix3};
use ndarray_npy::NpzReader;
use spikecube::sort::matching::{MatchingSettings, MatchingSetup, WindowSpikes, assemble, match_window};
use spikecube::sort::templates::postprocess_templates;

struct Unit {
    wpca: Array2<f32>,
    wtemp: Array2<f32>,
    xc: Array1<f32>,
    yc: Array1<f32>,
    wall0: Array3<f32>,
    clu0: Array1<i32>,
    wall3: Array3<f32>,
    x: Array3<f32>,
    st: Array2<f64>,
    tf: Array3<f32>,
    icc: Array2<i64>,
    icc_mask: Array2<bool>,
    iu: Array1<i64>,
    batch_size: usize,
}

fn get<A: ndarray_npy::ReadableElement, D: ndarray::Dimension>(
    z: &mut NpzReader<File>,
    name: &str,
) -> ndarray::Array<A, D> {
    z.by_name(name)
        .unwrap_or_else(|e| panic!("unit.npz: {name}: {e}"))
}

fn load_unit() -> Unit {
    let mut z = NpzReader::new(File::open(data("matching/unit.npz")).unwrap()).unwrap();
    let bs: ArrayD<i64> = get(&mut z, "batch_size");
    Unit {
        wpca: get::<f32, Ix2>(&mut z, "wPCA"),
        wtemp: get::<f32, Ix2>(&mut z, "wTEMP"),
        xc: get::<f32, Ix1>(&mut z, "xc"),
        yc: get::<f32, Ix1>(&mut z, "yc"),
        wall0: get::<f32, Ix3>(&mut z, "Wall0"),
        clu0: get::<i32, Ix1>(&mut z, "clu0"),
        wall3: get::<f32, Ix3>(&mut z, "Wall3"),
        x: get::<f32, Ix3>(&mut z, "X"),
        st: get::<f64, Ix2>(&mut z, "st"),
        tf: get::<f32, Ix3>(&mut z, "tF"),
        icc: get::<i64, Ix2>(&mut z, "iCC"),
        icc_mask: get::<bool, Ix2>(&mut z, "iCC_mask"),
        iu: get::<i64, Ix1>(&mut z, "iU"),
        batch_size: bs.iter().next().copied().unwrap() as usize,
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn postprocess_templates_equals_kilosort4_on_the_unit_case() {
    let u = load_unit();
    let post =
        postprocess_templates(u.wall0.view(), u.clu0.as_slice().unwrap(), u.wpca.view(), u.wtemp.view())
            .unwrap();
    assert_eq!(post.wall3.dim(), u.wall3.dim(), "Wall3 shape (K, 6, C)");
    let err = max_abs_diff(post.wall3.as_slice().unwrap(), u.wall3.as_slice().unwrap());
    let peak = u.wall3.iter().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!("Wall3: K = {}, max |ours − Kilosort4| = {err:e} (peak {peak})", u.wall3.dim().0);
    assert!(err <= 1e-5 * peak.max(1.0), "Wall3 differs by {err}");
    // The merged set: 12 clusters → 8 templates, every cluster assigned.
    assert_eq!(post.template_of.len(), u.wall0.dim().0);
    assert_eq!(post.counts.iter().sum::<u64>(), u.clu0.len() as u64);
}

fn unit_setup(u: &Unit) -> MatchingSetup {
    let settings = MatchingSettings {
        batch_size: u.batch_size,
        ..MatchingSettings::default()
    };
    MatchingSetup::new(
        u.wall3.view(),
        u.wpca.view(),
        u.xc.as_slice().unwrap(),
        u.yc.as_slice().unwrap(),
        &settings,
    )
    .unwrap()
}

#[test]
fn matching_equals_kilosort4_on_the_unit_case() {
    let u = load_unit();
    let setup = unit_setup(&u);
    assert_eq!(setup.icc().mapv(i64::from), u.icc, "iCC");
    assert_eq!(setup.icc_mask(), &u.icc_mask, "iCC_mask");
    assert_eq!(
        setup.iu().iter().map(|&v| i64::from(v)).collect::<Vec<_>>(),
        u.iu.to_vec(),
        "iU"
    );
    let parts: Vec<WindowSpikes> = u
        .x
        .axis_iter(Axis(0))
        .map(|x| match_window(&setup, x).unwrap())
        .collect();
    let ours = assemble(&setup, &parts);
    let n = u.st.nrows();
    eprintln!(
        "unit case: {n} Kilosort4 spikes, {} ours, peels per window {:?}",
        ours.st.nrows(),
        parts.iter().map(|p| p.peels).collect::<Vec<_>>()
    );
    assert_eq!(ours.st.nrows(), n, "spike count");
    let mut worst_amp = 0f64;
    for i in 0..n {
        assert_eq!(ours.st[[i, 0]], u.st[[i, 0]], "spike {i}: sample");
        assert_eq!(ours.st[[i, 1]], u.st[[i, 1]], "spike {i}: template");
        let rel = (ours.st[[i, 2]] - u.st[[i, 2]]).abs() / u.st[[i, 2]].abs();
        worst_amp = worst_amp.max(rel);
    }
    let tf_err = max_abs_diff(ours.tf.as_slice().unwrap(), u.tf.as_slice().unwrap());
    eprintln!("amplitude max relative difference {worst_amp:e}; tF max abs difference {tf_err:e}");
    assert!(worst_amp < 1e-4);
    assert!(tf_err < 1e-5 * u.tf.iter().fold(1f32, |m, v| m.max(v.abs())));
}

#[test]
fn matching_is_independent_of_the_thread_count() {
    let u = load_unit();
    let setup = unit_setup(&u);
    let x = u.x.index_axis(Axis(0), 1);
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let four = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    let a = one.install(|| match_window(&setup, x).unwrap());
    let b = four.install(|| match_window(&setup, x).unwrap());
    assert_eq!(a, b);
}

#[test]
fn precomputed_and_per_spike_cross_correlations_agree_exactly() {
    let u = load_unit();
    let setup = unit_setup(&u);
    assert!(setup.ctc_precomputed());
    let lean = MatchingSetup::new(
        u.wall3.view(),
        u.wpca.view(),
        u.xc.as_slice().unwrap(),
        u.yc.as_slice().unwrap(),
        &MatchingSettings {
            batch_size: u.batch_size,
            ctc_budget_bytes: 0,
            ..MatchingSettings::default()
        },
    )
    .unwrap();
    assert!(!lean.ctc_precomputed());
    assert!(lean.pair_bytes() < setup.pair_bytes());
    let x = u.x.index_axis(Axis(0), 0);
    assert_eq!(match_window(&setup, x).unwrap(), match_window(&lean, x).unwrap());
}
