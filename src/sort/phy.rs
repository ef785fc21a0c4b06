//! The sort's Phy folder, as Kilosort4 4.1.7's `io.save_to_phy` writes it
//! (`../shared/docs/sorting-spec.md` §3), published atomically through a
//! [`StagedFolder`](crate::output::folder::StagedFolder) with its `spikecube.json`.
//!
//! [`save_sorting`] takes the final clustering's result, runs the CCG-gated
//! merges ([`crate::sort::merge::merge_ccg`]) and writes the folder
//! ([`write_phy`]). n = spikes after the merges, n_k = spikes kept after
//! duplicate removal, U = units, C = sites, nC = 10, npc = 6, nt = 61.
//!
//! | file | dtype | shape | contents |
//! |---|---|---|---|
//! | `spike_times.npy` | int64 | (n_k,) | trough sample + `imin`, time order |
//! | `spike_clusters.npy` | int32 | (n_k,) | unit 0…U−1 |
//! | `spike_templates.npy` | int32 | (n_k,) | the same unit ids (Kilosort4 writes the clusters here, not the templates) |
//! | `spike_detection_templates.npy` | int32 | (n_k,) | learned template that matched the spike |
//! | `amplitudes.npy` | float32 | (n_k,) | L2 norm of the spike's (nC, npc) features, whitened units |
//! | `spike_positions.npy` | float32 | (n_k, 2) | x, y µm: sites weighted by feature norm |
//! | `kept_spikes.npy` | bool | (n,) | false for spikes dropped as duplicates |
//! | `templates.npy` | float32 | (U, nt, C) | Wall·wPCA, whitened |
//! | `templates_ind.npy` | int64 | (U, C) | 0…C−1 on every row |
//! | `similar_templates.npy` | float32 | (U, U) | max over lags of the normalised template cross-correlation |
//! | `pc_features.npy` | float32 | (n_k, npc, nC) | features on the unit's nC sites (Kilosort4's `make_pc_features`) |
//! | `pc_feature_ind.npy` | uint32 | (U, nC) | those sites |
//! | `whitening_mat.npy`, `whitening_mat_dat.npy` | float32 | (C, C) | Wrot |
//! | `whitening_mat_inv.npy` | float32 | (C, C) | inverse of Wrot + 1e-5·I |
//! | `channel_map.npy` | int32 | (C,) | probe's channel map |
//! | `channel_positions.npy` | float32 | (C, 2) | site x, y µm |
//! | `channel_shanks.npy` | float32 | (C,) | probe's shank ids (`kcoords`) |
//! | `cluster_KSLabel.tsv` | text | header + U rows | `good` (refractory after duplicate removal) or `mua` |
//! | `cluster_group.tsv` | text | | byte copy of `cluster_KSLabel.tsv` (header `KSLabel`, as Kilosort4) |
//! | `cluster_ContamPct.tsv` | text | | 100·R12, one decimal |
//! | `cluster_Amplitude.tsv` | text | | template L2 norm, one decimal |
//! | `params.py` | text | | `n_channels_dat`, `offset` (0 but for a flat binary file read with `--offset`), `sample_rate`, `dtype`, `hp_filtered = False`, `dat_path` (list of absolute paths) |
//! | `spikecube.json` | JSON | | provenance (spikecube's own; Kilosort4 writes `ops.npy` instead) |
//! | `units.png` | PNG | 2000 × 1000 | units on the probe, amplitude and firing rate by depth, ACGs of the 4 largest and the 4 fastest other units, ids beside their dots ([`crate::sort::summary`]; spikecube's own) |

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ndarray::{Array2, Array3, ArrayView2};
use rayon::prelude::*;

use crate::output::folder::StagedFolder;
use crate::output::npy_stream::{LeBytes, NpyStream, write_all};
use crate::output::params::{py_float, py_str};
use crate::probe::Probe;
use crate::sort::ccg::{self, Thresholds};
use crate::sort::merge::{MergeSettings, Merged, Similarity, merge_ccg};
use crate::sort::postprocess::{self as pp, ChannelSets};
use crate::sort::summary::{UnitSummary, draw_units};

/// The final clustering's result and what the matching fixed, as the export needs them.
#[derive(Debug, Clone)]
pub struct SortResult {
    /// (n, 3) float64: trough sample (without `imin`), learned template id, amplitude.
    pub st: Array2<f64>,
    /// (n, nC, npc) float32 features.
    pub tf: Array3<f32>,
    /// (n,) final clustering labels 0…U−1.
    pub clu: Vec<i32>,
    /// (U, C, npc) float32 cluster templates in wPCA space.
    pub wall: Array3<f32>,
    /// (npc, nt) temporal basis.
    pub wpca: Array2<f32>,
    /// (C, C) whitening matrix applied to the data.
    pub wrot: Array2<f32>,
    /// The matching's site sets (iCC, iCC_mask, iU).
    pub sets: ChannelSets,
}

/// Settings of the merges and the export (Kilosort4's names and defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSettings {
    /// Sample rate, Hz (`fs`).
    pub fs: f64,
    /// Columns in the raw file (`n_chan_bin`), for `params.py`.
    pub n_chan_bin: u64,
    /// NumPy name of the raw sample type (`data_dtype`), for `params.py`.
    pub dtype: String,
    /// Raw recording file(s), written absolute into `params.py`.
    pub dat_path: Vec<PathBuf>,
    /// Header bytes at the start of each raw file (`--offset`, flat binary
    /// only), for `params.py` (Kilosort4 always writes 0).
    pub offset: u64,
    /// First sample read (`tmin`·fs), added to the spike times.
    pub imin: i64,
    /// Same-unit spikes closer than this are duplicates (`duplicate_spike_ms`, 0.25).
    pub duplicate_spike_ms: f64,
    /// The global merges' settings (and the `good` label's thresholds).
    pub merge: MergeSettings,
    /// Recording length, samples, for the firing rates of `units.png`
    /// (0: up to the last spike).
    pub n_samples: u64,
}

impl ExportSettings {
    /// Kilosort4's defaults for a recording of `n_chan_bin` int16 columns at `fs` Hz.
    pub fn new(fs: f64, n_chan_bin: u64, dat_path: Vec<PathBuf>) -> Self {
        ExportSettings {
            fs,
            n_chan_bin,
            dtype: "int16".into(),
            dat_path,
            offset: 0,
            imin: 0,
            duplicate_spike_ms: 0.25,
            merge: MergeSettings::kilosort(),
            n_samples: 0,
        }
    }
}

/// What [`save_sorting`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct PhySummary {
    /// The published folder.
    pub path: PathBuf,
    /// Units (U).
    pub n_units: usize,
    /// Units labelled `good`.
    pub n_good: usize,
    /// Spikes written (n_k).
    pub n_spikes: usize,
    /// Spikes dropped as duplicates.
    pub n_duplicates: usize,
    /// Merges made.
    pub n_merges: usize,
    /// Warnings about the folder's result (no `good` unit, a single spike),
    /// also appended to `spikecube.json`'s `warnings`.
    pub warnings: Vec<String>,
}

/// Recordings shorter than this (s) are named as the likely reason when no
/// unit passes the refractory test.
const SHORT_FOR_REFRACTORY_S: f64 = 60.0;

/// Warnings about a written sort: no unit passed the refractory test (with
/// the likely reason), or the sort holds a single spike, which Phy's loader
/// (phylib's `TemplateModel`, as of 2.7) cannot open: it squeezes one-element
/// arrays to scalars.
fn result_warnings(
    n_units: usize,
    n_good: usize,
    n_spikes: usize,
    settings: &ExportSettings,
) -> Vec<String> {
    let mut w = Vec::new();
    if n_good == 0 {
        // The test compares a unit's refractory bins with its correlogram's
        // shoulders: a short recording holds too few spikes for either.
        let seconds = settings.n_samples as f64 / settings.fs;
        let why = if settings.n_samples > 0 && seconds < SHORT_FOR_REFRACTORY_S {
            format!(
                "the recording is {seconds:.1} s long, too short for the test to find a refractory period (it needs minutes); otherwise check the recording's sample rate and scale"
            )
        } else {
            "check the recording's sample rate and scale".to_string()
        };
        w.push(format!(
            "none of the {n_units} units passed the refractory test (acg_threshold {}): {why}",
            settings.merge.thresholds.acg
        ));
    }
    if n_spikes == 1 {
        w.push("the sort holds a single spike: Phy cannot open the folder (its loader turns one-element arrays into scalars), although every file is complete; numpy's np.load reads them".to_string());
    }
    w
}

/// Merges the final clustering ([`merge_ccg`]) and writes the Phy folder `out`
/// ([`write_phy`]), Kilosort4's `merging_function` + `save_sorting`.
///
/// `manifest` (a JSON object: settings, versions…) goes into `spikecube.json`
/// with `command` (the subcommand whose folder this is) and the file list.
///
/// # Errors
/// When the inputs disagree in size or index range (named), `out` holds
/// something spikecube did not write (nothing is then changed), or a write fails.
pub fn save_sorting(
    out: &Path,
    result: SortResult,
    probe: &Probe,
    settings: &ExportSettings,
    manifest: serde_json::Value,
    command: &str,
) -> Result<PhySummary> {
    let SortResult {
        st,
        tf,
        clu,
        wall,
        wpca,
        wrot,
        sets,
    } = result;
    let merged = timed("merges", || {
        merge_ccg(
            wall,
            &clu,
            st,
            tf,
            wpca.view(),
            settings.fs,
            &settings.merge,
        )
    })
    .context("global merges")?;
    write_phy(
        out,
        merged,
        wpca.view(),
        wrot.view(),
        &sets,
        probe,
        settings,
        manifest,
        command,
    )
}

fn npy<T: LeBytes>(dir: &Path, name: &str, descr: &str, shape: &[usize], v: &[T]) -> Result<()> {
    write_all(&dir.join(name), descr, shape, v)
}

/// The text of Kilosort4's `params.py` (its key order and literals).
///
/// # Errors
/// When `fs` is not finite or a path cannot be made absolute.
pub fn params_text(settings: &ExportSettings) -> Result<String> {
    let mut paths = Vec::new();
    for p in &settings.dat_path {
        let abs = std::path::absolute(p)
            .with_context(|| format!("cannot make {} absolute", p.display()))?;
        let abs = abs.canonicalize().unwrap_or(abs);
        paths.push(py_str(&abs.to_string_lossy().replace('\\', "/")));
    }
    if settings.dtype.is_empty() || !settings.dtype.chars().all(|c| c.is_ascii_alphanumeric()) {
        bail!(
            "params.py: dtype `{}` is not a NumPy type name",
            settings.dtype
        );
    }
    Ok(format!(
        "n_channels_dat = {}\noffset = {}\nsample_rate = {}\ndtype = {}\nhp_filtered = False\ndat_path = [{}]\n",
        settings.n_chan_bin,
        settings.offset,
        py_float(settings.fs, "sample_rate")?,
        py_str(&settings.dtype),
        paths.join(", ")
    ))
}

/// One `cluster_<name>.tsv`: header `cluster_id\t<name>`, then `i\tvalue` rows.
fn tsv(name: &str, values: impl Iterator<Item = String>) -> String {
    let mut s = format!("cluster_id\t{name}\n");
    for (i, v) in values.enumerate() {
        s.push_str(&format!("{i}\t{v}\n"));
    }
    s
}

/// One decimal, rounding the exact binary value half to even (Python's `{:.1f}`).
fn one_decimal(v: f64) -> String {
    format!("{v:.1}")
}

/// Writes the probe's and the whitening files into `dir`.
fn write_probe_files(dir: &Path, probe: &Probe, wrot: ArrayView2<f32>) -> Result<()> {
    let c = probe.n_sites();
    if wrot.dim() != (c, c) {
        bail!(
            "the whitening matrix is {:?}, but the probe has {c} sites",
            wrot.dim()
        );
    }
    let map: Vec<i32> = probe.chan_map.iter().map(|&m| m as i32).collect();
    npy(dir, "channel_map.npy", "'<i4'", &[c], &map)?;
    let pos: Vec<f32> = (0..c).flat_map(|i| [probe.xc[i], probe.yc[i]]).collect();
    npy(dir, "channel_positions.npy", "'<f4'", &[c, 2], &pos)?;
    let shanks: Vec<f32> = probe.kcoords.iter().map(|&k| k as f32).collect();
    npy(dir, "channel_shanks.npy", "'<f4'", &[c], &shanks)?;
    let w = wrot.as_standard_layout();
    let w = w.as_slice().expect("standard layout");
    npy(dir, "whitening_mat_dat.npy", "'<f4'", &[c, c], w)?;
    npy(dir, "whitening_mat.npy", "'<f4'", &[c, c], w)?;
    let inv = pp::whitening_inverse(wrot)?;
    npy(
        dir,
        "whitening_mat_inv.npy",
        "'<f4'",
        &[c, c],
        inv.as_slice().expect("standard layout"),
    )
}

/// Writes the Phy folder `out` from merged spikes (module docs), Kilosort4's
/// `save_to_phy`: spike positions and amplitudes of every spike, duplicate
/// removal, templates and their similarity, PC features of the kept spikes,
/// refractoriness of the kept spikes (`good`/`mua`, `ContamPct`), `params.py`.
///
/// # Errors
/// As [`save_sorting`].
#[allow(clippy::too_many_arguments)]
pub fn write_phy(
    out: &Path,
    merged: Merged,
    wpca: ArrayView2<f32>,
    wrot: ArrayView2<f32>,
    sets: &ChannelSets,
    probe: &Probe,
    settings: &ExportSettings,
    manifest: serde_json::Value,
    command: &str,
) -> Result<PhySummary> {
    let Merged {
        wall,
        clu,
        st,
        mut tf,
        n_merges,
        n_refused,
        ..
    } = merged;
    let (u, c, _) = wall.dim();
    if c != probe.n_sites() {
        bail!(
            "the templates have {c} sites, but the probe {} has {}",
            probe.source.display(),
            probe.n_sites()
        );
    }
    let n = clu.len();
    let templates: Vec<usize> = st.column(1).iter().map(|&t| t as usize).collect();
    sets.check(c, &templates)?;
    if !tf.is_standard_layout() {
        tf = tf.as_standard_layout().into_owned();
    }
    let staged = StagedFolder::create(out, command)?;
    let dir = staged.path().to_path_buf();

    let times: Vec<i64> = st
        .column(0)
        .iter()
        .map(|&t| t as i64 + settings.imin)
        .collect();
    let (positions, amps) = timed("positions and amplitudes", || {
        rayon::join(
            || pp::spike_positions(&templates, tf.view(), sets, &probe.xc, &probe.yc),
            || pp::amplitudes(tf.view()),
        )
    });
    let dt = pp::duplicate_spike_bins(settings.duplicate_spike_ms, settings.fs);
    let keep = pp::remove_duplicates(&times, &clu, dt);
    let kept: Vec<usize> = (0..n).filter(|&i| keep[i]).collect();
    let nk = kept.len();
    let k_times: Vec<i64> = kept.iter().map(|&i| times[i]).collect();
    let k_clu: Vec<i32> = kept.iter().map(|&i| clu[i]).collect();
    let k_tmpl: Vec<usize> = kept.iter().map(|&i| templates[i]).collect();
    let k_xy: Vec<[f32; 2]> = kept
        .iter()
        .map(|&i| [positions[[i, 0]], positions[[i, 1]]])
        .collect();
    drop(positions);

    // The files are independent: written concurrently, each the same bytes
    // whatever the order (the PC features, the longest, first).
    let spikes = KeptSpikes {
        keep: &keep,
        kept: &kept,
        times: &k_times,
        clu: &k_clu,
        templates: &k_tmpl,
        xy: &k_xy,
        amps: &amps,
    };
    let (pc, (files, tables)) = rayon::join(
        || {
            timed("pc features", || {
                write_pc_files(&dir, &mut tf, &spikes, sets, u)
            })
        },
        || {
            rayon::join(
                || -> Result<()> {
                    timed("spike files", || write_spike_files(&dir, &spikes))?;
                    timed("template files", || {
                        write_template_files(&dir, wall.view(), wpca)
                    })?;
                    timed("probe files", || write_probe_files(&dir, probe, wrot))
                },
                || {
                    let (good, amp_t) = timed("cluster tables", || {
                        write_cluster_tables(&dir, &k_clu, &k_times, wall.view(), settings)
                    })?;
                    let n_good = good.iter().filter(|&&g| g).count();
                    timed("units.png", || {
                        units_png(&dir, &k_clu, &k_times, &k_xy, good, &amp_t, settings, probe)
                    })?;
                    Ok::<_, anyhow::Error>(n_good)
                },
            )
        },
    );
    pc?;
    files?;
    let n_good = tables?;
    let mut manifest = match manifest {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    let warnings = result_warnings(u, n_good, nk, settings);
    if !warnings.is_empty() {
        let listed = manifest
            .entry("warnings")
            .or_insert_with(|| serde_json::Value::Array(Vec::new()));
        if let serde_json::Value::Array(a) = listed {
            a.extend(warnings.iter().cloned().map(serde_json::Value::String));
        }
    }
    manifest.insert(
        "counts".into(),
        serde_json::json!({
            "units": u, "good": n_good, "spikes": nk, "n_spikes": nk, "duplicates": n - nk,
            "merges": n_merges,
            // Pairs the CCG passed that the same-template amplitude rule kept apart.
            "merges_refused_same_template": n_refused,
        }),
    );
    let path = staged.publish(serde_json::Value::Object(manifest))?;
    Ok(PhySummary {
        path,
        n_units: u,
        n_good,
        n_spikes: nk,
        n_duplicates: n - nk,
        n_merges,
        warnings,
    })
}

/// Runs `f`, logging its wall time at debug level (the export's pieces).
fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t = std::time::Instant::now();
    let r = f();
    tracing::debug!("export: {what} {:.3} s", t.elapsed().as_secs_f64());
    r
}

/// The spikes kept after duplicate removal and their per-spike values.
struct KeptSpikes<'a> {
    /// (n,) whether each merged spike is kept.
    keep: &'a [bool],
    /// (n_k,) the kept spikes' indices among the merged ones, ascending.
    kept: &'a [usize],
    /// (n_k,) times, samples with `imin`.
    times: &'a [i64],
    /// (n_k,) units.
    clu: &'a [i32],
    /// (n_k,) learned templates.
    templates: &'a [usize],
    /// (n_k,) positions, µm.
    xy: &'a [[f32; 2]],
    /// (n,) amplitudes of every merged spike.
    amps: &'a [f32],
}

/// The per-spike files: times, units, templates, positions, amplitudes and the keep mask.
fn write_spike_files(dir: &Path, k: &KeptSpikes) -> Result<()> {
    let nk = k.kept.len();
    npy(dir, "spike_times.npy", "'<i8'", &[nk], k.times)?;
    npy(dir, "spike_templates.npy", "'<i4'", &[nk], k.clu)?;
    npy(dir, "spike_clusters.npy", "'<i4'", &[nk], k.clu)?;
    let pos: Vec<f32> = k.xy.iter().flatten().copied().collect();
    npy(dir, "spike_positions.npy", "'<f4'", &[nk, 2], &pos)?;
    let t32: Vec<i32> = k.templates.iter().map(|&t| t as i32).collect();
    npy(dir, "spike_detection_templates.npy", "'<i4'", &[nk], &t32)?;
    let amp: Vec<f32> = k.kept.iter().map(|&i| k.amps[i]).collect();
    npy(dir, "amplitudes.npy", "'<f4'", &[nk], &amp)?;
    let keep_u8: Vec<u8> = k.keep.iter().map(|&b| u8::from(b)).collect();
    npy(dir, "kept_spikes.npy", "'|b1'", &[k.keep.len()], &keep_u8)
}

/// `similar_templates.npy`, `templates.npy` and `templates_ind.npy`.
fn write_template_files(
    dir: &Path,
    wall: ndarray::ArrayView3<f32>,
    wpca: ArrayView2<f32>,
) -> Result<()> {
    let (u, c, _) = wall.dim();
    let sim = Similarity::new(wpca).matrix(wall);
    let sim32: Vec<f32> = sim.iter().map(|&v| v as f32).collect();
    npy(dir, "similar_templates.npy", "'<f4'", &[u, u], &sim32)?;
    let tt = pp::templates_in_time(wall, wpca);
    npy(
        dir,
        "templates.npy",
        "'<f4'",
        tt.shape(),
        tt.as_slice().expect("standard layout"),
    )?;
    let ind: Vec<i64> = (0..u).flat_map(|_| 0..c as i64).collect();
    npy(dir, "templates_ind.npy", "'<i8'", &[u, c], &ind)
}

/// `pc_features.npy` (n_k, npc, nC) and `pc_feature_ind.npy`: Kilosort4's
/// `make_pc_features` in place on the kept spikes' rows of `tf` (n, nC, npc),
/// written row by row with each row's (nC, npc) transposed, about 1 MiB at
/// a time (no copy of the whole array). After each piece the system is asked
/// to start writing it to the disk ([`NpyStream::start_writeback`]), so that
/// the final sync of this large file (about 270 MB for a million spikes)
/// finds most of it written: on 2 cores the rows took 0.17 s instead of
/// 0.28 s for 1.12 M spikes (`cargo bench --bench phy_export`).
fn write_pc_files(
    dir: &Path,
    tf: &mut Array3<f32>,
    k: &KeptSpikes,
    sets: &ChannelSets,
    n_units: usize,
) -> Result<()> {
    let pc_ind = timed("pc features: make_pc_features", || {
        pp::pc_features_in_place(k.templates, k.clu, k.kept, tf, sets, n_units)
    })?;
    let (nc, npc) = (tf.shape()[1], tf.shape()[2]);
    let row_len = nc * npc;
    let path = dir.join("pc_features.npy");
    if row_len == 0 {
        write_all::<f32>(&path, "'<f4'", &[k.kept.len(), npc, nc], &[])?;
    } else {
        let flat = tf.as_slice().expect("standard layout");
        let row_bytes = row_len * 4;
        let mut stream = NpyStream::create(&path, "'<f4'", &[npc, nc], row_bytes)?;
        let rows_per_chunk = ((1 << 20) / row_bytes).max(1);
        let mut buf = Vec::new();
        for chunk in k.kept.chunks(rows_per_chunk) {
            buf.resize(chunk.len() * row_bytes, 0u8);
            buf.par_chunks_mut(row_bytes)
                .zip(chunk.par_iter())
                .for_each(|(b, &i)| {
                    let row = &flat[i * row_len..(i + 1) * row_len];
                    for p in 0..npc {
                        for ch in 0..nc {
                            let o = (p * nc + ch) * 4;
                            b[o..o + 4].copy_from_slice(&row[ch * npc + p].to_le_bytes());
                        }
                    }
                });
            stream.append_bytes(&buf)?;
            stream.start_writeback()?;
        }
        stream.finish()?;
    }
    npy(
        dir,
        "pc_feature_ind.npy",
        "'<u4'",
        pc_ind.shape(),
        pc_ind.as_slice().expect("standard layout"),
    )
}

/// `units.png` ([`crate::sort::summary`]) from the kept spikes (unit, time in
/// samples with `imin`, position in µm) and each unit's label and amplitude.
#[allow(clippy::too_many_arguments)]
fn units_png(
    dir: &Path,
    k_clu: &[i32],
    k_times: &[i64],
    k_xy: &[[f32; 2]],
    good: Vec<bool>,
    amp_t: &[f32],
    settings: &ExportSettings,
    probe: &Probe,
) -> Result<()> {
    let seconds = if settings.n_samples > 0 {
        settings.n_samples as f64 / settings.fs
    } else {
        k_times.last().map_or(0, |&t| t - settings.imin) as f64 / settings.fs
    };
    let summary = UnitSummary::new(
        k_clu,
        k_xy,
        amp_t.iter().map(|&a| f64::from(a)).collect(),
        good,
        seconds,
    );
    let rel_times: Vec<i64> = k_times.iter().map(|&t| t - settings.imin).collect();
    draw_units(
        &dir.join("units.png"),
        &summary,
        &rel_times,
        k_clu,
        settings.fs,
        &probe.xc,
        &probe.yc,
    )
}

/// The cluster tables (`cluster_ContamPct.tsv`, `cluster_Amplitude.tsv`,
/// `cluster_KSLabel.tsv` and its copy `cluster_group.tsv`) and `params.py`;
/// returns each unit's `good` label and template amplitude.
fn write_cluster_tables(
    dir: &Path,
    k_clu: &[i32],
    k_times: &[i64],
    wall: ndarray::ArrayView3<f32>,
    settings: &ExportSettings,
) -> Result<(Vec<bool>, Vec<f32>)> {
    // Refractoriness of the kept spikes: Kilosort4 sizes it by max(id) + 1.
    let n_ref = k_clu.iter().map(|&c| c as usize + 1).max().unwrap_or(0);
    let secs: Vec<f64> = k_times.iter().map(|&t| t as f64 / settings.fs).collect();
    let thr: Thresholds = settings.merge.thresholds;
    let (is_ref, r12) = ccg::refract(k_clu, &secs, n_ref, thr);
    let write = |name: &str, text: String| -> Result<()> {
        let p = dir.join(name);
        std::fs::write(&p, text).with_context(|| format!("cannot write {}", p.display()))
    };
    write(
        "cluster_ContamPct.tsv",
        tsv("ContamPct", r12.iter().map(|&r| one_decimal(r * 100.0))),
    )?;
    let amp_t = pp::template_amplitudes(wall);
    write(
        "cluster_Amplitude.tsv",
        tsv(
            "Amplitude",
            amp_t.iter().map(|&a| one_decimal(f64::from(a))),
        ),
    )?;
    let labels = tsv(
        "KSLabel",
        is_ref
            .iter()
            .map(|&r| if r { "good" } else { "mua" }.to_string()),
    );
    write("cluster_KSLabel.tsv", labels.clone())?;
    write("cluster_group.tsv", labels)?;
    write("params.py", params_text(settings)?)?;

    Ok((is_ref, amp_t))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_single_spike_and_no_good_unit_are_warned_about() {
        let mut s = ExportSettings::new(30_000.0, 4, vec![]);
        let one = result_warnings(3, 1, 1, &s);
        assert!(
            one.len() == 1 && one[0].contains("Phy cannot open"),
            "{one:?}"
        );
        assert!(result_warnings(3, 1, 0, &s).is_empty());
        assert!(result_warnings(3, 1, 2, &s).is_empty());
        s.n_samples = 300_000;
        let none = result_warnings(3, 0, 50, &s);
        assert!(
            none.len() == 1
                && none[0].contains("none of the 3 units")
                && none[0].contains("10.0 s long"),
            "{none:?}"
        );
        s.n_samples = 30_000 * 600;
        let long = result_warnings(3, 0, 50, &s);
        assert!(!long[0].contains("too short"), "{long:?}");
    }

    use super::*;

    #[test]
    fn decimals_like_python() {
        // Python: f'{0.25:.1f}' = '0.2', f'{0.35:.1f}' = '0.3' (0.35 is below .35), f'{12.25:.1f}' = '12.2'.
        assert_eq!(one_decimal(0.25), "0.2");
        assert_eq!(one_decimal(0.35), "0.3");
        assert_eq!(one_decimal(12.25), "12.2");
        assert_eq!(one_decimal(0.0), "0.0");
        assert_eq!(one_decimal(99.96), "100.0");
    }

    #[test]
    fn tsv_layout() {
        assert_eq!(
            tsv("KSLabel", ["good", "mua"].iter().map(|s| s.to_string())),
            "cluster_id\tKSLabel\n0\tgood\n1\tmua\n"
        );
    }
}
