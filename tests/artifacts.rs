//! Stimulus / light artifacts: a simulated recording (`spikecube simulate`,
//! ground truth) with light edges added on every channel, each channel
//! moved by a different amount (so the median reference removes only part
//! of it), in two layouts. Checked: the warning names the right count and
//! the first times; `--artifact-times` and `--blank-transients true` remove
//! the spikes locked to the light and keep the real spikes away from it;
//! bad times files are clear errors; CPU and GPU (wgpu) back ends agree.

mod common;

use common::{Rng, s, spikecube};

use std::path::{Path, PathBuf};
use std::process::Output;

use ndarray::{Array1, Array2};
use spikecube::npy;

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A `n`-site probe in `cols` columns 32 µm apart, rows every 20 µm (Kilosort JSON).
fn write_probe(dir: &Path, n: usize, cols: usize) -> PathBuf {
    let p = dir.join(format!("probe{n}.json"));
    let j = serde_json::json!({
        "chanMap": (0..n).collect::<Vec<_>>(),
        "xc": (0..n).map(|i| 32.0 * (i % cols) as f64).collect::<Vec<_>>(),
        "yc": (0..n).map(|i| 20.0 * (i / cols) as f64).collect::<Vec<_>>(),
        "kcoords": vec![0; n], "n_chan": n,
    });
    std::fs::write(&p, j.to_string()).unwrap();
    p
}

/// A simulated recording with light edges: the file, its ground truth
/// (trough sample, x, y per spike), the edge samples and a text file of their times.
struct Opto {
    bin: PathBuf,
    truth: Array2<f64>,
    edges: Vec<usize>,
    times_file: PathBuf,
    fs: f64,
}

/// Simulates `seconds` on `probe` (`None`: the built-in 384-site probe) and
/// adds a light pulse every 0.25 s (on at 0.1 s + k·0.25 s, off 20 ms later):
/// at each edge every recorded channel jumps by 300–1500 counts (a different
/// amount per channel, opposite signs at on and off) and decays back with a
/// 1-ms time constant.
fn opto(dir: &Path, probe: Option<&Path>, seconds: f64, seed: u64) -> Opto {
    let sim = dir.join("sim");
    let secs = seconds.to_string();
    let seed_s = seed.to_string();
    let mut args = vec![
        "simulate",
        "--seconds",
        &secs,
        "--n-units",
        "12",
        "--rate",
        "8",
        "--seed",
        &seed_s,
        "--out",
        s(&sim),
    ];
    if let Some(p) = probe {
        args.extend(["--probe", s(p)]);
    }
    ok(&spikecube(&args));
    let bin = sim.join("sim_g0_t0.imec0.ap.bin");
    let pj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sim.join("probe.json")).unwrap()).unwrap();
    let n_file = pj["n_chan"].as_u64().unwrap() as usize;
    let n_ap = pj["chanMap"].as_array().unwrap().len();
    let fs = 30_000.0;
    let bytes = std::fs::read(&bin).unwrap();
    let mut x: Vec<i16> = bytes
        .chunks_exact(2)
        .map(|b| i16::from_le_bytes([b[0], b[1]]))
        .collect();
    let n = x.len() / n_file;
    let mut rng = Rng(seed * 7 + 3);
    let amp: Vec<f32> = (0..n_ap)
        .map(|_| 300.0 + 1200.0 * rng.uniform() as f32)
        .collect();
    let mut edges = Vec::new();
    let mut on = (0.1 * fs) as usize;
    while on + (0.03 * fs) as usize <= n {
        edges.push(on);
        edges.push(on + (0.02 * fs) as usize);
        on += (0.25 * fs) as usize;
    }
    for (k, &e) in edges.iter().enumerate() {
        let sign = if k % 2 == 0 { 1.0 } else { -1.0 };
        for t in e..(e + 300).min(n) {
            let decay = (-((t - e) as f32) / 30.0).exp();
            for c in 0..n_ap {
                let v = f32::from(x[t * n_file + c]) + sign * amp[c] * decay;
                x[t * n_file + c] = v.round().clamp(-32768.0, 32767.0) as i16;
            }
        }
    }
    let out: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&bin, out).unwrap();
    let times_file = dir.join("light_times.txt");
    let text: String = edges
        .iter()
        .map(|&e| format!("{}\n", e as f64 / fs))
        .collect();
    std::fs::write(&times_file, format!("# light edges, s\n{text}")).unwrap();
    Opto {
        bin,
        truth: npy::read(&sim.join("ground_truth.npy")).unwrap(),
        edges,
        times_file,
        fs,
    }
}

/// A `detect` run's spikes (time, x, y) and `spikecube.json`.
struct Found {
    t: Vec<i64>,
    pos: Array2<f32>,
    json: serde_json::Value,
}

fn detect(o: &Opto, out: &Path, extra: &[&str]) -> Found {
    let mut args = vec![
        "detect",
        s(&o.bin),
        "--out",
        s(out),
        "-q",
        "--batch-size",
        "30000",
        "--nblocks",
        "0",
    ];
    args.extend_from_slice(extra);
    ok(&spikecube(&args));
    let t: Array1<i64> = npy::read(&out.join("spike_times.npy")).unwrap();
    let json = serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
        .unwrap();
    Found {
        t: t.to_vec(),
        pos: npy::read(&out.join("spike_positions.npy")).unwrap(),
        json,
    }
}

/// Whether detection `i` matches a true spike (trough within 15 samples of
/// detection − 10, position within 50 µm), as tests/detect.rs counts.
fn is_true(f: &Found, i: usize, truth: &Array2<f64>) -> bool {
    truth.rows().into_iter().any(|r| {
        let dt = (f.t[i] - 10) as f64 - r[0];
        let d2 = (f.pos[[i, 0]] as f64 - r[1]).powi(2) + (f.pos[[i, 1]] as f64 - r[2]).powi(2);
        dt.abs() <= 15.0 && d2 <= 2500.0
    })
}

/// Distance in samples from `t` to the nearest edge.
fn to_edge(edges: &[usize], t: f64) -> f64 {
    edges
        .iter()
        .map(|&e| (t - e as f64).abs())
        .fold(f64::MAX, f64::min)
}

/// Detections within 3 ms of an edge that match no true spike (light-locked false spikes).
fn light_locked(f: &Found, o: &Opto) -> usize {
    (0..f.t.len())
        .filter(|&i| to_edge(&o.edges, f.t[i] as f64) <= 0.003 * o.fs && !is_true(f, i, &o.truth))
        .count()
}

/// True spikes more than 5 ms from every edge that a detection matches,
/// and how many such spikes there are.
fn kept_away(f: &Found, o: &Opto) -> (usize, usize) {
    let away: Vec<_> = o
        .truth
        .rows()
        .into_iter()
        .filter(|r| to_edge(&o.edges, r[0]) > 0.005 * o.fs)
        .collect();
    let hit = away
        .iter()
        .filter(|r| {
            (0..f.t.len()).any(|i| {
                let dt = (f.t[i] - 10) as f64 - r[0];
                let d2 =
                    (f.pos[[i, 0]] as f64 - r[1]).powi(2) + (f.pos[[i, 1]] as f64 - r[2]).powi(2);
                dt.abs() <= 15.0 && d2 <= 2500.0
            })
        })
        .count();
    (hit, away.len())
}

fn warnings(f: &Found) -> Vec<String> {
    f.json["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap().to_owned())
        .collect()
}

/// The warning names the count of edges and the first times; blanking at the
/// given times or around the found transients removes the light-locked false
/// spikes and keeps the real spikes away from the light. Two layouts.
#[test]
fn light_artifacts_are_counted_and_blanked() {
    for (layout, seconds) in [(Some((32usize, 2usize)), 4.0), (None, 2.0)] {
        let dir = tempfile::tempdir().unwrap();
        let probe = layout.map(|(n, c)| write_probe(dir.path(), n, c));
        let o = opto(dir.path(), probe.as_deref(), seconds, 11);
        let cpu = ["--backend", "cpu"];
        let plain = detect(&o, &dir.path().join("plain"), &cpu);
        let w = warnings(&plain);
        let tw = w
            .iter()
            .find(|w| w.contains("transient(s) common to most"))
            .unwrap_or_else(|| panic!("{layout:?}: no transient warning in {w:?}"));
        let n_edges = o.edges.len();
        assert!(tw.starts_with(&format!("{n_edges} transient(s)")), "{tw}");
        assert!(
            tw.contains(&format!("{:.4}", o.edges[0] as f64 / o.fs)),
            "{tw}"
        );
        assert!(tw.contains("--blank-transients true"), "{tw}");
        let rec = &plain.json["settings"]["checks"]["transients"];
        assert_eq!(rec["count"].as_u64(), Some(n_edges as u64), "{rec}");
        let times: Vec<f64> = rec["times_s"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        for (t, &e) in times.iter().zip(&o.edges) {
            assert!((t * o.fs - e as f64).abs() <= 2.0, "{t} vs edge {e}");
        }
        let false_plain = light_locked(&plain, &o);
        let (kept_plain, away) = kept_away(&plain, &o);
        eprintln!(
            "{layout:?}: {n_edges} edges, {} detections, {false_plain} light-locked false, {kept_plain}/{away} true spikes away from the light",
            plain.t.len()
        );
        assert!(
            false_plain >= n_edges / 2,
            "{false_plain} light-locked of {n_edges} edges"
        );

        let times_flag = ["--backend", "cpu", "--artifact-times", s(&o.times_file)];
        let given = detect(&o, &dir.path().join("given"), &times_flag);
        let found = detect(
            &o,
            &dir.path().join("found"),
            &["--backend", "cpu", "--blank-transients", "true"],
        );
        for (name, f) in [("--artifact-times", &given), ("--blank-transients", &found)] {
            let false_n = light_locked(f, &o);
            let (kept, away) = kept_away(f, &o);
            eprintln!(
                "{layout:?} {name}: {} detections, {false_n} light-locked false, {kept}/{away} true spikes away from the light",
                f.t.len()
            );
            assert!(
                false_n * 50 <= n_edges,
                "{name}: {false_n} light-locked of {n_edges}"
            );
            // The simulation's own recall is about 0.9 (tests/detect.rs asks
            // 0.8); blanking must lose at most 2 % of it away from the light.
            assert!(kept * 100 >= away * 85, "{name}: {kept} of {away} kept");
            assert!(
                kept + away / 50 >= kept_plain,
                "{name}: {kept} vs {kept_plain} without"
            );
        }
        let b = &found.json["settings"]["checks"]["transients"]["blanking"];
        assert_eq!(b["around_transients"].as_bool(), Some(true), "{b}");
        let b = &given.json["settings"]["checks"]["transients"]["blanking"];
        assert_eq!(b["events_given"].as_u64(), Some(n_edges as u64), "{b}");
        assert_eq!(
            (b["samples_before"].as_u64(), b["samples_after"].as_u64()),
            (Some(15), Some(60))
        );
    }
}

/// Bad times files and windows are clear errors naming the file or flag and
/// the numbers; times outside the recording are warned about and ignored.
#[test]
fn bad_artifact_times_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let probe = write_probe(dir.path(), 16, 2);
    let o = opto(dir.path(), Some(&probe), 1.0, 5);
    let run = |extra: &[&str], out: &str| {
        let mut args = vec![
            "detect",
            s(&o.bin),
            "--out",
            out,
            "-q",
            "--backend",
            "cpu",
            "--nblocks",
            "0",
            "--templates-from-data",
            "false",
        ];
        args.extend_from_slice(extra);
        spikecube(&args)
    };
    let out = dir.path().join("o");
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "0.1\n0.2s\n").unwrap();
    let e = run(&["--artifact-times", s(&bad)], s(&out));
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success()
            && msg.contains("bad.csv")
            && msg.contains("line 2")
            && msg.contains("0.2s"),
        "{msg}"
    );
    let ms = dir.path().join("ms.txt");
    std::fs::write(&ms, "100\n350\n").unwrap();
    let e = run(&["--artifact-times", s(&ms)], s(&out));
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success()
            && msg.contains("ms.txt")
            && msg.contains("none of its 2 times is inside the recording")
            && msg.contains("milliseconds"),
        "{msg}"
    );
    let e = run(&["--artifact-window", "0.5"], s(&out));
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success() && msg.contains("MS_BEFORE,MS_AFTER"),
        "{msg}"
    );
    assert!(!out.exists());
    let some = dir.path().join("some.txt");
    std::fs::write(&some, "0.1 0.35 7.5").unwrap();
    let r = run(&["--artifact-times", s(&some)], s(&out));
    ok(&r);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
            .unwrap();
    let w = json["warnings"].to_string();
    assert!(
        w.contains("some.txt: 1 of 3 times are outside") && w.contains("7.5"),
        "{w}"
    );
    // A spreadsheet's export, with a header and a label column, gives the
    // same times: the same spikes.
    let labelled = dir.path().join("labelled.csv");
    std::fs::write(
        &labelled,
        "\u{feff}time_s,label\n0.1,light on\n0.35,light off\n7.5,light on\n",
    )
    .unwrap();
    let out2 = dir.path().join("o2");
    ok(&run(&["--artifact-times", s(&labelled)], s(&out2)));
    let spikes = |d: &Path| std::fs::read(d.join("spike_times.npy")).unwrap();
    assert_eq!(spikes(&out2), spikes(&out));
    // A row whose time is not a number is refused, naming the line and the text.
    let swapped = dir.path().join("swapped.csv");
    std::fs::write(&swapped, "label,time_s\nlight on,0.1\n").unwrap();
    let e = run(
        &["--artifact-times", s(&swapped)],
        s(&dir.path().join("o3")),
    );
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(
        !e.status.success()
            && msg.contains("swapped.csv")
            && msg.contains("line 2")
            && msg.contains("\"light\""),
        "{msg}"
    );
}

/// `spikecube sort --artifact-times`: the learned-template matching reads the
/// windows again and blanks them as the detection did, so the Phy folder
/// holds no light-locked false spikes either.
#[test]
fn the_sort_blanks_as_the_detection_does() {
    let dir = tempfile::tempdir().unwrap();
    let probe = write_probe(dir.path(), 32, 2);
    let o = opto(dir.path(), Some(&probe), 6.0, 5);
    let sorted = dir.path().join("sorted");
    ok(&spikecube(&[
        "sort",
        s(&o.bin),
        "--out",
        s(&sorted),
        "-q",
        "--backend",
        "cpu",
        "--batch-size",
        "30000",
        "--nblocks",
        "0",
        "--artifact-times",
        s(&o.times_file),
    ]));
    // Phy's spike times are troughs; `is_true` takes detection times (trough + 10).
    let t: Array1<i64> = npy::read(&sorted.join("spike_times.npy")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sorted.join("spikecube.json")).unwrap())
            .unwrap();
    let f = Found {
        t: t.iter().map(|&v| v + 10).collect(),
        pos: npy::read(&sorted.join("spike_positions.npy")).unwrap(),
        json,
    };
    let n_edges = o.edges.len();
    let false_n = light_locked(&f, &o);
    let (kept, away) = kept_away(&f, &o);
    eprintln!(
        "sort --artifact-times: {} spikes, {false_n} light-locked false of {n_edges} edges, {kept}/{away} true spikes away from the light",
        f.t.len()
    );
    assert!(
        false_n * 50 <= n_edges,
        "{false_n} light-locked of {n_edges}"
    );
    assert!(kept * 100 >= away * 70, "{kept} of {away} kept");
    let b = &f.json["settings"]["detection"]["checks"]["transients"]["blanking"];
    assert_eq!(b["events_given"].as_u64(), Some(n_edges as u64), "{b}");
}

/// The GPU back end (wgpu; lavapipe in CI) finds the same transients in its
/// int16 windows as the CPU in its f32 ones, and with blanking (which
/// preprocesses on the host for every back end) writes the same spikes.
#[cfg(feature = "wgpu")]
#[test]
fn blanking_gives_the_same_spikes_on_cpu_and_wgpu() {
    crate::common::require_vulkan();
    let dir = tempfile::tempdir().unwrap();
    let probe = write_probe(dir.path(), 32, 2);
    let o = opto(dir.path(), Some(&probe), 2.0, 23);
    let blank = [
        "--artifact-times",
        s(&o.times_file),
        "--blank-transients",
        "true",
    ];
    for (name, extra) in [("plain", &[][..]), ("blanked", &blank[..])] {
        let mut found = Vec::new();
        for b in ["cpu", "wgpu"] {
            let mut args = vec!["--backend", b, "--templates-from-data", "false"];
            args.extend_from_slice(extra);
            found.push(detect(&o, &dir.path().join(format!("{name}_{b}")), &args));
        }
        let (c, g) = (&found[0], &found[1]);
        let tr = |f: &Found| f.json["settings"]["checks"]["transients"].clone();
        assert_eq!(tr(c)["count"], tr(g)["count"], "{name}");
        assert_eq!(tr(c)["times_s"], tr(g)["times_s"], "{name}");
        assert_eq!(
            tr(c)["count"].as_u64(),
            Some(o.edges.len() as u64),
            "{name}"
        );
        if name == "blanked" {
            assert_eq!(c.t, g.t, "{name}: spike times differ between cpu and wgpu");
            assert_eq!(light_locked(g, &o), 0, "{name}");
            assert_eq!(
                g.json["settings"]["preprocessing_on"].as_str(),
                Some("host")
            );
        }
    }
}

/// `spikecube preprocess --artifact-times` writes `temp_wh.dat` with every
/// site zero over the window around each event, and only there.
#[test]
fn preprocess_writes_the_blanked_stretches_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let probe = write_probe(dir.path(), 16, 2);
    let o = opto(dir.path(), Some(&probe), 1.0, 9);
    let out = dir.path().join("pre");
    ok(&spikecube(&[
        "preprocess",
        s(&o.bin),
        "--out",
        s(&out),
        "-q",
        "--float32",
        "--batch-size",
        "15000",
        "--artifact-times",
        s(&o.times_file),
        "--artifact-window",
        "1,3",
    ]));
    let bytes = std::fs::read(out.join("temp_wh.dat")).unwrap();
    let v: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let n_sites = 16;
    let n = v.len() / n_sites;
    let (before, after) = (30usize, 90usize);
    let blanked = |t: usize| o.edges.iter().any(|&e| t + before >= e && t < e + after);
    for t in 0..n {
        let row = &v[t * n_sites..(t + 1) * n_sites];
        if blanked(t) {
            assert!(row.iter().all(|&x| x == 0.0), "sample {t}: {row:?}");
        } else {
            assert!(row.iter().any(|&x| x != 0.0), "sample {t} zeroed");
        }
    }
}

/// An `--artifact-window` typed in microseconds or samples (seconds long),
/// and event stretches that blank most of the recording, are warned about.
#[test]
fn blanking_most_of_the_recording_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let sim = dir.path().join("sim");
    let o = common::spikecube(&[
        "simulate",
        "--seconds",
        "4",
        "--n-units",
        "4",
        "--out",
        common::s(&sim),
        "-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let times = dir.path().join("events.csv");
    std::fs::write(&times, "1\n2\n3\n").unwrap();
    let out = dir.path().join("out");
    let o = common::spikecube(&[
        "detect",
        common::s(&sim.join("sim_g0_t0.imec0.ap.bin")),
        "--artifact-times",
        common::s(&times),
        "--artifact-window=500,2000",
        "--nblocks",
        "0",
        "--templates-from-data",
        "false",
        "--backend",
        "cpu",
        "--out",
        common::s(&out),
        "-q",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("blanks 2.5 s around each event"), "{err}");
    assert!(err.contains("% of the recording"), "{err}");
}
