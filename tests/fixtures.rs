//! The CPU detector against Kilosort4 4.1.7's own outputs (`tests/data/fixtures/detection`).
//!
//! Tolerance for float outputs: |ours − Kilosort| ≤ 1e-5 · max(|Kilosort|, 1). The
//! values are in whitened units (noise sd = 1; detections have |A| > 9), so this is
//! 1e-5 relative for every value of noise size or more, and 1e-5 absolute for the
//! small values where a relative error is dominated by float32 cancellation
//! (a PC feature near 0 is a difference of terms of size ~10).

mod common;

use std::collections::BTreeSet;

use common::{CASES, Case};
use ndarray::{Array2, Array3, ArrayView2};
use spikecube::detect::cpu::CpuDetector;
use spikecube::{Detections, Geometry, UniversalTemplates, npy};

const TOL: f64 = 1e-5;

/// Largest |a − b| / max(|a|, 1) over two equal-length slices.
fn max_rel(reference: impl IntoIterator<Item = f32>, ours: impl IntoIterator<Item = f32>) -> f64 {
    reference
        .into_iter()
        .zip(ours)
        .map(|(a, b)| (a as f64 - b as f64).abs() / (a as f64).abs().max(1.0))
        .fold(0.0, f64::max)
}

fn detect(case: &Case, g: Geometry) -> Detections {
    let mut det =
        CpuDetector::new(g, UniversalTemplates::builtin(), case.settings.clone()).unwrap();
    det.detect(case.x.view(), &case.probe.yc).unwrap()
}

/// A CPU detector with Kilosort4's neighbourhoods of `case`, its built-in
/// templates and `settings`.
fn kilosort_detector(case: &Case, settings: spikecube::DetectionSettings) -> CpuDetector {
    CpuDetector::new(
        case.kilosort_geometry(),
        UniversalTemplates::builtin(),
        settings,
    )
    .unwrap()
}

fn pairs(d: &Detections) -> Vec<(i64, i64)> {
    d.centre
        .iter()
        .zip(&d.sample)
        .map(|(&j, &t)| (j as i64, t as i64))
        .collect()
}

#[test]
fn identical_to_kilosort_with_its_neighbourhoods() {
    for name in CASES {
        let case = Case::load(name);
        let d = detect(&case, case.kilosort_geometry());
        let xy = case.i64_2("xy.npy");
        let expected: Vec<(i64, i64)> = xy.rows().into_iter().map(|r| (r[0], r[1])).collect();
        assert_eq!(pairs(&d), expected, "{name}: xy differs");
        let imax: ndarray::Array1<i64> = npy::read(&case.dir.join("imax.npy")).unwrap();
        assert_eq!(
            d.imax.iter().map(|&v| v as i64).collect::<Vec<_>>(),
            imax.to_vec(),
            "{name}: imax"
        );
        let sign: ndarray::Array1<i8> = npy::read(&case.dir.join("sign.npy")).unwrap();
        assert_eq!(d.sign, sign.to_vec(), "{name}: sign");

        let amp = max_rel(case.f32_1("amp.npy"), d.amp.iter().copied());
        let yct = max_rel(case.f32_1("yct.npy"), d.yct.iter().copied());
        let adist_ref: Array2<f32> = npy::read(&case.dir.join("adist.npy")).unwrap();
        let adist = max_rel(
            adist_ref.iter().copied(),
            d.adist_kilosort().iter().copied(),
        );
        let tf_ref: Array3<f32> = npy::read(&case.dir.join("tF.npy")).unwrap();
        assert_eq!(tf_ref.shape(), d.tf_array().shape(), "{name}: tF shape");
        let tf = max_rel(tf_ref.iter().copied(), d.tf.iter().copied());
        eprintln!(
            "{name}: {} detections identical; largest difference amp {amp:.2e}, adist {adist:.2e}, yct {yct:.2e}, tF {tf:.2e}",
            d.len()
        );
        for (what, v) in [("amp", amp), ("adist", adist), ("yct", yct), ("tF", tf)] {
            assert!(v <= TOL, "{name}: {what} differs by {v:.3e} > {TOL:e}");
        }
    }
}

#[test]
fn tetrode_intermediates_match_kilosort_buffers() {
    let case = Case::load("tetrode_like");
    let mut det = kilosort_detector(&case, case.settings.clone());
    let im = det.intermediates(case.x.view(), &case.probe.yc).unwrap();
    let as_ref: Array2<f32> = npy::read(&case.dir.join("As.npy")).unwrap();
    let imax_ref: Array2<i64> = npy::read(&case.dir.join("imax_signed.npy")).unwrap();
    let amax_ref: Array2<f32> = npy::read(&case.dir.join("Amax_prepool.npy")).unwrap();
    let d_as = max_rel(as_ref.iter().copied(), im.as_.iter().copied());
    let d_amax = max_rel(amax_ref.iter().copied(), im.amax_prepool.iter().copied());
    assert!(d_as <= TOL && d_amax <= TOL, "As {d_as:e}, Amax {d_amax:e}");
    // imax may only differ where two of the 30 outputs are within rounding of each other.
    let differ = imax_ref
        .iter()
        .zip(im.imax_signed.iter())
        .filter(|(a, b)| **a != **b as i64)
        .count();
    eprintln!(
        "tetrode_like intermediates: As {d_as:.2e}, Amax {d_amax:.2e}, imax_signed differs at {differ} of {} points",
        imax_ref.len()
    );
    assert!(
        differ * 1000 < imax_ref.len(),
        "imax_signed differs at {differ} points"
    );

    // Step 1 alone against Kilosort's conv1d output B (channels × 6 × samples).
    let b_ref: Array3<f32> = npy::read(&case.dir.join("B.npy")).unwrap();
    let t = UniversalTemplates::builtin();
    let w = t.wtemp.as_slice().unwrap();
    let nt_w = case.x.ncols();
    let mut worst = 0f64;
    let mut tile = vec![0f32; 6 * spikecube::detect::cpu::TILE];
    for c in 0..case.x.nrows() {
        let row = case.x.row(c).to_vec();
        for t0 in (0..nt_w).step_by(spikecube::detect::cpu::TILE) {
            let width = spikecube::detect::cpu::TILE.min(nt_w - t0);
            spikecube::detect::cpu::filter_bank(&row, w, t0, &mut tile);
            for k in 0..6 {
                for i in 0..width {
                    let a = b_ref[[c, k, t0 + i]] as f64;
                    let b = tile[k * spikecube::detect::cpu::TILE + i] as f64;
                    worst = worst.max((a - b).abs() / a.abs().max(1.0));
                }
            }
        }
    }
    eprintln!("tetrode_like B: largest difference {worst:.2e}");
    assert!(worst <= TOL);
}

/// Squared distance from (x, y) to each listed point.
fn sorted_d2(x: f64, y: f64, pts: impl Iterator<Item = (f64, f64)>) -> Vec<f64> {
    let mut v: Vec<f64> = pts
        .map(|(a, b)| (y - b) * (y - b) + (x - a) * (x - a))
        .collect();
    v.sort_by(f64::total_cmp);
    v
}

fn column_set(a: ArrayView2<u32>, j: usize) -> BTreeSet<u32> {
    a.column(j).iter().copied().collect()
}

#[test]
fn own_geometry_matches_kilosort_up_to_distance_ties() {
    for name in CASES {
        let mut case = Case::load(name);
        // Kilosort4's rule: iC2 may cross shanks (see the next test for the default).
        case.settings.separate_shanks = false;
        let ours = Geometry::new(&case.probe, &case.settings).unwrap();
        let ks = case.kilosort_geometry();
        assert_eq!(ours.xcup, case.f64_1("xcup.npy").to_vec(), "{name}: xcup");
        assert_eq!(ours.ycup, case.f64_1("ycup.npy").to_vec(), "{name}: ycup");
        assert_eq!(ours.i_c.dim(), ks.i_c.dim(), "{name}: iC shape");
        assert_eq!(ours.i_c2.dim(), ks.i_c2.dim(), "{name}: iC2 shape");
        let xc: Vec<f64> = case.probe.xc.iter().map(|&v| v as f64).collect();
        let yc: Vec<f64> = case.probe.yc.iter().map(|&v| v as f64).collect();
        let nf = ours.n_centres();
        let mut tie_centres = BTreeSet::new();
        for j in 0..nf {
            let (x, y) = (ours.xcup[j], ours.ycup[j]);
            let d_ours = sorted_d2(
                x,
                y,
                ours.i_c
                    .column(j)
                    .iter()
                    .map(|&c| (xc[c as usize], yc[c as usize])),
            );
            let d_ks = sorted_d2(
                x,
                y,
                ks.i_c
                    .column(j)
                    .iter()
                    .map(|&c| (xc[c as usize], yc[c as usize])),
            );
            assert_eq!(d_ours, d_ks, "{name}: iC distances of centre {j}");
            let c2 = |g: &Geometry| {
                sorted_d2(
                    x,
                    y,
                    g.i_c2
                        .column(j)
                        .iter()
                        .map(|&m| (ours.xcup[m as usize], ours.ycup[m as usize])),
                )
            };
            assert_eq!(c2(&ours), c2(&ks), "{name}: iC2 distances of centre {j}");
            if column_set(ours.i_c.view(), j) != column_set(ks.i_c.view(), j)
                || column_set(ours.i_c2.view(), j) != column_set(ks.i_c2.view(), j)
            {
                tie_centres.insert(j as u32);
            }
        }
        let a = detect(&case, ours.clone());
        let b = detect(&case, ks.clone());
        let (pa, pb): (BTreeSet<_>, BTreeSet<_>) = (
            pairs(&a).into_iter().collect(),
            pairs(&b).into_iter().collect(),
        );
        let only_ours: Vec<_> = pa.difference(&pb).collect();
        let only_ks: Vec<_> = pb.difference(&pa).collect();
        eprintln!(
            "{name}: own geometry: {} of {nf} centres have a tie-broken iC or iC2 set; detections {} vs {} (Kilosort), {} only ours, {} only Kilosort's",
            tie_centres.len(),
            a.len(),
            b.len(),
            only_ours.len(),
            only_ks.len()
        );
        // A differing detection must sit where a tie-broken neighbourhood can reach it:
        // its centre, or a centre in its neighbourhood, had its iC or iC2 set changed by a tie.
        for &&(j, t) in only_ours.iter().chain(&only_ks) {
            let j = j as usize;
            let near = |g: &Geometry| g.i_c2.column(j).iter().any(|m| tie_centres.contains(m));
            assert!(
                tie_centres.contains(&(j as u32)) || near(&ours) || near(&ks),
                "{name}: detection (centre {j}, sample {t}) differs but no tie touches it"
            );
        }
    }
}

#[test]
fn separate_shanks_only_changes_cross_shank_neighbourhoods() {
    for name in CASES {
        let case = Case::load(name);
        assert!(
            case.settings.separate_shanks,
            "the default keeps shanks apart"
        );
        let ours = Geometry::new(&case.probe, &case.settings).unwrap();
        let ks_rule = Geometry::new(
            &case.probe,
            &spikecube::DetectionSettings {
                separate_shanks: false,
                ..case.settings.clone()
            },
        )
        .unwrap();
        assert_eq!(
            ours.i_c, ks_rule.i_c,
            "{name}: iC never crosses shanks here"
        );
        let changed: BTreeSet<u32> = (0..ours.n_centres())
            .filter(|&j| ours.i_c2.column(j) != ks_rule.i_c2.column(j))
            .map(|j| j as u32)
            .collect();
        // Every changed centre is one whose Kilosort neighbourhood reached another shank.
        for &j in &changed {
            let j = j as usize;
            assert!(
                ks_rule
                    .i_c2
                    .column(j)
                    .iter()
                    .any(|&m| ks_rule.centre_shank[m as usize] != ks_rule.centre_shank[j]),
                "{name}: centre {j} changed without crossing a shank"
            );
        }
        let a: BTreeSet<_> = pairs(&detect(&case, ours)).into_iter().collect();
        let b: BTreeSet<_> = pairs(&detect(&case, ks_rule)).into_iter().collect();
        let differ: Vec<_> = a.symmetric_difference(&b).collect();
        eprintln!(
            "{name}: separate_shanks changes iC2 of {} centres and {} detections ({:?})",
            changed.len(),
            differ.len(),
            differ
        );
        // Fewer competitors can only add detections, and only where a neighbourhood changed.
        assert!(
            b.is_subset(&a),
            "{name}: separating shanks removed a detection"
        );
        for &&(j, _) in &differ {
            assert!(
                changed.contains(&(j as u32)),
                "{name}: detection at centre {j} changed"
            );
        }
    }
}

#[test]
fn pruned_detector_equals_dense_oracle() {
    for name in CASES {
        let case = Case::load(name);
        let mut det = kilosort_detector(&case, case.settings.clone());
        let fast = det.detect(case.x.view(), &case.probe.yc).unwrap();
        let dense = det.detect_dense(case.x.view(), &case.probe.yc).unwrap();
        assert_eq!(fast, dense, "{name}");
        // Lower thresholds prune less; the detections must still agree.
        for th in [2.0f32, 5.0] {
            let settings = spikecube::DetectionSettings {
                th_universal: th,
                ..case.settings.clone()
            };
            let mut det = kilosort_detector(&case, settings);
            let fast = det.detect(case.x.view(), &case.probe.yc).unwrap();
            let dense = det.detect_dense(case.x.view(), &case.probe.yc).unwrap();
            assert_eq!(fast, dense, "{name}, Th_universal {th}");
        }
    }
}

/// A window holding a NaN or ±∞ anywhere (either edge, a tile boundary, the
/// first and last channel) is an error naming its channel and sample, on the
/// pruned and the dense path: the CPU detector learns of it from step 1's
/// outputs instead of scanning the window first. Finite values so large
/// that step 1 overflows are not an error, and the detector is usable after
/// each error.
#[test]
fn non_finite_values_are_named_wherever_they_are() {
    let case = Case::load("tetrode_like");
    let mut det = kilosort_detector(&case, case.settings.clone());
    let (c, n) = case.x.dim();
    let tile = spikecube::detect::cpu::TILE;
    let clean = det.detect(case.x.view(), &case.probe.yc).unwrap();
    for (ch, t) in [
        (0, 0),
        (c - 1, n - 1),
        (c / 2, tile - 1),
        (1, tile),
        (c - 1, 0),
        (0, n - 1),
    ] {
        for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = case.x.clone();
            x[[ch, t]] = v;
            for dense in [false, true] {
                let e = if dense {
                    det.detect_dense(x.view(), &case.probe.yc)
                } else {
                    det.detect(x.view(), &case.probe.yc)
                }
                .unwrap_err()
                .to_string();
                assert!(
                    e.contains(&format!(
                        "non-finite value ({v}) at channel {ch}, sample {t}"
                    )),
                    "{e}"
                );
            }
        }
        assert_eq!(det.detect(case.x.view(), &case.probe.yc).unwrap(), clean);
    }
    // A constant 3e38 on one channel overflows step 1's sums there.
    let mut huge = case.x.clone();
    huge.row_mut(0).fill(3e38);
    det.detect(huge.view(), &case.probe.yc).unwrap();
    det.detect_dense(huge.view(), &case.probe.yc).unwrap();
}
