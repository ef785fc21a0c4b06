//! Many recordings as independent tasks for a job engine (Slurm arrays,
//! Snakemake): a run folder, its manifest, one task per line, a summary.
//!
//! ```text
//! RUN/manifest.tsv     one line per recording, written once (`batch plan`)
//! RUN/out/<name>/      a task's output: exactly what `spikecube detect` writes
//! RUN/logs/            the engine's logs; <index>.error when a task failed
//! RUN/summary.tsv      one line per task (`batch collect`)
//! ```
//!
//! A task is a pure function of (manifest, index): it never picks nodes,
//! GPUs (it uses what `CUDA_VISIBLE_DEVICES` exposes), order or retries. Its
//! output appears only when complete ([`crate::output::folder`]), and a task
//! whose complete output already holds the line's settings hash
//! ([`Line::settings_hash`]) is skipped, so requeued and resumed runs are safe.

pub mod check;
pub mod collect;
pub mod manifest;
pub mod plan;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

pub use check::{State, check_output};
pub use collect::{Row, SUMMARY_TSV, collect, error_file};
pub use manifest::{Line, MANIFEST_TSV, Manifest};
pub use plan::{PlanArgs, Written, manifest_for, split_args, write_once};

/// One task, ready to run: its line, output folder, the output's state and
/// the provenance its `spikecube.json` will hold.
#[derive(Debug, Clone)]
pub struct Task {
    /// The manifest line.
    pub line: Line,
    /// The output folder, `RUN/out/<name>`.
    pub out: PathBuf,
    /// What is there now; [`State::Complete`] means skip.
    pub state: State,
    /// The run folder, line and settings hash, for `spikecube.json`.
    pub provenance: crate::provenance::Task,
}

impl Task {
    /// Line `index` of run folder `run`.
    ///
    /// # Errors
    /// When the manifest cannot be read or has no such line.
    pub fn load(run: &Path, index: usize) -> Result<Task> {
        let run = std::fs::canonicalize(run)
            .with_context(|| format!("cannot find the run folder {}", run.display()))?;
        let manifest = Manifest::read(&run)?;
        let line = manifest.line(index, &run)?.clone();
        let out = run.join(&line.out);
        let hash = line.settings_hash();
        let state = check_output(&out, &line.command, &hash);
        Ok(Task {
            provenance: crate::provenance::Task {
                run: run.clone(),
                index,
                name: line.name.clone(),
                settings_hash: hash,
            },
            line,
            out,
            state,
        })
    }

    /// The subcommand's command line (without the program name).
    pub fn argv(&self) -> Vec<std::ffi::OsString> {
        self.line.argv(&self.provenance.run)
    }

    /// Records the task's outcome: a failure's message in
    /// [`error_file`], removed on success (`None`).
    ///
    /// # Errors
    /// When the file cannot be written or removed.
    pub fn record_outcome(&self, error: Option<&str>) -> Result<()> {
        let path = error_file(&self.provenance.run, self.line.index);
        match error {
            Some(e) => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("cannot create {}", dir.display()))?;
                }
                std::fs::write(&path, format!("{e}\n"))
                    .with_context(|| format!("cannot write {}", path.display()))
            }
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(e).with_context(|| format!("cannot remove {}", path.display()))
                }
                _ => Ok(()),
            },
        }
    }
}
