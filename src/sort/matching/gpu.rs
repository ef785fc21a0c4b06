//! Learned-template matching on the GPU through CubeCL (CUDA or wgpu): the
//! device twin of [`match_window`](super::match_window), Kilosort4 4.1.7's
//! `run_matching` + `extract`'s features (`shared/docs/sorting-spec.md` §2.5).
//!
//! A [`GpuMatcher`] uploads once what [`MatchingSetup`] holds: the templates
//! (block-sparse, see below), ‖U‖², the waveforms on each template's support
//! sites, the partner lists with their cross-correlations `ctc` (or their
//! `UtU` when the set-up did not precompute `ctc`), wPCA, `iCC` and `iU`.
//! Per window: one upload of X (C × NT), then on the device
//!
//! 1. F = wPCA ⋆ X on the sites some template uses ([`kernels::filter_kernel`]);
//! 2. B = U·F, K × NT, a tiled product of [`kernels::KB`] templates ×
//!    [`kernels::TT`] samples per cube over the union of the block's sites
//!    ([`kernels::product_kernel`]);
//! 3. the best template and Cf per sample ([`kernels::best_dense_kernel`]);
//! 4. per peel, with no host round trip: peak flags and their in-order
//!    compaction (block scans, [`kernels::flags_kernel`],
//!    [`kernels::offsets_kernel`], [`kernels::write_kernel`]), subtraction of
//!    the even-ranked then the odd-ranked spikes from B and the residual
//!    ([`kernels::subtract_kernel`]), Cf again around them
//!    ([`kernels::best_sparse_kernel`]). A device state (spike count, stop
//!    flag, peels) lets later peels do nothing once a peel finds no spike; the
//!    host reads it after as many peels as the previous window needed, then
//!    every few peels ([`GpuMatchOptions`]), and stops launching;
//! 5. the features of every spike from the final residual
//!    ([`kernels::features_kernel`]), then one download.
//!
//! Spikes: the same (sample, template) as the CPU, in the same order (peel by
//! peel, ascending sample). Ordering is by integer scans, and no sum uses
//! atomics, so a back end gives the same bytes on every run.
//!
//! Floats: every sum runs in the CPU's order, but GPU compilers fuse
//! `a + w·x` into multiply-adds, and tF's sums are float32 here (float64
//! rounded once on the CPU; wgpu has no float64). Tested (tests/matching_gpu.rs):
//! √Cf and amp within 1e-5 relative, tF within 1e-4·max(|tF|, 1); measured on
//! lavapipe: amp and √Cf bit-identical to the CPU's, tF within 2e-6 (unit
//! case and a sim32 window); a whole `spikecube sort` of the 30-s sim32
//! recording gave the same spike times, templates and clusters as the CPU. A spike can differ only where that rounding moves a
//! comparison (a Cf within rounding of `Th_learned`², or two maxima within
//! rounding of each other), as between the CPU and Kilosort4. Two spikes of
//! one half-peel with overlapping ranges (two exactly equal Cf maxima within
//! nt) are both subtracted here; the CPU lets the later one's write win.
//!
//! Capacity: at most `max_peels`·(NT/(nt + 1) + 1) spikes per window (a peel's
//! spikes are more than nt apart unless Cf values tie exactly); a window that
//! would pass it is matched again on the CPU, with a warning.
//!
//! Device memory (float32): B K·NT, F C_used·npc·NT, X C·NT, Cf and flags a
//! few NT; the pair arrays are the set-up's: `ctc` (2nt + 1 floats per pair
//! that shares a site, only when they fit `ctc_budget_bytes`, 512 MiB by
//! default) else `UtU` (npc² floats per pair: at most K²·144 B = 576 MB at
//! K = 2 000). At K = 2 000, C = 384, NT = 60 122: 481 + 554 + 92 + ≤ 576 MB
//! + outputs (≤ 30 MB) ≈ 1.8 GB, below 3 GB.

pub mod kernels;
mod simple;

use crate::detect::gpu::exact::NEG_ZERO;
use std::sync::Arc;

use cubecl::prelude::*;
use cubecl::server::Handle;
use ndarray::ArrayView2;

use super::{MatchError, MatchingSetup, WindowSpikes};
use kernels::{
    BEST_LANES, BEST_SLICES, KB, S_LEN, S_OVERFLOW, S_PEELS, S_STOP, S_TOTAL, TT, UNITS,
};

/// How the peels are driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMatchOptions {
    /// Peels launched between two reads of the device state (1 reads after
    /// every peel; `max_peels` launches them all and reads once). The
    /// results do not depend on it. Default 8: the 10-minute simulation of
    /// BENCHMARKS.md needs 19 peels a window on average, and of 2, 4, 8 and
    /// 16 on the H200, 8 gave the shortest peel phase.
    pub peels_per_check: usize,
    /// Whether a window's first read comes after one peel more than the
    /// previous window needed, and later reads every
    /// [`FOLLOW_UP_PEELS`] peels (`peels_per_check` then serves the first
    /// window only): neighbouring windows need about as many peels, so
    /// fewer peels are launched after the last one that finds a spike, and
    /// fewer reads wait for the device. The results do not depend on it.
    pub peels_from_last: bool,
    /// The first, one-unit-per-sample forms of the wPCA filter (`.0`) and of
    /// the best-template scans (`.1`) instead of the tiled ones (the same
    /// results; for checking a device against them).
    pub simple_kernels: (bool, bool),
    /// Windows fed from the device's preprocessing are copied and the copy
    /// matched, instead of matching in the window's own buffer (the same
    /// spikes; for measuring the copy).
    pub copy_window: bool,
    /// The peel kernels' grids sized for the work ([`LATER_BEST_CUBES`],
    /// [`SUBTRACT_PARTS`]); off, the first grids (the same spikes; for
    /// measuring).
    pub peel_grid: bool,
}

impl Default for GpuMatchOptions {
    fn default() -> Self {
        GpuMatchOptions {
            peels_per_check: 8,
            peels_from_last: true,
            simple_kernels: (false, false),
            copy_window: false,
            peel_grid: true,
        }
    }
}

impl GpuMatchOptions {
    /// The defaults, with `peels_per_check` from `SPIKECUBE_MATCH_PEELS_PER_CHECK`
    /// when it holds a positive integer (then every read comes after that
    /// many peels; a tuning knob: the spikes do not depend on it), the simple
    /// kernels with `SPIKECUBE_MATCH_KERNELS`
    /// = `simple`, `simple-filter` or `simple-best`, and the copied window
    /// with `SPIKECUBE_MATCH_COPY` set, and the first peel grids with
    /// `SPIKECUBE_MATCH_PEEL_GRID=first` (diagnostics).
    pub fn from_env() -> Self {
        let mut o = GpuMatchOptions::default();
        if let Some(v) = std::env::var("SPIKECUBE_MATCH_PEELS_PER_CHECK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&v| v > 0)
        {
            o.peels_per_check = v;
            o.peels_from_last = false;
        }
        match std::env::var("SPIKECUBE_MATCH_KERNELS").as_deref() {
            Ok("simple") => o.simple_kernels = (true, true),
            Ok("simple-filter") => o.simple_kernels = (true, false),
            Ok("simple-best") => o.simple_kernels = (false, true),
            _ => {}
        }
        o.copy_window = std::env::var_os("SPIKECUBE_MATCH_COPY").is_some();
        o.peel_grid = std::env::var("SPIKECUBE_MATCH_PEEL_GRID").as_deref() != Ok("first");
        o
    }
}

/// Per-window device buffers for windows of `n` samples.
struct WindowBuffers {
    n: usize,
    cap: usize,
    /// The matcher's own copy of the window X, then its residual (C × N),
    /// refilled every window; made on first use (a window matched in its
    /// own device buffer needs none).
    x: Option<Handle>,
    f: Handle,
    b: Handle,
    cfmax: Handle,
    imax: Handle,
    flags: Handle,
    lrank: Handle,
    bcount: Handle,
    boff: Handle,
    col: Handle,
    tmpl: Handle,
    amp: Handle,
    cf: Handle,
    tf: Handle,
}

/// Learned-template matching on one GPU for one [`MatchingSetup`] (generic
/// over the CubeCL runtime). Same [`WindowSpikes`] as [`super::match_window`].
pub struct GpuMatcher<R: Runtime> {
    client: ComputeClient<R>,
    device_name: String,
    setup: Arc<MatchingSetup>,
    options: GpuMatchOptions,
    /// Used sites (ascending; F's rows are slot-major).
    sites: Handle,
    n_used: usize,
    nm: Handle,
    wpca: Handle,
    wtw: Handle,
    blk_off: Handle,
    blk_slot: Handle,
    blk_u: Handle,
    n_blk_entries: usize,
    pk_off: Handle,
    pk_k: Handle,
    pairs: Handle,
    pairs_len: usize,
    n_pairs: usize,
    sup_off: Handle,
    sup_site: Handle,
    wave: Handle,
    n_sup: usize,
    u_all: Handle,
    icc: Handle,
    iu: Handle,
    window: Option<WindowBuffers>,
    /// Per-phase device times, when `SPIKECUBE_MATCH_PROFILE` is set.
    profile: Option<Box<PhaseTimes>>,
    /// Per-kernel device times of the peels, when `SPIKECUBE_MATCH_PROFILE`
    /// is `kernels` (a sync after every launch).
    kernel_clock: Option<std::sync::Mutex<KernelClock>>,
    /// Peels the previous window ran (the last one finding no spike
    /// included), for [`GpuMatchOptions::peels_from_last`].
    last_peels: Option<usize>,
    /// The last matched window's download, queued on the device and not yet
    /// waited for: it completes while the next window's kernels run.
    pending: Option<Pending>,
    /// Matched windows' spikes in window order, not yet taken.
    done: std::collections::VecDeque<WindowSpikes>,
    /// A clone of `client` that lives as long as the process, for the
    /// queued downloads: CubeCL's `read_async` future is tied to the client
    /// it was asked of (one client handle, tens of bytes, per matcher).
    reader: &'static ComputeClient<R>,
}

/// Bytes of a device read that is queued and not yet waited for.
type ReadFuture = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<Vec<cubecl::bytes::Bytes>, cubecl::server::ServerError>,
            > + Send,
    >,
>;

/// A window whose features kernel and download are queued on the device
/// (col, template, amp, Cf, tF of `count` spikes).
struct Pending {
    read: ReadFuture,
    count: usize,
    total: usize,
    peels: usize,
}

/// Cubes along x of a later peel's best-template scan
/// ([`kernels::best_sparse_kernel`], which strides over the peel's spikes):
/// later peels find few spikes, and a grid sized for the most a peel can
/// hold (one spike every nt + 1 samples, 986 in a 2-s window) spent most of
/// its launch on cubes with nothing to do. 128 × 4 cubes of 512 units fill
/// an H100's 132 multiprocessors about once.
pub const LATER_BEST_CUBES: usize = 128;

/// Cubes along y of each spike's subtraction ([`kernels::subtract_kernel`]),
/// with [`GpuMatchOptions::peel_grid`]: a spike's partners' values are
/// spread over this many cubes instead of one.
pub const SUBTRACT_PARTS: usize = 4;

/// The peel kernels' grids: (subtraction x, subtraction y, best-template
/// scan x) for a peel of at most `per_peel` spikes. Without `sized` (the
/// first form, for measuring) every peel gets one subtraction cube per
/// spike pair and one scan cube per possible spike. The grids do not change
/// the results (each value is written by one unit, or by several with the
/// same value).
fn peel_grid(per_peel: usize, first: bool, sized: bool) -> (u32, u32, u32) {
    let sub_x = per_peel.div_ceil(2) as u32;
    if !sized {
        return (sub_x, 1, per_peel as u32);
    }
    let best_x = if first {
        per_peel
    } else {
        per_peel.min(LATER_BEST_CUBES)
    };
    (sub_x, SUBTRACT_PARTS as u32, best_x as u32)
}

/// Peels between two reads of the device state after a window's first read,
/// with [`GpuMatchOptions::peels_from_last`].
pub const FOLLOW_UP_PEELS: usize = 4;

/// Device seconds of each peel kernel, split between the first peel of a
/// window and the later ones (a diagnostic; logged when the matcher is
/// dropped).
#[derive(Debug)]
struct KernelClock {
    last: std::time::Instant,
    /// (kernel, first peel) → (seconds, launches).
    per: std::collections::BTreeMap<(&'static str, bool), (f64, u64)>,
}

/// Device seconds of each phase of the matching, summed over windows: a
/// diagnostic (`SPIKECUBE_MATCH_PROFILE=1`), which syncs the device after
/// every phase and so makes the pass slower; logged when the matcher is dropped.
#[derive(Debug)]
struct PhaseTimes {
    windows: usize,
    peels: usize,
    state_reads: usize,
    /// Since the previous window's end: the host's hand-over and the
    /// preprocessing of this window on the device (when fed from it).
    before: f64,
    copy: f64,
    filter: f64,
    product: f64,
    best_dense: f64,
    peels_s: f64,
    /// Host seconds spent launching the peels' kernels (inside `peels_s`).
    peel_launch: f64,
    features: f64,
    download: f64,
    clock: std::time::Instant,
}

impl PhaseTimes {
    fn new() -> Self {
        PhaseTimes {
            windows: 0,
            peels: 0,
            state_reads: 0,
            before: 0.0,
            copy: 0.0,
            filter: 0.0,
            product: 0.0,
            best_dense: 0.0,
            peels_s: 0.0,
            peel_launch: 0.0,
            features: 0.0,
            download: 0.0,
            clock: std::time::Instant::now(),
        }
    }

    /// Seconds since the last lap.
    fn lap(&mut self) -> f64 {
        let now = std::time::Instant::now();
        let d = now.duration_since(self.clock).as_secs_f64();
        self.clock = now;
        d
    }
}

impl<R: Runtime> Drop for GpuMatcher<R> {
    fn drop(&mut self) {
        // A download still in flight (a pass stopped by an error after a
        // window was queued) is waited for: its host buffers must not go back
        // to CubeCL's pools while the device still copies into them.
        if let Some(p) = self.pending.take() {
            let _ = cubecl::future::block_on(p.read);
        }
        if let Some(k) = &self.kernel_clock
            && let Ok(k) = k.lock()
        {
            let windows = self.profile.as_ref().map_or(1, |p| p.windows.max(1));
            for ((name, first), (s, n)) in &k.per {
                tracing::info!(
                    "matching kernel {name} ({}): {:.3} ms a window, {n} launches, {:.1} µs a launch",
                    if *first { "first peel" } else { "later peels" },
                    1e3 * s / windows as f64,
                    1e6 * s / (*n).max(1) as f64
                );
            }
        }
        if let Some(p) = &self.profile {
            let ms = |v: f64| 1e3 * v / p.windows.max(1) as f64;
            tracing::info!(
                "matching profile ({} windows, {} peels, {} state reads), ms a window: before {:.2}, copy {:.2}, filter {:.2}, product {:.2}, best {:.2}, peels {:.2} (launching {:.2}), features {:.2}, download {:.2}",
                p.windows,
                p.peels,
                p.state_reads,
                ms(p.before),
                ms(p.copy),
                ms(p.filter),
                ms(p.product),
                ms(p.best_dense),
                ms(p.peels_s),
                ms(p.peel_launch),
                ms(p.features),
                ms(p.download)
            );
        }
    }
}

impl<R: Runtime> std::fmt::Debug for GpuMatcher<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuMatcher")
            .field("device", &self.device_name)
            .field("templates", &self.setup.n_templates())
            .finish()
    }
}

fn bytes_f32(v: &[f32]) -> &[u8] {
    f32::as_bytes(v)
}
fn bytes_u32(v: &[u32]) -> &[u8] {
    u32::as_bytes(v)
}

/// The block-sparse template matrix: per block of [`KB`] templates, the
/// union of their sites' slots (ascending) and, per entry, KB × npc
/// coefficients (zero for templates without that site or past K).
fn template_blocks(setup: &MatchingSetup, slot: &[usize]) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let (k, npc, _) = setup.u.dim();
    let nb = k.div_ceil(KB);
    let mut off = vec![0u32];
    let mut slots = Vec::new();
    let mut vals = Vec::new();
    for blk in 0..nb {
        let mut sites: Vec<u32> = (blk * KB..((blk + 1) * KB).min(k))
            .flat_map(|j| setup.support[j].iter().copied())
            .collect();
        sites.sort_unstable();
        sites.dedup();
        for &c in &sites {
            slots.push(slot[c as usize] as u32);
            for r in 0..KB {
                let j = blk * KB + r;
                for p in 0..npc {
                    vals.push(if j < k {
                        setup.u[[j, p, c as usize]]
                    } else {
                        0.0
                    });
                }
            }
        }
        off.push(slots.len() as u32);
    }
    (off, slots, vals)
}

impl<R: Runtime> GpuMatcher<R> {
    /// Uploads `setup`'s arrays to `device` (`device_name` names it in errors).
    ///
    /// # Errors
    /// None today; kept fallible for device allocation failures.
    pub fn new(
        device: &R::Device,
        device_name: String,
        setup: Arc<MatchingSetup>,
        options: GpuMatchOptions,
    ) -> Result<Self, MatchError> {
        let client = R::client(device);
        let (k, npc, n_c) = setup.u.dim();
        let nt = setup.settings.nt;
        let up_f =
            |v: &[f32]| client.create_from_slice(bytes_f32(if v.is_empty() { &[0.0] } else { v }));
        let up_u =
            |v: &[u32]| client.create_from_slice(bytes_u32(if v.is_empty() { &[0] } else { v }));
        let mut used = vec![false; n_c];
        for s in &setup.support {
            for &c in s {
                used[c as usize] = true;
            }
        }
        let sites: Vec<u32> = (0..n_c as u32).filter(|&c| used[c as usize]).collect();
        let mut slot = vec![usize::MAX; n_c];
        for (i, &c) in sites.iter().enumerate() {
            slot[c as usize] = i;
        }
        let (blk_off, blk_slot, blk_u) = template_blocks(&setup, &slot);
        let mut pk_off = vec![0u32];
        let mut pk_k = Vec::new();
        let mut pairs = Vec::new();
        let precomputed = setup.ctc_precomputed();
        for p in &setup.partners {
            pk_k.extend_from_slice(&p.k);
            pk_off.push(pk_k.len() as u32);
            match (&p.ctc, precomputed) {
                (Some(c), true) => pairs.extend_from_slice(c),
                _ => pairs.extend_from_slice(&p.utu),
            }
        }
        let mut sup_off = vec![0u32];
        let mut sup_site = Vec::new();
        let mut wave = Vec::new();
        for j in 0..k {
            sup_site.extend_from_slice(&setup.support[j]);
            sup_off.push(sup_site.len() as u32);
            wave.extend_from_slice(&setup.wave[j]);
        }
        debug_assert_eq!(wave.len(), sup_site.len() * nt);
        let wtw: Vec<f32> = {
            // WtW is npc × npc × (2nt + 1); the kernel reads [a·npc + b][d].
            setup.wtw.iter().copied().collect()
        };
        let m = GpuMatcher {
            device_name,
            options,
            n_used: sites.len(),
            sites: up_u(&sites),
            nm: up_f(&setup.nm),
            wpca: up_f(
                setup
                    .wpca
                    .as_standard_layout()
                    .as_slice()
                    .expect("standard"),
            ),
            wtw: up_f(&wtw),
            n_blk_entries: blk_slot.len(),
            blk_off: up_u(&blk_off),
            blk_slot: up_u(&blk_slot),
            blk_u: up_f(&blk_u),
            n_pairs: pk_k.len(),
            pairs_len: pairs.len(),
            pk_off: up_u(&pk_off),
            pk_k: up_u(&pk_k),
            pairs: up_f(&pairs),
            n_sup: sup_site.len(),
            sup_off: up_u(&sup_off),
            sup_site: up_u(&sup_site),
            wave: up_f(&wave),
            u_all: up_f(setup.u.as_standard_layout().as_slice().expect("standard")),
            icc: up_u(setup.icc.as_standard_layout().as_slice().expect("standard")),
            iu: up_u(&setup.iu),
            window: None,
            profile: std::env::var_os("SPIKECUBE_MATCH_PROFILE")
                .is_some()
                .then(|| Box::new(PhaseTimes::new())),
            kernel_clock: (std::env::var("SPIKECUBE_MATCH_PROFILE").as_deref() == Ok("kernels"))
                .then(|| {
                    std::sync::Mutex::new(KernelClock {
                        last: std::time::Instant::now(),
                        per: std::collections::BTreeMap::new(),
                    })
                }),
            last_peels: None,
            pending: None,
            done: std::collections::VecDeque::new(),
            reader: Box::leak(Box::new(client.clone())),
            setup,
            client,
        };
        debug_assert!(npc * npc * (2 * nt + 1) == m.setup.wtw.len());
        Ok(m)
    }

    /// How the peels are driven and which kernels run.
    pub fn options(&self) -> GpuMatchOptions {
        self.options
    }

    /// The set-up this matcher was made from.
    pub fn setup(&self) -> &Arc<MatchingSetup> {
        &self.setup
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Bytes of device memory held: the set-up's arrays plus the window's.
    pub fn device_bytes(&self) -> usize {
        let h = |x: &Handle| x.size() as usize;
        let fixed = [
            &self.sites,
            &self.nm,
            &self.wpca,
            &self.wtw,
            &self.blk_off,
            &self.blk_slot,
            &self.blk_u,
            &self.pk_off,
            &self.pk_k,
            &self.pairs,
            &self.sup_off,
            &self.sup_site,
            &self.wave,
            &self.u_all,
            &self.icc,
            &self.iu,
        ]
        .into_iter()
        .map(h)
        .sum::<usize>();
        let win = self.window.as_ref().map_or(0, |w| {
            [
                &w.f, &w.b, &w.cfmax, &w.imax, &w.flags, &w.lrank, &w.bcount, &w.boff, &w.col,
                &w.tmpl, &w.amp, &w.cf, &w.tf,
            ]
            .into_iter()
            .map(h)
            .sum::<usize>()
        });
        fixed + win
    }

    /// With profiling on: waits for the device and returns the seconds since
    /// the last lap (0 otherwise).
    fn lap(&mut self) -> f64 {
        if self.profile.is_none() {
            return 0.0;
        }
        let _ = cubecl::future::block_on(self.client.sync());
        self.profile.as_mut().map_or(0.0, |p| p.lap())
    }

    /// With the per-kernel profile on: waits for the device and books the
    /// seconds since the previous mark to `name` (`first`: the window's first
    /// peel); `None` restarts the clock.
    fn mark(&self, name: Option<&'static str>, first: bool) {
        let Some(k) = &self.kernel_clock else {
            return;
        };
        let _ = cubecl::future::block_on(self.client.sync());
        let now = std::time::Instant::now();
        if let Ok(mut k) = k.lock() {
            if let Some(name) = name {
                let d = now.duration_since(k.last).as_secs_f64();
                let e = k.per.entry((name, first)).or_insert((0.0, 0));
                e.0 += d;
                e.1 += 1;
            }
            k.last = now;
        }
    }

    /// [`MatchError::Shape`] unless a window of `n` samples is longer than
    /// 2·nt (the spikes lie in nt ≤ col < n − nt).
    fn check_samples(&self, n: usize) -> Result<(), MatchError> {
        let nt = self.setup.settings.nt;
        if n <= 2 * nt {
            return Err(super::shape_err(
                "window",
                format!("has {n} samples; expected more than {}", 2 * nt),
            ));
        }
        Ok(())
    }

    fn warn_overflow(&self, n: usize) {
        tracing::warn!(
            "GPU matching: more than {} spikes in one window of {n} samples (exactly tied Cf maxima?); this window is matched on the CPU",
            self.window.as_ref().map_or(0, |w| w.cap)
        );
    }

    fn device_err(&self, message: String) -> MatchError {
        MatchError::Device {
            device: self.device_name.clone(),
            message,
        }
    }

    fn buffers(&mut self, n: usize) {
        if self.window.as_ref().is_some_and(|w| w.n == n) {
            return;
        }
        let s = &self.setup.settings;
        let (k, npc, _) = self.setup.u.dim();
        let nc = self.setup.icc.nrows();
        let cap = s.max_peels * (n / (s.nt + 1) + 1);
        let nb = n.div_ceil(UNITS);
        let c = &self.client;
        let f = |len: usize| c.empty(len.max(1) * 4);
        self.window = Some(WindowBuffers {
            n,
            cap,
            x: None,
            f: f(self.n_used * npc * n),
            b: f(k * n),
            cfmax: f(n),
            imax: f(n),
            flags: f(n),
            lrank: f(n),
            bcount: f(nb),
            boff: f(nb),
            col: f(cap),
            tmpl: f(cap),
            amp: f(cap),
            cf: f(cap),
            tf: f(cap * nc * npc),
        });
    }

    /// [`super::match_window`] on the device: the same checks, the same spikes.
    ///
    /// # Errors
    /// [`MatchError::Shape`] as the CPU's; [`MatchError::Device`] when a read
    /// back fails.
    pub fn match_window(&mut self, x: ArrayView2<f32>) -> Result<WindowSpikes, MatchError> {
        let (_, _, n_c) = self.setup.u.dim();
        let nt = self.setup.settings.nt;
        let n = x.ncols();
        if x.nrows() != n_c || n <= 2 * nt {
            return Err(super::shape_err(
                "window",
                format!(
                    "is {} × {n}; expected {n_c} sites and more than {} samples",
                    x.nrows(),
                    2 * nt
                ),
            ));
        }
        self.buffers(n);
        let xres = self.upload(x);
        if self.run(xres, n)? {
            self.own_spikes()
        } else {
            super::match_window(&self.setup, x)
        }
    }

    /// [`GpuMatcher::match_window`] on a window already on this matcher's
    /// device: `x` holds the preprocessed window, `n_c` × `n` f32 row-major
    /// (e.g. [`crate::detect::gpu::GpuDetector::preprocess_to_device`]'s
    /// buffer, on the same device). The window is copied on the device into
    /// the matcher's own buffer, so `x` is left as it was.
    ///
    /// # Errors
    /// [`MatchError::Shape`] when `n` is not above 2·nt; [`MatchError::Device`]
    /// when a read back fails.
    pub fn match_device(&mut self, x: &Handle, n: usize) -> Result<WindowSpikes, MatchError> {
        if self.run_copy(x, n)? {
            self.own_spikes()
        } else {
            let host = self.read_window(x, n)?;
            super::match_window(&self.setup, host.view())
        }
    }

    /// [`GpuMatcher::match_device`] with the window's download left in
    /// flight: it completes while the next window's kernels run, and its
    /// spikes come from [`GpuMatcher::take_done`] once the next window is
    /// queued, or from [`GpuMatcher::flush`]. Windows come out in the order
    /// they were queued, with the same spikes as one at a time; a window
    /// that overflows the device's spike capacity is matched on the CPU in
    /// its turn. `x` may be freed when this returns (the device runs its
    /// work in order).
    ///
    /// # Errors
    /// As [`GpuMatcher::match_device`]; a failed read of the previous
    /// window's download is reported here.
    pub fn queue_device(&mut self, x: &Handle, n: usize) -> Result<(), MatchError> {
        if !self.run_copy(x, n)? {
            let host = self.read_window(x, n)?;
            let spikes = super::match_window(&self.setup, host.view())?;
            self.done.push_back(spikes);
        }
        Ok(())
    }

    /// [`GpuMatcher::match_device_in_place`] with the download left in
    /// flight, as [`GpuMatcher::queue_device`]: `false` when the device's
    /// spike capacity overflows (nothing is queued; the caller restores the
    /// window and queues it with [`GpuMatcher::queue_device`]).
    ///
    /// # Errors
    /// As [`GpuMatcher::queue_device`].
    pub fn queue_device_in_place(&mut self, x: &Handle, n: usize) -> Result<bool, MatchError> {
        self.check_samples(n)?;
        self.buffers(n);
        let before = self.lap();
        if let Some(p) = self.profile.as_mut() {
            p.before += before;
        }
        self.run(x.clone(), n)
    }

    /// The spikes of the queued windows whose downloads are done, in window
    /// order (after [`GpuMatcher::queue_device`] of window i: windows up to
    /// i − 1).
    pub fn take_done(&mut self) -> Vec<WindowSpikes> {
        self.done.drain(..).collect()
    }

    /// Waits for the last queued window's download and returns every
    /// window's spikes not yet taken, in window order.
    ///
    /// # Errors
    /// [`MatchError::Device`] when the read back fails.
    pub fn flush(&mut self) -> Result<Vec<WindowSpikes>, MatchError> {
        self.finish_pending()?;
        Ok(self.take_done())
    }

    /// Copies window `x` into the matcher's buffer and runs the peels there
    /// (`false`: the spike capacity overflowed).
    fn run_copy(&mut self, x: &Handle, n: usize) -> Result<bool, MatchError> {
        let (_, _, n_c) = self.setup.u.dim();
        self.check_samples(n)?;
        self.buffers(n);
        let before = self.lap();
        let xres = self.copy_on_device(x, n_c * n);
        let copy = self.lap();
        if let Some(p) = self.profile.as_mut() {
            p.before += before;
            p.copy += copy;
        }
        self.run(xres, n)
    }

    /// The spikes of the window just run (the last one queued), leaving
    /// earlier windows' spikes to [`GpuMatcher::take_done`].
    fn own_spikes(&mut self) -> Result<WindowSpikes, MatchError> {
        self.finish_pending()?;
        self.done
            .pop_back()
            .ok_or_else(|| self.device_err("a matched window's spikes are missing".into()))
    }

    /// [`GpuMatcher::match_device`] without the copy: the window's own buffer
    /// `x` becomes the residual (the window in it is overwritten). `None` when
    /// the device's spike capacity overflows: the caller then restores the
    /// window (e.g. [`crate::detect::gpu::GpuDetector::preprocess_last_again`])
    /// and calls [`GpuMatcher::match_device`], which ends on the CPU.
    ///
    /// # Errors
    /// As [`GpuMatcher::match_device`].
    pub fn match_device_in_place(
        &mut self,
        x: &Handle,
        n: usize,
    ) -> Result<Option<WindowSpikes>, MatchError> {
        if self.queue_device_in_place(x, n)? {
            self.own_spikes().map(Some)
        } else {
            Ok(None)
        }
    }

    /// The `n_c` × `n` window in device buffer `x`, read back.
    fn read_window(&self, x: &Handle, n: usize) -> Result<ndarray::Array2<f32>, MatchError> {
        let n_c = self.setup.u.dim().2;
        let out = self.client.read(vec![x.clone()]);
        let v = f32::from_bytes(&out[0]);
        if v.len() < n_c * n {
            return Err(self.device_err(format!(
                "window read back {} of {} values",
                v.len(),
                n_c * n
            )));
        }
        Ok(
            ndarray::Array2::from_shape_vec((n_c, n), v[..n_c * n].to_vec())
                .expect("length checked"),
        )
    }

    /// The peels of the window in `xres` (`n` samples; it becomes the
    /// residual), then its features and download queued
    /// ([`GpuMatcher::queue_download`]); the previous window's download is
    /// waited for once this window's first peels are queued, so that it
    /// overlaps them. `false` when the device's spike capacity overflows
    /// (nothing queued; the caller then matches the window on the CPU).
    fn run(&mut self, xres: Handle, n: usize) -> Result<bool, MatchError> {
        let state = self.client.create_from_slice(bytes_u32(&[0u32; S_LEN]));
        self.lap();
        self.launch_filter(&xres, n);
        let filter = self.lap();
        self.launch_product(n);
        let product = self.lap();
        self.launch_best_dense(n);
        let best = self.lap();
        let mut reads = 0;
        let mut launch_s = 0.0;
        let max_peels = self.setup.settings.max_peels;
        let every = self.options.peels_per_check.max(1);
        let (mut batch, follow_up) = match (self.options.peels_from_last, self.last_peels) {
            (true, Some(last)) => (last + 1, FOLLOW_UP_PEELS),
            (true, None) => (every, FOLLOW_UP_PEELS),
            (false, _) => (every, every),
        };
        let mut st = [0u32; S_LEN];
        let mut peel = 0;
        while peel < max_peels {
            let end = (peel + batch).min(max_peels);
            batch = follow_up;
            let launching = std::time::Instant::now();
            for p in peel..end {
                self.launch_peel(&xres, &state, n, p);
            }
            launch_s += launching.elapsed().as_secs_f64();
            peel = end;
            if reads == 0 {
                self.finish_pending()?;
            }
            st = self.read_state(&state)?;
            reads += 1;
            if st[S_STOP] != 0 {
                break;
            }
        }
        if st[S_OVERFLOW] != 0 {
            self.warn_overflow(n);
            return Ok(false);
        }
        let count = st[S_TOTAL] as usize;
        let peels = st[S_PEELS] as usize;
        self.last_peels = Some(peels);
        let peels_s = self.lap();
        if let Some(p) = self.profile.as_mut() {
            p.windows += 1;
            p.peels += peels;
            p.state_reads += reads;
            p.filter += filter;
            p.product += product;
            p.best_dense += best;
            p.peels_s += peels_s;
            p.peel_launch += launch_s;
        }
        self.queue_download(&xres, n, count, peels)?;
        Ok(true)
    }

    /// The matcher's own window buffer (C × N f32 of the window's length),
    /// made on first use.
    fn window_x(&mut self) -> Handle {
        let len = self.setup.u.dim().2 * self.window.as_ref().expect("allocated").n;
        let client = &self.client;
        let w = self.window.as_mut().expect("allocated");
        w.x.get_or_insert_with(|| client.empty(len.max(1) * 4))
            .clone()
    }

    /// Copies window `x` into the persistent window buffer. CubeCL 0.10's
    /// `create_from_slice` stages its input on the host: a whole 92 MB
    /// window that way took about 0.2 s on the H200 machine, against a few ms
    /// of kernels, so the window goes in pieces of
    /// [`crate::detect::gpu::upload::CHUNK`] floats (whose staging memory the
    /// pools reuse), each copied into place by a kernel, as detection's
    /// upload does.
    fn upload(&mut self, x: ArrayView2<f32>) -> Handle {
        let xs = x.as_standard_layout();
        let xs = xs.as_slice().expect("standard layout");
        let dst = self.window_x();
        let chunk = crate::detect::gpu::upload::CHUNK;
        for (i, part) in xs.chunks(chunk).enumerate() {
            let src = self.client.create_from_slice(bytes_f32(part));
            // SAFETY: the kernel writes dst[offset + j] for j < len = part.len(),
            // and offset + len ≤ xs.len(), the buffer's length.
            unsafe {
                crate::detect::gpu::upload::copy_chunk_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(part.len().div_ceil(256) as u32, 1, 1),
                    CubeDim::new_1d(256),
                    ArrayArg::from_raw_parts(src, part.len()),
                    ArrayArg::from_raw_parts(dst.clone(), xs.len()),
                    (i * chunk) as u32,
                    part.len() as u32,
                );
            }
        }
        dst
    }

    /// Copies the `len` floats of device buffer `src` into the persistent
    /// window buffer, bits unchanged
    /// ([`crate::detect::gpu::upload::copy_on_device`]).
    fn copy_on_device(&mut self, src: &Handle, len: usize) -> Handle {
        let dst = self.window_x();
        crate::detect::gpu::upload::copy_on_device(&self.client, src, &dst, len);
        dst
    }

    fn read_state(&self, state: &Handle) -> Result<[u32; S_LEN], MatchError> {
        let out = self.client.read(vec![state.clone()]);
        let v = u32::from_bytes(&out[0]);
        let mut st = [0u32; S_LEN];
        if v.len() < S_LEN {
            return Err(self.device_err(format!("state read back {} words", v.len())));
        }
        st.copy_from_slice(&v[..S_LEN]);
        Ok(st)
    }

    /// Launches the features and queues the one download of the window's
    /// spikes (waited for by [`GpuMatcher::finish_pending`]); a window with
    /// no spike goes straight to the done queue. No download is pending
    /// here: [`GpuMatcher::run`] waits for the previous one first.
    fn queue_download(
        &mut self,
        xres: &Handle,
        n: usize,
        count: usize,
        peels: usize,
    ) -> Result<(), MatchError> {
        debug_assert!(self.pending.is_none());
        if count == 0 {
            self.done.push_back(WindowSpikes {
                peels,
                ..WindowSpikes::default()
            });
            return Ok(());
        }
        let (_, npc, n_c) = self.setup.u.dim();
        let nc = self.setup.icc.nrows();
        let nt = self.setup.settings.nt;
        let w = self.window.as_ref().expect("allocated");
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let total = count * nc * npc;
        // SAFETY: spikes lie in nt ≤ col < n − nt, so col ± nt/2 is inside the
        // window; sites and templates index the uploaded arrays' lengths.
        unsafe {
            kernels::features_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(total.div_ceil(UNITS) as u32, 1, 1),
                CubeDim::new_1d(UNITS as u32),
                arr(xres, n_c * n),
                arr(&self.wpca, npc * nt),
                arr(&self.u_all, self.setup.u.len()),
                arr(&self.icc, self.setup.icc.len()),
                arr(&self.iu, self.setup.iu.len()),
                arr(&w.col, w.cap),
                arr(&w.tmpl, w.cap),
                arr(&w.amp, w.cap),
                arr(&w.tf, w.cap * nc * npc),
                n as u32,
                count as u32,
                n_c as u32,
                NEG_ZERO,
                nc,
                npc,
                nt,
            );
        }
        let features = self.lap();
        let part =
            |h: &Handle, used: usize, cap: usize| h.clone().offset_end(((cap - used) * 4) as u64);
        let w = self.window.as_ref().expect("allocated");
        // The copies are queued behind the features kernel; the next
        // window's kernels, queued after them, run while they complete.
        let read = self.reader.read_async(vec![
            part(&w.col, count, w.cap),
            part(&w.tmpl, count, w.cap),
            part(&w.amp, count, w.cap),
            part(&w.cf, count, w.cap),
            part(&w.tf, total, w.cap * nc * npc),
        ]);
        self.pending = Some(Pending {
            read: Box::pin(read),
            count,
            total,
            peels,
        });
        if let Some(p) = self.profile.as_mut() {
            p.features += features;
        }
        // The profile times each phase alone.
        if self.profile.is_some() {
            self.finish_pending()?;
        }
        Ok(())
    }

    /// Waits for the pending download, if any, and puts its window's spikes
    /// on the done queue.
    fn finish_pending(&mut self) -> Result<(), MatchError> {
        let Some(pending) = self.pending.take() else {
            return Ok(());
        };
        let t0 = std::time::Instant::now();
        let Pending {
            read,
            count,
            total,
            peels,
        } = pending;
        let data = cubecl::future::block_on(read)
            .map_err(|e| self.device_err(format!("spikes read back: {e:?}")))?;
        let nc_npc = self.setup.icc.nrows() * self.setup.u.dim().1;
        if data.len() < 5 {
            return Err(self.device_err(format!("read back {} of 5 arrays", data.len())));
        }
        let col = u32::from_bytes(&data[0]);
        let tmpl = u32::from_bytes(&data[1]);
        let amp = f32::from_bytes(&data[2]);
        let cf = f32::from_bytes(&data[3]);
        let tf = f32::from_bytes(&data[4]);
        if col.len() < count
            || tmpl.len() < count
            || amp.len() < count
            || cf.len() < count
            || tf.len() < total
        {
            return Err(self.device_err(format!(
                "read back {} of {count} spikes",
                col.len().min(tf.len() / nc_npc.max(1))
            )));
        }
        self.done.push_back(WindowSpikes {
            col: col[..count].to_vec(),
            template: tmpl[..count].to_vec(),
            amp: amp[..count].to_vec(),
            th_amp: cf[..count].iter().map(|v| v.sqrt()).collect(),
            tf: tf[..total].to_vec(),
            peels,
        });
        if let Some(p) = self.profile.as_mut() {
            p.download += t0.elapsed().as_secs_f64();
            p.clock = std::time::Instant::now();
        }
        Ok(())
    }

    /// F = wPCA ⋆ X on the used sites.
    fn launch_filter(&self, xres: &Handle, n: usize) {
        let (_, npc, n_c) = self.setup.u.dim();
        let nt = self.setup.settings.nt;
        let w = self.window.as_ref().expect("allocated");
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        if self.n_used == 0 {
            return;
        }
        // SAFETY: the filter reads X inside 0..n (zero padding) and writes F's
        // n_used·npc rows.
        unsafe {
            if self.options.simple_kernels.0 {
                simple::filter_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(n.div_ceil(UNITS) as u32, self.n_used as u32, 1),
                    CubeDim::new_1d(UNITS as u32),
                    arr(xres, n_c * n),
                    arr(&self.wpca, npc * nt),
                    arr(&self.sites, self.n_used),
                    arr(&w.f, self.n_used * npc * n),
                    n as u32,
                    NEG_ZERO,
                    npc,
                    nt,
                );
            } else {
                kernels::filter_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(
                        n.div_ceil(kernels::FILTER_R * UNITS) as u32,
                        self.n_used as u32,
                        1,
                    ),
                    CubeDim::new_1d(UNITS as u32),
                    arr(xres, n_c * n),
                    arr(&self.wpca, npc * nt),
                    arr(&self.sites, self.n_used),
                    arr(&w.f, self.n_used * npc * n),
                    n as u32,
                    NEG_ZERO,
                    npc,
                    nt,
                    kernels::FILTER_R,
                );
            }
        }
    }

    /// B = U·F over the template blocks.
    fn launch_product(&self, n: usize) {
        let (k, npc, _) = self.setup.u.dim();
        let w = self.window.as_ref().expect("allocated");
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let nb = k.div_ceil(KB);
        if self.n_used == 0 {
            return;
        }
        // SAFETY: the product reads the block lists built for F's rows and
        // writes B, K × n.
        unsafe {
            kernels::product_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(n.div_ceil(TT) as u32, nb as u32, 1),
                CubeDim::new_1d(UNITS as u32),
                arr(&w.f, self.n_used * npc * n),
                arr(&self.blk_off, nb + 1),
                arr(&self.blk_slot, self.n_blk_entries.max(1)),
                arr(&self.blk_u, (self.n_blk_entries * KB * npc).max(1)),
                arr(&w.b, k * n),
                n as u32,
                k as u32,
                NEG_ZERO,
                npc,
            );
        }
    }

    fn launch_best_dense(&self, n: usize) {
        let k = self.setup.u.dim().0;
        let w = self.window.as_ref().expect("allocated");
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        // SAFETY: units with a sample below n read B (K × n) and write it; the others only meet the barriers.
        unsafe {
            if self.options.simple_kernels.1 {
                simple::best_dense_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(n.div_ceil(UNITS) as u32, 1, 1),
                    CubeDim::new_1d(UNITS as u32),
                    arr(&w.b, k * n),
                    arr(&self.nm, k),
                    arr(&w.cfmax, n),
                    arr(&w.imax, n),
                    n as u32,
                    k as u32,
                    self.setup.settings.nt as u32,
                );
            } else {
                kernels::best_dense_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(n.div_ceil(BEST_LANES) as u32, 1, 1),
                    CubeDim::new_2d(BEST_LANES as u32, BEST_SLICES as u32),
                    arr(&w.b, k * n),
                    arr(&self.nm, k),
                    arr(&w.cfmax, n),
                    arr(&w.imax, n),
                    n as u32,
                    k as u32,
                    self.setup.settings.nt as u32,
                );
            }
        }
    }

    /// One peel's launches (peaks, compaction, both halves' subtraction, Cf
    /// again around the spikes); they do nothing once the state says stop.
    fn launch_peel(&self, xres: &Handle, state: &Handle, n: usize, peel: usize) {
        let (k, npc, n_c) = self.setup.u.dim();
        let s = &self.setup.settings;
        let nt = s.nt;
        let nl = 2 * nt + 1;
        let w = self.window.as_ref().expect("allocated");
        let nb = n.div_ceil(UNITS);
        let th2 = (s.th_learned * s.th_learned) as f32;
        let arr = |h: &Handle, len: usize| unsafe { ArrayArg::from_raw_parts(h.clone(), len) };
        let per_peel = (n / (nt + 1) + 1).min(4096);
        let precomputed = self.setup.ctc_precomputed();
        let first = peel == 0;
        self.mark(None, first);
        // SAFETY: flags and ranks cover 0..n; spikes lie in nt ≤ col < n − nt,
        // so every range col ± nt (B) and col ± nt/2 (X) is inside the window;
        // spike indices stay below cap (the offsets kernel stops before).
        unsafe {
            kernels::flags_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(nb as u32, 1, 1),
                CubeDim::new_1d(UNITS as u32),
                arr(&w.cfmax, n),
                arr(state, S_LEN),
                arr(&w.flags, n),
                arr(&w.lrank, n),
                arr(&w.bcount, nb),
                n as u32,
                nt as u32,
                th2,
            );
            self.mark(Some("flags"), first);
            kernels::offsets_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(UNITS as u32),
                arr(&w.bcount, nb),
                arr(&w.boff, nb),
                arr(state, S_LEN),
                nb as u32,
                peel as u32,
                w.cap as u32,
            );
            self.mark(Some("offsets"), first);
            kernels::write_kernel::launch_unchecked::<R>(
                &self.client,
                CubeCount::Static(nb as u32, 1, 1),
                CubeDim::new_1d(UNITS as u32),
                arr(&w.flags, n),
                arr(&w.lrank, n),
                arr(&w.boff, nb),
                arr(&w.cfmax, n),
                arr(&w.imax, n),
                arr(&w.b, k * n),
                arr(&self.nm, k),
                arr(state, S_LEN),
                arr(&w.col, w.cap),
                arr(&w.tmpl, w.cap),
                arr(&w.amp, w.cap),
                arr(&w.cf, w.cap),
                n as u32,
                w.cap as u32,
            );
            self.mark(Some("write"), first);
            let (sub_x, sub_y, best_x) = peel_grid(per_peel, first, self.options.peel_grid);
            for parity in 0..2u32 {
                kernels::subtract_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(sub_x, sub_y, 1),
                    CubeDim::new_1d(UNITS as u32),
                    arr(state, S_LEN),
                    arr(&w.col, w.cap),
                    arr(&w.tmpl, w.cap),
                    arr(&w.amp, w.cap),
                    arr(&self.pk_off, k + 1),
                    arr(&self.pk_k, self.n_pairs.max(1)),
                    arr(&self.pairs, self.pairs_len.max(1)),
                    arr(&self.wtw, npc * npc * nl),
                    arr(&self.sup_off, k + 1),
                    arr(&self.sup_site, self.n_sup.max(1)),
                    arr(&self.wave, (self.n_sup * nt).max(1)),
                    arr(&w.b, k * n),
                    arr(xres, n_c * n),
                    n as u32,
                    parity,
                    NEG_ZERO,
                    nt,
                    npc,
                    precomputed,
                );
                self.mark(
                    Some(if parity == 0 {
                        "subtract even"
                    } else {
                        "subtract odd"
                    }),
                    first,
                );
            }
            if self.options.simple_kernels.1 {
                simple::best_sparse_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(per_peel as u32, 1, 1),
                    CubeDim::new_1d(128),
                    arr(&w.b, k * n),
                    arr(&self.nm, k),
                    arr(state, S_LEN),
                    arr(&w.col, w.cap),
                    arr(&w.cfmax, n),
                    arr(&w.imax, n),
                    n as u32,
                    k as u32,
                    nt as u32,
                );
            } else {
                kernels::best_sparse_kernel::launch_unchecked::<R>(
                    &self.client,
                    CubeCount::Static(best_x, nl.div_ceil(BEST_LANES) as u32, 1),
                    CubeDim::new_2d(BEST_LANES as u32, BEST_SLICES as u32),
                    arr(&w.b, k * n),
                    arr(&self.nm, k),
                    arr(state, S_LEN),
                    arr(&w.col, w.cap),
                    arr(&w.cfmax, n),
                    arr(&w.imax, n),
                    n as u32,
                    k as u32,
                    nt as u32,
                );
            }
            self.mark(Some("best sparse"), first);
        }
    }
}
