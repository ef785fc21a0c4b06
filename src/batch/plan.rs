//! `spikecube batch plan`: the command line split into recordings, the run
//! folder and the subcommand's flags, and the manifest written once.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::manifest::{Line, MANIFEST_TSV, Manifest, names_for};

/// `spikecube batch plan INPUTS… --out RUN [FLAGS…]`, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanArgs {
    /// The recordings, one task each (the arguments before the first flag).
    pub inputs: Vec<PathBuf>,
    /// The run folder (`--out`).
    pub run: PathBuf,
    /// `--probe`, for every task.
    pub probe: Option<PathBuf>,
    /// Every other argument, passed to each task's subcommand as given.
    pub flags: Vec<String>,
}

/// The detect and sort flags whose value is a file the task reads: written to
/// the manifest as absolute paths, like the recordings and the probe.
const FILE_FLAGS: [&str; 3] = ["--templates", "--artifact-times", "--neighbourhoods"];

/// Splits the arguments of `batch plan`: the recordings are the arguments
/// before the first one that starts with `-`; `--out RUN` (or `--out=RUN`) and
/// `--probe P` are taken out; the rest are the subcommand's flags, those
/// naming a file ([`FILE_FLAGS`]) with the file's absolute path.
///
/// # Errors
/// When no recording comes first, `--out` is missing or given twice, an
/// argument is not UTF-8, or a file flag's file does not exist.
pub fn split_args(args: &[OsString]) -> Result<PlanArgs> {
    let args: Vec<String> = args
        .iter()
        .map(|a| {
            a.to_str()
                .map(String::from)
                .with_context(|| format!("argument {a:?} is not valid UTF-8"))
        })
        .collect::<Result<_>>()?;
    let first_flag = args
        .iter()
        .position(|a| a.starts_with('-'))
        .unwrap_or(args.len());
    if first_flag == 0 {
        bail!("give the recordings first: spikecube batch plan INPUTS… --out RUN [detect flags…]");
    }
    let inputs = args[..first_flag].iter().map(PathBuf::from).collect();
    let (mut run, mut probe, mut flags) = (None, None, Vec::new());
    let mut rest = args[first_flag..].iter();
    while let Some(a) = rest.next() {
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        let slot = match name {
            "--out" => Some(&mut run),
            "--probe" => Some(&mut probe),
            _ if FILE_FLAGS.contains(&name) => None,
            _ => {
                flags.push(a.clone());
                continue;
            }
        };
        let value = match inline {
            Some(v) => v,
            None => rest
                .next()
                .cloned()
                .with_context(|| format!("{name} needs a value"))?,
        };
        let Some(slot) = slot else {
            // A file a task reads: absolute (tasks run from any folder), and
            // it must exist now.
            let path = absolute(Path::new(&value), &format!("{name} file"))?;
            let path = path
                .to_str()
                .with_context(|| format!("{name} {value}: the absolute path is not UTF-8"))?;
            flags.push(format!("{name}={path}"));
            continue;
        };
        if slot.replace(PathBuf::from(value)).is_some() {
            bail!("{name} is given twice");
        }
    }
    let run = run.context(
        "--out RUN is missing: the run folder that gets manifest.tsv and out/ (spikecube batch plan INPUTS… --out RUN)",
    )?;
    Ok(PlanArgs {
        inputs,
        run,
        probe,
        flags,
    })
}

/// An absolute path for `p` (against the current folder), made canonical when
/// it exists.
fn absolute(p: &Path, what: &str) -> Result<PathBuf> {
    if p.exists() {
        return std::fs::canonicalize(p)
            .with_context(|| format!("cannot resolve the {what} {}", p.display()));
    }
    bail!("the {what} {} does not exist", p.display())
}

/// The manifest for `args` and subcommand `command`: one line per recording,
/// inputs and probe made absolute (so tasks may run from any folder), names
/// from [`names_for`], outputs `out/<name>`.
///
/// # Errors
/// When a recording or the probe does not exist, or a recording is listed
/// twice (two tasks would sort it into two folders with the same result).
pub fn manifest_for(command: &str, args: &PlanArgs) -> Result<Manifest> {
    let inputs = args
        .inputs
        .iter()
        .map(|p| absolute(p, "recording"))
        .collect::<Result<Vec<_>>>()?;
    // The paths are canonical: the same file under two spellings (`a/../b`,
    // a link) is found too.
    for (j, p) in inputs.iter().enumerate() {
        if let Some(i) = inputs[..j].iter().position(|q| q == p) {
            bail!(
                "the recording {} is listed twice (recordings {} and {} of the list): list each once",
                p.display(),
                i + 1,
                j + 1
            );
        }
    }
    let probe = args
        .probe
        .as_deref()
        .map(|p| absolute(p, "--probe file"))
        .transpose()?;
    let names = names_for(&inputs);
    let lines = inputs
        .into_iter()
        .zip(names)
        .enumerate()
        .map(|(index, (input, name))| Line {
            index,
            command: command.to_string(),
            out: Path::new("out").join(&name),
            name,
            inputs: vec![input],
            probe: probe.clone(),
            flags: args.flags.clone(),
        })
        .collect();
    Ok(Manifest { lines })
}

/// Whether [`write_once`] wrote the manifest or found the same one there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Written now.
    New,
    /// The run folder already held this very manifest (nothing changed).
    Unchanged,
}

/// Creates `run/`, `run/out/` and `run/logs/` and writes `run/manifest.tsv`
/// once: the file appears complete (written under another name and linked),
/// and an existing one is never replaced.
///
/// # Errors
/// When `run/manifest.tsv` exists with other contents (nothing is changed),
/// or a folder or the file cannot be written.
pub fn write_once(run: &Path, manifest: &Manifest) -> Result<Written> {
    let text = manifest.to_tsv()?;
    let path = run.join(MANIFEST_TSV);
    let same = |path: &Path| -> Result<Option<bool>> {
        match std::fs::read_to_string(path) {
            Ok(old) => Ok(Some(old == text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
        }
    };
    let differs = || {
        anyhow::anyhow!(
            "{} already exists with other tasks or settings; a run folder's manifest is written once (nothing was changed): choose another --out, or remove that run folder yourself",
            path.display()
        )
    };
    match same(&path)? {
        Some(true) => return Ok(Written::Unchanged),
        Some(false) => return Err(differs()),
        None => {}
    }
    for d in [run.to_path_buf(), run.join("out"), run.join("logs")] {
        std::fs::create_dir_all(&d)
            .with_context(|| format!("cannot create the folder {}", d.display()))?;
    }
    let tmp = run.join(format!(".{MANIFEST_TSV}.{}", std::process::id()));
    std::fs::write(&tmp, &text).with_context(|| format!("cannot write {}", tmp.display()))?;
    // A hard link never replaces an existing file: two plans at once cannot
    // both win.
    let linked = std::fs::hard_link(&tmp, &path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(Written::New),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => match same(&path)? {
            Some(true) => Ok(Written::Unchanged),
            _ => Err(differs()),
        },
        Err(e) => Err(e).with_context(|| format!("cannot write {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn arguments_split_into_recordings_run_probe_and_flags() {
        let a = split_args(&os(&[
            "a.bin",
            "b.bin",
            "--out",
            "runs/w49",
            "--backend",
            "cpu",
            "--probe=p.json",
            "--th-universal",
            "8",
        ]))
        .unwrap();
        assert_eq!(a.inputs, [PathBuf::from("a.bin"), PathBuf::from("b.bin")]);
        assert_eq!(a.run, PathBuf::from("runs/w49"));
        assert_eq!(a.probe, Some(PathBuf::from("p.json")));
        assert_eq!(a.flags, ["--backend", "cpu", "--th-universal", "8"]);
    }

    #[test]
    fn file_flags_get_absolute_paths_and_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.npz");
        std::fs::write(&t, b"x").unwrap();
        let canonical = std::fs::canonicalize(&t).unwrap();
        let a = split_args(&os(&[
            "a.bin",
            "--out",
            "r",
            "--templates",
            t.to_str().unwrap(),
            "--nblocks",
            "0",
        ]))
        .unwrap();
        assert_eq!(
            a.flags,
            [
                format!("--templates={}", canonical.display()),
                "--nblocks".into(),
                "0".into()
            ]
        );
        let missing = dir.path().join("none.csv");
        let e = split_args(&os(&[
            "a.bin",
            "--out",
            "r",
            &format!("--artifact-times={}", missing.display()),
        ]))
        .err()
        .unwrap();
        assert!(e.to_string().contains("does not exist"), "{e}");
    }

    #[test]
    fn bad_plan_arguments_are_explained() {
        let cases: [(&[&str], &str); 4] = [
            (&["--out", "r", "a.bin"], "recordings first"),
            (&["a.bin", "--backend", "cpu"], "--out RUN is missing"),
            (&["a.bin", "--out", "r", "--out=s"], "twice"),
            (&["a.bin", "--out"], "needs a value"),
        ];
        for (args, want) in cases {
            let err = split_args(&os(args)).unwrap_err().to_string();
            assert!(err.contains(want), "{args:?}: {err}");
        }
    }

    #[test]
    fn the_manifest_is_written_once() {
        let dir = tempfile::tempdir().unwrap();
        let rec = dir.path().join("r.ap.bin");
        std::fs::write(&rec, b"").unwrap();
        let args = PlanArgs {
            inputs: vec![rec.clone()],
            run: dir.path().join("run"),
            probe: None,
            flags: vec!["--backend".into(), "cpu".into()],
        };
        let m = manifest_for("detect", &args).unwrap();
        assert_eq!(m.lines[0].out, PathBuf::from("out/r.ap"));
        assert!(m.lines[0].inputs[0].is_absolute());
        assert_eq!(write_once(&args.run, &m).unwrap(), Written::New);
        assert!(args.run.join("out").is_dir() && args.run.join("logs").is_dir());
        assert_eq!(write_once(&args.run, &m).unwrap(), Written::Unchanged);
        let mut other = m.clone();
        other.lines[0].flags.push("--nblocks=0".into());
        let before = std::fs::read(args.run.join(MANIFEST_TSV)).unwrap();
        let err = write_once(&args.run, &other).unwrap_err().to_string();
        assert!(err.contains("written once"), "{err}");
        assert_eq!(std::fs::read(args.run.join(MANIFEST_TSV)).unwrap(), before);
        let missing = PlanArgs {
            inputs: vec![dir.path().join("nope.bin")],
            ..args
        };
        let err = manifest_for("detect", &missing).unwrap_err().to_string();
        assert!(
            err.contains("nope.bin") && err.contains("does not exist"),
            "{err}"
        );
    }
}
