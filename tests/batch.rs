//! `spikecube batch plan | task | collect` without a job engine: the manifest
//! is written once and its flags checked at plan time; a task's output equals
//! a plain `spikecube detect` byte for byte (every file but spikecube.json)
//! and records its provenance; a complete task is skipped; collect names the
//! tasks that are missing, failed or half-written.

mod common;

use common::{s, spikecube};

use std::path::{Path, PathBuf};
use std::process::Output;

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Two 1-s simulated 32-site recordings, `a/sim…bin` and `b/sim…bin`, and the probe.
fn recordings(dir: &Path) -> (Vec<PathBuf>, PathBuf) {
    let probe = dir.join("probe32.json");
    let xc: Vec<f32> = (0..32).map(|i| 32.0 * (i % 2) as f32).collect();
    let yc: Vec<f32> = (0..32).map(|i| 20.0 * (i / 2) as f32).collect();
    let j = serde_json::json!({"chanMap": (0..32).collect::<Vec<_>>(), "xc": xc, "yc": yc, "kcoords": vec![0; 32], "n_chan": 32});
    std::fs::write(&probe, j.to_string()).unwrap();
    let recs = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let out = dir.join(name);
            ok(&spikecube(&[
                "simulate",
                "-q",
                "--probe",
                s(&probe),
                "--seconds",
                "1",
                "--n-units",
                "4",
                "--seed",
                &i.to_string(),
                "--out",
                s(&out),
            ]));
            out.join("sim_g0_t0.imec0.ap.bin")
        })
        .collect();
    (recs, probe)
}

/// Every file of a folder but spikecube.json, with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != "spikecube.json")
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn json(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("spikecube.json")).unwrap()).unwrap()
}

const NAMES: [&str; 2] = ["a_sim_g0_t0.imec0.ap", "b_sim_g0_t0.imec0.ap"];

#[test]
fn plan_task_collect_equal_plain_detect_and_skip_complete_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let (recs, probe) = recordings(dir.path());
    let run = dir.path().join("run");
    let plan = |extra: &[&str]| {
        let mut a = vec!["batch", "plan", s(&recs[0]), s(&recs[1]), "--out", s(&run)];
        a.extend(["--probe", s(&probe), "--backend", "cpu"]);
        a.extend(extra);
        spikecube(&a)
    };
    let o = plan(&[]);
    ok(&o);
    assert!(text(&o).contains("2 tasks"), "{}", text(&o));
    let manifest = std::fs::read_to_string(run.join("manifest.tsv")).unwrap();
    assert!(manifest.starts_with("index\tcommand\tname\tinputs\tprobe\tout\tflags\n"));
    assert!(
        manifest.contains(&format!("\tout/{}\t--backend cpu\n", NAMES[1])),
        "{manifest}"
    );
    // The same plan again changes nothing; another one is refused.
    ok(&plan(&[]));
    let o = plan(&["--th-universal", "8"]);
    assert!(
        !o.status.success() && text(&o).contains("written once"),
        "{}",
        text(&o)
    );
    assert_eq!(
        std::fs::read_to_string(run.join("manifest.tsv")).unwrap(),
        manifest
    );

    // Nothing ran yet: collect fails, naming both tasks.
    let o = spikecube(&["batch", "collect", s(&run)]);
    assert!(!o.status.success());
    let t = text(&o);
    for (i, n) in NAMES.iter().enumerate() {
        assert!(t.contains(&format!("task {i} ({n}) missing")), "{t}");
    }
    assert!(t.contains("2 of 2 tasks are not done"), "{t}");

    for i in ["0", "1"] {
        ok(&spikecube(&["batch", "task", s(&run), "--index", i, "-q"]));
    }
    for (rec, name) in recs.iter().zip(NAMES) {
        let reference = dir.path().join("ref").join(name);
        let canon = std::fs::canonicalize(rec).unwrap();
        let canon_probe = std::fs::canonicalize(&probe).unwrap();
        ok(&spikecube(&[
            "detect",
            "-q",
            s(&canon),
            "--out",
            s(&reference),
            "--probe",
            s(&canon_probe),
            "--backend",
            "cpu",
        ]));
        let out = run.join("out").join(name);
        assert_eq!(files(&out), files(&reference), "{name}");
        let p = &json(&out)["provenance"];
        assert_eq!(p["batch"]["name"], name);
        assert_eq!(p["batch"]["settings_hash"].as_str().unwrap().len(), 16);
        assert!(p["device"].as_str().unwrap().starts_with("CPU"), "{p}");
        assert!(p["host"].is_string() && p["env"].get("CUDA_VISIBLE_DEVICES").is_some());
        // A plain run records where it ran, but is no batch task.
        assert!(json(&reference)["provenance"].get("batch").is_none());
    }

    // Complete: skipped, nothing rewritten.
    let out0 = run.join("out").join(NAMES[0]);
    let before = std::fs::read(out0.join("spikecube.json")).unwrap();
    let o = spikecube(&["batch", "task", s(&run), "--index", "0"]);
    ok(&o);
    assert!(text(&o).contains("skipped"), "{}", text(&o));
    assert_eq!(std::fs::read(out0.join("spikecube.json")).unwrap(), before);

    let o = spikecube(&["batch", "collect", s(&run)]);
    ok(&o);
    let summary = std::fs::read_to_string(run.join("summary.tsv")).unwrap();
    let rows: Vec<&str> = summary.lines().collect();
    assert_eq!(rows.len(), 3, "{summary}");
    assert!(rows[0].starts_with(
        "index\tname\tstatus\tspikes\tunits\tgood_units\trecording_s\twall_s\trealtime\twarnings\tdevice\thost"
    ));
    assert!(
        rows[1].starts_with(&format!("0\t{}\tok\t", NAMES[0])),
        "{summary}"
    );
    // A detection has no units.
    let cols: Vec<&str> = rows[1].split('\t').collect();
    assert_eq!(&cols[4..6], &["", ""], "{summary}");

    // Half-written: a file cut short makes collect fail, naming it.
    let amps = out0.join("amplitudes.npy");
    let bytes = std::fs::read(&amps).unwrap();
    std::fs::write(&amps, &bytes[..bytes.len() - 4]).unwrap();
    let o = spikecube(&["batch", "collect", s(&run)]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains(&format!("task 0 ({}) incomplete", NAMES[0])) && t.contains("amplitudes.npy is"),
        "{t}"
    );
    assert!(t.contains("1 of 2 tasks are not done"), "{t}");
    // ... and the task is no longer skipped.
    let o = spikecube(&["batch", "task", s(&run), "--index", "0", "-q"]);
    ok(&o);
    assert!(!text(&o).contains("skipped"));
    ok(&spikecube(&["batch", "collect", s(&run)]));
}

#[test]
fn bad_plans_and_failed_tasks_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let (recs, _) = recordings(dir.path());
    let run = dir.path().join("run");
    // A bad flag is refused at plan time, and no manifest is written.
    let o = spikecube(&[
        "batch",
        "plan",
        s(&recs[0]),
        "--out",
        s(&run),
        "--nblocks",
        "x",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("task 0") && text(&o).contains("--nblocks"),
        "{}",
        text(&o)
    );
    assert!(!run.join("manifest.tsv").exists());
    // A recording listed twice, also under another spelling, is refused.
    let again = recs[0]
        .parent()
        .unwrap()
        .join(".")
        .join(recs[0].file_name().unwrap());
    let o = spikecube(&["batch", "plan", s(&recs[0]), s(&again), "--out", s(&run)]);
    assert!(
        !o.status.success() && text(&o).contains("listed twice"),
        "{}",
        text(&o)
    );
    assert!(!run.join("manifest.tsv").exists());
    let o = spikecube(&[
        "batch",
        "plan",
        s(&recs[0]),
        "--out",
        s(&run),
        "--no-such-flag",
    ]);
    assert!(
        !o.status.success() && text(&o).contains("--no-such-flag"),
        "{}",
        text(&o)
    );
    let o = spikecube(&["batch", "plan", "--out", s(&run), s(&recs[0])]);
    assert!(
        !o.status.success() && text(&o).contains("recordings first"),
        "{}",
        text(&o)
    );
    let missing = dir.path().join("missing.bin");
    let o = spikecube(&["batch", "plan", s(&missing), "--out", s(&run)]);
    assert!(
        !o.status.success() && text(&o).contains("does not exist"),
        "{}",
        text(&o)
    );

    // A task that fails (its recording vanished) is named by collect with its error.
    ok(&spikecube(&[
        "batch",
        "plan",
        s(&recs[0]),
        "--out",
        s(&run),
        "--backend",
        "cpu",
        "-q",
    ]));
    let moved = dir.path().join("moved.bin");
    std::fs::rename(&recs[0], &moved).unwrap();
    let o = spikecube(&["batch", "task", s(&run), "--index", "0"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("task 0 (sim_g0_t0.imec0.ap) failed"),
        "{}",
        text(&o)
    );
    let o = spikecube(&["batch", "task", s(&run), "--index", "3"]);
    assert!(
        !o.status.success() && text(&o).contains("one task, index 0"),
        "{}",
        text(&o)
    );
    let o = spikecube(&["batch", "collect", s(&run)]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("task 0 (sim_g0_t0.imec0.ap) failed"),
        "{}",
        text(&o)
    );
    let summary = std::fs::read_to_string(run.join("summary.tsv")).unwrap();
    assert!(
        summary.lines().nth(1).unwrap().contains("\tfailed\t"),
        "{summary}"
    );
    // Put back, the task runs and its error note goes.
    std::fs::rename(&moved, &recs[0]).unwrap();
    ok(&spikecube(&[
        "batch",
        "task",
        s(&run),
        "--index",
        "0",
        "-q",
    ]));
    assert!(!run.join("logs/0.error").exists());
    ok(&spikecube(&["batch", "collect", s(&run)]));
}

#[test]
fn sort_tasks_equal_plain_sort_and_are_skipped_when_complete() {
    let dir = tempfile::tempdir().unwrap();
    let (_, probe) = recordings(dir.path());
    // Long enough for both clusterings: 6 s, 8 units at 15 Hz.
    let a = dir.path().join("a");
    std::fs::remove_dir_all(&a).unwrap();
    ok(&spikecube(&[
        "simulate",
        "-q",
        "--probe",
        s(&probe),
        "--seconds",
        "6",
        "--n-units",
        "8",
        "--rate",
        "15",
        "--seed",
        "2",
        "--out",
        s(&a),
    ]));
    let recs = [a.join("sim_g0_t0.imec0.ap.bin")];
    // One recording: its task is named after the file alone.
    const NAME: &str = "sim_g0_t0.imec0.ap";
    let run = dir.path().join("run");
    let mut a = vec!["batch", "plan", s(&recs[0]), "--out", s(&run)];
    a.extend([
        "--command",
        "sort",
        "--probe",
        s(&probe),
        "--backend",
        "cpu",
    ]);
    ok(&spikecube(&a));
    let manifest = std::fs::read_to_string(run.join("manifest.tsv")).unwrap();
    assert!(
        manifest.contains(&format!("\n0\tsort\t{}\t", NAME)),
        "{manifest}"
    );
    // A sort flag is checked at plan time too; an unknown command is refused.
    let bad = spikecube(&[
        "batch",
        "plan",
        s(&recs[0]),
        "--out",
        s(&dir.path().join("r2")),
        "--command",
        "sort",
        "--th-learnd",
        "8",
    ]);
    assert!(
        !bad.status.success() && text(&bad).contains("--th-learnd"),
        "{}",
        text(&bad)
    );
    let bad = spikecube(&[
        "batch",
        "plan",
        s(&recs[0]),
        "--out",
        s(&dir.path().join("r3")),
        "--command",
        "cluster",
    ]);
    assert!(
        !bad.status.success() && text(&bad).contains("detect, sort"),
        "{}",
        text(&bad)
    );
    assert!(!dir.path().join("r2").exists() && !dir.path().join("r3").exists());

    ok(&spikecube(&[
        "batch",
        "task",
        s(&run),
        "--index",
        "0",
        "-q",
    ]));
    let reference = dir.path().join("ref");
    let canon = std::fs::canonicalize(&recs[0]).unwrap();
    let canon_probe = std::fs::canonicalize(&probe).unwrap();
    ok(&spikecube(&[
        "sort",
        "-q",
        s(&canon),
        "--out",
        s(&reference),
        "--probe",
        s(&canon_probe),
        "--backend",
        "cpu",
    ]));
    let out = run.join("out").join(NAME);
    assert_eq!(files(&out), files(&reference));
    let j = json(&out);
    assert_eq!(j["command"], "sort");
    assert_eq!(j["provenance"]["batch"]["name"], NAME);
    assert!(j["input"]["duration_s"].as_f64().unwrap() > 0.9);
    let before = std::fs::read(out.join("spikecube.json")).unwrap();
    let o = spikecube(&["batch", "task", s(&run), "--index", "0"]);
    ok(&o);
    assert!(text(&o).contains("skipped"), "{}", text(&o));
    assert_eq!(std::fs::read(out.join("spikecube.json")).unwrap(), before);
    let o = spikecube(&["batch", "collect", s(&run)]);
    ok(&o);
    let summary = std::fs::read_to_string(run.join("summary.tsv")).unwrap();
    let row = summary.lines().nth(1).unwrap();
    let cols: Vec<&str> = row.split('\t').collect();
    assert_eq!(&cols[..3], &["0", NAME, "ok"], "{summary}");
    assert_eq!(cols[3], j["counts"]["n_spikes"].to_string(), "{summary}");
    // A sort's units and good units.
    assert_eq!(cols[4], j["counts"]["units"].to_string(), "{summary}");
    assert_eq!(cols[5], j["counts"]["good"].to_string(), "{summary}");
    assert!(j["counts"]["units"].as_u64().unwrap() > 0, "{summary}");
}

/// `batch plan` checks the flags' values against every recording and the
/// probe, as each task would before reading any sample: a value a task would
/// refuse is an error at plan time naming the task, the recording, the flag
/// and the number, and no manifest is written.
#[test]
fn plan_refuses_values_a_task_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let (recs, probe) = recordings(dir.path());
    let run = dir.path().join("run");
    let labelled = dir.path().join("light.csv");
    std::fs::write(&labelled, "time,label\n0.2,laser\nlaser,0.4\n").unwrap();
    let plan = |recs: &[&Path], extra: &[&str]| {
        let mut a = vec!["batch", "plan"];
        a.extend(recs.iter().map(|r| s(r)));
        a.extend(["--out", s(&run), "--probe", s(&probe), "--backend", "cpu"]);
        a.extend(extra);
        spikecube(&a)
    };
    let both = [recs[0].as_path(), recs[1].as_path()];
    let cases: [(&[&str], &[&str]); 9] = [
        (&["--batch-size", "10"], &["--batch-size", "10"]),
        (&["--nblocks", "100"], &["--nblocks 100", "at most"]),
        (&["--exclude-channels", "999"], &["999"]),
        (&["--threads", "0"], &["--threads 0"]),
        (&["--binning-depth", "-5"], &["--binning-depth", "-5"]),
        (&["--tmin", "30"], &["30"]),
        (
            &["--artifact-times", s(&labelled)],
            &["light.csv", "line 3", "\"laser\""],
        ),
        (
            &["--command", "sort", "--th-learned", "-3"],
            &["--th-learned", "-3"],
        ),
        (
            &["--command", "sort", "--max-peels", "0"],
            &["--max-peels", "is 0"],
        ),
    ];
    for (flags, want) in cases {
        let o = plan(&both, flags);
        let t = text(&o);
        assert!(!o.status.success(), "{flags:?}: {t}");
        assert!(
            t.contains("task 0 (a_sim_g0_t0.imec0.ap)")
                && t.contains(&format!("a/{}", "sim_g0_t0.imec0.ap.bin")),
            "{flags:?}: {t}"
        );
        for w in want {
            assert!(t.contains(w), "{flags:?}: wants {w:?}: {t}");
        }
        assert!(!t.contains("panicked"), "{flags:?}: {t}");
        assert!(!run.join("manifest.tsv").exists(), "{flags:?}");
    }
    // Each recording is checked, not only the first: one cut to a few
    // samples (shorter than a window's nt) is named.
    let short = dir.path().join("short");
    std::fs::create_dir(&short).unwrap();
    let bin = short.join("cut.bin");
    let bytes = std::fs::read(&recs[1]).unwrap();
    std::fs::write(&bin, &bytes[..33 * 2 * 20]).unwrap();
    let o = plan(
        &[recs[0].as_path(), bin.as_path()],
        &["--n-channels", "33", "--fs", "30000"],
    );
    let t = text(&o);
    assert!(
        !o.status.success() && t.contains("task 1") && t.contains("cut.bin"),
        "{t}"
    );
    assert!(!run.join("manifest.tsv").exists());
    // Good values still plan.
    ok(&plan(
        &both,
        &["--batch-size", "30000", "--nblocks", "1", "-q"],
    ));
    assert!(run.join("manifest.tsv").exists());
}

/// `batch plan` says what a task would warn about before reading samples,
/// naming the task and the recording, and still writes the manifest.
#[test]
fn plan_shows_the_warnings_a_task_would_give() {
    let dir = tempfile::tempdir().unwrap();
    let (recs, probe) = recordings(dir.path());
    let run = dir.path().join("run");
    let o = spikecube(&[
        "batch",
        "plan",
        s(&recs[0]),
        "--out",
        s(&run),
        "--probe",
        s(&probe),
        "--artifact-window",
        "1,1",
        "-q",
    ]);
    ok(&o);
    let t = text(&o);
    assert!(
        t.contains("task 0 (") && t.contains("nothing is blanked"),
        "{t}"
    );
    assert!(run.join("manifest.tsv").exists());
}
