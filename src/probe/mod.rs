//! Probe geometry: where each recording site sits, which shank it is on and which
//! column of the recording file holds it.
//!
//! Loaders: Kilosort's probe JSON ([`Probe::from_kilosort_json`]), probeinterface
//! JSON ([`Probe::from_probeinterface_json`]), `.prb` files ([`prb`]) and
//! [`Probe::parse`], which picks one by content. [`Probe::load`], which also
//! reads the geometry in a SpikeGLX `.meta`, is defined with the recordings
//! (`recording/probe_file.rs`) so that this module needs none of them. Every loader ends in [`Probe::validate`], so a `Probe` in hand is
//! always consistent: 1-D arrays of equal length, finite coordinates, unique
//! channel indices within `n_chan`.

mod kilosort;
pub mod prb;
mod probeinterface;

use std::path::{Path, PathBuf};

use crate::error::ProbeError;

/// A probe: `n_sites` recording sites with positions in µm.
///
/// Field names follow Kilosort4's probe dictionary. Coordinates are stored as
/// `f32` because Kilosort4 casts them to float32 before detection, and every
/// derived quantity (template centres, distances) starts from those values.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Probe {
    /// Horizontal site position, µm, one per site (Kilosort: `xc`).
    pub xc: Vec<f32>,
    /// Vertical site position (depth along the shank), µm, one per site (Kilosort: `yc`).
    pub yc: Vec<f32>,
    /// Shank id of each site (Kilosort: `kcoords`). Sites on different shanks are
    /// never neighbours of the same template centre unless the grid says so.
    pub kcoords: Vec<i64>,
    /// Column of the recording file that holds each site, 0-based (Kilosort: `chanMap`).
    pub chan_map: Vec<u64>,
    /// Number of channels (columns) in the recording file (Kilosort: `n_chan`).
    pub n_chan: u64,
    /// Where the probe came from (file path or a description), for messages.
    #[serde(skip)]
    pub source: PathBuf,
}

impl Probe {
    /// Number of sites in use (rows of a window).
    pub fn n_sites(&self) -> usize {
        self.xc.len()
    }

    /// Parses probe text already in memory; `path` is used in messages only.
    ///
    /// # Errors
    /// As [`Probe::load`].
    pub fn parse(text: &str, path: &Path) -> Result<Probe, ProbeError> {
        let json: serde_json::Value = serde_json::from_str(text).map_err(|e| ProbeError::Parse {
            path: path.to_owned(),
            message: format!(
                "not valid JSON ({e}); expected a Kilosort probe (chanMap, xc, yc, kcoords, n_chan) or a probeinterface file"
            ),
        })?;
        if json.get("probes").is_some() {
            probeinterface::from_value(&json, path)
        } else {
            kilosort::from_value(&json, path)
        }
    }

    /// Parses a `.prb` file's text (as data, never executed); see [`prb`].
    ///
    /// # Errors
    /// [`ProbeError`] naming the line or the field.
    pub fn parse_prb(text: &str, path: &Path) -> Result<Probe, ProbeError> {
        prb::parse(text, path)
    }

    /// Loads Kilosort4's probe JSON (`chanMap`, `xc`, `yc`, `kcoords`, `n_chan`),
    /// as written by `kilosort.io.save_probe`.
    ///
    /// # Errors
    /// [`ProbeError`] naming the file and field.
    pub fn from_kilosort_json(path: &Path) -> Result<Probe, ProbeError> {
        kilosort::from_value(&read_json(path)?, path)
    }

    /// Loads the first probe of a probeinterface JSON file (`contact_positions`,
    /// `shank_ids`, `device_channel_indices`).
    ///
    /// # Errors
    /// [`ProbeError`] naming the file and field.
    pub fn from_probeinterface_json(path: &Path) -> Result<Probe, ProbeError> {
        probeinterface::from_value(&read_json(path)?, path)
    }

    /// Checks the invariants every consumer relies on.
    ///
    /// # Errors
    /// [`ProbeError::Field`] when arrays differ in length, a coordinate is not
    /// finite, a channel index repeats or is not below `n_chan`, or there are no sites.
    pub fn validate(&self) -> Result<(), ProbeError> {
        let err = |field: &str, message: String| ProbeError::Field {
            path: self.source.clone(),
            field: field.to_owned(),
            message,
        };
        let n = self.xc.len();
        if n == 0 {
            return Err(err("xc", "the probe has no sites".into()));
        }
        for (field, len) in [
            ("yc", self.yc.len()),
            ("kcoords", self.kcoords.len()),
            ("chanMap", self.chan_map.len()),
        ] {
            if len != n {
                return Err(err(
                    field,
                    format!("has {len} entries but xc has {n}; every site needs one of each"),
                ));
            }
        }
        for (field, v) in [("xc", &self.xc), ("yc", &self.yc)] {
            if let Some((i, x)) = v.iter().enumerate().find(|(_, x)| !x.is_finite()) {
                return Err(err(field, format!("entry {i} is {x}, not a finite number")));
            }
        }
        let mut seen = vec![usize::MAX; n];
        let mut order: Vec<(u64, usize)> = self.chan_map.iter().copied().zip(0..).collect();
        order.sort_unstable();
        for w in order.windows(2) {
            if w[0].0 == w[1].0 {
                return Err(err(
                    "chanMap",
                    format!(
                        "channel {} is used by sites {} and {}; channel indices must be unique",
                        w[0].0, w[0].1, w[1].1
                    ),
                ));
            }
        }
        seen.clear();
        if let Some((i, c)) = self
            .chan_map
            .iter()
            .enumerate()
            .find(|&(_, &c)| c >= self.n_chan)
        {
            return Err(err(
                "chanMap",
                format!(
                    "site {i} reads channel {c}, but the file has n_chan = {} channels (0..{})",
                    self.n_chan,
                    self.n_chan.saturating_sub(1)
                ),
            ));
        }
        Ok(())
    }

    /// Minimal and maximal coordinate of the sites: `(xmin, xmax, ymin, ymax)` in µm.
    pub fn extent(&self) -> (f32, f32, f32, f32) {
        let fold = |v: &[f32]| {
            v.iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
                    (lo.min(x), hi.max(x))
                })
        };
        let (x0, x1) = fold(&self.xc);
        let (y0, y1) = fold(&self.yc);
        (x0, x1, y0, y1)
    }
}

/// Reads a JSON file, with errors naming it.
fn read_json(path: &Path) -> Result<serde_json::Value, ProbeError> {
    let text = std::fs::read_to_string(path).map_err(|source| ProbeError::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ProbeError::Parse {
        path: path.to_owned(),
        message: format!("not valid JSON: {e}"),
    })
}
