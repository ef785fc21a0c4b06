//! Recording layer: readers, SpikeGLX geometry, windows, loader; field-failure
//! regressions BR-08 … BR-18.
//!
//! Tests that need real files read them from the repository's `tests/data/`,
//! and fail (not skip) when they are missing.

use std::collections::BTreeSet;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ndarray::Array2;
use spikecube::Probe;
use spikecube::error::RecordingError;
use spikecube::recording::{
    self, Dtype, Format, OpenOptions, Recording, WindowLoader, WindowPlan, np_parts, openephys,
    read_window, spikeglx,
};

// ---------------------------------------------------------------- helpers

/// The test data carried in the repository (`tests/data/`); a missing folder is
/// a failure naming where it was expected, never a skip.
fn shared() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    assert!(
        p.join("data").is_dir(),
        "test data missing: expected {}/data (the repository's tests/data/ should hold it)",
        p.display()
    );
    p
}

/// Collects the text of every tracing event emitted while `f` runs.
fn capture_logs<T>(f: impl FnOnce() -> T) -> (T, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let b2 = buf.clone();
    let sub = tracing_subscriber::fmt()
        .with_writer(move || b2.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let out = tracing::subscriber::with_default(sub, f);
    let text = String::from_utf8_lossy(&buf.0.lock().unwrap()).into_owned();
    (out, text)
}

fn write_bytes(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

fn i16_bytes(v: &[i16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn flat(n_channels: u64, fs: f64, dtype: Dtype) -> OpenOptions {
    OpenOptions {
        format: Format::Binary,
        n_channels: Some(n_channels),
        fs: Some(fs),
        dtype,
        ..Default::default()
    }
}

fn read_all(rec: &dyn Recording, chan_map: &[u64]) -> Vec<f32> {
    let n = rec.n_samples() as usize;
    let mut out = vec![0.0; chan_map.len() * n];
    rec.read_channels(0, n, chan_map, &mut out).unwrap();
    out
}

/// A SpikeGLX `.meta` text with the given fields (plus defaults).
fn meta_text(n_saved: u64, subset: &str, ap_lf_sy: &str, fs: &str, extra: &[String]) -> String {
    let mut s = format!(
        "typeThis=imec\nnSavedChans={n_saved}\nimSampRate={fs}\nsnsSaveChanSubset={subset}\nsnsApLfSy={ap_lf_sy}\n"
    );
    for e in extra {
        s.push_str(e);
        s.push('\n');
    }
    s
}

fn np1_imro(banks: impl Fn(u64) -> u64) -> String {
    let mut s = String::from("~imroTbl=(0,384)");
    for c in 0..384 {
        s.push_str(&format!("({c} {} 0 500 250 1)", banks(c)));
    }
    s
}

// ---------------------------------------------------------------- BR-08

#[test]
fn br08_np1_even_channels_plus_sync() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("rec_g0_t0.imec0.ap.bin");
    let subset: Vec<String> = (0..192)
        .map(|k| (2 * k).to_string())
        .chain(["768".into()])
        .collect();
    let n_t = 3000usize;
    let meta = meta_text(
        193,
        &subset.join(","),
        "192,0,1",
        "30000.0",
        &[
            np1_imro(|_| 0),
            format!("fileSizeBytes={}", 193 * 2 * n_t),
            "imDatPrb_type=0".into(),
        ],
    );
    std::fs::write(bin.with_extension("meta"), meta).unwrap();
    let data: Vec<i16> = (0..n_t).flat_map(|_| 0..193i16).collect();
    write_bytes(&bin, &i16_bytes(&data));

    let opened = recording::open(&bin, &OpenOptions::default()).unwrap();
    let probe = opened.probe.expect("probe from the meta");
    assert_eq!(probe.n_sites(), 192);
    assert_eq!(probe.n_chan, 193);
    assert_eq!(probe.chan_map, (0..192).collect::<Vec<u64>>());
    assert!(!probe.chan_map.contains(&192), "sync column is not a site");
    for k in 0..192usize {
        // Saved channel 2k reads electrode 2k: row k, column 0.
        let row = k as f32;
        let expect_x = if k % 2 == 0 { 16.0 } else { 0.0 };
        assert_eq!(probe.xc[k], expect_x, "site {k}");
        assert_eq!(probe.yc[k], 20.0 * row, "site {k}");
        assert_eq!(probe.kcoords[k], 0);
    }
    let rec = opened.recording;
    assert_eq!(rec.n_channels(), 193);
    assert_eq!(rec.n_samples(), n_t as u64);
    let vals = read_all(rec.as_ref(), &probe.chan_map);
    for (k, row) in vals.chunks(n_t).enumerate() {
        assert!(
            row.iter().all(|&v| v == k as f32),
            "column {k} values preserved"
        );
    }

    // The real meta that saved only part of an NP1.0 probe.
    let real = shared()
        .join("data/probes/spikeglx_meta/probeinterface__NP1_saved_only_subset_of_channels.meta");
    let m = spikeglx::parse_meta(&real).unwrap();
    assert_eq!(m.n_saved_chans, 152);
    assert_eq!(m.saved_channels.last(), Some(&768));
    let p = m.probe().unwrap();
    assert_eq!(p.n_chan, 152);
    assert_eq!(p.n_sites(), 151);
    assert!(p.chan_map.iter().all(|&c| c < 151));
}

// ---------------------------------------------------------------- BR-09

#[test]
fn br09_np2_four_shank_middle_shanks() {
    let mut imro = String::from("~imroTbl=(24,384)");
    for c in 0..384u64 {
        let shank = if c < 192 { 1 } else { 2 };
        let e = c % 192;
        imro.push_str(&format!("({c} {shank} 0 0 {e})"));
    }
    let text = meta_text(
        385,
        "0:384",
        "384,0,1",
        "30000.0",
        &[imro, "imDatPrb_type=24".into(), "imDatPrb_pn=NP2010".into()],
    );
    let m = spikeglx::parse_meta_text(&text, Path::new("synthetic.meta")).unwrap();
    let p = m.probe().unwrap();
    assert_eq!(p.n_sites(), 384);
    let xs: BTreeSet<i64> = p.xc.iter().map(|&x| x as i64).collect();
    assert_eq!(xs, BTreeSet::from([250, 282, 500, 532]));
    let shanks: BTreeSet<i64> = p.kcoords.iter().copied().collect();
    assert_eq!(shanks, BTreeSet::from([1, 2]));
    for i in 0..384 {
        assert_eq!(p.kcoords[i], if i < 192 { 1 } else { 2 });
        assert_eq!(p.yc[i], 15.0 * ((i % 192) / 2) as f32);
    }

    // Real tables parse and stay within the part's shanks.
    let root = shared().join("data/probes/spikeglx_meta");
    let t = std::fs::read_to_string(root.join("probeinterface__test_multi_shank.imro")).unwrap();
    let imro = spikeglx::parse_imro(&t).unwrap();
    assert_eq!(imro.type_id, Some(24));
    let sites = imro.sites(None).unwrap();
    assert_eq!(sites.len(), 384);
    assert!(sites.iter().all(|s| (0..4).contains(&s.shank)));
    let m = spikeglx::parse_meta(&root.join("probeinterface__NP2_4_shanks.imec0.ap.meta")).unwrap();
    let p = m.probe().unwrap();
    assert!(p.kcoords.iter().all(|&k| (0..4).contains(&k)));
    for i in 0..p.n_sites() {
        let local = p.xc[i] - 250.0 * p.kcoords[i] as f32;
        assert!(local == 0.0 || local == 32.0, "x within the shank: {local}");
    }
}

// ---------------------------------------------------------------- BR-10

fn check_tail(batch: u64, nt: u64, r: u64) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tail.bin");
    let nc = 8u64;
    let n = 2 * batch + r;
    let mut data = vec![0i16; (n * nc) as usize];
    for t in 0..n {
        for c in 0..nc {
            data[(t * nc + c) as usize] = ((t * 7 + c * 13) % 200) as i16 - 100;
        }
    }
    // A "spike" in the tail.
    let spike_t = 2 * batch + r / 2;
    data[(spike_t * nc + 3) as usize] = -5000;
    write_bytes(&path, &i16_bytes(&data));
    let opts = flat(nc, 30000.18, Dtype::Int16);
    let (res, logs) = capture_logs(|| {
        let rec = recording::open(&path, &opts).unwrap().recording;
        assert_eq!(rec.fs(), 30000.18);
        let plan = WindowPlan::new(rec.n_samples(), batch, nt).unwrap();
        let windows: Vec<_> = WindowLoader::all(rec, plan, (0..nc).collect())
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        (plan, windows)
    });
    let (plan, windows) = res;
    if r < nt {
        assert_eq!(plan.n_windows, 2, "r = {r}");
        assert!(logs.contains("skipped"), "r = {r}: logs: {logs}");
    } else {
        assert_eq!(plan.n_windows, 3, "r = {r}");
        let w = &windows[2];
        assert_eq!(w.own_len, r);
        let col = (spike_t - w.own_start + nt) as usize;
        assert_eq!(w.data[[3, col]], -5000.0, "tail spike, r = {r}");
    }
    assert_eq!(windows.len() as u64, plan.n_windows);
    logs
}

#[test]
fn br10_any_tail_length() {
    for r in [1, 10, 60, 61, 62, 5999] {
        check_tail(6000, 61, r);
    }
    // One case at Kilosort4's default batch size.
    check_tail(60000, 61, 59999);
    check_tail(60000, 61, 10);
}

// ---------------------------------------------------------------- BR-11

#[test]
fn br11_uint16_edge_values_exact() {
    let dir = tempfile::tempdir().unwrap();
    let nc = 4usize;
    let n = 6000usize;
    let edge = [0u16, 1, 32767, 32768, 32769, 65535];
    let mut v = vec![32768u16; n * nc];
    for t in 0..n {
        for c in 0..nc {
            v[t * nc + c] = if t < 6 {
                edge[t]
            } else if t % 500 == 100 {
                32768 - 300 + c as u16
            } else {
                32768 + ((t * 31 + c) % 50) as u16
            };
        }
    }
    let pu = dir.path().join("u16.bin");
    write_bytes(
        &pu,
        &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
    );
    let pi = dir.path().join("i16.bin");
    let as_i16: Vec<i16> = v.iter().map(|&x| (i32::from(x) - 32768) as i16).collect();
    write_bytes(&pi, &i16_bytes(&as_i16));
    let ru = recording::open(&pu, &flat(4, 30000.0, Dtype::Uint16))
        .unwrap()
        .recording;
    let ri = recording::open(&pi, &flat(4, 30000.0, Dtype::Int16))
        .unwrap()
        .recording;
    let cm: Vec<u64> = (0..4).collect();
    let a = read_all(ru.as_ref(), &cm);
    let b = read_all(ri.as_ref(), &cm);
    for c in 0..nc {
        for (t, e) in edge.iter().enumerate() {
            let got = a[c * n + t];
            assert_eq!(got.to_bits(), ((i32::from(*e) - 32768) as f32).to_bits());
        }
    }
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    let plan = WindowPlan::new(n as u64, 2000, 61).unwrap();
    for i in 0..plan.n_windows {
        let mut wa = Array2::zeros((4, plan.window_len()));
        let mut wb = Array2::zeros((4, plan.window_len()));
        read_window(ru.as_ref(), &plan, i, &cm, &mut wa).unwrap();
        read_window(ri.as_ref(), &plan, i, &cm, &mut wb).unwrap();
        assert_eq!(wa, wb);
    }
}

// ---------------------------------------------------------------- BR-13

#[test]
fn br13_size_mismatch_message_and_meta_contradiction() {
    let dir = tempfile::tempdir().unwrap();
    // (b) 64 channels plus 2 stray bytes.
    let p = dir.path().join("stray.bin");
    let mut bytes = vec![0u8; 64 * 3000 * 2];
    bytes.extend([1, 2]);
    write_bytes(&p, &bytes);
    let err = recording::open(&p, &flat(64, 30000.0, Dtype::Int16)).unwrap_err();
    assert!(matches!(err, RecordingError::Size { remainder: 2, .. }));
    let msg = err.to_string();
    for needle in [
        "384002",
        "int16",
        "64 channels",
        "2 bytes are left over",
        "stray.bin",
    ] {
        assert!(msg.contains(needle), "`{needle}` missing from: {msg}");
    }
    let nearest = recording::nearest_channel_counts(384002, 2, 64);
    assert_ne!(nearest, "none");
    assert!(msg.contains(&nearest), "{msg}");
    // 384002 / 2 = 192001 = 7 · 27429 ...: the counts listed do divide.
    for c in nearest.split(", ") {
        let c: u64 = c.parse().unwrap();
        assert_eq!(384002 % (2 * c), 0);
    }

    // (a) 64-channel SpikeGLX file read as 48 channels: the meta says 64.
    let bin = dir.path().join("tet.bin");
    write_bytes(&bin, &vec![0u8; 64 * 3000 * 2]);
    std::fs::write(
        bin.with_extension("meta"),
        meta_text(64, "all", "64,0,0", "30000", &[]),
    )
    .unwrap();
    let mut o = OpenOptions {
        n_channels: Some(48),
        ..Default::default()
    };
    let err = recording::open(&bin, &o).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(
        err,
        RecordingError::Setting {
            setting: "n_chan_bin",
            ..
        }
    ));
    assert!(
        msg.contains("48") && msg.contains("nSavedChans = 64"),
        "{msg}"
    );
    o.n_channels = Some(64);
    let ok = recording::open(&bin, &o).unwrap();
    assert_eq!(ok.recording.n_samples(), 3000);

    // The same 64-channel file opened as SpikeGLX without a meta: a clear error.
    let lone = dir.path().join("lone.bin");
    write_bytes(&lone, &[0u8; 128]);
    let err = recording::open(
        &lone,
        &OpenOptions {
            format: Format::SpikeGlx,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(matches!(err, RecordingError::Missing { .. }), "{err}");
    assert!(err.to_string().contains("lone.meta"));
    // Flat binary without the channel count names the flag, not Kilosort's name.
    let err = recording::open(&lone, &OpenOptions::default()).unwrap_err();
    assert!(err.to_string().contains("--n-channels"), "{err}");
    assert!(!err.to_string().contains("n_chan_bin"), "{err}");
}

// ---------------------------------------------------------------- BR-14

#[test]
fn br14_truncated_spikeglx_file() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("killed.imec0.ap.bin");
    let nc = 385u64;
    let declared = nc * 2 * 60000; // 2.0 s at 30 kHz
    std::fs::write(
        bin.with_extension("meta"),
        meta_text(
            nc,
            "0:383,768",
            "384,0,1",
            "30000",
            &[np1_imro(|_| 0), format!("fileSizeBytes={declared}")],
        ),
    )
    .unwrap();
    let n = 39000u64;
    let mut bytes = vec![0u8; (n * nc * 2) as usize];
    // Mark the last whole sample of channel 5.
    let o = ((n - 1) * nc * 2 + 10) as usize;
    bytes[o..o + 2].copy_from_slice(&1234i16.to_le_bytes());
    bytes.extend(vec![7u8; 100]);
    write_bytes(&bin, &bytes);
    // The two findings are the opened recording's warnings (a run adds them
    // to its own, printed and kept in spikecube.json), not logged on opening.
    let (opened, logs) = capture_logs(|| recording::open(&bin, &OpenOptions::default()).unwrap());
    let warnings = opened.warnings.join("\n");
    let rec = opened.recording;
    assert_eq!(rec.n_samples(), 39000);
    assert!(
        warnings.contains("100 bytes after the last whole frame"),
        "{warnings}"
    );
    assert!(warnings.contains("fileSizeBytes"), "{warnings}");
    assert_eq!(opened.warnings.len(), 2, "{warnings}");
    assert_eq!(logs.matches(" WARN ").count(), 0, "{logs}");
    let plan = WindowPlan::new(rec.n_samples(), 6000, 61).unwrap();
    let mut last = None;
    for w in WindowLoader::all(rec.clone(), plan, vec![5]).unwrap() {
        last = Some(w.unwrap());
    }
    let w = last.unwrap();
    let col = (38999 - w.own_start + 61) as usize;
    assert_eq!(w.data[[0, col]], 1234.0);
    assert_eq!(opened.probe.unwrap().n_sites(), 384);
}

// ---------------------------------------------------------------- BR-15

#[test]
fn br15_tmin_tmax_absolute_indices() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ramp.bin");
    let fs = 1000.0;
    let n = 20000usize;
    let data: Vec<f32> = (0..n).flat_map(|t| [t as f32, -(t as f32)]).collect();
    write_bytes(&p, &f32_bytes(&data));
    let mut o = flat(2, fs, Dtype::Float32);
    o.tmin = 5.0;
    o.tmax = 7.5;
    let rec = recording::open(&p, &o).unwrap().recording;
    assert_eq!(rec.first_sample(), 5000);
    assert_eq!(rec.n_samples(), 2500);
    let plan = WindowPlan::new(rec.n_samples(), 1000, 10).unwrap();
    let mut seen = Vec::new();
    for w in WindowLoader::all(rec.clone(), plan, vec![0, 1]).unwrap() {
        let w = w.unwrap();
        for c in 10..10 + w.own_len as usize {
            let abs = w.first_sample + c as i64;
            assert_eq!(w.data[[0, c]], abs as f32);
            assert_eq!(w.data[[1, c]], -(abs as f32));
            seen.push(abs);
        }
        // Padding never reaches outside [tmin, tmax).
        assert!(w.data.row(0).iter().all(|&v| (5000.0..7500.0).contains(&v)));
    }
    assert_eq!(seen, (5000..7500).collect::<Vec<i64>>());

    o.tmax = 5.2;
    let rec = recording::open(&p, &o).unwrap().recording;
    assert_eq!(rec.n_samples(), 200);
    o.tmax = 5.0;
    let err = recording::open(&p, &o).unwrap_err();
    assert!(err.to_string().contains("tmin"), "{err}");
    o.tmin = 30.0;
    o.tmax = f64::INFINITY;
    let err = recording::open(&p, &o).unwrap_err();
    assert!(err.to_string().contains("no samples"), "{err}");
}

// ---------------------------------------------------------------- BR-17 / BR-18

fn ramp_recording(dir: &Path, n: usize) -> Arc<dyn Recording> {
    let p = dir.join(format!("ramp{n}.bin"));
    let data: Vec<f32> = (0..n).map(|t| t as f32).collect();
    write_bytes(&p, &f32_bytes(&data));
    recording::open(&p, &flat(1, 30000.0, Dtype::Float32))
        .unwrap()
        .recording
}

#[test]
fn br17_br18_window_boundaries_match_kilosort() {
    let dir = tempfile::tempdir().unwrap();
    let (nb, nt) = (6000u64, 61u64);
    // (n, expected windows) from the preprocessing spec, plus more.
    for (n, expect) in [
        (18050u64, 3u64),
        (18060, 3),
        (18061, 4),
        (20500, 4),
        (6061, 2),
        (6060, 1),
        (6122, 2),
        (12000, 2),
        (4000, 1),
        (6000, 1),
        (6060, 1),
        (60, 0),
        (150000, 25),
    ] {
        let rec = ramp_recording(dir.path(), n as usize);
        let plan = WindowPlan::new(n, nb, nt).unwrap();
        assert_eq!(plan.n_windows, expect, "n = {n}");
        let mut owners = vec![0u32; n as usize];
        for w in WindowLoader::all(rec.clone(), plan, vec![0]).unwrap() {
            let w = w.unwrap();
            assert_eq!(w.own_start, w.index * nb);
            assert_eq!(w.first_sample, (w.index * nb) as i64 - nt as i64);
            for c in 0..plan.window_len() {
                let s = w.first_sample + c as i64;
                let expect = if plan.n_windows == 1 {
                    if s < 0 {
                        0.0
                    } else if (s as u64) < n && c < plan.window_len() {
                        s as f32
                    } else {
                        0.0
                    }
                } else {
                    s.clamp(0, plan.n_used as i64 - 1) as f32
                };
                assert_eq!(
                    w.data[[0, c]],
                    expect,
                    "n = {n}, window {}, column {c}",
                    w.index
                );
            }
            for t in w.own_start..w.own_start + w.own_len {
                owners[t as usize] += 1;
            }
        }
        assert!(
            owners[..plan.n_used as usize].iter().all(|&k| k == 1),
            "n = {n}: every used sample in exactly one window's own part"
        );
        assert!(owners[plan.n_used as usize..].iter().all(|&k| k == 0));
    }
}

#[test]
fn sparse_file_longer_than_2_pow_31_samples() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("huge.bin");
    let n: u64 = (1 << 31) + 1000;
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(n * 2).unwrap();
    let mut f = f;
    let marks: Vec<(u64, i16)> = vec![(1 << 31, 11), ((1 << 31) + 500, -22), (n - 1, 33)];
    for &(t, v) in &marks {
        f.seek(SeekFrom::Start(t * 2)).unwrap();
        f.write_all(&v.to_le_bytes()).unwrap();
    }
    drop(f);
    let rec = recording::open(&p, &flat(1, 30000.0, Dtype::Int16))
        .unwrap()
        .recording;
    assert_eq!(rec.n_samples(), n);
    let mut out = vec![0f32; 1001];
    rec.read_channels((1 << 31) - 1, 1001, &[0], &mut out)
        .unwrap();
    assert_eq!(out[0], 0.0);
    assert_eq!(out[1], 11.0);
    assert_eq!(out[501], -22.0);
    let plan = WindowPlan::new(n, 65536, 61).unwrap();
    assert_eq!(plan.n_windows, n.div_ceil(65536));
    let last = plan.n_windows - 1;
    let loader = WindowLoader::new(rec.clone(), plan, vec![0], vec![32768, last], 1).unwrap();
    let ws: Vec<_> = loader.map(|w| w.unwrap()).collect();
    assert_eq!(ws[0].own_start, 1 << 31);
    assert_eq!(ws[0].data[[0, 61]], 11.0);
    assert_eq!(ws[0].data[[0, 561]], -22.0);
    let w = &ws[1];
    let col = (n - 1 - w.own_start + 61) as usize;
    assert_eq!(w.data[[0, col]], 33.0);
    assert_eq!(
        w.data[[0, plan.window_len() - 1]],
        33.0,
        "edge repeat of the last sample"
    );
}

// ---------------------------------------------------------------- concatenation, loader

#[test]
fn concatenated_files_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mk = |name: &str, from: usize, len: usize, nc: usize| {
        let p = dir.path().join(name);
        let d: Vec<f32> = (from..from + len)
            .flat_map(|t| (0..nc).map(move |c| (t * 10 + c) as f32))
            .collect();
        write_bytes(&p, &f32_bytes(&d));
        p
    };
    let a = mk("a.bin", 0, 1234, 2);
    let b = mk("b.bin", 1234, 777, 2);
    let c = mk("c.bin", 2011, 500, 2);
    let mut o = flat(2, 1000.0, Dtype::Float32);
    let rec = recording::open_many(&[a.clone(), b.clone(), c.clone()], &o)
        .unwrap()
        .recording;
    assert_eq!(rec.n_samples(), 2511);
    let all = read_all(rec.as_ref(), &[1]);
    assert!(
        all.iter()
            .enumerate()
            .all(|(t, &v)| v == (t * 10 + 1) as f32)
    );
    // tmin/tmax over the concatenation keep absolute indices.
    o.tmin = 1.0;
    o.tmax = 2.1;
    let rec = recording::open_many(&[a.clone(), b.clone(), c], &o)
        .unwrap()
        .recording;
    assert_eq!(rec.first_sample(), 1000);
    let plan = WindowPlan::new(rec.n_samples(), 300, 5).unwrap();
    for w in WindowLoader::all(rec.clone(), plan, vec![0]).unwrap() {
        let w = w.unwrap();
        for c in 5..5 + w.own_len as usize {
            assert_eq!(w.data[[0, c]], ((w.first_sample + c as i64) * 10) as f32);
        }
    }
    // Different channel counts or rates are refused.
    let d = mk("d.bin", 0, 100, 3);
    let parts = |fs_d: f64, nc_d: u64| -> Vec<Arc<dyn Recording>> {
        vec![
            Arc::new(
                recording::BinaryRecording::open_flat(&a, 2, 1000.0, Dtype::Float32, 0).unwrap(),
            ),
            Arc::new(
                recording::BinaryRecording::open_flat(&d, nc_d, fs_d, Dtype::Float32, 0).unwrap(),
            ),
        ]
    };
    let names = [a.clone(), d.clone()];
    let e = recording::ConcatRecording::new(parts(1000.0, 3), &names)
        .err()
        .unwrap();
    assert!(e.to_string().contains("3 channels"), "{e}");
    let e = recording::ConcatRecording::new(parts(999.0, 2), &names)
        .err()
        .unwrap();
    assert!(e.to_string().contains("999"), "{e}");
    assert!(recording::open_many(&[], &o).is_err());
}

#[test]
fn loader_errors_and_early_drop() {
    let dir = tempfile::tempdir().unwrap();
    let rec = ramp_recording(dir.path(), 100_000);
    // A plan for a different length: the error reaches the consumer.
    let bad = WindowPlan::new(50_000, 1000, 61).unwrap();
    let mut l = WindowLoader::all(rec.clone(), bad, vec![0]).unwrap();
    assert!(l.next().unwrap().is_err());
    assert!(l.next().is_none());
    // Channel outside the file.
    let plan = WindowPlan::new(100_000, 1000, 61).unwrap();
    let mut l = WindowLoader::all(rec.clone(), plan, vec![3]).unwrap();
    let e = l.next().unwrap().unwrap_err();
    assert!(e.to_string().contains("channel map entry 3"), "{e}");
    // Dropping after one window stops the thread (the test would hang otherwise).
    let mut l = WindowLoader::all(rec.clone(), plan, vec![0]).unwrap();
    let w = l.next().unwrap().unwrap();
    assert_eq!(w.index, 0);
    drop(l);
    // Out-of-range reads are errors, not panics.
    let mut out = vec![0f32; 10];
    assert!(rec.read_channels(99_995, 10, &[0], &mut out).is_err());
    assert!(rec.read_channels(u64::MAX - 3, 10, &[0], &mut out).is_err());
    assert!(rec.read_channels(0, 5, &[0], &mut out).is_err());
    let mut wrong = Array2::zeros((2, 5));
    assert!(read_window(rec.as_ref(), &plan, 0, &[0], &mut wrong).is_err());
    assert!(WindowPlan::new(10, 0, 61).is_err());
}

#[test]
fn scale_and_shift() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.bin");
    write_bytes(&p, &i16_bytes(&[10, -4, 3, 8]));
    let mut o = flat(2, 1000.0, Dtype::Int16);
    o.scale = Some(0.5);
    o.shift = Some(1.0);
    let rec = recording::open(&p, &o).unwrap().recording;
    assert_eq!(read_all(rec.as_ref(), &[0, 1]), vec![6.0, 2.5, -1.0, 5.0]);
    let p32 = dir.path().join("i32.bin");
    write_bytes(
        &p32,
        &[i32::MIN, 7]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let rec = recording::open(&p32, &flat(1, 1.5, Dtype::Int32))
        .unwrap()
        .recording;
    assert_eq!(read_all(rec.as_ref(), &[0]), vec![i32::MIN as f32, 7.0]);
    assert_eq!(Dtype::parse("<u2"), Some(Dtype::Uint16));
    assert_eq!(Dtype::parse("float64"), None);
}

// ---------------------------------------------------------------- shared data

fn meta_dir() -> PathBuf {
    shared().join("data/probes/spikeglx_meta")
}

/// (file, nSavedChans, rate, AP sites in the probe)
const METAS: &[(&str, u64, f64, usize)] = &[
    (
        "ibl-neuropixel__sample3A_376_channels.ap.meta",
        277,
        30000.0,
        269,
    ),
    (
        "ibl-neuropixel__sample3B_g0_t0.imec1.ap.meta",
        385,
        30000.390639481,
        383,
    ),
    (
        "ibl-neuropixel__sampleNHPlong_prototype.ap.meta",
        385,
        30000.0,
        383,
    ),
    (
        "ibl-neuropixel__sampleNP2.4_4shanks_g0_t0.imec.ap.meta",
        385,
        29999.757983,
        383,
    ),
    (
        "ibl-neuropixel__sampleNPultra_g0_t0.imec0.ap.meta",
        385,
        30000.0,
        384,
    ),
    ("probeinterface__NP-Ultra.meta", 385, 30000.0, 384),
    (
        "probeinterface__NP1110_vstripe_g0_t0.imec0.ap.meta",
        385,
        30000.0,
        384,
    ),
    (
        "probeinterface__NP1_saved_only_subset_of_channels.meta",
        152,
        30000.0,
        151,
    ),
    (
        "probeinterface__NP2020_sample_g0_t0.imec0.ap.meta",
        1540,
        30000.0,
        1536,
    ),
    (
        "probeinterface__NP2_2013_all_channels.imec0.ap.meta",
        385,
        30000.0,
        384,
    ),
    (
        "probeinterface__NP2_2013_subset_channels.imec0.ap.meta",
        121,
        30000.0,
        120,
    ),
    (
        "probeinterface__NP2_4_shanks.imec0.ap.meta",
        385,
        30000.0,
        383,
    ),
    ("probeinterface__catgt.meta", 385, 30000.149579831934, 383),
    (
        "probeinterface__non_human_primate_long_staggered.imec0.ap.meta",
        385,
        30000.0,
        383,
    ),
    ("probeinterface__p2_g0_t0.imec0.ap.meta", 385, 30000.0, 383),
    ("probeinterface__phase3a.imec.ap.meta", 385, 30000.0, 374),
];

#[test]
fn every_shared_meta_loads() {
    let mut n = 0;
    for e in std::fs::read_dir(meta_dir()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "meta") {
            let name = p.file_name().unwrap().to_str().unwrap().to_owned();
            let &(_, ns, fs, sites) = METAS
                .iter()
                .find(|m| m.0 == name)
                .unwrap_or_else(|| panic!("{name} is not in the table"));
            let m = spikeglx::parse_meta(&p).unwrap();
            assert_eq!(m.n_saved_chans, ns, "{name}");
            assert_eq!(m.fs, fs, "{name}");
            let probe = m.probe().unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(probe.n_sites(), sites, "{name}");
            assert_eq!(probe.n_chan, ns, "{name}");
            let [ap, _, _] = m.ap_lf_sy.unwrap();
            assert!(
                probe.chan_map.iter().all(|&c| c < ap),
                "{name}: only AP columns"
            );
            n += 1;
        }
    }
    assert_eq!(n, METAS.len());
    // Probe::load reads the geometry of a .meta too.
    let p = Probe::load(&meta_dir().join(METAS[1].0)).unwrap();
    assert_eq!(p.n_sites(), METAS[1].3);
}

fn library_positions(name: &str) -> Vec<(f32, f32)> {
    let p = shared().join(format!("data/probes/probeinterface_library/{name}.json"));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let probe = &v["probes"][0];
    let ids = probe["contact_ids"].as_array().unwrap();
    let pos = probe["contact_positions"].as_array().unwrap();
    let mut out = vec![(f32::NAN, f32::NAN); ids.len()];
    for (id, xy) in ids.iter().zip(pos) {
        let e: usize = id
            .as_str()
            .unwrap()
            .trim_start_matches('e')
            .parse()
            .unwrap();
        out[e] = (
            xy[0].as_f64().unwrap() as f32,
            xy[1].as_f64().unwrap() as f32,
        );
    }
    out
}

/// Electrode read by each probe site of a meta whose imro table names it.
fn electrodes(m: &spikeglx::Meta, p: &Probe) -> Vec<usize> {
    let imro = spikeglx::parse_imro(m.get("imroTbl").unwrap()).unwrap();
    p.chan_map
        .iter()
        .map(|&col| {
            let ch = m.saved_channels[col as usize] as i64;
            let e = imro.entries.iter().find(|e| e[0] == ch).unwrap();
            match imro.type_id {
                Some(21) => e[3] as usize,
                _ => (e[1] * 384 + e[0]) as usize,
            }
        })
        .collect()
}

#[test]
fn geometry_matches_probeinterface_library() {
    for (meta, lib) in [
        ("ibl-neuropixel__sample3B_g0_t0.imec1.ap.meta", "NP1000"),
        ("probeinterface__catgt.meta", "NP1000"),
        ("probeinterface__phase3a.imec.ap.meta", "NP1000"),
        ("probeinterface__p2_g0_t0.imec0.ap.meta", "NP2000"),
        ("probeinterface__NP-Ultra.meta", "NP1100"),
    ] {
        let m = spikeglx::parse_meta(&meta_dir().join(meta)).unwrap();
        let p = m.probe().unwrap();
        let lib_pos = library_positions(lib);
        for (i, e) in electrodes(&m, &p).into_iter().enumerate() {
            assert_eq!(
                (p.xc[i], p.yc[i]),
                lib_pos[e],
                "{meta}: site {i}, electrode {e}"
            );
        }
    }
}

#[test]
fn geom_map_and_imro_agree() {
    for name in [
        "probeinterface__NP2_2013_all_channels.imec0.ap.meta",
        "probeinterface__NP2_2013_subset_channels.imec0.ap.meta",
        "probeinterface__NP2020_sample_g0_t0.imec0.ap.meta",
    ] {
        let m = spikeglx::parse_meta(&meta_dir().join(name)).unwrap();
        let from_geom = m.probe().unwrap();
        let mut m2 = m.clone();
        m2.fields.remove("~snsGeomMap");
        let from_imro = m2.probe().unwrap();
        assert_eq!(from_geom.chan_map, from_imro.chan_map, "{name}");
        assert_eq!(from_geom.kcoords, from_imro.kcoords, "{name}");
        assert_eq!(from_geom.xc, from_imro.xc, "{name}");
        assert_eq!(from_geom.yc, from_imro.yc, "{name}");
    }
}

#[test]
fn np_parts_match_features_json() {
    let p = shared().join("data/probes/neuropixels_probe_features.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let probes = v["neuropixels_probes"].as_object().unwrap();
    assert_eq!(probes.len(), np_parts::NP_PARTS.len());
    let num = |x: &serde_json::Value| x.as_str().unwrap().parse::<f64>().unwrap();
    for part in np_parts::NP_PARTS {
        let f = &probes[part.part];
        assert_eq!(part.cols_per_shank as f64, num(&f["cols_per_shank"]));
        assert_eq!(part.pitch_horz as f64, num(&f["electrode_pitch_horz_um"]));
        assert_eq!(part.pitch_vert as f64, num(&f["electrode_pitch_vert_um"]));
        assert_eq!(
            part.even_row_offset as f64,
            num(&f["even_row_horz_offset_left_edge_to_leftmost_electrode_center_um"])
        );
        assert_eq!(
            part.odd_row_offset as f64,
            num(&f["odd_row_horz_offset_left_edge_to_leftmost_electrode_center_um"])
        );
        assert_eq!(part.num_shanks as f64, num(&f["num_shanks"]));
        assert_eq!(part.shank_pitch as f64, num(&f["shank_pitch_um"]));
        assert_eq!(
            part.electrodes_per_shank as f64,
            num(&f["electrodes_per_shank"])
        );
        assert_eq!(
            part.num_readout_channels as f64,
            num(&f["num_readout_channels"])
        );
        assert_eq!(
            part.imro_format,
            f["imro_table_format_type"].as_str().unwrap()
        );
    }
    let types = v["z_imro_format_type_to_imro_format"].as_object().unwrap();
    assert_eq!(types.len(), np_parts::IMRO_TYPES.len());
    for (t, fmt, pn) in np_parts::IMRO_TYPES {
        assert_eq!(types[&t.to_string()].as_str().unwrap(), *fmt);
        assert_eq!(
            v["z_imro_format_type_to_part_number"][t.to_string()]
                .as_str()
                .unwrap(),
            *pn
        );
    }
}

#[test]
fn open_ephys_example() {
    let rec_dir = shared().join(
        "data/real/openephys_example_16ch/binary_format/Record Node 101/experiment1/recording1",
    );
    for path in [
        rec_dir.join("structure.oebin"),
        rec_dir.clone(),
        shared().join("data/real/openephys_example_16ch/binary_format"),
    ] {
        let o = recording::open(&path, &OpenOptions::default()).unwrap();
        let rec = o.recording;
        assert_eq!(rec.n_channels(), 16, "{path:?}");
        assert_eq!(rec.fs(), 40000.0);
        assert_eq!(rec.n_samples(), 131362);
        assert_eq!(o.first_sample_number, Some(40091));
        let bv = o.bit_volts.unwrap();
        assert_eq!(bv.len(), 16);
        assert!((bv[0] - 0.05).abs() < 1e-6);
        let mut out = vec![0f32; 16 * 2];
        rec.read_channels(0, 2, &(0..16).collect::<Vec<u64>>(), &mut out)
            .unwrap();
        assert_eq!(&out[..2], &[325.0, 351.0]);
        assert_eq!(out[2 * 15], 439.0);
        let mut one = [0f32];
        rec.read_channels(1000, 1, &[3], &mut one).unwrap();
        assert_eq!(one[0], 46.0);
    }
    let err = recording::open(
        &rec_dir,
        &OpenOptions {
            n_channels: Some(12),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("num_channels = 16"), "{err}");
    let bad = openephys::parse_oebin_text("{\"continuous\": [{}]}", Path::new("x.oebin"));
    assert!(bad.unwrap_err().to_string().contains("folder_name"));
}

#[test]
fn locust_raw_file() {
    let dir = shared().join("data/real/locust_tetrode_tridesclous");
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("info.json")).unwrap()).unwrap();
    let dtype = Dtype::parse(info["dtype"].as_str().unwrap()).unwrap();
    let nc = info["shape"][1].as_u64().unwrap();
    let fs = info["sample_rate"].as_f64().unwrap();
    let path = dir.join("locust_trial_01.raw");
    let rec = recording::open(&path, &flat(nc, fs, dtype))
        .unwrap()
        .recording;
    assert_eq!(rec.n_channels(), 4);
    assert_eq!(rec.fs(), 15000.0);
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(rec.n_samples(), bytes.len() as u64 / 8);
    let t = 12345usize;
    let mut out = vec![0f32; 4];
    rec.read_channels(t as u64, 1, &[0, 1, 2, 3], &mut out)
        .unwrap();
    for (c, v) in out.iter().enumerate() {
        let o = (t * 4 + c) * 2;
        assert_eq!(*v, i16::from_le_bytes([bytes[o], bytes[o + 1]]) as f32);
    }
    // The tetrode's .prb gives its geometry.
    let probe =
        Probe::load(&shared().join("data/probes/prb/tetrode_striatum_tridesclous.prb")).unwrap();
    assert_eq!(probe.n_sites(), 4);
    assert_eq!(probe.chan_map, vec![0, 1, 2, 3]);
    assert_eq!(probe.xc, vec![-100.0, 100.0, -100.0, 100.0]);
    assert_eq!(probe.yc, vec![1500.0, 1400.0, 1300.0, 1200.0]);
    assert_eq!(probe.n_chan, 4);
}

#[test]
fn prb_parser_subset_and_refusals() {
    let text = "# two groups\ntotal_nb_channels = 10\nradius = 100\nchannel_groups = {\n  0: {'channels': [0, 1], 'geometry': {0: (0, 0), 1: (0, 20.5)}, 'graph': [(0, 1)]},\n  1: {\"channels\": [5, 6, 7], \"geometry\": {5: [250, 0], 6: (250, 20), 7: (282, 1e1)}},\n}\n";
    let p = Probe::parse_prb(text, Path::new("t.prb")).unwrap();
    assert_eq!(p.chan_map, vec![0, 1, 5, 6, 7]);
    assert_eq!(p.kcoords, vec![0, 0, 1, 1, 1]);
    assert_eq!(p.yc, vec![0.0, 20.5, 0.0, 20.0, 10.0]);
    assert_eq!(p.n_chan, 10);
    for bad in [
        "import os\nchannel_groups = {}",
        "channel_groups = {0: {'channels': [0], 'geometry': {0: (os.system('x'), 0)}}}",
        "channel_groups = [1, 2]",
        "channel_groups = {0: {'channels': [0], 'geometry': {0: (0, 0)}}",
        "channel_groups = {0: {'channels': [-1], 'geometry': {}}}",
        "total_nb_channels = 1\nchannel_groups = {0: {'channels': [0, 3], 'geometry': {0: (0, 0), 3: (1, 1)}}}",
        &"[".repeat(10_000),
    ] {
        assert!(
            Probe::parse_prb(bad, Path::new("bad.prb")).is_err(),
            "{bad:.60}"
        );
    }
}

#[test]
fn meta_parser_refusals() {
    let p = Path::new("x.meta");
    assert!(
        spikeglx::parse_meta_text("", p)
            .unwrap_err()
            .to_string()
            .contains("nSavedChans")
    );
    let t = meta_text(4, "0:3", "3,0,1", "abc", &[]);
    assert!(
        spikeglx::parse_meta_text(&t, p)
            .unwrap_err()
            .to_string()
            .contains("imSampRate")
    );
    let t = meta_text(4, "0:2", "3,0,1", "30000", &[]);
    assert!(
        spikeglx::parse_meta_text(&t, p)
            .unwrap_err()
            .to_string()
            .contains("snsSaveChanSubset")
    );
    let t = meta_text(4, "0:3", "3,0,0", "30000", &[]);
    assert!(
        spikeglx::parse_meta_text(&t, p)
            .unwrap_err()
            .to_string()
            .contains("snsApLfSy")
    );
    let t = meta_text(
        4,
        "0:3",
        "3,0,1",
        "30000",
        &["~imroTbl=(1110,0,0,500,250,1)(0 1 2)".into()],
    );
    let m = spikeglx::parse_meta_text(&t, p).unwrap();
    assert!(m.probe().is_err());
    let t = meta_text(
        4,
        "0:3",
        "3,0,1",
        "30000",
        &["~imroTbl=(0,384)(0 9 0 500 250 1)".into()],
    );
    let e = spikeglx::parse_meta_text(&t, p)
        .unwrap()
        .probe()
        .unwrap_err();
    assert!(e.to_string().contains("electrode"), "{e}");
    assert_eq!(
        spikeglx::parse_channel_subset("0:3,7, 9:10", 0).unwrap(),
        vec![0, 1, 2, 3, 7, 9, 10]
    );
    assert!(spikeglx::parse_channel_subset("5:3", 0).is_err());
    assert!(spikeglx::parse_channel_subset("0:99999999999", 0).is_err());
}
