//! The whole sort, as Kilosort4 4.1.7's `run_kilosort` chains it after
//! detection (`../shared/docs/sorting-spec.md` §1):
//!
//! ```text
//! detection (universal spikes st0, features tF0, wPCA/wTEMP, W, drift)
//!   → first clustering          clu0, Wall0      (clustering::first_clustering)
//!   → template post-processing  Wall3            (templates::postprocess_templates)
//!   → learned-template matching st, tF           (matching::extract, every window again)
//!   → final clustering          clu, Wall        (clustering::final_clustering)
//!   → CCG-gated merges, duplicate removal, Phy folder (sort::phy::save_sorting)
//! ```
//!
//! The detection stage is `spikecube detect` itself: it writes its folder
//! into a private working folder beside the output (removed once the sort is
//! published), and the sort reads its arrays back. Each later stage keeps its
//! output in memory: a 10-minute 384-site recording holds about a million
//! spikes, 240 MB of features per pass.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use ndarray::{Array1, Array2, Array3, Axis};
use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::detect::Geometry;
use crate::drift::DriftMode;
use crate::drift::correct::DriftCorrection;
use crate::pipeline::{DetectJob, Report, run_detection};
use crate::preprocess::Preprocessor;
use crate::recording::{Recording, WindowPlan};
use crate::sort::clustering::{
    ClusteringSettings, SeedingGenerator, final_clustering, first_clustering,
};
use crate::sort::matching::backend::Matcher;
use crate::sort::matching::{MatchingSettings, MatchingSetup, preprocessed_window_into};
use crate::sort::merge::MergeSettings;
use crate::sort::phy::{ExportSettings, PhySummary, SortResult, save_sorting};
use crate::sort::postprocess::ChannelSets;
use crate::sort::templates::postprocess_templates;

/// Settings of the stages after detection, with Kilosort4's names and defaults.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SortSettings {
    /// Both clusterings (`cluster_downsampling`, `max_cluster_subset`,
    /// `cluster_neighbors`, `cluster_init_seed`, `cluster_init_generator`,
    /// `x_centers`, …).
    pub clustering: ClusteringSettings,
    /// The learned-template matching (`Th_learned`, `max_peels`,
    /// `nearest_chans`, `position_limit`).
    pub matching: MatchingSettings,
    /// Same-unit spikes closer than this are duplicates, ms (`duplicate_spike_ms`, 0.25).
    pub duplicate_spike_ms: f64,
    /// `acg_threshold` (0.2): a unit is `good` when its ACG's R12 is below it.
    pub acg_threshold: f64,
    /// `ccg_threshold` (0.25): two units merge when their CCG's R12 is below it.
    pub ccg_threshold: f64,
    /// Two units whose most frequent learned template is the same merge only
    /// when the smaller median amplitude is at least this fraction of the larger
    /// ([`crate::sort::merge::MergeSettings::same_template_amplitude_ratio`];
    /// 0.5 in spikecube, 0 in Kilosort4, which has no such rule; runs
    /// recorded before it existed read as 0).
    #[serde(default)]
    pub same_template_amplitude_ratio: f64,
    /// Bytes for keeping the detection pass's preprocessed windows for the
    /// matching ([`crate::stages::KeepWindows::budget`]; `None`: that
    /// field's defaults). The sort is the same bytes whatever it is, so it is
    /// not recorded.
    #[serde(skip)]
    pub keep_windows_bytes: Option<u64>,
}

impl SortSettings {
    /// Checks the values the later stages cannot run with, before any data is
    /// read: the same limits the matching and the clusterings check when they
    /// start, named by flag and by Kilosort4's name.
    ///
    /// # Errors
    /// A message naming the flag, the setting and the value.
    pub fn validate(&self) -> Result<()> {
        let m = &self.matching;
        let positive = |flag: &str, ks: &str, v: f64| -> Result<()> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bail!("{flag} (Kilosort4's {ks}) is {v}; it must be a positive number")
            }
        };
        let non_negative = |flag: &str, ks: &str, v: f64| -> Result<()> {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                bail!("{flag} (Kilosort4's {ks}) is {v}; it must be 0 or more")
            }
        };
        positive("--th-learned", "Th_learned", m.th_learned)?;
        if m.max_peels == 0 {
            bail!("--max-peels (Kilosort4's max_peels) is 0; it must be at least 1");
        }
        positive("--position-limit", "position_limit", m.position_limit)?;
        non_negative(
            "--duplicate-spike-ms",
            "duplicate_spike_ms",
            self.duplicate_spike_ms,
        )?;
        non_negative("--acg-threshold", "acg_threshold", self.acg_threshold)?;
        non_negative("--ccg-threshold", "ccg_threshold", self.ccg_threshold)?;
        if !(self.same_template_amplitude_ratio.is_finite()
            && (0.0..=1.0).contains(&self.same_template_amplitude_ratio))
        {
            bail!(
                "--same-template-amplitude-ratio is {}; it must be between 0 (Kilosort4's merges) and 1",
                self.same_template_amplitude_ratio
            );
        }
        if let Err(e) = self.clustering.validate() {
            match &e {
                crate::sort::clustering::ClusteringError::Setting { name, .. } => {
                    bail!("--{}: {e}", name.replace('_', "-"))
                }
                _ => bail!("{e}"),
            }
        }
        Ok(())
    }

    /// Kilosort4 4.1.7's defaults.
    pub fn kilosort() -> Self {
        SortSettings {
            clustering: ClusteringSettings::default(),
            matching: MatchingSettings::default(),
            duplicate_spike_ms: 0.25,
            acg_threshold: 0.2,
            ccg_threshold: 0.25,
            same_template_amplitude_ratio: 0.0,
            keep_windows_bytes: None,
        }
    }
}

/// The settings of the stages after detection as a user gives them:
/// `spikecube sort`'s flags (`--th-learned`, …) and, with Kilosort4's names
/// (`Th_learned`, `max_peels`, …; every key given), the Python package's.
/// [`SortFlags::settings`] turns them into [`SortSettings`].
#[derive(Debug, Clone, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SortFlags {
    /// Detection threshold of the matching with the learned templates (Kilosort4's
    /// Th_learned), in whitened units: lower finds smaller spikes, and more
    /// noise. A spike is kept where the data's projection on a template, over
    /// the template's norm, exceeds it.
    #[arg(allow_negative_numbers = true, long, default_value_t = 8.0)]
    #[serde(rename = "Th_learned")]
    pub th_learned: f64,
    /// Rounds of the matching pursuit per window (Kilosort4's max_peels).
    #[arg(long, default_value_t = 100)]
    pub max_peels: usize,
    /// Sites within this of a spike's site count for its position, µm (Kilosort4's position_limit).
    #[arg(allow_negative_numbers = true, long, default_value_t = 100.0)]
    pub position_limit: f64,
    /// Every N-th spike of a group is a landmark of the neighbour graph (Kilosort4's cluster_downsampling).
    #[arg(long, default_value_t = 20)]
    pub cluster_downsampling: usize,
    /// At most this many landmarks per group, 0 for no limit (Kilosort4's max_cluster_subset).
    #[arg(long, default_value_t = 25_000)]
    pub max_cluster_subset: usize,
    /// Neighbours (landmarks) per spike in the graph (Kilosort4's cluster_neighbors).
    #[arg(long, default_value_t = 10)]
    pub cluster_neighbors: usize,
    /// Seed of the clusters' seeding, used afresh in every group (Kilosort4's cluster_init_seed).
    #[arg(long, default_value_t = 5)]
    pub cluster_init_seed: u64,
    /// Generator of the seeding's candidate draws: `torch` draws what
    /// Kilosort4's CPU runs draw (torch's CPU generator, MT19937), `chacha8`
    /// a ChaCha8 stream; both are the same on every machine.
    #[arg(long, default_value = "torch", value_name = "torch|chacha8")]
    pub cluster_init_generator: SeedingGenerator,
    /// Spikes of one unit closer than this are duplicates, ms (Kilosort4's duplicate_spike_ms).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.25)]
    pub duplicate_spike_ms: f64,
    /// A unit is `good` when its autocorrelogram's R12 is below it (Kilosort4's acg_threshold).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.2)]
    pub acg_threshold: f64,
    /// Two units merge when their cross-correlogram's R12 is below it (Kilosort4's ccg_threshold).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.25)]
    pub ccg_threshold: f64,
    /// Two units whose most frequent learned template is the same merge only
    /// when the smaller of their median amplitudes (the matching's, as in
    /// amplitudes.npy) is at least this fraction of the larger. Their
    /// cross-correlogram cannot tell: the matching seldom fits one template
    /// twice within a template's length, so it is nearly empty near zero
    /// whether or not they are one neuron, and the template's low-amplitude
    /// fits to other units' residuals would join the unit. A neuron whose
    /// amplitude changes more than that between two clusters stays split.
    /// 0: Kilosort4's merges (the cross-correlogram alone decides).
    #[arg(allow_negative_numbers = true, long, default_value_t = crate::sort::merge::SAME_TEMPLATE_AMPLITUDE_RATIO)]
    pub same_template_amplitude_ratio: f64,
    /// Reproduce Kilosort4 4.1.5–4.1.7's `swarmsplitter.check_CCG` guard, which
    /// switches the refractory test inside the final clustering's tree off
    /// (Kilosort issue #1042). Off by default: spikecube runs the intended test.
    #[arg(long)]
    pub ks4_swarm_ccg_bug: bool,
    /// Memory, GB, for keeping the detection pass's preprocessed windows for
    /// the matching, which then neither reads nor preprocesses them again
    /// (and, with drift correction, the first pass's high-passed windows,
    /// which the corrected pass whitens again instead of reading them):
    /// the GPU's when the detection preprocessed there (default: half of its
    /// free memory with CUDA, none with wgpu), else the host's (default:
    /// a third of the memory the process may still take, within a Slurm job's or
    /// container's cgroup limit). 0: none. A value over 80 % of the memory
    /// left is cut to that, with a warning. Windows past it are read again.
    /// The sort is the same either way.
    #[arg(long, value_name = "GB", value_parser = gigabytes, allow_negative_numbers = true)]
    #[serde(default)]
    pub keep_windows_gb: Option<f64>,
}

/// A memory size in GB of `--keep-windows-gb`: finite and not negative.
fn gigabytes(v: &str) -> std::result::Result<f64, String> {
    match v.parse::<f64>() {
        Ok(gb) if gb.is_finite() && gb >= 0.0 => Ok(gb),
        _ => Err(format!("{v} is not a size in GB (a number, 0 or more)")),
    }
}

impl SortFlags {
    /// The sort's settings: Kilosort4's defaults with these values, and
    /// `nearest_chans` (the detection's) for the matching's features.
    pub fn settings(&self, nearest_chans: usize) -> SortSettings {
        let mut s = SortSettings::kilosort();
        // The command line refuses other values; any other keeps nothing.
        s.keep_windows_bytes = self.keep_windows_gb.map(|gb| {
            if gb.is_finite() && gb > 0.0 {
                (gb * 1e9) as u64
            } else {
                0
            }
        });
        s.matching.th_learned = self.th_learned;
        s.matching.max_peels = self.max_peels;
        s.matching.position_limit = self.position_limit;
        s.matching.nearest_chans = nearest_chans;
        s.clustering.cluster_downsampling = self.cluster_downsampling;
        s.clustering.max_cluster_subset =
            (self.max_cluster_subset > 0).then_some(self.max_cluster_subset);
        s.clustering.cluster_neighbors = self.cluster_neighbors;
        s.clustering.cluster_init_seed = self.cluster_init_seed;
        s.clustering.cluster_init_generator = self.cluster_init_generator;
        s.clustering.ks4_swarm_ccg_bug = self.ks4_swarm_ccg_bug;
        s.duplicate_spike_ms = self.duplicate_spike_ms;
        s.acg_threshold = self.acg_threshold;
        s.ccg_threshold = self.ccg_threshold;
        s.same_template_amplitude_ratio = self.same_template_amplitude_ratio;
        s
    }
}

/// One sort: the detection run (whose `out` is the sort's output folder) and
/// the settings of the later stages.
pub struct SortJob {
    /// Detection as `spikecube detect` runs it; `detect.out` is where the
    /// Phy folder is published.
    pub detect: DetectJob,
    /// Settings after detection.
    pub sort: SortSettings,
}

impl SortJob {
    /// The settings a sort refuses before it opens its output: the later
    /// stages' values ([`SortSettings::validate`]) and `--drift-only`,
    /// which stops before any spike is sorted.
    ///
    /// # Errors
    /// A message naming the flag and the value.
    fn check_settings(&self) -> Result<()> {
        self.sort.validate()?;
        if self.detect.drift.drift_only {
            bail!(
                "--drift-only (drift_only) stops after the drift estimate, before any spike is sorted: run `spikecube detect --drift-only` for drift.npy and drift.png, or sort without it"
            );
        }
        Ok(())
    }

    /// Checks the sort as [`run_sort`] checks it before it reads any sample
    /// (its own settings, then the detection's with
    /// [`crate::pipeline::check_job`]), without reading samples or writing
    /// anything: for planning many sorts (`spikecube batch plan --command
    /// sort`). Returns the detection's warnings so far, not logged.
    ///
    /// # Errors
    /// As [`run_sort`] before it reads the data.
    pub fn check(self) -> Result<Vec<String>> {
        self.check_settings()?;
        crate::pipeline::check_job(self.detect)
    }
}

/// Where a sort is, reported between stages and once per matched window.
#[derive(Debug, Clone)]
pub struct SortProgress {
    /// The stage running (Kilosort4's log names: "first pass" (the drift
    /// estimate's detection pass), "detection", "first clustering",
    /// "templates", "matching", "final clustering", "merges and export").
    pub stage: &'static str,
    /// Windows done in the stage (detection and matching), else 0.
    pub done: u64,
    /// Windows of the stage (detection and matching), else 0.
    pub total: u64,
    /// Recording seconds processed in this stage.
    pub seconds_done: f64,
    /// Wall time since the sort started, s.
    pub elapsed: f64,
    /// Units (clusters or templates) found so far.
    pub units: usize,
}

/// What a finished sort reports.
#[derive(Debug, Clone)]
pub struct SortReport {
    /// The Phy folder written.
    pub phy: PhySummary,
    /// The detection run's report (its warnings included).
    pub detection: Report,
    /// Universal-template spikes (n0) and first-clustering clusters (K0).
    pub n0: usize,
    /// Clusters of the first clustering (K0).
    pub k0: usize,
    /// Learned templates after the pre-merge (K).
    pub k: usize,
    /// Learned-template spikes (n).
    pub n: usize,
    /// Clusters of the final clustering, before the merges.
    pub u1: usize,
    /// Recording seconds sorted.
    pub seconds: f64,
    /// Wall time of each stage, s, in order.
    pub timings: Vec<(&'static str, f64)>,
    /// Warnings of the whole sort.
    pub warnings: Vec<String>,
}

/// The detection folder's arrays the sort continues from.
struct Detected {
    centres: Vec<u32>,
    tf0: Array3<f32>,
    wpca: Array2<f32>,
    wtemp: Array2<f32>,
    wrot: Array2<f32>,
    dshift: Option<(Array2<f64>, Vec<f64>)>,
}

fn read_detected(dir: &Path) -> Result<Detected> {
    let r = |name: &str| dir.join(name);
    let centres: Array1<i64> = crate::npy::read(&r("spike_centers.npy"))?;
    let tf0: Array3<f32> = crate::npy::read(&r("pc_features.npy"))?;
    let mut wpca: Array2<f32> = crate::npy::read(&r("wPCA.npy"))?;
    // The features use the first n_pcs components (`--n-pcs`); the folder's
    // wPCA keeps every component of the templates file.
    let n_pcs = tf0.dim().2;
    if wpca.nrows() > n_pcs {
        wpca = wpca.slice(ndarray::s![..n_pcs, ..]).to_owned();
    }
    let wtemp: Array2<f32> = crate::npy::read(&r("wTEMP.npy"))?;
    let wrot: Array2<f32> = crate::npy::read(&r("whitening_mat.npy"))?;
    let dshift = if r("drift.npy").exists() {
        let d: Array2<f64> = crate::npy::read(&r("drift.npy"))?;
        let y: Array1<f64> = crate::npy::read(&r("drift_blocks.npy"))?;
        Some((d, y.to_vec()))
    } else {
        None
    };
    Ok(Detected {
        centres: centres.iter().map(|&c| c as u32).collect(),
        tf0,
        wpca,
        wtemp,
        wrot,
        dshift,
    })
}

/// Runs the whole sort of `job` and publishes the Phy folder at `job.detect.out`.
///
/// # Errors
/// As [`run_detection`]; with `drift_only` set (it stops before the sort);
/// when no spike is detected, a stage's inputs disagree
/// (named), or the output folder cannot be written. On error nothing is left
/// at the output folder (a previous result there is kept) and the working
/// folder is removed.
pub fn run_sort(mut job: SortJob, progress: &mut dyn FnMut(SortProgress)) -> Result<SortReport> {
    // The matching may use the device again after detection: its context
    // must outlive the detection pass.
    job.detect.last_device_use = false;
    // The detection stage's folder is this run's working folder.
    job.detect.scratch = true;
    job.check_settings()?;
    let out = job.detect.out.clone();
    // An output folder that cannot take the Phy folder fails now, not after
    // the detection stage (the same check runs again when it is published).
    crate::output::folder::check_target(&out, "sort")?;
    // The working folder goes beside the output folder: its parent is made
    // now, and a failure names the output folder.
    crate::output::folder::make_parent(&out)?;
    // What a killed sort into the same place left.
    crate::output::folder::remove_stale_working(&out, WORK_TAG)?;
    // The detection stage's working folder, removed when the sort ends, also
    // when it is stopped by an unwind (Python's Ctrl-C stops a run that way)
    // or by Ctrl-C / SIGTERM at the command line (the signal handler's
    // `abandon_all`).
    let work = crate::output::folder::WorkingFolder::beside(&out, WORK_TAG)?;
    sort_into(job, work.path(), progress)
}

/// The tag of the sort's working folder, `.<out>.spikecube-detection-<pid>`.
const WORK_TAG: &str = "spikecube-detection";

fn sort_into(
    mut job: SortJob,
    work: &Path,
    progress: &mut dyn FnMut(SortProgress),
) -> Result<SortReport> {
    let t0 = Instant::now();
    let out = std::mem::replace(&mut job.detect.out, work.to_path_buf());
    let backend = job.detect.backend;
    let rec: Arc<dyn Recording> = job.detect.recording.clone();
    let probe = job.detect.probe.clone();
    let detection_settings = job.detect.detection.clone();
    let pre_settings = window_settings(&job.detect, rec.as_ref());
    let drift_settings = job.detect.drift.clone();
    let blanking = job.detect.checks.blanking.clone();
    let device_preprocessing = job.detect.device_preprocessing;
    let run_info = job.detect.run_info.clone();
    let mut s = job.sort.clone();
    s.clustering.seeding_device = seeding_device(backend);
    // The matching reads the windows as the detection pass read them: stuck
    // stretches masked when the detection masked them.
    let mask_min_run = job
        .detect
        .checks
        .mask_clipped
        .then(|| crate::checks::stuck_min_run(rec.fs()));
    // The detection pass's preprocessed windows stay where they were made (on
    // the GPU, or in host memory) for the matching, within the budget.
    let keep = crate::stages::KeepWindows {
        budget: s.keep_windows_bytes,
        slot: Default::default(),
    };
    job.detect.keep_windows = Some(keep.clone());
    let mut timings: Vec<(&'static str, f64)> = Vec::new();
    let mut lap = {
        let mut t = Instant::now();
        move |timings: &mut Vec<(&'static str, f64)>, name: &'static str| {
            timings.push((name, t.elapsed().as_secs_f64()));
            t = Instant::now();
        }
    };

    let detection = run_detection(job.detect, &mut |p| {
        progress(SortProgress {
            stage: if p.first_pass {
                "first pass"
            } else {
                "detection"
            },
            done: p.windows_done,
            total: p.windows_total,
            seconds_done: p.seconds_done,
            elapsed: t0.elapsed().as_secs_f64(),
            units: 0,
        })
    })?;
    lap(&mut timings, "detection");
    let kept = keep.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    if detection.summary.n_spikes == 0 {
        bail!(
            "no spike was detected in {}: nothing to sort",
            rec.describe()
        );
    }
    let t_read = Instant::now();
    let det = read_detected(work).context("reading the detection stage's arrays")?;
    tracing::debug!(
        "the detection stage's arrays read back in {:.3} s",
        t_read.elapsed().as_secs_f64()
    );
    let det_json = read_manifest(work)?;
    let geometry = Geometry::new(&probe, &detection_settings)?;
    let stage = |name: &'static str, units: usize| SortProgress {
        stage: name,
        done: 0,
        total: 0,
        seconds_done: 0.0,
        elapsed: t0.elapsed().as_secs_f64(),
        units,
    };

    progress(stage("first clustering", 0));
    let first = first_stage(&det, &probe, &geometry, &s.clustering)?;
    lap(&mut timings, "first_clustering");
    let k0 = first.wall.dim().0;
    progress(stage("templates", k0));
    let post = postprocess_templates(
        first.wall.view(),
        &first.clu,
        det.wpca.view(),
        det.wtemp.view(),
    )
    .context("template post-processing")?;
    lap(&mut timings, "templates");
    let k = post.wall3.dim().0;

    let input = MatchingInput {
        rec: rec.as_ref(),
        probe: &probe,
        geometry: &geometry,
        detection: &detection_settings,
        pre_settings: &pre_settings,
        drift_settings: &drift_settings,
        det: &det,
        wall3: &post.wall3,
        settings: &s.matching,
        backend,
        device_preprocessing,
        blanking,
        mask_min_run,
    };
    let (ex, matching_warnings, matching_run) =
        matching_pass(&input, kept, &mut |done, total, seconds_done| {
            progress(SortProgress {
                stage: "matching",
                done,
                total,
                seconds_done,
                elapsed: t0.elapsed().as_secs_f64(),
                units: k,
            })
        })?;
    lap(&mut timings, "matching");
    let n = ex.st.nrows();
    if n == 0 {
        bail!(
            "the learned-template matching found no spike above Th_learned = {} in {}",
            s.matching.th_learned,
            rec.describe()
        );
    }

    progress(stage("final clustering", k));
    let icc = ex.icc.mapv(|v| v as usize);
    let iu: Vec<usize> = ex.iu.iter().map(|&v| v as usize).collect();
    let fin = final_stage(&ex, &icc, &iu, &probe, &geometry, rec.fs(), &s.clustering)?;
    lap(&mut timings, "final_clustering");
    let u1 = fin.wall.dim().0;

    progress(stage("merges and export", u1));
    let mut export = export_settings(&run_info, rec.fs(), &s);
    export.n_samples = rec.n_samples();
    // Spike times count from the file's first sample, as `params.py`'s
    // dat_path is the whole file (Kilosort4 adds imin likewise).
    export.imin = rec.first_sample() as i64;
    let mut warnings = [detection.warnings.clone(), matching_warnings].concat();
    let manifest = manifest(
        &s,
        &det,
        &det_json,
        [k0, k, n, u1],
        [&detection.warnings, &warnings],
        &timings,
        matching_run,
    );
    let n0 = det.tf0.len_of(Axis(0));
    let result = sort_result(ex, fin, det, icc, iu);
    let phy = save_sorting(&out, result, &probe, &export, manifest, "sort")?;
    lap(&mut timings, "merges_export");
    warnings.extend(phy.warnings.iter().cloned());
    Ok(SortReport {
        phy,
        seconds: detection.seconds,
        detection,
        n0,
        k0,
        k,
        n,
        u1,
        timings,
        warnings,
    })
}

/// The matching's and the final clustering's arrays as the Phy writer takes them.
fn sort_result(
    ex: crate::sort::matching::Extracted,
    fin: crate::sort::clustering::Clustering,
    det: Detected,
    icc: Array2<usize>,
    iu: Vec<usize>,
) -> SortResult {
    SortResult {
        st: ex.st,
        tf: ex.tf,
        clu: fin.clu,
        wall: fin.wall,
        wpca: det.wpca,
        wrot: det.wrot,
        sets: ChannelSets {
            icc,
            icc_mask: ex.icc_mask,
            iu,
        },
    }
}

/// What the matching pass needs of the run: the recording and its probe, the
/// detection's settings and arrays (whitening, drift), the templates.
struct MatchingInput<'a> {
    rec: &'a dyn Recording,
    probe: &'a crate::probe::Probe,
    /// For the device's preprocessing (a GPU build).
    #[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
    geometry: &'a Geometry,
    detection: &'a crate::detect::DetectionSettings,
    pre_settings: &'a crate::preprocess::PreprocessSettings,
    drift_settings: &'a crate::drift::DriftSettings,
    det: &'a Detected,
    wall3: &'a Array3<f32>,
    settings: &'a MatchingSettings,
    backend: Backend,
    /// Whether the detection preprocessed on its device (`--preprocess-on`).
    #[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
    device_preprocessing: bool,
    blanking: Option<Arc<crate::preprocess::Blanking>>,
    /// Stuck stretches of at least this many samples are masked in each raw
    /// window, as the detection pass masked them (`--mask-clipped`).
    mask_min_run: Option<usize>,
}

/// The learned-template matching over every window of the recording,
/// preprocessed as the detection's second pass was (same whitening, same
/// drift correction, same masking), on the input's back end ([`Matcher`]),
/// with the warnings of choosing it. On a GPU that preprocessed the
/// detection's windows, the windows the detection pass kept on the device
/// (`kept`, from window 0 on) are matched as they are, and the others go to
/// the device raw as read and are preprocessed and matched there
/// ([`Matcher::match_raw`]); otherwise each window is preprocessed on the
/// host and handed to the matcher. Either way a reader thread prepares
/// window i + 1 while window i is matched, and the windows and their order
/// are the same as read one by one, so the results are too: the kept windows
/// hold the bits the device's preprocessing of the same raw window gives.
fn matching_pass(
    input: &MatchingInput,
    kept: Option<crate::stages::KeptWindows>,
    progress: &mut dyn FnMut(u64, u64, f64),
) -> Result<(
    crate::sort::matching::Extracted,
    Vec<String>,
    serde_json::Value,
)> {
    let mut warnings = Vec::new();
    let mut matching = input.settings.clone();
    matching.nt = input.detection.nt;
    matching.batch_size = input.pre_settings.batch_size;
    // As in detection: a probe with fewer sites than nearest_chans (a tetrode)
    // uses all of them.
    let n_sites = input.probe.n_sites();
    if matching.nearest_chans > n_sites {
        tracing::info!(
            "matching: nearest_chans lowered from {} to {n_sites}, the number of sites",
            matching.nearest_chans
        );
        matching.nearest_chans = n_sites;
    }
    let t_setup = Instant::now();
    let setup = Arc::new(
        MatchingSetup::new(
            input.wall3.view(),
            input.det.wpca.view(),
            &input.probe.xc,
            &input.probe.yc,
            &matching,
        )
        .context("learned-template matching set-up")?,
    );
    let setup_s = t_setup.elapsed().as_secs_f64();
    let (mut matcher, chosen) = Matcher::open(input.backend, setup.clone(), &mut warnings)
        .context("learned-template matching back end")?;
    tracing::debug!(
        "matching: set-up {setup_s:.3} s, back end opened {:.3} s",
        t_setup.elapsed().as_secs_f64() - setup_s
    );
    tracing::info!(
        "learned-template matching on {} ({}): {}",
        chosen.backend,
        chosen.device,
        chosen.reason
    );
    // Blanked as the detection pass blanked the same windows.
    let pre = Preprocessor::new(input.pre_settings, input.det.wrot.clone())?
        .with_blanking(input.blanking.clone());
    let drift = match &input.det.dshift {
        Some((dshift, yblk)) if !input.drift_settings.drift_only => Some(
            DriftCorrection::new(
                &input.probe.xc,
                &input.probe.yc,
                dshift.clone(),
                yblk.clone(),
                input.drift_settings.sig_interp,
            )?
            .with_zero_outside(
                (input.drift_settings.mode != DriftMode::Kilosort
                    && input.drift_settings.edge_margin.is_finite())
                .then_some(input.drift_settings.edge_margin),
            ),
        ),
        _ => None,
    };
    // The detection stage planned (and warned about) the same windows.
    let plan = WindowPlan::again(
        input.rec.n_samples(),
        input.pre_settings.batch_size as u64,
        input.pre_settings.nt as u64,
    )?;
    let mut parts = Vec::with_capacity(plan.n_windows as usize);
    let mut done = |i: u64| {
        progress(
            i + 1,
            plan.n_windows,
            ((i + 1) * plan.batch_size).min(plan.n_samples) as f64 / input.rec.fs(),
        )
    };
    // Windows kept in host memory are the host path's; those on a GPU, the
    // device path's.
    let shape = pre.window_shape();
    let (kept, host_kept) = match kept {
        Some(k) if k.backend == "cpu" => {
            let fits = (k.n_sites, k.n_t) == shape;
            (None, if fits { k.host } else { Vec::new() })
        }
        k => (k, Vec::new()),
    };
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    if device_feed_allowed(input, &matcher) {
        let kept = kept.filter(|k| matcher.holds(k) && (k.n_sites, k.n_t) == shape);
        let n_kept = kept
            .as_ref()
            .map_or(0, |k| k.len() as u64)
            .min(plan.n_windows);
        let feed = if n_kept < plan.n_windows {
            device_feed(input, &chosen, &pre, &matcher)?
        } else {
            None
        };
        if n_kept == plan.n_windows || feed.is_some() {
            tracing::info!(
                "learned-template matching: {n_kept} of {} windows kept on the device by the detection pass, the others preprocessed on the device",
                plan.n_windows
            );
            let run = matching_run(
                &chosen,
                plan.n_windows,
                n_kept,
                kept.as_ref().map(|k| k.backend),
            );
            let kept = kept.map(|k| k.handles).unwrap_or_default();
            device_fed(
                input,
                &plan,
                &pre,
                drift.as_ref(),
                feed,
                kept,
                &mut matcher,
                &mut parts,
                &mut done,
            )?;
            return Ok((assembled(&setup, &parts), warnings, run));
        }
    }
    // Windows kept on the device are used only where the device preprocesses.
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    drop(kept);
    let n_kept = (host_kept.len() as u64).min(plan.n_windows);
    let run = matching_run(
        &chosen,
        plan.n_windows,
        n_kept,
        (n_kept > 0).then_some("host"),
    );
    host_fed(
        input,
        &plan,
        &pre,
        drift.as_ref(),
        host_kept,
        &mut matcher,
        &mut parts,
        &mut done,
    )?;
    Ok((assembled(&setup, &parts), warnings, run))
}

/// How the matching pass ran, for `spikecube.json`: its back end, its
/// windows, and how many of them the detection pass kept and where (`cuda`,
/// `wgpu`, `host`; `null` when none).
fn matching_run(
    chosen: &crate::backend::Chosen,
    n_windows: u64,
    n_kept: u64,
    kept_in: Option<&str>,
) -> serde_json::Value {
    serde_json::json!({
        "backend": chosen.backend,
        "windows": n_windows,
        "windows_kept": n_kept,
        "kept_in": if n_kept > 0 { kept_in } else { None },
    })
}

/// [`crate::sort::matching::assemble`], its time logged (debug).
fn assembled(
    setup: &MatchingSetup,
    parts: &[crate::sort::matching::WindowSpikes],
) -> crate::sort::matching::Extracted {
    let t = Instant::now();
    let ex = crate::sort::matching::assemble(setup, parts);
    tracing::debug!(
        "matching: spikes assembled {:.3} s",
        t.elapsed().as_secs_f64()
    );
    ex
}

/// The matching pass on windows preprocessed on the host, matched by
/// `matcher`: windows `0 .. kept.len()` as the detection pass kept them
/// (each freed once matched), the others read and preprocessed on a reader
/// thread.
#[allow(clippy::too_many_arguments)]
fn host_fed(
    input: &MatchingInput,
    plan: &WindowPlan,
    pre: &Preprocessor,
    drift: Option<&DriftCorrection>,
    kept: Vec<Array2<f32>>,
    matcher: &mut Matcher,
    parts: &mut Vec<crate::sort::matching::WindowSpikes>,
    done: &mut dyn FnMut(u64),
) -> Result<()> {
    let n_windows = plan.n_windows;
    let n_kept = (kept.len() as u64).min(n_windows);
    if n_kept > 0 {
        tracing::info!(
            "learned-template matching: {n_kept} of {n_windows} windows kept in host memory by the detection pass"
        );
    }
    if let Some(setup) = matcher.cpu_setup() {
        let at_once = cpu_windows_at_once().min(n_windows.max(1) as usize);
        if at_once > 1 {
            return cpu_windows_in_parallel(
                input, plan, pre, drift, kept, setup, at_once, parts, done,
            );
        }
    }
    let rec = input.rec;
    let chan_map = &input.probe.chan_map;
    std::thread::scope(|scope| -> Result<()> {
        // Kept windows, once matched, are freed on a thread of their own:
        // returning a window's pages to the system takes milliseconds that
        // would otherwise stand between one window's matching and the next.
        let (drop_tx, drop_rx) = crossbeam_channel::unbounded::<Array2<f32>>();
        scope.spawn(move || drop_rx.iter().for_each(drop));
        let (tx, rx) = crossbeam_channel::bounded::<Result<Array2<f32>>>(1);
        // Matched windows' buffers go back to the reader: at most three
        // exist (one read, one queued, one matched).
        let (free_tx, free_rx) = crossbeam_channel::unbounded::<Array2<f32>>();
        scope.spawn(move || {
            for i in n_kept..n_windows {
                let mut x = free_rx.try_recv().unwrap_or_else(|_| Array2::zeros((0, 0)));
                let x = preprocessed_window_into(
                    rec,
                    plan,
                    chan_map,
                    pre,
                    drift,
                    i,
                    input.mask_min_run,
                    &mut x,
                )
                .map(|()| x)
                .with_context(|| format!("matching: window {i}"));
                let failed = x.is_err();
                if tx.send(x).is_err() || failed {
                    break;
                }
            }
        });
        let mut kept = kept.into_iter();
        for i in 0..n_windows {
            if i < n_kept {
                let mut x = kept.next().expect("n_kept windows");
                let w = matcher
                    .match_window_in_place(&mut x)
                    .with_context(|| format!("matching: window {i} kept in host memory"))?;
                let _ = drop_tx.send(x);
                parts.push(w);
                done(i);
                continue;
            }
            let mut x = rx
                .recv()
                .with_context(|| format!("matching: window {i} was not read"))??;
            let w = matcher
                .match_window_in_place(&mut x)
                .with_context(|| format!("matching: window {i}"))?;
            let _ = free_tx.send(x);
            parts.push(w);
            done(i);
        }
        Ok(())
    })
}

/// How many windows the CPU matching works on at once
/// (`SPIKECUBE_MATCH_WINDOWS`, 1 by default).
fn cpu_windows_at_once() -> usize {
    std::env::var("SPIKECUBE_MATCH_WINDOWS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

/// [`host_fed`] on the CPU with `at_once` windows in flight: each of
/// `at_once` threads takes the next window (a kept one, or one it reads and
/// preprocesses itself), matches it in place and sends its spikes, and this
/// thread hands them on in window order. One window's serial steps (peak
/// tests, the peels' bookkeeping, the reading) then run beside another's
/// parallel ones. Each window is matched by the same code as alone, so the
/// spikes are those of one window at a time, bit for bit.
#[allow(clippy::too_many_arguments)]
fn cpu_windows_in_parallel(
    input: &MatchingInput,
    plan: &WindowPlan,
    pre: &Preprocessor,
    drift: Option<&DriftCorrection>,
    kept: Vec<Array2<f32>>,
    setup: &MatchingSetup,
    at_once: usize,
    parts: &mut Vec<crate::sort::matching::WindowSpikes>,
    done: &mut dyn FnMut(u64),
) -> Result<()> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    let n_windows = plan.n_windows;
    let kept: Vec<Mutex<Option<Array2<f32>>>> = kept
        .into_iter()
        .take(n_windows as usize)
        .map(|x| Mutex::new(Some(x)))
        .collect();
    let n_kept = kept.len() as u64;
    let (next, stop) = (AtomicU64::new(0), AtomicBool::new(false));
    let read = |i: u64, x: &mut Array2<f32>| {
        preprocessed_window_into(
            input.rec,
            plan,
            &input.probe.chan_map,
            pre,
            drift,
            i,
            input.mask_min_run,
            x,
        )
    };
    std::thread::scope(|scope| -> Result<()> {
        let (tx, rx) =
            crossbeam_channel::unbounded::<(u64, Result<crate::sort::matching::WindowSpikes>)>();
        for _ in 0..at_once {
            let tx = tx.clone();
            let (next, stop, kept, read) = (&next, &stop, &kept, &read);
            scope.spawn(move || {
                let mut buf = Array2::<f32>::zeros((0, 0));
                while !stop.load(Relaxed) {
                    let i = next.fetch_add(1, Relaxed);
                    if i >= n_windows {
                        break;
                    }
                    let r = if i < n_kept {
                        let mut x = kept[i as usize]
                            .lock()
                            .ok()
                            .and_then(|mut k| k.take())
                            .expect("each kept window is taken once");
                        crate::sort::matching::match_window_in_place(setup, &mut x)
                            .with_context(|| format!("matching: window {i} kept in host memory"))
                    } else {
                        read(i, &mut buf)
                            .and_then(|()| {
                                Ok(crate::sort::matching::match_window_in_place(
                                    setup, &mut buf,
                                )?)
                            })
                            .with_context(|| format!("matching: window {i}"))
                    };
                    if r.is_err() {
                        stop.store(true, Relaxed);
                    }
                    if tx.send((i, r)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        let mut waiting = std::collections::BTreeMap::new();
        let mut i_out = 0u64;
        for (i, r) in rx.iter() {
            let w = match r {
                Ok(w) => w,
                Err(e) => {
                    stop.store(true, Relaxed);
                    return Err(e);
                }
            };
            waiting.insert(i, w);
            while let Some(w) = waiting.remove(&i_out) {
                parts.push(w);
                done(i_out);
                i_out += 1;
            }
        }
        if i_out < n_windows {
            bail!("matching: window {i_out} was not matched");
        }
        Ok(())
    })
}

/// Whether the matching's windows may be preprocessed on the matcher's
/// device ([`device_feed`]): a GPU matcher, a detection that preprocessed on
/// its device, no blanking, and not `SPIKECUBE_MATCH_FEED=host`.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn device_feed_allowed(input: &MatchingInput, matcher: &Matcher) -> bool {
    matcher.is_gpu()
        && input.device_preprocessing
        && input.blanking.is_none()
        && std::env::var("SPIKECUBE_MATCH_FEED").as_deref() != Ok("host")
}

/// The preprocessing on the matcher's GPU: a detector there with the
/// detection's preprocessing, and its packer of raw windows; `None` when the
/// detection preprocessed on the host (`--preprocess-on host`), a blanking
/// is set (it runs on the host), the matcher is on the CPU, or the
/// preprocessing has no device form. `SPIKECUBE_MATCH_FEED=host` keeps the
/// host's preprocessing, for comparing the two.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn device_feed(
    input: &MatchingInput,
    chosen: &crate::backend::Chosen,
    pre: &Preprocessor,
    matcher: &Matcher,
) -> Result<Option<(crate::backend::Detector, crate::detect::gpu::Packer)>> {
    if !device_feed_allowed(input, matcher) {
        return Ok(None);
    }
    let mut feed = crate::backend::Detector::new(
        chosen,
        input.geometry.clone(),
        crate::detect::UniversalTemplates::builtin(),
        input.detection.clone(),
    )
    .context("device preprocessing for the matching")?;
    if !matcher.shares_device_with(&feed) || !feed.set_preprocessing(pre)? {
        return Ok(None);
    }
    let Some(mut packer) = feed.packer() else {
        return Ok(None);
    };
    // Two upload buffers on the device: the reader thread copies window i + 1
    // into one while window i, in the other, is preprocessed and matched.
    let (c, n) = pre.window_shape();
    let bytes = c * crate::recording::Raw16::stride_for(n) * 2;
    feed.give_upload_slots(&mut packer, bytes);
    Ok(Some((feed, packer)))
}

/// The matching pass on the device: windows `0 .. kept.len()` from the
/// detection pass's kept buffers, the others sent to the device raw as read
/// (int16 values when the file holds them), preprocessed there with the
/// window's drift-corrected whitening by `feed` and matched there
/// ([`Matcher::match_raw`]). A reader thread reads, masks and packs the next
/// unkept window, copies it into one of the device's two upload buffers
/// (CUDA, page-locked memory), and makes its whitening matrix. Each kept
/// buffer is freed once its window is matched.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
#[allow(clippy::too_many_arguments)]
fn device_fed(
    input: &MatchingInput,
    plan: &WindowPlan,
    pre: &Preprocessor,
    drift: Option<&DriftCorrection>,
    feed: Option<(crate::backend::Detector, crate::detect::gpu::Packer)>,
    kept: Vec<cubecl::server::Handle>,
    matcher: &mut Matcher,
    parts: &mut Vec<crate::sort::matching::WindowSpikes>,
    done: &mut dyn FnMut(u64),
) -> Result<()> {
    type Csr = (Vec<u32>, Vec<u32>, Vec<f32>);
    let n_windows = plan.n_windows;
    let n_kept = (kept.len() as u64).min(n_windows);
    let n_t = pre.window_shape().1;
    let rec = input.rec;
    let chan_map = &input.probe.chan_map;
    let yc = &input.probe.yc;
    let mask_min_run = input.mask_min_run;
    let (mut feed, packer) = match feed {
        Some((d, p)) => (Some(d), Some(p)),
        None => (None, None),
    };
    std::thread::scope(|scope| -> Result<()> {
        let (tx, rx) =
            crossbeam_channel::bounded::<Result<(crate::detect::gpu::RawWindow, Option<Csr>)>>(2);
        let reader = packer.map(|packer| {
            scope.spawn(move || {
                let (mut read_s, mut whiten_s, mut upload_s) = (0f64, 0f64, 0f64);
                let alloc_packer = packer.clone();
                let mut raw16: Option<crate::stages::Raw16Alloc> =
                    Some(Box::new(move |n| Box::new(alloc_packer.raw16_buffer(n))));
                let mut data = Array2::<f32>::zeros((0, 0));
                for i in n_kept..n_windows {
                    let item = (|| -> Result<_> {
                        let t0 = Instant::now();
                        let r16 =
                            crate::stages::read_any(rec, plan, i, chan_map, &mut data, &mut raw16)?;
                        let mut w = crate::recording::Window::of(
                            rec.first_sample(),
                            plan,
                            i,
                            std::mem::replace(&mut data, Array2::zeros((0, 0))),
                            r16,
                        );
                        if let Some(min_run) = mask_min_run {
                            let cols = crate::checks::WindowColumns::of(plan, i);
                            crate::checks::mask_stuck_window(&mut w, &cols, min_run);
                        }
                        let raw = packer.raw_window(&mut w);
                        let t_up = Instant::now();
                        let raw = packer.send_ahead(raw);
                        upload_s += t_up.elapsed().as_secs_f64();
                        let t1 = Instant::now();
                        let csr = match drift {
                            Some(d) => Some(d.window_whitening(i, pre.whitening())?.csr()),
                            None => None,
                        };
                        read_s += t_up.duration_since(t0).as_secs_f64();
                        whiten_s += t1.elapsed().as_secs_f64();
                        Ok((raw, csr))
                    })()
                    .with_context(|| format!("matching: window {i}"));
                    let failed = item.is_err();
                    if tx.send(item).is_err() || failed {
                        break;
                    }
                }
                (read_s, whiten_s, upload_s)
            })
        });
        // Seconds waiting for the reader, and on the device (preprocessing,
        // matching, the download), for the log: which side bounds the pass.
        let (mut waited, mut on_device) = (0f64, 0f64);
        let mut kept = kept.into_iter();
        for i in 0..n_windows {
            let t0 = Instant::now();
            if i < n_kept {
                let x = kept.next().expect("n_kept buffers");
                matcher
                    .queue_kept(&x, n_t)
                    .with_context(|| format!("matching: window {i} kept on the device"))?;
                drop(x);
                on_device += t0.elapsed().as_secs_f64();
                take_matched(matcher.take_done(), parts, done);
                continue;
            }
            let feed = feed.as_mut().ok_or_else(|| {
                anyhow::anyhow!("matching: window {i} was not kept on the device")
            })?;
            let (raw, csr) = rx
                .recv()
                .with_context(|| format!("matching: window {i} was not read"))??;
            let t1 = Instant::now();
            if let Some((start, cols, vals)) = &csr {
                feed.set_whitening(start, cols, vals)?;
            }
            matcher
                .queue_raw(feed, raw, yc)
                .with_context(|| format!("matching: window {i} on the device"))?;
            waited += t1.duration_since(t0).as_secs_f64();
            on_device += t1.elapsed().as_secs_f64();
            take_matched(matcher.take_done(), parts, done);
        }
        let t_last = Instant::now();
        let last = matcher
            .flush()
            .with_context(|| format!("matching: window {} on the device", n_windows.max(1) - 1))?;
        take_matched(last, parts, done);
        on_device += t_last.elapsed().as_secs_f64();
        if parts.len() as u64 != n_windows {
            bail!(
                "matching: {} of {n_windows} windows came back from the device",
                parts.len()
            );
        }
        drop(rx);
        let (read_s, whiten_s, upload_s) = reader
            .map(|r| r.join().unwrap_or_default())
            .unwrap_or_default();
        tracing::info!(
            "matching pass: {n_windows} windows ({n_kept} kept on the device), {on_device:.2} s on the device, {waited:.2} s waiting for the reader (its reading {read_s:.2} s, sending ahead {upload_s:.2} s, drift-corrected whitening {whiten_s:.2} s)"
        );
        Ok(())
    })
}

/// Appends matched windows' spikes (in window order) to `parts`, telling
/// `done` each window's index.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn take_matched(
    windows: Vec<crate::sort::matching::WindowSpikes>,
    parts: &mut Vec<crate::sort::matching::WindowSpikes>,
    done: &mut dyn FnMut(u64),
) {
    for w in windows {
        parts.push(w);
        done(parts.len() as u64 - 1);
    }
}

/// The merges' and the Phy folder's settings from the run and the sort settings.
fn export_settings(run_info: &crate::output::RunInfo, fs: f64, s: &SortSettings) -> ExportSettings {
    let dat_paths = std::iter::once(&run_info.dat_path)
        .chain(&run_info.more_dat_paths)
        .cloned()
        .collect();
    let mut export = ExportSettings::new(fs, run_info.n_channels_dat, dat_paths);
    export.dtype = run_info.dtype.clone();
    export.offset = run_info.offset;
    export.duplicate_spike_ms = s.duplicate_spike_ms;
    export.merge = MergeSettings::kilosort();
    export.merge.thresholds.acg = s.acg_threshold;
    export.merge.thresholds.ccg = s.ccg_threshold;
    export.merge.same_template_amplitude_ratio = s.same_template_amplitude_ratio;
    export
}

/// Where the clusterings' seeding runs: on the sort's GPU when its back end
/// is CUDA or wgpu (every gain there, all groups in lockstep, or with
/// `SPIKECUBE_SEED_LOCKSTEP=0` only the candidate pairs screened there; the
/// labels are the same bytes as on the CPU), else on the CPU.
/// `SPIKECUBE_SEED_SCREEN=cpu` keeps it on the CPU, for measuring;
/// `SPIKECUBE_SEED_DEVICE_MIN=N` sends only groups of at least N spikes to
/// the device (default [`crate::sort::clustering::DEVICE_MIN_SPIKES`]), for
/// measuring.
fn seeding_device(backend: Backend) -> crate::sort::clustering::SeedingDevice {
    use crate::sort::clustering::SeedingDevice;
    if std::env::var("SPIKECUBE_SEED_SCREEN").as_deref() == Ok("cpu") {
        return SeedingDevice::cpu();
    }
    let device = match crate::backend::choose(backend) {
        #[cfg(feature = "cuda")]
        Ok(c) if c.backend == "cuda" => SeedingDevice::cuda(),
        #[cfg(feature = "wgpu")]
        Ok(c) if c.backend == "wgpu" => SeedingDevice::wgpu(),
        _ => SeedingDevice::cpu(),
    };
    let min = std::env::var("SPIKECUBE_SEED_DEVICE_MIN")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(crate::sort::clustering::DEVICE_MIN_SPIKES);
    let device = device.with_min_spikes(min);
    if device.is_device() && min > 0 {
        tracing::info!(
            "clustering: seeding on {} for groups of at least {min} spikes, on the CPU for the others",
            device.name()
        );
    } else if device.is_device() {
        tracing::info!("clustering: seeding on {}", device.name());
    } else {
        tracing::info!("clustering: seeding on the cpu");
    }
    device
}

/// The first clustering of the universal spikes (by template centre).
fn first_stage(
    det: &Detected,
    probe: &crate::probe::Probe,
    geometry: &Geometry,
    settings: &ClusteringSettings,
) -> Result<crate::sort::clustering::Clustering> {
    let ic = geometry.i_c.mapv(|v| v as usize);
    first_clustering(
        &det.centres,
        det.tf0.view(),
        ic.view(),
        &geometry.xcup,
        &geometry.ycup,
        &probe.xc,
        geometry.dmin,
        probe.n_sites(),
        settings,
    )
    .context("first clustering")
}

/// The final clustering of the matched spikes (by learned template), with
/// their times in seconds for the refractory test.
fn final_stage(
    ex: &crate::sort::matching::Extracted,
    icc: &Array2<usize>,
    iu: &[usize],
    probe: &crate::probe::Probe,
    geometry: &Geometry,
    fs: f64,
    settings: &ClusteringSettings,
) -> Result<crate::sort::clustering::Clustering> {
    let st_template: Vec<u32> = ex.st.column(1).iter().map(|&v| v as u32).collect();
    let times_s: Vec<f64> = ex.st.column(0).iter().map(|&v| v / fs).collect();
    final_clustering(
        &st_template,
        &times_s,
        ex.tf.view(),
        icc.view(),
        iu,
        &probe.xc,
        &probe.yc,
        &geometry.ycup,
        geometry.dmin,
        settings,
    )
    .context("final clustering")
}

/// The preprocessing settings of the run's windows, as the detection run
/// fixes them: `fs` and `nt` from the recording and the detection settings,
/// and a recording shorter than one batch read as one window.
fn window_settings(job: &DetectJob, rec: &dyn Recording) -> crate::preprocess::PreprocessSettings {
    let mut pre = job.preprocess.clone();
    pre.fs = rec.fs();
    pre.nt = job.detection.nt;
    let n = rec.n_samples();
    if n > 0 && n < pre.batch_size as u64 && n >= pre.nt as u64 {
        pre.batch_size = n as usize;
    }
    pre
}

/// The sort's part of `spikecube.json`: settings, counts (K0, K, n, U1) and
/// the stages' times so far.
fn manifest(
    s: &SortSettings,
    det: &Detected,
    det_json: &serde_json::Value,
    [k0, k, n, u1]: [usize; 4],
    [detection_warnings, warnings]: [&[String]; 2],
    timings: &[(&'static str, f64)],
    matching: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "program": "spikecube",
        "version": env!("CARGO_PKG_VERSION"),
        "versions": det_json["versions"],
        "input": det_json["input"],
        "provenance": det_json["provenance"],
        "settings": { "detection": det_json["settings"], "sort": s },
        "detection": { "counts": det_json["counts"], "timings_s": det_json["timings_s"] },
        "stage_counts": { "universal_spikes": det.tf0.len_of(Axis(0)), "first_clusters": k0,
                    "learned_templates": k, "learned_spikes": n, "final_clusters": u1 },
        "matching": matching,
        "detection_warnings": detection_warnings,
        "warnings": warnings,
        "timings_s": timings.iter().map(|(k, v)| ((*k).to_string(), serde_json::json!(v)))
            .chain([("total".to_string(), serde_json::json!(timings.iter().map(|t| t.1).sum::<f64>()))])
            .collect::<serde_json::Map<_, _>>(),
    })
}

/// The detection stage's `spikecube.json` (its input, versions, provenance
/// and settings go into the sort's).
fn read_manifest(work: &Path) -> Result<serde_json::Value> {
    let p = work.join(crate::output::folder::MANIFEST);
    let text =
        std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} does not read", p.display()))
}
#[cfg(test)]
mod tests {
    use super::SortFlags;
    use crate::sort::clustering::SeedingGenerator;

    /// The Python package sends every sort setting by name
    /// (`python/spikecube/_settings.py`); the seeding's generator is a name.
    #[test]
    fn sort_settings_by_name_choose_the_seeding_generator() {
        let json = r#"{"Th_learned": 8.0, "max_peels": 100, "position_limit": 100.0,
            "cluster_downsampling": 20, "max_cluster_subset": 25000, "cluster_neighbors": 10,
            "cluster_init_seed": 5, "cluster_init_generator": "torch", "duplicate_spike_ms": 0.25,
            "acg_threshold": 0.2, "ccg_threshold": 0.25, "same_template_amplitude_ratio": 0.5,
            "ks4_swarm_ccg_bug": false, "keep_windows_gb": null}"#;
        let generator = |json: &str| {
            serde_json::from_str::<SortFlags>(json)
                .map(|f| f.settings(10).clustering.cluster_init_generator)
        };
        assert_eq!(generator(json).unwrap(), SeedingGenerator::Torch);
        let chacha = json.replace("\"torch\"", "\"chacha8\"");
        assert_eq!(generator(&chacha).unwrap(), SeedingGenerator::ChaCha8);
        assert!(generator(&json.replace("\"torch\"", "\"mt\"")).is_err());
    }
}
