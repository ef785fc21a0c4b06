//! `spikecube sort` end to end on the CPU back end: the 30-s 32-site
//! simulation of `tests/data/sort/sim32` (regenerated from its seed), sorted
//! into a Phy folder whose files have Kilosort4's names, dtypes and shapes,
//! whose units recover the simulated ones, and whose bytes do not depend on
//! the number of threads or of windows matched at once.

mod common;

use std::path::{Path, PathBuf};

use common::{s, spikecube};
use ndarray::{Array1, Array2};
use spikecube::npy;

fn simulate(dir: &Path) -> PathBuf {
    common::simulate32(dir, "30", "36", "7")
}

fn sort(rec: &Path, out: &Path, threads: &str) {
    sort_with(rec, out, threads, &[]);
}

/// [`sort`] with environment settings.
fn sort_with(rec: &Path, out: &Path, threads: &str, env: &[(&str, &str)]) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_spikecube"))
        .args([
            "sort",
            s(&rec.join("sim_g0_t0.imec0.ap.bin")),
            "--backend",
            "cpu",
            "--threads",
            threads,
            "--out",
            s(out),
            "-q",
        ])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "sort failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A 2-s, 4-unit simulation of the default probe in `dir/sim` (its folder).
fn simulate_short(dir: &Path) -> PathBuf {
    let rec = dir.join("sim");
    let o = spikecube(&[
        "simulate",
        "--seconds",
        "2",
        "--n-units",
        "4",
        "--out",
        s(&rec),
        "-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    rec
}

/// Fraction of the simulated unit's spikes that the best-matching sorted unit
/// holds within ±12 samples (0.4 ms), and that unit's precision.
fn best_match(gt: &[i64], times: &[i64], clu: &[i32], n_units: usize) -> (f64, f64) {
    let mut best = (0.0, 0.0);
    for u in 0..n_units as i32 {
        let t: Vec<i64> = times
            .iter()
            .zip(clu)
            .filter(|(_, c)| **c == u)
            .map(|(t, _)| *t)
            .collect();
        let mut hits = 0usize;
        let mut j = 0usize;
        for &g in gt {
            while j < t.len() && t[j] < g - 12 {
                j += 1;
            }
            if j < t.len() && (t[j] - g).abs() <= 12 {
                hits += 1;
                j += 1;
            }
        }
        let recall = hits as f64 / gt.len().max(1) as f64;
        let precision = hits as f64 / t.len().max(1) as f64;
        if recall * precision > best.0 * best.1 {
            best = (recall, precision);
        }
    }
    best
}

#[test]
fn sort_writes_a_phy_folder_that_finds_the_simulated_units() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate(dir.path());
    let out = dir.path().join("sorted");
    sort(&rec, &out, "2");
    for f in [
        "params.py",
        "spike_times.npy",
        "spike_clusters.npy",
        "spike_templates.npy",
        "spike_detection_templates.npy",
        "amplitudes.npy",
        "templates.npy",
        "templates_ind.npy",
        "similar_templates.npy",
        "pc_features.npy",
        "pc_feature_ind.npy",
        "whitening_mat.npy",
        "whitening_mat_inv.npy",
        "channel_map.npy",
        "channel_positions.npy",
        "cluster_KSLabel.tsv",
        "cluster_group.tsv",
        "cluster_ContamPct.tsv",
        "cluster_Amplitude.tsv",
        "spikecube.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let times: Array1<i64> = npy::read(&out.join("spike_times.npy")).unwrap();
    let clu: Array1<i32> = npy::read(&out.join("spike_clusters.npy")).unwrap();
    let n_units = clu.iter().copied().max().unwrap() as usize + 1;
    assert!(
        times.windows(2).into_iter().all(|w| w[0] <= w[1]),
        "spike times not sorted"
    );
    // Ground truth: float64 (n, 4) rows of (trough sample, unit x, unit y,
    // amplitude); a unit is one (x, y).
    let gt: Array2<f64> = npy::read(&rec.join("ground_truth.npy")).unwrap();
    let mut units: std::collections::BTreeMap<(u64, u64), Vec<i64>> = Default::default();
    for r in gt.rows() {
        units
            .entry((r[1].to_bits(), r[2].to_bits()))
            .or_default()
            .push(r[0] as i64);
    }
    let n_true = units.len();
    let mut well = 0;
    for g in units.values() {
        let (r, p) = best_match(
            g,
            times.as_slice().unwrap(),
            clu.as_slice().unwrap(),
            n_units,
        );
        if r >= 0.8 && p >= 0.8 {
            well += 1;
        }
    }
    eprintln!(
        "{n_units} units; {well} of {n_true} simulated units found with recall and precision ≥ 0.8"
    );
    assert!(
        well * 10 >= n_true * 8,
        "only {well} of {n_true} simulated units well sorted"
    );

    // The first PC feature of a trough-first spike is positive on its unit's
    // first site, as Phy's depth estimate needs (phylib keeps the positive
    // first features); `tests/learned.rs` checks learned wPCA for the same sign.
    let pcs: ndarray::Array3<f32> = npy::read(&out.join("pc_features.npy")).unwrap();
    let positive = pcs.outer_iter().filter(|spike| spike[[0, 0]] > 0.0).count();
    assert!(
        positive * 10 >= pcs.shape()[0] * 9,
        "only {positive} of {} spikes have a positive first PC feature on their unit's first site",
        pcs.shape()[0]
    );

    // The same folder with 1 thread, and with three windows matched at once.
    let out1 = dir.path().join("sorted1");
    sort(&rec, &out1, "1");
    let out3 = dir.path().join("sorted_windows3");
    sort_with(&rec, &out3, "2", &[("SPIKECUBE_MATCH_WINDOWS", "3")]);
    for (other, what) in [
        (&out1, "1 thread"),
        (&out3, "three windows matched at once"),
    ] {
        for e in std::fs::read_dir(&out).unwrap() {
            let name = e.unwrap().file_name();
            if name == "spikecube.json" {
                continue;
            }
            let a = std::fs::read(out.join(&name)).unwrap();
            let b = std::fs::read(other.join(&name)).unwrap();
            assert!(
                a == b,
                "{} differs between 2 threads and {what}",
                name.to_string_lossy()
            );
        }
    }
}

/// An `--out` that cannot take the Phy folder (another subcommand's result, a
/// user's file inside) is refused before any data is read: no detection
/// warning is printed and nothing is written beside it.
#[test]
fn an_unusable_output_folder_is_refused_before_detection() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let bin = rec.join("sim_g0_t0.imec0.ap.bin");
    let mine = dir.path().join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), "a user's notes").unwrap();
    let o = spikecube(&["sort", s(&bin), "--out", s(&mine), "--backend", "cpu"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("notes.txt") && err.contains("nothing was changed"),
        "{err}"
    );
    // The detection stage never started: it logs its windows and back end first.
    assert!(
        !err.contains("windows of") && !err.contains("detection on"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(mine.join("notes.txt")).unwrap(),
        "a user's notes"
    );
    // --drift-only stops before anything is sorted: refused, pointing at detect.
    let o = spikecube(&[
        "sort",
        s(&bin),
        "--out",
        s(&dir.path().join("drift")),
        "--backend",
        "cpu",
        "--drift-only",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("--drift-only") && err.contains("spikecube detect"),
        "{err}"
    );
    // An --out inside a file: the error names that --out, not the sort's
    // hidden working folder.
    let inside_file = mine.join("notes.txt").join("sorted");
    let o = spikecube(&[
        "sort",
        s(&bin),
        "--out",
        s(&inside_file),
        "--backend",
        "cpu",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains(s(&inside_file)) && !err.contains("spikecube-detection"),
        "{err}"
    );
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

/// `params.py` tells Phy how to read the raw file, so it names the samples as
/// they were read: a SpikeGLX file is int16 with no header whatever `--dtype`
/// and `--offset` say (both warned about, in `spikecube.json` too), and a flat
/// binary file read past a header of `--offset` bytes gets that offset (and
/// the same spikes as the SpikeGLX file it was made from).
#[test]
fn params_py_names_the_raw_file_as_it_was_read() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let bin = rec.join("sim_g0_t0.imec0.ap.bin");
    let glx = dir.path().join("glx");
    let o = spikecube(&[
        "sort",
        s(&bin),
        "--dtype",
        "float32",
        "--offset",
        "100",
        "--backend",
        "cpu",
        "--out",
        s(&glx),
        "-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let params = std::fs::read_to_string(glx.join("params.py")).unwrap();
    assert!(
        params.contains("dtype = 'int16'") && params.contains("offset = 0\n"),
        "{params}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(glx.join("spikecube.json")).unwrap())
            .unwrap();
    assert_eq!(json["input"]["dtype"], "int16");
    assert_eq!(json["input"]["offset"], 0);
    let warnings = json["warnings"].to_string();
    // A 2-s recording is too short for the refractory test: that warning,
    // made once the units are labelled, is in the folder's record too.
    assert_eq!(
        json["counts"]["good"] == 0,
        warnings.contains("passed the refractory test"),
        "{warnings}"
    );
    assert!(
        warnings.contains("--dtype float32 was given")
            && warnings.contains("--offset 100 was given"),
        "{warnings}"
    );
    // The same samples behind a 64-byte header, read as flat binary.
    let mut bytes = vec![0u8; 64];
    bytes.extend(std::fs::read(&bin).unwrap());
    let flat = dir.path().join("flat.dat");
    std::fs::write(&flat, bytes).unwrap();
    let out = dir.path().join("flat_sorted");
    let o = spikecube(&[
        "sort",
        s(&flat),
        "--n-channels",
        "385",
        "--fs",
        "30000",
        "--offset",
        "64",
        "--probe",
        s(&rec.join("probe.json")),
        "--backend",
        "cpu",
        "--out",
        s(&out),
        "-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let params = std::fs::read_to_string(out.join("params.py")).unwrap();
    assert!(
        params.contains("dtype = 'int16'") && params.contains("offset = 64\n"),
        "{params}"
    );
    assert_eq!(
        std::fs::read(out.join("spike_times.npy")).unwrap(),
        std::fs::read(glx.join("spike_times.npy")).unwrap(),
        "the flat file's spikes"
    );
}

/// Runs `spikecube sort` with `args` (the CPU back end, quiet) and returns
/// its output, asserting success.
fn sort_args(args: &[&str]) -> std::process::Output {
    let mut all = vec!["sort"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--backend", "cpu", "-q"]);
    let o = spikecube(&all);
    assert!(
        o.status.success(),
        "sort {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// A tetrode has fewer sites than `nearest_chans` (10): detection and the
/// matching both use its 4 (README's locust example, sorted).
#[test]
fn a_tetrode_sorts_with_nearest_chans_lowered_to_its_sites() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("locust_sorted");
    let raw = common::data("data/real/locust_tetrode_tridesclous/locust_trial_01.raw");
    let probe = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/probes/locust_tetrode.json");
    sort_args(&[
        s(&raw),
        "--n-channels",
        "4",
        "--fs",
        "15000",
        "--probe",
        s(&probe),
        "--do-car",
        "false",
        "--out",
        s(&out),
    ]);
    let times: Array1<i64> = npy::read(&out.join("spike_times.npy")).unwrap();
    assert!(!times.is_empty());
    let ind: Array2<u32> = npy::read(&out.join("pc_feature_ind.npy")).unwrap();
    assert_eq!(
        ind.ncols(),
        4,
        "each unit's features on the tetrode's 4 sites"
    );
}

/// `--n-pcs` below 6: the features, the matching and the export use that many
/// components.
#[test]
fn fewer_pcs_sort_with_that_many_features() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let out = dir.path().join("pcs3");
    sort_args(&[
        s(&rec.join("sim_g0_t0.imec0.ap.bin")),
        "--n-pcs",
        "3",
        "--out",
        s(&out),
    ]);
    let pcs: ndarray::Array3<f32> = npy::read(&out.join("pc_features.npy")).unwrap();
    assert_eq!(pcs.dim().1, 3, "pc_features is (n, n_pcs, sites)");
}

/// With `--tmin`, spike times still count from the file's first sample, as
/// `detect`'s do and as `params.py` (the whole file) needs: the events of a
/// sort from 0.5 s are those of the whole recording's sort at the same samples.
#[test]
fn tmin_spike_times_count_from_the_files_first_sample() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let bin = rec.join("sim_g0_t0.imec0.ap.bin");
    let (whole, late) = (dir.path().join("whole"), dir.path().join("late"));
    sort_args(&[s(&bin), "--out", s(&whole)]);
    sort_args(&[s(&bin), "--tmin", "0.5", "--out", s(&late)]);
    let all: Array1<i64> = npy::read(&whole.join("spike_times.npy")).unwrap();
    let part: Array1<i64> = npy::read(&late.join("spike_times.npy")).unwrap();
    assert!(!part.is_empty());
    assert!(part.iter().all(|&t| t >= 15_000), "from sample 15 000 on");
    let near = part
        .iter()
        .filter(|&&t| all.iter().any(|&u| (u - t).abs() <= 3))
        .count();
    assert!(
        near * 10 >= part.len() * 9,
        "{near} of {} within 3 samples of the whole sort's",
        part.len()
    );
}

/// Several files sorted as one recording: `params.py` lists every file, in
/// order, so that Phy reads the whole recording.
#[test]
fn params_py_lists_every_file_of_a_concatenated_recording() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let bytes = std::fs::read(rec.join("sim_g0_t0.imec0.ap.bin")).unwrap();
    let frame = 385 * 2;
    let half = (bytes.len() / frame / 2) * frame;
    let (a, b) = (dir.path().join("part1.bin"), dir.path().join("part2.bin"));
    std::fs::write(&a, &bytes[..half]).unwrap();
    std::fs::write(&b, &bytes[half..]).unwrap();
    let out = dir.path().join("two");
    sort_args(&[
        s(&a),
        s(&b),
        "--n-channels",
        "385",
        "--fs",
        "30000",
        "--probe",
        s(&rec.join("probe.json")),
        "--out",
        s(&out),
    ]);
    let params = std::fs::read_to_string(out.join("params.py")).unwrap();
    let line = params
        .lines()
        .find(|l| l.starts_with("dat_path"))
        .unwrap_or_default();
    let (pa, pb) = (
        std::fs::canonicalize(&a).unwrap(),
        std::fs::canonicalize(&b).unwrap(),
    );
    let (ia, ib) = (
        line.find(pa.to_str().unwrap()),
        line.find(pb.to_str().unwrap()),
    );
    assert!(ia.is_some() && ib.is_some() && ia < ib, "{line}");
}

/// A setting of the stages after detection that cannot work fails before any
/// data is read, naming the flag; negative numbers are values, not flags.
#[test]
fn sort_settings_are_checked_before_detection() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let bin = rec.join("sim_g0_t0.imec0.ap.bin");
    for (flag, value) in [
        ("--max-peels", "0"),
        ("--th-learned", "-3"),
        ("--cluster-neighbors", "0"),
        ("--ccg-threshold", "nan"),
        ("--same-template-amplitude-ratio", "1.5"),
        ("--same-template-amplitude-ratio", "-0.1"),
    ] {
        let out = dir.path().join("refused");
        let o = spikecube(&[
            "sort",
            s(&bin),
            flag,
            value,
            "--backend",
            "cpu",
            "--out",
            s(&out),
            "-q",
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{flag} {value} was accepted");
        assert!(err.contains(flag), "{flag} {value}: {err}");
        assert!(!err.contains("detection"), "refused after detection: {err}");
        assert!(!out.exists());
    }
}

/// What the reader finds when opening the file (a partial last frame, a size
/// the metadata contradicts, a rate it overrides) is a run warning: in
/// `spikecube.json`, and printed once when found and once in the closing list.
#[test]
fn the_readers_warnings_are_kept_in_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let glx = dir.path().join("cut");
    std::fs::create_dir(&glx).unwrap();
    let bytes = std::fs::read(rec.join("sim_g0_t0.imec0.ap.bin")).unwrap();
    let bin = glx.join("x_g0_t0.imec0.ap.bin");
    std::fs::write(&bin, &bytes[..bytes.len() - 385 * 2 * 1000 + 51]).unwrap();
    std::fs::copy(
        rec.join("sim_g0_t0.imec0.ap.meta"),
        glx.join("x_g0_t0.imec0.ap.meta"),
    )
    .unwrap();
    let out = dir.path().join("sorted");
    let o = spikecube(&[
        "sort",
        s(&bin),
        "--fs",
        "25000",
        "--backend",
        "cpu",
        "--out",
        s(&out),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
            .unwrap();
    let warnings = json["warnings"].to_string();
    for what in [
        "bytes after the last whole frame",
        "declares fileSizeBytes",
        "fs = 25000 Hz was given",
    ] {
        assert!(warnings.contains(what), "{what}: {warnings}");
        assert!(
            err.matches(what).count() <= 2,
            "{what} printed more than twice: {err}"
        );
    }
}

/// A probe whose `n_chan` exceeds the file's channel count (`--n-channels`
/// too small, or another recording's probe), or that declares a file width
/// (columns past its last site) and the file is wider, is named in a warning.
#[test]
fn a_probe_for_another_channel_count_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let mut probe: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(rec.join("probe.json")).unwrap()).unwrap();
    probe["n_chan"] = serde_json::json!(386);
    let wide = dir.path().join("probe386.json");
    std::fs::write(&wide, probe.to_string()).unwrap();
    let flat = dir.path().join("flat.bin");
    std::fs::copy(rec.join("sim_g0_t0.imec0.ap.bin"), &flat).unwrap();
    // `detect` of the flat file read as `n_channels` columns with `probe`
    // into `out`: its warnings.
    let detect = |n_channels: &str, probe: &Path, out: &str| {
        let o = spikecube(&[
            "detect",
            s(&flat),
            "--n-channels",
            n_channels,
            "--fs",
            "30000",
            "--probe",
            s(probe),
            "--backend",
            "cpu",
            "--out",
            s(&dir.path().join(out)),
            "-q",
        ]);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        err
    };
    let err = detect("385", &wide, "det");
    assert!(err.contains("n_chan = 386 channels"), "{err}");
    // The file read as wider than the probe's declared 385 columns (384 sites
    // and the sync column): 385 × 60 000 values are also 400 × 57 750.
    let err = detect("400", &rec.join("probe.json"), "det400");
    assert!(
        err.contains("n_chan = 385 channels") && err.contains("has 400"),
        "{err}"
    );
    // Not also "give a probe that covers" the other columns: the width is wrong.
    assert!(!err.contains("give a probe that covers"), "{err}");
    // Kilosort's own convention, n_chan = the number of sites (384), declares
    // no column past the last site: no such warning for the 385-column file.
    probe["n_chan"] = serde_json::json!(384);
    let ks = dir.path().join("probe_ks.json");
    std::fs::write(&ks, probe.to_string()).unwrap();
    let err = detect("385", &ks, "det_ks");
    assert!(!err.contains("describes a file of"), "{err}");
}

/// A sort's folder whose `cluster_group.tsv` someone edited (curation by hand
/// or by a tool that leaves no `.phy` folder) is not replaced by a new sort.
#[test]
fn curated_labels_are_not_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let rec = simulate_short(dir.path());
    let bin = rec.join("sim_g0_t0.imec0.ap.bin");
    let out = dir.path().join("sorted");
    sort_args(&[s(&bin), "--out", s(&out)]);
    // The same sort again replaces its own folder.
    sort_args(&[s(&bin), "--out", s(&out)]);
    let group = out.join("cluster_group.tsv");
    let text = std::fs::read_to_string(&group).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let (id, label) = lines[1].split_once('\t').unwrap();
    let flipped = if label == "good" { "noise" } else { "good" };
    lines[1] = format!("{id}\t{flipped}");
    let curated = lines.join("\n") + "\n";
    std::fs::write(&group, &curated).unwrap();
    let o = spikecube(&["sort", s(&bin), "--backend", "cpu", "--out", s(&out), "-q"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a curated folder was replaced");
    assert!(err.contains("curation") && err.contains("1 unit"), "{err}");
    assert_eq!(std::fs::read_to_string(&group).unwrap(), curated);
}

/// A probe left with one site (here by `--exclude-channels`) cannot take a
/// median common reference (it would zero every sample): refused, naming
/// `--do-car false`, which then runs.
#[test]
fn one_site_with_car_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let rec = common::data(
        "data/real/openephys_example_16ch/binary_format/Record Node 101/experiment1/recording1",
    );
    let probe =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/probes/openephys_16ch_linear.json");
    let run = |car: &str, out: &str| {
        spikecube(&[
            "detect",
            s(&rec),
            "--probe",
            s(&probe),
            "--exclude-channels",
            "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
            "--do-car",
            car,
            "--backend",
            "cpu",
            "--out",
            s(&dir.path().join(out)),
            "-q",
        ])
    };
    let o = run("true", "car");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--do-car false"),
        "{err}"
    );
    assert!(!dir.path().join("car").exists());
    let o = run("false", "nocar");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
