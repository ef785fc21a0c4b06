//! The spike output folder: `.npy` arrays (Phy- and SpikeInterface-readable),
//! Phy's `params.py`, the provenance file `spikecube.json` and the drift map.
//!
//! [`OutputWriter`] streams detections to disk window by window, so memory does
//! not grow with the spike count (field failure BR-23), and publishes the
//! folder atomically through a [`folder::StagedFolder`]: everything is written
//! into a sibling folder `<out>.partial-<pid>`, which is renamed to `<out>` only
//! by [`OutputWriter::finish`]. A writer dropped without `finish` removes its
//! partial folder; a killed process leaves only the `.partial-<pid>` folder,
//! which never looks like a finished result and is removed by the next run into
//! the same place. An existing `<out>` is replaced only when it is an earlier
//! `detect` result holding nothing but the files it lists (see [`folder`]).
//!
//! # Files
//!
//! n = spikes, nC = sites per spike, npc = PCs per site, Nf = template
//! centres, n_sites = probe sites (rows of the whitened data, in the probe's
//! channel-map order). All arrays are little-endian `.npy` version 1.0.
//!
//! | file | dtype | shape | contents |
//! |---|---|---|---|
//! | `spike_times.npy` | int64 | (n,) | absolute sample index of each detection (Kilosort4's `st[:, 0]·fs`): the sample where the filter output peaks, about 10 samples after the spike's trough |
//! | `spike_centers.npy` | int64 | (n,) | template-centre index j, 0 ≤ j < Nf |
//! | `amplitudes.npy` | float32 | (n,) | best filter output \|A\| (whitened units) |
//! | `spike_detection_templates.npy` | int64 | (n,) | winning (size, template) pair, size·6 + template, 0–29 |
//! | `spike_signs.npy` | int8 | (n,) | +1 for a negative-going spike, −1 for an inverted one |
//! | `spike_positions.npy` | float32 | (n, 2) | x = centre x, y = amplitude-weighted depth (yct), µm |
//! | `pc_features.npy` | float32 | (n, nC, npc) | PC features of each spike on its centre's nC sites |
//! | `pc_feature_ind.npy` | int64 | (n, nC) | the site index (row of `channel_map.npy`) of each of those nC sites |
//! | `peaks.npy` | structured | (n,) | SpikeInterface peaks in SpikeInterface's conventions: `sample_index` = spike time − [`TROUGH_OFFSET`] (the trough), `channel_index` (the site, a row of `channel_map.npy`, where the winning template's output is largest), `amplitude` (float64, −sign·\|A\|, whitened units: negative for a trough-first spike), `segment_index` (0) |
//! | `template_centers.npy` | float64 | (Nf, 2) | centre x, y, µm |
//! | `center_channels.npy` | int64 | (Nf, nC) | the nC nearest sites of each centre, nearest first |
//! | `channel_map.npy` | int64 | (n_sites,) | column of the raw file read by each site |
//! | `channel_positions.npy` | float64 | (n_sites, 2) | site x, y, µm (float64 because Phy reads positions as floats) |
//! | `channel_shanks.npy` | int64 | (n_sites,) | the probe's own shank id of each site, unchanged, in channel-map order (BR-21) |
//! | `whitening_mat.npy` | float32 | (n_sites, n_sites) | the whitening matrix applied (identity when none was given) |
//! | `params.py` | text | | Phy's parameters (raw file, channels, dtype, offset, sample rate) |
//! | `spikecube.json` | JSON | | settings, versions, back end and device, input, sizes, warnings, timings, counts; `command` (`detect`) and `files` (every file spikecube wrote in the folder) |
//! | `drift_map.png` | PNG | 1400 × 900 | depth against time, coloured by amplitude |
//! | `wTEMP.npy`, `wPCA.npy` | float32 | (6, 61), (npc, 61) | the universal templates detection used, written by `run_detection` ([`crate::universal`]) |
//! | `templates.png` | PNG | 800 × 500 | the temporal templates (wTEMP) |
//!
//! Rows are in time order (then by centre) when windows are appended in time
//! order; `spikecube.json` records whether they were (`counts.time_sorted`).

mod drift_map;
pub mod folder;
pub mod npy_stream;
pub mod params;
pub mod plot;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ndarray::Array2;
use rayon::prelude::*;

pub use drift_map::{DEFAULT_CAPACITY, DriftAxes, DriftMap};
pub use npy_stream::NpyStream;
pub use params::Params;

use crate::detect::{Detections, Geometry};
use crate::probe::Probe;
use npy_stream::{LeBytes, write_all};

/// The `.npy` dtype text of SpikeInterface's peak records.
pub const PEAK_DESCR: &str = "[('sample_index', '<i8'), ('channel_index', '<i8'), ('amplitude', '<f8'), ('segment_index', '<i8')]";
/// Bytes per peak record.
pub const PEAK_BYTES: usize = 32;
/// Samples from a spike's trough to its detection time (Kilosort4's
/// convention, `spike_times.npy`): `nt/2 − nt0min` = 30 − 20 for the built-in
/// universal templates, whose trough is at sample `nt0min` of 61 and which
/// Kilosort4 correlates with `nt/2` samples of padding. `peaks.npy` gives
/// `spike_time − TROUGH_OFFSET` (at least 0), SpikeInterface's peak time.
pub const TROUGH_OFFSET: i64 = 10;

/// SpikeInterface's peak channel and amplitude of detection `i` (centre `j`):
/// the site of the centre's nC sites (`i_c`, nC × Nf) where the winning
/// temporal template's output |adist| is largest (the first on a tie), and the
/// signed amplitude −sign·|A| in whitened units (negative for a trough-first
/// spike, like a trace value at the trough).
pub fn peak_site_and_amplitude(
    det: &Detections,
    i: usize,
    i_c: &Array2<u32>,
    j: usize,
) -> (usize, f64) {
    let nc = det.n_chans;
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for c in 0..nc {
        let v = det.adist.get(i * nc + c).map_or(0.0, |v| v.abs());
        if v > best_v {
            best_v = v;
            best = c;
        }
    }
    let site = if nc == 0 { 0 } else { i_c[[best, j]] as usize };
    (site, -f64::from(det.sign[i]) * f64::from(det.amp[i]))
}

/// Number of (size, template) pairs a detection can report.
pub const N_DETECTION_TEMPLATES: usize = 30;

/// Disk bytes one spike takes in the output folder (all per-spike files), for
/// `n_chans` sites per spike (nC) and `n_pcs` PCs per site: 69 + nC·(4·npc + 8);
/// 389 bytes with the defaults (nC = 10, npc = 6). Multiply by an expected spike
/// count to estimate the folder's size before a run.
pub fn bytes_per_spike(n_chans: usize, n_pcs: usize) -> u64 {
    // times, centres, templates (i64); amplitudes (f32); signs (i8); positions (2 × f32); peaks.
    let fixed = 8 + 8 + 8 + 4 + 1 + 8 + PEAK_BYTES;
    (fixed + n_chans * (4 * n_pcs + 8)) as u64
}

/// Everything about a run that is known only at its end, for `params.py` and `spikecube.json`.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    /// Settings in force (detection, preprocessing, batching), as JSON.
    pub settings: serde_json::Value,
    /// Versions of the program and its parts (name → version).
    pub versions: BTreeMap<String, String>,
    /// Human description of the input (format, probe file, ...).
    pub input_description: String,
    /// Raw recording path, written into `params.py` as given.
    pub dat_path: PathBuf,
    /// The recording's further files, in order, when several were given
    /// (concatenated): the sort's `params.py` lists them after `dat_path`.
    pub more_dat_paths: Vec<PathBuf>,
    /// Channels (columns) in the raw file, including sync channels.
    pub n_channels_dat: u64,
    /// NumPy name of the raw sample type (`int16`, `uint16`, `float32`, ...).
    pub dtype: String,
    /// Header bytes before the first sample of the raw file.
    pub offset: u64,
    /// Sample rate, Hz.
    pub fs: f64,
    /// Samples per channel in the recording.
    pub n_samples: u64,
    /// Whether the raw file is already high-pass filtered.
    pub hp_filtered: bool,
    /// Wall-clock time per stage, seconds.
    pub timings: BTreeMap<String, f64>,
    /// Whitening matrix applied, n_sites × n_sites; empty when none (an identity is written).
    pub whitening: Array2<f32>,
    /// Warnings of the run (input checks), one line each; `"warnings"` in `spikecube.json`.
    pub warnings: Vec<String>,
    /// The `spikecube batch` task this run is, if any; with the host, device
    /// and job engine's ids it makes `"provenance"` in `spikecube.json`
    /// ([`crate::provenance::record`]).
    pub task: Option<crate::provenance::Task>,
}

/// What [`OutputWriter::finish`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The final folder.
    pub path: PathBuf,
    /// Spikes written.
    pub n_spikes: u64,
    /// Windows appended.
    pub n_windows: u64,
    /// Whether `spike_times.npy` is in non-decreasing order.
    pub time_sorted: bool,
    /// Spikes per detection template (size·6 + template), 30 counts.
    pub per_template: Vec<u64>,
}

/// The per-spike streams.
#[derive(Debug)]
struct Streams {
    times: NpyStream,
    centres: NpyStream,
    amps: NpyStream,
    templates: NpyStream,
    signs: NpyStream,
    positions: NpyStream,
    pcs: NpyStream,
    pc_ind: NpyStream,
    peaks: NpyStream,
}

/// Writes one spike output folder, window by window (see the module docs for the files).
///
/// Memory: one window's detections plus fixed buffers and the drift-map
/// subsample ([`DEFAULT_CAPACITY`] spikes), whatever the recording length.
#[derive(Debug)]
pub struct OutputWriter {
    out: PathBuf,
    tmp: PathBuf,
    staged: Option<folder::StagedFolder>,
    streams: Option<Streams>,
    n_sites: usize,
    n_chans: usize,
    n_pcs: usize,
    xcup: Vec<f64>,
    i_c: Array2<u32>,
    y_range: (f64, f64),
    n_spikes: u64,
    n_windows: u64,
    last_time: Option<i64>,
    first_time: Option<i64>,
    time_sorted: bool,
    per_template: Vec<u64>,
    drift: DriftMap,
    scratch: bool,
}

impl OutputWriter {
    /// Starts an output folder that will become `out`, writing into
    /// `<out>.partial-<pid>` beside it; the probe and geometry files are written now.
    ///
    /// `n_pcs` is the number of PC features per site (6 with the default settings).
    ///
    /// # Errors
    /// When `out` has no file name, the temporary folder cannot be created or a
    /// file cannot be written, or `geometry` does not fit `probe`.
    pub fn create(out: &Path, probe: &Probe, geometry: &Geometry, n_pcs: usize) -> Result<Self> {
        let staged = folder::StagedFolder::create(out, "detect")?;
        let tmp = staged.path().to_path_buf();

        let n_sites = probe.n_sites();
        let nc = geometry.n_chans();
        let nf = geometry.n_centres();
        if let Some(&bad) = geometry.i_c.iter().find(|&&s| s as usize >= n_sites) {
            bail!(
                "geometry names site {bad}, but the probe {} has {n_sites} sites",
                probe.source.display()
            );
        }
        let mut w = OutputWriter {
            out: out.to_path_buf(),
            tmp: tmp.clone(),
            staged: Some(staged),
            streams: None,
            n_sites,
            n_chans: nc,
            n_pcs,
            xcup: geometry.xcup.clone(),
            i_c: geometry.i_c.clone(),
            y_range: {
                let (_, _, y0, y1) = probe.extent();
                (y0 as f64, y1 as f64)
            },
            n_spikes: 0,
            n_windows: 0,
            last_time: None,
            first_time: None,
            time_sorted: true,
            per_template: vec![0; N_DETECTION_TEMPLATES],
            drift: DriftMap::new(DEFAULT_CAPACITY),
            scratch: false,
        };
        // From here on, dropping `w` removes the temporary folder on error.
        let f = |n: &str| tmp.join(n);
        w.streams = Some(Streams {
            times: NpyStream::create(&f("spike_times.npy"), "'<i8'", &[], 8)?,
            centres: NpyStream::create(&f("spike_centers.npy"), "'<i8'", &[], 8)?,
            amps: NpyStream::create(&f("amplitudes.npy"), "'<f4'", &[], 4)?,
            templates: NpyStream::create(&f("spike_detection_templates.npy"), "'<i8'", &[], 8)?,
            signs: NpyStream::create(&f("spike_signs.npy"), "'|i1'", &[], 1)?,
            positions: NpyStream::create(&f("spike_positions.npy"), "'<f4'", &[2], 8)?,
            pcs: NpyStream::create(&f("pc_features.npy"), "'<f4'", &[nc, n_pcs], nc * n_pcs * 4)?,
            pc_ind: NpyStream::create(&f("pc_feature_ind.npy"), "'<i8'", &[nc], nc * 8)?,
            peaks: NpyStream::create(&f("peaks.npy"), PEAK_DESCR, &[], PEAK_BYTES)?,
        });

        let centres: Vec<f64> = (0..nf)
            .flat_map(|j| [geometry.xcup[j], geometry.ycup[j]])
            .collect();
        write_all(&f("template_centers.npy"), "'<f8'", &[nf, 2], &centres)?;
        let cc: Vec<i64> = (0..nf)
            .flat_map(|j| (0..nc).map(move |c| (j, c)))
            .map(|(j, c)| geometry.i_c[[c, j]] as i64)
            .collect();
        write_all(&f("center_channels.npy"), "'<i8'", &[nf, nc], &cc)?;
        let map: Vec<i64> = probe.chan_map.iter().map(|&c| c as i64).collect();
        write_all(&f("channel_map.npy"), "'<i8'", &[n_sites], &map)?;
        let pos: Vec<f64> = (0..n_sites)
            .flat_map(|i| [probe.xc[i] as f64, probe.yc[i] as f64])
            .collect();
        write_all(&f("channel_positions.npy"), "'<f8'", &[n_sites, 2], &pos)?;
        write_all(
            &f("channel_shanks.npy"),
            "'<i8'",
            &[n_sites],
            &probe.kcoords,
        )?;
        Ok(w)
    }

    /// The temporary folder being written (`<out>.partial-<pid>`).
    pub fn partial_path(&self) -> &Path {
        &self.tmp
    }

    /// Spikes appended so far.
    pub fn n_spikes(&self) -> u64 {
        self.n_spikes
    }

    /// Appends one window's detections.
    ///
    /// `window_first_sample` is the absolute sample index of column 0 of the
    /// padded window (negative for the first window, whose left pad lies
    /// before the recording). A detection at window column t is written with
    /// spike time `window_first_sample + t`. Within the window, spikes are
    /// written in time order, then by centre.
    ///
    /// # Errors
    /// When the detections' arrays disagree in length, their nC or npc differ
    /// from the writer's, a centre or template index is out of range, a spike
    /// time is negative, or writing fails.
    pub fn append(&mut self, det: &Detections, window_first_sample: i64) -> Result<()> {
        let n = det.len();
        let (nc, npc) = (self.n_chans, self.n_pcs);
        if n > 0 && (det.n_chans != nc || det.n_pcs != npc) {
            bail!(
                "window at sample {window_first_sample}: detections have nC = {}, npc = {}, but the output was created for nC = {nc}, npc = {npc}",
                det.n_chans,
                det.n_pcs
            );
        }
        for (what, len) in [
            ("sample", det.sample.len()),
            ("amp", det.amp.len()),
            ("imax", det.imax.len()),
            ("sign", det.sign.len()),
            ("yct", det.yct.len()),
            ("tf", det.tf.len() / (nc * npc).max(1)),
        ] {
            if len != n {
                bail!(
                    "window at sample {window_first_sample}: detections field `{what}` has {len} entries for {n} spikes"
                );
            }
        }
        if det.tf.len() != n * nc * npc {
            bail!(
                "window at sample {window_first_sample}: `tf` has {} values, expected n × nC × npc = {n} × {nc} × {npc}",
                det.tf.len()
            );
        }
        let nf = self.xcup.len();
        let mut times = Vec::with_capacity(n);
        for i in 0..n {
            let j = det.centre[i] as usize;
            if j >= nf {
                bail!(
                    "window at sample {window_first_sample}: spike {i} has centre {j}, but there are {nf} centres"
                );
            }
            if det.imax[i] as usize >= N_DETECTION_TEMPLATES {
                bail!(
                    "window at sample {window_first_sample}: spike {i} has template {}, expected 0–29",
                    det.imax[i]
                );
            }
            let t = i64::try_from(det.sample[i])
                .ok()
                .and_then(|t| t.checked_add(window_first_sample))
                .filter(|&t| t >= 0);
            let Some(t) = t else {
                bail!(
                    "window at sample {window_first_sample}: spike {i} at window sample {} falls before the recording or overflows",
                    det.sample[i]
                );
            };
            times.push(t);
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (times[i], det.centre[i]));

        let mut b_times = Vec::with_capacity(n * 8);
        let mut b_centres = Vec::with_capacity(n * 8);
        let mut b_amps = Vec::with_capacity(n * 4);
        let mut b_templates = Vec::with_capacity(n * 8);
        let mut b_signs = Vec::with_capacity(n);
        let mut b_pos = Vec::with_capacity(n * 8);
        let mut b_pcs = Vec::with_capacity(n * nc * npc * 4);
        let mut b_ind = Vec::with_capacity(n * nc * 8);
        let mut b_peaks = Vec::with_capacity(n * PEAK_BYTES);
        for &i in &order {
            let j = det.centre[i] as usize;
            let t = times[i];
            if let Some(last) = self.last_time
                && t < last
            {
                self.time_sorted = false;
            }
            self.last_time = Some(t);
            self.first_time.get_or_insert(t);
            t.put(&mut b_times);
            (j as i64).put(&mut b_centres);
            det.amp[i].put(&mut b_amps);
            (det.imax[i] as i64).put(&mut b_templates);
            det.sign[i].put(&mut b_signs);
            (self.xcup[j] as f32).put(&mut b_pos);
            det.yct[i].put(&mut b_pos);
            for v in &det.tf[i * nc * npc..(i + 1) * nc * npc] {
                v.put(&mut b_pcs);
            }
            for c in 0..nc {
                (self.i_c[[c, j]] as i64).put(&mut b_ind);
            }
            // peaks.npy: SpikeInterface's conventions (peak time, site, amplitude).
            let (site, amplitude) = peak_site_and_amplitude(det, i, &self.i_c, j);
            (t - TROUGH_OFFSET).max(0).put(&mut b_peaks);
            (site as i64).put(&mut b_peaks);
            amplitude.put(&mut b_peaks);
            0i64.put(&mut b_peaks);
            self.per_template[det.imax[i] as usize] += 1;
            if !self.scratch {
                self.drift.push(t, det.yct[i], det.amp[i]);
            }
        }
        let s = self
            .streams
            .as_mut()
            .context("output writer already finished")?;
        s.times.append_bytes(&b_times)?;
        s.centres.append_bytes(&b_centres)?;
        s.amps.append_bytes(&b_amps)?;
        s.templates.append_bytes(&b_templates)?;
        s.signs.append_bytes(&b_signs)?;
        s.positions.append_bytes(&b_pos)?;
        if nc * npc > 0 {
            s.pcs.append_bytes(&b_pcs)?;
        }
        if nc > 0 {
            s.pc_ind.append_bytes(&b_ind)?;
        }
        s.peaks.append_bytes(&b_peaks)?;
        self.n_spikes += n as u64;
        self.n_windows += 1;
        Ok(())
    }

    /// Makes this folder a later stage's working folder (the sort's detection
    /// stage, read back by the same process and then removed): its spike files
    /// are not synced to the disk and its drift map is neither collected nor
    /// drawn (`spikecube.json` then has no `counts.drift_map_spikes_shown`).
    pub fn set_scratch(&mut self, scratch: bool) {
        self.scratch = scratch;
    }

    /// Finishes the spike files, writes `whitening_mat.npy`, `params.py`,
    /// `spikecube.json` and `drift_map.png`, and renames the temporary folder to
    /// the final one (an existing final folder is replaced only at this point).
    ///
    /// # Errors
    /// When `run.fs` is not positive, the whitening matrix is not
    /// n_sites × n_sites, or any write or rename fails; the final folder is then
    /// left as it was before the run.
    pub fn finish(mut self, run: &RunInfo) -> Result<Summary> {
        let s = self
            .streams
            .take()
            .context("output writer already finished")?;
        let streams = vec![
            s.times,
            s.centres,
            s.amps,
            s.templates,
            s.signs,
            s.positions,
            s.pcs,
            s.pc_ind,
            s.peaks,
        ];
        // Each file's header and its sync to disk, all at once (nine
        // syncs one after another took tens of ms), beside the drift map.
        let drift_map = self.tmp.join("drift_map.png");
        let axes = DriftAxes {
            fs: run.fs,
            n_samples: run.n_samples,
            y_range: self.y_range,
        };
        let drift = &self.drift;
        let sync = !self.scratch;
        let (finished, rendered) = rayon::join(
            || {
                streams
                    .into_par_iter()
                    .map(|st| st.finish_with(sync).map(|_| ()))
                    .collect::<Result<Vec<()>>>()
            },
            || {
                if sync {
                    drift.render(&drift_map, &axes)
                } else {
                    Ok(())
                }
            },
        );
        finished?;
        rendered?;
        let n_sites = self.n_sites;
        let f = |n: &str| self.tmp.join(n);

        let wm = &run.whitening;
        let (whitening, whitening_note) = if wm.is_empty() {
            let eye: Vec<f32> = (0..n_sites * n_sites)
                .map(|k| if k % (n_sites + 1) == 0 { 1.0 } else { 0.0 })
                .collect();
            (eye, "identity: no whitening matrix was given")
        } else if wm.dim() == (n_sites, n_sites) {
            (wm.iter().copied().collect(), "the whitening matrix applied")
        } else {
            bail!(
                "whitening matrix is {} × {}, expected n_sites × n_sites = {n_sites} × {n_sites}",
                wm.nrows(),
                wm.ncols()
            );
        };
        write_all(
            &f("whitening_mat.npy"),
            "'<f4'",
            &[n_sites, n_sites],
            &whitening,
        )?;

        Params {
            dat_path: run.dat_path.to_string_lossy().into_owned(),
            n_channels_dat: run.n_channels_dat,
            dtype: if run.dtype.is_empty() {
                "int16".into()
            } else {
                run.dtype.clone()
            },
            offset: run.offset,
            sample_rate: run.fs,
            hp_filtered: run.hp_filtered,
        }
        .write(&f("params.py"))?;

        let duration_s = run.n_samples as f64 / run.fs;
        let mut json = serde_json::json!({
            "program": "spikecube",
            "version": env!("CARGO_PKG_VERSION"),
            "versions": run.versions,
            "settings": run.settings,
            "input": {
                "description": run.input_description,
                "dat_path": run.dat_path.to_string_lossy(),
                "n_channels_dat": run.n_channels_dat,
                "dtype": run.dtype,
                "offset": run.offset,
                "fs": run.fs,
                "n_samples": run.n_samples,
                "duration_s": duration_s,
                "hp_filtered": run.hp_filtered,
            },
            "sizes": {
                "n_sites": n_sites,
                "n_centres": self.xcup.len(),
                "n_chans_per_spike": self.n_chans,
                "n_pcs": self.n_pcs,
            },
            "warnings": run.warnings,
            "provenance": crate::provenance::record(run.versions.get("device").map(String::as_str), run.task.as_ref()),
            "timings_s": run.timings,
            "counts": {
                "n_spikes": self.n_spikes,
                "n_windows": self.n_windows,
                "first_spike_sample": self.first_time,
                "last_spike_sample": self.last_time,
                "time_sorted": self.time_sorted,
                "per_detection_template": self.per_template,
            },
            "conventions": {
                "spike_times": "absolute sample index of the detection, about 10 samples after the spike's trough (Kilosort4's st[:, 0] times fs)",
                "spike_positions": "x of the template centre and amplitude-weighted depth yct, µm",
                "channel_index": "rows of channel_map.npy (probe sites in channel-map order); channel_map.npy gives the raw-file column",
                "peaks": "SpikeInterface's conventions: sample_index = spike_times - 10 (the trough), channel_index = the site where the winning template's output is largest, amplitude = -sign * |A| (whitened units, negative for a trough-first spike)",
                "whitening_mat": whitening_note,
            },
        });
        let staged = self
            .staged
            .take()
            .context("output writer already finished")?;
        if !self.scratch {
            json["counts"]["drift_map_spikes_shown"] = self.drift.kept().into();
        }
        staged.publish(json)?;
        Ok(Summary {
            path: self.out.clone(),
            n_spikes: self.n_spikes,
            n_windows: self.n_windows,
            time_sorted: self.time_sorted,
            per_template: self.per_template.clone(),
        })
    }
}

impl Drop for OutputWriter {
    /// Closes the files, then removes the temporary folder when the writer was
    /// not finished.
    fn drop(&mut self) {
        self.streams = None;
        self.staged = None;
    }
}
