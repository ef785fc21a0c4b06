//! Whether a task's output folder is complete, and with which settings.
//!
//! Complete means: `spikecube.json` reads and names the task's subcommand;
//! every file it lists is there; every `.npy` among them is as long as its
//! header says; `spike_times.npy` holds `counts.n_spikes` rows; and its
//! `provenance.batch.settings_hash` is the line's. The staged folders of
//! [`crate::output::folder`] make a half-written folder at the final path
//! impossible for spikecube itself; these checks catch what happens to a
//! folder afterwards (a copy cut short, a file removed, a disk error).

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::output::folder::MANIFEST;

/// The state of one task's output folder.
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    /// Complete, with the line's settings hash.
    Complete(Box<serde_json::Value>),
    /// Complete, but written with other settings (the hash it holds, or none:
    /// not written by a batch task).
    Stale(Option<String>),
    /// No output folder.
    Missing,
    /// A folder that is not a complete output: why.
    Incomplete(String),
}

impl State {
    /// One line for a person: `complete`, or what is wrong.
    pub fn describe(&self, out: &Path) -> String {
        match self {
            State::Complete(_) => "complete".into(),
            State::Stale(Some(h)) => format!(
                "{} was written with other settings (hash {h}): run the task again",
                out.display()
            ),
            State::Stale(None) => format!(
                "{} was not written by this run's task (no settings hash in its {MANIFEST}): run the task again",
                out.display()
            ),
            State::Missing => format!("no output at {}", out.display()),
            State::Incomplete(why) => format!("{} is incomplete: {why}", out.display()),
        }
    }
}

/// The bytes an `.npy` file should have from its header (version 1–3, any
/// plain dtype): header + product(shape) · itemsize. `None` with the reason
/// when the header cannot be read.
fn npy_expected_len(path: &Path) -> Result<u64, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let mut head = [0u8; 12];
    f.read_exact(&mut head)
        .map_err(|_| "too short for an .npy header".to_string())?;
    if &head[..6] != b"\x93NUMPY" {
        return Err("not an .npy file (no magic string)".into());
    }
    let (pre, hlen) = match head[6] {
        1 => (10u64, u64::from(u16::from_le_bytes([head[8], head[9]]))),
        2 | 3 => (
            12u64,
            u64::from(u32::from_le_bytes([head[8], head[9], head[10], head[11]])),
        ),
        v => return Err(format!(".npy version {v} is unknown")),
    };
    let mut dict = vec![0u8; hlen as usize];
    let mut f = std::fs::File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let mut skip = vec![0u8; pre as usize];
    f.read_exact(&mut skip)
        .and_then(|_| f.read_exact(&mut dict))
        .map_err(|_| "its header is cut short".to_string())?;
    let dict = String::from_utf8_lossy(&dict);
    let field = |key: &str, open: char, close: char| -> Option<String> {
        let at = dict.find(key)? + key.len();
        let rest = &dict[at..];
        let start = rest.find(open)? + 1;
        let end = start + rest[start..].find(close)?;
        Some(rest[start..end].to_string())
    };
    let item = descr_itemsize(&dict)?;
    let shape = field("'shape'", '(', ')').ok_or("its header has no shape")?;
    let mut n: u64 = 1;
    for d in shape.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        n = n.saturating_mul(
            d.parse::<u64>()
                .map_err(|_| format!("shape ({shape}) unreadable"))?,
        );
    }
    Ok(pre + hlen + n * item)
}

/// Bytes per element of an `.npy` header's `descr`: a plain type (`'<f4'`)
/// or a flat structured one (`[('a', '<i8'), ('b', '<f8')]`, the sum of its
/// fields).
fn descr_itemsize(dict: &str) -> Result<u64, String> {
    let at = dict.find("'descr'").ok_or("its header has no descr")? + "'descr'".len();
    let rest = dict[at..].trim_start_matches([':', ' ']);
    let region = if rest.starts_with('[') {
        &rest[..rest.find(']').ok_or("its descr is cut short")?]
    } else {
        let end = rest[1..].find('\'').ok_or("its descr is cut short")? + 2;
        &rest[..end]
    };
    let mut total = 0u64;
    for token in region.split('\'').skip(1).step_by(2) {
        let mut chars = token.chars();
        let (Some(order), Some(kind)) = (chars.next(), chars.next()) else {
            continue;
        };
        if !"<>|=".contains(order) || !kind.is_ascii_alphabetic() {
            continue;
        }
        let size: u64 = chars
            .as_str()
            .parse()
            .map_err(|_| format!("dtype {token:?} is not a plain number type"))?;
        total += size;
    }
    if total == 0 {
        return Err("its descr holds no number type".into());
    }
    Ok(total)
}

/// Rows of an `.npy` file (its shape's first number; 1 for a scalar).
fn npy_rows(path: &Path) -> Option<u64> {
    let mut f = std::fs::File::open(path).ok()?;
    let mut head = vec![0u8; 512];
    let n = f.read(&mut head).ok()?;
    let text = String::from_utf8_lossy(&head[..n]);
    let at = text.find("'shape'")?;
    let rest = &text[at..];
    let inner = &rest[rest.find('(')? + 1..rest.find(')')?];
    match inner.split(',').next().map(str::trim) {
        Some("") | None => Some(1),
        Some(d) => d.parse().ok(),
    }
}

/// Checks `out` as the output of subcommand `command` with settings hash
/// `hash` (see the module docs).
pub fn check_output(out: &Path, command: &str, hash: &str) -> State {
    match std::fs::metadata(out) {
        Err(_) => return State::Missing,
        Ok(m) if !m.is_dir() => return State::Incomplete("it is a file, not a folder".into()),
        Ok(_) => {}
    }
    let json: serde_json::Value = match std::fs::read_to_string(out.join(MANIFEST)) {
        Err(_) => return State::Incomplete(format!("it has no {MANIFEST}")),
        Ok(t) => match serde_json::from_str(&t) {
            Ok(v) => v,
            Err(e) => return State::Incomplete(format!("its {MANIFEST} does not read: {e}")),
        },
    };
    if json["command"] != command {
        return State::Incomplete(format!(
            "its {MANIFEST} is of `spikecube {}`, not `spikecube {command}`",
            json["command"].as_str().unwrap_or("?")
        ));
    }
    let Some(files) = json["files"].as_array() else {
        return State::Incomplete(format!("its {MANIFEST} lists no files"));
    };
    for name in files.iter().filter_map(|f| f.as_str()) {
        let p: PathBuf = out.join(name);
        let Ok(meta) = std::fs::metadata(&p) else {
            return State::Incomplete(format!("{name} is missing"));
        };
        if name.ends_with(".npy") {
            match npy_expected_len(&p) {
                Ok(want) if want == meta.len() => {}
                Ok(want) => {
                    return State::Incomplete(format!(
                        "{name} is {} bytes, its header says {want}",
                        meta.len()
                    ));
                }
                Err(why) => return State::Incomplete(format!("{name}: {why}")),
            }
        }
    }
    if let Some(n) = json["counts"]["n_spikes"].as_u64() {
        let rows = npy_rows(&out.join("spike_times.npy"));
        if rows != Some(n) {
            return State::Incomplete(format!(
                "spike_times.npy holds {} spikes, {MANIFEST} says {n}",
                rows.map_or("an unknown number of".into(), |r| r.to_string())
            ));
        }
    }
    match json["provenance"]["batch"]["settings_hash"].as_str() {
        Some(h) if h == hash => State::Complete(Box::new(json)),
        Some(h) => State::Stale(Some(h.to_string())),
        None => State::Stale(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(path: &Path, n: usize) {
        let a = ndarray::Array1::<i64>::from_iter(0..n as i64);
        crate::npy::write(path, &a).unwrap();
    }

    fn folder(dir: &Path, hash: Option<&str>) -> PathBuf {
        let out = dir.join("rec");
        std::fs::create_dir_all(&out).unwrap();
        npy(&out.join("spike_times.npy"), 5);
        let mut j = serde_json::json!({
            "command": "detect",
            "files": ["spike_times.npy", "spikecube.json"],
            "counts": {"n_spikes": 5},
            "provenance": {"host": "h"},
        });
        if let Some(h) = hash {
            j["provenance"]["batch"] = serde_json::json!({"settings_hash": h});
        }
        std::fs::write(out.join(MANIFEST), j.to_string()).unwrap();
        out
    }

    #[test]
    fn complete_stale_and_missing_outputs_are_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            check_output(&dir.path().join("rec"), "detect", "h1"),
            State::Missing
        );
        let out = folder(dir.path(), Some("h1"));
        assert!(matches!(
            check_output(&out, "detect", "h1"),
            State::Complete(_)
        ));
        assert_eq!(
            check_output(&out, "detect", "h2"),
            State::Stale(Some("h1".into()))
        );
        let out = folder(dir.path(), None);
        assert_eq!(check_output(&out, "detect", "h1"), State::Stale(None));
        assert!(matches!(
            check_output(&out, "sort", "h1"),
            State::Incomplete(_)
        ));
    }

    #[test]
    fn half_written_outputs_are_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let out = folder(dir.path(), Some("h"));
        let times = out.join("spike_times.npy");
        let full = std::fs::read(&times).unwrap();
        // Cut short.
        std::fs::write(&times, &full[..full.len() - 3]).unwrap();
        let s = check_output(&out, "detect", "h");
        assert!(
            matches!(&s, State::Incomplete(w) if w.contains("bytes, its header says")),
            "{s:?}"
        );
        // A consistent file with the wrong count.
        npy(&times, 4);
        let s = check_output(&out, "detect", "h");
        assert!(
            matches!(&s, State::Incomplete(w) if w.contains("holds 4 spikes")),
            "{s:?}"
        );
        // Gone.
        std::fs::remove_file(&times).unwrap();
        let s = check_output(&out, "detect", "h");
        assert!(
            matches!(&s, State::Incomplete(w) if w.contains("missing")),
            "{s:?}"
        );
        // No spikecube.json.
        std::fs::remove_file(out.join(MANIFEST)).unwrap();
        let s = check_output(&out, "detect", "h");
        assert!(
            s.describe(&out)
                .contains("incomplete: it has no spikecube.json"),
            "{s:?}"
        );
    }

    #[test]
    fn npy_lengths_follow_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        let a = ndarray::Array2::<f32>::zeros((3, 7));
        crate::npy::write(&p, &a).unwrap();
        assert_eq!(
            npy_expected_len(&p).unwrap(),
            std::fs::metadata(&p).unwrap().len()
        );
        assert_eq!(npy_rows(&p), Some(3));
        // A structured dtype (as peaks.npy): the fields' sizes add up.
        let dict = format!(
            "{{'descr': {}, 'fortran_order': False, 'shape': (2,), }}",
            crate::output::PEAK_DESCR
        );
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend((dict.len() as u16).to_le_bytes());
        bytes.extend(dict.as_bytes());
        bytes.extend([0u8; 64]);
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(npy_expected_len(&p).unwrap(), bytes.len() as u64);
        assert_eq!(descr_itemsize("{'descr': '|i1', }"), Ok(1));
        assert!(descr_itemsize("{'descr': 'O', }").is_err());
    }
}
