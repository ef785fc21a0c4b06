//! One rule for every output folder spikecube writes (`detect`, `preprocess`,
//! `detect-window`, `simulate`): never remove what spikecube did not write.
//!
//! A [`StagedFolder`] is written under a temporary name, `<out>.partial-<pid>`,
//! beside the final folder, and renamed to `<out>` by [`StagedFolder::publish`]
//! only when complete. Its `spikecube.json` names the subcommand that wrote it
//! (`command`) and every file it holds (`files`). A folder already at `<out>` is
//! replaced only when it is empty, or when it is an earlier result of the same
//! subcommand that holds nothing but the files its `spikecube.json` lists; any
//! other file there is an error naming it, checked before anything is written
//! and again just before the rename, and nothing is touched.
//!
//! Interruptions: a staged folder dropped without being published removes
//! itself; [`abandon_all`] removes every staged folder of the process (for a
//! signal handler that then exits). A `<out>.partial-<pid>` left by a process
//! that no longer runs (killed, power loss) is removed by the next run into the
//! same place, with a log line. A [`WorkingFolder`] (a private folder a run
//! reads back and removes, e.g. the sort's detection stage) is removed the
//! same ways: when dropped, by [`abandon_all`], and, once its process is gone,
//! by [`remove_stale_working`].

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

/// Name of the provenance file every spikecube output folder holds.
pub const MANIFEST: &str = "spikecube.json";

/// Staged folders of this process not yet published, and whether the process
/// is being interrupted (then nothing more is published).
struct Registry {
    active: Vec<PathBuf>,
    /// Private working folders (e.g. the sort's detection stage), removed with
    /// the staged folders on an interrupt.
    working: Vec<PathBuf>,
    /// Folders [`make_parent`] created (outermost first), removed on an
    /// interrupt when they are empty again.
    created: Vec<PathBuf>,
    abandoned: bool,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    active: Vec::new(),
    working: Vec::new(),
    created: Vec::new(),
    abandoned: false,
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes a folder, retrying while another thread of this process may still be
/// creating files in it. Returns whether it is gone.
fn remove_tree(path: &Path) -> bool {
    for _ in 0..20 {
        match std::fs::remove_dir_all(path) {
            Ok(()) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
        }
    }
    !path.exists()
}

/// What [`abandon_all`] removed.
#[derive(Debug, Default)]
pub struct Abandoned {
    /// Staged and working folders of this process, removed with their contents.
    pub unfinished: Vec<PathBuf>,
    /// Folders this process made to hold its outputs, removed because they
    /// were empty again (innermost first).
    pub parents: Vec<PathBuf>,
}

/// Removes every staged folder of this process that was not published, and stops
/// any later [`StagedFolder::publish`] (it fails with "interrupted"). Meant for a
/// signal handler that exits right after. Returns what it removed.
pub fn abandon_all() -> Abandoned {
    let mut reg = registry();
    reg.abandoned = true;
    let mut active = std::mem::take(&mut reg.active);
    // Working folders that exist (one may not be made yet, or be gone).
    active.extend(
        std::mem::take(&mut reg.working)
            .into_iter()
            .filter(|p| p.exists()),
    );
    let unfinished: Vec<PathBuf> = active.into_iter().filter(|p| remove_tree(p)).collect();
    // The parents this process made for its outputs, innermost first, each
    // only when empty (`remove_dir` leaves a folder with anything in it).
    let parents = std::mem::take(&mut reg.created)
        .into_iter()
        .rev()
        .filter(|dir| std::fs::remove_dir(dir).is_ok())
        .collect();
    Abandoned {
        unfinished,
        parents,
    }
}

/// A private working folder of this process (named with its pid, e.g. the
/// sort's `.NAME.spikecube-detection-PID`): removed when this guard is
/// dropped, and by [`abandon_all`] on an interrupt.
#[derive(Debug)]
pub struct WorkingFolder(PathBuf);

impl WorkingFolder {
    /// Registers `.<out's name>.<tag>-<pid>` beside `out` (not made yet) as
    /// this process's own: the name [`remove_stale_working`] looks for.
    ///
    /// # Errors
    /// When `out` has no file name.
    pub fn beside(out: &Path, tag: &str) -> Result<WorkingFolder> {
        let (parent, name) = split(out)?;
        let path = parent.join(format!(
            ".{}.{tag}-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
        registry().working.push(path.clone());
        Ok(WorkingFolder(path))
    }

    /// The folder's path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for WorkingFolder {
    fn drop(&mut self) {
        registry().working.retain(|p| p != &self.0);
        if self.0.exists() {
            remove_tree(&self.0);
        }
    }
}

/// Removes working folders beside `out` named `.<out's name>.<tag>-<pid>`
/// (and their own `.partial-<pid>` staging folders) whose process no longer
/// runs: what a killed run leaves (`SIGKILL`, power loss), logging each.
/// Returns the folders removed.
///
/// # Errors
/// When such a folder cannot be removed.
pub fn remove_stale_working(out: &Path, tag: &str) -> Result<Vec<PathBuf>> {
    let (parent, name) = split(out)?;
    let prefix = format!(".{}.{tag}-", name.to_string_lossy());
    remove_dead(
        &parent,
        |n| {
            // `<pid>` or `<pid>.partial-<pid>`.
            let rest = n.strip_prefix(&prefix)?;
            rest.split_once(".partial-")
                .map_or(Some(rest), |(a, b)| (a == b).then_some(a))?
                .parse()
                .ok()
        },
        "the working folder of an interrupted run",
        true,
    )
}

/// Removes the entries of `parent` whose name `pid_of` maps to the id of a
/// process (not this one) that no longer runs, logging each as `what`; only
/// folders when `folders_only`. Returns the entries removed.
fn remove_dead(
    parent: &Path,
    pid_of: impl Fn(&str) -> Option<u32>,
    what: &str,
    folders_only: bool,
) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Ok(removed);
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(&pid_of) else {
            continue;
        };
        if pid == std::process::id() || process_alive(pid) {
            continue;
        }
        let path = e.path();
        let is_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if folders_only && !is_dir {
            continue;
        }
        let r = if is_dir {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        r.with_context(|| format!("cannot remove {}, {what} (process {pid})", path.display()))?;
        tracing::info!(
            "removed {}, {what} (process {pid} no longer runs)",
            path.display()
        );
        removed.push(path);
    }
    Ok(removed)
}

/// Whether process `pid` still runs (Unix: `kill(pid, 0)`; elsewhere always true,
/// so nothing is ever removed on a guess).
fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        if pid <= 0 {
            return true;
        }
        // SAFETY: signal 0 sends nothing; it only checks that the process exists.
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// The parent folder of `out` (`.` for a bare name) and `out`'s file name.
fn split(out: &Path) -> Result<(PathBuf, std::ffi::OsString)> {
    let name = out
        .file_name()
        .with_context(|| format!("output folder {} has no name", out.display()))?
        .to_os_string();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// Removes `<out>.partial-<pid>` folders beside `out` whose process no longer
/// runs, logging each. Returns the folders removed.
pub fn remove_stale(out: &Path) -> Result<Vec<PathBuf>> {
    let (parent, name) = split(out)?;
    let prefix = format!("{}.partial-", name.to_string_lossy());
    remove_dead(
        &parent,
        |n| n.strip_prefix(&prefix)?.parse().ok(),
        "left unfinished by an interrupted run",
        false,
    )
}

/// What stands at an output path before a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Existing {
    /// Nothing: the folder will be created.
    Nothing,
    /// An empty folder (replaced).
    Empty,
    /// An earlier result of the same subcommand, holding exactly these files
    /// (all listed in its `spikecube.json`; replaced).
    EarlierResult(Vec<String>),
}

/// Checks what stands at `out` against the rule in the module docs for a run of
/// subcommand `command`.
///
/// # Errors
/// When `out` is a file; a non-empty folder without a readable `spikecube.json`
/// that lists its files; an earlier result of another subcommand; or a folder
/// holding a file or folder its `spikecube.json` does not list (named in the
/// message).
pub fn check_target(out: &Path, command: &str) -> Result<Existing> {
    let meta = match std::fs::symlink_metadata(out) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Existing::Nothing),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", out.display())),
    };
    if !meta.is_dir() {
        bail!(
            "output folder {} already exists as a file; choose another --out",
            out.display()
        );
    }
    let mut names = Vec::new();
    for e in std::fs::read_dir(out).with_context(|| format!("cannot read {}", out.display()))? {
        let e = e.with_context(|| format!("cannot read {}", out.display()))?;
        let is_file = e.file_type().map(|t| t.is_file()).unwrap_or(false);
        names.push((e.file_name().to_string_lossy().into_owned(), is_file));
    }
    if names.is_empty() {
        return Ok(Existing::Empty);
    }
    names.sort();
    let manifest = out.join(MANIFEST);
    let parsed: Option<serde_json::Value> = std::fs::read_to_string(&manifest)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let Some(json) = parsed else {
        bail!(
            "output folder {} already exists and is not an earlier spikecube result (it has no readable {MANIFEST}; it holds {}); nothing was changed: choose another --out or empty it",
            out.display(),
            names[0].0
        );
    };
    let theirs = json.get("command").and_then(|c| c.as_str());
    let listed: Option<Vec<String>> = json.get("files").and_then(|f| f.as_array()).map(|a| {
        a.iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect()
    });
    let (Some(theirs), Some(listed)) = (theirs, listed) else {
        bail!(
            "output folder {} holds a {MANIFEST} without the list of files spikecube wrote (an older spikecube, or not a spikecube result); nothing was changed: choose another --out, or remove the folder yourself",
            out.display()
        );
    };
    if theirs != command {
        bail!(
            "output folder {} holds the result of `spikecube {theirs}`, not of `spikecube {command}`; nothing was changed: choose another --out",
            out.display()
        );
    }
    for (name, is_file) in &names {
        if !is_file || !listed.iter().any(|l| l == name) {
            bail!(
                "output folder {} holds {}, which is not among the files `spikecube {command}` wrote there; nothing was changed: move it away or choose another --out",
                out.display(),
                out.join(name).display()
            );
        }
    }
    if let Some(changed) = curated_labels(out) {
        bail!(
            "output folder {} holds curation: its cluster_group.tsv differs from the sort's own labels (cluster_KSLabel.tsv) for {}; nothing was changed: choose another --out, or move the folder away",
            out.display(),
            crate::error::count(changed as u64, "unit")
        );
    }
    Ok(Existing::EarlierResult(
        names.into_iter().map(|(n, _)| n).collect(),
    ))
}

/// For a sort's folder: how many units' `cluster_group.tsv` labels differ
/// from `cluster_KSLabel.tsv`'s, which the sort writes identical, so that a
/// difference is someone's curation (by hand or by a tool other than Phy,
/// which leaves its `.phy` folder); `None` when they agree or either file is
/// missing or unreadable.
fn curated_labels(out: &Path) -> Option<usize> {
    let rows = |name: &str| -> Option<Vec<(String, String)>> {
        let text = std::fs::read_to_string(out.join(name)).ok()?;
        Some(
            text.lines()
                .skip(1)
                .filter(|l| !l.trim().is_empty())
                .map(|l| {
                    let mut f = l.split('\t');
                    let id = f.next().unwrap_or("").trim().to_string();
                    let label = f.next().unwrap_or("").trim().to_string();
                    (id, label)
                })
                .collect(),
        )
    };
    let group = rows("cluster_group.tsv")?;
    let ks = rows("cluster_KSLabel.tsv")?;
    let ks: std::collections::HashMap<_, _> = ks.into_iter().collect();
    let changed = group
        .iter()
        .filter(|(id, label)| ks.get(id) != Some(label))
        .count()
        + ks.len().saturating_sub(group.len());
    (changed > 0).then_some(changed)
}

/// Creates the folder that will hold `out` (and its parents) when it does
/// not exist, with a warning once it is made: a mistyped `--out` would
/// otherwise grow folders unseen. An interrupt ([`abandon_all`]) removes the
/// folders made here again when they are empty.
///
/// # Errors
/// When `out` has no name, its parent is a file, or the folder cannot be
/// created (`out` is named, as the user gave it).
pub fn make_parent(out: &Path) -> Result<()> {
    let (parent, _) = split(out)?;
    if parent.exists() && !parent.is_dir() {
        bail!(
            "cannot create the output folder {}: {} is a file, not a folder",
            out.display(),
            parent.display()
        );
    }
    if parent.exists() {
        return Ok(());
    }
    // The folders about to be made, outermost first.
    let mut missing: Vec<PathBuf> = parent
        .ancestors()
        .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
        .map(Path::to_path_buf)
        .collect();
    missing.reverse();
    std::fs::create_dir_all(&parent).with_context(|| {
        format!(
            "cannot create the output folder {}: cannot create {}",
            out.display(),
            parent.display()
        )
    })?;
    registry().created.extend(missing);
    tracing::info!(
        "the output folder's parent {} did not exist; it was created",
        parent.display()
    );
    Ok(())
}

/// An output folder being written under a temporary name (see the module docs).
#[derive(Debug)]
pub struct StagedFolder {
    out: PathBuf,
    tmp: PathBuf,
    command: String,
}

impl StagedFolder {
    /// Checks `out` for a run of subcommand `command` ([`check_target`]), removes
    /// stale temporary folders beside it ([`remove_stale`]) and creates
    /// `<out>.partial-<pid>` (and `out`'s parent folders).
    ///
    /// # Errors
    /// As [`check_target`]; when `out` has no name, its parent is a file, or a
    /// folder cannot be created.
    pub fn create(out: &Path, command: &str) -> Result<Self> {
        let (parent, name) = split(out)?;
        check_target(out, command)?;
        make_parent(out)?;
        remove_stale(out)?;
        let mut tmp_name = name;
        tmp_name.push(format!(".partial-{}", std::process::id()));
        let tmp = parent.join(tmp_name);
        {
            let mut reg = registry();
            if reg.abandoned {
                bail!("interrupted");
            }
            if tmp.exists() {
                // Ours, from an earlier staged folder of this process that failed.
                std::fs::remove_dir_all(&tmp)
                    .with_context(|| format!("cannot remove stale {}", tmp.display()))?;
            }
            std::fs::create_dir(&tmp).with_context(|| {
                format!(
                    "cannot create the output folder {} (written first as {})",
                    out.display(),
                    tmp.display()
                )
            })?;
            reg.active.push(tmp.clone());
        }
        Ok(StagedFolder {
            out: out.to_path_buf(),
            tmp,
            command: command.to_string(),
        })
    }

    /// The temporary folder to write into.
    pub fn path(&self) -> &Path {
        &self.tmp
    }

    /// The final folder.
    pub fn out(&self) -> &Path {
        &self.out
    }

    /// Writes `spikecube.json` (the fields of `manifest`, a JSON object, plus
    /// `command` and `files`, the sorted names of every file in the folder) and
    /// renames the folder to its final name, replacing an earlier result only now.
    ///
    /// # Errors
    /// When `manifest` is not an object, the folder holds anything but plain
    /// files, the final folder no longer passes [`check_target`] (a file was
    /// added meanwhile: it is left as it is), the process is being interrupted,
    /// or a write or rename fails. The temporary folder is then removed.
    pub fn publish(mut self, manifest: serde_json::Value) -> Result<PathBuf> {
        let serde_json::Value::Object(mut map) = manifest else {
            bail!("the {MANIFEST} contents must be a JSON object");
        };
        let mut files = vec![MANIFEST.to_string()];
        for e in std::fs::read_dir(&self.tmp)
            .with_context(|| format!("cannot read {}", self.tmp.display()))?
        {
            let e = e.with_context(|| format!("cannot read {}", self.tmp.display()))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if !e.file_type().map(|t| t.is_file()).unwrap_or(false) {
                bail!("{} is not a plain file", e.path().display());
            }
            if name != MANIFEST {
                files.push(name);
            }
        }
        files.sort();
        map.insert("command".into(), self.command.clone().into());
        map.insert("files".into(), files.into());
        let text = serde_json::to_string_pretty(&serde_json::Value::Object(map))
            .context("cannot encode spikecube.json")?;
        let manifest_path = self.tmp.join(MANIFEST);
        std::fs::write(&manifest_path, text + "\n")
            .with_context(|| format!("cannot write {}", manifest_path.display()))?;

        let mut reg = registry();
        if reg.abandoned {
            bail!("interrupted");
        }
        let existing = check_target(&self.out, &self.command)?;
        let out = &self.out;
        match existing {
            Existing::Nothing => {
                std::fs::rename(&self.tmp, out).with_context(|| {
                    format!("cannot rename {} to {}", self.tmp.display(), out.display())
                })?;
            }
            Existing::Empty | Existing::EarlierResult(_) => {
                let old_files = match existing {
                    Existing::EarlierResult(f) => f,
                    _ => Vec::new(),
                };
                let mut old_name = out.file_name().unwrap_or_default().to_os_string();
                old_name.push(format!(".old-{}", std::process::id()));
                let old = out.with_file_name(old_name);
                std::fs::rename(out, &old).with_context(|| {
                    format!(
                        "cannot move the earlier {} aside to {}",
                        out.display(),
                        old.display()
                    )
                })?;
                if let Err(e) = std::fs::rename(&self.tmp, out) {
                    // Put the earlier result back.
                    let _ = std::fs::rename(&old, out);
                    return Err(e).with_context(|| {
                        format!("cannot rename {} to {}", self.tmp.display(), out.display())
                    });
                }
                // Only the files checked above, then the (then empty) folder.
                for f in &old_files {
                    let _ = std::fs::remove_file(old.join(f));
                }
                if let Err(e) = std::fs::remove_dir(&old) {
                    tracing::warn!(
                        "the earlier result was moved to {} but could not be removed: {e}",
                        old.display()
                    );
                }
            }
        }
        reg.active.retain(|p| p != &self.tmp);
        drop(reg);
        self.tmp = PathBuf::new();
        Ok(self.out.clone())
    }
}

impl Drop for StagedFolder {
    /// Removes the temporary folder when it was not published.
    fn drop(&mut self) {
        if self.tmp.as_os_str().is_empty() {
            return;
        }
        let mut reg = registry();
        reg.active.retain(|p| p != &self.tmp);
        remove_tree(&self.tmp);
    }
}
