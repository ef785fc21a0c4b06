//! Where a run ran: the host, the device, the job engine's ids (Slurm) and the
//! GPUs the engine handed the process (`CUDA_VISIBLE_DEVICES`), recorded as
//! `"provenance"` in every `spikecube.json` a detection writes.
//!
//! spikecube never picks GPUs: the CUDA back end opens device 0 of whatever
//! `CUDA_VISIBLE_DEVICES` exposes, so the variable (set by Slurm's `--gres`,
//! by Ray, or by hand) is what says which physical GPU a task used.

use serde::{Deserialize, Serialize};

/// Environment variables recorded as they were (absent ones as `null`): the
/// job engine's ids and the GPUs it handed the process.
pub const RECORDED_ENV: [&str; 6] = [
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_RESTART_COUNT",
    "SLURM_JOB_NODELIST",
    "CUDA_VISIBLE_DEVICES",
];

/// A run that is one task of a `spikecube batch` run folder
/// ([`crate::batch`]): which line of which manifest it ran, and the settings
/// hash that says whether a later task may skip it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Task {
    /// The run folder (absolute), holding `manifest.tsv`.
    pub run: std::path::PathBuf,
    /// The manifest line's index (the Slurm array index).
    pub index: usize,
    /// The line's name (its output folder is `out/<name>`).
    pub name: String,
    /// [`crate::batch::Line::settings_hash`] of the line, 16 hex digits.
    pub settings_hash: String,
}

/// The host's name (`gethostname`), or `None` when it cannot be read.
pub fn host_name() -> Option<String> {
    #[cfg(unix)]
    {
        let mut buf = [0u8; 256];
        // SAFETY: the buffer is valid for its length; the name is NUL-terminated
        // when it fits (a truncated one is cut at the buffer's end below).
        let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        if r != 0 {
            return None;
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        let name = String::from_utf8_lossy(&buf[..end]).into_owned();
        (!name.is_empty()).then_some(name)
    }
    #[cfg(not(unix))]
    {
        std::env::var("COMPUTERNAME").ok()
    }
}

/// The `"provenance"` object of `spikecube.json`: `host`, `device` (the device
/// name the back end reported, e.g. "NVIDIA H200" or "CPU, 8 threads"), `env`
/// (each of [`RECORDED_ENV`], a string or `null`) and, for a batch task,
/// `batch` ([`Task`]).
pub fn record(device: Option<&str>, task: Option<&Task>) -> serde_json::Value {
    let env: serde_json::Map<String, serde_json::Value> = RECORDED_ENV
        .iter()
        .map(|k| {
            let v = std::env::var(k)
                .ok()
                .map_or(serde_json::Value::Null, Into::into);
            ((*k).to_string(), v)
        })
        .collect();
    let mut v = serde_json::json!({
        "host": host_name(),
        "device": device,
        "env": env,
    });
    if let Some(t) = task {
        v["batch"] = serde_json::to_value(t).unwrap_or(serde_json::Value::Null);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_names_every_variable_and_the_task() {
        let t = Task {
            run: "/runs/week49".into(),
            index: 2,
            name: "rec3".into(),
            settings_hash: "0123456789abcdef".into(),
        };
        let v = record(Some("CPU, 2 threads"), Some(&t));
        assert_eq!(v["device"], "CPU, 2 threads");
        for k in RECORDED_ENV {
            assert!(v["env"].get(k).is_some(), "{k} missing from {v}");
        }
        assert_eq!(v["batch"]["index"], 2);
        assert_eq!(v["batch"]["settings_hash"], "0123456789abcdef");
        let back: Task = serde_json::from_value(v["batch"].clone()).unwrap();
        assert_eq!(back, t);
        assert!(record(None, None).get("batch").is_none());
    }

    #[test]
    fn host_name_is_read() {
        #[cfg(unix)]
        assert!(host_name().is_some_and(|h| !h.is_empty()));
    }
}
