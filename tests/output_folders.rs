//! What a run leaves on disk, for every subcommand that writes a folder
//! (`detect`, `preprocess`, `detect-window`, `simulate`): an earlier result of the
//! same subcommand is replaced, anything else in the way is an error that leaves
//! every file as it was; Ctrl-C and SIGTERM leave no temporary folder; a
//! temporary folder of a killed run is removed by the next run; a closed
//! standard output never stops a run. Plus the wording of common errors.

mod common;

use common::{s, spikecube};

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_spikecube")
}

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A 32-site two-column probe, Kilosort JSON, for a file of 33 columns (sync last).
fn write_probe(dir: &Path) -> PathBuf {
    let p = dir.join("probe32.json");
    let xc: Vec<f32> = (0..32).map(|i| 32.0 * (i % 2) as f32).collect();
    let yc: Vec<f32> = (0..32).map(|i| 20.0 * (i / 2) as f32).collect();
    let j = serde_json::json!({"chanMap": (0..32).collect::<Vec<_>>(), "xc": xc, "yc": yc, "kcoords": vec![0; 32], "n_chan": 32});
    std::fs::write(&p, j.to_string()).unwrap();
    p
}

/// Simulates `seconds` of the 32-site probe into `dir/name`; returns the folder.
fn simulate(dir: &Path, name: &str, seconds: &str) -> PathBuf {
    let probe = write_probe(dir);
    let sim = dir.join(name);
    ok(&spikecube(&[
        "simulate",
        "--probe",
        s(&probe),
        "--seconds",
        seconds,
        "--n-units",
        "6",
        "--out",
        s(&sim),
    ]));
    sim
}

/// Every file in `dir` with its contents.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let bytes = if e.file_type().unwrap().is_file() {
                std::fs::read(e.path()).unwrap()
            } else {
                b"<folder>".to_vec()
            };
            (name, bytes)
        })
        .collect();
    v.sort();
    v
}

/// Entries of `dir` whose name holds `.partial` or `.old-`.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".partial") || n.contains(".old-"))
        .collect()
}

/// The arguments of each subcommand writing to `out`, reading the simulated
/// recording in `sim` (as flat binary, `copies` times over, for a long run).
fn command(which: &str, sim: &Path, out: &Path, copies: usize) -> Vec<String> {
    let bin = sim.join("sim_g0_t0.imec0.ap.bin");
    let probe = sim.join("probe.json");
    let mut a: Vec<String> = vec![which.into()];
    match which {
        "detect" | "preprocess" => {
            for _ in 0..copies {
                a.push(s(&bin).into());
            }
            for f in [
                "--n-channels",
                "33",
                "--fs",
                "30000",
                "--probe",
                s(&probe),
                "--batch-size",
                "30000",
                "-q",
            ] {
                a.push(f.into());
            }
        }
        "simulate" => {
            let secs = if copies > 1 { "600" } else { "1" };
            for f in ["--seconds", secs, "--n-units", "4"] {
                a.push(f.into());
            }
        }
        "detect-window" => {
            let case = common::data("fixtures/detection/tetrode_like");
            a.extend([
                "--window".into(),
                s(&case.join("X.npy")).into(),
                "--probe".into(),
                s(&case.join("probe.json")).into(),
            ]);
        }
        _ => unreachable!(),
    }
    a.push("--out".into());
    a.push(s(out).into());
    a
}

fn run(args: &[String]) -> Output {
    let a: Vec<&str> = args.iter().map(|x| x.as_str()).collect();
    spikecube(&a)
}

const WRITERS: [&str; 4] = ["detect", "preprocess", "detect-window", "simulate"];

#[test]
fn a_rerun_replaces_only_an_earlier_result_that_holds_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d, "sim", "2");
    for which in WRITERS {
        let out = d.join(format!("out-{which}"));
        let args = command(which, &sim, &out, 1);
        ok(&run(&args));
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
                .unwrap();
        assert_eq!(manifest["command"], which);
        let mut listed: Vec<String> = manifest["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        listed.sort();
        let present: Vec<String> = snapshot(&out).into_iter().map(|(n, _)| n).collect();
        assert_eq!(listed, present, "{which}: spikecube.json lists every file");

        // A file of the user's in the folder: an error naming it, nothing touched.
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        let before = snapshot(&out);
        let o = run(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{which}: {err}");
        assert!(err.contains("notes.txt"), "{which}: {err}");
        assert_eq!(err.lines().filter(|l| l.contains("error")).count(), 1);
        assert_eq!(snapshot(&out), before, "{which}: the folder was changed");
        assert!(leftovers(d).is_empty(), "{which}: {:?}", leftovers(d));

        // A sub-folder of the user's, likewise.
        std::fs::remove_file(out.join("notes.txt")).unwrap();
        std::fs::create_dir(out.join("mine")).unwrap();
        let o = run(&args);
        assert_eq!(o.status.code(), Some(2), "{which}: {}", stderr(&o));
        assert!(stderr(&o).contains("mine"), "{which}: {}", stderr(&o));
        assert!(out.join("mine").is_dir());
        std::fs::remove_dir(out.join("mine")).unwrap();

        // Nothing but the earlier result: replaced.
        ok(&run(&args));
        assert!(out.join("spikecube.json").is_file());
        assert!(leftovers(d).is_empty(), "{which}: {:?}", leftovers(d));
    }
}

#[test]
fn a_folder_that_is_not_this_subcommands_result_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d, "sim", "2");
    let users = d.join("users");
    std::fs::create_dir(&users).unwrap();
    std::fs::write(users.join("precious.txt"), "mine").unwrap();
    let file = d.join("notes.txt");
    std::fs::write(&file, "mine").unwrap();
    for which in WRITERS {
        for (out, needle) in [
            (&users, "not an earlier spikecube result"),
            (&file, "exists as a file"),
            // The simulated recording is a `simulate` result, not this one's.
            (&sim, "spikecube simulate"),
        ] {
            if which == "simulate" && out == &sim {
                continue;
            }
            let before = if out.is_dir() { snapshot(out) } else { vec![] };
            let o = run(&command(which, &sim, out, 1));
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{which} → {out:?}: {err}");
            assert!(err.contains(needle), "{which} → {out:?}: {err}");
            if out.is_dir() {
                assert_eq!(snapshot(out), before);
            }
        }
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
    assert_eq!(
        std::fs::read_to_string(users.join("precious.txt")).unwrap(),
        "mine"
    );
    assert!(leftovers(d).is_empty(), "{:?}", leftovers(d));
}

/// Starts `args` with its standard output discarded and its standard error kept.
fn spawn(args: &[String]) -> std::process::Child {
    Command::new(bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits, polling every 5 ms, until `seen()` holds; fails when `child` ends
/// first or after `limit`, naming `what` it waited for.
fn wait_until(
    child: &mut std::process::Child,
    limit: Duration,
    what: &str,
    mut seen: impl FnMut() -> bool,
) {
    let t0 = Instant::now();
    while !seen() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the run ended ({st}) before {what} was seen");
        }
        assert!(t0.elapsed() < limit, "no {what} after {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits until a `.partial` entry appears in `dir` (the run has started writing).
fn wait_for_partial(dir: &Path, child: &mut std::process::Child) {
    let what = format!("temporary folder in {}", dir.display());
    wait_until(child, Duration::from_secs(60), &what, || {
        !leftovers(dir).is_empty()
    });
    // Let it get well into its work.
    std::thread::sleep(Duration::from_millis(300));
}

#[cfg(unix)]
#[test]
fn sigint_and_sigterm_leave_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d, "sim", "10");
    for which in ["detect", "preprocess", "simulate"] {
        for (sig, name, code) in [
            (libc::SIGINT, "SIGINT", 130),
            (libc::SIGTERM, "SIGTERM", 143),
        ] {
            let parent = d.join(format!("runs-{which}-{name}"));
            std::fs::create_dir(&parent).unwrap();
            let out = parent.join("out");
            // 60 copies of 10 s (detect, preprocess) or 600 s (simulate): far longer
            // than the test waits.
            let mut child = spawn(&command(which, &sim, &out, 60));
            wait_for_partial(&parent, &mut child);
            let t0 = Instant::now();
            // SAFETY: sends a signal to our own child process.
            assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
            let o = child.wait_with_output().unwrap();
            let took = t0.elapsed();
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(code), "{which} {name}: {err}");
            assert!(
                took < Duration::from_secs(1),
                "{which} {name}: stopped after {took:?}"
            );
            let lines: Vec<&str> = err.lines().filter(|l| l.contains("interrupted")).collect();
            assert_eq!(lines.len(), 1, "{which} {name}: {err}");
            assert!(
                lines[0].contains(name) && lines[0].contains("removed"),
                "{err}"
            );
            assert!(
                leftovers(&parent).is_empty(),
                "{which} {name}: {:?}",
                leftovers(&parent)
            );
            assert!(!out.exists(), "{which} {name}: {out:?} exists");
        }
    }
}

/// A process id that no longer runs: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    pid
}

/// The temporary folder of a run killed outright (SIGKILL, power loss) is removed
/// by the next run into the same place; one of a run still going is not.
#[test]
fn a_killed_runs_temporary_folder_is_removed_by_the_next_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d, "sim", "2");
    let dead = dead_pid();
    let me = std::process::id();
    for which in WRITERS {
        let out = d.join(format!("out-{which}"));
        let stale = d.join(format!("out-{which}.partial-{dead}"));
        std::fs::create_dir(&stale).unwrap();
        std::fs::write(stale.join("spike_times.npy"), "half written").unwrap();
        let live = d.join(format!("out-{which}.partial-{me}"));
        std::fs::create_dir(&live).unwrap();
        let args: Vec<String> = command(which, &sim, &out, 1)
            .into_iter()
            .filter(|a| a != "-q")
            .collect();
        let o = run(&args);
        ok(&o);
        let err = stderr(&o);
        assert!(!stale.exists(), "{which}: {stale:?} left");
        assert!(
            err.contains("removed") && err.contains(&format!(".partial-{dead}")),
            "{which}: {err}"
        );
        assert!(
            live.is_dir(),
            "{which}: the folder of a running process was removed"
        );
        std::fs::remove_dir(&live).unwrap();
        assert!(out.join("spikecube.json").is_file());
    }
}

/// `spikecube detect … | head -n 0`: the pipe is closed before anything is
/// printed; the run still completes, with no panic.
#[cfg(unix)]
#[test]
fn a_closed_standard_output_never_stops_a_run() {
    // `spikecube ARGS | PIPE` under pipefail.
    let piped = |args: &[String], pipe: &str| {
        Command::new("bash")
            .arg("-c")
            .arg(format!(r#"set -o pipefail; "$0" "$@" | {pipe}"#))
            .arg(bin())
            .args(args)
            .output()
            .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d, "sim", "2");
    for which in ["detect", "simulate"] {
        let out = d.join(format!("piped-{which}"));
        let mut args = command(which, &sim, &out, 1);
        if which == "detect" {
            args.push("--json".into());
        }
        let o = piped(&args, "head -n 0");
        let err = stderr(&o);
        assert!(o.status.success(), "{which}: {:?} {err}", o.status.code());
        assert!(!err.contains("panicked"), "{which}: {err}");
        assert!(out.join("spikecube.json").is_file(), "{which}: {err}");
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("spikecube.json")).unwrap())
                .unwrap();
        for f in manifest["files"].as_array().unwrap() {
            assert!(
                out.join(f.as_str().unwrap()).is_file(),
                "{which}: {f} missing"
            );
        }
    }
    // `| head -1` as users pipe it: the one line is read, the run ends normally.
    let out = d.join("piped-head1");
    let mut args = command("detect", &sim, &out, 1);
    args.push("--json".into());
    let o = piped(&args, "head -1");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("\"spikes\""));
    assert!(out.join("drift_map.png").is_file());
    // The commands that only print: `spikecube info | head -n 0` and
    // `spikecube probe P | head -n 0` end normally, with no panic.
    let probe = sim.join("probe.json");
    for args in [
        vec!["info".to_string()],
        vec!["probe".into(), s(&probe).into()],
    ] {
        let o = piped(&args, "head -n 0");
        let err = stderr(&o);
        assert!(o.status.success(), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn errors_name_flags_paths_and_counts_as_a_user_reads_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let first_error = |o: &Output| -> String {
        let err = stderr(o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        let lines: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
        assert_eq!(lines.len(), 1, "{err}");
        lines[0].to_string()
    };
    // A path that does not exist: "no such file" first.
    let absent = d.join("absent.bin");
    let e = first_error(&spikecube(&[
        "detect",
        s(&absent),
        "--out",
        s(&d.join("o")),
    ]));
    assert!(e.starts_with("spikecube: error: no such file"), "{e}");
    assert!(e.contains("absent.bin"), "{e}");
    // A .bin without its .meta: the .meta path looked for, and the flags to use instead.
    let lone = d.join("lone_g0_t0.imec0.ap.bin");
    std::fs::write(&lone, vec![0u8; 385 * 2 * 100]).unwrap();
    let e = first_error(&spikecube(&["detect", s(&lone), "--out", s(&d.join("o"))]));
    assert!(e.contains("lone_g0_t0.imec0.ap.meta"), "{e}");
    assert!(e.contains("no such file"), "{e}");
    // Settings are named by their flags, not Kilosort's internal names.
    let flat = d.join("flat.dat");
    std::fs::write(&flat, vec![0u8; 64 * 2 * 100]).unwrap();
    let e = first_error(&spikecube(&[
        "detect",
        s(&flat),
        "--n-channels",
        "0",
        "--fs",
        "30000",
        "--out",
        s(&d.join("o")),
    ]));
    assert!(
        e.contains("--n-channels") && !e.contains("n_chan_bin"),
        "{e}"
    );
    let sim = simulate(d, "sim", "1");
    let e = first_error(&run(&{
        let mut a = command("detect", &sim, &d.join("o"), 1);
        a.extend(["--nearest-chans".into(), "0".into()]);
        a
    }));
    assert!(
        e.contains("--nearest-chans") && !e.contains("`nearest_chans`"),
        "{e}"
    );
    // A SpikeGLX recording's folder instead of its file: the file is named.
    let e = first_error(&run(&[
        "detect".to_string(),
        s(&sim).to_string(),
        "--out".into(),
        s(&d.join("o")).to_string(),
    ]));
    assert!(
        e.contains("structure.oebin") && e.contains("sim_g0_t0.imec0.ap.bin"),
        "{e}"
    );
    // Two template sources at once: refused before anything is read.
    let e = first_error(&run(&{
        let mut a = command("detect", &sim, &d.join("o"), 1);
        a.extend([
            "--templates".into(),
            "missing.npz".into(),
            "--templates-from-data".into(),
            "true".into(),
        ]);
        a
    }));
    assert!(
        e.contains("--templates missing.npz") && e.contains("--templates-from-data true"),
        "{e}"
    );

    // Counts: "1 window", never "1 windows"; log lines carry a level and no
    // module path (unless -v).
    let bin = sim.join("sim_g0_t0.imec0.ap.bin");
    let out = d.join("one");
    let o = spikecube(&["detect", s(&bin), "--out", s(&out)]);
    ok(&o);
    let err = stderr(&o);
    assert!(err.contains("1 window"), "{err}");
    assert!(!err.contains("1 windows"), "{err}");
    let info: Vec<&str> = err.lines().filter(|l| l.contains("INFO")).collect();
    assert!(!info.is_empty(), "{err}");
    assert!(info.iter().all(|l| !l.contains("spikecube::")), "{err}");
    let o = spikecube(&["detect", s(&bin), "--out", s(&out), "-v"]);
    ok(&o);
    assert!(stderr(&o).contains("spikecube::"), "{}", stderr(&o));
}

/// The sort's arguments: `detect`'s (`copies` copies of the simulation) on the CPU.
fn sort_command(sim: &Path, out: &Path, copies: usize) -> Vec<String> {
    let mut a = command("detect", sim, out, copies);
    a[0] = "sort".into();
    a.extend(["--backend".into(), "cpu".into()]);
    a
}

/// A sort stopped by SIGINT after its detection stage (while it clusters or
/// matches) removes its hidden working folder too, says so, and leaves
/// nothing beside the output; the folders it made to hold the output go too
/// (the user's own parent stays).
#[cfg(unix)]
#[test]
fn a_sort_interrupted_after_detection_removes_its_working_folder() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d, "sim", "10");
    let parent = d.join("runs-sort");
    std::fs::create_dir(&parent).unwrap();
    // Two folders the sort makes for its output, removed again on the interrupt.
    let made = parent.join("made");
    let out = made.join("by-sort").join("out");
    let mut child = spawn(&sort_command(&sim, &out, 30));
    // The detection stage's folder, published under its final name.
    let work = made
        .join("by-sort")
        .join(format!(".out.spikecube-detection-{}", child.id()));
    wait_until(
        &mut child,
        Duration::from_secs(300),
        "finished detection stage",
        || work.join("spikecube.json").is_file(),
    );
    // SAFETY: sends a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("interrupted"))
        .unwrap_or("");
    assert!(
        line.contains("removed") && line.contains(".out.spikecube-detection-"),
        "{err}"
    );
    // The line names the folders it made and removed again.
    assert!(
        line.contains("empty folders") && line.contains(&made.display().to_string()),
        "{err}"
    );
    let left: Vec<_> = std::fs::read_dir(&parent)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left beside the output: {left:?}");
}

/// The working folders of a sort killed outright (SIGKILL, power loss) are
/// removed by the next sort into the same place; those of a sort still
/// running, and a user's folder of a similar name, are not.
#[test]
fn a_killed_sorts_working_folders_are_removed_by_the_next_sort() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sim = simulate(d, "sim", "4");
    let dead = dead_pid();
    let me = std::process::id();
    let stale = [
        d.join(format!(".out.spikecube-detection-{dead}")),
        d.join(format!(".out.spikecube-detection-{dead}.partial-{dead}")),
    ];
    let kept = [
        d.join(format!(".out.spikecube-detection-{me}")),
        d.join(".out.spikecube-detection-notes"),
    ];
    for f in stale.iter().chain(&kept) {
        std::fs::create_dir(f).unwrap();
        std::fs::write(f.join("spike_times.npy"), "half written").unwrap();
    }
    let args: Vec<String> = sort_command(&sim, &d.join("out"), 1)
        .into_iter()
        .filter(|a| a != "-q")
        .collect();
    let o = run(&args);
    ok(&o);
    let err = stderr(&o);
    for f in &stale {
        assert!(!f.exists(), "{f:?} left: {err}");
    }
    assert!(
        err.contains(&format!("process {dead} no longer runs")),
        "{err}"
    );
    for f in &kept {
        assert!(f.join("spike_times.npy").is_file(), "{f:?} was removed");
    }
    assert!(d.join("out/spikecube.json").is_file());
}
