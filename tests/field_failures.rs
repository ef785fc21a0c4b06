//! Field failures from real users (the field-failures list in the project's shared docs, `field-failures.md`), geometry and
//! detection parts, as tests. Each test is named after its row.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use common::{inject, noise, probe};
use spikecube::detect::cpu::CpuDetector;
use spikecube::error::{DetectError, ProbeError};
use spikecube::{DetectionSettings, Detections, Geometry, Probe, UniversalTemplates};

fn run(p: &Probe, s: &DetectionSettings, x: &ndarray::Array2<f32>) -> (Geometry, Detections) {
    let g = Geometry::new(p, s).unwrap();
    for w in g.weigh.iter() {
        assert!(w.is_finite(), "weights must be finite");
    }
    let mut det = CpuDetector::new(g.clone(), UniversalTemplates::builtin(), s.clone()).unwrap();
    let d = det.detect(x.view(), &p.yc).unwrap();
    (g, d)
}

/// Spike troughs every `gap` samples from `first`, inside the window's own samples.
fn spike_times(n: usize, first: usize, gap: usize) -> Vec<usize> {
    (0..n).map(|i| first + i * gap).collect()
}

/// Detection samples minus the 10-sample lag of the filter peak (spec §7.1).
fn trough_times(d: &Detections) -> BTreeSet<u64> {
    d.sample.iter().map(|&t| t - 10).collect()
}

#[test]
fn br01_small_arbitrary_units_give_a_float_grid() {
    let xy = [(2.0, 3.0), (2.0, 1.0), (1.0, 2.0), (3.0, 2.0)];
    let small = probe(&xy, &[0; 4]);
    let scaled = probe(&xy.map(|(x, y)| (x * 25.0, y * 25.0)), &[0; 4]);
    let s = DetectionSettings::default();
    let times = spike_times(30, 200, 300);
    let mut x = noise(4, 9_000 + 122, 101);
    for &t in &times {
        inject(&mut x, t, 0, 60.0, &[1.0, 0.0, 0.0, 0.0]);
    }
    let (g_small, d_small) = run(&small, &s, &x);
    let (g_scaled, d_scaled) = run(&scaled, &s, &x);
    assert_eq!(g_small.dmin, 1.0);
    assert_eq!(g_scaled.dmin, 25.0);
    // Rows every dmin/2: half-units kept, not truncated to 0.
    assert_eq!(g_small.yup, vec![1.0, 1.5, 2.0, 2.5, 3.0]);
    assert_eq!(g_scaled.yup, vec![25.0, 37.5, 50.0, 62.5, 75.0]);
    let expected: BTreeSet<u64> = times.iter().map(|&t| t as u64).collect();
    assert_eq!(trough_times(&d_small), expected, "as given");
    assert_eq!(trough_times(&d_scaled), expected, "×25");

    // Two columns with 7.5 µm rows keep their half-rows (3.75 µm).
    let rows: Vec<(f32, f32)> = (0..16)
        .map(|i| ((i % 2) as f32 * 20.0, 7.5 * (i / 2) as f32))
        .collect();
    let g = Geometry::new(&probe(&rows, &[0; 16]), &s).unwrap();
    assert_eq!(g.dmin, 7.5);
    assert_eq!(g.yup[1] - g.yup[0], 3.75);

    // A zero or negative given pitch is a settings error, not a crash.
    for dmin in [0.0, -5.0] {
        let bad = DetectionSettings {
            dmin: Some(dmin),
            ..s.clone()
        };
        assert!(matches!(
            Geometry::new(&small, &bad),
            Err(DetectError::Setting { name: "dmin", .. })
        ));
    }
}

#[test]
fn br02_single_column_keeps_its_column() {
    let s = DetectionSettings {
        dminx: 103.0,
        ..DetectionSettings::default()
    };
    for wobble in [0.0f32, 1.0] {
        let xy: Vec<(f32, f32)> = (0..48)
            .map(|i| (wobble * (i % 2) as f32, 20.0 * i as f32))
            .collect();
        let p = probe(&xy, &[0; 48]);
        let times = spike_times(50, 150, 180);
        let mut x = noise(48, 9_000 + 122, 202);
        for (n, &t) in times.iter().enumerate() {
            let centre = 1 + (n * 7) % 46;
            let mut gains = vec![0.0; 48];
            gains[centre - 1] = 0.5;
            gains[centre] = 1.0;
            gains[centre + 1] = 0.5;
            inject(&mut x, t, n % 6, 25.0, &gains);
        }
        let (g, d) = run(&p, &s, &x);
        assert!(
            g.xcup.iter().all(|&x| x == 0.0),
            "every template centre on the column"
        );
        let found = trough_times(&d);
        let hits = times
            .iter()
            .filter(|&&t| found.contains(&(t as u64)))
            .count();
        assert!(hits >= 48, "wobble {wobble}: {hits} of 50 spikes found");
    }
}

#[test]
fn br03_sparse_layouts_give_finite_weights_and_per_channel_detection() {
    let s = DetectionSettings::default();
    // 16 sites, one column, 150 µm apart; each spike on one site only.
    let xy: Vec<(f32, f32)> = (0..16).map(|i| (0.0, 150.0 * i as f32)).collect();
    let p = probe(&xy, &[0; 16]);
    let times = spike_times(40, 150, 200);
    let mut x = noise(16, 8_000 + 122, 303);
    let mut site_of = std::collections::BTreeMap::new();
    for (n, &t) in times.iter().enumerate() {
        let c = (n * 5) % 16;
        let mut gains = vec![0.0; 16];
        gains[c] = 1.0;
        inject(&mut x, t, 2, 25.0, &gains);
        site_of.insert(t as u64, c as u32);
    }
    let (g, d) = run(&p, &s, &x);
    let mut right = 0;
    for (i, &t) in d.sample.iter().enumerate() {
        if let Some(&c) = site_of.get(&(t - 10)) {
            right += usize::from(g.i_c[[0, d.centre[i] as usize]] == c);
        }
    }
    assert!(right >= 38, "{right} of 40 spikes found on their own site");

    // A larger max_channel_distance would make Kilosort4 divide 0 by 0 (every
    // weight underflows); the weights stay finite and normalised here.
    let far = DetectionSettings {
        max_channel_distance: 100.0,
        ..s.clone()
    };
    let grid: Vec<(f32, f32)> = (0..16)
        .map(|i| (200.0 * (i % 4) as f32, 200.0 * (i / 4) as f32))
        .collect();
    for settings in [&s, &far] {
        let g = Geometry::new(&probe(&grid, &[0; 16]), settings).unwrap();
        for j in 0..g.n_centres() {
            for sz in 0..g.n_sizes() {
                let norm: f32 = (0..g.n_chans()).map(|c| g.weigh[[sz, c, j]].powi(2)).sum();
                assert!(
                    (norm - 1.0).abs() < 1e-5,
                    "centre {j}, size {sz}: Σw² = {norm}"
                );
            }
        }
    }
}

fn four_shank(ids: [i64; 4]) -> Probe {
    let mut xy = Vec::new();
    let mut shank = Vec::new();
    for (s, &id) in ids.iter().enumerate() {
        for row in 0..6 {
            for col in [0.0, 32.0] {
                xy.push((250.0 * s as f32 + col, 15.0 * row as f32));
                shank.push(id);
            }
        }
    }
    probe(&xy, &shank)
}

#[test]
fn br04_multi_shank_grid_stays_on_the_shanks() {
    let s = DetectionSettings::default();
    let p = four_shank([0, 1, 2, 3]);
    let times = spike_times(30, 150, 250);
    let mut x = noise(48, 8_000 + 122, 404);
    for (n, &t) in times.iter().enumerate() {
        // Shank 2 holds sites 24..36.
        let c = 24 + (n * 5) % 12;
        let mut gains = vec![0.0; 48];
        for (i, g) in gains.iter_mut().enumerate().take(36).skip(24) {
            let d2 = (p.xc[i] - p.xc[c]).powi(2) + (p.yc[i] - p.yc[c]).powi(2);
            *g = (-d2 / (2.0 * 20.0 * 20.0)).exp();
        }
        inject(&mut x, t, n % 6, 20.0, &gains);
    }
    let (g, d) = run(&p, &s, &x);
    for &cx in &g.xcup {
        assert!(
            (0..4).any(|k| (250.0 * k as f64..=250.0 * k as f64 + 32.0).contains(&cx)),
            "centre x = {cx} between shanks"
        );
    }
    for j in 0..g.n_centres() {
        let shank = g.centre_shank[j];
        assert!(
            g.i_c
                .column(j)
                .iter()
                .all(|&c| p.kcoords[c as usize] == shank),
            "iC of centre {j} crosses shanks"
        );
        assert!(
            g.i_c2
                .column(j)
                .iter()
                .all(|&m| g.centre_shank[m as usize] == shank),
            "iC2 of centre {j} crosses shanks"
        );
    }
    assert!(d.len() >= 28, "{} detections for 30 spikes", d.len());
    for &j in &d.centre {
        assert_eq!(g.centre_shank[j as usize], 2, "detection off shank 2");
    }
    // Renumbering the shanks changes nothing.
    let (_, d2) = run(&four_shank([3, 2, 1, 0]), &s, &x);
    assert_eq!(d, d2);
}

#[test]
fn br06_tetrode_groups_are_hard_boundaries() {
    let s = DetectionSettings::default();
    let square = [(0.0, 0.0), (25.0, 0.0), (0.0, 25.0), (25.0, 25.0)];
    let xy: Vec<(f32, f32)> = square
        .iter()
        .chain(&square.map(|(x, y)| (x + 300.0, y)))
        .copied()
        .collect();
    let p = probe(&xy, &[0, 0, 0, 0, 1, 1, 1, 1]);
    let times = spike_times(20, 150, 300);
    let mut x = noise(8, 6_000 + 122, 606);
    for (n, &t) in times.iter().enumerate() {
        let mut gains = vec![0.0; 8];
        gains[n % 4] = 1.0;
        gains[(n + 1) % 4] = 0.4;
        inject(&mut x, t, n % 6, 20.0, &gains);
    }
    let (g, d) = run(&p, &s, &x);
    assert_eq!(g.n_chans(), 4, "nearest_chans lowered to the tetrode size");
    assert!(!d.is_empty());
    for &j in &d.centre {
        assert!(
            g.i_c.column(j as usize).iter().all(|&c| c < 4),
            "detection uses channels of tetrode 1"
        );
    }
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn br07_malformed_probe_files_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            r#"{"chanMap": [0,1,2,3], "xc": [[0],[0],[20],[20]], "yc": [0,20,0,20], "kcoords": [0,0,0,0], "n_chan": 4}"#,
            "xc",
        ),
        (
            r#"{"chanMap": [0,1,2,3], "xc": [0,0,20,20], "yc": [0,20,0,20], "kcoords": [0,0,0], "n_chan": 4}"#,
            "kcoords",
        ),
        (
            r#"{"chanMap": [0,1,1,3], "xc": [0,0,20,20], "yc": [0,20,0,20], "kcoords": [0,0,0,0], "n_chan": 4}"#,
            "chanMap",
        ),
        (
            r#"{"chanMap": [0,1,2,7], "xc": [0,0,20,20], "yc": [0,20,0,20], "kcoords": [0,0,0,0], "n_chan": 4}"#,
            "chanMap",
        ),
    ];
    for (i, (text, field)) in cases.iter().enumerate() {
        let path = write(dir.path(), &format!("probe{i}.json"), text);
        match Probe::load(&path) {
            Err(ProbeError::Field {
                field: f,
                path: p,
                message,
            }) => {
                assert_eq!(&f, field, "case {i}: {message}");
                assert_eq!(p, path);
            }
            other => panic!("case {i}: expected an error naming {field}, got {other:?}"),
        }
    }
}

#[test]
fn br20_any_window_length_and_nt_checked_at_configuration() {
    let s = DetectionSettings::default();
    let xy: Vec<(f32, f32)> = (0..16)
        .map(|i| ((i % 2) as f32 * 32.0, 15.0 * (i / 2) as f32))
        .collect();
    let p = probe(&xy, &[0; 16]);
    let mut x = noise(16, 6_039 + 122, 2020);
    for (n, t) in spike_times(20, 150, 280).into_iter().enumerate() {
        let mut gains = vec![0.0; 16];
        gains[n % 16] = 1.0;
        inject(&mut x, t, n % 6, 20.0, &gains);
    }
    let short = x.slice(ndarray::s![.., ..6_001 + 122]).to_owned();
    let (_, d_long) = run(&p, &s, &x);
    let (_, d_short) = run(&p, &s, &short);
    // Away from the shorter window's right edge, both see the same detections.
    let limit = (6_001 + 122 - 61 - 2 * 20) as u64;
    let keep = |d: &Detections| -> Vec<(u32, u64)> {
        d.centre
            .iter()
            .zip(&d.sample)
            .filter(|(_, t)| **t < limit)
            .map(|(&j, &t)| (j, t))
            .collect()
    };
    assert!(!keep(&d_short).is_empty());
    assert_eq!(keep(&d_long), keep(&d_short));
    // An even (or any non-61) template length is refused up front.
    let bad = DetectionSettings { nt: 60, ..s };
    assert!(matches!(
        Geometry::new(&p, &bad),
        Err(DetectError::Setting { name: "nt", .. })
    ));
}
