//! `RUN/manifest.tsv`: one task per line, written once by `spikecube batch plan`.
//!
//! Tab-separated, a header line, then one line per task:
//!
//! | column | holds |
//! |---|---|
//! | `index` | 0, 1, 2, … in line order (the Slurm array index) |
//! | `command` | the subcommand the task runs (`detect` or `sort`) |
//! | `name` | the task's name; unique in the run |
//! | `inputs` | the recording's file(s) or folder, absolute, joined by `|` |
//! | `probe` | the probe file given to `--probe`, absolute; empty: the recording's metadata |
//! | `out` | the output folder, relative to the run folder (`out/<name>`) |
//! | `flags` | the subcommand's other flags, shell-quoted and joined by spaces |

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The manifest's file name inside a run folder.
pub const MANIFEST_TSV: &str = "manifest.tsv";

/// The header line's columns.
pub const COLUMNS: [&str; 7] = [
    "index", "command", "name", "inputs", "probe", "out", "flags",
];

/// Subcommands a task can run.
pub const COMMANDS: [&str; 2] = ["detect", "sort"];

/// One task: a subcommand run on one recording into `RUN/<out>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// Position in the manifest, from 0.
    pub index: usize,
    /// Subcommand, one of [`COMMANDS`].
    pub command: String,
    /// Unique name; the output folder is `out/<name>`.
    pub name: String,
    /// The recording's file(s) or folder (several are read one after the other).
    pub inputs: Vec<PathBuf>,
    /// `--probe`, or `None` for the geometry in the recording's metadata.
    pub probe: Option<PathBuf>,
    /// Output folder relative to the run folder.
    pub out: PathBuf,
    /// The subcommand's other flags, one argument each.
    pub flags: Vec<String>,
}

/// 64-bit FNV-1a over bytes: a stable hash (the same on every machine and
/// version of Rust), used only to tell settings apart, not for security.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Line {
    /// The hash of everything that decides the task's output: spikecube's
    /// version, the command, the name, the inputs, the probe and the flags
    /// (each field ended by a NUL byte), as 16 hex digits. A complete output
    /// holding the same hash is not computed again. The files' contents are
    /// not read: a recording replaced in place needs its output removed.
    pub fn settings_hash(&self) -> String {
        let mut fields: Vec<String> = vec![
            format!("spikecube {}", env!("CARGO_PKG_VERSION")),
            self.command.clone(),
            self.name.clone(),
        ];
        fields.extend(self.inputs.iter().map(|p| p.to_string_lossy().into_owned()));
        fields.push(format!(
            "probe={}",
            self.probe
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        fields.extend(self.flags.iter().cloned());
        let bytes = fields.iter().flat_map(|f| f.bytes().chain([0u8]));
        format!("{:016x}", fnv1a(bytes))
    }

    /// The command line the task runs, without the program name:
    /// `command INPUTS… --out OUT [--probe P] FLAGS…`, `OUT` under `run`.
    pub fn argv(&self, run: &Path) -> Vec<std::ffi::OsString> {
        let mut v: Vec<std::ffi::OsString> = vec![self.command.clone().into()];
        v.extend(self.inputs.iter().map(|p| p.clone().into_os_string()));
        v.push("--out".into());
        v.push(run.join(&self.out).into_os_string());
        if let Some(p) = &self.probe {
            v.push("--probe".into());
            v.push(p.clone().into_os_string());
        }
        v.extend(self.flags.iter().map(Into::into));
        v
    }

    fn to_tsv(&self) -> Result<String> {
        let path = |p: &Path| -> Result<String> {
            let s = p
                .to_str()
                .with_context(|| format!("{} is not valid UTF-8", p.display()))?;
            if s.contains(['\t', '\n', '\r', '|']) {
                bail!(
                    "{s:?} holds a tab, a line break or '|', which manifest.tsv cannot hold; rename it"
                );
            }
            Ok(s.to_string())
        };
        let inputs = self
            .inputs
            .iter()
            .map(|p| path(p))
            .collect::<Result<Vec<_>>>()?
            .join("|");
        let probe = self.probe.as_deref().map(path).transpose()?;
        let flags = shlex::try_join(self.flags.iter().map(String::as_str))
            .map_err(|e| anyhow::anyhow!("cannot write the flags {:?}: {e}", self.flags))?;
        if flags.contains(['\t', '\n', '\r']) {
            bail!("a flag holds a tab or a line break: {:?}", self.flags);
        }
        Ok([
            self.index.to_string(),
            self.command.clone(),
            self.name.clone(),
            inputs,
            probe.unwrap_or_default(),
            path(&self.out)?,
            flags,
        ]
        .join("\t"))
    }

    fn from_tsv(text: &str, where_: &str, expected_index: usize) -> Result<Line> {
        let cols: Vec<&str> = text.split('\t').collect();
        if cols.len() != COLUMNS.len() {
            bail!(
                "{where_}: {} columns, expected {} ({})",
                cols.len(),
                COLUMNS.len(),
                COLUMNS.join(", ")
            );
        }
        let index: usize = cols[0]
            .parse()
            .with_context(|| format!("{where_}: index {:?} is not a number", cols[0]))?;
        if index != expected_index {
            bail!(
                "{where_}: index {index}, expected {expected_index} (lines are numbered 0, 1, 2, … in order)"
            );
        }
        if !COMMANDS.contains(&cols[1]) {
            bail!(
                "{where_}: command {:?} is not one a task runs ({})",
                cols[1],
                COMMANDS.join(", ")
            );
        }
        if cols[2].is_empty() || cols[3].is_empty() || cols[5].is_empty() {
            bail!("{where_}: the name, inputs and out columns must not be empty");
        }
        let flags = shlex::split(cols[6])
            .with_context(|| format!("{where_}: cannot read the flags {:?}", cols[6]))?;
        Ok(Line {
            index,
            command: cols[1].to_string(),
            name: cols[2].to_string(),
            inputs: cols[3].split('|').map(PathBuf::from).collect(),
            probe: (!cols[4].is_empty()).then(|| PathBuf::from(cols[4])),
            out: PathBuf::from(cols[5]),
            flags,
        })
    }
}

/// The tasks of a run folder, in index order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// One per task; `lines[i].index == i`.
    pub lines: Vec<Line>,
}

impl Manifest {
    /// The file's text: the header and one line per task.
    ///
    /// # Errors
    /// When a path holds a tab, a line break or `|`, or is not UTF-8.
    pub fn to_tsv(&self) -> Result<String> {
        let mut s = COLUMNS.join("\t");
        s.push('\n');
        for l in &self.lines {
            s.push_str(&l.to_tsv()?);
            s.push('\n');
        }
        Ok(s)
    }

    /// Reads `run/manifest.tsv`.
    ///
    /// # Errors
    /// When the file is missing or unreadable, its header is not [`COLUMNS`],
    /// a line is malformed (named by its line number), the indices are not
    /// 0, 1, 2, … or two names repeat.
    pub fn read(run: &Path) -> Result<Manifest> {
        let path = run.join(MANIFEST_TSV);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "cannot read {} (make it with `spikecube batch plan INPUTS… --out {}`)",
                path.display(),
                run.display()
            )
        })?;
        let mut rows = text.lines();
        let header = rows.next().unwrap_or_default();
        if header != COLUMNS.join("\t") {
            bail!(
                "{} does not start with the header line of a spikecube manifest ({})",
                path.display(),
                COLUMNS.join(", ")
            );
        }
        let mut lines = Vec::new();
        for (i, row) in rows.enumerate() {
            if row.is_empty() {
                continue;
            }
            let where_ = format!("{} line {}", path.display(), i + 2);
            lines.push(Line::from_tsv(row, &where_, lines.len())?);
        }
        let mut names: Vec<&str> = lines.iter().map(|l| l.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            bail!("{}: the name {} appears twice", path.display(), w[0]);
        }
        Ok(Manifest { lines })
    }

    /// The line with index `index`.
    ///
    /// # Errors
    /// When there is none (the message gives the range there is).
    pub fn line(&self, index: usize, run: &Path) -> Result<&Line> {
        self.lines.get(index).with_context(|| {
            let range = match self.lines.len() {
                0 => "no tasks".to_string(),
                1 => "one task, index 0".to_string(),
                n => format!("tasks 0–{}", n - 1),
            };
            format!(
                "--index {index}: {} has {range}",
                run.join(MANIFEST_TSV).display()
            )
        })
    }
}

/// Names for recordings: each input's file name without `.bin`/`.dat`
/// (a folder keeps its name; `structure.oebin` and `continuous.dat` stand for
/// their folder), prefixed by as many parent folders (joined by `_`) as it
/// takes to make every name unique.
pub fn names_for(inputs: &[PathBuf]) -> Vec<String> {
    let parts = |p: &Path| -> Vec<String> {
        let mut comps: Vec<String> = p
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect();
        if let Some(last) = comps.last_mut() {
            for ext in [".bin", ".dat", ".oebin"] {
                if let Some(stem) = last.strip_suffix(ext)
                    && !stem.is_empty()
                {
                    *last = stem.to_string();
                    break;
                }
            }
        }
        comps.reverse();
        comps
    };
    let all: Vec<Vec<String>> = inputs.iter().map(|p| parts(p)).collect();
    let deepest = all.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let clean = |s: String| -> String {
        s.chars()
            .map(|c| {
                if c.is_control() || "/\\|:".contains(c) {
                    '_'
                } else {
                    c
                }
            })
            .collect()
    };
    for depth in 1..=deepest {
        let names: Vec<String> = all
            .iter()
            .map(|c| {
                let mut v: Vec<&str> = c.iter().take(depth).map(String::as_str).collect();
                v.reverse();
                clean(v.join("_"))
            })
            .collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() == names.len() && names.iter().all(|n| !n.is_empty()) {
            return names;
        }
    }
    // Same paths given twice: the index makes them unique.
    all.iter()
        .enumerate()
        .map(|(i, c)| clean(format!("{i}_{}", c.first().cloned().unwrap_or_default())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(i: usize) -> Line {
        Line {
            index: i,
            command: "detect".into(),
            name: format!("rec{i}"),
            inputs: vec![format!("/data/rec {i}/a.ap.bin").into()],
            probe: (i == 1).then(|| PathBuf::from("/p/probe.json")),
            out: format!("out/rec{i}").into(),
            flags: vec![
                "--backend".into(),
                "cpu".into(),
                "--th-universal".into(),
                "8.5".into(),
            ],
        }
    }

    #[test]
    fn manifest_round_trips_through_tsv() {
        let m = Manifest {
            lines: vec![line(0), line(1)],
        };
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(MANIFEST_TSV), m.to_tsv().unwrap()).unwrap();
        assert_eq!(Manifest::read(dir.path()).unwrap(), m);
        let err = m.line(2, dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("--index 2") && err.contains("tasks 0–1"),
            "{err}"
        );
    }

    #[test]
    fn bad_manifests_are_refused_with_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let head = COLUMNS.join("\t");
        let cases = [
            (
                format!("{head}\n1\tdetect\ta\t/x\t\tout/a\t\n"),
                "expected 0",
            ),
            (format!("{head}\n0\tsort9\ta\t/x\t\tout/a\t\n"), "command"),
            (format!("{head}\n0\tdetect\ta\t/x\n"), "4 columns"),
            (
                format!("{head}\n0\tdetect\ta\t/x\t\tout/a\t\n1\tdetect\ta\t/y\t\tout/a\t\n"),
                "appears twice",
            ),
            ("index\tname\n".to_string(), "header"),
        ];
        for (text, want) in cases {
            std::fs::write(dir.path().join(MANIFEST_TSV), &text).unwrap();
            let err = format!("{:#}", Manifest::read(dir.path()).unwrap_err());
            assert!(err.contains(want), "{text:?}: {err}");
        }
    }

    #[test]
    fn paths_with_tabs_are_refused() {
        let mut l = line(0);
        l.inputs = vec!["/a\tb.bin".into()];
        assert!(l.to_tsv().unwrap_err().to_string().contains("tab"));
    }

    #[test]
    fn settings_hash_changes_with_every_field() {
        let base = line(1);
        let h = base.settings_hash();
        assert_eq!(h.len(), 16);
        assert_eq!(h, line(1).settings_hash());
        let mut variants = Vec::new();
        let mut l = base.clone();
        l.flags[3] = "9".into();
        variants.push(l);
        let mut l = base.clone();
        l.probe = None;
        variants.push(l);
        let mut l = base.clone();
        l.inputs[0] = "/data/other.bin".into();
        variants.push(l);
        let mut l = base.clone();
        l.name = "recX".into();
        variants.push(l);
        // Moving a flag's boundary is a different setting too.
        let mut l = base.clone();
        l.flags = vec![
            "--backend cpu".into(),
            "--th-universal".into(),
            "8.5".into(),
        ];
        variants.push(l);
        for v in variants {
            assert_ne!(v.settings_hash(), h, "{v:?}");
        }
        // The index is where the line stands, not a setting.
        let mut l = base.clone();
        l.index = 7;
        assert_eq!(l.settings_hash(), h);
    }

    #[test]
    fn names_are_stems_made_unique_by_parent_folders() {
        let p = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        assert_eq!(
            names_for(&p(&["/d/a.ap.bin", "/d/b.ap.bin"])),
            ["a.ap", "b.ap"]
        );
        assert_eq!(
            names_for(&p(&[
                "/d/r1/sim.ap.bin",
                "/d/r2/sim.ap.bin",
                "/e/r3/sim.ap.bin"
            ])),
            ["r1_sim.ap", "r2_sim.ap", "r3_sim.ap"]
        );
        assert_eq!(
            names_for(&p(&["/x/s/rec", "/y/s/rec"])),
            ["x_s_rec", "y_s_rec"]
        );
        assert_eq!(names_for(&p(&["/d/a.bin", "/d/a.bin"])), ["0_a", "1_a"]);
    }
}
