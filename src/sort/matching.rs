//! Learned-template matching on the CPU (Kilosort4 4.1.7
//! `template_matching.extract`, `prepare_extract`, `prepare_matching`,
//! `run_matching`; `shared/docs/sorting-spec.md` §2.5).
//!
//! Per window X (C sites × NT samples, preprocessed and drift-corrected):
//!
//! 1. B\[k, t\] = Σ_{c,p} U\[k, p, c\]·(X_c ⋆ wPCA_p)\[t\] (correlation, zero
//!    padding nt/2), nm\[k\] = ‖U_k‖²;
//! 2. each peel: Cf = relu(B)²/nm, zero in the first and last nt columns;
//!    the best template per sample (first on ties); spikes are the samples
//!    whose best Cf exceeds `Th_learned`² and is the largest within ±nt; each
//!    gets amp = B/nm and √Cf; amp × the templates' cross-correlations are
//!    subtracted from B and amp × the waveform from the residual, first for
//!    the even-numbered spikes, then for the odd ones;
//! 3. up to `max_peels` peels; then the features of every spike from the
//!    final residual on the 10 sites `iCC[:, iU[template]]`, plus amp × the
//!    template's own PCs there.
//!
//! Exactness and order: every sum is float32 in a fixed order (the filter
//! and the product over sites: sequential; template products and features:
//! float64, rounded once), so a window's spikes do not depend on the thread
//! count. Against Kilosort4 the floats differ by rounding only (its sums run
//! in BLAS/oneDNN order); a spike can differ only where that rounding moves
//! a comparison (a Cf within rounding of `Th_learned`², or two equal maxima).
//!
//! Measured against Kilosort4 4.1.7's `extract` (`tests/matching.rs`): on
//! its own windows (synthetic unit case, 118 spikes) and on windows
//! preprocessed here with its `Wrot` (Open Ephys example, 1 555 spikes;
//! 30-s 32-site simulation, 15 791 spikes) every spike has the same sample
//! and template, √Cf within 1.5e-6 relative and tF within 2e-5 absolute (the
//! part beyond 4e-6 comes from the preprocessing, not the matching).
//!
//! Where the order can differ from Kilosort4 (only on exact float ties):
//! * `iCC` distance ties go to the lower site index ([`nearest_sites`]);
//!   numpy's unstable sort orders them by CPU code path, so
//!   [`MatchingSetup::with_icc`] takes Kilosort4's own;
//! * spikes at the same sample (different peels) keep their peel order in
//!   the final stable sort; `np.argsort` leaves their order unspecified;
//! * two spikes of one half-peel with overlapping ranges (possible only when
//!   two Cf maxima within nt are exactly equal): the later one's write wins;
//! * Kilosort4 stops with an error past 100 000 spikes in one window; here
//!   there is no cap. `batch_downsampling` is not supported (it is 1).
//!
//! Work saved without changing any result: sites where a template is zero
//! are skipped (their products are exact zeros); after the first peel only
//! samples within ±2·nt of the last peel's spikes are examined again (elsewhere
//! neither B nor the pooled maximum changed).
//!
//! Memory: B is K × NT float32 (K·NT·4 B: 96 MB for K = 400 at NT = 60 122),
//! the residual C × NT, both kept by the set-up for its next window; the
//! filtered window is made per block of [`TILE`] samples (C·npc·TILE·4 B per
//! thread). Template cross-correlations are kept
//! only for pairs of templates that share a site: precomputed (`2nt + 1`
//! floats per pair) while that fits in [`MatchingSettings::ctc_budget_bytes`],
//! otherwise only the pairs' `UtU` (npc² floats, 144 B per pair; at most
//! K²·144 B = 576 MB for K = 2000 when every pair shares a site) and each
//! spike's cross-correlations are made when it is subtracted. Kilosort4's
//! K² × (2nt + 1) tensor (`ctc`, 1.97 GB at K = 2000) is never made.

use ndarray::{Array2, Array3, ArrayView2, ArrayView3};
use rayon::prelude::*;

use super::templates::{support, wtw};

pub mod backend;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod gpu;
#[cfg(test)]
mod tests;

/// Samples per block of the filter product (its unit of parallel work): a
/// block's filtered sites (sites × npc × TILE float32) stay in cache while
/// the templates' products read them.
pub const TILE: usize = 64;

/// Settings of the matching pass, named and defaulted as in Kilosort4 4.1.7.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct MatchingSettings {
    /// `Th_learned`: a spike needs relu(B)²/‖U‖² above its square. Default 8.
    #[serde(rename = "Th_learned")]
    pub th_learned: f64,
    /// `max_peels`: peels per window. Default 100.
    pub max_peels: usize,
    /// `nearest_chans`: sites per spike feature (`iCC` rows). Default 10.
    pub nearest_chans: usize,
    /// `position_limit`, µm: `iCC_mask` marks sites nearer than this. Default 100.
    pub position_limit: f64,
    /// `nt`: waveform length and window pad, samples. Default 61.
    pub nt: usize,
    /// `nt0min`: trough sample within the waveform. Default 20.
    pub nt0min: usize,
    /// `batch_size`: own samples per window. Default 60 000.
    pub batch_size: usize,
    /// Bytes the precomputed template cross-correlations may take; above,
    /// they are made per spike. Not a Kilosort4 setting. Default 512 MiB.
    pub ctc_budget_bytes: usize,
}

impl Default for MatchingSettings {
    fn default() -> Self {
        MatchingSettings {
            th_learned: 8.0,
            max_peels: 100,
            nearest_chans: 10,
            position_limit: 100.0,
            nt: 61,
            nt0min: 20,
            batch_size: 60_000,
            ctc_budget_bytes: 512 << 20,
        }
    }
}

/// Bad inputs to the matching pass.
#[derive(Debug, thiserror::Error)]
pub enum MatchError {
    /// A setting out of range.
    #[error("setting {name}: {message}")]
    Setting {
        /// The setting's Kilosort4 name.
        name: &'static str,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// Arrays whose shapes do not fit together.
    #[error("{what}: {message}")]
    Shape {
        /// Which array.
        what: &'static str,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// The GPU failed (a device error or a read back that did not complete).
    #[error("matching on {device}: {message}")]
    Device {
        /// The device's name.
        device: String,
        /// What failed.
        message: String,
    },
}

fn shape_err(what: &'static str, message: String) -> MatchError {
    MatchError::Shape { what, message }
}

/// Cross-correlations of the templates that share a site with one template.
#[derive(Debug, Clone)]
struct Partners {
    /// Templates k sharing a site with this one (itself included), ascending.
    k: Vec<u32>,
    /// Per partner, `UtU[k, j]` (npc × npc, a-major): Σ_c U\[k, a, c\]·U\[j, b, c\].
    utu: Vec<f32>,
    /// Per partner, `ctc[k, j, :]` (2nt + 1), when precomputed.
    ctc: Option<Vec<f32>>,
    /// The [`GroupBest`] groups of `k`, ascending.
    groups: Vec<u32>,
}

/// Everything the matching needs that does not change between windows
/// (`prepare_extract` and `prepare_matching`).
#[derive(Debug, Clone)]
pub struct MatchingSetup {
    settings: MatchingSettings,
    /// K × npc × C templates (`Wall3`).
    u: Array3<f32>,
    wpca: Array2<f32>,
    wtw: Array3<f32>,
    /// ‖U_k‖², K values.
    nm: Vec<f32>,
    /// Sites of each template's non-zero coefficients.
    support: Vec<Vec<u32>>,
    /// Each template's waveform on its support sites (|support| × nt, site-major).
    wave: Vec<Vec<f32>>,
    partners: Vec<Partners>,
    icc: Array2<u32>,
    icc_mask: Array2<bool>,
    iu: Vec<u32>,
    /// The last window's B and residual buffers, reused by the next.
    scratch: Scratch,
}

/// Buffers of finished windows kept for the next ones (B: NT × K, the
/// residual: C × NT, float32), so that a window does not map and fault in
/// ~190 MB afresh (K = 400, C = 384). Each slot holds up to
/// [`Scratch::KEPT`] buffers, one for each window matched at the same time
/// ([`crate::sort::matching`]'s callers may match several windows at once).
/// Every buffer is overwritten entirely before it is read. A clone of the
/// set-up starts with none.
#[derive(Debug, Default)]
struct Scratch {
    b: std::sync::Mutex<Vec<Vec<f32>>>,
    x: std::sync::Mutex<Vec<Vec<f32>>>,
}

impl Clone for Scratch {
    fn clone(&self) -> Self {
        Scratch::default()
    }
}

impl Scratch {
    /// Buffers kept per slot: more windows at once than this allocate their own.
    const KEPT: usize = 8;

    /// A buffer of `len` floats with unspecified contents, a kept one if
    /// there is one.
    fn take(slot: &std::sync::Mutex<Vec<Vec<f32>>>, len: usize) -> Vec<f32> {
        let mut v = slot
            .lock()
            .ok()
            .and_then(|mut g| g.pop())
            .unwrap_or_default();
        if v.len() >= len {
            v.truncate(len);
        } else {
            v = vec![0f32; len];
        }
        v
    }

    /// Keeps `v` in `slot` for a later window (unless the slot is full).
    fn give(slot: &std::sync::Mutex<Vec<Vec<f32>>>, v: Vec<f32>) {
        if let Ok(mut g) = slot.lock()
            && g.len() < Self::KEPT
        {
            g.push(v);
        }
    }
}

/// The spikes of one window, in the order found (peel by peel, by sample).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WindowSpikes {
    /// Window column of each spike's template centre (nt ≤ col < NT − nt).
    pub col: Vec<u32>,
    /// Template index (0 … K − 1).
    pub template: Vec<u32>,
    /// Fitted amplitude B/nm (float32), used for the features.
    pub amp: Vec<f32>,
    /// √(pooled Cf), Kilosort4's `st[:, 2]`.
    pub th_amp: Vec<f32>,
    /// Features, n × nC × npc row-major (`tF` rows).
    pub tf: Vec<f32>,
    /// Peels run (1 … `max_peels`; the last may have found none).
    pub peels: usize,
}

impl WindowSpikes {
    /// Number of spikes.
    pub fn len(&self) -> usize {
        self.col.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.col.is_empty()
    }
}

/// The whole pass's output (`extract`'s return values and the `ops` it sets).
#[derive(Debug, Clone)]
pub struct Extracted {
    /// n × 3 float64: sample (relative to the first window's first own sample,
    /// at the trough: template centre − nt/2 + nt0min), template, √Cf.
    pub st: Array2<f64>,
    /// n × nC × npc float32 features.
    pub tf: Array3<f32>,
    /// nC × C: each site's nearest sites (`iCC`).
    pub icc: Array2<u32>,
    /// nC × C: whether that neighbour is within `position_limit` (`iCC_mask`).
    pub icc_mask: Array2<bool>,
    /// K: each template's site of largest energy (`iU`).
    pub iu: Vec<u32>,
}

impl MatchingSetup {
    /// `prepare_extract` + `prepare_matching`: from `Wall3` (K × npc × C),
    /// `wPCA` (npc × nt) and the site positions (µm, C each).
    ///
    /// `iCC` takes each site's nC nearest sites by squared distance (float32,
    /// as Kilosort4 computes it), ties to the lower index; Kilosort4's numpy
    /// sort breaks ties in a CPU-dependent order, so [`MatchingSetup::with_icc`]
    /// can impose its `iCC`.
    ///
    /// # Errors
    /// [`MatchError::Setting`] for `Th_learned` ≤ 0 or not finite, `max_peels`
    /// 0, `nt` even or unlike wPCA, `nt0min` ≥ `nt`, `nearest_chans` 0 or above
    /// C; [`MatchError::Shape`] when the arrays disagree or there is no template.
    pub fn new(
        wall3: ArrayView3<f32>,
        wpca: ArrayView2<f32>,
        xc: &[f32],
        yc: &[f32],
        settings: &MatchingSettings,
    ) -> Result<Self, MatchError> {
        let (k, npc, n_c) = wall3.dim();
        check_settings(settings, wpca, n_c)?;
        if wpca.nrows() != npc {
            return Err(shape_err(
                "Wall3",
                format!("has {npc} PCs, wPCA {} rows", wpca.nrows()),
            ));
        }
        if xc.len() != n_c || yc.len() != n_c {
            return Err(shape_err(
                "site positions",
                format!("{} x and {} y for {n_c} sites", xc.len(), yc.len()),
            ));
        }
        if k == 0 {
            return Err(shape_err("Wall3", "has no template".into()));
        }
        let u = wall3.to_owned();
        let nt = settings.nt;
        let support: Vec<Vec<u32>> = (0..k)
            .map(|j| support(u.slice(ndarray::s![j, .., ..])))
            .collect();
        let nm: Vec<f32> = (0..k)
            .map(|j| {
                let s: f64 = u
                    .slice(ndarray::s![j, .., ..])
                    .iter()
                    .map(|&v| f64::from(v).powi(2))
                    .sum();
                s as f32
            })
            .collect();
        if let Some(j) = nm.iter().position(|&v| !(v > 0.0 && v.is_finite())) {
            return Err(shape_err(
                "Wall3",
                format!("template {j} has norm² {} (zero or not finite)", nm[j]),
            ));
        }
        let wave = (0..k)
            .into_par_iter()
            .map(|j| {
                let mut w = Vec::with_capacity(support[j].len() * nt);
                for &c in &support[j] {
                    for i in 0..nt {
                        let mut acc = 0f64;
                        for p in 0..npc {
                            acc += f64::from(u[[j, p, c as usize]]) * f64::from(wpca[[p, i]]);
                        }
                        w.push(acc as f32);
                    }
                }
                w
            })
            .collect();
        let (icc, icc_mask) =
            nearest_sites(xc, yc, settings.nearest_chans, settings.position_limit);
        let iu = (0..k)
            .map(|j| {
                let mut best = (0u32, f32::NEG_INFINITY);
                for c in 0..n_c {
                    let e: f64 = (0..npc).map(|p| f64::from(u[[j, p, c]]).powi(2)).sum();
                    if (e as f32) > best.1 {
                        best = (c as u32, e as f32);
                    }
                }
                best.0
            })
            .collect();
        let wtw = wtw(wpca);
        let partners = partners(&u, &support, &wtw, settings.ctc_budget_bytes);
        Ok(MatchingSetup {
            settings: settings.clone(),
            u,
            wpca: wpca.to_owned(),
            wtw,
            nm,
            support,
            wave,
            partners,
            icc,
            icc_mask,
            iu,
            scratch: Scratch::default(),
        })
    }

    /// Replaces `iCC` (nC × C, e.g. Kilosort4's own, whose tie order depends on
    /// numpy's CPU path).
    ///
    /// # Errors
    /// [`MatchError::Shape`] when the shape differs or an entry is not a site.
    pub fn with_icc(mut self, icc: Array2<u32>) -> Result<Self, MatchError> {
        let n_c = self.u.dim().2;
        if icc.dim() != self.icc.dim() || icc.iter().any(|&c| c as usize >= n_c) {
            return Err(shape_err(
                "iCC",
                format!(
                    "is {:?}, expected {:?} with sites below {n_c}",
                    icc.dim(),
                    self.icc.dim()
                ),
            ));
        }
        self.icc = icc;
        Ok(self)
    }

    /// The settings.
    pub fn settings(&self) -> &MatchingSettings {
        &self.settings
    }

    /// K templates.
    pub fn n_templates(&self) -> usize {
        self.u.dim().0
    }

    /// `iCC` (nC × C).
    pub fn icc(&self) -> &Array2<u32> {
        &self.icc
    }

    /// `iCC_mask` (nC × C).
    pub fn icc_mask(&self) -> &Array2<bool> {
        &self.icc_mask
    }

    /// `iU` (K).
    pub fn iu(&self) -> &[u32] {
        &self.iu
    }

    /// Template pairs that share a site (the stored cross-correlations).
    pub fn n_pairs(&self) -> usize {
        self.partners.iter().map(|p| p.k.len()).sum()
    }

    /// Whether the cross-correlations are precomputed (else made per spike).
    pub fn ctc_precomputed(&self) -> bool {
        self.partners.iter().all(|p| p.ctc.is_some())
    }

    /// Bytes held by the set-up's per-pair arrays.
    pub fn pair_bytes(&self) -> usize {
        self.partners
            .iter()
            .map(|p| 4 * (p.k.len() + p.utu.len() + p.ctc.as_ref().map_or(0, Vec::len)))
            .sum()
    }

    /// `ctc[k, j, :]` for every partner k of template j, partner-major.
    fn ctc_of(&self, j: usize) -> std::borrow::Cow<'_, [f32]> {
        let p = &self.partners[j];
        match &p.ctc {
            Some(c) => std::borrow::Cow::Borrowed(c),
            None => std::borrow::Cow::Owned(ctc_from_utu(&p.utu, &self.wtw)),
        }
    }
}

fn check_settings(
    s: &MatchingSettings,
    wpca: ArrayView2<f32>,
    n_c: usize,
) -> Result<(), MatchError> {
    let bad = |name, message: String| Err(MatchError::Setting { name, message });
    if !(s.th_learned.is_finite() && s.th_learned > 0.0) {
        return bad(
            "Th_learned",
            format!("is {}; it must be positive", s.th_learned),
        );
    }
    if s.max_peels == 0 {
        return bad("max_peels", "is 0; it must be at least 1".into());
    }
    if s.nt.is_multiple_of(2) || s.nt != wpca.ncols() {
        return bad(
            "nt",
            format!(
                "is {}; it must be odd and equal wPCA's {} samples",
                s.nt,
                wpca.ncols()
            ),
        );
    }
    if s.nt0min >= s.nt {
        return bad(
            "nt0min",
            format!("is {}; it must be below nt = {}", s.nt0min, s.nt),
        );
    }
    if s.nearest_chans == 0 || s.nearest_chans > n_c {
        return bad(
            "nearest_chans",
            format!(
                "is {}; it must be 1 … {n_c} (the probe's sites)",
                s.nearest_chans
            ),
        );
    }
    if s.batch_size < s.nt {
        return bad(
            "batch_size",
            format!("is {}; it must be at least nt = {}", s.batch_size, s.nt),
        );
    }
    Ok(())
}

/// `iCC` and `iCC_mask`: per site (column), its `n` nearest sites by squared
/// distance in float32, ties to the lower index, and whether each lies within
/// `limit` µm.
pub fn nearest_sites(xc: &[f32], yc: &[f32], n: usize, limit: f64) -> (Array2<u32>, Array2<bool>) {
    let n_c = xc.len();
    let mut icc = Array2::<u32>::zeros((n, n_c));
    let mut mask = Array2::<bool>::from_elem((n, n_c), false);
    let lim2 = limit * limit;
    for b in 0..n_c {
        let d: Vec<f32> = (0..n_c)
            .map(|a| {
                let dx = xc[b] - xc[a];
                let dy = yc[b] - yc[a];
                dx * dx + dy * dy
            })
            .collect();
        let mut order: Vec<usize> = (0..n_c).collect();
        order.sort_by(|&p, &q| d[p].total_cmp(&d[q]));
        for r in 0..n {
            icc[[r, b]] = order[r] as u32;
            mask[[r, b]] = f64::from(d[order[r]]) < lim2;
        }
    }
    (icc, mask)
}

/// `ctc[k, j, :]` = Σ_{a,b} `UtU[k, j, a, b]`·`WtW[a, b, :]` for a list of
/// partners' UtU (npc² each), partner-major, float64 rounded once.
fn ctc_from_utu(utu: &[f32], wtw: &Array3<f32>) -> Vec<f32> {
    let (npc, _, nl) = wtw.dim();
    let n2 = npc * npc;
    let mut out = Vec::with_capacity(utu.len() / n2 * nl);
    for u in utu.chunks_exact(n2) {
        for l in 0..nl {
            let mut acc = 0f64;
            for a in 0..npc {
                for b in 0..npc {
                    acc += f64::from(u[a * npc + b]) * f64::from(wtw[[a, b, l]]);
                }
            }
            out.push(acc as f32);
        }
    }
    out
}

/// For every template j, the templates sharing a site with it and their `UtU`,
/// with `ctc` too when all of them fit in `budget` bytes.
fn partners(
    u: &Array3<f32>,
    support: &[Vec<u32>],
    wtw: &Array3<f32>,
    budget: usize,
) -> Vec<Partners> {
    let (k, npc, n_c) = u.dim();
    let mut by_site: Vec<Vec<u32>> = vec![Vec::new(); n_c];
    for (j, s) in support.iter().enumerate() {
        for &c in s {
            by_site[c as usize].push(j as u32);
        }
    }
    let mut list: Vec<Partners> = (0..k)
        .into_par_iter()
        .map(|j| {
            let mut ks: Vec<u32> = support[j]
                .iter()
                .flat_map(|&c| by_site[c as usize].iter().copied())
                .collect();
            ks.sort_unstable();
            ks.dedup();
            let mut utu = Vec::with_capacity(ks.len() * npc * npc);
            for &kk in &ks {
                for a in 0..npc {
                    for b in 0..npc {
                        let mut acc = 0f64;
                        for &c in &support[j] {
                            acc += f64::from(u[[kk as usize, a, c as usize]])
                                * f64::from(u[[j, b, c as usize]]);
                        }
                        utu.push(acc as f32);
                    }
                }
            }
            let mut groups: Vec<u32> = ks.iter().map(|&kk| kk / GROUP_K as u32).collect();
            groups.dedup();
            Partners {
                k: ks,
                utu,
                ctc: None,
                groups,
            }
        })
        .collect();
    let n_pairs: usize = list.iter().map(|p| p.k.len()).sum();
    if n_pairs.saturating_mul(4 * wtw.dim().2) <= budget {
        list.par_iter_mut()
            .for_each(|p| p.ctc = Some(ctc_from_utu(&p.utu, wtw)));
    }
    list
}

/// The vector instructions the hot loops are compiled for, chosen at run time
/// (the same operations in the same order on wider registers: the same bits;
/// multiplications and additions stay separate, Rust never fuses them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Simd {
    /// Baseline (SSE2 on x86-64) or another architecture.
    Base,
    /// AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512F.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    /// The widest the CPU has.
    fn detect() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            if crate::simd::avx512() {
                return Simd::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Simd::Avx2;
            }
        }
        Simd::Base
    }
}

/// What the filter product needs of the set-up, flattened for its loops.
struct FilterBank<'a> {
    /// Sites in some template's support, ascending.
    used: Vec<usize>,
    /// wPCA, npc × nt row-major.
    wpca: Vec<f32>,
    /// Per template, (row of the block's filtered sites, U coefficient) for
    /// each (support site, PC) in the order of its sum: sites as in the
    /// support, PCs ascending. The row is slot(site)·npc + PC.
    terms: Vec<Vec<(u32, f32)>>,
    npc: usize,
    nt: usize,
    x: ArrayView2<'a, f32>,
}

impl<'a> FilterBank<'a> {
    fn new(setup: &MatchingSetup, x: ArrayView2<'a, f32>) -> Self {
        let (k, npc, n_c) = setup.u.dim();
        let mut slot = vec![usize::MAX; n_c];
        for s in &setup.support {
            for &c in s {
                slot[c as usize] = 0;
            }
        }
        let used: Vec<usize> = (0..n_c).filter(|&c| slot[c] == 0).collect();
        for (i, &c) in used.iter().enumerate() {
            slot[c] = i;
        }
        let terms = (0..k)
            .map(|j| {
                let mut v = Vec::with_capacity(setup.support[j].len() * npc);
                for &c in &setup.support[j] {
                    for p in 0..npc {
                        let row = (slot[c as usize] * npc + p) as u32;
                        v.push((row, setup.u[[j, p, c as usize]]));
                    }
                }
                v
            })
            .collect();
        FilterBank {
            used,
            wpca: setup.wpca.iter().copied().collect(),
            terms,
            npc,
            nt: setup.settings.nt,
            x,
        }
    }
}

/// B (time-major, NT × K) of a window: the filter bank product, per block of
/// [`TILE`] samples.
///
/// Each B\[t, k\] is the float32 sum, starting from zero, over the template's
/// support sites (in support order) and PCs (ascending) of U·F, where F (the
/// filtered site) is itself the float32 sum, starting from zero, over the nt
/// taps (ascending) of x·wPCA with zeros outside the window. Blocks and
/// samples are independent, so their order and the vector width do not
/// change any bit.
fn filter_product(setup: &MatchingSetup, simd: Simd, x: ArrayView2<f32>) -> Vec<f32> {
    let k = setup.n_templates();
    let n = x.ncols();
    let bank = FilterBank::new(setup, x);
    let mut b = Scratch::take(&setup.scratch.b, n * k);
    let rows = bank.used.len() * bank.npc;
    b.par_chunks_mut(TILE * k).enumerate().for_each_init(
        || (vec![0f32; rows * TILE], vec![0f32; TILE + bank.nt - 1]),
        |(f, seg), (blk, out)| filter_block(simd, &bank, blk * TILE, out, f, seg),
    );
    b
}

/// [`filter_block_impl`] compiled for `simd`.
fn filter_block(
    simd: Simd,
    bank: &FilterBank,
    t0: usize,
    out: &mut [f32],
    f: &mut [f32],
    seg: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        // Six PCs from each loaded sample vector where there are six
        // (Kilosort4's default); else two PCs at a time fill AVX-512's
        // registers (8 running sums of 16 lanes) and one fills AVX2's.
        const SIX_512: SixPcs<ByPcs<2>> = SixPcs {
            simd: Simd::Avx512,
            fallback: ByPcs,
        };
        const SIX_256: SixPcs<ByPcs<1>> = SixPcs {
            simd: Simd::Avx2,
            fallback: ByPcs,
        };
        #[target_feature(enable = "avx512f")]
        fn avx512(bank: &FilterBank, t0: usize, out: &mut [f32], f: &mut [f32], seg: &mut [f32]) {
            filter_block_impl(bank, t0, out, f, seg, SIX_512);
        }
        #[target_feature(enable = "avx2")]
        fn avx2(bank: &FilterBank, t0: usize, out: &mut [f32], f: &mut [f32], seg: &mut [f32]) {
            filter_block_impl(bank, t0, out, f, seg, SIX_256);
        }
        match simd {
            // SAFETY: the CPU has AVX-512F (`Simd::detect`).
            Simd::Avx512 => return unsafe { avx512(bank, t0, out, f, seg) },
            // SAFETY: the CPU has AVX2 (`Simd::detect`).
            Simd::Avx2 => return unsafe { avx2(bank, t0, out, f, seg) },
            Simd::Base => {}
        }
    }
    let _ = simd;
    filter_block_impl(bank, t0, out, f, seg, ByPcs::<1>);
}

/// B for samples t0 … t0 + w − 1 (`out`: w × K, w ≤ [`TILE`]): first F of
/// every used site and PC over the block (`f`: rows × TILE), P PCs at a
/// time, then each template's sum of U·F, two templates at a time when their
/// sums have the same length. `seg` (TILE + nt − 1) holds one site's samples
/// with the block's ±nt/2 margins, zero outside the window.
#[inline(always)]
fn filter_block_impl(
    bank: &FilterBank,
    t0: usize,
    out: &mut [f32],
    f: &mut [f32],
    seg: &mut [f32],
    convs: impl SiteConv,
) {
    let nt = bank.nt;
    let npc = bank.npc;
    let half = nt / 2;
    let n = bank.x.ncols();
    let k = bank.terms.len();
    let w = out.len() / k;
    // seg[i] is sample t0 − nt/2 + i: those below a or from z on are outside.
    let a = half.saturating_sub(t0).min(seg.len());
    let z = (n + half).saturating_sub(t0).clamp(a, seg.len());
    for (si, &c) in bank.used.iter().enumerate() {
        // The block's samples of a site two ahead, asked for now: the sites'
        // rows are too many separate streams for the hardware prefetcher, and
        // each block needs only a few new cache lines of each.
        if let Some(r) = bank
            .used
            .get(si + 2)
            .and_then(|&s| bank.x.row(s).to_slice())
        {
            let lo = (t0 + a).saturating_sub(half).min(r.len());
            let hi = (t0 + z).saturating_sub(half).min(r.len());
            crate::prefetch::prefetch(&r[lo..hi]);
        }
        let row = bank.x.row(c);
        seg[..a].fill(0.0);
        seg[z..].fill(0.0);
        let first = t0 + a - half;
        match row.as_slice() {
            Some(r) => seg[a..z].copy_from_slice(&r[first..first + z - a]),
            None => {
                for (v, &xv) in seg[a..z].iter_mut().zip(row.iter().skip(first)) {
                    *v = xv;
                }
            }
        }
        convs.site(
            seg,
            &bank.wpca,
            npc,
            &mut f[si * npc * TILE..(si + 1) * npc * TILE],
        );
    }
    let row_of = |r: u32| -> &[f32; TILE] {
        let r = r as usize;
        f[r * TILE..(r + 1) * TILE]
            .try_into()
            .expect("TILE samples")
    };
    let mut j = 0;
    while j < k {
        let ta = &bank.terms[j];
        if j + 1 < k && bank.terms[j + 1].len() == ta.len() {
            let tb = &bank.terms[j + 1];
            let mut acc_a = [0f32; TILE];
            let mut acc_b = [0f32; TILE];
            for (&(ra, ua), &(rb, ub)) in ta.iter().zip(tb) {
                let (fa, fb) = (row_of(ra), row_of(rb));
                for l in 0..TILE {
                    acc_a[l] += ua * fa[l];
                    acc_b[l] += ub * fb[l];
                }
            }
            for t in 0..w {
                out[t * k + j] = acc_a[t];
                out[t * k + j + 1] = acc_b[t];
            }
            j += 2;
        } else {
            let mut acc = [0f32; TILE];
            for &(r, uv) in ta {
                for (s, &fv) in acc.iter_mut().zip(row_of(r)) {
                    *s += uv * fv;
                }
            }
            for (t, &v) in acc[..w].iter().enumerate() {
                out[t * k + j] = v;
            }
            j += 1;
        }
    }
}

/// F of every PC of one site over a block: `out[p·TILE + t]` (npc × TILE) =
/// the float32 sum, from zero, over the taps i ascending of
/// seg\[t + i\]·wPCA\[p, i\] (`wpca`: npc × nt). Implementations differ only
/// in how many sums share each loaded vector of samples: the same bits.
trait SiteConv: Copy {
    fn site(self, seg: &[f32], wpca: &[f32], npc: usize, out: &mut [f32]);
}

/// [`conv`] over P PCs at a time (the last ones one at a time).
#[derive(Clone, Copy)]
struct ByPcs<const P: usize>;

impl<const P: usize> SiteConv for ByPcs<P> {
    #[inline(always)]
    fn site(self, seg: &[f32], wpca: &[f32], npc: usize, out: &mut [f32]) {
        let nt = wpca.len() / npc;
        let mut p = 0;
        while p < npc {
            if p + P <= npc {
                conv::<P>(
                    seg,
                    &wpca[p * nt..(p + P) * nt],
                    &mut out[p * TILE..(p + P) * TILE],
                );
                p += P;
            } else {
                conv::<1>(
                    seg,
                    &wpca[p * nt..(p + 1) * nt],
                    &mut out[p * TILE..(p + 1) * TILE],
                );
                p += 1;
            }
        }
    }
}

/// Six PCs at once in the vectors of `simd` ([`conv6_avx512`],
/// [`conv6_avx2`]), the fallback for other counts (and for the baseline).
/// Made only inside a function compiled for `simd`, which `Simd::detect`
/// found on the CPU.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct SixPcs<F> {
    simd: Simd,
    fallback: F,
}

#[cfg(target_arch = "x86_64")]
impl<F: SiteConv> SiteConv for SixPcs<F> {
    #[inline(always)]
    fn site(self, seg: &[f32], wpca: &[f32], npc: usize, out: &mut [f32]) {
        match (npc, self.simd) {
            // SAFETY: `simd` was detected on this CPU (`filter_block`).
            (6, Simd::Avx512) => unsafe { conv6_avx512(seg, wpca, out) },
            // SAFETY: as above.
            (6, Simd::Avx2) => unsafe { conv6_avx2(seg, wpca, out) },
            _ => self.fallback.site(seg, wpca, npc, out),
        }
    }
}

/// [`SiteConv::site`] for six PCs on AVX-512: the whole block (four
/// 16-lane vectors) for all six PCs, 24 running sums in registers, so each
/// loaded sample vector serves six sums (two loads per PC and tap were the
/// limit of [`conv`]). Each sum is the same chain of separate multiplies and
/// adds in ascending tap order.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn conv6_avx512(seg: &[f32], wpca: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    const W: usize = 16;
    const V: usize = TILE / W;
    let nt = wpca.len() / 6;
    assert!(wpca.len() == 6 * nt && seg.len() + 1 >= TILE + nt && out.len() >= 6 * TILE);
    let sp = seg.as_ptr();
    let mut acc = [[_mm512_setzero_ps(); V]; 6];
    for i in 0..nt {
        let mut x = [_mm512_setzero_ps(); V];
        for (v, xv) in x.iter_mut().enumerate() {
            // SAFETY: i + v·W + W ≤ nt − 1 + TILE ≤ seg.len() (asserted).
            *xv = unsafe { _mm512_loadu_ps(sp.add(i + v * W)) };
        }
        for (q, aq) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(wpca[q * nt + i]);
            for (a, &xv) in aq.iter_mut().zip(&x) {
                *a = _mm512_add_ps(*a, _mm512_mul_ps(xv, w));
            }
        }
    }
    let op = out.as_mut_ptr();
    for (q, aq) in acc.iter().enumerate() {
        for (v, &a) in aq.iter().enumerate() {
            // SAFETY: q·TILE + v·W + W ≤ 6·TILE ≤ out.len() (asserted).
            unsafe { _mm512_storeu_ps(op.add(q * TILE + v * W), a) };
        }
    }
}

/// [`SiteConv::site`] for six PCs on AVX2: 16 samples (two 8-lane vectors)
/// at a time for all six PCs, 12 running sums in registers. Each sum is the
/// same chain of separate multiplies and adds in ascending tap order.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn conv6_avx2(seg: &[f32], wpca: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    const W: usize = 8;
    let nt = wpca.len() / 6;
    assert!(wpca.len() == 6 * nt && seg.len() + 1 >= TILE + nt && out.len() >= 6 * TILE);
    let sp = seg.as_ptr();
    let op = out.as_mut_ptr();
    for tc in (0..TILE).step_by(2 * W) {
        let mut acc = [[_mm256_setzero_ps(); 2]; 6];
        for i in 0..nt {
            // SAFETY: tc + i + 2·W ≤ TILE + nt − 1 ≤ seg.len() (asserted).
            let x = unsafe {
                [
                    _mm256_loadu_ps(sp.add(tc + i)),
                    _mm256_loadu_ps(sp.add(tc + i + W)),
                ]
            };
            for (q, aq) in acc.iter_mut().enumerate() {
                let w = _mm256_set1_ps(wpca[q * nt + i]);
                for (a, &xv) in aq.iter_mut().zip(&x) {
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(xv, w));
                }
            }
        }
        for (q, aq) in acc.iter().enumerate() {
            for (v, &a) in aq.iter().enumerate() {
                // SAFETY: q·TILE + tc + v·W + W ≤ 6·TILE ≤ out.len() (asserted).
                unsafe { _mm256_storeu_ps(op.add(q * TILE + tc + v * W), a) };
            }
        }
    }
}

/// F of P consecutive PCs over one block: `out[q·TILE + t]` = the float32
/// sum, from zero, over the taps i ascending of seg\[t + i\]·taps\[q·nt + i\].
#[inline(always)]
fn conv<const P: usize>(seg: &[f32], taps: &[f32], out: &mut [f32]) {
    let nt = taps.len() / P;
    let mut acc = [[0f32; TILE]; P];
    for i in 0..nt {
        let xs: &[f32; TILE] = seg[i..i + TILE].try_into().expect("TILE samples");
        for (q, aq) in acc.iter_mut().enumerate() {
            let wv = taps[q * nt + i];
            for (s, &xv) in aq.iter_mut().zip(xs) {
                *s += xv * wv;
            }
        }
    }
    for (o, aq) in out.chunks_exact_mut(TILE).zip(&acc) {
        let o: &mut [f32; TILE] = o.try_into().expect("TILE samples");
        *o = *aq;
    }
}

/// Templates per group of [`GroupBest`]: one AVX-512 vector of Cf values.
const GROUP_K: usize = 16;

/// Each sample's best Cf and template within every group of [`GROUP_K`]
/// consecutive templates (`cf`, `idx`: NT × G, G = ⌈K / GROUP_K⌉, the first
/// of equal values). A subtraction changes B only in its template's
/// partners, which fall in few groups (templates near each other on the
/// probe have near numbers: 2.2 of 18 groups on average in a dense 60-s
/// simulation): the samples it touches then rescan those groups and the G
/// group maxima, not all K templates.
struct GroupBest {
    /// Groups per sample, G.
    g: usize,
    cf: Vec<f32>,
    idx: Vec<u32>,
}

impl GroupBest {
    fn new(k: usize, n: usize) -> Self {
        let g = k.div_ceil(GROUP_K);
        GroupBest {
            g,
            cf: vec![0.0; n * g],
            idx: vec![0; n * g],
        }
    }
}

/// Per-sample best template and its Cf over `lo..lo + cfmax.len()` (zero in
/// the first and last nt columns, as Kilosort4 zeroes Cf there), with the
/// group maxima of `groups` (all of them when `changed` is `None`, else only
/// the groups listed, ascending: those whose B values changed since they
/// were last computed).
///
/// Cf = relu(B)²/nm in float32; the best is the largest Cf, the lowest
/// template on ties (Cf is never NaN: relu maps NaN to 0 and nm > 0; nor
/// −0), so the group maxima combined in group order pick the same template
/// as one scan in template order.
#[allow(clippy::too_many_arguments)]
fn best_templates(
    setup: &MatchingSetup,
    simd: Simd,
    b: &[f32],
    n: usize,
    lo: usize,
    cfmax: &mut [f32],
    imax: &mut [u32],
    gcf: &mut [f32],
    gidx: &mut [u32],
    changed: Option<&[u32]>,
) {
    let k = setup.nm.len();
    let g = k.div_ceil(GROUP_K);
    let nt = setup.settings.nt;
    let nm = &setup.nm[..];
    cfmax
        .par_chunks_mut(BEST_CHUNK)
        .zip(imax.par_chunks_mut(BEST_CHUNK))
        .zip(gcf.par_chunks_mut(BEST_CHUNK * g))
        .zip(gidx.par_chunks_mut(BEST_CHUNK * g))
        .enumerate()
        .for_each(|(ci, (((cm, im), gc), gi))| {
            let t0 = lo + ci * BEST_CHUNK;
            // Samples t0 + a .. t0 + z are inside nt … NT − nt − 1.
            let a = nt.saturating_sub(t0).min(cm.len());
            let z = (n - nt).saturating_sub(t0).clamp(a, cm.len());
            cm[..a].fill(0.0);
            im[..a].fill(0);
            cm[z..].fill(0.0);
            im[z..].fill(0);
            let rows = &b[(t0 + a) * k..(t0 + z) * k];
            best_rows(
                simd,
                BestRows {
                    rows,
                    nm,
                    cm: &mut cm[a..z],
                    im: &mut im[a..z],
                    gc: &mut gc[a * g..z * g],
                    gi: &mut gi[a * g..z * g],
                    changed,
                },
            );
        });
}

/// Samples per parallel task of [`best_templates`].
const BEST_CHUNK: usize = 64;

/// Rows ahead whose changed groups [`best_rows_impl`] prefetches.
const PREFETCH_ROWS: usize = 4;

/// One [`best_rows_impl`] call's rows and outputs.
struct BestRows<'a> {
    /// cm.len() × K values of B.
    rows: &'a [f32],
    /// ‖U_k‖², K values.
    nm: &'a [f32],
    /// Best Cf and template per row.
    cm: &'a mut [f32],
    im: &'a mut [u32],
    /// Best Cf and template per row and group (cm.len() × G).
    gc: &'a mut [f32],
    gi: &'a mut [u32],
    /// The groups to recompute (ascending); `None`: all of them.
    changed: Option<&'a [u32]>,
}

/// [`best_rows_impl`] compiled for `simd`.
fn best_rows(simd: Simd, job: BestRows) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512(job: BestRows) {
            best_rows_impl(job);
        }
        #[target_feature(enable = "avx2")]
        fn avx2(job: BestRows) {
            best_rows_impl(job);
        }
        match simd {
            // SAFETY: the CPU has AVX-512F (`Simd::detect`).
            Simd::Avx512 => return unsafe { avx512(job) },
            // SAFETY: the CPU has AVX2 (`Simd::detect`).
            Simd::Avx2 => return unsafe { avx2(job) },
            Simd::Base => {}
        }
    }
    let _ = simd;
    best_rows_impl(job);
}

/// For each row of K B values (`rows`): the best Cf and template of each
/// group in `changed` (every group when `None`) into `gc`/`gi`, then the
/// largest of the G group maxima, the lowest group on ties, into `cm`/`im`.
#[inline(always)]
fn best_rows_impl(job: BestRows) {
    let BestRows {
        rows,
        nm,
        cm,
        im,
        gc,
        gi,
        changed,
    } = job;
    let k = nm.len();
    let g = k.div_ceil(GROUP_K);
    for (r, ((((row, c), i), gcr), gir)) in rows
        .chunks_exact(k)
        .zip(cm.iter_mut())
        .zip(im.iter_mut())
        .zip(gc.chunks_exact_mut(g))
        .zip(gi.chunks_exact_mut(g))
        .enumerate()
    {
        // Plain loops: an iterator adapter's closure may be compiled outside
        // this function, without its target features.
        match changed {
            None => {
                for q in 0..g {
                    group_best(row, nm, q, gcr, gir);
                }
            }
            Some(qs) => {
                // The changed groups of a row a few ahead, asked for now:
                // rows are K floats apart, too far for the hardware
                // prefetcher to follow a few lines of each.
                if let Some(ahead) = rows.get((r + PREFETCH_ROWS) * k..(r + PREFETCH_ROWS + 1) * k)
                {
                    for &q in qs {
                        // A group's first and last values: the one or two
                        // cache lines it spans.
                        let lo = q as usize * GROUP_K;
                        let hi = (lo + GROUP_K).min(k);
                        crate::prefetch::prefetch(&ahead[lo..lo + 1]);
                        crate::prefetch::prefetch(&ahead[hi - 1..hi]);
                    }
                }
                for &q in qs {
                    group_best(row, nm, q as usize, gcr, gir);
                }
            }
        }
        let mut best = (0u32, f32::NEG_INFINITY);
        for (&v, &j) in gcr.iter().zip(gir.iter()) {
            if v > best.1 {
                best = (j, v);
            }
        }
        *c = best.1;
        *i = best.0;
    }
}

/// The best Cf of group `q` of one row (templates q·GROUP_K … up to K) and
/// its template, the first of equal values, into `gc[q]`, `gi[q]`.
#[inline(always)]
fn group_best(row: &[f32], nm: &[f32], q: usize, gc: &mut [f32], gi: &mut [u32]) {
    let lo = q * GROUP_K;
    let hi = (lo + GROUP_K).min(nm.len());
    if hi - lo == GROUP_K {
        let vs: &[f32; GROUP_K] = row[lo..hi].try_into().expect("GROUP_K values");
        let ms: &[f32; GROUP_K] = nm[lo..hi].try_into().expect("GROUP_K values");
        let mut cf = [0f32; GROUP_K];
        for l in 0..GROUP_K {
            let r = vs[l].max(0.0);
            cf[l] = (r * r) / ms[l];
        }
        // The largest by halves (no NaN, so any order gives it), then the
        // first lane holding it.
        let mut m = cf;
        let mut w = GROUP_K / 2;
        while w > 0 {
            for l in 0..w {
                m[l] = if m[l + w] > m[l] { m[l + w] } else { m[l] };
            }
            w /= 2;
        }
        let top = m[0];
        let mut mask = 0u32;
        for (l, &v) in cf.iter().enumerate() {
            mask |= u32::from(v == top) << l;
        }
        gc[q] = top;
        gi[q] = (lo + mask.trailing_zeros() as usize) as u32;
    } else {
        let mut best = (lo as u32, f32::NEG_INFINITY);
        for j in lo..hi {
            let r = row[j].max(0.0);
            let cf = (r * r) / nm[j];
            if cf > best.1 {
                best = (j as u32, cf);
            }
        }
        gc[q] = best.1;
        gi[q] = best.0;
    }
}

/// Merges sorted, possibly overlapping intervals into disjoint ones.
fn merge_intervals(mut v: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    v.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(v.len());
    for (lo, hi) in v {
        match out.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// The samples whose B a peel's subtraction changed: the disjoint,
/// ascending union of the ranges t − nt … t + nt of the `found` spikes
/// (ascending in t), each with the [`GroupBest`] groups of the partners of
/// every spike it merged (ascending): the only groups whose B values changed
/// there.
fn dirty_ranges(
    setup: &MatchingSetup,
    found: &[(usize, usize, f32)],
    n: usize,
) -> Vec<(usize, usize, Vec<u32>)> {
    let nt = setup.settings.nt;
    let mut out: Vec<(usize, usize, Vec<u32>)> = Vec::new();
    for &(t, j, _) in found {
        let (lo, hi) = (t - nt, (t + nt + 1).min(n));
        let groups = &setup.partners[j].groups;
        match out.last_mut() {
            Some(last) if lo <= last.1 => {
                last.1 = last.1.max(hi);
                last.2.extend_from_slice(groups);
            }
            _ => out.push((lo, hi, groups.clone())),
        }
    }
    for (_, _, gs) in &mut out {
        gs.sort_unstable();
        gs.dedup();
    }
    out
}

/// The `len` values after the first `skip` of `rest`, which keeps what
/// follows them: disjoint ascending ranges of one slice, one at a time.
fn next_range<'a, T>(rest: &mut &'a mut [T], skip: usize, len: usize) -> &'a mut [T] {
    let (range, tail) = std::mem::take(rest)[skip..].split_at_mut(len);
    *rest = tail;
    range
}

/// Samples t of `ranges` (clipped to nt … NT − nt) whose best Cf exceeds
/// `th2` and is the largest within ±nt (Kilosort4's max-pool test), ascending.
/// Pieces of [`PEAK_CHUNK`] samples are tested in parallel (each sample's test
/// only reads `cfmax`) and their peaks joined in order.
fn peaks(cfmax: &[f32], nt: usize, th2: f32, ranges: &[(usize, usize)]) -> Vec<usize> {
    let n = cfmax.len();
    let pieces: Vec<(usize, usize)> = ranges
        .iter()
        .flat_map(|&(lo, hi)| {
            let (lo, hi) = (lo.max(nt), hi.min(n.saturating_sub(nt)));
            (lo..hi)
                .step_by(PEAK_CHUNK)
                .map(move |a| (a, (a + PEAK_CHUNK).min(hi)))
        })
        .collect();
    pieces
        .par_iter()
        .flat_map_iter(|&(lo, hi)| {
            (lo..hi).filter(|&t| {
                let v = cfmax[t];
                v > th2 && {
                    let a = t.saturating_sub(nt);
                    let z = (t + nt + 1).min(n);
                    cfmax[a..z].iter().all(|&w| w <= v)
                }
            })
        })
        .collect()
}

/// Samples per parallel piece of [`peaks`].
const PEAK_CHUNK: usize = 2048;

/// Kilosort4's `run_matching` on one window plus `extract`'s features.
///
/// `x`: C × NT preprocessed window (NT = batch_size + 2·nt in a full pass;
/// any NT > 2·nt works).
///
/// # Errors
/// [`MatchError::Shape`] when `x` does not have C rows or has at most 2·nt columns.
pub fn match_window(setup: &MatchingSetup, x: ArrayView2<f32>) -> Result<WindowSpikes, MatchError> {
    match_window_with(setup, x, Simd::detect())
}

/// [`match_window`] on a window the caller no longer needs: `x` itself
/// becomes the residual (the spikes' templates subtracted), instead of a copy
/// of it. The same spikes, bit for bit.
///
/// # Errors
/// As [`match_window`].
pub fn match_window_in_place(
    setup: &MatchingSetup,
    x: &mut Array2<f32>,
) -> Result<WindowSpikes, MatchError> {
    check_window(setup, x.view())?;
    if !x.is_standard_layout() {
        *x = x.as_standard_layout().into_owned();
    }
    let simd = Simd::detect();
    let b = filter_product(setup, simd, x.view());
    Ok(peel(setup, simd, b, x))
}

/// [`MatchError::Shape`] unless `x` has the set-up's sites as rows and more
/// than 2·nt columns.
fn check_window(setup: &MatchingSetup, x: ArrayView2<f32>) -> Result<(), MatchError> {
    let n_c = setup.u.dim().2;
    let nt = setup.settings.nt;
    let n = x.ncols();
    if x.nrows() != n_c || n <= 2 * nt {
        return Err(shape_err(
            "window",
            format!(
                "is {} × {n}; expected {n_c} sites and more than {} samples",
                x.nrows(),
                2 * nt
            ),
        ));
    }
    Ok(())
}

/// [`match_window`] with its loops compiled for `simd`.
fn match_window_with(
    setup: &MatchingSetup,
    x: ArrayView2<f32>,
    simd: Simd,
) -> Result<WindowSpikes, MatchError> {
    check_window(setup, x)?;
    let b = filter_product(setup, simd, x);
    let mut xres = residual_copy(x, Scratch::take(&setup.scratch.x, x.len()));
    let out = peel(setup, simd, b, &mut xres);
    Scratch::give(&setup.scratch.x, xres.into_raw_vec_and_offset().0);
    Ok(out)
}

/// The peels of a window whose filter product is `b` (NT × K) and whose
/// residual starts as the window itself (`xres`, C × NT, standard layout),
/// then the features of the final residual.
fn peel(
    setup: &MatchingSetup,
    simd: Simd,
    mut b: Vec<f32>,
    xres: &mut Array2<f32>,
) -> WindowSpikes {
    let k = setup.n_templates();
    let nt = setup.settings.nt;
    let n = xres.ncols();
    let th2 = (setup.settings.th_learned * setup.settings.th_learned) as f32;
    let mut cfmax = vec![0f32; n];
    let mut imax = vec![0u32; n];
    let mut groups = GroupBest::new(k, n);
    let g = groups.g;
    best_templates(
        setup,
        simd,
        &b,
        n,
        0,
        &mut cfmax,
        &mut imax,
        &mut groups.cf,
        &mut groups.idx,
        None,
    );
    let mut ranges = vec![(0, n)];
    let mut out = WindowSpikes::default();
    for peel in 0..setup.settings.max_peels {
        out.peels = peel + 1;
        let spikes = peaks(&cfmax, nt, th2, &ranges);
        if spikes.is_empty() {
            break;
        }
        let found: Vec<(usize, usize, f32)> = spikes
            .iter()
            .map(|&t| {
                let j = imax[t] as usize;
                (t, j, b[t * k + j] / setup.nm[j])
            })
            .collect();
        for &(t, j, amp) in &found {
            out.col.push(t as u32);
            out.template.push(j as u32);
            out.amp.push(amp);
            out.th_amp.push(cfmax[t].sqrt());
        }
        for parity in 0..2 {
            let half_spikes: Vec<(usize, usize, f32)> =
                found.iter().copied().skip(parity).step_by(2).collect();
            subtract(setup, &half_spikes, &mut b, xres, n);
        }
        let dirty = dirty_ranges(setup, &found, n);
        // The dirty ranges are disjoint and ascending: one slice of cfmax,
        // imax and the group maxima each, all updated in parallel.
        let mut parts = Vec::with_capacity(dirty.len());
        let (mut cm_rest, mut im_rest) = (&mut cfmax[..], &mut imax[..]);
        let (mut gc_rest, mut gi_rest) = (&mut groups.cf[..], &mut groups.idx[..]);
        let mut at = 0;
        for (lo, hi, changed) in &dirty {
            let (skip, len) = (lo - at, hi - lo);
            parts.push((
                *lo,
                next_range(&mut cm_rest, skip, len),
                next_range(&mut im_rest, skip, len),
                next_range(&mut gc_rest, skip * g, len * g),
                next_range(&mut gi_rest, skip * g, len * g),
                &changed[..],
            ));
            at = *hi;
        }
        parts
            .into_par_iter()
            .for_each(|(lo, cm, im, gc, gi, changed)| {
                best_templates(setup, simd, &b, n, lo, cm, im, gc, gi, Some(changed))
            });
        ranges = merge_intervals(
            dirty
                .iter()
                .map(|&(lo, hi, _)| (lo.saturating_sub(nt), (hi + nt).min(n)))
                .collect(),
        );
        if peel + 1 == setup.settings.max_peels {
            tracing::debug!(
                "matching stopped at max_peels = {} with {} spikes in the last peel",
                setup.settings.max_peels,
                found.len()
            );
        }
    }
    out.tf = features(setup, xres.view(), &out);
    Scratch::give(&setup.scratch.b, b);
    out
}

/// A standard-layout copy of the window (C × NT) in `buf` (C·NT floats), one
/// row per parallel task.
fn residual_copy(x: ArrayView2<f32>, mut buf: Vec<f32>) -> Array2<f32> {
    let n = x.ncols();
    buf.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(c, o)| match x.row(c).as_slice() {
            Some(r) => o.copy_from_slice(r),
            None => o.iter_mut().zip(x.row(c)).for_each(|(v, &xv)| *v = xv),
        });
    Array2::from_shape_vec(x.dim(), buf).expect("C × NT values")
}

/// Subtracts one half-peel's spikes (ascending samples) from B and the residual.
///
/// Kilosort4 writes each half with one indexed assignment (`X[:, idx] -= v`):
/// every column of a spike's range becomes (value before the half) − (its
/// term), for all rows. Ranges within a half overlap only when two samples
/// within nt tie exactly; then the later spike's write wins for the shared
/// columns, which is what is done here (Kilosort4's order there is unspecified).
/// Without overlaps (the rule) every value is written by one spike only, so
/// the spikes are subtracted in parallel.
fn subtract(
    setup: &MatchingSetup,
    spikes: &[(usize, usize, f32)],
    b: &mut [f32],
    xres: &mut Array2<f32>,
    n: usize,
) {
    if spikes.is_empty() {
        return;
    }
    let nt = setup.settings.nt;
    if spikes.windows(2).any(|w| w[1].0 - w[0].0 <= 2 * nt) {
        subtract_overlapping(setup, spikes, b, xres, n);
        return;
    }
    let k = setup.nm.len();
    let half = nt / 2;
    let nl = 2 * nt + 1;
    // Spike s owns B's rows t − nt … t + nt and the residual's columns
    // t − nt/2 … t + nt/2, disjoint from the other spikes' (more than 2·nt
    // apart).
    let mut parts = Vec::with_capacity(spikes.len());
    let mut b_rest = b;
    let mut x_rest = xres.view_mut();
    let (mut b_at, mut x_at) = (0, 0);
    for s in spikes {
        let lo = s.0 - nt;
        let (_, bs) = std::mem::take(&mut b_rest).split_at_mut((lo - b_at) * k);
        let (bs, b_tail) = bs.split_at_mut(nl * k);
        let xlo = s.0 - half;
        let (_, xs) = x_rest.split_at(ndarray::Axis(1), xlo - x_at);
        let (xs, x_tail) = xs.split_at(ndarray::Axis(1), nt);
        (b_rest, x_rest, b_at, x_at) = (b_tail, x_tail, lo + nl, xlo + nt);
        parts.push((s, bs, xs));
    }
    parts
        .into_par_iter()
        .for_each(|(&(_, j, amp), bs, mut xs)| {
            let ctc = setup.ctc_of(j);
            let p = &setup.partners[j];
            for (pi, &kk) in p.k.iter().enumerate() {
                let cs = &ctc[pi * nl..(pi + 1) * nl];
                for (row, &cv) in bs.chunks_exact_mut(k).zip(cs) {
                    row[kk as usize] -= amp * cv;
                }
            }
            for (si, &c) in setup.support[j].iter().enumerate() {
                let w = &setup.wave[j][si * nt..(si + 1) * nt];
                for (v, &wv) in xs.row_mut(c as usize).iter_mut().zip(w) {
                    *v -= amp * wv;
                }
            }
        });
}

/// [`subtract`] for a half whose ranges overlap: one spike after the other,
/// each starting from the values before the half. Only a spike whose range
/// overlaps the previous one's finds values already changed in the half, so
/// only those ranges are saved beforehand (not all of B and the residual).
fn subtract_overlapping(
    setup: &MatchingSetup,
    spikes: &[(usize, usize, f32)],
    b: &mut [f32],
    xres: &mut Array2<f32>,
    n: usize,
) {
    let k = setup.nm.len();
    let nt = setup.settings.nt;
    let half = nt / 2;
    let nl = 2 * nt + 1;
    let ctcs: Vec<std::borrow::Cow<'_, [f32]>> = spikes
        .par_iter()
        .map(|&(_, j, _)| setup.ctc_of(j))
        .collect();
    // Per spike: B's rows t − nt … t + nt and the residual's columns
    // t − nt/2 … t + nt/2 before the half, where the previous range overlaps.
    let saved: Vec<_> = spikes
        .iter()
        .enumerate()
        .map(|(i, &(t, _, _))| {
            let gap = (i > 0).then(|| t - spikes[i - 1].0);
            let rows = gap
                .filter(|&g| g <= 2 * nt)
                .map(|_| b[(t - nt) * k..(t + nt + 1).min(n) * k].to_vec());
            let cols = gap.filter(|&g| g <= 2 * half).map(|_| {
                xres.slice(ndarray::s![.., t - half..t - half + nt])
                    .to_owned()
            });
            (rows, cols)
        })
        .collect();
    for ((&(t, j, amp), ctc), (rows, cols)) in spikes.iter().zip(&ctcs).zip(&saved) {
        let lo = t - nt;
        if let Some(orig) = rows {
            b[lo * k..lo * k + orig.len()].copy_from_slice(orig);
        }
        let p = &setup.partners[j];
        for d in 0..nl {
            let row = &mut b[(lo + d) * k..(lo + d + 1) * k];
            for (pi, &kk) in p.k.iter().enumerate() {
                row[kk as usize] -= amp * ctc[pi * nl + d];
            }
        }
        let xlo = t - half;
        if let Some(orig) = cols {
            xres.slice_mut(ndarray::s![.., xlo..xlo + nt]).assign(orig);
        }
        for (si, &c) in setup.support[j].iter().enumerate() {
            let w = &setup.wave[j][si * nt..(si + 1) * nt];
            let mut row = xres.row_mut(c as usize);
            for (i, &wv) in w.iter().enumerate() {
                row[xlo + i] -= amp * wv;
            }
        }
    }
}

/// `extract`'s features: per spike, the wPCA projection of the final
/// residual on the nC sites `iCC[:, iU[template]]` over the nt samples centred
/// on it, plus amp × the template's coefficients there (n × nC × npc).
fn features(setup: &MatchingSetup, xres: ArrayView2<f32>, sp: &WindowSpikes) -> Vec<f32> {
    let (_, npc, _) = setup.u.dim();
    let nt = setup.settings.nt;
    let half = nt / 2;
    let nc = setup.icc.nrows();
    let mut tf = vec![0f32; sp.len() * nc * npc];
    tf.par_chunks_mut(nc * npc).enumerate().for_each(|(s, o)| {
        let j = sp.template[s] as usize;
        let t = sp.col[s] as usize;
        let centre = setup.iu[j] as usize;
        for ci in 0..nc {
            let c = setup.icc[[ci, centre]] as usize;
            let row = xres.row(c);
            for p in 0..npc {
                // float32, i ascending, each product rounded: the device's sum.
                let mut acc = 0f32;
                for i in 0..nt {
                    acc += row[t - half + i] * setup.wpca[[p, i]];
                }
                o[ci * npc + p] = acc + sp.amp[s] * setup.u[[j, p, c]];
            }
        }
    });
    tf
}

/// `extract` over `n_windows` windows read by `window(i)` (C × NT each,
/// preprocessed): spike samples are `col − nt + i·batch_size − nt/2 + nt0min`
/// (the trough, relative to window 0's first own sample); negative samples
/// (window 0 only) are dropped; the rows are then sorted by sample with a
/// stable sort (Kilosort4's `np.argsort` quicksort orders equal samples,
/// which come from different peels, in an unspecified way).
///
/// # Errors
/// What `window` returns, and [`MatchError`] from [`match_window`] (through `E: From`).
pub fn extract<E, F>(setup: &MatchingSetup, n_windows: u64, mut window: F) -> Result<Extracted, E>
where
    F: FnMut(u64) -> Result<Array2<f32>, E>,
    E: From<MatchError>,
{
    let mut parts = Vec::new();
    for i in 0..n_windows {
        let x = window(i)?;
        parts.push(match_window(setup, x.view())?);
    }
    Ok(assemble(setup, &parts))
}

/// Combines per-window spikes (`parts[i]` from window i) into `st` and `tF`,
/// as [`extract`] does.
pub fn assemble(setup: &MatchingSetup, parts: &[WindowSpikes]) -> Extracted {
    let s = &setup.settings;
    let npc = setup.u.dim().1;
    let nc = setup.icc.nrows();
    let per = nc * npc;
    let mut rows: Vec<(i64, u32, f32, usize, usize)> = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        for r in 0..p.len() {
            let sample = p.col[r] as i64 - s.nt as i64 + (i * s.batch_size) as i64
                - (s.nt / 2) as i64
                + s.nt0min as i64;
            if sample >= 0 {
                rows.push((sample, p.template[r], p.th_amp[r], i, r));
            }
        }
    }
    // Stable: spikes at one sample stay in window and peel order, whatever
    // the thread count.
    rows.par_sort_by_key(|r| r.0);
    let mut st = Array2::<f64>::zeros((rows.len(), 3));
    for (o, &(sample, j, th, _, _)) in rows.iter().enumerate() {
        st[[o, 0]] = sample as f64;
        st[[o, 1]] = f64::from(j);
        st[[o, 2]] = f64::from(th);
    }
    let mut tf = Array3::<f32>::zeros((rows.len(), nc, npc));
    if per > 0 {
        tf.as_slice_mut()
            .expect("standard layout")
            .par_chunks_mut(per)
            .zip(rows.par_iter())
            .for_each(|(out, &(_, _, _, i, r))| {
                out.copy_from_slice(&parts[i].tf[r * per..(r + 1) * per]);
            });
    }
    Extracted {
        st,
        tf,
        icc: setup.icc.clone(),
        icc_mask: setup.icc_mask.clone(),
        iu: setup.iu.clone(),
    }
}

/// Window `i` of `rec` preprocessed as the matching pass reads it (Kilosort4's
/// `BinaryFiltered.padded_batch_to_torch` with drift correction): raw rows
/// `chan_map` (C × (batch_size + 2·nt)), channel means, median CAR, high-pass,
/// then the whitening `W` of `pre`, or `M_b·W` when `drift` is given.
///
/// # Errors
/// When the read fails, the window does not fit `pre`, or `i` is past the
/// drift estimate's windows.
pub fn preprocessed_window(
    rec: &dyn crate::recording::Recording,
    plan: &crate::recording::WindowPlan,
    chan_map: &[u64],
    pre: &crate::preprocess::Preprocessor,
    drift: Option<&crate::drift::correct::DriftCorrection>,
    i: u64,
) -> anyhow::Result<Array2<f32>> {
    let mut x = Array2::<f32>::zeros((chan_map.len(), plan.window_len()));
    preprocessed_window_into(rec, plan, chan_map, pre, drift, i, None, &mut x)?;
    Ok(x)
}

/// [`preprocessed_window`] into `x`, a buffer of a window's shape (C ×
/// window length) or any other (it is then made anew), with the raw window's
/// stuck (clipped) stretches of at least `mask_min_run` samples masked first,
/// as the detection pass masks them (`--mask-clipped`,
/// [`crate::checks::mask_stuck_runs`]; `None` masks nothing, as Kilosort4).
/// Every value is written, so a buffer from an earlier window can be reused:
/// a fresh 92 MB buffer per window costs the kernel its pages' faults and
/// zeroing.
///
/// # Errors
/// As [`preprocessed_window`].
#[allow(clippy::too_many_arguments)]
pub fn preprocessed_window_into(
    rec: &dyn crate::recording::Recording,
    plan: &crate::recording::WindowPlan,
    chan_map: &[u64],
    pre: &crate::preprocess::Preprocessor,
    drift: Option<&crate::drift::correct::DriftCorrection>,
    i: u64,
    mask_min_run: Option<usize>,
    x: &mut Array2<f32>,
) -> anyhow::Result<()> {
    let shape = (chan_map.len(), plan.window_len());
    if x.dim() != shape {
        *x = Array2::zeros(shape);
    }
    crate::recording::read_window(rec, plan, i, chan_map, x)?;
    if let Some(min_run) = mask_min_run {
        let cols = crate::checks::WindowColumns::of(plan, i);
        crate::checks::mask_stuck_runs(x, cols.lo, cols.hi, cols.pad_repeats, min_run);
    }
    // The preprocessor's blanking (`--artifact-times`, `--blank-transients`)
    // finds its stretches in the raw window, column 0 at this absolute sample.
    let first = (rec.first_sample() + plan.window_start(i)) as i64 - plan.nt as i64;
    let blank = pre.blank_ranges(x, first);
    match drift {
        None => pre.apply(x)?,
        Some(d) => {
            pre.filter_only(x)?;
            d.window_whitening(i, pre.whitening())?.apply(x)?;
        }
    }
    crate::preprocess::zero_columns(x, &blank);
    Ok(())
}
