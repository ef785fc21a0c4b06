//! `spikecube detect` end to end, as a user runs it: simulated SpikeGLX data with
//! ground truth, the real example recordings with the shipped probes, repeatability,
//! and bad inputs (one clear error line, exit code 2, no output folder).

mod common;

use common::{s, spikecube};

use std::path::{Path, PathBuf};
use std::process::Output;

use ndarray::{Array1, Array2, Array3};
use spikecube::npy;

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A 32-site two-column probe (x ∈ {0, 32} µm, rows every 20 µm) written as Kilosort JSON.
fn write_probe(dir: &Path) -> PathBuf {
    let p = dir.join("probe32.json");
    let xc: Vec<f32> = (0..32).map(|i| 32.0 * (i % 2) as f32).collect();
    let yc: Vec<f32> = (0..32).map(|i| 20.0 * (i / 2) as f32).collect();
    let j = serde_json::json!({"chanMap": (0..32).collect::<Vec<_>>(), "xc": xc, "yc": yc, "kcoords": vec![0; 32], "n_chan": 32});
    std::fs::write(&p, j.to_string()).unwrap();
    p
}

fn simulate(dir: &Path) -> PathBuf {
    let probe = write_probe(dir);
    let sim = dir.join("sim");
    ok(&spikecube(&[
        "simulate",
        "--probe",
        s(&probe),
        "--seconds",
        "6",
        "--n-units",
        "8",
        "--rate",
        "6",
        "--out",
        s(&sim),
    ]));
    sim
}

#[test]
fn simulated_spikeglx_recording_to_spikes_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let sim = simulate(dir.path());
    let bin = sim.join("sim_g0_t0.imec0.ap.bin");
    let out = dir.path().join("out");
    let o = spikecube(&[
        "detect",
        s(&bin),
        "--out",
        s(&out),
        "--batch-size",
        "30000",
        "--json",
    ]);
    ok(&o);
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let n = summary["spikes"].as_u64().unwrap() as usize;
    assert!(n > 0);

    let times: Array1<i64> = npy::read(&out.join("spike_times.npy")).unwrap();
    let centres: Array1<i64> = npy::read(&out.join("spike_centers.npy")).unwrap();
    let amps: Array1<f32> = npy::read(&out.join("amplitudes.npy")).unwrap();
    let templates: Array1<i64> = npy::read(&out.join("spike_detection_templates.npy")).unwrap();
    let signs: Array1<i8> = npy::read(&out.join("spike_signs.npy")).unwrap();
    let pos: Array2<f32> = npy::read(&out.join("spike_positions.npy")).unwrap();
    let pcs: Array3<f32> = npy::read(&out.join("pc_features.npy")).unwrap();
    let centers: Array2<f64> = npy::read(&out.join("template_centers.npy")).unwrap();
    let cc: Array2<i64> = npy::read(&out.join("center_channels.npy")).unwrap();
    let cmap: Array1<i64> = npy::read(&out.join("channel_map.npy")).unwrap();
    let cpos: Array2<f64> = npy::read(&out.join("channel_positions.npy")).unwrap();
    let shanks: Array1<i64> = npy::read(&out.join("channel_shanks.npy")).unwrap();
    let wm: Array2<f32> = npy::read(&out.join("whitening_mat.npy")).unwrap();
    assert_eq!(
        (
            times.len(),
            centres.len(),
            amps.len(),
            templates.len(),
            signs.len()
        ),
        (n, n, n, n, n)
    );
    assert_eq!(pos.dim(), (n, 2));
    assert_eq!(pcs.dim(), (n, 10, 6));
    assert_eq!(centers.ncols(), 2);
    assert_eq!(cc.dim(), (centers.nrows(), 10));
    assert_eq!(
        (cmap.len(), cpos.dim(), shanks.len(), wm.dim()),
        (32, (32, 2), 32, (32, 32))
    );
    assert!(
        times.windows(2).into_iter().all(|w| w[0] <= w[1]),
        "spike times sorted"
    );
    assert!(
        times.iter().all(|&t| (0..180_000).contains(&t)),
        "every spike inside the recording"
    );
    assert!(amps.iter().all(|&a| a > 9.0));
    assert!(templates.iter().all(|&t| (0..30).contains(&t)));
    for f in ["params.py", "peaks.npy", "spikecube.json", "drift_map.png"] {
        assert!(out.join(f).is_file(), "{f}");
    }
    let params = std::fs::read_to_string(out.join("params.py")).unwrap();
    assert!(
        params.contains("n_channels_dat = 33") && params.contains("sample_rate = 30000"),
        "{params}"
    );

    // Recall against the ground truth: a trough within ±0.5 ms of a detection's
    // trough (detection sample − 10) at a position within 50 µm.
    let truth: Array2<f64> = npy::read(&sim.join("ground_truth.npy")).unwrap();
    let mut found = 0;
    for row in truth.rows() {
        let hit = (0..n).any(|i| {
            let dt = (times[i] - 10) as f64 - row[0];
            let d2 = (pos[[i, 0]] as f64 - row[1]).powi(2) + (pos[[i, 1]] as f64 - row[2]).powi(2);
            dt.abs() <= 15.0 && d2 <= 50.0 * 50.0
        });
        found += usize::from(hit);
    }
    let recall = found as f64 / truth.nrows() as f64;
    eprintln!(
        "simulated: {n} detections, recall {recall:.3} of {} true spikes",
        truth.nrows()
    );
    assert!(recall > 0.8, "recall {recall}");

    // A second run gives byte-identical spike files.
    let out2 = dir.path().join("out2");
    ok(&spikecube(&[
        "detect",
        s(&bin),
        "--out",
        s(&out2),
        "--batch-size",
        "30000",
        "-q",
    ]));
    for f in [
        "spike_times.npy",
        "spike_centers.npy",
        "amplitudes.npy",
        "spike_detection_templates.npy",
        "spike_signs.npy",
        "spike_positions.npy",
        "pc_features.npy",
        "peaks.npy",
        "whitening_mat.npy",
    ] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(out2.join(f)).unwrap(),
            "{f} differs between runs"
        );
    }
}

#[test]
fn real_recordings_with_shipped_probes() {
    let real = common::data("data/real");
    let probes = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/probes");
    let dir = tempfile::tempdir().unwrap();
    let oe =
        real.join("openephys_example_16ch/binary_format/Record Node 101/experiment1/recording1");
    let out = dir.path().join("oe");
    ok(&spikecube(&[
        "detect",
        s(&oe),
        "--probe",
        s(&probes.join("openephys_16ch_linear.json")),
        "--out",
        s(&out),
        "-q",
    ]));
    let t: Array1<i64> = npy::read(&out.join("spike_times.npy")).unwrap();
    assert!(
        t.len() > 100 && t.iter().all(|&v| (0..131_362).contains(&v)),
        "{} spikes",
        t.len()
    );

    let locust = real.join("locust_tetrode_tridesclous/locust_trial_01.raw");
    let out = dir.path().join("locust");
    ok(&spikecube(&[
        "detect",
        s(&locust),
        "--n-channels",
        "4",
        "--fs",
        "15000",
        "--probe",
        s(&probes.join("locust_tetrode.json")),
        "--out",
        s(&out),
        "-q",
    ]));
    let t: Array1<i64> = npy::read(&out.join("spike_times.npy")).unwrap();
    assert!(
        t.len() > 100 && t.iter().all(|&v| (0..431_548).contains(&v)),
        "{} spikes",
        t.len()
    );
    let pcs: Array3<f32> = npy::read(&out.join("pc_features.npy")).unwrap();
    assert_eq!(
        pcs.dim(),
        (t.len(), 4, 6),
        "nearest_chans lowered to the 4 sites"
    );
}

#[test]
fn bad_inputs_give_one_error_line_and_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d);
    let bin = sim.join("sim_g0_t0.imec0.ap.bin");
    // A SpikeGLX .bin copied without its .meta.
    let lonely = d.join("lonely.ap.bin");
    std::fs::copy(&bin, &lonely).unwrap();
    let garbage = d.join("garbage.json");
    std::fs::write(&garbage, "{not json").unwrap();
    let a_file = d.join("a_file");
    std::fs::write(&a_file, "").unwrap();
    let probe = write_probe(d);
    let odd = d.join("odd.dat");
    std::fs::write(&odd, vec![0u8; 32 * 2 * 1000 + 6]).unwrap();
    let out = d.join("out");
    let not_writable = a_file.join("out");
    let absent = d.join("absent.bin");
    let cases: Vec<(Vec<&str>, &str, &Path)> = vec![
        (
            vec!["detect", s(&lonely), "--out", s(&out)],
            "no such file",
            &out,
        ),
        (
            vec!["detect", s(&lonely), "--out", s(&out)],
            "lonely.ap.meta",
            &out,
        ),
        (
            vec!["detect", s(&bin), "--n-channels", "32", "--out", s(&out)],
            "nSavedChans = 33",
            &out,
        ),
        (
            vec!["detect", s(&bin), "--probe", s(&garbage), "--out", s(&out)],
            "garbage.json",
            &out,
        ),
        (
            vec!["detect", s(&bin), "--out", s(&not_writable)],
            "a_file",
            &not_writable,
        ),
        (
            vec![
                "detect",
                s(&odd),
                "--n-channels",
                "32",
                "--fs",
                "30000",
                "--probe",
                s(&probe),
                "--out",
                s(&out),
            ],
            "6 bytes are left over",
            &out,
        ),
        (
            vec!["detect", s(&absent), "--out", s(&out)],
            "absent.bin",
            &out,
        ),
    ];
    for (args, needle, target) in cases {
        let o = spikecube(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        let errors: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {err}");
        assert!(
            errors[0].contains(needle),
            "{args:?}: `{needle}` not in {err}"
        );
        assert!(!target.exists(), "{args:?}: output left behind");
        let leftovers: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".partial"))
            .collect();
        assert!(
            leftovers.is_empty(),
            "{args:?}: partial folder left: {leftovers:?}"
        );
    }
}

#[test]
fn preprocess_writes_kilosorts_whitened_recording() {
    let fx = common::data("fixtures/preprocessing");
    let dir = tempfile::tempdir().unwrap();
    let rec = fx.join("recording.bin");
    let probe = fx.join("probe.json");
    let base = [
        "--n-channels",
        "32",
        "--fs",
        "30000",
        "--probe",
        s(&probe),
        "--batch-size",
        "6000",
        "--nskip",
        "1",
        "-q",
    ];
    let out_f = dir.path().join("f32");
    let mut args = vec!["preprocess", s(&rec), "--float32", "--out", s(&out_f)];
    args.extend(base);
    ok(&spikecube(&args));
    let out_i = dir.path().join("i16");
    let mut args = vec!["preprocess", s(&rec), "--out", s(&out_i)];
    args.extend(base);
    ok(&spikecube(&args));

    // Kilosort4's batches, own columns 61 .. 6061, one after the other, sample-major.
    let bytes = std::fs::read(out_f.join("temp_wh.dat")).unwrap();
    let ours: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(ours.len(), 20_500 * 32);
    let bytes16 = std::fs::read(out_i.join("temp_wh.dat")).unwrap();
    assert_eq!(bytes16.len(), 20_500 * 32 * 2);
    let mut worst = 0f64;
    for b in 0..4 {
        let batch: Array2<f32> = npy::read(&fx.join(format!("batch_{b}.npy"))).unwrap();
        for t in 0..6000usize.min(20_500 - b * 6000) {
            for c in 0..32 {
                let r = batch[[c, 61 + t]] as f64;
                let i = (b * 6000 + t) * 32 + c;
                worst = worst.max((ours[i] as f64 - r).abs() / r.abs().max(1.0));
                let q = i16::from_le_bytes([bytes16[2 * i], bytes16[2 * i + 1]]);
                assert_eq!(q, (ours[i] * 200.0).trunc() as i16);
            }
        }
    }
    eprintln!("preprocess: temp_wh.dat vs Kilosort4's batches, largest difference {worst:.2e}");
    assert!(worst <= 1e-4);
    let w: Array2<f32> = npy::read(&out_f.join("whitening_mat.npy")).unwrap();
    assert_eq!(w.dim(), (32, 32));
    let hp: Array1<f32> = npy::read(&out_f.join("hp_filter.npy")).unwrap();
    let hp_ref: Array1<f32> = npy::read(&fx.join("hp_filter.npy")).unwrap();
    assert_eq!(hp.len(), hp_ref.len());
}

/// An existing file or a folder that is not an earlier result is never replaced.
#[test]
fn output_never_replaces_a_users_file_or_folder() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d);
    let bin = sim.join("sim_g0_t0.imec0.ap.bin");
    let file = d.join("notes.txt");
    std::fs::write(&file, "mine").unwrap();
    let folder = d.join("my_data");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("precious.txt"), "mine").unwrap();
    for (out, needle) in [
        (&file, "exists as a file"),
        (&folder, "not an earlier spikecube result"),
    ] {
        let o = spikecube(&[
            "detect",
            s(&bin),
            "--out",
            s(out),
            "--batch-size",
            "30000",
            "-q",
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(needle), "{err}");
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
    assert_eq!(
        std::fs::read_to_string(folder.join("precious.txt")).unwrap(),
        "mine"
    );
    // An earlier result is replaced.
    let out = d.join("result");
    ok(&spikecube(&[
        "detect",
        s(&bin),
        "--out",
        s(&out),
        "--batch-size",
        "30000",
        "-q",
    ]));
    ok(&spikecube(&[
        "detect",
        s(&bin),
        "--out",
        s(&out),
        "--batch-size",
        "30000",
        "-q",
    ]));
    assert!(out.join("spikecube.json").is_file());
}
