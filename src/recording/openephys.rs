//! Open Ephys binary format: `structure.oebin` (JSON) describing continuous
//! streams, each `continuous/<folder_name>/continuous.dat` (int16, sample-major,
//! `num_channels` channels) with an optional `sample_numbers.npy` (int64, one per
//! sample) beside it.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::binary::{BinaryParams, BinaryRecording, PartialFrame};
use super::{Dtype, OpenOptions, Opened};
use crate::error::RecordingError;

/// One continuous stream of a `structure.oebin`.
#[derive(Debug, Clone, PartialEq)]
pub struct Stream {
    /// Folder under `continuous/` (`folder_name`, trailing `/` removed).
    pub folder_name: String,
    /// Stream name (`stream_name`), empty if absent.
    pub stream_name: String,
    /// Sampling rate, Hz (`sample_rate`).
    pub sample_rate: f64,
    /// Channels in `continuous.dat` (`num_channels`).
    pub num_channels: u64,
    /// µV per count of each channel (`channels[i].bit_volts`), `num_channels` entries.
    pub bit_volts: Vec<f64>,
}

/// A parsed `structure.oebin`.
#[derive(Debug, Clone, PartialEq)]
pub struct Oebin {
    /// The `structure.oebin` file.
    pub path: PathBuf,
    /// Its continuous streams, in file order.
    pub streams: Vec<Stream>,
}

fn field_err(path: &Path, field: &str, message: impl Into<String>) -> RecordingError {
    RecordingError::Meta {
        path: path.to_owned(),
        field: field.to_owned(),
        message: message.into(),
    }
}

/// Parses `structure.oebin` text; `path` is used in messages only.
///
/// # Errors
/// [`RecordingError::Meta`] naming the field (`continuous[i].sample_rate`, ...)
/// that is missing or malformed.
pub fn parse_oebin_text(text: &str, path: &Path) -> Result<Oebin, RecordingError> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| field_err(path, "(file)", format!("not valid JSON: {e}")))?;
    let cont = v
        .get("continuous")
        .and_then(|c| c.as_array())
        .ok_or_else(|| field_err(path, "continuous", "missing or not a list"))?;
    let mut streams = Vec::new();
    for (i, s) in cont.iter().enumerate() {
        let f = |name: &str| format!("continuous[{i}].{name}");
        let folder_name = s
            .get("folder_name")
            .and_then(|x| x.as_str())
            .ok_or_else(|| field_err(path, &f("folder_name"), "missing or not text"))?
            .trim_end_matches('/')
            .to_owned();
        if folder_name.is_empty()
            || Path::new(&folder_name)
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(field_err(
                path,
                &f("folder_name"),
                format!("`{folder_name}` is not a plain folder name"),
            ));
        }
        let sample_rate = s
            .get("sample_rate")
            .and_then(|x| x.as_f64())
            .filter(|r| r.is_finite() && *r > 0.0)
            .ok_or_else(|| {
                field_err(path, &f("sample_rate"), "missing or not a positive number")
            })?;
        let num_channels = s
            .get("num_channels")
            .and_then(|x| x.as_u64())
            .filter(|&n| n > 0 && n <= 100_000)
            .ok_or_else(|| field_err(path, &f("num_channels"), "missing or not a channel count"))?;
        let chans = s.get("channels").and_then(|x| x.as_array());
        let bit_volts = match chans {
            Some(c) => {
                if c.len() as u64 != num_channels {
                    return Err(field_err(
                        path,
                        &f("channels"),
                        format!(
                            "lists {} channels but num_channels = {num_channels}",
                            c.len()
                        ),
                    ));
                }
                c.iter()
                    .enumerate()
                    .map(|(j, ch)| {
                        ch.get("bit_volts").and_then(|b| b.as_f64()).ok_or_else(|| {
                            field_err(
                                path,
                                &format!("continuous[{i}].channels[{j}].bit_volts"),
                                "missing or not a number",
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None => {
                return Err(field_err(path, &f("channels"), "missing or not a list"));
            }
        };
        streams.push(Stream {
            folder_name,
            stream_name: s
                .get("stream_name")
                .and_then(|x| x.as_str())
                .unwrap_or("")
                .to_owned(),
            sample_rate,
            num_channels,
            bit_volts,
        });
    }
    if streams.is_empty() {
        return Err(field_err(path, "continuous", "lists no continuous streams"));
    }
    Ok(Oebin {
        path: path.to_owned(),
        streams,
    })
}

/// Finds `structure.oebin`: the path itself, or inside the folder, or (uniquely)
/// up to three folder levels below it (Record Node / experiment / recording).
///
/// # Errors
/// [`RecordingError::Missing`] when none or several are found.
pub fn find_oebin(path: &Path) -> Result<PathBuf, RecordingError> {
    if path.is_file() {
        return Ok(path.to_owned());
    }
    let mut found = Vec::new();
    let mut level = vec![path.to_owned()];
    for _ in 0..4 {
        let mut next = Vec::new();
        for d in &level {
            let f = d.join("structure.oebin");
            if f.is_file() {
                found.push(f);
            }
            if let Ok(rd) = std::fs::read_dir(d) {
                let mut subs: Vec<PathBuf> = rd
                    .filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect();
                subs.sort();
                next.extend(subs);
            }
        }
        if !found.is_empty() {
            break;
        }
        level = next;
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => {
            // A folder of a SpikeGLX or flat binary recording: name its files.
            let mut bins: Vec<String> = std::fs::read_dir(path)
                .map(|rd| {
                    rd.filter_map(|e| e.ok())
                        .map(|e| e.path())
                        .filter(|p| {
                            p.is_file()
                                && p.extension()
                                    .is_some_and(|e| e == "bin" || e == "dat" || e == "raw")
                        })
                        .map(|p| p.display().to_string())
                        .collect()
                })
                .unwrap_or_default();
            bins.sort();
            let hint = if bins.is_empty() {
                String::new()
            } else {
                format!(
                    "; a folder is read as Open Ephys: for a binary recording give its file ({})",
                    bins.join(", ")
                )
            };
            Err(RecordingError::Missing {
                path: path.join("structure.oebin"),
                message: format!("no structure.oebin in this folder or three levels below{hint}"),
            })
        }
        _ => Err(RecordingError::Missing {
            path: path.to_owned(),
            message: format!(
                "several recordings found ({}); give the path of one structure.oebin",
                found
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

/// Reads element 0 of a 1-D int64 (or uint64/int32) `.npy` file without loading the rest.
///
/// # Errors
/// [`RecordingError::Meta`] naming the file when it is not such an array or is empty.
pub fn first_npy_int(path: &Path) -> Result<i64, RecordingError> {
    let bad = |m: String| field_err(path, "(npy header)", m);
    let mut f = std::fs::File::open(path).map_err(|source| RecordingError::Io {
        path: path.to_owned(),
        source,
    })?;
    let mut head = [0u8; 10];
    f.read_exact(&mut head)
        .map_err(|e| bad(format!("too short for an .npy file: {e}")))?;
    if &head[..6] != b"\x93NUMPY" {
        return Err(bad("not an .npy file (bad magic)".into()));
    }
    let hlen = if head[6] == 1 {
        u16::from_le_bytes([head[8], head[9]]) as usize
    } else {
        let mut two = [0u8; 2];
        f.read_exact(&mut two)
            .map_err(|e| bad(format!("truncated header: {e}")))?;
        u32::from_le_bytes([head[8], head[9], two[0], two[1]]) as usize
    };
    if hlen > 1 << 20 {
        return Err(bad(format!("header of {hlen} bytes is implausible")));
    }
    let mut h = vec![0u8; hlen];
    f.read_exact(&mut h)
        .map_err(|e| bad(format!("truncated header: {e}")))?;
    let h = String::from_utf8_lossy(&h);
    let descr = h
        .split("'descr':")
        .nth(1)
        .and_then(|r| r.split('\'').nth(1))
        .ok_or_else(|| bad(format!("no descr in header {h}")))?;
    let size = match descr {
        "<i8" | "<u8" => 8,
        "<i4" | "<u4" => 4,
        d => return Err(bad(format!("dtype {d}; expected little-endian int64"))),
    };
    let mut b = [0u8; 8];
    f.read_exact(&mut b[..size])
        .map_err(|_| bad("the array is empty".into()))?;
    Ok(match descr {
        "<i8" => i64::from_le_bytes(b),
        "<u8" => u64::from_le_bytes(b) as i64,
        "<i4" => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
        _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
    })
}

/// Opens an Open Ephys recording: `path` is a `structure.oebin` or a folder holding
/// one (see [`find_oebin`]). `opts.stream` picks a stream by folder or stream
/// name; otherwise the first is used (with a warning if there are several).
///
/// # Errors
/// [`RecordingError::Missing`] for a missing oebin, stream or `continuous.dat`;
/// [`RecordingError::Setting`] when `opts.n_channels` disagrees with
/// `num_channels`; the errors of [`parse_oebin_text`].
pub fn open(path: &Path, opts: &OpenOptions) -> Result<Opened, RecordingError> {
    let oebin_path = find_oebin(path)?;
    let text = std::fs::read_to_string(&oebin_path).map_err(|source| RecordingError::Io {
        path: oebin_path.clone(),
        source,
    })?;
    let oebin = parse_oebin_text(&text, &oebin_path)?;
    let stream = match &opts.stream {
        Some(name) => oebin
            .streams
            .iter()
            .find(|s| s.folder_name == *name || s.stream_name == *name)
            .ok_or_else(|| RecordingError::Missing {
                path: oebin_path.clone(),
                message: format!(
                    "no continuous stream `{name}`; streams: {}",
                    oebin
                        .streams
                        .iter()
                        .map(|s| s.folder_name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?,
        None => {
            if oebin.streams.len() > 1 {
                super::open_warning(format!(
                    "{}: {} continuous streams; using the first, {}",
                    oebin_path.display(),
                    oebin.streams.len(),
                    oebin.streams[0].folder_name
                ));
            }
            &oebin.streams[0]
        }
    };
    let dir = oebin_path
        .parent()
        .unwrap_or(Path::new("."))
        .join("continuous")
        .join(&stream.folder_name);
    let dat = dir.join("continuous.dat");
    if !dat.is_file() {
        return Err(RecordingError::Missing {
            path: dat,
            message: format!(
                "the data of stream `{}` listed in {}",
                stream.folder_name,
                oebin_path.display()
            ),
        });
    }
    super::check_against_metadata(
        opts,
        &dat,
        &oebin_path,
        ("num_channels", stream.num_channels),
        ("the stream's sample_rate", stream.sample_rate),
    )?;
    let rec = BinaryRecording::open(
        &dat,
        &BinaryParams {
            n_channels: stream.num_channels,
            fs: stream.sample_rate,
            dtype: Dtype::Int16,
            offset: 0,
            scale: opts.scale,
            shift: opts.shift,
            partial_frame: PartialFrame::Warn,
        },
    )?;
    let sn = dir.join("sample_numbers.npy");
    let first_sample_number = if sn.is_file() {
        Some(first_npy_int(&sn)?)
    } else {
        None
    };
    Ok(Opened {
        recording: Arc::new(rec),
        probe: None,
        bit_volts: Some(stream.bit_volts.clone()),
        first_sample_number,
        dtype: Dtype::Int16,
        offset: 0,
        warnings: Vec::new(),
    })
}
