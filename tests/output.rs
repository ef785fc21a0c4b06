//! The spike output folder: contents, layouts, atomicity, determinism.

use std::path::{Path, PathBuf};

use ndarray::{Array1, Array2, Array3};
use spikecube::output::{DriftMap, OutputWriter, PEAK_DESCR, RunInfo, bytes_per_spike};
use spikecube::{DetectionSettings, Detections, Geometry, Probe};

/// 16 sites on 4 shanks (ids 1–4, 4 sites each, 200 µm apart), with a shuffled channel map.
fn probe() -> Probe {
    let n = 16;
    Probe {
        xc: (0..n)
            .map(|i| 200.0 * (i / 4) as f32 + 16.0 * (i % 2) as f32)
            .collect(),
        yc: (0..n).map(|i| 20.0 * (i % 4) as f32).collect(),
        kcoords: (0..n).map(|i| 1 + (i / 4) as i64).collect(),
        chan_map: vec![3, 0, 7, 1, 12, 2, 5, 4, 15, 6, 8, 9, 11, 10, 14, 13],
        n_chan: 17,
        source: PathBuf::from("test probe"),
    }
}

fn geometry(p: &Probe) -> Geometry {
    Geometry::new(p, &DetectionSettings::default()).expect("geometry")
}

/// A window of fake detections at (centre, window sample) pairs.
fn window(g: &Geometry, spikes: &[(u32, u64)], seed: f32) -> Detections {
    let nc = g.n_chans();
    let npc = 6;
    let n = spikes.len();
    Detections {
        centre: spikes.iter().map(|s| s.0).collect(),
        sample: spikes.iter().map(|s| s.1).collect(),
        amp: (0..n).map(|i| 10.0 + seed + i as f32).collect(),
        imax: (0..n).map(|i| (i * 7 % 30) as u8).collect(),
        sign: (0..n).map(|i| if i % 3 == 2 { -1 } else { 1 }).collect(),
        adist: vec![1.0; n * nc],
        yct: (0..n).map(|i| 5.0 * i as f32 + seed).collect(),
        tf: (0..n * nc * npc).map(|k| k as f32 * 0.5 + seed).collect(),
        n_chans: nc,
        n_pcs: npc,
    }
}

fn run_info(p: &Probe) -> RunInfo {
    RunInfo {
        settings: serde_json::json!({"Th_universal": 9.0}),
        dat_path: PathBuf::from("/data/it's here\\rec.bin"),
        n_channels_dat: p.n_chan,
        dtype: "int16".into(),
        fs: 30_000.0,
        n_samples: 200_000,
        ..RunInfo::default()
    }
}

/// Writes two windows; returns the detections given (in window order).
fn write_two(out: &Path) -> (Probe, Geometry, Vec<(Detections, i64)>) {
    let p = probe();
    let g = geometry(&p);
    let nf = g.n_centres() as u32;
    let w1 = (window(&g, &[(0, 100), (nf - 1, 90), (2, 100)], 0.0), -61);
    let w2 = (window(&g, &[(1, 70), (3, 65)], 100.0), 60_000 - 61);
    let mut w = OutputWriter::create(out, &p, &g, 6).expect("create");
    for (d, first) in [&w1, &w2] {
        w.append(d, *first).expect("append");
    }
    let summary = w.finish(&run_info(&p)).expect("finish");
    assert_eq!(summary.n_spikes, 5);
    assert!(summary.time_sorted);
    (p, g, vec![w1, w2])
}

fn read<A: ndarray_npy::ReadableElement + Clone, D: ndarray::Dimension>(
    dir: &Path,
    name: &str,
) -> ndarray::Array<A, D> {
    spikecube::npy::read(&dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

#[test]
fn files_have_the_documented_shapes_and_values() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("spikes");
    let (p, g, wins) = write_two(&out);
    let (nf, nc) = (g.n_centres(), g.n_chans());

    // Expected rows: each window sorted by (time, centre).
    let mut rows = Vec::new();
    for (d, first) in &wins {
        let mut idx: Vec<usize> = (0..d.len()).collect();
        idx.sort_by_key(|&i| (first + d.sample[i] as i64, d.centre[i]));
        rows.extend(idx.into_iter().map(|i| (d, *first, i)));
    }
    let times: Array1<i64> = read(&out, "spike_times.npy");
    let want: Vec<i64> = rows
        .iter()
        .map(|(d, f, i)| f + d.sample[*i] as i64)
        .collect();
    assert_eq!(times.to_vec(), want);
    assert_eq!(want, vec![29, 39, 39, 60_004, 60_009]);

    let centres: Array1<i64> = read(&out, "spike_centers.npy");
    let want: Vec<i64> = rows.iter().map(|(d, _, i)| d.centre[*i] as i64).collect();
    assert_eq!(centres.to_vec(), want);
    let amps: Array1<f32> = read(&out, "amplitudes.npy");
    assert_eq!(
        amps.to_vec(),
        rows.iter().map(|(d, _, i)| d.amp[*i]).collect::<Vec<_>>()
    );
    let tpl: Array1<i64> = read(&out, "spike_detection_templates.npy");
    assert_eq!(
        tpl.to_vec(),
        rows.iter()
            .map(|(d, _, i)| d.imax[*i] as i64)
            .collect::<Vec<_>>()
    );
    let signs: Array1<i8> = read(&out, "spike_signs.npy");
    assert_eq!(
        signs.to_vec(),
        rows.iter().map(|(d, _, i)| d.sign[*i]).collect::<Vec<_>>()
    );
    let pos: Array2<f32> = read(&out, "spike_positions.npy");
    assert_eq!(pos.dim(), (5, 2));
    for (k, (d, _, i)) in rows.iter().enumerate() {
        assert_eq!(pos[[k, 0]], g.xcup[d.centre[*i] as usize] as f32);
        assert_eq!(pos[[k, 1]], d.yct[*i]);
    }
    let pcs: Array3<f32> = read(&out, "pc_features.npy");
    assert_eq!(pcs.dim(), (5, nc, 6));
    for (k, (d, _, i)) in rows.iter().enumerate() {
        let got: Vec<f32> = pcs
            .index_axis(ndarray::Axis(0), k)
            .iter()
            .copied()
            .collect();
        assert_eq!(got, d.tf[i * nc * 6..(i + 1) * nc * 6].to_vec());
    }
    let ind: Array2<i64> = read(&out, "pc_feature_ind.npy");
    assert_eq!(ind.dim(), (5, nc));
    for (k, (d, _, i)) in rows.iter().enumerate() {
        for c in 0..nc {
            assert_eq!(ind[[k, c]], g.i_c[[c, d.centre[*i] as usize]] as i64);
        }
    }

    let tc: Array2<f64> = read(&out, "template_centers.npy");
    assert_eq!(tc.dim(), (nf, 2));
    assert_eq!(tc.column(0).to_vec(), g.xcup);
    assert_eq!(tc.column(1).to_vec(), g.ycup);
    let cc: Array2<i64> = read(&out, "center_channels.npy");
    assert_eq!(cc, g.i_c.t().mapv(|v| v as i64));
    let wm: Array2<f32> = read(&out, "whitening_mat.npy");
    assert_eq!(wm, Array2::<f32>::eye(p.n_sites()));

    // Structured peaks: header text and size.
    let bytes = std::fs::read(out.join("peaks.npy")).unwrap();
    assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    assert_eq!((10 + hlen) % 64, 0);
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
    assert!(
        header.contains(&format!("'descr': {PEAK_DESCR}")),
        "{header}"
    );
    assert!(header.contains("'shape': (5,)"), "{header}");
    assert!(header.ends_with('\n'));
    assert_eq!(bytes.len(), 10 + hlen + 5 * 32);
    // SpikeInterface's conventions: the trough, the site of the
    // largest winning-template output, −sign·|A|.
    for (k, (d, _, i)) in rows.iter().enumerate() {
        let rec = &bytes[10 + hlen + 32 * k..10 + hlen + 32 * (k + 1)];
        let field = |k: usize| i64::from_le_bytes(rec[8 * k..8 * k + 8].try_into().unwrap());
        assert_eq!(
            field(0),
            (times[k] - spikecube::output::TROUGH_OFFSET).max(0)
        );
        let j = d.centre[*i] as usize;
        let nc = d.n_chans;
        let best = (0..nc)
            .max_by(|&a, &b| {
                d.adist[i * nc + a]
                    .abs()
                    .total_cmp(&d.adist[i * nc + b].abs())
                    .then(b.cmp(&a))
            })
            .unwrap();
        assert_eq!(field(1), g.i_c[[best, j]] as i64);
        let amp = f64::from_le_bytes(rec[16..24].try_into().unwrap());
        assert_eq!(amp, -f64::from(d.sign[*i]) * f64::from(d.amp[*i]));
        assert!(amp < 0.0 || d.sign[*i] < 0);
        assert_eq!(field(3), 0);
    }

    // Every streamed header is padded to 64 bytes.
    for name in ["spike_times.npy", "pc_features.npy", "spike_signs.npy"] {
        let b = std::fs::read(out.join(name)).unwrap();
        let h = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + h) % 64, 0, "{name}");
    }

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
            .unwrap();
    assert_eq!(json["counts"]["n_spikes"], 5);
    assert_eq!(json["sizes"]["n_centres"], nf);
    let png = image::open(out.join("drift_map.png")).unwrap();
    assert!(png.width() >= 1200 && png.height() >= 800);
}

#[test]
fn br21_shanks_and_positions_follow_probe_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("spikes");
    let (p, _, _) = write_two(&out);
    let shanks: Array1<i64> = read(&out, "channel_shanks.npy");
    assert_eq!(shanks.to_vec(), p.kcoords);
    let map: Array1<i64> = read(&out, "channel_map.npy");
    assert_eq!(
        map.to_vec(),
        p.chan_map.iter().map(|&c| c as i64).collect::<Vec<_>>()
    );
    let pos: Array2<f64> = read(&out, "channel_positions.npy");
    for i in 0..p.n_sites() {
        assert_eq!(pos[[i, 0]], p.xc[i] as f64);
        assert_eq!(pos[[i, 1]], p.yc[i] as f64);
    }
}

#[test]
fn params_py_is_key_value_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("spikes");
    write_two(&out);
    let text = std::fs::read_to_string(out.join("params.py")).unwrap();
    let mut keys = Vec::new();
    for line in text.lines() {
        let (k, v) = line
            .split_once(" = ")
            .unwrap_or_else(|| panic!("not key = value: {line}"));
        assert!(k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        assert!(!v.is_empty());
        keys.push(k.to_string());
    }
    assert_eq!(
        keys,
        [
            "dat_path",
            "n_channels_dat",
            "dtype",
            "offset",
            "sample_rate",
            "hp_filtered"
        ]
    );
    assert!(
        text.contains("dat_path = '/data/it\\'s here\\\\rec.bin'\n"),
        "{text}"
    );
    assert!(text.contains("n_channels_dat = 17\n"));
    assert!(text.contains("sample_rate = 30000.0\n"));
    assert!(text.contains("hp_filtered = False\n"));
}

#[test]
fn an_interrupted_writer_leaves_no_final_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("spikes");
    let p = probe();
    let g = geometry(&p);
    {
        let mut w = OutputWriter::create(&out, &p, &g, 6).unwrap();
        w.append(&window(&g, &[(0, 100)], 0.0), 0).unwrap();
        assert!(w.partial_path().exists());
        assert!(!out.exists());
        // Dropped without finish.
    }
    assert!(!out.exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn an_earlier_result_is_replaced_only_at_finish() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("spikes");
    write_two(&out);
    let p = probe();
    let g = geometry(&p);
    let mut w = OutputWriter::create(&out, &p, &g, 6).unwrap();
    w.append(&window(&g, &[(0, 100)], 0.0), 0).unwrap();
    // The earlier result is intact while the new one is written.
    let times: Array1<i64> = read(&out, "spike_times.npy");
    assert_eq!(times.len(), 5);
    w.finish(&run_info(&p)).unwrap();
    let times: Array1<i64> = read(&out, "spike_times.npy");
    assert_eq!(times.to_vec(), vec![100]);
    let names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["spikes".to_string()]);
}

#[test]
fn identical_runs_give_identical_spike_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    write_two(&a);
    write_two(&b);
    for name in [
        "spike_times.npy",
        "spike_centers.npy",
        "amplitudes.npy",
        "spike_detection_templates.npy",
        "spike_signs.npy",
        "spike_positions.npy",
        "pc_features.npy",
        "pc_feature_ind.npy",
        "peaks.npy",
        "template_centers.npy",
        "center_channels.npy",
        "channel_map.npy",
        "channel_positions.npy",
        "channel_shanks.npy",
        "whitening_mat.npy",
        "params.py",
        "drift_map.png",
    ] {
        assert_eq!(
            std::fs::read(a.join(name)).unwrap(),
            std::fs::read(b.join(name)).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn bad_detections_are_refused_with_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let p = probe();
    let g = geometry(&p);
    let mut w = OutputWriter::create(&tmp.path().join("o"), &p, &g, 6).unwrap();
    let mut d = window(&g, &[(0, 100)], 0.0);
    d.centre[0] = 10_000;
    let e = format!("{:#}", w.append(&d, 0).unwrap_err());
    assert!(e.contains("10000"), "{e}");
    let d = window(&g, &[(0, 10)], 0.0);
    let e = format!("{:#}", w.append(&d, -61).unwrap_err());
    assert!(e.contains("before the recording"), "{e}");
}

#[test]
fn empty_runs_write_valid_empty_files() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    let p = probe();
    let g = geometry(&p);
    let w = OutputWriter::create(&out, &p, &g, 6).unwrap();
    let s = w.finish(&run_info(&p)).unwrap();
    assert_eq!(s.n_spikes, 0);
    let pcs: Array3<f32> = read(&out, "pc_features.npy");
    assert_eq!(pcs.dim(), (0, g.n_chans(), 6));
    let t: Array1<i64> = read(&out, "spike_times.npy");
    assert!(t.is_empty());
}

#[test]
fn br23_drift_map_memory_is_bounded() {
    let mut m = DriftMap::new(1000);
    for i in 0..100_000 {
        m.push(i, (i % 3000) as f32, 10.0 + (i % 50) as f32);
    }
    assert_eq!(m.seen(), 100_000);
    assert_eq!(m.kept(), 1000);
}

#[test]
fn windows_out_of_time_order_are_recorded_as_unsorted() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    let p = probe();
    let g = geometry(&p);
    let mut w = OutputWriter::create(&out, &p, &g, 6).unwrap();
    w.append(&window(&g, &[(0, 100)], 0.0), 60_000).unwrap();
    w.append(&window(&g, &[(0, 100)], 0.0), 0).unwrap();
    let s = w.finish(&run_info(&p)).unwrap();
    assert!(!s.time_sorted);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
            .unwrap();
    assert_eq!(json["counts"]["time_sorted"], false);
}

#[test]
fn bytes_per_spike_matches_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let p = probe();
    let g = geometry(&p);
    let w = OutputWriter::create(&a, &p, &g, 6).unwrap();
    w.finish(&run_info(&p)).unwrap();
    write_two(&b);
    let per_spike = [
        "spike_times.npy",
        "spike_centers.npy",
        "amplitudes.npy",
        "spike_detection_templates.npy",
        "spike_signs.npy",
        "spike_positions.npy",
        "pc_features.npy",
        "pc_feature_ind.npy",
        "peaks.npy",
    ];
    let size = |d: &Path| -> u64 {
        per_spike
            .iter()
            .map(|n| std::fs::metadata(d.join(n)).unwrap().len())
            .sum()
    };
    assert_eq!(size(&b) - size(&a), 5 * bytes_per_spike(g.n_chans(), 6));
    assert_eq!(bytes_per_spike(10, 6), 389);
}
