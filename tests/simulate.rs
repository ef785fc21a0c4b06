//! Synthetic recordings: file sizes, metadata, ground truth, determinism.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ndarray::Array2;
use spikecube::Probe;
use spikecube::simulate::{SimConfig, default_probe, geom_map, simulate, waveform};

/// 32 sites, two columns, 20 µm rows, file columns reversed.
fn probe32() -> Probe {
    let n = 32;
    Probe {
        xc: (0..n).map(|i| 20.0 * (i % 2) as f32).collect(),
        yc: (0..n).map(|i| 20.0 * (i / 2) as f32).collect(),
        kcoords: vec![0; n],
        chan_map: (0..n as u64).rev().collect(),
        n_chan: n as u64,
        source: PathBuf::from("test probe"),
    }
}

fn meta(path: &Path) -> HashMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn cfg(seed: u64) -> SimConfig {
    SimConfig {
        seconds: 4.0,
        n_units: 8,
        rate_hz: 10.0,
        seed,
        ..SimConfig::default()
    }
}

#[test]
fn four_seconds_of_32_channels_match_their_meta() {
    let tmp = tempfile::tempdir().unwrap();
    let s = simulate(&probe32(), &cfg(7), tmp.path()).unwrap();
    let m = meta(&s.meta_path);
    let size = std::fs::metadata(&s.bin_path).unwrap().len();
    assert_eq!(size, m["fileSizeBytes"].parse::<u64>().unwrap());
    assert_eq!(size, 4 * 30_000 * 33 * 2);
    assert_eq!(m["nSavedChans"], "33");
    assert_eq!(m["snsApLfSy"], "32,0,1");
    assert_eq!(m["typeThis"], "imec");
    assert_eq!(m["imSampRate"].parse::<f64>().unwrap(), 30_000.0);
    assert_eq!(m["fileTimeSecs"].parse::<f64>().unwrap(), 4.0);
    let geom = &m["~snsGeomMap"];
    assert!(geom.starts_with("(spikecube_sim,1,0,"), "{geom}");
    assert_eq!(geom.matches(":1)").count(), 32);
    // Column 31 holds site 0 at (0, 0); column 0 holds site 31 at (20, 300).
    assert!(geom.contains(")(0:20:300:1)"), "{geom}");
    assert!(geom.ends_with("(0:0:0:1)"), "{geom}");

    let gt: Array2<f64> = spikecube::npy::read(&tmp.path().join("ground_truth.npy")).unwrap();
    assert_eq!(gt.ncols(), 4);
    assert_eq!(gt.nrows(), s.n_spikes);
    // 8 units × 10 Hz × 4 s = 320 expected (Poisson sd ≈ 18).
    assert!((240..=400).contains(&gt.nrows()), "{} spikes", gt.nrows());
    let n_samples = 120_000.0;
    for r in 0..gt.nrows() {
        let t = gt[[r, 0]];
        assert!((20.0..n_samples - 41.0).contains(&t), "spike at {t}");
        if r > 0 {
            assert!(gt[[r - 1, 0]] <= t, "not sorted at row {r}");
        }
        assert!((-200.0..=-60.0).contains(&gt[[r, 3]]));
        assert!((-10.0..=30.0).contains(&gt[[r, 1]]));
        assert!((-10.0..=320.0).contains(&gt[[r, 2]]));
    }
    let written = Probe::load(&tmp.path().join("probe.json")).unwrap();
    assert_eq!(written.n_chan, 33);
    assert_eq!(written.chan_map, probe32().chan_map);
    assert_eq!(written.xc, probe32().xc);
}

#[test]
fn spikes_are_visible_in_the_data() {
    let tmp = tempfile::tempdir().unwrap();
    let p = probe32();
    let s = simulate(&p, &cfg(3), tmp.path()).unwrap();
    let bytes = std::fs::read(&s.bin_path).unwrap();
    let n_cols = 33;
    let at = |t: usize, col: usize| {
        let o = (t * n_cols + col) * 2;
        i16::from_le_bytes([bytes[o], bytes[o + 1]])
    };
    let gt: Array2<f64> = spikecube::npy::read(&tmp.path().join("ground_truth.npy")).unwrap();
    // At the trough, the site nearest the unit dips well below the noise.
    let mut deep = 0;
    for r in 0..gt.nrows() {
        let (t, x, y, a) = (gt[[r, 0]] as usize, gt[[r, 1]], gt[[r, 2]], gt[[r, 3]]);
        let site = (0..p.n_sites())
            .min_by(|&i, &j| {
                let d = |k: usize| (p.xc[k] as f64 - x).powi(2) + (p.yc[k] as f64 - y).powi(2);
                d(i).total_cmp(&d(j))
            })
            .unwrap();
        let v = at(t, p.chan_map[site] as usize) as f64
            - at(t.saturating_sub(15), p.chan_map[site] as usize) as f64;
        if v < a * 0.3 {
            deep += 1;
        }
    }
    assert!(
        deep * 10 >= gt.nrows() * 8,
        "{deep} of {} spikes visible",
        gt.nrows()
    );
    // Sync channel: 64 in the first half of each second.
    assert_eq!(at(0, 32), 64);
    assert_eq!(at(20_000, 32), 0);
}

#[test]
fn ground_truth_units_name_each_spikes_unit() {
    let tmp = tempfile::tempdir().unwrap();
    let c = cfg(5);
    let s = simulate(&probe32(), &c, tmp.path()).unwrap();
    let gt: Array2<f64> = spikecube::npy::read(&tmp.path().join("ground_truth.npy")).unwrap();
    let units: ndarray::Array1<i32> =
        spikecube::npy::read(&tmp.path().join("ground_truth_units.npy")).unwrap();
    assert_eq!(units.len(), gt.nrows());
    assert_eq!(s.units.len(), c.n_units);
    let mut last = vec![None::<f64>; c.n_units];
    for (r, &u) in units.iter().enumerate() {
        assert!((0..c.n_units as i32).contains(&u), "unit {u} at row {r}");
        let unit = &s.units[u as usize];
        // Without drift, each row's position and amplitude are its unit's.
        assert_eq!(gt[[r, 1]], unit.x as f64, "row {r}");
        assert_eq!(gt[[r, 2]], unit.y as f64, "row {r}");
        assert_eq!(gt[[r, 3]], unit.amplitude as f64, "row {r}");
        // Spikes of one unit respect its refractory period.
        if let Some(prev) = last[u as usize] {
            assert!(
                gt[[r, 0]] - prev >= c.refractory_s * c.fs - 1.0,
                "unit {u} at row {r}"
            );
        }
        last[u as usize] = Some(gt[[r, 0]]);
    }
    // 8 units at 10 Hz for 4 s: every unit fires.
    assert!(last.iter().all(Option::is_some));
    let manifest = std::fs::read_to_string(tmp.path().join("spikecube.json")).unwrap();
    assert!(
        manifest.contains("\"ground_truth_units.npy\""),
        "{manifest}"
    );
}

#[test]
fn the_same_seed_gives_the_same_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    let mut short = cfg(11);
    short.seconds = 1.5;
    let sa = simulate(&probe32(), &short, &a).unwrap();
    let sb = simulate(&probe32(), &short, &b).unwrap();
    short.seed = 12;
    let sc = simulate(&probe32(), &short, &c).unwrap();
    let (ba, bb, bc) = (
        std::fs::read(&sa.bin_path).unwrap(),
        std::fs::read(&sb.bin_path).unwrap(),
        std::fs::read(&sc.bin_path).unwrap(),
    );
    assert_eq!(ba, bb);
    assert_ne!(ba, bc);
    assert_eq!(
        std::fs::read(a.join("ground_truth.npy")).unwrap(),
        std::fs::read(b.join("ground_truth.npy")).unwrap()
    );
}

#[test]
fn the_default_probe_is_np2_like() {
    let p = default_probe();
    assert_eq!(p.n_sites(), 384);
    assert_eq!(p.extent(), (0.0, 32.0, 0.0, 2865.0));
    p.validate().unwrap();
    let g = geom_map(&p, 384);
    assert!(
        g.starts_with("(spikecube_sim,1,0,48)(0:0:0:1)(0:32:0:1)(0:0:15:1)"),
        "{}",
        &g[..80]
    );
}

#[test]
fn the_waveform_has_its_trough_at_20() {
    let w = waveform(0.00012, 30_000.0);
    let (imin, &min) = w
        .iter()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(b.1))
        .unwrap();
    assert_eq!(imin, 20);
    assert_eq!(min, -1.0);
    assert!(w[0].abs() < 1e-3 && w[60].abs() < 1e-3);
    assert!(w[35] > 0.1, "rebound {}", w[35]);
}

#[test]
fn bad_settings_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = cfg(0);
    c.seconds = -1.0;
    let e = format!("{:#}", simulate(&probe32(), &c, tmp.path()).unwrap_err());
    assert!(e.contains("-1"), "{e}");
    let mut c = cfg(0);
    c.fs = f64::NAN;
    assert!(simulate(&probe32(), &c, tmp.path()).is_err());
}

/// End to end: simulated spikes, crudely filtered (common median and a running
/// mean removed, scaled by the noise sd), are found by the CPU detector at the
/// trough + 10 samples and near the unit's depth.
#[test]
fn simulated_spikes_are_detected() {
    use spikecube::detect::cpu::CpuDetector;
    use spikecube::{DetectionSettings, Geometry, UniversalTemplates};

    let tmp = tempfile::tempdir().unwrap();
    let p = probe32();
    let mut c = cfg(5);
    c.seconds = 0.5;
    c.n_units = 6;
    c.rate_hz = 20.0;
    let s = simulate(&p, &c, tmp.path()).unwrap();
    let bytes = std::fs::read(&s.bin_path).unwrap();
    let (ns, nt, n_cols) = (p.n_sites(), s.n_samples as usize, 33);
    let mut x = Array2::<f32>::zeros((ns, nt));
    for t in 0..nt {
        for i in 0..ns {
            let o = (t * n_cols + p.chan_map[i] as usize) * 2;
            x[[i, t]] = i16::from_le_bytes([bytes[o], bytes[o + 1]]) as f32;
        }
    }
    // Common median per sample.
    for t in 0..nt {
        let mut col: Vec<f32> = x.column(t).to_vec();
        col.sort_by(f32::total_cmp);
        let med = (col[ns / 2 - 1] + col[ns / 2]) / 2.0;
        x.column_mut(t).mapv_inplace(|v| v - med);
    }
    // Running mean over 301 samples per channel, then scale to unit noise.
    let half = 150;
    for i in 0..ns {
        let row = x.row(i).to_vec();
        let mut cum = vec![0f64; nt + 1];
        for t in 0..nt {
            cum[t + 1] = cum[t] + row[t] as f64;
        }
        for t in 0..nt {
            let (a, b) = (t.saturating_sub(half), (t + half + 1).min(nt));
            let m = (cum[b] - cum[a]) / (b - a) as f64;
            x[[i, t]] = ((row[t] as f64 - m) / 10.0) as f32;
        }
    }
    let settings = DetectionSettings::default();
    let g = Geometry::new(&p, &settings).unwrap();
    let mut det = CpuDetector::new(g, UniversalTemplates::builtin(), settings).unwrap();
    let d = det.detect(x.view(), &p.yc).unwrap();
    let gt: Array2<f64> = spikecube::npy::read(&tmp.path().join("ground_truth.npy")).unwrap();
    // Only spikes whose detection sample lies in the window's own part (nt = 61 padding
    // is not added here, so skip the edges).
    let mut found = 0;
    let mut total = 0;
    for r in 0..gt.nrows() {
        let (t, y) = (gt[[r, 0]] as i64 + 10, gt[[r, 2]] as f32);
        if t < 100 || t > nt as i64 - 100 {
            continue;
        }
        total += 1;
        if (0..d.len()).any(|k| (d.sample[k] as i64 - t).abs() <= 3 && (d.yct[k] - y).abs() < 40.0)
        {
            found += 1;
        }
    }
    eprintln!("found {found} of {total}; {} detections", d.len());
    assert!(total > 20, "{total} spikes");
    assert!(found * 10 >= total * 8, "found {found} of {total}");
}

/// The `.meta` of a Neuropixels layout has every field neo and probeinterface
/// need (part number, type, `~imroTbl`, gain, ADC range and resolution,
/// consistent with each other), and spikecube's own reader gives back the
/// positions of `probe.json`. (`tests/python/` checks SpikeInterface itself.)
#[test]
fn neuropixels_layouts_get_a_meta_other_readers_accept() {
    use spikecube::recording::{OpenOptions, open};
    let tmp = tempfile::tempdir().unwrap();
    let mut c = cfg(1);
    c.seconds = 0.2;
    // NP1.0: electrodes 0..383, staggered rows 20 µm apart.
    let mut np1 = default_probe();
    for i in 0..384 {
        let row = i / 2;
        np1.xc[i] = if row % 2 == 0 { 16.0 } else { 0.0 } + 32.0 * (i % 2) as f32;
        np1.yc[i] = 20.0 * row as f32;
    }
    let custom = probe32();
    for (name, probe, fields) in [
        (
            "np2",
            default_probe(),
            vec![
                "imDatPrb_pn=NP2003\n",
                "imDatPrb_type=2003\n",
                "imAiRangeMax=0.62\n",
                "imMaxInt=2048\n",
                "imChan0apGain=100\n",
                "~imroTbl=(2003,384)(0 1 0 0)(1 1 0 1)",
                "~snsGeomMap=(NP2003,1,0,70)(0:27:0:1)(0:59:0:1)",
            ],
        ),
        (
            "np1",
            np1,
            vec![
                "imDatPrb_pn=PRB_1_4_0480_1\n",
                "imDatPrb_type=0\n",
                "imAiRangeMax=0.6\n",
                "imMaxInt=512\n",
                "~imroTbl=(0,384)(0 0 0 500 250 1)",
                "~snsGeomMap=(PRB_1_4_0480_1,1,0,70)(0:27:0:1)(0:59:0:1)(0:11:20:1)",
            ],
        ),
        ("custom", custom, vec!["~snsGeomMap=(spikecube_sim,"]),
    ] {
        let dir = tmp.path().join(name);
        let s = simulate(&probe, &c, &dir).unwrap();
        let meta = std::fs::read_to_string(&s.meta_path).unwrap();
        for f in &fields {
            assert!(meta.contains(f), "{name}: `{f}` not in the .meta");
        }
        for f in [
            "imSampRate=30000\n",
            "nSavedChans=",
            "snsApLfSy=",
            "typeThis=imec\n",
            "fileSizeBytes=",
        ] {
            assert!(meta.contains(f), "{name}: `{f}` not in the .meta");
        }
        if name == "custom" {
            assert!(!meta.contains("imDatPrb_pn"), "{name}");
        }
        let opened = open(&s.bin_path, &OpenOptions::default()).unwrap();
        let read = opened.probe.expect("the .meta gives the geometry");
        let json = Probe::load(&dir.join("probe.json")).unwrap();
        // Site positions by file column, from the .meta, probe.json and the probe given.
        let by_channel = |p: &Probe| {
            let mut v: Vec<(u64, f32, f32)> = (0..p.n_sites())
                .map(|i| (p.chan_map[i], p.xc[i], p.yc[i]))
                .collect();
            v.sort_by_key(|a| a.0);
            v
        };
        assert_eq!(by_channel(&read), by_channel(&json), "{name}");
        assert_eq!(by_channel(&read), by_channel(&probe), "{name}");
    }
}
