//! `spikecube batch collect`: one summary line per task, in `RUN/summary.tsv`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::check::{State, check_output};
use super::manifest::{Line, Manifest};

/// The summary's file name inside a run folder.
pub const SUMMARY_TSV: &str = "summary.tsv";

/// The summary's columns: `units` and `good_units` are a sort's units and
/// those labelled `good` (empty for a detection); `realtime` is seconds of
/// recording per second of the task's run; `warnings` counts the run's
/// warnings (listed in its `spikecube.json`); `job` is Slurm's
/// `<array job>_<index>` or job id.
pub const SUMMARY_COLUMNS: [&str; 14] = [
    "index",
    "name",
    "status",
    "spikes",
    "units",
    "good_units",
    "recording_s",
    "wall_s",
    "realtime",
    "warnings",
    "device",
    "host",
    "job",
    "problem",
];

/// Where a task that failed leaves its error: `RUN/logs/<index>.error`
/// (removed when the task later succeeds or is skipped).
pub fn error_file(run: &Path, index: usize) -> PathBuf {
    run.join("logs").join(format!("{index}.error"))
}

/// One task's line in the summary.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The manifest line.
    pub index: usize,
    /// Its name.
    pub name: String,
    /// `ok`, `failed`, `missing`, `incomplete` or `stale`.
    pub status: &'static str,
    /// What is wrong, for a status other than `ok` (empty otherwise).
    pub problem: String,
    /// The output's `spikecube.json`, when complete.
    pub json: Option<serde_json::Value>,
}

impl Row {
    /// Whether the task is done.
    pub fn ok(&self) -> bool {
        self.status == "ok"
    }

    fn tsv(&self) -> String {
        let j = self.json.as_ref().unwrap_or(&serde_json::Value::Null);
        let text = |v: &serde_json::Value| match v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => String::new(),
            v => v.to_string(),
        };
        let secs = j["input"]["duration_s"].as_f64();
        let wall = j["timings_s"]["total"].as_f64();
        let env = &j["provenance"]["env"];
        let job = match (
            env["SLURM_ARRAY_JOB_ID"].as_str(),
            env["SLURM_ARRAY_TASK_ID"].as_str(),
        ) {
            (Some(a), Some(t)) => format!("{a}_{t}"),
            _ => text(&env["SLURM_JOB_ID"]),
        };
        let clean = |s: String| s.replace(['\t', '\n', '\r'], " ");
        [
            self.index.to_string(),
            self.name.clone(),
            self.status.to_string(),
            text(&j["counts"]["n_spikes"]),
            text(&j["counts"]["units"]),
            text(&j["counts"]["good"]),
            secs.map(|s| format!("{s:.3}")).unwrap_or_default(),
            wall.map(|s| format!("{s:.3}")).unwrap_or_default(),
            match (secs, wall) {
                (Some(s), Some(w)) if w > 0.0 => format!("{:.2}", s / w),
                _ => String::new(),
            },
            j["warnings"]
                .as_array()
                .map(|a| a.len().to_string())
                .unwrap_or_default(),
            text(&j["provenance"]["device"]),
            text(&j["provenance"]["host"]),
            job,
            self.problem.clone(),
        ]
        .map(clean)
        .join("\t")
    }
}

/// The state of `line`'s task in run folder `run`, as a summary row.
pub fn row(run: &Path, line: &Line) -> Row {
    let out = run.join(&line.out);
    let state = check_output(&out, &line.command, &line.settings_hash());
    let error = std::fs::read_to_string(error_file(run, line.index)).ok();
    let (status, problem, json) = match state {
        State::Complete(j) => ("ok", String::new(), Some(*j)),
        other => {
            let status = match (&other, &error) {
                (_, Some(_)) => "failed",
                (State::Missing, None) => "missing",
                (State::Stale(_), None) => "stale",
                _ => "incomplete",
            };
            let mut problem = other.describe(&out);
            if let Some(e) = error {
                problem = format!("{} ({problem})", e.trim());
            }
            (status, problem, None)
        }
    };
    Row {
        index: line.index,
        name: line.name.clone(),
        status,
        problem,
        json,
    }
}

/// Checks every task of `run` and writes `run/summary.tsv` (replaced as a
/// whole, through a temporary file). Returns the rows in index order.
///
/// # Errors
/// When the manifest cannot be read or the summary cannot be written; tasks
/// that are not done are rows, not errors.
pub fn collect(run: &Path) -> Result<Vec<Row>> {
    let manifest = Manifest::read(run)?;
    let rows: Vec<Row> = manifest.lines.iter().map(|l| row(run, l)).collect();
    let mut text = SUMMARY_COLUMNS.join("\t");
    text.push('\n');
    for r in &rows {
        text.push_str(&r.tsv());
        text.push('\n');
    }
    let path = run.join(SUMMARY_TSV);
    let tmp = run.join(format!(".{SUMMARY_TSV}.{}", std::process::id()));
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(rows)
}
