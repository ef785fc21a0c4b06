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
use spikecube::sort::matching::{
    MatchError, MatchingSettings, MatchingSetup, WindowSpikes, assemble, extract, match_window,
};
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
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn postprocess_templates_equals_kilosort4_on_the_unit_case() {
    let u = load_unit();
    let post = postprocess_templates(
        u.wall0.view(),
        u.clu0.as_slice().unwrap(),
        u.wpca.view(),
        u.wtemp.view(),
    )
    .unwrap();
    assert_eq!(post.wall3.dim(), u.wall3.dim(), "Wall3 shape (K, 6, C)");
    let err = max_abs_diff(post.wall3.as_slice().unwrap(), u.wall3.as_slice().unwrap());
    let peak = u.wall3.iter().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!(
        "Wall3: K = {}, max |ours − Kilosort4| = {err:e} (peak {peak})",
        u.wall3.dim().0
    );
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
    // iCC: numpy breaks distance ties in its own order; ours takes the lower
    // index. The same distances in the same ranks, then Kilosort4's order.
    let d2 = |a: usize, b: usize| {
        let (dx, dy) = (u.xc[a] - u.xc[b], u.yc[a] - u.yc[b]);
        dx * dx + dy * dy
    };
    for ((r, c), &k) in u.icc.indexed_iter() {
        assert_eq!(
            d2(setup.icc()[[r, c]] as usize, c),
            d2(k as usize, c),
            "iCC[{r}, {c}] distance"
        );
    }
    let setup = setup.with_icc(u.icc.mapv(|v| v as u32)).unwrap();
    assert_eq!(setup.icc_mask(), &u.icc_mask, "iCC_mask");
    assert_eq!(
        setup.iu().iter().map(|&v| i64::from(v)).collect::<Vec<_>>(),
        u.iu.to_vec(),
        "iU"
    );
    let parts: Vec<WindowSpikes> =
        u.x.axis_iter(Axis(0))
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
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let four = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
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
    assert_eq!(
        match_window(&setup, x).unwrap(),
        match_window(&lean, x).unwrap()
    );
}

/// Kilosort4's fixtures on the Open Ephys example (`tests/data/sort/oe16/`).
struct Case {
    ops: NpzReader<File>,
    dir: std::path::PathBuf,
}

impl Case {
    fn open(name: &str) -> Case {
        let dir = data(&format!("sort/{name}"));
        Case {
            ops: NpzReader::new(File::open(dir.join("ops.npz")).unwrap()).unwrap(),
            dir,
        }
    }

    fn npz(&self, file: &str) -> NpzReader<File> {
        NpzReader::new(File::open(self.dir.join(file)).unwrap()).unwrap()
    }
}

#[test]
fn postprocess_templates_equals_kilosort4_on_oe16() {
    let mut case = Case::open("oe16");
    let mut first = case.npz("first_out.npz");
    let wall0: Array3<f32> = get(&mut first, "Wall0");
    let clu0: Array1<i32> = get(&mut first, "clu0");
    let wpca: Array2<f32> = get(&mut case.ops, "wPCA");
    let wtemp: Array2<f32> = get(&mut case.ops, "wTEMP");
    let want: Array3<f32> = get(&mut case.npz("post_out.npz"), "Wall3");
    let post = postprocess_templates(
        wall0.view(),
        clu0.as_slice().unwrap(),
        wpca.view(),
        wtemp.view(),
    )
    .unwrap();
    assert_eq!(post.wall3.dim(), want.dim(), "Wall3 shape");
    let err = max_abs_diff(post.wall3.as_slice().unwrap(), want.as_slice().unwrap());
    let peak = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!(
        "oe16 Wall3: K = {}, max |ours − Kilosort4| = {err:e} (peak {peak})",
        want.dim().0
    );
    assert!(err <= 1e-5 * peak.max(1.0));
}

/// Every window of a flat int16 recording, preprocessed with Kilosort4's `Wrot`.
fn windows(
    dat: &std::path::Path,
    n_channels: u64,
    fs: f64,
    probe: &spikecube::Probe,
    wrot: Array2<f32>,
) -> (Vec<Array2<f32>>, usize) {
    use spikecube::preprocess::{PreprocessSettings, Preprocessor};
    use spikecube::recording::{Dtype, Format, OpenOptions, WindowPlan, open};
    let opened = open(
        dat,
        &OpenOptions {
            format: Format::Binary,
            n_channels: Some(n_channels),
            fs: Some(fs),
            dtype: Dtype::Int16,
            ..OpenOptions::default()
        },
    )
    .unwrap();
    let settings = PreprocessSettings {
        fs,
        ..PreprocessSettings::default()
    };
    let pre = Preprocessor::new(&settings, wrot).unwrap();
    let rec = opened.recording;
    let plan = WindowPlan::new(
        rec.n_samples(),
        settings.batch_size as u64,
        settings.nt as u64,
    )
    .unwrap();
    let windows = (0..plan.n_windows)
        .map(|i| {
            spikecube::sort::matching::preprocessed_window(
                rec.as_ref(),
                &plan,
                &probe.chan_map,
                &pre,
                None,
                i,
            )
            .unwrap()
        })
        .collect::<Vec<_>>();
    // One buffer reused for every window, last first (as the CPU matching
    // pass reuses its buffers): the same values as fresh buffers.
    let mut reused = Array2::<f32>::zeros((0, 0));
    for i in (0..plan.n_windows).rev() {
        spikecube::sort::matching::preprocessed_window_into(
            rec.as_ref(),
            &plan,
            &probe.chan_map,
            &pre,
            None,
            i,
            None,
            &mut reused,
        )
        .unwrap();
        let bits = |a: &Array2<f32>| a.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&reused), bits(&windows[i as usize]), "window {i}");
    }
    (windows, settings.batch_size)
}

fn oe16_windows(wrot: Array2<f32>) -> (Vec<Array2<f32>>, usize) {
    let dat = data(
        "data/real/openephys_example_16ch/binary_format/Record Node 101/experiment1/recording1/continuous/File_Reader-100.example_data/continuous.dat",
    );
    let probe = spikecube::Probe::load(
        &std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("data/probes/openephys_16ch_linear.json"),
    )
    .unwrap();
    windows(&dat, 16, 40_000.0, &probe, wrot)
}

/// The sim32 recording, made again from its seed (`tests/data/sort/README.md`).
fn sim32_windows(wrot: Array2<f32>) -> (Vec<Array2<f32>>, usize) {
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
    let out = dir.path().join("sim");
    let sum = simulate(&probe, &cfg, &out).unwrap();
    assert_eq!(sum.n_channels, 33);
    windows(&sum.bin_path, 33, 30_000.0, &probe, wrot)
}

#[test]
fn postprocess_templates_equals_kilosort4_on_sim32() {
    let mut case = Case::open("sim32");
    let mut first = case.npz("first_out.npz");
    let wall0: Array3<f32> = get(&mut first, "Wall0");
    let clu0: Array1<i32> = get(&mut first, "clu0");
    let wpca: Array2<f32> = get(&mut case.ops, "wPCA");
    let wtemp: Array2<f32> = get(&mut case.ops, "wTEMP");
    let want: Array3<f32> = get(&mut case.npz("post_out.npz"), "Wall3");
    let post = postprocess_templates(
        wall0.view(),
        clu0.as_slice().unwrap(),
        wpca.view(),
        wtemp.view(),
    )
    .unwrap();
    eprintln!(
        "sim32: K0 = {} → K = {} (Kilosort4 {})",
        wall0.dim().0,
        post.wall3.dim().0,
        want.dim().0
    );
    assert_eq!(post.wall3.dim(), want.dim(), "Wall3 shape");
    let err = max_abs_diff(post.wall3.as_slice().unwrap(), want.as_slice().unwrap());
    let peak = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!("sim32 Wall3: max |ours − Kilosort4| = {err:e} (peak {peak})");
    assert!(err <= 1e-5 * peak.max(1.0));
}

#[test]
fn matching_equals_kilosort4_on_sim32() {
    let mut case = Case::open("sim32");
    let wpca: Array2<f32> = get(&mut case.ops, "wPCA");
    let wrot: Array2<f32> = get(&mut case.ops, "Wrot");
    let xc: Array1<f32> = get(&mut case.ops, "xc");
    let yc: Array1<f32> = get(&mut case.ops, "yc");
    let icc: Array2<i64> = get(&mut case.ops, "iCC");
    let mut ext = case.npz("extract_out.npz");
    let st: Array2<f64> = get(&mut ext, "st");
    let tf: Array3<f32> = get(&mut ext, "tF");
    let wall3: Array3<f32> = get(&mut case.npz("post_out.npz"), "Wall3");
    let (windows, batch_size) = sim32_windows(wrot);
    let setup = MatchingSetup::new(
        wall3.view(),
        wpca.view(),
        xc.as_slice().unwrap(),
        yc.as_slice().unwrap(),
        &MatchingSettings {
            batch_size,
            ..MatchingSettings::default()
        },
    )
    .unwrap()
    .with_icc(icc.mapv(|v| v as u32))
    .unwrap();
    let ours = extract(&setup, windows.len() as u64, |i| {
        Ok::<_, MatchError>(windows[i as usize].clone())
    })
    .unwrap();
    assert_eq!(ours.iu.len(), wall3.dim().0);
    report_and_compare("sim32", &ours.st, &ours.tf, &st, &tf);
}

#[test]
fn matching_equals_kilosort4_on_oe16() {
    let mut case = Case::open("oe16");
    let wpca: Array2<f32> = get(&mut case.ops, "wPCA");
    let wrot: Array2<f32> = get(&mut case.ops, "Wrot");
    let xc: Array1<f32> = get(&mut case.ops, "xc");
    let yc: Array1<f32> = get(&mut case.ops, "yc");
    let icc: Array2<i64> = get(&mut case.ops, "iCC");
    let mut ext = case.npz("extract_out.npz");
    let st: Array2<f64> = get(&mut ext, "st");
    let tf: Array3<f32> = get(&mut ext, "tF");
    let iu: Array1<i64> = get(&mut ext, "iU");
    let wall3: Array3<f32> = get(&mut case.npz("post_out.npz"), "Wall3");
    let (windows, batch_size) = oe16_windows(wrot);
    let setup = MatchingSetup::new(
        wall3.view(),
        wpca.view(),
        xc.as_slice().unwrap(),
        yc.as_slice().unwrap(),
        &MatchingSettings {
            batch_size,
            ..MatchingSettings::default()
        },
    )
    .unwrap();
    // Our own iCC sorts ties to the lower index; compare its distances, then use Kilosort4's.
    let setup = setup.with_icc(icc.mapv(|v| v as u32)).unwrap();
    assert_eq!(
        setup.iu().iter().map(|&v| i64::from(v)).collect::<Vec<_>>(),
        iu.to_vec(),
        "iU"
    );
    let parts: Vec<WindowSpikes> = windows
        .iter()
        .map(|x| match_window(&setup, x.view()).unwrap())
        .collect();
    let ours = assemble(&setup, &parts);
    report_and_compare("oe16", &ours.st, &ours.tf, &st, &tf);
}

/// Compares st and tF spike for spike; prints the numbers.
fn report_and_compare(
    name: &str,
    st: &Array2<f64>,
    tf: &Array3<f32>,
    want_st: &Array2<f64>,
    want_tf: &Array3<f32>,
) {
    eprintln!(
        "{name}: Kilosort4 {} spikes, ours {}",
        want_st.nrows(),
        st.nrows()
    );
    let key = |s: &Array2<f64>, i: usize| (s[[i, 0]] as i64, s[[i, 1]] as i64);
    let theirs: std::collections::BTreeMap<(i64, i64), usize> =
        (0..want_st.nrows()).map(|i| (key(want_st, i), i)).collect();
    let mut same = 0;
    let mut amp = 0f64;
    let mut tfe = 0f32;
    let mut only_ours = Vec::new();
    for i in 0..st.nrows() {
        match theirs.get(&key(st, i)) {
            Some(&j) => {
                same += 1;
                amp = amp.max((st[[i, 2]] - want_st[[j, 2]]).abs() / want_st[[j, 2]].abs());
                let a = tf.index_axis(Axis(0), i);
                let b = want_tf.index_axis(Axis(0), j);
                tfe = a
                    .iter()
                    .zip(b.iter())
                    .map(|(x, y)| (x - y).abs())
                    .fold(tfe, f32::max);
            }
            None => only_ours.push(key(st, i)),
        }
    }
    eprintln!(
        "{name}: {same} equal (sample, template); only ours {:?}; only Kilosort4 {}; amplitude max rel diff {amp:e}; tF max abs diff {tfe:e}",
        only_ours,
        want_st.nrows() - same
    );
    assert_eq!(st.nrows(), want_st.nrows());
    assert_eq!(same, want_st.nrows());
    assert!(amp < 1e-4);
    assert!(tfe < 1e-5 * want_tf.iter().fold(1f32, |m, v| m.max(v.abs())));
}
