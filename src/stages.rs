//! The per-window part of a run, pipelined: reading, preprocessing + detection,
//! and writing overlap across windows.
//!
//! Three stages, each on its own thread, joined by bounded queues that move
//! owned buffers from one stage to the next:
//!
//! 1. **read** (thread `spikecube-read`): [`read_window`] into a recycled
//!    window buffer, then the caller's per-window input checks (stuck runs,
//!    channel health, masking), in window order;
//! 2. **pass** (thread `spikecube-pass`): a [`WindowPass`] — preprocessing and
//!    detection as one call, raw window in, [`Detections`] out — after which
//!    the window buffer goes back to the reader;
//! 3. **write** (the calling thread): the caller's closure, in window order
//!    (boundary duplicates, the output folder, progress).
//!
//! Memory is bounded by [`WINDOWS_IN_FLIGHT`] window buffers: the reader takes a
//! free buffer before reading, so it can be at most that many windows ahead of
//! the pass (back-pressure), whatever the recording's length. Detections are
//! small and queue behind the pass.
//!
//! Each stage adds its busy seconds to a [`StageTimes`]; their sum divided by
//! the wall time of the stages is the overlap achieved (1 when nothing
//! overlaps; at most the number of stages, more when a stage itself runs on
//! several cores counts only once).
//!
//! Results do not depend on the overlap: every stage handles windows in order,
//! one at a time, exactly as a sequential loop would.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use crossbeam_channel::{bounded, unbounded};
use ndarray::Array2;

use crate::backend::Detector;
use crate::detect::cpu::Detections;
use crate::preprocess::Preprocessor;
use crate::recording::{Recording, Window, WindowPlan, read_window};

/// Window buffers a pipelined run holds at most: one being read, one queued
/// for the pass, one in the pass.
pub const WINDOWS_IN_FLIGHT: usize = 3;

/// Threads reading windows at once for a pass that takes int16 windows (a GPU
/// pass, [`WindowPass::raw16_buffers`]) of a recording that gives them
/// ([`crate::recording::gives_int16`]): each reads a window of its own, then
/// hands it on in window order ([`crate::recording::read_in_order`]); one
/// reader for other passes. One by default: on the H200 machine three readers
/// shared the host's memory bandwidth and were no faster (the read already
/// runs on every core); [`device_readers`]
/// takes another count from the environment, for measuring. Each reader
/// beyond the first holds one more window ([`windows_in_flight`]).
pub const DEVICE_READERS: usize = 1;

/// Window buffers [`run_windows`] holds at most: [`WINDOWS_IN_FLIGHT`], one
/// more when a stager runs between the reader and the pass, and one more per
/// reading thread beyond the first (`readers`: 1, or [`DEVICE_READERS`] for
/// a pass that takes int16 windows). 4 for a CPU pass and, by default, for a
/// GPU pass (int16 windows, half the bytes of a CPU pass's f32 windows).
pub fn windows_in_flight(stager: bool, readers: usize) -> usize {
    WINDOWS_IN_FLIGHT + usize::from(stager) + readers.max(1) - 1
}

/// [`DEVICE_READERS`], or 1 to 8 from the environment variable
/// `SPIKECUBE_READERS` (for measuring).
pub fn device_readers() -> usize {
    std::env::var("SPIKECUBE_READERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| (1..=8).contains(n))
        .unwrap_or(DEVICE_READERS)
}

/// Busy seconds per stage, by name (`read`, `checks`, `preprocess`, `detect`,
/// `write`; a GPU pass adds its own, e.g. `upload`, `download`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageTimes(pub BTreeMap<String, f64>);

impl StageTimes {
    /// Adds `seconds` to `stage`.
    pub fn add(&mut self, stage: &str, seconds: f64) {
        *self.0.entry(stage.to_string()).or_insert(0.0) += seconds;
    }

    /// Adds the seconds elapsed since `since` to `stage` and returns now.
    pub fn lap(&mut self, stage: &str, since: Instant) -> Instant {
        let now = Instant::now();
        self.add(stage, (now - since).as_secs_f64());
        now
    }

    /// Adds every stage of `other`.
    pub fn merge(&mut self, other: &StageTimes) {
        for (k, v) in &other.0 {
            self.add(k, *v);
        }
    }

    /// Seconds of `stage` (0 when absent).
    pub fn get(&self, stage: &str) -> f64 {
        self.0.get(stage).copied().unwrap_or(0.0)
    }

    /// Sum of all stages' busy seconds. Parts of a stage, named
    /// `stage.part` (e.g. `preprocess.car`, `detect.steps_1_3`), are already
    /// in their stage's seconds and are not added again.
    pub fn busy(&self) -> f64 {
        self.0
            .iter()
            .filter(|(k, _)| !k.contains('.'))
            .map(|(_, v)| v)
            .sum()
    }
}

/// A whitening that changes from window to window: drift correction's
/// `G_b = M_b·W` (the drift module's `DriftRun`). A [`WindowPass`] takes one
/// through [`WindowPass::set_drift`] and asks it for each window's matrix;
/// it knows nothing else of drift.
pub trait WindowWhitening: Send + Sync {
    /// Whether any window's whitening differs from W (false: the pass keeps W).
    fn corrects(&self) -> bool;

    /// The whitening of window `index` in place of `w`; `None`: `w` itself.
    ///
    /// # Errors
    /// When the window is unknown or `w` does not fit.
    fn window_whitening(
        &self,
        index: u64,
        w: &crate::preprocess::Whitening,
    ) -> Result<Option<Arc<crate::preprocess::Whitening>>>;

    /// Preprocesses raw window `index` in place on the host: `pre`'s steps
    /// with the window's whitening.
    ///
    /// # Errors
    /// As [`WindowWhitening::window_whitening`] and `pre`'s steps.
    fn preprocess(&self, pre: &Preprocessor, index: u64, x: &mut Array2<f32>) -> Result<()>;

    /// The rest of [`WindowWhitening::preprocess`] on window `index` as
    /// `pre`'s high-pass and artifact check left it
    /// ([`Preprocessor::filter_timed`], e.g. kept from a pass before;
    /// `artifact`: whether the check zeroed it): its whitening, in place. The
    /// two give the same bits as `preprocess` on the raw window.
    ///
    /// # Errors
    /// As [`WindowWhitening::preprocess`].
    fn whiten_filtered(
        &self,
        pre: &Preprocessor,
        index: u64,
        x: &mut Array2<f32>,
        artifact: bool,
    ) -> Result<()>;
}

/// A window's place in the recording (a [`Window`] without its samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowInfo {
    /// Window index, `0 .. n_windows`.
    pub index: u64,
    /// Absolute sample index of column `nt` (the first own sample).
    pub own_start: u64,
    /// Own samples of the window.
    pub own_len: u64,
    /// Absolute sample index of column 0 (may be negative for window 0).
    pub first_sample: i64,
}

impl WindowInfo {
    fn of(w: &Window) -> Self {
        WindowInfo {
            index: w.index,
            own_start: w.own_start,
            own_len: w.own_len,
            first_sample: w.first_sample,
        }
    }
}

/// Preprocessing and detection of one window: the stage between reading and
/// writing, and the one a GPU pass replaces as a whole.
pub trait WindowPass: Send {
    /// Turns one raw window into its detections.
    ///
    /// `window.data`: C sites × N samples (`batch_size + 2·nt`), f32 raw
    /// values, rows in channel-map order, stuck stretches already masked when
    /// the run masks them; the pass may overwrite it (its buffer is reused for
    /// a later window afterwards). Returns every detection of the window, with
    /// window-relative samples (the caller keeps the own samples'), and adds
    /// the pass's busy seconds to `times` under its stage names.
    ///
    /// # Errors
    /// When preprocessing or detection fails; the run stops.
    fn run(&mut self, window: &mut Window, times: &mut StageTimes) -> Result<Detections>;

    /// Bytes sent to a device so far (0 for a pass on the host).
    fn bytes_uploaded(&self) -> u64 {
        0
    }

    /// Windows sent to a device so far, over every pass of the run (0 for a
    /// pass on the host).
    fn windows_uploaded(&self) -> u64 {
        0
    }

    /// Corrects drift in every later window: `Some` after the drift
    /// step estimated a correction, `None` for none (the first pass).
    ///
    /// # Errors
    /// When the pass cannot take the correction (the default: it corrects nothing).
    fn set_drift(&mut self, drift: Option<Arc<dyn WindowWhitening>>) -> Result<()> {
        match drift {
            Some(d) if d.corrects() => Err(anyhow!("this pass cannot correct drift")),
            _ => Ok(()),
        }
    }

    /// Whether detection computes the PC features `tF` from the next window
    /// on (the drift step's first pass needs only times, depths and
    /// amplitudes); a pass that always computes them ignores it (the default).
    fn set_pc_features(&mut self, on: bool) {
        let _ = on;
    }

    /// Where preprocessing runs: `host` or `device`.
    fn preprocess_on(&self) -> &'static str {
        "host"
    }

    /// The device high-pass in use (`iir-f64`, `iir-f32`, `direct`), when the
    /// pass preprocesses on a device; `None` by default.
    fn device_highpass(&self) -> Option<&'static str> {
        None
    }

    /// Detects with other universal templates (same shapes) from the next
    /// window on, keeping the detector's buffers (templates learned again for
    /// the drift-corrected pass).
    ///
    /// # Errors
    /// When the templates do not fit (the default: the pass has no detector).
    fn set_templates(&mut self, templates: &crate::detect::UniversalTemplates) -> Result<()> {
        let _ = templates;
        Err(anyhow!("this pass has no detector"))
    }

    /// Per-window medians of finer steps, seconds, measured on some windows
    /// (a device pass: upload, preprocess, each detection step, download), for
    /// `spikecube.json`; empty by default.
    fn step_medians(&self) -> Vec<(String, f64)> {
        Vec::new()
    }

    /// Storage for windows read as the file's int16 values
    /// ([`crate::recording::read_window_i16`], rows of
    /// [`crate::recording::Raw16::stride_for`]), when this pass takes them (a GPU
    /// pass: it uploads them as they are); `None` (the default)
    /// for f32 windows. Recordings that cannot give int16 values get f32
    /// windows anyway, so the pass must take both.
    fn raw16_buffers(&self) -> Option<Raw16Alloc> {
        None
    }

    /// Host work of this pass that can run one window ahead of it on its own
    /// thread (`spikecube-stage`; e.g. packing a window for the upload while
    /// the device works on the previous one); `None` (the default) for none.
    fn stager(&mut self) -> Option<Box<dyn Stager>> {
        None
    }

    /// For the template learning (Kilosort4's `extract_wPCA_wTEMP` on the
    /// drift-corrected windows): window `w` as read, preprocessed on this
    /// pass's device as the pass preprocesses it (with `drift`'s whitening of
    /// the window when given), and its clips as `cut` cuts them (n × nt),
    /// on the calling thread; the pass's own whitening is set again
    /// afterwards. `None` (the default) when the pass preprocesses on the
    /// host.
    fn learning_window(
        &mut self,
        w: &mut Window,
        drift: Option<&dyn WindowWhitening>,
        cut: &crate::detect::learn::ClipCut,
    ) -> Option<Result<Array2<f32>>> {
        let _ = (w, drift, cut);
        None
    }

    /// Frees what [`WindowPass::learning_window`] kept between windows (a
    /// device pass's host copy of a whitened window); nothing by default.
    fn end_learning(&mut self) {}

    /// [`WindowPass::run`] with what this pass's [`Stager`] made of the window.
    ///
    /// # Errors
    /// As [`WindowPass::run`].
    fn run_staged(
        &mut self,
        window: &mut Window,
        staged: Staged,
        times: &mut StageTimes,
    ) -> Result<Detections> {
        let _ = staged;
        self.run(window, times)
    }

    /// Takes the next window (with what the [`Stager`] made of it, if any) and
    /// returns the windows whose detections are done, in window order: the
    /// window itself (the default, [`WindowPass::run_staged`]), or earlier
    /// ones when the pass keeps windows queued on a device (the
    /// device starts on window k + 1 before the host takes window k's
    /// detections). [`WindowPass::drain`] returns the rest.
    ///
    /// # Errors
    /// As [`WindowPass::run`], for this window or a queued one.
    fn push(
        &mut self,
        mut window: Window,
        staged: Option<Staged>,
        times: &mut StageTimes,
    ) -> Result<Vec<(Window, Detections)>> {
        let det = match staged {
            Some(st) => self.run_staged(&mut window, st, times)?,
            None => self.run(&mut window, times)?,
        };
        Ok(vec![(window, det)])
    }

    /// The windows still queued by [`WindowPass::push`], done, in order (none
    /// by default). Also called when the run stops early, so that a queued
    /// window releases what it holds.
    ///
    /// # Errors
    /// As [`WindowPass::run`].
    fn drain(&mut self, times: &mut StageTimes) -> Result<Vec<(Window, Detections)>> {
        let _ = times;
        Ok(Vec::new())
    }

    /// Keeps each later window's preprocessed samples where the pass made
    /// them (a device pass on its GPU, a host pass in host memory), from
    /// window 0 on, while `budget` bytes hold them ([`KeepWindows::budget`]);
    /// a pass that cannot keeps nothing (the default).
    fn keep_windows(&mut self, budget: Option<u64>) {
        let _ = budget;
    }

    /// The windows kept since [`WindowPass::keep_windows`] (which stops
    /// keeping); `None` when none were.
    fn take_kept(&mut self) -> Option<KeptWindows> {
        None
    }

    /// Keeps each window of the next pass after its high-pass and before its
    /// whitening where the pass made it, from window 0 on while `budget`
    /// bytes hold them (as [`WindowPass::keep_windows`]'s budget), so that
    /// the pass after it (Kilosort4's drift-corrected pass: the same raw
    /// windows, another whitening) whitens those again instead of reading,
    /// sending and filtering them ([`WindowPass::windows_held`]); a later
    /// [`WindowPass::keep_windows`] then keeps each such window whitened,
    /// within the same budget. The
    /// detections are the same bytes either way. Returns whether the pass
    /// keeps such windows: a pass that cannot keeps nothing (the default).
    fn keep_filtered(&mut self, budget: Option<u64>) -> bool {
        let _ = budget;
        false
    }

    /// The warnings the pass raised since last asked (a keeping budget cut
    /// to the memory left), for the run's warnings.
    fn take_warnings(&mut self) -> Vec<String> {
        Vec::new()
    }

    /// Windows `0 .. k` of this run whose samples the pass holds already
    /// (kept after their high-pass in the pass before,
    /// [`WindowPass::keep_filtered`]): they need not be read again, once
    /// their input checks are known ([`run_windows_prechecked`]'s
    /// `checked_below`). None by default.
    fn windows_held(&self) -> u64 {
        0
    }
}

/// The final pass's whitened windows, kept where the pass preprocessed them
/// (on its GPU, or in host memory) for a later stage (the sort's
/// learned-template matching, which would otherwise read and preprocess every
/// window again): windows `0 .. len()` of the pass, each `n_sites × n_t` f32
/// row-major, drift-corrected as the pass detected on them.
pub struct KeptWindows {
    /// Where they are: `cuda` or `wgpu` (device buffers, `handles`), or `cpu`
    /// (host arrays, `host`).
    pub backend: &'static str,
    /// Rows of each window (sites, channel-map order).
    pub n_sites: usize,
    /// Samples of each window, padding included (`batch_size + 2·nt`).
    pub n_t: usize,
    /// Device buffers, one per window, in window order from window 0.
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    pub handles: Vec<cubecl::server::Handle>,
    /// Host arrays (`n_sites × n_t`), one per window, in window order from
    /// window 0.
    pub host: Vec<Array2<f32>>,
}

impl KeptWindows {
    /// Windows kept.
    pub fn len(&self) -> usize {
        #[cfg(any(feature = "cuda", feature = "wgpu"))]
        let on_device = self.handles.len();
        #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
        let on_device = 0;
        on_device + self.host.len()
    }

    /// Whether no window was kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for KeptWindows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "KeptWindows({} × {} × {} on {})",
            self.len(),
            self.n_sites,
            self.n_t,
            self.backend
        )
    }
}

/// A request to a run's final pass to keep its whitened windows where it
/// preprocessed them ([`KeptWindows`]), from window 0 on while they fit in
/// the budget; the run leaves them in `slot`.
#[derive(Debug, Clone, Default)]
pub struct KeepWindows {
    /// Most bytes the kept windows may take; `None`: for a pass on a GPU,
    /// half of the device's free memory when the pass starts on CUDA, nothing
    /// on wgpu (which cannot say how much memory its device has); nothing for
    /// a pass on the host.
    pub budget: Option<u64>,
    /// Where the run leaves the kept windows.
    pub slot: Arc<std::sync::Mutex<Option<KeptWindows>>>,
}

/// The host memory, bytes, that a pass keeps preprocessed windows in when
/// `--keep-windows-gb` is not given: a third of what this process may still
/// take ([`host_free_memory`]). A third, not half: the kept windows are held
/// through the first clustering, which on a long recording needs about as
/// much again (13.8 GB for 20 million spikes). 0 when the system reports
/// nothing.
pub fn default_host_keep_budget() -> u64 {
    host_free_memory().map_or(0, |free| free / 3)
}

/// The host memory, bytes, this process may still take: the smaller of the
/// system's available memory and, under a cgroup memory limit (a Slurm job's
/// `--mem`, a container's limit), the free memory of this process's cgroup;
/// `None` when the system reports neither.
pub fn host_free_memory() -> Option<u64> {
    use sysinfo::{MemoryRefreshKind, Pid, ProcessRefreshKind, ProcessesToUpdate, System};
    let mut sys = System::new().ok()?;
    sys.refresh_memory_specifics(MemoryRefreshKind::nothing().with_ram());
    let mut free = sys.available_memory();
    let pid = Pid::from_u32(std::process::id());
    sys.refresh_processes_specifics(
        ProcessesToUpdate::Some(&[pid]),
        false,
        ProcessRefreshKind::nothing(),
    );
    if let Some(limits) = sys.process(pid).and_then(|p| p.cgroup_limits()) {
        free = free.min(limits.free_memory);
    }
    (free > 0).then_some(free)
}

/// Share of the memory left (host or GPU) that a budget given with
/// `--keep-windows-gb` may take ([`capped_budget`]).
pub const GIVEN_BUDGET_SHARE: f64 = 0.8;

/// `--keep-windows-gb`'s `given` bytes, or [`GIVEN_BUDGET_SHARE`] of `free`
/// (the memory left where the windows are kept: `place`, `host` or `GPU`)
/// when that is less, with a warning saying so: windows past the budget are
/// read again, so the sort is the same, while a budget past the memory
/// would end the run (the host's out-of-memory killer, or a failed GPU
/// allocation). `free` unknown: `given`.
pub fn capped_budget(given: u64, free: Option<u64>, place: &str) -> (u64, Option<String>) {
    let Some(free) = free else {
        return (given, None);
    };
    let cap = (free as f64 * GIVEN_BUDGET_SHARE) as u64;
    if given <= cap {
        return (given, None);
    }
    let w = format!(
        "--keep-windows-gb {:.1} is more than {:.0} % of the {place} memory left ({:.1} GB): windows are kept within {:.1} GB, the others read again (the sort is the same)",
        given as f64 / 1e9,
        GIVEN_BUDGET_SHARE * 100.0,
        free as f64 / 1e9,
        cap as f64 / 1e9
    );
    (cap, Some(w))
}

/// The windows a pass keeps ([`WindowPass::keep_windows`]): windows 0 .. k,
/// in order, while they fit in the budget.
#[derive(Debug)]
pub struct Keeping<T> {
    /// Most bytes the kept windows may take.
    budget: u64,
    kept: Vec<T>,
    /// Set when a window was not kept (past the budget, or out of order):
    /// no later one is.
    stopped: bool,
}

impl<T> Keeping<T> {
    fn new(budget: u64) -> Self {
        Keeping {
            budget,
            kept: Vec::new(),
            stopped: false,
        }
    }

    /// Says (info) that no `what` was kept when a window of `window` bytes
    /// is more than a budget that is not 0 (`--keep-windows-gb` too small).
    fn say_if_none_fit(&self, window: u64, what: &str) {
        if self.kept.is_empty() && self.budget > 0 && self.budget < window {
            tracing::info!(
                "no {what}: one takes {:.3} GB, more than the budget of {:.3} GB (--keep-windows-gb); the matching reads them again",
                window as f64 / 1e9,
                self.budget as f64 / 1e9
            );
        }
    }

    /// Whether window `index`, of `bytes` bytes, is the next one to keep and
    /// fits in the budget; once one is not, keeping stops.
    fn admits(&mut self, index: u64, bytes: u64) -> bool {
        let fits = (self.kept.len() as u64 + 1) * bytes <= self.budget;
        if self.stopped || index != self.kept.len() as u64 || !fits {
            self.stopped = true;
        }
        !self.stopped
    }
}

/// What a [`HostPass`] keeps: its preprocessed windows.
pub type HostKeeping = Keeping<Array2<f32>>;

impl HostKeeping {
    /// Keeps preprocessed window `index` (its buffer `x`, left empty) when it
    /// is the next one to keep and fits in the budget; with
    /// `SPIKECUBE_HOST_KEEP=copy`, a copy of it (made in parallel, row by
    /// row; `x` stays), for measuring.
    fn keep(&mut self, index: u64, x: &mut Array2<f32>) {
        if !self.admits(index, (x.len() * 4) as u64) || !x.is_standard_layout() {
            self.stopped = true;
            return;
        }
        if std::env::var("SPIKECUBE_HOST_KEEP").as_deref() != Ok("copy") {
            self.kept.push(std::mem::replace(x, Array2::zeros((0, 0))));
            return;
        }
        self.kept.push(parallel_copy(x));
    }
}

/// A copy of window `x` (standard layout), made in parallel row by row on
/// the thread pool, each value written once.
fn parallel_copy(x: &Array2<f32>) -> Array2<f32> {
    use rayon::prelude::*;
    let src = x.as_slice().expect("standard layout");
    let mut v: Vec<f32> = Vec::with_capacity(src.len());
    let n = x.ncols().max(1);
    v.spare_capacity_mut()
        .par_chunks_mut(n)
        .zip(src.par_chunks(n))
        .for_each(|(d, s)| {
            for (d, &s) in d.iter_mut().zip(s) {
                d.write(s);
            }
        });
    // SAFETY: every one of the src.len() values was written just above.
    unsafe { v.set_len(src.len()) };
    Array2::from_shape_vec(x.dim(), v).expect("the window's shape")
}

/// A window a [`HostPass`] kept after its high-pass in the pass before
/// ([`WindowPass::keep_filtered`]), to be whitened again in the next pass
/// instead of read and filtered again.
#[derive(Debug)]
struct HeldWindow {
    /// Its samples after channel means, median CAR, high-pass and the
    /// artifact check, before whitening (`n_sites × n_t`).
    data: Array2<f32>,
    /// The stimulus artifacts' stretches found in its raw values (columns),
    /// zeroed after its whitening.
    blank: Vec<(usize, usize)>,
    /// Whether the artifact check zeroed it.
    artifact: bool,
}

/// The high-passed windows of a [`HostPass`]: those it keeps during a pass
/// ([`WindowPass::keep_filtered`]) and those it holds from the pass before
/// ([`WindowPass::windows_held`]), shared with its stager.
#[derive(Debug, Clone, Default)]
struct HostFiltered {
    /// Windows being kept in this pass, in order from window 0.
    keeping: Option<Arc<std::sync::Mutex<Keeping<HeldWindow>>>>,
    /// Windows `0 .. len` held from the pass before, each taken once.
    held: Arc<Vec<std::sync::Mutex<Option<HeldWindow>>>>,
}

impl HostFiltered {
    /// Window `index` when it is held (taken, so `None` afterwards).
    ///
    /// # Errors
    /// When it is held but was taken already.
    fn take_held(&self, index: u64) -> Result<Option<HeldWindow>> {
        let Some(slot) = self.held.get(index as usize) else {
            return Ok(None);
        };
        let taken = slot.lock().ok().and_then(|mut h| h.take());
        match taken {
            Some(h) => Ok(Some(h)),
            None => Err(anyhow!(
                "window {index}, kept after its high-pass, was whitened once already"
            )),
        }
    }

    /// Whether high-passed window `x` (number `index`) is to be kept: when
    /// keeping, it is the next one and it fits in the budget. The caller then
    /// [`HostFiltered::push`]es it before the next window is asked about.
    fn admits(&self, index: u64, x: &Array2<f32>) -> bool {
        let Some(k) = &self.keeping else {
            return false;
        };
        let Ok(mut k) = k.lock() else {
            return false;
        };
        if !x.is_standard_layout() {
            k.stopped = true;
            return false;
        }
        k.admits(index, (x.len() * 4) as u64)
    }

    /// Keeps the window [`HostFiltered::admits`] just admitted.
    fn push(&self, held: HeldWindow) {
        if let Some(k) = &self.keeping
            && let Ok(mut k) = k.lock()
        {
            k.kept.push(held);
        }
    }
}

/// Makes storage for an int16 window of the given number of values
/// ([`WindowPass::raw16_buffers`]).
pub type Raw16Alloc = Box<dyn FnMut(usize) -> Box<dyn crate::recording::Raw16Buffer> + Send>;

/// What a [`Stager`] made of a window, for [`WindowPass::run_staged`].
pub type Staged = Box<dyn std::any::Any + Send>;

/// The part of a [`WindowPass`] that runs one window ahead of it, on its own
/// thread, in window order ([`WindowPass::stager`]).
pub trait Stager: Send {
    /// Prepares `window` for the pass, adding its busy seconds to `times`.
    ///
    /// # Errors
    /// When the preparation fails; the run stops.
    fn stage(&mut self, window: &mut Window, times: &mut StageTimes) -> Result<Staged>;
}

/// The window pass for `detector`: preprocessing on the device
/// ([`DevicePass`]) when `on_device` and the back end can preprocess as `pre`
/// does, on the host ([`HostPass`]) otherwise. GPU back ends that preprocess
/// take each raw window as it was read (int16 values two per word;
/// page-locked with CUDA).
///
/// # Errors
/// When the device cannot take the preprocessing constants.
pub fn window_pass(
    detector: Detector,
    pre: &Preprocessor,
    yc: Vec<f32>,
    on_device: bool,
) -> Result<Box<dyn WindowPass>> {
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    let detector = if on_device {
        match DevicePass::new(detector, pre, yc.clone())? {
            Ok(p) => return Ok(Box::new(p)),
            Err(d) => d,
        }
    } else {
        detector
    };
    #[cfg(not(any(feature = "cuda", feature = "wgpu")))]
    let _ = on_device;
    Ok(Box::new(HostPass::new(pre.clone(), detector, yc)))
}

/// Preprocessing on the CPU ([`Preprocessor`]), then detection on any back
/// end ([`Detector`]); stage names `preprocess` and `detect`. In
/// [`run_windows`] the preprocessing runs one window ahead of the detection,
/// on the staging thread ([`WindowPass::stager`]).
pub struct HostPass {
    /// Channel means, median CAR, high-pass, whitening.
    pub pre: Preprocessor,
    /// Detection on the chosen back end.
    pub detector: Detector,
    /// Site depths, µm (the probe's `yc`).
    pub yc: Vec<f32>,
    /// Drift correction, when on: each high-passed window is
    /// multiplied by `G_b = M_b·W` instead of W ([`WindowWhitening::preprocess`]).
    pub drift: Option<Arc<dyn WindowWhitening>>,
    /// The preprocessed windows kept so far ([`WindowPass::keep_windows`]);
    /// `None` when not keeping.
    pub keep: Option<HostKeeping>,
    /// The high-passed windows kept in this pass or held from the pass
    /// before ([`WindowPass::keep_filtered`]).
    filtered: HostFiltered,
    /// Warnings not yet taken ([`WindowPass::take_warnings`]).
    warnings: Vec<String>,
}

/// The preprocessing half of a [`HostPass`], run one window ahead of its
/// detection on the staging thread ([`WindowPass::stager`]): window k + 1 is
/// preprocessed while window k is detected in, both on the shared thread
/// pool, so that one step's serial parts and joins leave no core idle. Each
/// window is preprocessed exactly as [`HostPass::run`] does it.
struct HostStager {
    pre: Preprocessor,
    drift: Option<Arc<dyn WindowWhitening>>,
    filtered: HostFiltered,
}

/// What [`HostStager`] made of a window: the window itself is preprocessed in place.
struct HostStaged;

/// Preprocesses one window in place as [`HostPass`] does: `pre`'s steps,
/// with the window's drift-corrected whitening when `drift` is on, then
/// `pre`'s blanking of stimulus artifacts; stage name `preprocess` (and its
/// parts). A window `filtered` holds from the pass before (kept after its
/// high-pass) is only whitened and blanked; one `filtered` keeps is kept
/// after its high-pass, before its whitening. The same bits either way.
fn host_preprocess(
    pre: &Preprocessor,
    drift: Option<&dyn WindowWhitening>,
    filtered: &HostFiltered,
    w: &mut Window,
    times: &mut StageTimes,
) -> Result<()> {
    let t0 = Instant::now();
    let mut lap = |part: &str, s: f64| times.add(&format!("preprocess.{part}"), s);
    let (blank, res) = match filtered.take_held(w.index)? {
        Some(HeldWindow {
            data,
            blank,
            artifact,
        }) => {
            // Its high-pass ran in the pass before, and so did its count.
            w.data = data;
            if artifact {
                pre.count_artifact_window();
            }
            let res = match drift {
                Some(d) => d.whiten_filtered(pre, w.index, &mut w.data, artifact),
                None if artifact => Ok(()),
                None => pre
                    .whiten_timed(&mut w.data, &mut lap)
                    .map_err(anyhow::Error::from),
            };
            (blank, res)
        }
        None => {
            // Stimulus artifacts' stretches, found in the raw values, zeroed
            // at the end.
            let blank = pre.blank_ranges(&w.data, w.first_sample);
            // With drift correction, G_b = M_b·W in place of W.
            let res = match drift {
                Some(d) => d.preprocess(pre, w.index, &mut w.data),
                None => (|| {
                    let artifact = pre.filter_timed(&mut w.data, &mut lap)?;
                    if filtered.admits(w.index, &w.data) {
                        // Kept as it is: the whitening goes into a new
                        // array (the same bits), so nothing is copied.
                        let out = if artifact {
                            Array2::zeros(w.data.dim())
                        } else {
                            pre.whiten_to_new_timed(&w.data, &mut lap)?
                        };
                        let t = Instant::now();
                        let data = std::mem::replace(&mut w.data, out);
                        filtered.push(HeldWindow {
                            data,
                            blank: blank.clone(),
                            artifact,
                        });
                        lap("keep_filtered", t.elapsed().as_secs_f64());
                    } else if !artifact {
                        pre.whiten_timed(&mut w.data, &mut lap)?;
                    }
                    Ok::<(), crate::error::PreprocessError>(())
                })()
                .map_err(anyhow::Error::from),
            };
            (blank, res)
        }
    };
    res.with_context(|| {
        format!(
            "preprocessing window {} (samples from {})",
            w.index, w.own_start
        )
    })?;
    crate::preprocess::zero_columns(&mut w.data, &blank);
    times.lap("preprocess", t0);
    Ok(())
}

impl Stager for HostStager {
    fn stage(&mut self, w: &mut Window, times: &mut StageTimes) -> Result<Staged> {
        host_preprocess(&self.pre, self.drift.as_deref(), &self.filtered, w, times)?;
        Ok(Box::new(HostStaged))
    }
}

impl HostPass {
    /// The bytes to keep windows in: `given` (`--keep-windows-gb`) cut to
    /// the host memory left ([`capped_budget`], its warning kept for
    /// [`WindowPass::take_warnings`]), else [`default_host_keep_budget`].
    fn keep_budget(&mut self, given: Option<u64>) -> u64 {
        match given {
            Some(b) => {
                let (b, w) = capped_budget(b, host_free_memory(), "host");
                self.warnings.extend(w);
                b
            }
            None => default_host_keep_budget(),
        }
    }

    /// A pass preprocessing with `pre` and detecting with `detector` on a
    /// probe whose sites are at depths `yc` (µm), keeping nothing and
    /// without drift correction until told.
    pub fn new(pre: Preprocessor, detector: Detector, yc: Vec<f32>) -> Self {
        HostPass {
            pre,
            detector,
            yc,
            drift: None,
            keep: None,
            filtered: HostFiltered::default(),
            warnings: Vec::new(),
        }
    }

    fn stager_now(&self) -> HostStager {
        HostStager {
            pre: self.pre.clone(),
            drift: self.drift.clone(),
            filtered: self.filtered.clone(),
        }
    }

    /// Detection in a preprocessed window; a window kept
    /// ([`WindowPass::keep_windows`]) leaves with its buffer, and the reader
    /// makes a new one for a later window.
    fn detect(&mut self, w: &mut Window, times: &mut StageTimes) -> Result<Detections> {
        let t1 = Instant::now();
        let det = self
            .detector
            .detect(w.data.view(), &self.yc)
            .with_context(|| {
                format!(
                    "detecting in window {} (samples from {})",
                    w.index, w.own_start
                )
            })?;
        times.lap("detect", t1);
        for (part, s) in self.detector.take_step_seconds() {
            times.add(&format!("detect.{part}"), s);
        }
        if let Some(k) = self.keep.as_mut() {
            let t2 = Instant::now();
            k.keep(w.index, &mut w.data);
            times.lap("keep", t2);
        }
        Ok(det)
    }
}

impl WindowPass for HostPass {
    fn run(&mut self, w: &mut Window, times: &mut StageTimes) -> Result<Detections> {
        host_preprocess(&self.pre, self.drift.as_deref(), &self.filtered, w, times)?;
        self.detect(w, times)
    }

    fn stager(&mut self) -> Option<Box<dyn Stager>> {
        Some(Box::new(self.stager_now()))
    }

    fn run_staged(
        &mut self,
        w: &mut Window,
        staged: Staged,
        times: &mut StageTimes,
    ) -> Result<Detections> {
        match staged.downcast::<HostStaged>() {
            Ok(_) => self.detect(w, times),
            Err(_) => self.run(w, times),
        }
    }

    fn set_drift(&mut self, drift: Option<Arc<dyn WindowWhitening>>) -> Result<()> {
        self.drift = drift.filter(|d| d.corrects());
        Ok(())
    }

    fn set_templates(&mut self, templates: &crate::detect::UniversalTemplates) -> Result<()> {
        Ok(self.detector.set_templates(templates)?)
    }

    fn set_pc_features(&mut self, on: bool) {
        // The drift step's first pass goes without (it needs only times,
        // depths and amplitudes).
        self.detector.set_pc_features(on);
    }

    fn keep_windows(&mut self, budget: Option<u64>) {
        let held = self
            .filtered
            .keeping
            .take()
            .and_then(|k| k.lock().ok().map(|mut k| std::mem::take(&mut k.kept)))
            .unwrap_or_default();
        if let Some(first) = held.first() {
            // Each window kept after its high-pass is whitened again and kept
            // whitened in the same buffer; no other window is kept (the
            // budget was spent on those).
            let bytes = (held.len() * first.data.len() * 4) as u64;
            tracing::debug!(
                "{} windows start from their high-passed samples kept in host memory; keeping them whitened ({bytes} bytes)",
                held.len()
            );
            self.filtered.held = Arc::new(
                held.into_iter()
                    .map(|h| std::sync::Mutex::new(Some(h)))
                    .collect(),
            );
            self.keep = Some(Keeping::new(bytes));
            return;
        }
        // By default a third of the memory the process may still take: the
        // matching then neither reads nor preprocesses those windows again
        // (the same bytes; BENCHMARKS.md measures the time it saves).
        let budget = self.keep_budget(budget);
        tracing::debug!("keeping preprocessed windows in host memory within {budget} bytes");
        self.keep = Some(Keeping::new(budget));
    }

    fn windows_held(&self) -> u64 {
        self.filtered.held.len() as u64
    }

    fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    fn keep_filtered(&mut self, budget: Option<u64>) -> bool {
        // The same default as the whitened windows': they take the place of
        // these in the pass after.
        let budget = self.keep_budget(budget);
        if budget == 0 {
            return false;
        }
        tracing::debug!("keeping high-passed windows in host memory within {budget} bytes");
        self.filtered.keeping = Some(Arc::new(std::sync::Mutex::new(Keeping::new(budget))));
        true
    }

    fn take_kept(&mut self) -> Option<KeptWindows> {
        self.filtered = HostFiltered::default();
        let k = self.keep.take()?;
        let Some(first) = k.kept.first() else {
            let (c, n) = self.pre.window_shape();
            k.say_if_none_fit(
                (c * n * 4) as u64,
                "preprocessed window kept in host memory",
            );
            return None;
        };
        let (n_sites, n_t) = first.dim();
        tracing::info!(
            "{} preprocessed windows kept in host memory ({:.1} GB)",
            k.kept.len(),
            (k.kept.len() * first.len() * 4) as f64 / 1e9
        );
        Some(KeptWindows {
            backend: "cpu",
            n_sites,
            n_t,
            #[cfg(any(feature = "cuda", feature = "wgpu"))]
            handles: Vec::new(),
            host: k.kept,
        })
    }
}

/// Preprocessing and detection on a GPU: the raw window is packed
/// (int16 values two per word when they are integers; page-locked memory with
/// CUDA), sent up as it was read, preprocessed there
/// ([`crate::detect::gpu::preprocess`]) and detected in; one download of the
/// detections. Stage names `pack` and `device` (upload, preprocessing,
/// detection and download).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub struct DevicePass {
    detector: Detector,
    packer: crate::detect::gpu::Packer,
    pre: Preprocessor,
    yc: Vec<f32>,
    upload_bytes: u64,
    upload_windows: u64,
    drift: Option<Arc<dyn WindowWhitening>>,
    timed_windows: Vec<crate::detect::gpu::StepTimes>,
    /// Device seconds (host wall) of window 0 and of each later window not
    /// timed step by step.
    first_window_s: f64,
    window_s: Vec<f64>,
    /// Windows queued on the device ([`WindowPass::push`]), oldest first.
    queued: std::collections::VecDeque<Window>,
    /// The whitened windows kept so far ([`WindowPass::keep_windows`]).
    keep: Option<Keeping<cubecl::server::Handle>>,
    /// Whether windows sent ahead are queued on the device (true unless the
    /// environment variable `SPIKECUBE_DEVICE_QUEUE` is `0`, for measuring).
    queue_windows: bool,
    /// The high-passed windows being kept ([`WindowPass::keep_filtered`]).
    filtered: Option<Keeping<cubecl::server::Handle>>,
    /// The high-passed windows 0 .. k this pass starts from instead of
    /// sending and filtering them ([`DevicePass::keep_windows`] takes them from `filtered`);
    /// each is handed to the detector when its window is queued, which
    /// hands back the window whitened, to keep.
    from_filtered: Vec<Option<cubecl::server::Handle>>,
    /// Warnings not yet taken ([`WindowPass::take_warnings`]).
    warnings: Vec<String>,
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl DevicePass {
    /// A pass preprocessing as `pre` does, on `detector`'s device; `None` when
    /// the detector is on the CPU or a step of `pre` has no device version
    /// (the detector is handed back then).
    ///
    /// # Errors
    /// When the device cannot take the preprocessing constants.
    pub fn new(
        mut detector: Detector,
        pre: &Preprocessor,
        yc: Vec<f32>,
    ) -> Result<std::result::Result<Self, Detector>> {
        if !detector.set_preprocessing(pre)? {
            return Ok(Err(detector));
        }
        let Some(mut packer) = detector.packer() else {
            return Ok(Err(detector));
        };
        // Two upload buffers for int16 windows (the usual case), so that a
        // window's copy overlaps the device's work on the one before.
        let (c, n) = pre.window_shape();
        let bytes = c * crate::recording::Raw16::stride_for(n) * 2;
        detector.give_upload_slots(&mut packer, bytes);
        Ok(Ok(DevicePass {
            detector,
            packer,
            pre: pre.clone(),
            yc,
            upload_bytes: 0,
            upload_windows: 0,
            drift: None,
            timed_windows: Vec::new(),
            first_window_s: 0.0,
            window_s: Vec::new(),
            queued: Default::default(),
            keep: None,
            queue_windows: std::env::var("SPIKECUBE_DEVICE_QUEUE").as_deref() != Ok("0"),
            filtered: None,
            from_filtered: Vec::new(),
            warnings: Vec::new(),
        }))
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl DevicePass {
    /// Keeps window `index`'s whitened samples, just launched on the device,
    /// when it is the next window to keep and fits in the budget: `whitened`
    /// when they are in a buffer of their own already (a window whitened from
    /// its high-passed copy), else the buffer the detector hands out
    /// ([`Detector::keep_window`]).
    fn keep_one(&mut self, index: u64, whitened: Option<cubecl::server::Handle>) {
        let Some(k) = self.keep.as_mut() else {
            return;
        };
        let (c, n) = self.pre.window_shape();
        if !k.admits(index, (c * n * 4) as u64) {
            return;
        }
        match whitened.or_else(|| self.detector.keep_window()) {
            Some(h) => k.kept.push(h),
            None => k.stopped = true,
        }
    }

    /// Before window `index` is launched: asks the detector for its
    /// high-passed samples (in a buffer of their own) when it is the next one
    /// to keep and fits in the budget ([`WindowPass::keep_filtered`]).
    fn mark_filtered(&mut self, index: u64) {
        let Some(k) = self.filtered.as_mut() else {
            return;
        };
        let (c, n) = self.pre.window_shape();
        if k.admits(index, (c * n * 4) as u64) {
            self.detector.copy_filtered_next();
        }
    }

    /// After window `index` was launched: keeps the high-passed buffer
    /// [`DevicePass::mark_filtered`] asked for.
    fn take_filtered(&mut self, index: u64) {
        let copy = self.detector.take_filtered_copy();
        if let Some(k) = self.filtered.as_mut()
            && !k.stopped
            && index == k.kept.len() as u64
        {
            match copy {
                Some(h) => k.kept.push(h),
                None => k.stopped = true,
            }
        }
    }
}

/// The host side of a [`DevicePass`]: the window's drift-corrected whitening
/// (CSR) and its packed raw values, made one window ahead of the device.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
struct DeviceStager {
    packer: crate::detect::gpu::Packer,
    whitening: crate::preprocess::Whitening,
    drift: Option<Arc<dyn WindowWhitening>>,
    /// Windows below this index start from their high-passed samples on the
    /// device ([`DevicePass::from_filtered`]): nothing is sent.
    filtered_below: u64,
}

/// What [`DeviceStager`] makes of a window.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
struct DeviceStaged {
    /// The raw window; `None` for a window whitened from its high-passed
    /// samples already on the device.
    raw: Option<crate::detect::gpu::RawWindow>,
    whitening: Option<(Vec<u32>, Vec<u32>, Vec<f32>)>,
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl DeviceStaged {
    /// Whether the window can be queued on the device: sent ahead, or
    /// already there.
    fn queueable(&self) -> bool {
        self.raw.as_ref().is_none_or(|r| r.is_sent())
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl DeviceStager {
    fn stage_window(&self, w: &mut Window, times: &mut StageTimes) -> Result<DeviceStaged> {
        let t0 = Instant::now();
        let mut whitening = None;
        if let Some(d) = &self.drift {
            // Kilosort4 applies (M_b·W)·X: the window's matrix replaces W.
            if let Some(g) = d.window_whitening(w.index, &self.whitening)? {
                whitening = Some(g.csr());
            }
            times.lap("drift_matrix", t0);
        }
        if w.index < self.filtered_below {
            // Its raw values are not needed: their storage goes back now.
            w.raw16 = None;
            return Ok(DeviceStaged {
                raw: None,
                whitening,
            });
        }
        let t0 = Instant::now();
        let packed_here = w.raw16.is_none();
        let raw = self.packer.raw_window(w);
        if packed_here {
            times.lap("pack", t0);
        }
        let t0 = Instant::now();
        let raw = self.packer.send_ahead(raw);
        if raw.is_sent() {
            times.lap("upload", t0);
        }
        Ok(DeviceStaged {
            raw: Some(raw),
            whitening,
        })
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl Stager for DeviceStager {
    fn stage(&mut self, w: &mut Window, times: &mut StageTimes) -> Result<Staged> {
        Ok(Box::new(self.stage_window(w, times)?))
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl DevicePass {
    /// The bytes to keep windows in: `given` (`--keep-windows-gb`) cut to
    /// the device's free memory ([`capped_budget`], its warning kept for
    /// [`WindowPass::take_warnings`]), else half of it (none when the device
    /// cannot say, as wgpu).
    fn keep_budget(&mut self, given: Option<u64>) -> u64 {
        let free = self.detector.free_device_memory();
        match given {
            Some(b) => {
                let (b, w) = capped_budget(b, free, "GPU");
                self.warnings.extend(w);
                b
            }
            None => free.unwrap_or(0) / 2,
        }
    }

    fn stager_now(&self) -> DeviceStager {
        DeviceStager {
            packer: self.packer.clone(),
            whitening: self.pre.whitening().clone(),
            drift: self.drift.clone(),
            filtered_below: self.from_filtered.len() as u64,
        }
    }

    fn run_device(
        &mut self,
        w: &Window,
        staged: DeviceStaged,
        times: &mut StageTimes,
    ) -> Result<Detections> {
        let t1 = Instant::now();
        let Some(raw) = self.take_raw(staged)? else {
            // Whitened from its high-passed samples: queued, then collected.
            self.submit_filtered(w)?;
            let det = match self.detector.collect() {
                Ok(Some(det)) => det,
                Ok(None) => {
                    return Err(anyhow!("the device has no detections queued"))
                        .with_context(|| device_work(w));
                }
                Err(e) => return Err(e).with_context(|| device_work(w)),
            };
            self.window_done(w.index, false, t1, times);
            return Ok(det);
        };
        // Every TIMED_EVERY-th window (not the first ones, which compile the
        // kernels) syncs after each step, for the per-step split.
        let mut step = crate::detect::gpu::StepTimes::default();
        let timed = Self::is_timed(w.index);
        self.mark_filtered(w.index);
        let det = self
            .detector
            .detect_raw(raw, &self.yc, timed.then_some(&mut step))
            .with_context(|| device_work(w))?;
        self.take_filtered(w.index);
        self.keep_one(w.index, None);
        self.window_done(w.index, timed, t1, times);
        if timed {
            self.timed_windows.push(step);
        }
        Ok(det)
    }

    /// The window's raw values (`None`: it starts from its high-passed
    /// samples on the device) with its whitening set on the device (drift
    /// correction's per-window matrix), counted as uploaded.
    fn take_raw(&mut self, staged: DeviceStaged) -> Result<Option<crate::detect::gpu::RawWindow>> {
        if let Some((start, cols, vals)) = &staged.whitening {
            self.detector.set_whitening(start, cols, vals)?;
        }
        if let Some(raw) = &staged.raw {
            self.upload_bytes += raw.n_bytes() as u64;
            self.upload_windows += 1;
        }
        Ok(staged.raw)
    }

    /// Queues window `w` from its high-passed samples kept on the device,
    /// whitened with the whitening set, and keeps the buffer the detector
    /// hands back holding it whitened.
    fn submit_filtered(&mut self, w: &Window) -> Result<()> {
        let h = self
            .from_filtered
            .get_mut(w.index as usize)
            .and_then(Option::take)
            .ok_or_else(|| anyhow!("window {} was not kept after its high-pass", w.index))?;
        let whitened = self
            .detector
            .submit_filtered(h, &self.yc)
            .with_context(|| device_work(w))?;
        self.keep_one(w.index, Some(whitened));
        Ok(())
    }

    /// Adds the device's seconds since `t1` for window `index` (and what the
    /// host waited of them) to `times` and to the per-window record.
    fn window_done(&mut self, index: u64, timed: bool, t1: Instant, times: &mut StageTimes) {
        let t2 = times.lap("device", t1);
        times.add("device.wait", self.detector.take_wait_seconds());
        let secs = t2.duration_since(t1).as_secs_f64();
        if index == 0 {
            self.first_window_s = secs;
        } else if !timed {
            self.window_s.push(secs);
        }
    }
}

/// The context of a device error about window `w`.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn device_work(w: &Window) -> String {
    format!(
        "preprocessing and detecting window {} (samples from {}) on the device",
        w.index, w.own_start
    )
}

/// Every how many windows a [`DevicePass`] times its device steps one by one.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
const TIMED_EVERY: u64 = 25;

/// Windows a [`DevicePass`] keeps queued on the device after taking a new one:
/// one, so that the device works on window k + 1 while the host takes window
/// k's detections (two upload buffers: the stager fills the one window k
/// held while the device works on k + 1).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
const DEVICE_QUEUE: usize = 1;

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl DevicePass {
    /// Whether window `index` syncs after each device step, for the per-step
    /// split (every TIMED_EVERY-th window, not the first ones).
    fn is_timed(index: u64) -> bool {
        index >= 2 && index % TIMED_EVERY == 2
    }

    /// The oldest queued window with its detections.
    fn collect_one(&mut self) -> Result<(Window, Detections)> {
        let w = self
            .queued
            .pop_front()
            .ok_or_else(|| anyhow!("no window is queued on the device"))?;
        match self.detector.collect() {
            Ok(Some(det)) => Ok((w, det)),
            Ok(None) => {
                Err(anyhow!("the device has no detections queued")).with_context(|| device_work(&w))
            }
            Err(e) => {
                self.queued.clear();
                Err(e).with_context(|| device_work(&w))
            }
        }
    }

    /// Queues a window that was sent ahead ([`WindowPass::push`]).
    fn queue(
        &mut self,
        w: Window,
        staged: DeviceStaged,
        times: &mut StageTimes,
    ) -> Result<Vec<(Window, Detections)>> {
        let t1 = Instant::now();
        let index = w.index;
        match self.take_raw(staged)? {
            Some(raw) => {
                self.mark_filtered(index);
                self.detector
                    .submit_raw(raw, &self.yc)
                    .with_context(|| device_work(&w))?;
                self.take_filtered(index);
                self.keep_one(index, None);
            }
            None => self.submit_filtered(&w)?,
        }
        self.queued.push_back(w);
        let mut done = Vec::new();
        while self.queued.len() > DEVICE_QUEUE {
            done.push(self.collect_one()?);
        }
        self.window_done(index, false, t1, times);
        Ok(done)
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl WindowPass for DevicePass {
    fn run(&mut self, w: &mut Window, times: &mut StageTimes) -> Result<Detections> {
        let staged = self.stager_now().stage_window(w, times)?;
        self.run_device(w, staged, times)
    }

    fn stager(&mut self) -> Option<Box<dyn Stager>> {
        Some(Box::new(self.stager_now()))
    }

    fn raw16_buffers(&self) -> Option<Raw16Alloc> {
        let packer = self.packer.clone();
        Some(Box::new(move |n| Box::new(packer.raw16_buffer(n))))
    }

    fn run_staged(
        &mut self,
        w: &mut Window,
        staged: Staged,
        times: &mut StageTimes,
    ) -> Result<Detections> {
        match staged.downcast::<DeviceStaged>() {
            Ok(s) => self.run_device(w, *s, times),
            Err(_) => self.run(w, times),
        }
    }

    fn push(
        &mut self,
        mut w: Window,
        staged: Option<Staged>,
        times: &mut StageTimes,
    ) -> Result<Vec<(Window, Detections)>> {
        let staged = match staged.map(|s| s.downcast::<DeviceStaged>()) {
            Some(Ok(s)) => *s,
            _ => self.stager_now().stage_window(&mut w, times)?,
        };
        // A window already on the device is queued whether timed or not.
        if self.queue_windows
            && staged.queueable()
            && (staged.raw.is_none() || !Self::is_timed(w.index))
        {
            return self.queue(w, staged, times);
        }
        // A window the device cannot queue (not sent ahead: wgpu, or a window
        // of another size), or one timed step by step: after the queued ones.
        let mut done = self.drain(times)?;
        let det = self.run_device(&w, staged, times)?;
        done.push((w, det));
        Ok(done)
    }

    fn drain(&mut self, times: &mut StageTimes) -> Result<Vec<(Window, Detections)>> {
        let t1 = Instant::now();
        let mut done = Vec::with_capacity(self.queued.len());
        while !self.queued.is_empty() {
            done.push(self.collect_one()?);
        }
        if !done.is_empty() {
            times.lap("device", t1);
            times.add("device.wait", self.detector.take_wait_seconds());
        }
        Ok(done)
    }

    fn bytes_uploaded(&self) -> u64 {
        self.upload_bytes
    }

    fn windows_uploaded(&self) -> u64 {
        self.upload_windows
    }

    fn set_drift(&mut self, drift: Option<Arc<dyn WindowWhitening>>) -> Result<()> {
        self.drift = drift.filter(|d| d.corrects());
        if self.drift.is_none() {
            // Back to the plain whitening.
            let (start, cols, vals) = self.pre.whitening().csr();
            self.detector.set_whitening(&start, &cols, &vals)?;
        }
        Ok(())
    }

    fn preprocess_on(&self) -> &'static str {
        "device"
    }

    fn learning_window(
        &mut self,
        w: &mut Window,
        drift: Option<&dyn WindowWhitening>,
        cut: &crate::detect::learn::ClipCut,
    ) -> Option<Result<Array2<f32>>> {
        let mut run = || -> Result<Array2<f32>> {
            let own = match drift {
                Some(d) => d.window_whitening(w.index, self.pre.whitening())?,
                None => None,
            };
            if let Some(g) = &own {
                let (start, cols, vals) = g.csr();
                self.detector.set_whitening(&start, &cols, &vals)?;
            }
            let raw = self.packer.raw_window(w);
            let res = self.detector.learning_clips(raw, &self.yc, cut);
            let restored = match own {
                Some(_) => {
                    let (start, cols, vals) = self.pre.whitening().csr();
                    self.detector.set_whitening(&start, &cols, &vals)
                }
                None => Ok(()),
            };
            // The window's own error first; then the restore's.
            let clips = res
                .with_context(|| device_work(w))?
                .context("the pass's detector is not on a device")?;
            restored?;
            Ok(clips)
        };
        Some(run())
    }

    fn end_learning(&mut self) {
        self.detector.end_whitened();
    }

    fn keep_windows(&mut self, budget: Option<u64>) {
        if let Some(f) = self.filtered.take()
            && !f.kept.is_empty()
        {
            // Each high-passed window kept is traded for its whitened window
            // (the detector hands one buffer back for each it takes); no
            // other window is kept (the budget was spent on those).
            self.from_filtered = f.kept.into_iter().map(Some).collect();
            let (c, n) = self.pre.window_shape();
            let bytes = (self.from_filtered.len() * c * n * 4) as u64;
            tracing::debug!(
                "{} windows start from their high-passed samples kept on the device; keeping them whitened ({bytes} bytes)",
                self.from_filtered.len()
            );
            self.keep = Some(Keeping::new(bytes));
            return;
        }
        let budget = self.keep_budget(budget);
        tracing::debug!("keeping whitened windows on the device within {budget} bytes");
        self.keep = Some(Keeping::new(budget));
    }

    fn windows_held(&self) -> u64 {
        self.from_filtered.len() as u64
    }

    fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
    }

    fn keep_filtered(&mut self, budget: Option<u64>) -> bool {
        let budget = self.keep_budget(budget);
        tracing::debug!("keeping high-passed windows on the device within {budget} bytes");
        self.filtered = Some(Keeping::new(budget));
        true
    }

    fn take_kept(&mut self) -> Option<KeptWindows> {
        self.from_filtered = Vec::new();
        let k = self.keep.take()?;
        let (n_sites, n_t) = self.pre.window_shape();
        if k.kept.is_empty() {
            k.say_if_none_fit(
                (n_sites * n_t * 4) as u64,
                "whitened window kept on the device",
            );
            return None;
        }
        tracing::info!(
            "{} whitened windows kept on the device ({:.1} GB)",
            k.kept.len(),
            (k.kept.len() * n_sites * n_t * 4) as f64 / 1e9
        );
        Some(KeptWindows {
            backend: self.detector.backend_name(),
            n_sites,
            n_t,
            handles: k.kept,
            host: Vec::new(),
        })
    }

    fn device_highpass(&self) -> Option<&'static str> {
        self.detector.device_highpass()
    }

    fn set_templates(&mut self, templates: &crate::detect::UniversalTemplates) -> Result<()> {
        Ok(self.detector.set_templates(templates)?)
    }

    fn step_medians(&self) -> Vec<(String, f64)> {
        let t = &self.timed_windows;
        if t.is_empty() {
            return Vec::new();
        }
        let mut whole = self.window_s.clone();
        whole.sort_by(f64::total_cmp);
        let median = |f: fn(&crate::detect::gpu::StepTimes) -> f64| {
            let mut v: Vec<f64> = t.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        vec![
            ("upload".into(), median(|s| s.upload)),
            ("preprocess".into(), median(|s| s.preprocess)),
            ("filter_bank".into(), median(|s| s.filter_bank)),
            ("centre_response".into(), median(|s| s.centre_response)),
            ("neighbour_max".into(), median(|s| s.neighbour_max)),
            ("local_peaks".into(), median(|s| s.local_peaks)),
            ("features".into(), median(|s| s.features)),
            ("download".into(), median(|s| s.download)),
            ("windows_timed".into(), t.len() as f64),
            // Whole windows as the pass ran them (no syncs between steps).
            (
                "whole".into(),
                whole.get(whole.len() / 2).copied().unwrap_or(0.0),
            ),
            ("first_window".into(), self.first_window_s),
        ]
    }
}

/// What [`run_windows`] measured.
#[derive(Debug, Clone, Default)]
pub struct StagesReport {
    /// Busy seconds per stage, summed over windows.
    pub times: StageTimes,
    /// Wall seconds from the first read to the last write.
    pub wall: f64,
}

impl StagesReport {
    /// Sum of the stages' busy seconds over the wall time: how many stages
    /// ran at once on average.
    pub fn overlap(&self) -> f64 {
        self.times.busy() / self.wall.max(1e-12)
    }
}

/// Reads window `i`: as int16 values into storage from `raw16` when it is
/// given and the recording gives int16 values (then `data` is left empty and
/// the window is returned), else as f32 into `data` (allocated at its size when
/// it is not). When a recording answers that it cannot give int16 values at
/// all ([`crate::recording::gives_int16`]; not just for this window, as a
/// concatenation across its files), `raw16` is set to `None`.
pub(crate) fn read_any(
    rec: &dyn Recording,
    plan: &WindowPlan,
    i: u64,
    chan_map: &[u64],
    data: &mut Array2<f32>,
    raw16: &mut Option<Raw16Alloc>,
) -> Result<Option<crate::recording::Raw16>> {
    let (rows, n) = (chan_map.len(), plan.window_len());
    if let Some(alloc) = raw16.as_mut() {
        let stride = crate::recording::Raw16::stride_for(n);
        let mut raw = crate::recording::Raw16::new(rows, n, stride, alloc(rows * stride))?;
        if crate::recording::read_window_i16(rec, plan, i, chan_map, &mut raw)? {
            *data = Array2::zeros((0, 0));
            return Ok(Some(raw));
        }
        // A window across two files of a concatenation is read as
        // f32, and the next ones as int16 again; a recording that never gives
        // int16 values gets f32 windows from here on.
        if !crate::recording::gives_int16(rec, chan_map) {
            *raw16 = None;
        }
    }
    if data.dim() != (rows, n) {
        *data = Array2::zeros((rows, n));
    }
    read_window(rec, plan, i, chan_map, data)?;
    Ok(None)
}

/// Runs every window of `plan` through read (+ `check`), `pass` and `write`,
/// the three overlapping on their own threads (module docs).
///
/// * `check(window)`: on the reading thread, in window order, right after the read;
/// * `pass`: on the pass thread;
/// * `write(info, detections)`: on the calling thread, in window order.
///
/// At most [`WINDOWS_IN_FLIGHT`] window buffers (`chan_map.len()` ×
/// `plan.window_len()` f32 each) exist at a time.
///
/// # Errors
/// The first error of any stage (a failed read, check, pass or write); the
/// other stages then stop at their next window.
pub fn run_windows<C, W>(
    rec: Arc<dyn Recording>,
    plan: WindowPlan,
    chan_map: &[u64],
    mut check: C,
    pass: &mut dyn WindowPass,
    write: W,
) -> Result<StagesReport>
where
    C: FnMut(&mut Window) -> Result<()> + Send,
    W: FnMut(WindowInfo, Detections) -> Result<()>,
{
    run_windows_prechecked(
        rec,
        plan,
        chan_map,
        &|_: &mut Window| Ok(()),
        move |w: &mut Window, ()| check(w),
        0,
        pass,
        write,
    )
}

/// [`run_windows`] with the checks in two parts: `prepare` runs
/// on the reading threads right after each window is read (several windows
/// at once, in any order; e.g. [`crate::checks::precheck_window`]), `merge`
/// then takes its result in window order (e.g. adding it to the run's
/// [`crate::checks::ChannelHealth`]), before the window goes on.
///
/// Windows below both `checked_below` (whose checks `prepare` knows without
/// their samples) and the pass's [`WindowPass::windows_held`] (whose samples
/// the pass has) are not read: `prepare` and the pass get them
/// [`Window::unread`].
///
/// # Errors
/// As [`run_windows`].
#[allow(clippy::too_many_arguments)]
pub fn run_windows_prechecked<P, M, W>(
    rec: Arc<dyn Recording>,
    plan: WindowPlan,
    chan_map: &[u64],
    prepare: &(dyn Fn(&mut Window) -> Result<P> + Sync),
    merge: M,
    checked_below: u64,
    pass: &mut dyn WindowPass,
    mut write: W,
) -> Result<StagesReport>
where
    P: Send,
    M: FnMut(&mut Window, P) -> Result<()> + Send,
    W: FnMut(WindowInfo, Detections) -> Result<()>,
{
    let t_start = Instant::now();
    let stager = pass.stager();
    let raw16_allocs = reading_allocs(pass, rec.as_ref(), chan_map);
    let in_flight = windows_in_flight(stager.is_some(), raw16_allocs.len());
    if raw16_allocs.len() > 1 {
        tracing::info!(
            "{} windows read at once on their own threads ({in_flight} windows in flight)",
            raw16_allocs.len()
        );
    }
    let (raw_tx, raw_rx) = bounded::<Result<Window>>(WINDOWS_IN_FLIGHT);
    let (staged_tx, staged_rx) = bounded::<Result<(Window, Option<Staged>)>>(1);
    let (det_tx, det_rx) = bounded::<Result<(WindowInfo, Detections)>>(WINDOWS_IN_FLIGHT);
    let (free_tx, free_rx) = unbounded::<Array2<f32>>();
    let rec = rec.as_ref();
    let unread_below = checked_below.min(pass.windows_held());
    if unread_below > 0 {
        tracing::debug!(
            "{unread_below} windows not read: the pass holds their samples and their checks are known"
        );
    }
    let reading = Reading {
        rec,
        plan,
        chan_map,
        allocs: raw16_allocs,
        in_flight,
        unread_below,
    };

    std::thread::scope(|s| -> Result<StagesReport> {
        let reader = std::thread::Builder::new()
            .name("spikecube-read".into())
            .spawn_scoped(s, move || reading.run(prepare, merge, raw_tx, free_rx))
            .context("cannot start the reading thread")?;
        let stage_thread = std::thread::Builder::new()
            .name("spikecube-stage".into())
            .spawn_scoped(s, move || stage_windows(stager, raw_rx, staged_tx))
            .context("cannot start the staging thread")?;
        let pass_thread = std::thread::Builder::new()
            .name("spikecube-pass".into())
            .spawn_scoped(s, move || pass_windows(pass, staged_rx, free_tx, det_tx))
            .context("cannot start the processing thread")?;

        let mut times = StageTimes::default();
        let mut done = 0u64;
        let result = (|| -> Result<()> {
            for item in det_rx.iter() {
                let (info, det) = item?;
                let t0 = Instant::now();
                write(info, det)?;
                times.lap("write", t0);
                done += 1;
            }
            Ok(())
        })();
        // Stop the other stages if the writer stopped early.
        drop(det_rx);
        let pass_times = pass_thread
            .join()
            .map_err(|_| anyhow!("the processing thread panicked"))?;
        let stage_times = stage_thread
            .join()
            .map_err(|_| anyhow!("the staging thread panicked"))?;
        let read_times = reader
            .join()
            .map_err(|_| anyhow!("the reading thread panicked"))?;
        result?;
        if done != plan.n_windows {
            return Err(anyhow!(
                "the run stopped after {done} of {} windows",
                plan.n_windows
            ));
        }
        times.merge(&pass_times);
        times.merge(&stage_times);
        times.merge(&read_times);
        Ok(StagesReport {
            times,
            wall: t_start.elapsed().as_secs_f64(),
        })
    })
}

/// One allocator of int16 storage per reading thread: several threads for a
/// pass that takes int16 windows from a recording that gives them
/// ([`device_readers`]); one for the others (f32 windows, twice the bytes,
/// as for a CPU pass).
fn reading_allocs(
    pass: &mut dyn WindowPass,
    rec: &dyn Recording,
    chan_map: &[u64],
) -> Vec<Option<Raw16Alloc>> {
    match pass.raw16_buffers() {
        Some(a) if !crate::recording::gives_int16(rec, chan_map) => vec![Some(a)],
        Some(a) => std::iter::once(Some(a))
            .chain((1..device_readers()).map(|_| pass.raw16_buffers()))
            .collect(),
        None => vec![None],
    }
}

/// The read stage of [`run_windows_prechecked`]: what the reading threads need.
struct Reading<'a> {
    rec: &'a dyn Recording,
    plan: WindowPlan,
    chan_map: &'a [u64],
    /// One per reading thread.
    allocs: Vec<Option<Raw16Alloc>>,
    /// Window buffers that may exist at once.
    in_flight: usize,
    /// Windows below this index are handed on [`Window::unread`].
    unread_below: u64,
}

impl Reading<'_> {
    /// Reads every window on `allocs.len()` threads, `prepare` right after
    /// each read, then `merge` and the hand-on to `raw_tx` in window order
    /// ([`crate::recording::read_in_order`]); window buffers are taken in
    /// window order, at most `in_flight`, new ones while fewer exist and then
    /// those `free_rx` gives back. Returns the busy seconds (`read`,
    /// `checks.prepare` summed over the threads, `checks`).
    fn run<P, M>(
        self,
        prepare: &(dyn Fn(&mut Window) -> Result<P> + Sync),
        mut merge: M,
        raw_tx: crossbeam_channel::Sender<Result<Window>>,
        free_rx: crossbeam_channel::Receiver<Array2<f32>>,
    ) -> StageTimes
    where
        P: Send,
        M: FnMut(&mut Window, P) -> Result<()> + Send,
    {
        let Reading {
            rec,
            plan,
            chan_map,
            allocs,
            in_flight,
            unread_below,
        } = self;
        let mut times = StageTimes::default();
        let first = rec.first_sample();
        let mut allocated = 0;
        let states: Vec<(Option<Raw16Alloc>, StageTimes)> = allocs
            .into_iter()
            .map(|a| (a, StageTimes::default()))
            .collect();
        let raw_tx = &raw_tx;
        let times_r = &mut times;
        let done = crate::recording::read_in_order(
            "spikecube-read",
            plan.n_windows,
            states,
            // A free buffer, or a new one while fewer than the bound exist
            // (allocated at its size only when f32 samples go in); none once
            // the pass stopped.
            |_| {
                if allocated < in_flight {
                    allocated += 1;
                    Some(Array2::zeros((0, 0)))
                } else {
                    free_rx.recv().ok()
                }
            },
            |(raw16, times), i, mut data| {
                let t1 = Instant::now();
                let res = if i < unread_below {
                    Ok(Window::unread(first, &plan, i))
                } else {
                    read_any(rec, &plan, i, chan_map, &mut data, raw16)
                        .map(|raw16| Window::of(first, &plan, i, data, raw16))
                };
                let t2 = times.lap("read", t1);
                let res = res.and_then(|mut w| prepare(&mut w).map(|p| (w, p)));
                times.lap("checks.prepare", t2);
                res
            },
            |_, res: Result<(Window, P)>| {
                let t2 = Instant::now();
                let res = res.and_then(|(mut w, p)| merge(&mut w, p).map(|()| w));
                times_r.lap("checks", t2);
                let failed = res.is_err();
                raw_tx.send(res).is_ok() && !failed
            },
        );
        match done {
            Ok(states) => states.iter().for_each(|(_, t)| times.merge(t)),
            Err(e) => {
                let _ = raw_tx.send(Err(e).context("cannot start a reading thread"));
            }
        }
        times
    }
}

/// The stage between the reader and the pass: the pass's stager, or a plain
/// relay. Returns its busy seconds.
fn stage_windows(
    mut stager: Option<Box<dyn Stager>>,
    raw_rx: crossbeam_channel::Receiver<Result<Window>>,
    staged_tx: crossbeam_channel::Sender<Result<(Window, Option<Staged>)>>,
) -> StageTimes {
    let mut times = StageTimes::default();
    for item in raw_rx.iter() {
        let res = item.and_then(|mut w| match stager.as_mut() {
            Some(st) => {
                let staged = st.stage(&mut w, &mut times).with_context(|| {
                    format!(
                        "preparing window {} (samples from {})",
                        w.index, w.own_start
                    )
                })?;
                Ok((w, Some(staged)))
            }
            None => Ok((w, None)),
        });
        let failed = res.is_err();
        if staged_tx.send(res).is_err() || failed {
            break;
        }
    }
    times
}

/// The pass stage: each staged window through `pass`, the finished ones'
/// detections on to `det_tx` and their buffers back to the reader through
/// `free_tx`. Returns its busy seconds.
fn pass_windows(
    pass: &mut dyn WindowPass,
    staged_rx: crossbeam_channel::Receiver<Result<(Window, Option<Staged>)>>,
    free_tx: crossbeam_channel::Sender<Array2<f32>>,
    det_tx: crossbeam_channel::Sender<Result<(WindowInfo, Detections)>>,
) -> StageTimes {
    let mut times = StageTimes::default();
    // Hands on finished windows; false when the run stops.
    let hand_on = |res: Result<Vec<(Window, Detections)>>| -> bool {
        match res {
            Ok(done) => done.into_iter().all(|(w, det)| {
                let info = WindowInfo::of(&w);
                // Hand the buffer back; the reader may have stopped.
                let _ = free_tx.send(w.data);
                det_tx.send(Ok((info, det))).is_ok()
            }),
            Err(e) => {
                let _ = det_tx.send(Err(e));
                false
            }
        }
    };
    let mut going = true;
    for item in staged_rx.iter() {
        let res = item.and_then(|(w, staged)| pass.push(w, staged, &mut times));
        if !hand_on(res) {
            going = false;
            break;
        }
    }
    // The windows still queued (released even when the run stopped).
    let rest = pass.drain(&mut times);
    if going {
        hand_on(rest);
    }
    times
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RecordingError;
    use std::collections::HashSet;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A given budget stands when it fits in the memory left (or that is
    /// unknown), and is cut to [`GIVEN_BUDGET_SHARE`] of it otherwise.
    #[test]
    fn a_given_budget_is_capped_by_the_memory_left() {
        let gb = 1_000_000_000u64;
        assert_eq!(
            capped_budget(10 * gb, Some(100 * gb), "host"),
            (10 * gb, None)
        );
        assert_eq!(
            capped_budget(80 * gb, Some(100 * gb), "host"),
            (80 * gb, None)
        );
        let (b, w) = capped_budget(500 * gb, Some(100 * gb), "host");
        assert_eq!(b, 80 * gb);
        let w = w.unwrap();
        assert!(
            w.contains("--keep-windows-gb 500.0") && w.contains("host memory left (100.0 GB)"),
            "{w}"
        );
        assert_eq!(capped_budget(500 * gb, None, "GPU"), (500 * gb, None));
        assert_eq!(capped_budget(0, Some(gb), "host"), (0, None));
    }

    /// The host default keeps something on a Linux machine with free memory,
    /// and never more than a third of what the system reports available.
    #[test]
    fn default_host_keep_budget_is_a_third_of_what_is_free() {
        let budget = default_host_keep_budget();
        let mut sys = sysinfo::System::new().expect("system information on Linux");
        sys.refresh_memory();
        assert!(budget > 0, "no host memory reported free");
        // Memory may be freed between the two readings: allow 1 GB.
        assert!(
            budget <= sys.available_memory() / 3 + (1 << 30),
            "{budget} bytes against {} available",
            sys.available_memory()
        );
    }

    /// A recording in memory: sample t of channel c is c·1000 + t.
    #[derive(Debug)]
    struct Ramp {
        n_channels: usize,
        n_samples: u64,
    }

    impl Recording for Ramp {
        fn n_channels(&self) -> usize {
            self.n_channels
        }
        fn n_samples(&self) -> u64 {
            self.n_samples
        }
        fn fs(&self) -> f64 {
            30_000.0
        }
        fn first_sample(&self) -> u64 {
            0
        }
        fn read_channels(
            &self,
            start: u64,
            count: usize,
            chan_map: &[u64],
            out: &mut [f32],
        ) -> Result<(), RecordingError> {
            for (r, &c) in chan_map.iter().enumerate() {
                for t in 0..count {
                    out[r * count + t] = (c * 1000 + start + t as u64) as f32;
                }
            }
            Ok(())
        }
        fn describe(&self) -> String {
            "ramp".into()
        }
    }

    /// Records what it saw: the window index, column `nt`'s value on row 0 and
    /// the buffer's address; fails at window `fail_at`.
    struct Probe {
        seen: Arc<Mutex<Vec<(u64, f32, usize)>>>,
        fail_at: Option<u64>,
    }

    impl WindowPass for Probe {
        fn run(&mut self, w: &mut Window, times: &mut StageTimes) -> Result<Detections> {
            times.add("detect", 0.0);
            if Some(w.index) == self.fail_at {
                anyhow::bail!("pass failed at window {}", w.index);
            }
            // nt = 10 in these tests.
            self.seen
                .lock()
                .unwrap()
                .push((w.index, w.data[[0, 10]], w.data.as_ptr() as usize));
            Ok(Detections {
                centre: vec![w.index as u32],
                sample: vec![w.own_len],
                amp: vec![1.0],
                imax: vec![0],
                sign: vec![1],
                adist: vec![],
                yct: vec![0.0],
                tf: vec![],
                n_chans: 0,
                n_pcs: 0,
            })
        }
    }

    /// [`Ramp`] that also gives its values as int16.
    #[derive(Debug)]
    struct Ramp16(Ramp);

    impl Recording for Ramp16 {
        fn n_channels(&self) -> usize {
            self.0.n_channels
        }
        fn n_samples(&self) -> u64 {
            self.0.n_samples
        }
        fn fs(&self) -> f64 {
            30_000.0
        }
        fn first_sample(&self) -> u64 {
            0
        }
        fn read_channels(
            &self,
            start: u64,
            count: usize,
            chan_map: &[u64],
            out: &mut [f32],
        ) -> Result<(), RecordingError> {
            self.0.read_channels(start, count, chan_map, out)
        }
        fn read_channels_i16(
            &self,
            start: u64,
            count: usize,
            chan_map: &[u64],
            out: &mut [i16],
            stride: usize,
        ) -> Result<bool, RecordingError> {
            for (r, &c) in chan_map.iter().enumerate() {
                for t in 0..count {
                    out[r * stride + t] = (c * 1000 + start + t as u64) as i16;
                }
            }
            Ok(true)
        }
        fn describe(&self) -> String {
            "ramp16".into()
        }
    }

    /// int16 storage that counts how many exist at once.
    struct Counted(Vec<i16>, Arc<(AtomicUsize, AtomicUsize)>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.1.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl crate::recording::Raw16Buffer for Counted {
        fn values(&self) -> &[i16] {
            &self.0
        }
        fn values_mut(&mut self) -> &mut [i16] {
            &mut self.0
        }
        fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
            self
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    /// What [`Probe16`] saw: (window, row 0 at column nt) in turn.
    type Seen16 = Arc<Mutex<Vec<(u64, Option<i16>)>>>;

    /// A pass that takes int16 windows (as a GPU pass does): several reading
    /// threads. Says it holds windows `0 .. held` ([`WindowPass::windows_held`])
    /// and checks that exactly windows `0 .. unread` come without samples.
    /// Records (index, row 0 at column nt; `None` for an unread window),
    /// sleeps a little.
    struct Probe16 {
        seen: Seen16,
        live: Arc<(AtomicUsize, AtomicUsize)>,
        held: u64,
        unread: u64,
    }

    impl WindowPass for Probe16 {
        fn run(&mut self, w: &mut Window, _: &mut StageTimes) -> Result<Detections> {
            // Taken, as a device pass's stager takes it to upload it.
            let raw = w.raw16.take();
            assert_eq!(raw.is_none(), w.index < self.unread, "window {}", w.index);
            assert!(w.data.is_empty());
            let v = raw.as_ref().map(|r| r.row(0)[10]);
            self.seen.lock().unwrap().push((w.index, v));
            drop(raw);
            std::thread::sleep(std::time::Duration::from_millis(1));
            Ok(Detections {
                centre: vec![],
                sample: vec![],
                amp: vec![],
                imax: vec![],
                sign: vec![],
                adist: vec![],
                yct: vec![],
                tf: vec![],
                n_chans: 0,
                n_pcs: 0,
            })
        }
        fn raw16_buffers(&self) -> Option<Raw16Alloc> {
            let live = self.live.clone();
            Some(Box::new(move |n| {
                let now = live.0.fetch_add(1, Ordering::SeqCst) + 1;
                live.1.fetch_max(now, Ordering::SeqCst);
                Box::new(Counted(vec![0; n], live.clone()))
            }))
        }
        fn windows_held(&self) -> u64 {
            self.held
        }
    }

    #[test]
    fn int16_windows_read_on_several_threads_arrive_checked_in_order() {
        let rec: Arc<dyn Recording> = Arc::new(Ramp16(Ramp {
            n_channels: 3,
            n_samples: 6_789,
        }));
        let plan = WindowPlan::new(6_789, 100, 10).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let live = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let mut pass = Probe16 {
            seen: seen.clone(),
            live: live.clone(),
            held: 0,
            unread: 0,
        };
        let mut checked = Vec::new();
        let mut written = Vec::new();
        run_windows(
            rec,
            plan,
            &[2, 0],
            |w| {
                checked.push((w.index, w.raw16.as_ref().map(|r| r.row(1)[10])));
                Ok(())
            },
            &mut pass,
            |info, _| {
                written.push(info.index);
                Ok(())
            },
        )
        .unwrap();
        let all: Vec<u64> = (0..plan.n_windows).collect();
        assert_eq!(written, all);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), all);
        for (k, &(i, v)) in seen.iter().enumerate() {
            assert_eq!(v, Some((2000 + i * 100) as i16), "window {i}");
            // The checks saw the same window, in order (row 1 reads channel 0).
            assert_eq!(checked[k], (i, Some((i * 100) as i16)));
        }
        assert_eq!(live.0.load(Ordering::SeqCst), 0);
        let peak = live.1.load(Ordering::SeqCst);
        assert!(
            peak <= windows_in_flight(false, DEVICE_READERS),
            "{peak} int16 windows at once"
        );
    }

    /// Windows the pass holds whose checks are known are handed on without
    /// being read; the others (past either bound) are read and checked.
    #[test]
    fn windows_held_with_known_checks_are_not_read() {
        let rec: Arc<dyn Recording> = Arc::new(Ramp16(Ramp {
            n_channels: 3,
            n_samples: 2_345,
        }));
        let plan = WindowPlan::new(2_345, 100, 10).unwrap();
        for (held, checked_below, unread) in [(5, 3, 3), (3, 5, 3), (5, 0, 0), (0, 24, 0)] {
            let seen = Arc::new(Mutex::new(Vec::new()));
            let mut pass = Probe16 {
                seen: seen.clone(),
                live: Arc::new((AtomicUsize::new(0), AtomicUsize::new(0))),
                held,
                unread,
            };
            let prepared = Mutex::new(Vec::new());
            let mut merged = Vec::new();
            let prepare = |w: &mut Window| -> Result<bool> {
                prepared.lock().unwrap().push(w.index);
                Ok(w.has_samples())
            };
            let mut written = 0;
            run_windows_prechecked(
                rec.clone(),
                plan,
                &[2, 0],
                &prepare,
                |w: &mut Window, read: bool| {
                    merged.push((w.index, read));
                    Ok(())
                },
                checked_below,
                &mut pass,
                |_, _| {
                    written += 1;
                    Ok(())
                },
            )
            .unwrap();
            let case = format!("held {held}, checked below {checked_below}");
            assert_eq!(written, plan.n_windows, "{case}");
            let want: Vec<(u64, bool)> = (0..plan.n_windows).map(|i| (i, i >= unread)).collect();
            assert_eq!(merged, want, "{case}");
            let mut prepared = prepared.into_inner().unwrap();
            prepared.sort_unstable();
            assert_eq!(prepared, (0..plan.n_windows).collect::<Vec<_>>(), "{case}");
            let seen = seen.lock().unwrap();
            for &(i, v) in seen.iter() {
                let want = (i >= unread).then_some((2000 + i * 100) as i16);
                assert_eq!(v, want, "{case}: window {i}");
            }
        }
    }

    fn setup(n_samples: u64) -> (Arc<dyn Recording>, WindowPlan) {
        let rec: Arc<dyn Recording> = Arc::new(Ramp {
            n_channels: 3,
            n_samples,
        });
        let plan = WindowPlan::new(n_samples, 100, 10).unwrap();
        (rec, plan)
    }

    #[test]
    fn windows_arrive_in_order_with_at_most_the_bound_of_buffers() {
        let (rec, plan) = setup(2_345);
        assert_eq!(plan.n_windows, 24);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut pass = Probe {
            seen: seen.clone(),
            fail_at: None,
        };
        let mut checked = Vec::new();
        let mut written = Vec::new();
        let report = run_windows(
            rec,
            plan,
            &[2, 0],
            |w| {
                checked.push(w.index);
                Ok(())
            },
            &mut pass,
            |info, det| {
                written.push((info.index, det.centre[0] as u64, det.sample[0]));
                Ok(())
            },
        )
        .unwrap();
        let all: Vec<u64> = (0..plan.n_windows).collect();
        assert_eq!(checked, all);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), all);
        // Row 0 reads channel 2; column nt holds the window's first own sample
        // (window 0: the left pad repeats sample 0, so column 10 is sample 0).
        for &(i, v, _) in seen.iter() {
            assert_eq!(v, (2000 + i * 100) as f32, "window {i}");
        }
        let buffers: HashSet<usize> = seen.iter().map(|s| s.2).collect();
        assert!(
            buffers.len() <= WINDOWS_IN_FLIGHT,
            "{} buffers",
            buffers.len()
        );
        for (k, &(i, c, own)) in written.iter().enumerate() {
            assert_eq!((i, c, own), (k as u64, k as u64, plan.own_len(k as u64)));
        }
        assert!(report.times.0.contains_key("read"));
        assert!(report.times.0.contains_key("write"));
        assert!(report.overlap() >= 0.0);
    }

    #[test]
    fn a_failing_stage_stops_the_run_with_its_error() {
        let (rec, plan) = setup(5_000);
        let mut pass = Probe {
            seen: Arc::new(Mutex::new(Vec::new())),
            fail_at: Some(7),
        };
        let mut n = 0;
        let err = run_windows(
            rec.clone(),
            plan,
            &[0],
            |_| Ok(()),
            &mut pass,
            |_, _| {
                n += 1;
                Ok(())
            },
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("pass failed at window 7"),
            "{err:#}"
        );
        assert_eq!(n, 7);

        let mut pass = Probe {
            seen: Arc::new(Mutex::new(Vec::new())),
            fail_at: None,
        };
        let err = run_windows(
            rec.clone(),
            plan,
            &[0],
            |_| Ok(()),
            &mut pass,
            |i, _| {
                if i.index == 3 {
                    anyhow::bail!("disk full")
                }
                Ok(())
            },
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("disk full"));

        let mut pass = Probe {
            seen: Arc::new(Mutex::new(Vec::new())),
            fail_at: None,
        };
        let err = run_windows(
            rec,
            plan,
            &[0],
            |w| {
                if w.index == 2 {
                    anyhow::bail!("bad check")
                }
                Ok(())
            },
            &mut pass,
            |_, _| Ok(()),
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("bad check"));
    }
}
