//! Universal templates learned from the data (`templates_from_data`, issue 11):
//! the clips against Kilosort4's own `extract_snippets`, wPCA and wTEMP against
//! Kilosort4's `TruncatedSVD` and `KMeans` runs on Kilosort4's clips
//! (`tests/data/learned/`, made by `make_learned_reference.py` there), and
//! independence of the thread count.

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
    let d: f64 = a.iter().zip(b).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum();
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
        assert!(c >= 0.9999, "component {k}: |cos| = {c:.6} with the exact SVD");
    }
    // Against Kilosort4's randomized TruncatedSVD runs: |cos| ≥ 0.99 for every
    // component whose singular value is separated from its neighbours by more
    // than 5 %. The others lie in a near-degenerate (noise) part of the
    // spectrum, where Kilosort4's own runs disagree with each other (|cos| down
    // to 0.14 on this reference); there, ours captures at least as much of the
    // clips' energy as any Kilosort4 run (it is the exact optimum).
    let sv: ndarray::Array1<f64> =
        npy::read(&data("learned/kmeans/singular_values.npy")).unwrap();
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
        assert!(ours_e >= e * (1.0 - 1e-6), "energy {ours_e} < Kilosort4's {e}");
    }
    assert_eq!(n_separated, 5 * 3, "components 0-2 are the separated ones here");
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

#[test]
fn learning_gives_identical_results_with_1_and_2_threads() {
    let r = ks4_runs();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let (w, km) = learn_wtemp(r.clips.view(), &LearnSettings::default()).unwrap();
            let p = learn_wpca(r.clips.view(), 6).unwrap();
            let x: Array2<f32> = npy::read(&data("fixtures/detection/np1/X.npy")).unwrap();
            let (peaks, clips) = extract_clips(x.view(), 6.0, 61, 20);
            (w, km.inertia.to_bits(), p, peaks, clips)
        })
    };
    let (a, b) = (run(1), run(2));
    assert_eq!(a.0, b.0);
    assert_eq!(a.1, b.1);
    assert_eq!(a.2, b.2);
    assert_eq!(a.3, b.3);
    assert_eq!(a.4, b.4);
}

#[test]
fn kmeans_depends_only_on_the_seed() {
    let r = ks4_runs();
    let a = kmeans(r.clips.view(), 6, 5, 2, 300, 1e-4).unwrap();
    let b = kmeans(r.clips.view(), 6, 5, 2, 300, 1e-4).unwrap();
    assert_eq!(a.centres, b.centres);
    assert_eq!(a.inertia.to_bits(), b.inertia.to_bits());
}
