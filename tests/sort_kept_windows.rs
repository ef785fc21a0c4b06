//! The sort keeps the detection pass's preprocessed windows where they were
//! made — on the GPU, or in host memory — for the learned-template matching
//! (`--keep-windows-gb`). Whatever the budget (none kept, some, all) the Phy
//! folder's arrays are the same bytes: a kept window holds the bits the same
//! preprocessing of that raw window gives, and the windows read again are
//! masked (stuck stretches) as the detection pass masked them. On the CPU
//! and on wgpu (Mesa's lavapipe in CI), on a 10-s 32-site simulation with a
//! stuck stretch on one channel.

mod common;

use std::path::{Path, PathBuf};

use common::{s, spikecube};

/// A 10-s 32-site simulation (5 windows) whose channel 5 is stuck at one
/// value for 600 samples inside window 2, and its SpikeGLX binary.
fn simulate(dir: &Path) -> PathBuf {
    let out = common::simulate32(dir, "10", "24", "11");
    let bin = out.join("sim_g0_t0.imec0.ap.bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    let n_chan = bytes.len() / 2 / 300_000;
    assert_eq!(bytes.len(), n_chan * 2 * 300_000, "10 s at 30 kHz");
    for t in 130_000..130_600 {
        let at = (t * n_chan + 5) * 2;
        bytes[at..at + 2].copy_from_slice(&1234i16.to_le_bytes());
    }
    std::fs::write(&bin, bytes).unwrap();
    bin
}

/// Sorts `bin` on `backend` with `--keep-windows-gb gb` and the flags
/// `extra` into `out`; returns the log line saying how many windows the
/// matching found kept, and the one saying how many windows the detection
/// pass did not read (empty when it read them all).
fn sort(bin: &Path, out: &Path, backend: &str, gb: &str, extra: &[&str]) -> (String, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_spikecube"))
        .args([
            "sort",
            s(bin),
            "--backend",
            backend,
            "--keep-windows-gb",
            gb,
            "--out",
            s(out),
            "-q",
        ])
        .args(extra)
        .env("SPIKECUBE_LOG", "spikecube=info,spikecube::stages=debug")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "sort failed: {err}");
    let line = |f: &dyn Fn(&str) -> bool| err.lines().find(|l| f(l)).unwrap_or("").to_string();
    (
        line(&|l| {
            l.contains("kept on the device by the detection pass")
                || l.contains("kept in host memory by the detection pass")
        }),
        line(&|l| l.contains("windows not read")),
    )
}

const ARRAYS: [&str; 9] = [
    "spike_times.npy",
    "spike_clusters.npy",
    "spike_templates.npy",
    "spike_detection_templates.npy",
    "amplitudes.npy",
    "templates.npy",
    "pc_features.npy",
    "pc_feature_ind.npy",
    "similar_templates.npy",
];

/// Sorts with budgets for none, two and all five windows and checks the
/// folders' arrays and input checks are the same; `kept` says which log
/// line each run must print (`None`: none, as when nothing is kept in host
/// memory) and `unread` how many windows the detection pass must not have
/// read (kept after their high-pass in the first pass, which checked them).
/// `extra`: more flags for every run, given the temporary folder.
fn same_whatever_kept(
    backend: &str,
    kept: [Option<&str>; 3],
    unread: [u64; 3],
    extra: &dyn Fn(&Path) -> Vec<String>,
) {
    let dir = tempfile::tempdir().unwrap();
    let bin = simulate(dir.path());
    let extra = extra(dir.path());
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    // A window is 32 × 60 122 f32 = 7.7 MB: 0.02 GB holds two of the five.
    let mut outs = Vec::new();
    let mut checks = Vec::new();
    for ((gb, kept), unread) in ["0", "0.02", "1"].into_iter().zip(kept).zip(unread) {
        let out = dir.path().join(format!("out_{gb}"));
        let (line, not_read) = sort(&bin, &out, backend, gb, &extra);
        match kept {
            Some(k) => assert!(line.contains(k), "--keep-windows-gb {gb}: {line:?}"),
            None => assert!(line.is_empty(), "--keep-windows-gb {gb}: {line:?}"),
        }
        match unread {
            0 => assert!(not_read.is_empty(), "--keep-windows-gb {gb}: {not_read:?}"),
            n => assert!(
                not_read.contains(&format!(" {n} windows not read")),
                "--keep-windows-gb {gb}: {not_read:?}"
            ),
        }
        // spikecube.json says how many windows were kept, and where.
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
                .unwrap();
        let m = &json["matching"];
        let n_kept = kept.map_or(0, |k| k.split(' ').next().unwrap().parse::<u64>().unwrap());
        assert_eq!(m["windows"], 5, "{m}");
        assert_eq!(m["windows_kept"], n_kept, "{m}");
        // The input checks found the stuck stretch (masked), whichever pass
        // ran them.
        let c = &json["settings"]["detection"]["checks"];
        assert!(c["clipped_samples_masked"].as_u64().unwrap() > 0, "{c}");
        checks.push((c.clone(), json["detection_warnings"].clone()));
        let place = if backend == "cpu" { "host" } else { backend };
        assert_eq!(
            m["kept_in"],
            if n_kept > 0 {
                serde_json::json!(place)
            } else {
                serde_json::Value::Null
            },
            "{m}"
        );
        outs.push(out);
    }
    let n_spikes = std::fs::metadata(outs[0].join("spike_times.npy"))
        .unwrap()
        .len();
    assert!(n_spikes > 1000, "spike_times.npy is {n_spikes} bytes");
    for c in &checks[1..] {
        assert_eq!(c, &checks[0], "the input checks differ between budgets");
    }
    for name in ARRAYS {
        let a = std::fs::read(outs[0].join(name)).unwrap();
        for o in &outs[1..] {
            assert!(
                a == std::fs::read(o.join(name)).unwrap(),
                "{name} differs between {} and {}",
                outs[0].display(),
                o.display()
            );
        }
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn the_sort_is_the_same_whatever_the_windows_kept_on_the_device() {
    common::require_vulkan();
    same_whatever_kept(
        "wgpu",
        [Some("0 of 5"), Some("2 of 5"), Some("5 of 5")],
        [0, 2, 5],
        &|_| Vec::new(),
    );
}

/// The CPU and a GPU back end sort to the same bytes: the device kernels run
/// the CPU's arithmetic (`detect::gpu::exact`, the f64 IIR high-pass, the f64
/// covariance in the CPU's blocks). On lavapipe here; on CUDA measured in
/// BENCHMARKS.md on the 10-minute 384-site simulation.
#[cfg(feature = "wgpu")]
#[test]
fn the_cpu_and_wgpu_sorts_are_the_same_bytes() {
    common::require_vulkan();
    let dir = tempfile::tempdir().unwrap();
    let bin = simulate(dir.path());
    let cpu = dir.path().join("cpu");
    let gpu = dir.path().join("wgpu");
    sort(&bin, &cpu, "cpu", "0", &[]);
    sort(&bin, &gpu, "wgpu", "0", &[]);
    let n_spikes = std::fs::metadata(cpu.join("spike_times.npy"))
        .unwrap()
        .len();
    assert!(n_spikes > 1000, "spike_times.npy is {n_spikes} bytes");
    let more = [
        "whitening_mat.npy",
        "spike_positions.npy",
        "cluster_KSLabel.tsv",
        "cluster_ContamPct.tsv",
    ];
    for name in ARRAYS.iter().chain(&more) {
        assert!(
            std::fs::read(cpu.join(name)).unwrap() == std::fs::read(gpu.join(name)).unwrap(),
            "{name} differs between the CPU and wgpu"
        );
    }
}

/// On the CPU the windows kept after their high-pass in the first pass are
/// not read again either.
#[test]
fn the_sort_is_the_same_whatever_the_windows_kept_in_host_memory() {
    same_whatever_kept(
        "cpu",
        [None, Some("2 of 5"), Some("5 of 5")],
        [0, 2, 5],
        &|_| Vec::new(),
    );
}

/// With stimulus artifacts blanked: a window kept after its high-pass keeps
/// the stretches found in its raw values, zeroed after its whitening in the
/// second pass as in the first.
#[test]
fn blanked_stretches_are_the_same_whatever_the_windows_kept_in_host_memory() {
    same_whatever_kept(
        "cpu",
        [None, Some("2 of 5"), Some("5 of 5")],
        [0, 2, 5],
        &|dir| {
            // In windows 0, 1 and 3 (2 s each).
            let times = dir.join("artifacts.txt");
            std::fs::write(&times, "0.5\n3.1\n7.25\n").unwrap();
            vec!["--artifact-times".into(), s(&times).into()]
        },
    );
}

#[test]
fn a_negative_budget_is_refused() {
    for args in [
        &["--keep-windows-gb=-1"][..],
        &["--keep-windows-gb", "-1"],
        &["--keep-windows-gb", "nan"],
    ] {
        let o = spikecube(&[&["sort", "x.bin"][..], args].concat());
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("--keep-windows-gb") && err.contains("not a size in GB"),
            "{err}"
        );
    }
}

/// A budget past the memory left is cut to it, and the warning saying so
/// is one of the run's warnings (the end-of-run list and `spikecube.json`),
/// not only a log line; the sort is the one keeping every window.
#[test]
fn a_budget_past_the_memory_left_is_cut_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let bin = simulate(dir.path());
    let (all, huge) = (dir.path().join("all"), dir.path().join("huge"));
    let (line, _) = sort(&bin, &all, "cpu", "1", &[]);
    assert!(line.contains("5 of 5"), "{line:?}");
    let (line, _) = sort(&bin, &huge, "cpu", "1e9", &[]);
    assert!(line.contains("5 of 5"), "{line:?}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(huge.join("spikecube.json")).unwrap())
            .unwrap();
    let warnings = json["warnings"].as_array().unwrap();
    assert_eq!(
        warnings
            .iter()
            .filter(|w| w
                .as_str()
                .unwrap()
                .contains("--keep-windows-gb 1000000000.0 is more than 80 %"))
            .count(),
        1,
        "{warnings:?}"
    );
    for name in ARRAYS {
        assert!(
            std::fs::read(all.join(name)).unwrap() == std::fs::read(huge.join(name)).unwrap(),
            "{name} differs"
        );
    }
}
