//! SpikeGLX: `.bin` + `.meta`, and probe geometry from the metadata.
//!
//! The `.meta` file is `key=value` lines; keys starting with `~` hold tables.
//! Facts used here:
//!
//! * `nSavedChans`: columns in the `.bin` (int16, sample-major);
//! * `imSampRate` (or `niSampRate` for NI-DAQ files): the calibrated rate, Hz,
//!   usually not an integer;
//! * `snsSaveChanSubset`: which acquired channels were saved, `all` or a list of
//!   ranges such as `0:383,768` (inclusive); saved channels appear in the file in
//!   increasing order, AP channels first, then LF, then sync;
//! * `snsApLfSy`: how many saved channels are AP, LF and sync;
//! * `fileSizeBytes`: the size the writer intended (checked against the file);
//! * `~snsGeomMap` (newer SpikeGLX): per AP channel `(shank:x:z:used)` with a
//!   header `(part,n_shanks,shank_pitch,shank_width)`, one entry per saved AP
//!   channel; x from the shank's left
//!   edge, z from the tip row, µm;
//! * `~imroTbl`: per AP channel the electrode it reads; with the part's layout
//!   facts ([`super::np_parts`]) this gives positions when there is no geom map;
//! * `~snsShankMap` (older SpikeGLX): per saved AP channel `(shank:col:row:used)`;
//!   only its `used` flag is used here.
//!
//! `~snsGeomMap` and `~snsShankMap` list the *saved* AP channels in file order;
//! `~imroTbl` lists every acquired channel. Sites marked unused (`used` = 0, e.g.
//! reference electrodes) are left out of the probe.
//!
//! Positions from the imro table put the leftmost electrode column of shank 0 at
//! x = 0 (as probeinterface's library does); shank s is moved right by
//! s × shank pitch. Positions from a geom map of a known part are shifted the same
//! way, so both routes agree.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::binary::{BinaryParams, BinaryRecording, PartialFrame};
use super::np_parts::{IMRO_TYPES, NP_PARTS, NpPart};
use super::{Dtype, OpenOptions, Opened};
use crate::error::RecordingError;
use crate::probe::Probe;

/// A parsed SpikeGLX `.meta` file.
#[derive(Debug, Clone, PartialEq)]
pub struct Meta {
    /// The `.meta` file.
    pub path: PathBuf,
    /// Every `key=value` line, keys as written (including a leading `~`).
    pub fields: BTreeMap<String, String>,
    /// Columns in the `.bin` (`nSavedChans`).
    pub n_saved_chans: u64,
    /// Sampling rate, Hz (`imSampRate`, or `niSampRate` for NI-DAQ files).
    pub fs: f64,
    /// Acquired channel number of each saved column, in file order
    /// (`snsSaveChanSubset`), `n_saved_chans` entries.
    pub saved_channels: Vec<u64>,
    /// Saved AP, LF and sync channel counts (`snsApLfSy`); `None` for NI-DAQ files.
    pub ap_lf_sy: Option<[u64; 3]>,
    /// Intended size of the `.bin`, bytes (`fileSizeBytes`), if given.
    pub file_size_bytes: Option<u64>,
}

fn meta_err(path: &Path, field: &str, message: impl Into<String>) -> RecordingError {
    RecordingError::Meta {
        path: path.to_owned(),
        field: field.to_owned(),
        message: message.into(),
    }
}

/// Reads and parses a `.meta` file.
///
/// # Errors
/// [`RecordingError::Io`] when it cannot be read; [`RecordingError::Meta`] naming
/// the field that is missing or malformed.
pub fn parse_meta(path: &Path) -> Result<Meta, RecordingError> {
    let bytes = std::fs::read(path).map_err(|source| RecordingError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_meta_text(&String::from_utf8_lossy(&bytes), path)
}

/// Parses `.meta` text already in memory; `path` is used in messages only.
///
/// # Errors
/// As [`parse_meta`].
pub fn parse_meta_text(text: &str, path: &Path) -> Result<Meta, RecordingError> {
    let mut fields = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            fields.insert(k.trim().to_owned(), v.trim().to_owned());
        }
    }
    let get = |k: &str| {
        fields
            .get(k)
            .or_else(|| fields.get(&format!("~{k}")))
            .map(String::as_str)
    };
    let n_saved_chans: u64 = get("nSavedChans")
        .ok_or_else(|| {
            meta_err(
                path,
                "nSavedChans",
                "missing; it gives the number of columns in the .bin",
            )
        })?
        .parse()
        .map_err(|e| meta_err(path, "nSavedChans", format!("not a channel count: {e}")))?;
    if n_saved_chans == 0 || n_saved_chans > 100_000 {
        return Err(meta_err(
            path,
            "nSavedChans",
            format!("{n_saved_chans} is not a usable channel count"),
        ));
    }
    let (rate_key, rate) = match get("imSampRate") {
        Some(r) => ("imSampRate", r),
        None => (
            "niSampRate",
            get("niSampRate").ok_or_else(|| {
                meta_err(path, "imSampRate", "missing (and no niSampRate either)")
            })?,
        ),
    };
    let fs: f64 = rate
        .parse()
        .map_err(|e| meta_err(path, rate_key, format!("`{rate}` is not a rate: {e}")))?;
    if !(fs.is_finite() && fs > 0.0) {
        return Err(meta_err(
            path,
            rate_key,
            format!("{fs} Hz is not a usable rate"),
        ));
    }
    let subset = get("snsSaveChanSubset").unwrap_or("all");
    let saved_channels = parse_channel_subset(subset, n_saved_chans)
        .map_err(|m| meta_err(path, "snsSaveChanSubset", m))?;
    if saved_channels.len() as u64 != n_saved_chans {
        return Err(meta_err(
            path,
            "snsSaveChanSubset",
            format!(
                "`{subset}` lists {} channels but nSavedChans = {n_saved_chans}",
                saved_channels.len()
            ),
        ));
    }
    let ap_lf_sy = match get("snsApLfSy") {
        None => None,
        Some(s) => {
            let v: Vec<u64> = s
                .split(',')
                .map(|x| x.trim().parse::<u64>())
                .collect::<Result<_, _>>()
                .map_err(|e| meta_err(path, "snsApLfSy", format!("`{s}`: {e}")))?;
            let [a, l, y] = v[..] else {
                return Err(meta_err(
                    path,
                    "snsApLfSy",
                    format!("`{s}` should be three counts: AP,LF,SY"),
                ));
            };
            if a.checked_add(l).and_then(|x| x.checked_add(y)) != Some(n_saved_chans) {
                return Err(meta_err(
                    path,
                    "snsApLfSy",
                    format!("{a} AP + {l} LF + {y} sync channels ≠ nSavedChans = {n_saved_chans}"),
                ));
            }
            Some([a, l, y])
        }
    };
    let file_size_bytes = match get("fileSizeBytes") {
        None => None,
        Some(s) => Some(
            s.parse::<u64>()
                .map_err(|e| meta_err(path, "fileSizeBytes", format!("`{s}`: {e}")))?,
        ),
    };
    Ok(Meta {
        path: path.to_owned(),
        fields,
        n_saved_chans,
        fs,
        saved_channels,
        ap_lf_sy,
        file_size_bytes,
    })
}

/// Parses `snsSaveChanSubset`: `all` (→ `0..n_saved`) or comma-separated channels
/// and inclusive ranges `a:b`. The result is sorted and free of repeats.
///
/// # Errors
/// A message when an item is not a number or a range runs backwards, or the list
/// is unreasonably long.
pub fn parse_channel_subset(s: &str, n_saved: u64) -> Result<Vec<u64>, String> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("all") {
        return Ok((0..n_saved).collect());
    }
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        let num = |x: &str| {
            x.trim()
                .parse::<u64>()
                .map_err(|e| format!("`{x}` in `{s}` is not a channel number: {e}"))
        };
        let (a, b) = match item.split_once(':') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(item)?, num(item)?),
        };
        if b < a {
            return Err(format!("range `{item}` runs backwards"));
        }
        if out.len() as u64 + (b - a + 1) > 1_000_000 {
            return Err(format!("`{s}` lists more than a million channels"));
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// A parsed `~imroTbl`.
#[derive(Debug, Clone, PartialEq)]
pub struct Imro {
    /// Probe type from the header (`0`, `21`, `24`, `1100`, `2013`, ...); `None`
    /// for a phase-3A header `(serial,option,n)`.
    pub type_id: Option<u32>,
    /// One entry per channel: the integers of each `( ... )` group.
    pub entries: Vec<Vec<i64>>,
}

/// Splits `(a)(b)(c)` into `["a", "b", "c"]`.
fn groups(s: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some(r) = rest.strip_prefix('(') else {
            return Err(format!(
                "expected `(` at `{}`",
                rest.chars().take(20).collect::<String>()
            ));
        };
        let end = r.find(')').ok_or("a `(` is never closed")?;
        out.push(&r[..end]);
        rest = r[end + 1..].trim_start();
    }
    Ok(out)
}

/// Parses an imro table (the value of `~imroTbl`, or the text of a `.imro` file).
///
/// # Errors
/// A message when the groups are malformed or an entry holds a non-integer.
pub fn parse_imro(text: &str) -> Result<Imro, String> {
    let g = groups(text)?;
    let (header, body) = g.split_first().ok_or("the table is empty")?;
    let h: Vec<&str> = header.split(',').map(str::trim).collect();
    let type_id = if h.len() >= 3 {
        None
    } else {
        let t = h[0].trim_start_matches("NP");
        Some(
            t.parse::<u32>()
                .map_err(|e| format!("header `({header})`: type `{}`: {e}", h[0]))?,
        )
    };
    let entries = body
        .iter()
        .map(|e| {
            e.split_whitespace()
                .map(|x| {
                    x.parse::<i64>()
                        .map_err(|err| format!("entry `({e})`: {err}"))
                })
                .collect::<Result<Vec<i64>, String>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Imro { type_id, entries })
}

/// The part facts for a part number, if known.
pub fn np_part(part: &str) -> Option<&'static NpPart> {
    NP_PARTS.iter().find(|p| p.part == part)
}

/// A site position: shank, x and y in µm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Site {
    /// Acquired AP channel number.
    pub channel: u64,
    /// Shank index.
    pub shank: i64,
    /// Horizontal position, µm.
    pub x: f32,
    /// Vertical position, µm.
    pub y: f32,
    /// Whether the metadata marks the site as used.
    pub used: bool,
}

impl Imro {
    /// imro format name (`imro_np1000`, ...) and default part of this table's type.
    pub fn format(&self) -> Result<(&'static str, &'static str), String> {
        match self.type_id {
            None => Ok(("imro_np1000", "NP1000")),
            Some(t) => IMRO_TYPES
                .iter()
                .find(|(id, _, _)| *id == t)
                .map(|&(_, f, p)| (f, p))
                .ok_or_else(|| format!("imro type {t} is not a known Neuropixels type")),
        }
    }

    /// Positions of every entry. `part` overrides the part implied by the type
    /// (e.g. from `imDatPrb_pn`) when it is a known part number.
    ///
    /// # Errors
    /// A message for an unknown type, an unsupported format (UHD `imro_np1110`
    /// needs `~snsGeomMap`), short entries or electrodes/shanks out of range.
    pub fn sites(&self, part: Option<&str>) -> Result<Vec<Site>, String> {
        let (format, default_part) = self.format()?;
        let p = part
            .and_then(np_part)
            .or_else(|| np_part(default_part))
            .ok_or_else(|| format!("part {default_part} has no layout facts"))?;
        let min_off = p.even_row_offset.min(p.odd_row_offset);
        let need = match format {
            "imro_np1000" => 2,
            "imro_np2000" | "imro_np2003" | "imro_np3010" => 4,
            "imro_np2010" | "imro_np2013" | "imro_np2020" | "imro_np3020" => 5,
            other => {
                return Err(format!(
                    "{other} tables (part {}) do not give electrode positions directly; SpikeGLX ≥ 20230202 writes ~snsGeomMap, which is used when present",
                    p.part
                ));
            }
        };
        let mut out = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            if e.len() < need {
                return Err(format!(
                    "entry ({}) has {} fields; {format} entries have at least {need}",
                    e.iter()
                        .map(|x| x.to_string())
                        .collect::<Vec<_>>()
                        .join(" "),
                    e.len()
                ));
            }
            let channel = e[0];
            let (shank, electrode) = match need {
                2 => (
                    0,
                    e[1].saturating_mul(p.num_readout_channels as i64)
                        .saturating_add(channel),
                ),
                4 => (0, e[3]),
                _ => (e[1], e[4]),
            };
            if channel < 0 {
                return Err(format!("channel {channel} is negative"));
            }
            if !(0..p.electrodes_per_shank as i64).contains(&electrode) {
                return Err(format!(
                    "channel {channel} reads electrode {electrode}, but part {} has electrodes 0..{}",
                    p.part,
                    p.electrodes_per_shank - 1
                ));
            }
            if !(0..p.num_shanks as i64).contains(&shank) {
                return Err(format!(
                    "channel {channel} is on shank {shank}, but part {} has {} shank(s)",
                    p.part, p.num_shanks
                ));
            }
            let cols = p.cols_per_shank.max(1) as i64;
            let (row, col) = (electrode / cols, electrode % cols);
            let off = if row % 2 == 0 {
                p.even_row_offset
            } else {
                p.odd_row_offset
            };
            out.push(Site {
                channel: channel as u64,
                shank,
                x: shank as f32 * p.shank_pitch + col as f32 * p.pitch_horz + (off - min_off),
                y: row as f32 * p.pitch_vert,
                used: true,
            });
        }
        Ok(out)
    }
}

/// Parses `~snsGeomMap` into one site per entry, in the order of the entries
/// (`channel` = entry index; entries follow the saved AP channels).
///
/// # Errors
/// A message when the header or an entry is malformed.
pub fn parse_geom_map(text: &str) -> Result<Vec<Site>, String> {
    let g = groups(text)?;
    let (header, body) = g.split_first().ok_or("the map is empty")?;
    let h: Vec<&str> = header.split(',').map(str::trim).collect();
    if h.len() < 3 {
        return Err(format!(
            "header `({header})` should be (part,n_shanks,shank_pitch,shank_width)"
        ));
    }
    let pitch: f32 = h[2]
        .parse()
        .map_err(|e| format!("header `({header})`: shank pitch: {e}"))?;
    let shift = np_part(h[0])
        .map(|p| p.even_row_offset.min(p.odd_row_offset))
        .unwrap_or(0.0);
    body.iter()
        .enumerate()
        .map(|(k, e)| {
            let f: Vec<&str> = e.split(':').collect();
            if f.len() != 4 {
                return Err(format!("entry `({e})` should be shank:x:z:used"));
            }
            let shank: i64 = f[0]
                .trim()
                .parse()
                .map_err(|err| format!("entry `({e})`: {err}"))?;
            let x: f32 = f[1]
                .trim()
                .parse()
                .map_err(|err| format!("entry `({e})`: {err}"))?;
            let z: f32 = f[2]
                .trim()
                .parse()
                .map_err(|err| format!("entry `({e})`: {err}"))?;
            let used = f[3].trim() != "0";
            Ok(Site {
                channel: k as u64,
                shank,
                x: shank as f32 * pitch + x - shift,
                y: z,
                used,
            })
        })
        .collect()
}

/// Parses the `used` flags of `~snsShankMap`, one per entry.
fn parse_shank_map_used(text: &str) -> Result<Vec<bool>, String> {
    let g = groups(text)?;
    let (_, body) = g.split_first().ok_or("the map is empty")?;
    body.iter()
        .map(|e| {
            e.rsplit(':')
                .next()
                .map(|u| u.trim() != "0")
                .ok_or_else(|| format!("entry `({e})` is empty"))
        })
        .collect()
}

impl Meta {
    /// A field by name, with or without the leading `~`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields
            .get(key)
            .or_else(|| self.fields.get(&format!("~{key}")))
            .map(String::as_str)
    }

    /// The `.bin` beside this `.meta`.
    pub fn bin_path(&self) -> PathBuf {
        self.path.with_extension("bin")
    }

    /// File columns of the saved AP channels, in file order, with their acquired
    /// channel numbers: `(column, channel)`. Sync and LF columns are left out.
    ///
    /// # Errors
    /// [`RecordingError::Meta`] when `snsApLfSy` is missing (not an imec file).
    pub fn ap_columns(&self) -> Result<Vec<(u64, u64)>, RecordingError> {
        let [n_ap, _, _] = self.ap_lf_sy.ok_or_else(|| {
            meta_err(
                &self.path,
                "snsApLfSy",
                "missing; probe geometry needs an imec (Neuropixels) AP file",
            )
        })?;
        Ok(self
            .saved_channels
            .iter()
            .take(n_ap as usize)
            .enumerate()
            .map(|(col, &ch)| (col as u64, ch))
            .collect())
    }

    /// Probe geometry of the saved AP channels: one site per saved AP channel marked
    /// used, `chan_map` = its file column, `n_chan` = `nSavedChans`, positions from
    /// `~snsGeomMap` when present, else from `~imroTbl` (module docs). The sync
    /// channel is never a site.
    ///
    /// # Errors
    /// [`RecordingError::Meta`] when the tables are missing, malformed, of an
    /// unsupported type, or do not cover a saved channel; [`RecordingError::Probe`]
    /// if the result fails [`Probe::validate`].
    pub fn probe(&self) -> Result<Probe, RecordingError> {
        let cols = self.ap_columns()?;
        if cols.is_empty() {
            return Err(meta_err(
                &self.path,
                "snsApLfSy",
                "no AP channels were saved (an LF-only file?); there are no sites",
            ));
        }
        let n_ap = cols.len();
        // Tables listed per saved AP channel (geom map, shank map) are indexed by the
        // AP column; tables listed per acquired channel by the channel number.
        let pick = |len: usize, k: usize, ch: u64| -> Option<usize> {
            if len == n_ap {
                Some(k)
            } else if (ch as usize) < len {
                Some(ch as usize)
            } else {
                None
            }
        };
        let mut chosen: Vec<Site> = Vec::with_capacity(n_ap);
        if let Some(g) = self.get("snsGeomMap") {
            let sites = parse_geom_map(g).map_err(|m| meta_err(&self.path, "~snsGeomMap", m))?;
            for (k, &(col, ch)) in cols.iter().enumerate() {
                let i = pick(sites.len(), k, ch).ok_or_else(|| {
                    meta_err(
                        &self.path,
                        "~snsGeomMap",
                        format!(
                            "saved AP channel {ch} (file column {col}) has no entry; the map has {} entries for {n_ap} saved AP channels",
                            sites.len()
                        ),
                    )
                })?;
                chosen.push(Site {
                    channel: ch,
                    ..sites[i]
                });
            }
        } else {
            let t = self.get("imroTbl").ok_or_else(|| {
                meta_err(
                    &self.path,
                    "~imroTbl",
                    "missing, and there is no ~snsGeomMap: the site positions are unknown",
                )
            })?;
            let imro = parse_imro(t).map_err(|m| meta_err(&self.path, "~imroTbl", m))?;
            let sites = imro
                .sites(self.get("imDatPrb_pn"))
                .map_err(|m| meta_err(&self.path, "~imroTbl", m))?;
            let by_channel: BTreeMap<u64, Site> = sites.iter().map(|s| (s.channel, *s)).collect();
            let used = match self.get("snsShankMap") {
                Some(sm) => Some(
                    parse_shank_map_used(sm)
                        .map_err(|m| meta_err(&self.path, "~snsShankMap", m))?,
                ),
                None => None,
            };
            for (k, &(col, ch)) in cols.iter().enumerate() {
                let mut s = *by_channel.get(&ch).ok_or_else(|| {
                    meta_err(
                        &self.path,
                        "~imroTbl",
                        format!(
                            "saved AP channel {ch} (file column {col}) has no entry; the table has {} entries",
                            sites.len()
                        ),
                    )
                })?;
                if let Some(u) = &used
                    && let Some(i) = pick(u.len(), k, ch)
                {
                    s.used = u[i];
                }
                chosen.push(s);
            }
        }
        let mut probe = Probe {
            xc: vec![],
            yc: vec![],
            kcoords: vec![],
            chan_map: vec![],
            n_chan: self.n_saved_chans,
            source: self.path.clone(),
        };
        for (&(col, _), s) in cols.iter().zip(&chosen) {
            if !s.used {
                continue;
            }
            probe.xc.push(s.x);
            probe.yc.push(s.y);
            probe.kcoords.push(s.shank);
            probe.chan_map.push(col);
        }
        probe.validate()?;
        Ok(probe)
    }
}

/// The `.bin` and `.meta` of a SpikeGLX path given as either.
pub fn bin_and_meta(path: &Path) -> (PathBuf, PathBuf) {
    if path.extension().is_some_and(|e| e == "meta") {
        (path.with_extension("bin"), path.to_owned())
    } else {
        (path.to_owned(), path.with_extension("meta"))
    }
}

/// Opens a SpikeGLX recording (`.bin` or `.meta` path).
///
/// The sample count is `floor(bytes / (nSavedChans · 2))`; a partial last frame is
/// ignored with a warning, and a size that differs from `fileSizeBytes` is
/// reported with a warning. The probe comes from [`Meta::probe`]; when that fails
/// the reason is logged and `probe` is `None`.
///
/// # Errors
/// [`RecordingError::Missing`] when the `.meta` is absent; the errors of
/// [`parse_meta`]; [`RecordingError::Setting`] when `opts.n_channels` disagrees
/// with `nSavedChans`; [`RecordingError::Io`] for the `.bin`.
pub fn open(path: &Path, opts: &OpenOptions) -> Result<Opened, RecordingError> {
    let (bin, meta_path) = bin_and_meta(path);
    if !meta_path.is_file() {
        return Err(RecordingError::Missing {
            path: meta_path,
            message: format!(
                "no such file: the SpikeGLX metadata of {} was looked for here; it gives the channel count and rate (put the .meta beside the .bin, or read the file as flat binary with --n-channels and --fs)",
                bin.display()
            ),
        });
    }
    let meta = parse_meta(&meta_path)?;
    super::check_against_metadata(
        opts,
        &bin,
        &meta_path,
        ("nSavedChans", meta.n_saved_chans),
        ("imSampRate", meta.fs),
    )?;
    // A --dtype other than int16 is read past: `Opened::overridden` says so,
    // once, naming what was read.
    let rec = BinaryRecording::open(
        &bin,
        &BinaryParams {
            n_channels: meta.n_saved_chans,
            fs: meta.fs,
            dtype: Dtype::Int16,
            offset: 0,
            scale: opts.scale,
            shift: opts.shift,
            partial_frame: PartialFrame::Warn,
        },
    )?;
    let real = std::fs::metadata(&bin)
        .map_err(|source| RecordingError::Io {
            path: bin.clone(),
            source,
        })?
        .len();
    if let Some(declared) = meta.file_size_bytes
        && declared != real
    {
        let frame = meta.n_saved_chans * 2;
        super::open_warning(format!(
            "{}: the file holds {real} bytes but {} declares fileSizeBytes = {declared} ({} vs {} samples of {} channels); using the real size: {} whole samples",
            bin.display(),
            meta_path.display(),
            real as f64 / frame as f64,
            declared as f64 / frame as f64,
            meta.n_saved_chans,
            real / frame
        ));
    }
    let probe = match meta.probe() {
        Ok(p) => Some(p),
        Err(e) => {
            super::open_warning(format!(
                "{}: no probe geometry from the SpikeGLX metadata: {e}",
                meta_path.display()
            ));
            None
        }
    };
    Ok(Opened {
        recording: Arc::new(rec),
        probe,
        bit_volts: None,
        first_sample_number: None,
        dtype: Dtype::Int16,
        offset: 0,
        warnings: Vec::new(),
    })
}
