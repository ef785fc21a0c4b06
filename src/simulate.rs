//! Synthetic SpikeGLX-style recordings with known spikes, for tests,
//! benchmarks and demonstrations.
//!
//! [`simulate`] writes, into one folder:
//!
//! * `sim_g0_t0.imec0.ap.bin`: int16, samples × channels interleaved
//!   (sample-major), `n_ap` data channels (site i in column `chan_map[i]`,
//!   `n_ap = max(chan_map) + 1`) then one sync channel (a 1 Hz square wave
//!   on bit 6, value 64 for the first half of every second);
//! * `sim_g0_t0.imec0.ap.meta`: the SpikeGLX keys a reader needs
//!   (`nSavedChans`, `imSampRate`, `fileSizeBytes`, `fileTimeSecs`,
//!   `snsApLfSy`, `snsSaveChanSubset=all`, `imAiRangeMax/Min`, `imMaxInt`,
//!   `typeThis=imec`, `~snsChanMap` and `~snsGeomMap` with the geometry);
//! * `ground_truth.npy`: float64 (n, 4), one row per spike sorted by time:
//!   sample of the trough, unit x (µm), unit y (µm), trough amplitude at the
//!   unit's position (counts, negative);
//! * `ground_truth_units.npy`: int32 (n,), the unit (0 … `n_units` − 1, the
//!   order of [`SimSummary::units`]) of each row of `ground_truth.npy`, for
//!   scoring sorters (e.g. SpikeInterface's `compare_sorter_to_ground_truth`);
//! * `probe.json`: the probe in Kilosort's JSON format, with `n_chan` = the
//!   file's channel count (sync included);
//! * with a [`DriftModel`] (`simulate --drift`) also `drift_truth.npy`: float64
//!   (n_t, n_y), the true displacement (µm, positive up) at the times
//!   `drift_truth_times.npy` (float64 n_t, seconds, every [`DRIFT_TRUTH_DT`])
//!   of a unit resting at the depths `drift_truth_depths.npy` (float64 n_y,
//!   µm, every [`DRIFT_TRUTH_DY`] over the sites' span); ground truth's y is
//!   then the unit's depth at the spike (rest depth + displacement);
//! * `spikecube.json`: the settings, and the list of files written.
//!
//! The signal is: Gaussian noise (sd `noise_sd` counts, independent per
//! channel and sample), a slow common LFP-like oscillation (3 and 7 Hz, a few
//! tens of counts, growing with depth), and spikes of `n_units` units. Each
//! unit sits near a random site; it fires as a Poisson process with a
//! refractory period; its 61-sample waveform has its trough at sample 20 and
//! a slower positive rebound; it reaches each site scaled by
//! exp(−d²/2σ²) with σ of 20–30 µm (sites beyond 3σ get nothing).
//!
//! The output depends only on the probe and [`SimConfig`] (including the
//! seed), not on the thread count: the file is made in chunks, each with its
//! own random stream derived from the seed and the chunk index, computed in
//! parallel (rayon) and written in order. Memory is a few chunks, whatever
//! the length.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ndarray::Array2;
use rayon::prelude::*;

use crate::probe::Probe;

/// Samples in the unit waveform.
pub const WAVEFORM_LEN: usize = 61;
/// Index of the waveform's trough.
pub const TROUGH: usize = 20;
/// File stem of the simulated recording.
pub const STEM: &str = "sim_g0_t0.imec0.ap";
/// Samples per chunk of generated data.
const CHUNK: usize = 16_384;

/// Parameters of a simulated recording.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimConfig {
    /// Length, seconds.
    pub seconds: f64,
    /// Sample rate, Hz.
    pub fs: f64,
    /// Number of units.
    pub n_units: usize,
    /// Mean firing rate of each unit, Hz.
    pub rate_hz: f64,
    /// Seed of every random draw.
    pub seed: u64,
    /// Standard deviation of the noise, counts.
    pub noise_sd: f32,
    /// Refractory period, seconds (no two spikes of one unit closer than this).
    pub refractory_s: f64,
    /// Peak amplitude of the common LFP-like component, counts.
    pub lfp_counts: f32,
    /// Motion of the units relative to the probe (`None`: units stay put and
    /// the output is exactly that of a recording without drift).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drift: Option<DriftModel>,
}

/// Motion of the units relative to the probe, for drift-correction tests
/// (`simulate --drift`). The displacement d(t, y), µm, of a unit resting at
/// depth y is positive **upward** (towards larger y) and is the sum of
///
/// * a linear ramp from 0 at t = 0 to `linear_um` at the end of the recording;
/// * a step of `step_um` at `step_at_s` seconds;
/// * a sinusoid `sine_um`·sin(2π t / `sine_period_s`);
///
/// multiplied, when `nonrigid` is set, by a depth gain
/// g(y) = 0.2 + 1.6·(y − ymin)/(ymax − ymin) (0.2 at the probe's lowest site,
/// 1.8 at its highest: the top moves nine times as much as the bottom), else
/// by 1 (rigid). The unit's position at its spike's trough sample sets that
/// spike's footprint (a spike is short enough to be rigid within itself).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DriftModel {
    /// Linear drift over the whole recording, µm.
    pub linear_um: f64,
    /// Size of the step, µm.
    pub step_um: f64,
    /// Time of the step, seconds.
    pub step_at_s: f64,
    /// Amplitude of the sinusoid, µm.
    pub sine_um: f64,
    /// Period of the sinusoid, seconds.
    pub sine_period_s: f64,
    /// Depth-dependent (non-rigid) motion.
    pub nonrigid: bool,
}

impl DriftModel {
    /// The default rigid model for a recording of `seconds`: 40 µm linear, a
    /// 20 µm step at 60 % of the length, a 10 µm sinusoid of period `seconds`/3.
    pub fn rigid(seconds: f64) -> Self {
        DriftModel {
            linear_um: 40.0,
            step_um: 20.0,
            step_at_s: 0.6 * seconds,
            sine_um: 10.0,
            sine_period_s: seconds / 3.0,
            nonrigid: false,
        }
    }

    /// As [`DriftModel::rigid`] with the depth gain of the module docs.
    pub fn nonrigid(seconds: f64) -> Self {
        DriftModel {
            nonrigid: true,
            ..DriftModel::rigid(seconds)
        }
    }

    /// Displacement, µm (positive up), at time `t` s, of a unit resting at
    /// depth `y` µm, on a probe whose sites span depths `ymin..=ymax` µm.
    pub fn displacement(&self, t: f64, y: f64, ymin: f64, ymax: f64, seconds: f64) -> f64 {
        let mut d = self.linear_um * (t / seconds.max(1e-12));
        if t >= self.step_at_s {
            d += self.step_um;
        }
        if self.sine_period_s > 0.0 {
            d += self.sine_um * (std::f64::consts::TAU * t / self.sine_period_s).sin();
        }
        if self.nonrigid {
            let f = if ymax > ymin {
                ((y - ymin) / (ymax - ymin)).clamp(0.0, 1.0)
            } else {
                0.5
            };
            d *= 0.2 + 1.6 * f;
        }
        d
    }

    /// Checks the numbers are finite and the period not negative.
    fn validate(&self) -> Result<()> {
        let v = [
            self.linear_um,
            self.step_um,
            self.step_at_s,
            self.sine_um,
            self.sine_period_s,
        ];
        if v.iter().any(|x| !x.is_finite()) || self.sine_period_s < 0.0 {
            bail!("drift model {self:?}: every number must be finite and the period ≥ 0");
        }
        Ok(())
    }
}

/// Interval, seconds, of the true-drift table `drift_truth.npy`.
pub const DRIFT_TRUTH_DT: f64 = 0.1;
/// Depth step, µm, of the true-drift table `drift_truth.npy`.
pub const DRIFT_TRUTH_DY: f64 = 20.0;

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seconds: 10.0,
            fs: 30_000.0,
            n_units: 30,
            rate_hz: 5.0,
            seed: 0,
            noise_sd: 10.0,
            refractory_s: 0.002,
            lfp_counts: 20.0,
            drift: None,
        }
    }
}

/// One simulated unit.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Unit {
    /// Position, µm (the probe's frame).
    pub x: f32,
    /// Position, µm.
    pub y: f32,
    /// Trough amplitude at the unit's own position, counts (negative, −60 … −200).
    pub amplitude: f32,
    /// Spatial spread σ, µm.
    pub sigma_um: f32,
    /// Trough width parameter, seconds.
    pub width_s: f64,
}

/// What [`simulate`] wrote.
#[derive(Debug, Clone)]
pub struct SimSummary {
    /// The `.bin` file.
    pub bin_path: PathBuf,
    /// The `.meta` file.
    pub meta_path: PathBuf,
    /// Samples per channel.
    pub n_samples: u64,
    /// Channels in the file (data + 1 sync).
    pub n_channels: usize,
    /// Spikes in the ground truth.
    pub n_spikes: usize,
    /// Size of the `.bin` file, bytes.
    pub file_bytes: u64,
    /// The units, in unit order.
    pub units: Vec<Unit>,
}

/// The default probe of `simulate`: a Neuropixels 2.0 single shank (NP2003)
/// reading its first 384 electrodes, in probeinterface's frame: two columns
/// (x = 0 and 32 µm) and rows every 15 µm (y = 0 … 2865 µm); site i at
/// x = 32·(i mod 2), y = 15·⌊i/2⌋, file column i, `n_chan` = 385 (the last
/// column is the sync channel).
pub fn default_probe() -> Probe {
    let n = 384;
    Probe {
        xc: (0..n).map(|i| 32.0 * (i % 2) as f32).collect(),
        yc: (0..n).map(|i| 15.0 * (i / 2) as f32).collect(),
        kcoords: vec![0; n],
        chan_map: (0..n as u64).collect(),
        n_chan: n as u64 + 1,
        source: PathBuf::from("built-in Neuropixels 2.0 single shank (NP2003, 384 sites)"),
    }
}

/// A small deterministic random stream (SplitMix64).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    /// A stream for `(seed, stream)`; different streams are independent for practical purposes.
    fn new(seed: u64, stream: u64) -> Rng {
        let mut r = Rng(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }
    /// Standard normal (Box–Muller, one of the pair).
    fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// 65 536 standard-normal values (mean 0, sd 1 exactly), indexed by 16 random bits:
/// a fast noise source whose steps (about 1e-4 sd) vanish in int16 rounding.
fn normal_table() -> Vec<f32> {
    let mut r = Rng::new(0x6A09_E667_F3BC_C908, 1);
    let mut t: Vec<f64> = (0..1 << 16).map(|_| r.normal()).collect();
    let n = t.len() as f64;
    let mean = t.iter().sum::<f64>() / n;
    let sd = (t.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n).sqrt();
    for v in &mut t {
        *v = (*v - mean) / sd;
    }
    t.into_iter().map(|v| v as f32).collect()
}

/// The unit waveform, 61 samples, trough −1 at sample 20: a narrow negative
/// Gaussian (σ = `width_s`·fs samples) plus a positive rebound a third as
/// deep, centred 0.5 ms later and three times wider, tapered to 0 at both ends.
pub fn waveform(width_s: f64, fs: f64) -> [f32; WAVEFORM_LEN] {
    let s1 = (width_s * fs).clamp(1.0, 8.0);
    let d = (0.0005 * fs).clamp(3.0, 25.0);
    let s2 = 3.0 * s1;
    let mut w = [0f32; WAVEFORM_LEN];
    for (k, v) in w.iter_mut().enumerate() {
        let t = k as f64 - TROUGH as f64;
        let x =
            -(-(t * t) / (2.0 * s1 * s1)).exp() + 0.33 * (-(t - d).powi(2) / (2.0 * s2 * s2)).exp();
        let edge = (k.min(WAVEFORM_LEN - 1 - k) as f64 / 6.0).min(1.0);
        let taper = (edge * std::f64::consts::FRAC_PI_2).sin().powi(2);
        *v = (x * taper) as f32;
    }
    let min = w.iter().copied().fold(0f32, f32::min);
    if min < 0.0 {
        for v in &mut w {
            *v /= -min;
        }
    }
    w
}

/// Rank of each site's shank among the sorted distinct shank ids, and the count of shanks.
fn shank_ranks(probe: &Probe) -> (Vec<usize>, usize) {
    let mut ids = probe.kcoords.clone();
    ids.sort_unstable();
    ids.dedup();
    let ranks = probe
        .kcoords
        .iter()
        .map(|k| ids.binary_search(k).unwrap_or(0))
        .collect();
    (ranks, ids.len())
}

/// SpikeGLX's `~snsGeomMap` value for `probe` with `n_ap` data channels:
/// a header `(part,shanks,shank pitch µm,shank width µm)` then one
/// `(shank:x:z:used)` entry per data channel, x measured within the shank and
/// z up from the tip, µm. Here shank s is the rank of the probe's shank id,
/// the pitch is the mean spacing of the shanks' left edges, x = xc − s·pitch
/// and z = yc, each shifted only if needed to keep them non-negative; channels
/// that no site reads are written as `(0:0:0:0)`.
pub fn geom_map(probe: &Probe, n_ap: usize) -> String {
    let (ranks, n_shanks) = shank_ranks(probe);
    let mut left = vec![f32::INFINITY; n_shanks];
    for (i, &r) in ranks.iter().enumerate() {
        left[r] = left[r].min(probe.xc[i]);
    }
    let pitch = if n_shanks > 1 {
        (left[n_shanks - 1] - left[0]) / (n_shanks - 1) as f32
    } else {
        0.0
    };
    let local: Vec<f32> = (0..probe.n_sites())
        .map(|i| probe.xc[i] - ranks[i] as f32 * pitch)
        .collect();
    let xshift = local.iter().copied().fold(0f32, f32::min);
    let zshift = probe.yc.iter().copied().fold(0f32, f32::min);
    let width = local.iter().map(|x| x - xshift).fold(0f32, f32::max).ceil() + 16.0;
    let mut entries = vec!["(0:0:0:0)".to_string(); n_ap];
    for i in 0..probe.n_sites() {
        entries[probe.chan_map[i] as usize] = format!(
            "({}:{}:{}:1)",
            ranks[i],
            local[i] - xshift,
            probe.yc[i] - zshift
        );
    }
    format!(
        "(spikecube_sim,{n_shanks},{pitch},{width}){}",
        entries.concat()
    )
}

/// A Neuropixels probe type the simulated layout is, for the `.meta`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NpLayout {
    /// Neuropixels 1.0 (`imDatPrb_type=0`, part PRB_1_4_0480_1): the bank of
    /// each of the 384 channels (electrode = channel + 384·bank).
    Np1 {
        /// Bank of channel c, 0–2.
        banks: Vec<u32>,
    },
    /// Neuropixels 2.0 single shank (`imDatPrb_type=2003`, part NP2003): the
    /// electrode each of the 384 channels reads.
    Np2 {
        /// Electrode of channel c, 0–1279.
        electrodes: Vec<u32>,
    },
}

/// Position, µm, of Neuropixels 1.0 electrode `e` in probeinterface's frame
/// (the leftmost column at x = 0, the first row at y = 0): staggered columns,
/// x = 16 or 0 (alternate rows) + 32·(e mod 2), y = 20·⌊e/2⌋. (SpikeGLX's
/// `~snsGeomMap` measures x from the shank's left edge instead: 11 µm more.)
fn np1_xy(e: u32) -> (f32, f32) {
    let row = e / 2;
    let x0 = if row.is_multiple_of(2) { 16.0 } else { 0.0 };
    (x0 + 32.0 * (e % 2) as f32, 20.0 * row as f32)
}

/// Position, µm, of Neuropixels 2.0 single-shank electrode `e` in
/// probeinterface's frame: x = 32·(e mod 2), y = 15·⌊e/2⌋. (SpikeGLX's
/// `~snsGeomMap` measures x from the shank's left edge instead: 27 µm more.)
fn np2_xy(e: u32) -> (f32, f32) {
    (32.0 * (e % 2) as f32, 15.0 * (e / 2) as f32)
}

/// Which Neuropixels layout `probe` is, if any: 384 data channels on one
/// shank, each site exactly (±0.01 µm) at an electrode of a Neuropixels 2.0
/// single shank, else of a Neuropixels 1.0 probe (whose channel c can only
/// read electrodes c, c + 384, c + 768). `None` for any other layout.
pub fn np_layout(probe: &Probe, n_ap: usize) -> Option<NpLayout> {
    if n_ap != 384 || probe.n_sites() != 384 {
        return None;
    }
    if probe.kcoords.iter().any(|&k| k != probe.kcoords[0]) {
        return None;
    }
    let at = |xy: (f32, f32), i: usize| {
        (xy.0 - probe.xc[i]).abs() < 0.01 && (xy.1 - probe.yc[i]).abs() < 0.01
    };
    let mut seen = [false; 384];
    for &c in &probe.chan_map {
        if c >= 384 || std::mem::replace(&mut seen[c as usize], true) {
            return None;
        }
    }
    let mut electrodes = vec![0u32; 384];
    let np2 = (0..384).all(|i| {
        // Rows are 15 µm apart: the electrode is found from y directly.
        let row = (probe.yc[i] / 15.0).round();
        if !(0.0..640.0).contains(&row) {
            return false;
        }
        (0..2).any(|col| {
            let e = 2 * row as u32 + col;
            at(np2_xy(e), i) && {
                electrodes[probe.chan_map[i] as usize] = e;
                true
            }
        })
    });
    if np2 {
        let mut sorted = electrodes.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() == 384 {
            return Some(NpLayout::Np2 { electrodes });
        }
    }
    let mut banks = vec![0u32; 384];
    let np1 = (0..384).all(|i| {
        let c = probe.chan_map[i] as u32;
        (0..3).any(|b| {
            at(np1_xy(c + 384 * b), i) && {
                banks[c as usize] = b;
                true
            }
        })
    });
    np1.then_some(NpLayout::Np1 { banks })
}

/// The `.meta` text of a simulated recording. For a Neuropixels layout
/// ([`np_layout`]) it has the fields of a real SpikeGLX file of that probe,
/// consistent with each other (part number and type, `~imroTbl`, gain, ADC
/// range and resolution, `~snsGeomMap` naming the part); for any other layout
/// only the geometry (`~snsGeomMap` with the part `spikecube_sim`). As in a
/// real SpikeGLX file, a Neuropixels `~snsGeomMap` measures x from the shank's
/// left edge (probeinterface's x plus 27 µm on NP2.0, 11 µm on NP1.0), so
/// readers that use it and readers that use `~imroTbl` place the sites alike.
fn meta_text(
    probe: &Probe,
    cfg: &SimConfig,
    n_ap: usize,
    n_samples: u64,
    file_bytes: u64,
) -> String {
    let n_cols = n_ap + 1;
    let chan_map: String = (0..n_ap)
        .map(|i| format!("(AP{i};{i}:{i})"))
        .chain(std::iter::once(format!("(SY0;{n_ap}:{n_ap})")))
        .collect();
    let geom = geom_map(probe, n_ap);
    // Neuropixels fields, sorted by key as SpikeGLX writes them.
    let (probe_fields, imro, geom) = match np_layout(probe, n_ap) {
        Some(NpLayout::Np2 { electrodes }) => {
            let imro: String = electrodes
                .iter()
                .enumerate()
                .map(|(c, &e)| format!("({c} {} 0 {e})", 1u32 << (e / 384).min(2)))
                .collect();
            (
                "imAiRangeMax=0.62\nimAiRangeMin=-0.62\nimChan0apGain=100\nimDatPrb_pn=NP2003\nimDatPrb_sn=0\nimDatPrb_type=2003\nimMaxInt=2048\n".to_string(),
                Some(format!("(2003,384){imro}")),
                format!("(NP2003,1,0,70){}", np_geom_entries(probe, 27.0)),
            )
        }
        Some(NpLayout::Np1 { banks }) => {
            let imro: String = banks
                .iter()
                .enumerate()
                .map(|(c, &b)| format!("({c} {b} 0 500 250 1)"))
                .collect();
            (
                "imAiRangeMax=0.6\nimAiRangeMin=-0.6\nimChan0apGain=500\nimDatPrb_pn=PRB_1_4_0480_1\nimDatPrb_sn=0\nimDatPrb_type=0\nimMaxInt=512\n".to_string(),
                Some(format!("(0,384){imro}")),
                format!("(PRB_1_4_0480_1,1,0,70){}", np_geom_entries(probe, 11.0)),
            )
        }
        None => (
            "imAiRangeMax=0.62\nimAiRangeMin=-0.62\nimChan0apGain=100\nimMaxInt=2048\n".to_string(),
            None,
            geom,
        ),
    };
    let mut text = format!(
        "acqApLfSy={n_ap},0,1\n\
         fileName={STEM}.bin\n\
         fileSizeBytes={file_bytes}\n\
         fileTimeSecs={secs}\n\
         firstSample=0\n\
         {probe_fields}\
         imSampRate={fs}\n\
         nSavedChans={n_cols}\n\
         snsApLfSy={n_ap},0,1\n\
         snsSaveChanSubset=all\n\
         typeThis=imec\n\
         userNotes=synthetic recording written by spikecube {ver} simulate: seed {seed}, {units} units at {rate} Hz, noise sd {sd} counts\n",
        secs = n_samples as f64 / cfg.fs,
        fs = cfg.fs,
        ver = env!("CARGO_PKG_VERSION"),
        seed = cfg.seed,
        units = cfg.n_units,
        rate = cfg.rate_hz,
        sd = cfg.noise_sd,
    );
    if let Some(imro) = imro {
        text.push_str(&format!("~imroTbl={imro}\n"));
    }
    text.push_str(&format!(
        "~snsChanMap=({n_ap},0,1){chan_map}\n~snsGeomMap={geom}\n"
    ));
    text
}

/// `~snsGeomMap` entries `(0:x:z:1)` of a single-shank Neuropixels layout with
/// 384 channels: the site read by each channel, x = xc + `edge` (µm from the
/// shank's left edge, as SpikeGLX writes it), z = yc.
fn np_geom_entries(probe: &Probe, edge: f32) -> String {
    let mut entries = vec![String::new(); 384];
    for i in 0..probe.n_sites() {
        entries[probe.chan_map[i] as usize] =
            format!("(0:{}:{}:1)", probe.xc[i] + edge, probe.yc[i]);
    }
    entries.concat()
}

/// Writes `probe` as Kilosort JSON (`chanMap`, `xc`, `yc`, `kcoords`, `n_chan`).
///
/// # Errors
/// When the file cannot be written.
pub fn write_probe_json(probe: &Probe, path: &Path) -> Result<()> {
    let json = serde_json::json!({
        "chanMap": probe.chan_map,
        "xc": probe.xc,
        "yc": probe.yc,
        "kcoords": probe.kcoords,
        "n_chan": probe.n_chan,
    });
    let text = serde_json::to_string(&json).context("cannot encode the probe")?;
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write {}", path.display()))
}

/// A unit's footprint: (site, weight) for sites within 3σ.
fn footprint(probe: &Probe, u: &Unit) -> Vec<(usize, f32)> {
    (0..probe.n_sites())
        .filter_map(|i| {
            let (dx, dy) = (probe.xc[i] - u.x, probe.yc[i] - u.y);
            let d2 = dx * dx + dy * dy;
            let s2 = u.sigma_um * u.sigma_um;
            (d2 <= 9.0 * s2).then(|| (i, (-d2 / (2.0 * s2)).exp()))
        })
        .collect()
}

/// Draws the units and their spike trains: units in unit order, spikes as
/// (trough sample, unit) sorted by sample then unit, every waveform inside the file.
fn draw_spikes(probe: &Probe, cfg: &SimConfig, n_samples: u64) -> (Vec<Unit>, Vec<(u64, u32)>) {
    let mut r = Rng::new(cfg.seed, 0);
    let units: Vec<Unit> = (0..cfg.n_units)
        .map(|_| {
            let site = (r.next_u64() % probe.n_sites() as u64) as usize;
            Unit {
                x: probe.xc[site] + r.range(-8.0, 8.0) as f32,
                y: probe.yc[site] + r.range(-10.0, 10.0) as f32,
                amplitude: -r.range(60.0, 200.0) as f32,
                sigma_um: r.range(20.0, 30.0) as f32,
                width_s: r.range(0.00010, 0.00014),
            }
        })
        .collect();
    let lo = TROUGH as u64;
    let hi = n_samples.saturating_sub((WAVEFORM_LEN - TROUGH) as u64);
    let mut spikes = Vec::new();
    if cfg.rate_hz > 0.0 && hi > lo {
        // Exponential gaps after the refractory period, with the rate raised so
        // the mean rate stays `rate_hz` (when that is possible).
        let free = 1.0 / cfg.rate_hz - cfg.refractory_s;
        let mean_gap = if free > 0.0 { free } else { 1.0 / cfg.rate_hz };
        for u in 0..cfg.n_units {
            let mut ru = Rng::new(cfg.seed, 1_000_000 + u as u64);
            let mut t = -ru.uniform().ln() * mean_gap;
            loop {
                let s = (t * cfg.fs).round();
                if s >= hi as f64 {
                    break;
                }
                if s >= lo as f64 {
                    spikes.push((s as u64, u as u32));
                }
                t += cfg.refractory_s - (1.0 - ru.uniform()).ln() * mean_gap;
            }
        }
    }
    spikes.sort_unstable();
    (units, spikes)
}

/// Writes a simulated recording of `probe` into the folder `dir`, staged and
/// published by [`crate::output::folder::StagedFolder`] (an existing `dir` is
/// replaced only when empty or an earlier `simulate` result); see the module
/// docs for the files and the signal.
///
/// # Errors
/// When `seconds`, `fs` or `rate_hz` are not finite and positive (rate may be 0),
/// the recording would have no samples, a sample rate below 1 kHz, or a file
/// cannot be written (the path is named).
pub fn simulate(probe: &Probe, cfg: &SimConfig, dir: &Path) -> Result<SimSummary> {
    let n_samples = checked_samples(probe, cfg)?;
    let n_ap = probe.chan_map.iter().max().map_or(0, |&m| m as usize + 1);
    let n_cols = n_ap + 1;
    let staged = crate::output::folder::StagedFolder::create(dir, "simulate")?;
    let final_dir = dir;
    let dir = staged.path();

    let scene = Scene::new(probe, cfg, n_samples, n_ap);
    scene.write_bin(&dir.join(format!("{STEM}.bin")))?;
    let file_bytes = n_samples * n_cols as u64 * 2;
    scene.write_truth(dir)?;

    let mut written = probe.clone();
    written.n_chan = n_cols as u64;
    write_probe_json(&written, &dir.join("probe.json"))?;

    let meta_path = dir.join(format!("{STEM}.meta"));
    let meta = meta_text(probe, cfg, n_ap, n_samples, file_bytes);
    std::fs::write(&meta_path, meta)
        .with_context(|| format!("cannot write {}", meta_path.display()))?;
    let Scene { units, spikes, .. } = scene;
    staged.publish(serde_json::json!({
        "program": "spikecube",
        "version": env!("CARGO_PKG_VERSION"),
        "config": cfg,
        "n_samples": n_samples,
        "n_channels": n_cols,
        "n_spikes": spikes.len(),
    }))?;

    Ok(SimSummary {
        bin_path: final_dir.join(format!("{STEM}.bin")),
        meta_path: final_dir.join(format!("{STEM}.meta")),
        n_samples,
        n_channels: n_cols,
        n_spikes: spikes.len(),
        file_bytes,
        units,
    })
}

/// Checks `cfg` and `probe` and returns the recording's samples.
///
/// # Errors
/// As [`simulate`].
fn checked_samples(probe: &Probe, cfg: &SimConfig) -> Result<u64> {
    if !(cfg.seconds.is_finite() && cfg.seconds > 0.0) {
        bail!("--seconds = {} must be a positive number", cfg.seconds);
    }
    if !(cfg.fs.is_finite() && cfg.fs >= 1000.0) {
        bail!("--fs = {} Hz must be at least 1000", cfg.fs);
    }
    if !(cfg.rate_hz.is_finite() && cfg.rate_hz >= 0.0) {
        bail!("--rate = {} Hz must be zero or positive", cfg.rate_hz);
    }
    if !(cfg.noise_sd.is_finite() && cfg.noise_sd >= 0.0) {
        bail!(
            "noise sd = {} counts must be zero or positive",
            cfg.noise_sd
        );
    }
    probe.validate()?;
    if let Some(d) = &cfg.drift {
        d.validate()?;
    }
    let n_samples = (cfg.seconds * cfg.fs).round() as u64;
    if n_samples == 0 {
        bail!("{} s at {} Hz is no samples", cfg.seconds, cfg.fs);
    }
    Ok(n_samples)
}

/// Everything the simulated signal is made of: the units and their spikes,
/// footprints and waveforms, the noise table, the LFP's gain per site.
struct Scene<'a> {
    probe: &'a Probe,
    cfg: &'a SimConfig,
    n_samples: u64,
    /// AP channels of the file (the sync channel follows them).
    n_ap: usize,
    units: Vec<Unit>,
    /// (sample, unit), sorted.
    spikes: Vec<(u64, u32)>,
    feet: Vec<Vec<(usize, f32)>>,
    waves: Vec<[f32; WAVEFORM_LEN]>,
    table: Vec<f32>,
    /// The probe's vertical extent, µm.
    y0: f32,
    y1: f32,
    lfp_gain: Vec<f32>,
}

impl<'a> Scene<'a> {
    fn new(probe: &'a Probe, cfg: &'a SimConfig, n_samples: u64, n_ap: usize) -> Self {
        let (units, spikes) = draw_spikes(probe, cfg, n_samples);
        let feet = units.iter().map(|u| footprint(probe, u)).collect();
        let waves = units.iter().map(|u| waveform(u.width_s, cfg.fs)).collect();
        let table = normal_table();
        let (_, _, y0, y1) = probe.extent();
        let lfp_gain = probe
            .yc
            .iter()
            .map(|&y| 0.7 + 0.6 * if y1 > y0 { (y - y0) / (y1 - y0) } else { 0.5 })
            .collect();
        Scene {
            probe,
            cfg,
            n_samples,
            n_ap,
            units,
            spikes,
            feet,
            waves,
            table,
            y0,
            y1,
            lfp_gain,
        }
    }

    /// The unit's position at sample s (moved by the drift model, if any).
    fn moved(&self, u: &Unit, s: u64) -> Unit {
        let mut m = u.clone();
        if let Some(d) = &self.cfg.drift {
            let t = s as f64 / self.cfg.fs;
            let (y0, y1) = (self.y0 as f64, self.y1 as f64);
            m.y += d.displacement(t, u.y as f64, y0, y1, self.cfg.seconds) as f32;
        }
        m
    }

    /// The file's bytes of chunk `c` (samples `c·CHUNK ..`, every column).
    fn chunk(&self, c: u64) -> Vec<u8> {
        let (probe, cfg) = (self.probe, self.cfg);
        let s0 = c * CHUNK as u64;
        let len = (self.n_samples - s0).min(CHUNK as u64) as usize;
        let ns = probe.n_sites();
        // Signal in site order, sample-major: acc[t * ns + i].
        let mut acc = vec![0f32; len * ns];
        let mut r = Rng::new(cfg.seed, 2_000_000_000 + c);
        let mut bits = 0u64;
        let mut left = 0;
        for v in acc.iter_mut() {
            if left == 0 {
                bits = r.next_u64();
                left = 4;
            }
            *v = self.table[(bits & 0xFFFF) as usize] * cfg.noise_sd;
            bits >>= 16;
            left -= 1;
        }
        for t in 0..len {
            let ts = (s0 + t as u64) as f64 / cfg.fs;
            let l = cfg.lfp_counts
                * (0.6 * (std::f64::consts::TAU * 3.1 * ts).sin()
                    + 0.4 * (std::f64::consts::TAU * 7.3 * ts + 1.0).sin())
                    as f32;
            for (i, g) in self.lfp_gain.iter().enumerate() {
                acc[t * ns + i] += l * g;
            }
        }
        self.add_spikes(&mut acc, s0, len);
        self.to_file_bytes(&acc, s0, len)
    }

    /// Adds the spikes whose waveform overlaps `[s0, s0 + len)` to `acc`
    /// (site order, sample-major).
    fn add_spikes(&self, acc: &mut [f32], s0: u64, len: usize) {
        let ns = self.probe.n_sites();
        let spikes = &self.spikes;
        let first = spikes.partition_point(|&(s, _)| s + (WAVEFORM_LEN - TROUGH) as u64 <= s0);
        for &(s, u) in &spikes[first..] {
            let start = s as i64 - TROUGH as i64;
            if start >= (s0 + len as u64) as i64 {
                break;
            }
            let (unit, wave) = (&self.units[u as usize], &self.waves[u as usize]);
            let moved_foot;
            let foot = if self.cfg.drift.is_some() {
                moved_foot = footprint(self.probe, &self.moved(unit, s));
                &moved_foot
            } else {
                &self.feet[u as usize]
            };
            for (k, &wv) in wave.iter().enumerate() {
                let t = start + k as i64 - s0 as i64;
                if t < 0 || t >= len as i64 {
                    continue;
                }
                let row = &mut acc[t as usize * ns..(t as usize + 1) * ns];
                let a = unit.amplitude.abs() * wv;
                for &(i, wt) in foot {
                    row[i] += a * wt;
                }
            }
        }
    }

    /// The chunk's samples as the file holds them: int16, interleaved in the
    /// probe's channel map, the sync channel (a 1 Hz square wave) last.
    fn to_file_bytes(&self, acc: &[f32], s0: u64, len: usize) -> Vec<u8> {
        let (ns, n_ap) = (self.probe.n_sites(), self.n_ap);
        let n_cols = n_ap + 1;
        let mut out = vec![0u8; len * n_cols * 2];
        for t in 0..len {
            let base = t * n_cols;
            for i in 0..ns {
                let v = acc[t * ns + i].round().clamp(-32768.0, 32767.0) as i16;
                let o = (base + self.probe.chan_map[i] as usize) * 2;
                out[o..o + 2].copy_from_slice(&v.to_le_bytes());
            }
            let abs = s0 + t as u64;
            let sync: i16 = if ((abs as f64 / self.cfg.fs).fract()) < 0.5 {
                64
            } else {
                0
            };
            let o = (base + n_ap) * 2;
            out[o..o + 2].copy_from_slice(&sync.to_le_bytes());
        }
        out
    }

    /// Writes the recording to `bin_path` (under a temporary name, renamed
    /// when complete): chunks computed in parallel groups, a writer thread
    /// draining finished groups while the next group is computed.
    fn write_bin(&self, bin_path: &Path) -> Result<()> {
        let tmp_path = bin_path.with_extension("bin.partial");
        let file = File::create(&tmp_path)
            .with_context(|| format!("cannot create {}", tmp_path.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let n_chunks = self.n_samples.div_ceil(CHUNK as u64);
        let group = (rayon::current_num_threads() * 2).max(2) as u64;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Vec<u8>>>(1);
        let written: std::io::Result<()> = std::thread::scope(|scope| {
            let writer = scope.spawn(move || -> std::io::Result<()> {
                for bufs in rx {
                    for b in bufs {
                        w.write_all(&b)?;
                    }
                }
                // Flushed, not synced: the operating system writes it out at its pace.
                w.into_inner().map_err(|e| e.into_error())?;
                Ok(())
            });
            let mut c = 0;
            while c < n_chunks {
                let hi = (c + group).min(n_chunks);
                let bufs: Vec<Vec<u8>> = (c..hi).into_par_iter().map(|c| self.chunk(c)).collect();
                if tx.send(bufs).is_err() {
                    break; // The writer failed; its error is reported below.
                }
                c = hi;
            }
            drop(tx);
            writer
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the writer thread panicked")))
        });
        written.with_context(|| format!("cannot write {}", tmp_path.display()))?;
        std::fs::rename(&tmp_path, bin_path).with_context(|| {
            format!(
                "cannot rename {} to {}",
                tmp_path.display(),
                bin_path.display()
            )
        })
    }

    /// Writes `ground_truth.npy`, `ground_truth_units.npy` and, with a drift model, the drift truth
    /// (`drift_truth.npy`, `drift_truth_times.npy`, `drift_truth_depths.npy`)
    /// into `dir`.
    fn write_truth(&self, dir: &Path) -> Result<()> {
        let mut gt = Array2::<f64>::zeros((self.spikes.len(), 4));
        for (k, &(s, u)) in self.spikes.iter().enumerate() {
            let unit = &self.units[u as usize];
            gt[[k, 0]] = s as f64;
            gt[[k, 1]] = unit.x as f64;
            gt[[k, 2]] = self.moved(unit, s).y as f64;
            gt[[k, 3]] = unit.amplitude as f64;
        }
        crate::npy::write(&dir.join("ground_truth.npy"), &gt)?;
        let units: ndarray::Array1<i32> = self.spikes.iter().map(|&(_, u)| u as i32).collect();
        crate::npy::write(&dir.join("ground_truth_units.npy"), &units)?;
        let Some(d) = &self.cfg.drift else {
            return Ok(());
        };
        let (y0, y1, seconds) = (self.y0, self.y1, self.cfg.seconds);
        let n_t = (seconds / DRIFT_TRUTH_DT).floor() as usize + 1;
        let times: Vec<f64> = (0..n_t).map(|i| i as f64 * DRIFT_TRUTH_DT).collect();
        let n_y = ((y1 - y0) as f64 / DRIFT_TRUTH_DY).floor() as usize + 1;
        let depths: Vec<f64> = (0..n_y)
            .map(|j| y0 as f64 + j as f64 * DRIFT_TRUTH_DY)
            .collect();
        let truth = Array2::from_shape_fn((n_t, n_y), |(i, j)| {
            d.displacement(times[i], depths[j], y0 as f64, y1 as f64, seconds)
        });
        crate::npy::write(&dir.join("drift_truth.npy"), &truth)?;
        crate::npy::write(
            &dir.join("drift_truth_times.npy"),
            &ndarray::Array1::from(times),
        )?;
        crate::npy::write(
            &dir.join("drift_truth_depths.npy"),
            &ndarray::Array1::from(depths),
        )?;
        Ok(())
    }
}
