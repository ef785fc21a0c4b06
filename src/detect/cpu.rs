//! The reference CPU detector (Kilosort4 `spikedetect.template_match` and what
//! `spikedetect.run` does around it), one function per step so that each step
//! has a GPU twin:
//!
//! 1. [`filter_bank`]: correlate every channel with the 6 universal templates
//!    (`conv1d`, zero padding of nt/2, no kernel flip): B\[c, k, t\];
//! 2. [`centre_response`]: per centre and sample, the 30 (size, template)
//!    outputs A\[s·6 + k\] = Σ_c weigh\[s, c, j\]·B\[iC\[c, j\], k, t\]; keep the best
//!    |A| (`As`), the first index attaining it and its sign (`imaxs` = (1 + r)·sign);
//! 3. [`neighbour_max`]: Amax\[j, t\] = max over the iC2 neighbours of As;
//! 4. [`local_peaks`]: zero the first and last nt samples of Amax, take the
//!    ±nt0min max, keep (j, t) where As equals it and exceeds Th_universal;
//! 5. [`features`]: amplitude, template index, sign, adist, y position (yct) and
//!    PC features (tF) of each detection.
//!
//! Steps 1–3 run on tiles of [`TILE`] samples in parallel (rayon); each sample's
//! result is independent of the tiling. All sums are float32 in a fixed order
//! (no fused multiply-add), so results are identical on every CPU.

use ndarray::{Array2, Array3, ArrayView2};
use rayon::prelude::*;

use crate::detect::geometry::Geometry;
use crate::detect::settings::DetectionSettings;
use crate::detect::templates::UniversalTemplates;
use crate::error::DetectError;

/// Samples per tile in steps 1–3. A tile's filter outputs (C·6·TILE
/// float32: 1.18 MB for 384 sites) fit in a core's L2 cache (2 MB on the
/// Xeons measured) between step 1, which writes them, and step 2, which reads
/// them; at 256 (2.36 MB) they did not (BENCHMARKS.md, "Detection tiles that
/// stay in L2"). 64 measured the same as 128. No output depends on it.
pub const TILE: usize = 128;

/// Detections of one window, in Kilosort4's order: by centre, then by sample.
///
/// n detections; nC sites per centre; npc PCs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Detections {
    /// Template centre index j of each detection (column 0 of Kilosort4's `xy`).
    pub centre: Vec<u32>,
    /// Sample index t within the window (column 1 of `xy`; the window's own
    /// samples are nt ..= NT − nt − 1).
    pub sample: Vec<u64>,
    /// Best |A| at the detection (`amp`), whitened units.
    pub amp: Vec<f32>,
    /// Winning (size, template) pair r = s·6 + k, 0–29 (`imax`).
    pub imax: Vec<u8>,
    /// Sign of the winning A: +1 for a negative-going spike like the templates, −1 inverted.
    pub sign: Vec<i8>,
    /// Per-site output of the winning temporal template, sign-corrected (`adist`),
    /// n × nC row-major (Kilosort4 stores its transpose).
    pub adist: Vec<f32>,
    /// Amplitude-weighted depth, µm (`yct`).
    pub yct: Vec<f32>,
    /// PC features (`tF`), n × nC × npc row-major.
    pub tf: Vec<f32>,
    /// nC, sites per detection.
    pub n_chans: usize,
    /// npc, PCs per site.
    pub n_pcs: usize,
}

impl Detections {
    /// Keeps the detections whose (centre, sample) satisfy `keep`, in order.
    pub fn retain(&mut self, keep: impl Fn(u32, u64) -> bool) {
        let (nc, npc) = (self.n_chans, self.n_pcs);
        let old = std::mem::take(self);
        *self = Detections {
            n_chans: nc,
            n_pcs: npc,
            ..Detections::default()
        };
        for i in 0..old.len() {
            if keep(old.centre[i], old.sample[i]) {
                self.centre.push(old.centre[i]);
                self.sample.push(old.sample[i]);
                self.amp.push(old.amp[i]);
                self.imax.push(old.imax[i]);
                self.sign.push(old.sign[i]);
                self.adist
                    .extend_from_slice(&old.adist[i * nc..(i + 1) * nc]);
                self.yct.push(old.yct[i]);
                self.tf
                    .extend_from_slice(&old.tf[i * nc * npc..(i + 1) * nc * npc]);
            }
        }
    }

    /// Number of detections.
    pub fn len(&self) -> usize {
        self.centre.len()
    }
    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.centre.is_empty()
    }
    /// `adist` in Kilosort4's layout, nC × n.
    pub fn adist_kilosort(&self) -> Array2<f32> {
        let n = self.len();
        Array2::from_shape_vec((n, self.n_chans), self.adist.clone())
            .expect("adist holds n × nC values")
            .reversed_axes()
            .as_standard_layout()
            .to_owned()
    }
    /// `tF` as an n × nC × npc array.
    pub fn tf_array(&self) -> Array3<f32> {
        Array3::from_shape_vec((self.len(), self.n_chans, self.n_pcs), self.tf.clone())
            .expect("tF holds n × nC × npc values")
    }
}

/// Intermediate arrays of one window (dense, for tests and inspection).
#[derive(Debug, Clone)]
pub struct Intermediates {
    /// Best |A| per centre and sample, Nf × NT (Kilosort4's `As`).
    pub as_: Array2<f32>,
    /// (1 + r)·sign per centre and sample, Nf × NT (`imaxs`).
    pub imax_signed: Array2<i8>,
    /// Neighbour max with the edges zeroed, Nf × NT (before the time max-pool).
    pub amax_prepool: Array2<f32>,
}

/// The geometry's per-centre arrays laid out centre-major, as every back end's
/// steps 2–3 read them.
#[derive(Debug, Clone)]
pub(crate) struct CentreMajor {
    /// Per centre, its nC sites (iC\[:, j\]): Nf × nC.
    pub sites: Vec<u32>,
    /// Per centre and site, the nsz spatial weights (weigh\[:, c, j\]): Nf × nC × nsz.
    pub weights: Vec<f32>,
    /// Per centre, its nC2 neighbour centres (iC2\[:, j\]): Nf × nC2.
    pub neighbours: Vec<u32>,
    /// Per centre and site, max over sizes of |weigh\[s, c, j\]|: Nf × nC, for
    /// the bound of [`centre_response_pruned`].
    pub weight_max: Vec<f32>,
}

impl CentreMajor {
    pub(crate) fn new(geometry: &Geometry) -> CentreMajor {
        let nf = geometry.n_centres();
        let nc = geometry.n_chans();
        let nsz = geometry.n_sizes();
        let nc2 = geometry.n_neighbours();
        let mut sites = Vec::with_capacity(nf * nc);
        let mut weights = Vec::with_capacity(nf * nc * nsz);
        let mut neighbours = Vec::with_capacity(nf * nc2);
        let mut weight_max = Vec::with_capacity(nf * nc);
        for j in 0..nf {
            for c in 0..nc {
                sites.push(geometry.i_c[[c, j]]);
                for s in 0..nsz {
                    weights.push(geometry.weigh[[s, c, j]]);
                }
                weight_max.push(largest_magnitudes(&weights[weights.len() - nsz..]));
            }
            for m in 0..nc2 {
                neighbours.push(geometry.i_c2[[m, j]]);
            }
        }
        CentreMajor {
            sites,
            weights,
            neighbours,
            weight_max,
        }
    }
}

/// max |w| over `w` (0 when empty); NaN is passed over, as by `f32::max`.
fn largest_magnitudes(w: &[f32]) -> f32 {
    w.iter().fold(0f32, |m, &v| m.max(v.abs()))
}

/// A CPU detector for one probe geometry; its buffers persist across windows.
#[derive(Debug)]
pub struct CpuDetector {
    geometry: Geometry,
    templates: UniversalTemplates,
    settings: DetectionSettings,
    /// Per centre, its nC sites (centre-major copy of iC).
    sites: Vec<u32>,
    /// Per centre, weights laid out [j][c][s] (centre-major copy of weigh).
    weights: Vec<f32>,
    /// Per centre and site, max over sizes of |weigh| (Nf × nC), for the
    /// bound in [`centre_response_pruned`].
    weight_max: Vec<f32>,
    /// Per centre, its nC2 neighbours (centre-major copy of iC2).
    neighbours: Vec<u32>,
    /// Tile-major buffers: [tile][j][tt].
    as_buf: Vec<f32>,
    imax_buf: Vec<i8>,
    /// Per tile, centre and chunk of [`LANES`] samples ([tile][j][chunk]),
    /// after pruned steps: the largest As of a chunk step 2 computed (NaN
    /// passed over), 0 for a chunk it skipped (whose As and imax are then
    /// stale and stand for 0).
    chunk_max: Vec<f32>,
    amax_buf: Vec<f32>,
    /// (centre, sample) where As > Th_universal, from the last pruned steps
    /// 1–3: one list per tile, as the tile gathered them, less those a
    /// larger As within the same tile already rules out
    /// ([`TileAs::beaten`]).
    candidates: Vec<Vec<(u32, u64)>>,
    nt_window: usize,
    /// Busy seconds per step since the last [`CpuDetector::take_step_seconds`].
    step_seconds: [f64; 4],
    /// Whether step 5 computes the PC features `tF` ([`CpuDetector::set_pc_features`]).
    pc_features: bool,
}

thread_local! {
    /// Step 1's output B, the pruning bound's terms and the pruned step 2's
    /// chunk flags for one tile, per thread.
    static TILE_SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<u8>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Names of the parts [`CpuDetector::take_step_seconds`] reports.
pub const STEP_NAMES: [&str; 4] = ["check", "steps_1_3", "peaks", "features"];

impl CpuDetector {
    /// Detects with other universal templates from the next window on.
    ///
    /// # Errors
    /// [`DetectError::Setting`] when they do not fit the settings (as [`CpuDetector::new`]).
    pub fn set_templates(&mut self, templates: &UniversalTemplates) -> Result<(), DetectError> {
        let pc_features = self.pc_features;
        *self = CpuDetector::new(
            self.geometry.clone(),
            templates.clone(),
            self.settings.clone(),
        )?;
        self.pc_features = pc_features;
        Ok(())
    }

    /// Whether step 5 computes the PC features `tF` (`true`, the default).
    /// Without them (`false`: the drift step's first pass, which needs only
    /// each spike's sample, depth `yct` and amplitude) the detections have
    /// `n_pcs = 0` and an empty `tf`; every other field keeps its bits.
    pub fn set_pc_features(&mut self, on: bool) {
        self.pc_features = on;
    }

    /// Prepares a detector for `geometry` (template centres and neighbourhoods).
    ///
    /// # Errors
    /// [`DetectError::Setting`] for invalid settings.
    pub fn new(
        geometry: Geometry,
        templates: UniversalTemplates,
        settings: DetectionSettings,
    ) -> Result<CpuDetector, DetectError> {
        settings.validate()?;
        let CentreMajor {
            sites,
            weights,
            neighbours,
            weight_max,
        } = CentreMajor::new(&geometry);
        Ok(CpuDetector {
            geometry,
            templates,
            settings,
            sites,
            weights,
            neighbours,
            weight_max,
            as_buf: Vec::new(),
            imax_buf: Vec::new(),
            chunk_max: Vec::new(),
            amax_buf: Vec::new(),
            candidates: Vec::new(),
            nt_window: 0,
            step_seconds: [0.0; 4],
            pc_features: true,
        })
    }

    /// The geometry in use.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Detects spikes in one whitened window `x` (C sites × NT samples, float32,
    /// row i = probe site i), as Kilosort4's `template_match` + `yweighted` + PC
    /// features do.
    ///
    /// # Errors
    /// [`DetectError::Input`] when `x` has a different number of rows than the
    /// probe has sites, is shorter than 2·nt + 1 samples, or holds a non-finite value.
    pub fn detect(&mut self, x: ArrayView2<f32>, yc: &[f32]) -> Result<Detections, DetectError> {
        self.run(x, yc, false)
    }

    /// As [`CpuDetector::detect`], but every step computed densely over all centres
    /// and samples, in Kilosort4's order: the oracle the pruned path and the GPU
    /// kernels are checked against. Gives the same detections, more slowly.
    ///
    /// # Errors
    /// As [`CpuDetector::detect`].
    pub fn detect_dense(
        &mut self,
        x: ArrayView2<f32>,
        yc: &[f32],
    ) -> Result<Detections, DetectError> {
        self.run(x, yc, true)
    }

    fn run(
        &mut self,
        x: ArrayView2<f32>,
        yc: &[f32],
        dense: bool,
    ) -> Result<Detections, DetectError> {
        let t0 = std::time::Instant::now();
        check_window_shape(&self.geometry, &self.settings, x, yc)?;
        let t1 = std::time::Instant::now();
        let suspect = self.steps_1_to_3(x, dense);
        let t2 = std::time::Instant::now();
        if suspect {
            // Step 1 gave a non-finite output: the window holds a non-finite
            // value (then this names it), or finite values overflowed.
            check_finite(x)?;
        }
        // The scan's seconds, if any, count as the input check's.
        let scanned = std::time::Instant::now();
        let peaks = self.local_peaks(dense);
        let t3 = std::time::Instant::now();
        let det = self.features(x, yc, &peaks);
        let t4 = std::time::Instant::now();
        let check = (t1 - t0) + (scanned - t2);
        for (acc, d) in self
            .step_seconds
            .iter_mut()
            .zip([check, t2 - t1, t3 - scanned, t4 - t3])
        {
            *acc += d.as_secs_f64();
        }
        Ok(det)
    }

    /// Busy seconds of each step since the last call, by name ([`STEP_NAMES`]:
    /// the input check, steps 1–3 with the candidates, the local peaks, the
    /// features), and starts counting again.
    pub fn take_step_seconds(&mut self) -> Vec<(&'static str, f64)> {
        let s = std::mem::take(&mut self.step_seconds);
        STEP_NAMES.iter().copied().zip(s).collect()
    }

    /// Runs steps 1–3 and returns the dense intermediate arrays (for tests).
    ///
    /// # Errors
    /// As [`CpuDetector::detect`].
    pub fn intermediates(
        &mut self,
        x: ArrayView2<f32>,
        yc: &[f32],
    ) -> Result<Intermediates, DetectError> {
        self.check_input(x, yc)?;
        self.steps_1_to_3(x, true);
        let nf = self.geometry.n_centres();
        let nt_w = self.nt_window;
        let mut as_ = Array2::<f32>::zeros((nf, nt_w));
        let mut imax_signed = Array2::<i8>::zeros((nf, nt_w));
        let mut amax_prepool = Array2::<f32>::zeros((nf, nt_w));
        let nt = self.settings.nt;
        for j in 0..nf {
            for t in 0..nt_w {
                let i = self.index(j, t);
                as_[[j, t]] = self.as_buf[i];
                imax_signed[[j, t]] = self.imax_buf[i];
                let edge = t < nt || t + nt >= nt_w;
                amax_prepool[[j, t]] = if edge { 0.0 } else { self.amax_buf[i] };
            }
        }
        Ok(Intermediates {
            as_,
            imax_signed,
            amax_prepool,
        })
    }

    fn check_input(&self, x: ArrayView2<f32>, yc: &[f32]) -> Result<(), DetectError> {
        check_window(&self.geometry, &self.settings, x, yc)
    }

    /// How the As of centre `j` over samples `lo..hi` compare with `v` > 0
    /// ([`TileAs::row_against`], tile by tile).
    #[inline]
    fn row_against(&self, j: usize, lo: usize, hi: usize, v: f32) -> Against {
        if lo >= hi {
            return Against::Below;
        }
        let nf = self.geometry.n_centres();
        let mut equal = false;
        for tile in lo / TILE..=(hi - 1) / TILE {
            let t0 = tile * TILE;
            let tile_as = TileAs {
                t0,
                as_t: &self.as_buf[tile * nf * TILE..(tile + 1) * nf * TILE],
                cmax_t: &self.chunk_max[tile * nf * CHUNKS..(tile + 1) * nf * CHUNKS],
            };
            match tile_as.row_against(j, lo, hi, v) {
                Against::Above => return Against::Above,
                Against::Equal => equal = true,
                Against::Below => {}
            }
        }
        if equal {
            Against::Equal
        } else {
            Against::Below
        }
    }

    #[inline]
    fn index(&self, j: usize, t: usize) -> usize {
        let nf = self.geometry.n_centres();
        let tile = t / TILE;
        tile * nf * TILE + j * TILE + (t % TILE)
    }

    /// Steps 1–3 over all tiles. `dense`: every centre and sample exactly, plus the
    /// neighbour max (Kilosort4's arrays). Otherwise step 2 is computed exactly only
    /// where |A| can exceed Th_universal ([`centre_response_pruned`]) and step 3 is
    /// left to [`CpuDetector::local_peaks`].
    ///
    /// Returns whether some step-1 output B\[0, t\] was not finite. Every
    /// sample x\[c, t\] of the window is a factor of B\[c, 0, t\] (its centre
    /// tap), and a NaN or ±∞ factor makes that sum NaN or ±∞, so a window
    /// with a non-finite value always returns `true`; finite values that
    /// overflow can too.
    fn steps_1_to_3(&mut self, x: ArrayView2<f32>, dense: bool) -> bool {
        let x = x.as_standard_layout();
        let (n_ch, nt_w) = x.dim();
        let xs = x.as_slice().expect("standard layout");
        let nf = self.geometry.n_centres();
        let n_tiles = nt_w.div_ceil(TILE);
        let len = n_tiles * nf * TILE;
        self.nt_window = nt_w;
        self.as_buf.resize(len, 0.0);
        self.imax_buf.resize(len, 0);
        self.chunk_max
            .resize(if dense { 0 } else { n_tiles * nf * CHUNKS }, 0.0);
        let mut cmax_chunks: Vec<&mut [f32]> = if dense {
            (0..n_tiles).map(|_| &mut [][..]).collect()
        } else {
            self.chunk_max.chunks_mut(nf * CHUNKS).collect()
        };
        self.amax_buf.resize(if dense { len } else { 0 }, 0.0);
        let nsz = self.geometry.n_sizes();
        let nc2 = self.geometry.n_neighbours();
        let wtemp = self.templates.wtemp.as_standard_layout();
        let wtemp = wtemp.as_slice().expect("standard layout");
        let ntaps = wtemp.len() / NK;
        let wt = &taps_by_tap(wtemp);
        let sites = &self.sites;
        let weights = &self.weights;
        let neighbours = &self.neighbours;
        let weight_max = &self.weight_max;
        let th = self.settings.th_universal;
        let span = PeakSpan::of(&self.settings, nt_w);
        let mut amax_chunks: Vec<&mut [f32]> = if dense {
            self.amax_buf.chunks_mut(nf * TILE).collect()
        } else {
            (0..n_tiles).map(|_| &mut [][..]).collect()
        };
        let per_tile: Vec<(Vec<(u32, u64)>, bool)> = self
            .as_buf
            .par_chunks_mut(nf * TILE)
            .zip(self.imax_buf.par_chunks_mut(nf * TILE))
            .zip(amax_chunks.par_iter_mut())
            .zip(cmax_chunks.par_iter_mut())
            .enumerate()
            .map(|(tile, (((as_t, imax_t), amax_t), cmax_t))| {
                // Per-thread scratch that outlives the window (no fresh pages
                // per job); every value is written before it is read.
                TILE_SCRATCH.with_borrow_mut(|(b, q, done)| {
                    b.resize(n_ch * NK * TILE, 0.0);
                    q.resize(pruned_scratch_len(n_ch), 0.0);
                    let t0 = tile * TILE;
                    let mut non_finite = false;
                    for c in 0..n_ch {
                        // The tile's samples of the channel two ahead, asked
                        // for now: the channels' rows are too many separate
                        // streams for the hardware prefetcher.
                        if c + 2 < n_ch {
                            let ahead = &xs[(c + 2) * nt_w..(c + 3) * nt_w];
                            let lo = t0.saturating_sub(ntaps / 2).min(nt_w);
                            let hi = (t0 + TILE + ntaps / 2).min(nt_w);
                            crate::prefetch::prefetch(&ahead[lo..hi]);
                        }
                        let row = &xs[c * nt_w..(c + 1) * nt_w];
                        let out = &mut b[c * NK * TILE..(c + 1) * NK * TILE];
                        // The pruned step 2's bound terms come with the outputs.
                        let q_c = (!dense).then(|| &mut q[c * TILE..(c + 1) * TILE]);
                        non_finite |= filter_bank_with_bound(row, wt, t0, out, q_c);
                    }
                    if dense {
                        centre_response(b, sites, weights, nsz, as_t, imax_t);
                        neighbour_max(as_t, neighbours, nc2, amax_t);
                        (Vec::new(), non_finite)
                    } else {
                        let mut cands = Vec::new();
                        done.resize(nf * CHUNKS, 0);
                        let tile = PrunedTile {
                            sites,
                            weights,
                            weight_max,
                            nsz,
                            th,
                            t0,
                            nt_w,
                            q_ready: true,
                            flanks: Some(span),
                        };
                        centre_response_pruned_into(
                            b,
                            q,
                            &tile,
                            as_t,
                            imax_t,
                            Some(&mut done[..]),
                            &mut cands,
                        );
                        chunk_maxima(as_t, done, cmax_t);
                        // While the tile is in cache: drop the candidates that
                        // a larger As within the tile already rules out.
                        let tile_as = TileAs { t0, as_t, cmax_t };
                        cands.retain(|&(j, t)| {
                            !tile_as.beaten(span, neighbours, nc2, j as usize, t as usize)
                        });
                        (cands, non_finite)
                    }
                })
            })
            .collect();
        let mut non_finite = false;
        self.candidates = per_tile
            .into_iter()
            .map(|(c, nf)| {
                non_finite |= nf;
                c
            })
            .collect();
        non_finite
    }

    /// Steps 3–4. Dense: Kilosort4's order (neighbour max, edge zeroing, ±nt0min
    /// max-pool, comparison) on whole rows. Sparse: only where As > Th_universal,
    /// the same comparison against the largest As over the iC2 neighbours and the
    /// ±nt0min samples outside the zeroed edges; values at or below the threshold
    /// can neither win nor tie with a candidate, so the detections are the same.
    fn local_peaks(&self, dense: bool) -> Vec<(u32, u64)> {
        let nf = self.geometry.n_centres();
        let nt_w = self.nt_window;
        let nt = self.settings.nt;
        let half = self.settings.nt0min();
        let th = self.settings.th_universal;
        let nc2 = self.geometry.n_neighbours();
        if dense {
            let per_centre: Vec<Vec<(u32, u64)>> = (0..nf)
                .into_par_iter()
                .map(|j| {
                    let as_row: Vec<f32> =
                        (0..nt_w).map(|t| self.as_buf[self.index(j, t)]).collect();
                    let mut amax_row: Vec<f32> =
                        (0..nt_w).map(|t| self.amax_buf[self.index(j, t)]).collect();
                    local_peaks(&as_row, &mut amax_row, nt, half, th)
                        .into_iter()
                        .map(|t| (j as u32, t as u64))
                        .collect()
                })
                .collect();
            return per_centre.into_iter().flatten().collect();
        }
        // Candidates: every (j, t) with As > Th that steps 1–3 did not already
        // rule out within its tile. Each is tested in full on its own (its
        // range may reach into the tiles beside); the few detections are
        // then put in (centre, sample) order (the pairs are distinct).
        let span = PeakSpan::of(&self.settings, nt_w);
        let mut peaks: Vec<(u32, u64)> = self
            .candidates
            .par_iter()
            .flat_map_iter(|tile| tile.iter().copied())
            .filter(|&(j, t)| {
                let (j, t) = (j as usize, t as usize);
                let v = self.as_buf[self.index(j, t)];
                let (lo, hi) = span.range(t);
                // The samples beside t first, then the own row: most
                // candidates lie on a spike's flank and fail there.
                let (lo1, hi1) = span.beside(t);
                if let Against::Above = self.row_against(j, lo1, hi1, v) {
                    return false;
                }
                let mut equal = false;
                for n in std::iter::once(j).chain(
                    self.neighbours[j * nc2..(j + 1) * nc2]
                        .iter()
                        .map(|&n| n as usize)
                        .filter(|&n| n != j),
                ) {
                    match self.row_against(n, lo, hi, v) {
                        Against::Above => return false,
                        Against::Equal => equal = true,
                        Against::Below => {}
                    }
                }
                equal
            })
            .collect();
        peaks.par_sort_unstable();
        peaks
    }

    fn features(&self, x: ArrayView2<f32>, yc: &[f32], peaks: &[(u32, u64)]) -> Detections {
        let nc = self.geometry.n_chans();
        let npc = if self.pc_features {
            self.settings.n_pcs
        } else {
            0
        };
        let mut d = Detections {
            n_chans: nc,
            n_pcs: npc,
            ..Detections::default()
        };
        let rows: Vec<_> = peaks
            .par_iter()
            .map(|&(j, t)| {
                let code = self.imax_buf[self.index(j as usize, t as usize)];
                let amp = self.as_buf[self.index(j as usize, t as usize)];
                let sites = &self.sites[j as usize * nc..(j as usize + 1) * nc];
                features(x, &self.templates, sites, yc, t as usize, code, npc).with(j, t, amp)
            })
            .collect();
        for r in rows {
            d.centre.push(r.centre);
            d.sample.push(r.sample);
            d.amp.push(r.amp);
            d.imax.push(r.imax);
            d.sign.push(r.sign);
            d.adist.extend_from_slice(&r.adist);
            d.yct.push(r.yct);
            d.tf.extend_from_slice(&r.tf);
        }
        d
    }
}

/// Checks a whitened window `x` (C × NT) against the probe's site depths `yc`
/// (C values) and the geometry, for every back end.
///
/// # Errors
/// [`DetectError::Input`] when `x` has a different number of rows than the
/// probe has sites, is shorter than 2·nt + 1 samples, or holds a non-finite value.
pub(crate) fn check_window(
    geometry: &Geometry,
    settings: &DetectionSettings,
    x: ArrayView2<f32>,
    yc: &[f32],
) -> Result<(), DetectError> {
    check_window_shape(geometry, settings, x, yc)?;
    check_finite(x)
}

/// [`check_window`] without the scan for non-finite values (the CPU
/// detector learns of those from step 1's outputs).
///
/// # Errors
/// [`DetectError::Input`] when `x` has a different number of rows than the
/// probe has sites or is shorter than 2·nt + 1 samples.
fn check_window_shape(
    geometry: &Geometry,
    settings: &DetectionSettings,
    x: ArrayView2<f32>,
    yc: &[f32],
) -> Result<(), DetectError> {
    let (c, nt_w) = x.dim();
    let n_sites = yc.len();
    let bad = |message: String| {
        Err(DetectError::Input {
            what: "window".into(),
            message,
        })
    };
    if c != n_sites {
        return bad(format!(
            "has {c} rows (channels) but the probe has {n_sites} sites; rows must be the probe's sites in channel-map order"
        ));
    }
    if let Some(&m) = geometry.i_c.iter().max()
        && m as usize >= c
    {
        return bad(format!("iC refers to site {m} but the window has {c} rows"));
    }
    let nt = settings.nt;
    if nt_w < 2 * nt + 1 {
        return bad(format!(
            "has {nt_w} samples; a window needs at least 2·nt + 1 = {} (nt = {nt} samples of padding on each side)",
            2 * nt + 1
        ));
    }
    Ok(())
}

/// Fails with [`DetectError::Input`], naming the channel and sample, when the
/// window `x` holds a NaN or ±∞.
fn check_finite(x: ArrayView2<f32>) -> Result<(), DetectError> {
    let nt_w = x.ncols();
    // A branch-free scan first (NaN and ±∞ have all exponent bits set); the
    // position is looked for only when there is one.
    let all_finite = match x.as_slice() {
        Some(xs) => xs.par_chunks(1 << 16).all(|c| {
            c.iter().fold(0u32, |a, v| {
                a | u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000)
            }) == 0
        }),
        None => x.iter().all(|v| v.is_finite()),
    };
    if !all_finite && let Some((i, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(DetectError::Input {
            what: "window".into(),
            message: format!(
                "holds a non-finite value ({v}) at channel {}, sample {}",
                i / nt_w,
                i % nt_w
            ),
        });
    }
    Ok(())
}

/// Number of universal temporal templates (rows of wTEMP); checked by
/// [`DetectionSettings::validate`].
pub const NK: usize = 6;
const _: () = assert!(
    NK.is_multiple_of(2),
    "centre_response handles templates in pairs"
);
/// Samples handled together in the inner loops (one 256-bit vector of f32).
const LANES: usize = 8;
/// Samples per group of the coarse pruning bound in [`centre_response_pruned`].
pub const GROUP: usize = 32;
/// Groups per tile.
const N_GROUPS: usize = TILE / GROUP;
/// Chunks of [`LANES`] samples per tile.
const CHUNKS: usize = TILE / LANES;
// One row of a tile: its samples as the bits of a u128, its chunks as a u16.
const _: () = assert!(TILE == 128 && CHUNKS <= 16);
const _: () = assert!(TILE.is_multiple_of(GROUP) && GROUP.is_multiple_of(2 * LANES));

/// Scratch values [`centre_response_pruned`] needs for `n_ch` channels: the
/// per-sample bound terms (C·TILE) and the per-group ones (C·TILE/[`GROUP`]).
pub fn pruned_scratch_len(n_ch: usize) -> usize {
    n_ch * (TILE + N_GROUPS)
}

/// Runs `$body` compiled for AVX2 when the CPU has it, else for the baseline.
/// Both compile the same scalar code; there is no fused multiply-add in either,
/// so both give the same bits.
macro_rules! dispatch {
    ($name:ident, $generic:ident, ($($arg:ident: $ty:ty),*)) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        fn $name($($arg: $ty),*) {
            $generic($($arg),*)
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { $name($($arg),*) };
            return;
        }
        $generic($($arg),*)
    };
}

/// Step 1 for one channel and one tile: `out[k·TILE + i]` = B\[k, t0 + i\] =
/// Σ_m wTEMP\[k, m\]·x\[t0 + i + m − 30\] for i < [`TILE`], with x = 0 outside the
/// window (torch `conv1d` with zero padding: a cross-correlation). The sum runs
/// over m in ascending order. `wtemp` is 6 × 61 row-major; `out` holds 6·TILE values.
pub fn filter_bank(x: &[f32], wtemp: &[f32], t0: usize, out: &mut [f32]) {
    filter_bank_with_bound(x, &taps_by_tap(wtemp), t0, out, None);
}

/// The universal templates by tap: `wt[m][k]` = wTEMP\[k, m\] for the nt
/// taps of `wtemp` (6 × nt row-major), one fixed-size row per tap, the
/// layout [`filter_bank_with_bound`] reads. Built once per window, not per
/// channel and tile.
fn taps_by_tap(wtemp: &[f32]) -> Vec<[f32; NK]> {
    let ntaps = wtemp.len() / NK;
    (0..ntaps)
        .map(|m| std::array::from_fn(|k| wtemp[k * ntaps + m]))
        .collect()
}

/// [`filter_bank`], also writing, when `q` is given (TILE values), the
/// pruning bound's per-sample term `q[i]` = max_k |B\[k, t0 + i\]| (k
/// ascending, from 0) while the outputs are still in registers: the same
/// operations [`centre_response_pruned`] does on the stored B, so the same bits.
/// `wt` holds the weights by tap ([`taps_by_tap`]), at most 129 taps.
/// Returns whether some B\[0, t0 + i\] is NaN or ±∞.
fn filter_bank_with_bound(
    x: &[f32],
    wt: &[[f32; NK]],
    t0: usize,
    out: &mut [f32],
    q: Option<&mut [f32]>,
) -> bool {
    let ntaps = wt.len();
    let half = ntaps / 2;
    // Input samples t0 − half .. t0 + TILE + half, zero outside the window:
    // seg[i] = x[t0 + i − half]. A tile inside the window reads x in place;
    // one at an edge copies its part into a zero-padded buffer (made only
    // there: most tiles need none).
    let need = TILE + ntaps - 1;
    let mut pad;
    let seg: &[f32] = if t0 >= half && t0 - half + need <= x.len() {
        &x[t0 - half..t0 - half + need]
    } else {
        pad = [0f32; TILE + 2 * 64];
        let lo = half.saturating_sub(t0);
        let hi = (x.len() + half).saturating_sub(t0).min(need);
        if lo < hi {
            let src = t0 + lo - half;
            pad[lo..hi].copy_from_slice(&x[src..src + (hi - lo)]);
        }
        &pad[..need]
    };
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::avx512() {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { filter_taps_avx512(seg, wt, out, q) };
        }
        #[target_feature(enable = "avx2")]
        fn avx2(seg: &[f32], wt: &[[f32; NK]], out: &mut [f32], q: Option<&mut [f32]>) -> bool {
            filter_taps(seg, wt, out, q)
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(seg, wt, out, q) };
        }
    }
    filter_taps(seg, wt, out, q)
}

/// The sums of [`filter_bank_with_bound`] over `seg` (TILE + taps − 1
/// samples) with the weights by tap `wt`, in [`LANES`]-wide vectors.
/// Returns whether some output of template 0 is NaN or ±∞.
#[inline(always)]
fn filter_taps(seg: &[f32], wt: &[[f32; NK]], out: &mut [f32], mut q: Option<&mut [f32]>) -> bool {
    let ntaps = wt.len();
    let mut non_finite = 0u32;
    // 16 samples (two vectors) per pass over the taps: each loaded weight
    // serves twice, and the 12 sums are independent. Every sum still adds its
    // terms in ascending m, so the bits do not depend on this arrangement.
    for tc in (0..TILE).step_by(2 * LANES) {
        let mut acc0 = [[0f32; LANES]; NK];
        let mut acc1 = [[0f32; LANES]; NK];
        let s = &seg[tc..tc + ntaps - 1 + 2 * LANES];
        for (m, w) in wt.iter().enumerate() {
            let x0: &[f32; LANES] = s[m..m + LANES].try_into().expect("8 lanes");
            let x1: &[f32; LANES] = s[m + LANES..m + 2 * LANES].try_into().expect("8 lanes");
            for k in 0..NK {
                for l in 0..LANES {
                    acc0[k][l] += w[k] * x0[l];
                    acc1[k][l] += w[k] * x1[l];
                }
            }
        }
        for k in 0..NK {
            out[k * TILE + tc..k * TILE + tc + LANES].copy_from_slice(&acc0[k]);
            out[k * TILE + tc + LANES..k * TILE + tc + 2 * LANES].copy_from_slice(&acc1[k]);
        }
        // NaN and ±∞ have every exponent bit set.
        for v in acc0[0].iter().chain(&acc1[0]) {
            non_finite |= u32::from(v.to_bits() & 0x7f80_0000 == 0x7f80_0000);
        }
        if let Some(q) = q.as_deref_mut() {
            let (mut m0, mut m1) = ([0f32; LANES], [0f32; LANES]);
            for k in 0..NK {
                for l in 0..LANES {
                    m0[l] = m0[l].max(acc0[k][l].abs());
                    m1[l] = m1[l].max(acc1[k][l].abs());
                }
            }
            q[tc..tc + LANES].copy_from_slice(&m0);
            q[tc + LANES..tc + 2 * LANES].copy_from_slice(&m1);
        }
    }
    non_finite != 0
}

/// [`filter_taps`] on AVX-512: 32 samples (two 16-lane vectors) a pass over
/// the taps, 12 running sums in registers. Each sum is the same chain of
/// separate multiplies and adds in ascending tap order, so the same bits; the
/// bound's max keeps the running value on a NaN as `f32::max` does.
/// Returns whether some output of template 0 is NaN or ±∞.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn filter_taps_avx512(
    seg: &[f32],
    wt: &[[f32; NK]],
    out: &mut [f32],
    mut q: Option<&mut [f32]>,
) -> bool {
    use std::arch::x86_64::*;
    const W: usize = 16;
    // NaN and ±∞ have every exponent bit set.
    let exponent = _mm512_set1_epi32(0x7f80_0000);
    let mut non_finite: __mmask16 = 0;
    let ntaps = wt.len();
    assert!(seg.len() >= TILE + ntaps - 1 && out.len() >= NK * TILE);
    assert!(q.as_ref().is_none_or(|q| q.len() >= TILE));
    let sp = seg.as_ptr();
    for tc in (0..TILE).step_by(2 * W) {
        let mut acc0 = [_mm512_setzero_ps(); NK];
        let mut acc1 = [_mm512_setzero_ps(); NK];
        for (m, w) in wt.iter().enumerate() {
            // SAFETY: tc + m + 2·W ≤ TILE + ntaps − 1 ≤ seg.len() (asserted).
            let (x0, x1) = unsafe {
                (
                    _mm512_loadu_ps(sp.add(tc + m)),
                    _mm512_loadu_ps(sp.add(tc + m + W)),
                )
            };
            for k in 0..NK {
                let wk = _mm512_set1_ps(w[k]);
                acc0[k] = _mm512_add_ps(acc0[k], _mm512_mul_ps(wk, x0));
                acc1[k] = _mm512_add_ps(acc1[k], _mm512_mul_ps(wk, x1));
            }
        }
        for a in [acc0[0], acc1[0]] {
            let e = _mm512_and_si512(_mm512_castps_si512(a), exponent);
            non_finite |= _mm512_cmpeq_epi32_mask(e, exponent);
        }
        let op = out.as_mut_ptr();
        for k in 0..NK {
            // SAFETY: k·TILE + tc + 2·W ≤ NK·TILE ≤ out.len() (asserted).
            unsafe {
                _mm512_storeu_ps(op.add(k * TILE + tc), acc0[k]);
                _mm512_storeu_ps(op.add(k * TILE + tc + W), acc1[k]);
            }
        }
        if let Some(q) = q.as_deref_mut() {
            let (mut m0, mut m1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            for k in 0..NK {
                // max(v, m) returns m when v is NaN, as m.max(v) does; the
                // magnitudes are never −0, so ties cannot differ in sign.
                m0 = _mm512_max_ps(_mm512_abs_ps(acc0[k]), m0);
                m1 = _mm512_max_ps(_mm512_abs_ps(acc1[k]), m1);
            }
            let qp = q.as_mut_ptr();
            // SAFETY: tc + 2·W ≤ TILE ≤ q.len() (asserted).
            unsafe {
                _mm512_storeu_ps(qp.add(tc), m0);
                _mm512_storeu_ps(qp.add(tc + W), m1);
            }
        }
    }
    non_finite != 0
}

/// Step 2 for one tile: for every centre j (its nC sites `sites[j·nC ..]`, weights
/// `weights[(j·nC + c)·nsz + s]`) and sample, A\[r\] = Σ_c weigh\[s, c, j\]·B\[iC\[c, j\], k, t\]
/// for the nsz·6 pairs r = s·6 + k (sum over c ascending), then
/// `as_t[j·TILE + t]` = max_r |A\[r\]| and `imax_t[j·TILE + t]` = (1 + r\*)·sign(A\[r\*\]),
/// r\* the smallest r attaining the maximum (torch's first-index rule). `b` is the
/// tile of step 1, laid out \[channel\]\[k\]\[TILE\]. nsz must be 1 to 8.
pub fn centre_response(
    b: &[f32],
    sites: &[u32],
    weights: &[f32],
    nsz: usize,
    as_t: &mut [f32],
    imax_t: &mut [i8],
) {
    dispatch!(
        centre_response_avx2,
        centre_response_sizes,
        (b: &[f32], sites: &[u32], weights: &[f32], nsz: usize, as_t: &mut [f32], imax_t: &mut [i8])
    );
}

#[inline(always)]
fn centre_response_sizes(
    b: &[f32],
    sites: &[u32],
    weights: &[f32],
    nsz: usize,
    as_t: &mut [f32],
    imax_t: &mut [i8],
) {
    match nsz {
        1 => centre_response_impl::<1>(b, sites, weights, as_t, imax_t),
        2 => centre_response_impl::<2>(b, sites, weights, as_t, imax_t),
        3 => centre_response_impl::<3>(b, sites, weights, as_t, imax_t),
        4 => centre_response_impl::<4>(b, sites, weights, as_t, imax_t),
        5 => centre_response_impl::<5>(b, sites, weights, as_t, imax_t),
        6 => centre_response_impl::<6>(b, sites, weights, as_t, imax_t),
        7 => centre_response_impl::<7>(b, sites, weights, as_t, imax_t),
        8 => centre_response_impl::<8>(b, sites, weights, as_t, imax_t),
        _ => unreachable!("template_sizes is validated to 1..=8"),
    }
}

#[inline(always)]
fn centre_response_impl<const NSZ: usize>(
    b: &[f32],
    sites: &[u32],
    weights: &[f32],
    as_t: &mut [f32],
    imax_t: &mut [i8],
) {
    let nf = as_t.len() / TILE;
    let nc = sites.len() / nf;
    for j in 0..nf {
        let s_j = &sites[j * nc..(j + 1) * nc];
        let w_j = &weights[j * nc * NSZ..(j + 1) * nc * NSZ];
        for tc in (0..TILE).step_by(LANES) {
            let at = j * TILE + tc;
            respond_chunk::<NSZ>(
                b,
                s_j,
                w_j,
                tc,
                &mut as_t[at..at + LANES],
                &mut imax_t[at..at + LANES],
            );
        }
    }
}

/// Step 2 for one centre and 8 samples `tc ..`: writes best |A| and (1 + r)·sign.
#[inline(always)]
fn respond_chunk<const NSZ: usize>(
    b: &[f32],
    s_j: &[u32],
    w_j: &[f32],
    tc: usize,
    as_out: &mut [f32],
    imax_out: &mut [i8],
) {
    let nc = s_j.len();
    // All nsz·6 outputs for these 8 samples, a[s][k], r = s·6 + k (sized by
    // nsz rather than the largest nsz: less to zero per chunk).
    let mut a = [[[0f32; LANES]; NK]; NSZ];
    // Two templates at a time: 2·nsz independent sums keep the adders busy.
    for k in (0..NK).step_by(2) {
        let mut acc0 = [[0f32; LANES]; NSZ];
        let mut acc1 = [[0f32; LANES]; NSZ];
        for c in 0..nc {
            let off = (s_j[c] as usize * NK + k) * TILE + tc;
            let row0: &[f32; LANES] = b[off..off + LANES].try_into().expect("8 lanes");
            let row1: &[f32; LANES] = b[off + TILE..off + TILE + LANES]
                .try_into()
                .expect("8 lanes");
            for s in 0..NSZ {
                let w = w_j[c * NSZ + s];
                for l in 0..LANES {
                    acc0[s][l] += w * row0[l];
                    acc1[s][l] += w * row1[l];
                }
            }
        }
        for s in 0..NSZ {
            a[s][k] = acc0[s];
            a[s][k + 1] = acc1[s];
        }
    }
    let a = a.as_flattened();
    // The largest |A|, first r among equals (a strict > in ascending r).
    let mut best = [0f32; LANES];
    // r kept as f32 so that the selects below are plain vector blends.
    let mut r_best = [0f32; LANES];
    let mut value = a[0];
    for l in 0..LANES {
        best[l] = a[0][l].abs();
    }
    // A slice from r = 1 rather than `.skip(1)`: the Skip adapter was left
    // as a call in this loop, which spilled every vector around it.
    for (i, a_r) in a[1..].iter().enumerate() {
        let r = i + 1;
        for l in 0..LANES {
            let v = a_r[l].abs();
            let take = v > best[l];
            best[l] = if take { v } else { best[l] };
            r_best[l] = if take { r as f32 } else { r_best[l] };
            value[l] = if take { a_r[l] } else { value[l] };
        }
    }
    for l in 0..LANES {
        let sign: i8 = if value[l] > 0.0 {
            1
        } else if value[l] < 0.0 {
            -1
        } else {
            0
        };
        as_out[l] = best[l];
        imax_out[l] = (r_best[l] as i8 + 1) * sign;
    }
}

/// Step 2 computed exactly only where it can matter. By the triangle
/// inequality, |A\[s, k\]| ≤ L = Σ_c max_s |weigh\[s, c, j\]|·max_k |B\[iC\[c, j\], k, t\]|,
/// so where L (with a 1 % margin for float32 rounding) stays below
/// Th_universal, no |A| can exceed the threshold: As is set to 0 and imax to 0
/// there, values that can neither be detected nor beat or tie a detection.
/// Elsewhere the values are exactly those of [`centre_response`]. `q` is scratch
/// of at least [`pruned_scratch_len`]`(C)` values.
///
/// The rounding margin: the computed |A| is at most (1 + γ)·Σ_c |w·B| and the
/// computed L at least (1 − γ)·Σ_c |w|·max_k |B|, γ ≈ nC·2⁻²⁴, so 1 % covers any
/// neighbourhood under about 80 000 sites.
///
/// The bound is first checked per [`GROUP`] samples, with each site's largest
/// max_k |B| over the group: float32 sums of non-negative products are
/// monotone in each factor, so a group whose coarse L stays below the threshold
/// has every per-sample L below it too, and the chunks computed are exactly
/// those of the per-sample check alone.
#[allow(clippy::too_many_arguments)]
pub fn centre_response_pruned(
    b: &[f32],
    q: &mut [f32],
    sites: &[u32],
    weights: &[f32],
    nsz: usize,
    th: f32,
    as_t: &mut [f32],
    imax_t: &mut [i8],
) {
    let weight_max: Vec<f32> = weights.chunks_exact(nsz).map(largest_magnitudes).collect();
    let tile = PrunedTile {
        sites,
        weights,
        weight_max: &weight_max,
        nsz,
        th,
        t0: 0,
        nt_w: 0,
        q_ready: false,
        flanks: None,
    };
    centre_response_pruned_into(b, q, &tile, as_t, imax_t, None, &mut Vec::new());
}

/// The constants of [`centre_response_pruned`] for one tile, and where the
/// tile lies: first sample `t0` of a window of `nt_w` samples (candidates are
/// gathered only below `nt_w`; none when it is 0).
struct PrunedTile<'a> {
    sites: &'a [u32],
    weights: &'a [f32],
    /// Per centre and site, max over sizes of |weigh| (Nf × nC).
    weight_max: &'a [f32],
    nsz: usize,
    th: f32,
    t0: usize,
    nt_w: usize,
    /// Whether the scratch's per-sample bound terms (its first C·TILE
    /// values) were already written by [`filter_bank_with_bound`].
    q_ready: bool,
    /// With a span: a candidate is not gathered when the sample before or
    /// after it in its own row, within the tile and the span's valid
    /// samples, holds a larger As (it would fail the first comparison of
    /// [`CpuDetector::local_peaks`]).
    flanks: Option<PeakSpan>,
}

/// [`centre_response_pruned`], also appending to `cands` the (centre, sample)
/// pairs where As > Th_universal, in centre then sample order, as each
/// centre's row is computed (pruned chunks hold none; with `tile.flanks`,
/// those beside a larger As of their row are left out). With `done` (nf × [`CHUNKS`]
/// flags), a pruned chunk is marked 0 there and its As and imax are left as
/// they were instead of zeroed; a computed one is marked 1.
#[allow(clippy::too_many_arguments)]
fn centre_response_pruned_into(
    b: &[f32],
    q: &mut [f32],
    tile: &PrunedTile,
    as_t: &mut [f32],
    imax_t: &mut [i8],
    done: Option<&mut [u8]>,
    cands: &mut Vec<(u32, u64)>,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(wide) = Lanes16::detect() {
        #[target_feature(enable = "avx512f")]
        #[allow(clippy::too_many_arguments)]
        fn avx512(
            b: &[f32],
            q: &mut [f32],
            tile: &PrunedTile,
            as_t: &mut [f32],
            imax_t: &mut [i8],
            done: Option<&mut [u8]>,
            cands: &mut Vec<(u32, u64)>,
            wide: Lanes16,
        ) {
            centre_response_pruned_sizes(b, q, tile, as_t, imax_t, done, cands, wide)
        }
        // SAFETY: the CPU supports AVX-512F (`Lanes16::detect`).
        unsafe { avx512(b, q, tile, as_t, imax_t, done, cands, wide) };
        return;
    }
    let narrow = Lanes8;
    dispatch!(
        centre_response_pruned_avx2,
        centre_response_pruned_sizes,
        (b: &[f32], q: &mut [f32], tile: &PrunedTile, as_t: &mut [f32], imax_t: &mut [i8], done: Option<&mut [u8]>, cands: &mut Vec<(u32, u64)>, narrow: Lanes8)
    );
}

/// Step 2's exact values for two adjacent chunks of one centre: samples
/// `tc .. tc + 2·LANES` of the tile, written to `as_out` and `imax_out` as
/// [`respond_chunk`] writes them. Only the chunks whose `pass` flag is set
/// need be written.
trait PairResponse: Copy {
    #[allow(clippy::too_many_arguments)]
    fn respond_pair<const NSZ: usize>(
        self,
        b: &[f32],
        s_j: &[u32],
        w_j: &[f32],
        tc: usize,
        pass: [bool; 2],
        as_out: &mut [f32; 2 * LANES],
        imax_out: &mut [i8; 2 * LANES],
    );
}

/// [`respond_chunk`] on each chunk that passed.
#[derive(Clone, Copy)]
struct Lanes8;

impl PairResponse for Lanes8 {
    #[inline(always)]
    fn respond_pair<const NSZ: usize>(
        self,
        b: &[f32],
        s_j: &[u32],
        w_j: &[f32],
        tc: usize,
        pass: [bool; 2],
        as_out: &mut [f32; 2 * LANES],
        imax_out: &mut [i8; 2 * LANES],
    ) {
        for (h, &p) in pass.iter().enumerate() {
            if p {
                let r = h * LANES..(h + 1) * LANES;
                respond_chunk::<NSZ>(
                    b,
                    s_j,
                    w_j,
                    tc + h * LANES,
                    &mut as_out[r.clone()],
                    &mut imax_out[r],
                );
            }
        }
    }
}

/// Both chunks at once in 16-lane AVX-512 vectors ([`respond16_avx512`]).
/// Only [`Lanes16::detect`] makes one, so holding one proves the CPU has
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Lanes16(());

#[cfg(target_arch = "x86_64")]
impl Lanes16 {
    fn detect() -> Option<Lanes16> {
        crate::simd::avx512().then_some(Lanes16(()))
    }
}

#[cfg(target_arch = "x86_64")]
impl PairResponse for Lanes16 {
    #[inline(always)]
    fn respond_pair<const NSZ: usize>(
        self,
        b: &[f32],
        s_j: &[u32],
        w_j: &[f32],
        tc: usize,
        _pass: [bool; 2],
        as_out: &mut [f32; 2 * LANES],
        imax_out: &mut [i8; 2 * LANES],
    ) {
        // SAFETY: a Lanes16 exists only on a CPU with AVX-512F.
        unsafe { respond16_avx512::<NSZ>(b, s_j, w_j, tc, as_out, imax_out) }
    }
}

/// [`respond_chunk`] for 16 samples `tc ..` in AVX-512 vectors: every lane
/// is the same chain of separate multiplies and adds over the sites in
/// ascending order, and the same strict-greater scan over r ascending, so
/// the same bits as two calls of [`respond_chunk`].
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn respond16_avx512<const NSZ: usize>(
    b: &[f32],
    s_j: &[u32],
    w_j: &[f32],
    tc: usize,
    as_out: &mut [f32; 2 * LANES],
    imax_out: &mut [i8; 2 * LANES],
) {
    use std::arch::x86_64::*;
    const W: usize = 2 * LANES;
    const KS: usize = 3;
    const _: () = assert!(W == 16 && NK.is_multiple_of(KS));
    assert!(tc + W <= TILE && w_j.len() >= s_j.len() * NSZ);
    // A[s][k], sized by nsz rather than the largest nsz (less to zero per
    // pair).
    let mut a = [[_mm512_setzero_ps(); NK]; NSZ];
    // Three templates at a time: 3·nsz independent sums in registers.
    for k in (0..NK).step_by(KS) {
        let mut acc = [[_mm512_setzero_ps(); NSZ]; KS];
        for (c, &site) in s_j.iter().enumerate() {
            let off = (site as usize * NK + k) * TILE + tc;
            let rows: &[f32] = &b[off..off + (KS - 1) * TILE + W];
            // SAFETY: each load reads W values of `rows`: i·TILE + W ≤ its length.
            let x: [__m512; KS] =
                std::array::from_fn(|i| unsafe { _mm512_loadu_ps(rows.as_ptr().add(i * TILE)) });
            for s in 0..NSZ {
                let w = _mm512_set1_ps(w_j[c * NSZ + s]);
                for i in 0..KS {
                    acc[i][s] = _mm512_add_ps(acc[i][s], _mm512_mul_ps(w, x[i]));
                }
            }
        }
        for s in 0..NSZ {
            for i in 0..KS {
                a[s][k + i] = acc[i][s];
            }
        }
    }
    // The largest |A|, first r among equals (a strict > in ascending r =
    // s·6 + k; an unordered comparison is false, as `>` is on a NaN).
    let a = a.as_flattened();
    let mut best = _mm512_abs_ps(a[0]);
    let mut value = a[0];
    let mut r_best = _mm512_setzero_ps();
    // A slice from r = 1 rather than `.skip(1)`: the Skip adapter was left
    // as a call in this loop, which spilled every vector around it. r is
    // counted in a vector (small integers are exact in f32) rather than
    // converted and broadcast each time.
    let mut r_vec = _mm512_set1_ps(1.0);
    for &a_r in &a[1..] {
        let v = _mm512_abs_ps(a_r);
        let take = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(v, best);
        best = _mm512_mask_blend_ps(take, best, v);
        r_best = _mm512_mask_blend_ps(take, r_best, r_vec);
        value = _mm512_mask_blend_ps(take, value, a_r);
        r_vec = _mm512_add_ps(r_vec, _mm512_set1_ps(1.0));
    }
    let zero = _mm512_setzero_ps();
    let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(value, zero);
    let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(value, zero);
    let r1 = _mm512_add_epi32(_mm512_cvttps_epi32(r_best), _mm512_set1_epi32(1));
    let signed = _mm512_or_si512(
        _mm512_maskz_mov_epi32(positive, r1),
        _mm512_maskz_sub_epi32(negative, _mm512_setzero_si512(), r1),
    );
    // SAFETY: both outputs hold W values.
    unsafe {
        _mm512_storeu_ps(as_out.as_mut_ptr(), best);
        _mm_storeu_si128(
            imax_out.as_mut_ptr().cast::<__m128i>(),
            _mm512_cvtepi32_epi8(signed),
        );
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn centre_response_pruned_sizes(
    b: &[f32],
    q: &mut [f32],
    tile: &PrunedTile,
    as_t: &mut [f32],
    imax_t: &mut [i8],
    done: Option<&mut [u8]>,
    cands: &mut Vec<(u32, u64)>,
    respond: impl PairResponse,
) {
    let n_ch = b.len() / (NK * TILE);
    let (q, qg) = q[..pruned_scratch_len(n_ch)].split_at_mut(n_ch * TILE);
    // q[c, t] = max_k |B[c, k, t]|; qg[c, g] = max over group g's samples of q[c, t].
    for (c, (qc, qgc)) in q
        .chunks_exact_mut(TILE)
        .zip(qg.chunks_exact_mut(N_GROUPS))
        .enumerate()
    {
        if !tile.q_ready {
            let bc = &b[c * NK * TILE..(c + 1) * NK * TILE];
            for (t, v) in qc.iter_mut().enumerate() {
                let mut m = 0f32;
                for k in 0..NK {
                    m = m.max(bc[k * TILE + t].abs());
                }
                *v = m;
            }
        }
        for (g, v) in qgc.iter_mut().enumerate() {
            *v = qc[g * GROUP..(g + 1) * GROUP]
                .iter()
                .fold(0f32, |m, &x| m.max(x));
        }
    }
    let (q, qg) = (&*q, &*qg);
    match tile.nsz {
        1 => pruned_impl::<1>(b, q, qg, tile, as_t, imax_t, done, cands, respond),
        2 => pruned_impl::<2>(b, q, qg, tile, as_t, imax_t, done, cands, respond),
        3 => pruned_impl::<3>(b, q, qg, tile, as_t, imax_t, done, cands, respond),
        4 => pruned_impl::<4>(b, q, qg, tile, as_t, imax_t, done, cands, respond),
        5 => pruned_impl::<5>(b, q, qg, tile, as_t, imax_t, done, cands, respond),
        6 => pruned_impl::<6>(b, q, qg, tile, as_t, imax_t, done, cands, respond),
        7 => pruned_impl::<7>(b, q, qg, tile, as_t, imax_t, done, cands, respond),
        8 => pruned_impl::<8>(b, q, qg, tile, as_t, imax_t, done, cands, respond),
        _ => unreachable!("template_sizes is validated to 1..=8"),
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pruned_impl<const NSZ: usize>(
    b: &[f32],
    q: &[f32],
    qg: &[f32],
    tile: &PrunedTile,
    as_t: &mut [f32],
    imax_t: &mut [i8],
    mut done: Option<&mut [u8]>,
    cands: &mut Vec<(u32, u64)>,
    respond: impl PairResponse,
) {
    let PrunedTile {
        sites,
        weights,
        weight_max,
        th,
        t0,
        nt_w,
        flanks,
        ..
    } = *tile;
    let nsz = NSZ;
    let nf = as_t.len() / TILE;
    let nc = sites.len() / nf;
    let mut as_pair = [0f32; 2 * LANES];
    let mut imax_pair = [0i8; 2 * LANES];
    for j in 0..nf {
        let s_j = &sites[j * nc..(j + 1) * nc];
        let w_j = &weights[j * nc * nsz..(j + 1) * nc * nsz];
        let wm_j = &weight_max[j * nc..(j + 1) * nc];
        // The coarse bound of every group at once, sites in the same order as
        // the per-sample bound.
        let mut coarse = [0f32; N_GROUPS];
        for (&site, &w) in s_j.iter().zip(wm_j) {
            let g: &[f32; N_GROUPS] = qg[site as usize * N_GROUPS..][..N_GROUPS]
                .try_into()
                .expect("N_GROUPS values");
            for (v, &m) in coarse.iter_mut().zip(g) {
                *v += w * m;
            }
        }
        let over = |v: f32| v * 1.01 >= th;
        // Row j's lanes above the threshold, and its computed chunks.
        let mut above = 0u128;
        let mut computed = 0u16;
        // Two chunks at a time (one group holds both): each chunk is
        // computed exactly when its own bound lets it through.
        for tp in (0..TILE).step_by(2 * LANES) {
            let mut pass = [false; 2];
            if over(coarse[tp / GROUP]) {
                for (h, p) in pass.iter_mut().enumerate() {
                    let tc = tp + h * LANES;
                    let mut sum = [0f32; LANES];
                    for (&site, &w) in s_j.iter().zip(wm_j) {
                        let qc: &[f32; LANES] = q[site as usize * TILE + tc..][..LANES]
                            .try_into()
                            .expect("8 lanes");
                        for l in 0..LANES {
                            sum[l] += w * qc[l];
                        }
                    }
                    // Every lane compared, no early exit: one vector compare.
                    *p = sum.iter().fold(false, |a, &v| a | over(v));
                }
            }
            if pass.iter().any(|&p| p) {
                respond.respond_pair::<NSZ>(b, s_j, w_j, tp, pass, &mut as_pair, &mut imax_pair);
            }
            for (h, &p) in pass.iter().enumerate() {
                let tc = tp + h * LANES;
                let at = j * TILE + tc;
                let flag = j * CHUNKS + tc / LANES;
                if p {
                    let r = h * LANES..(h + 1) * LANES;
                    as_t[at..at + LANES].copy_from_slice(&as_pair[r.clone()]);
                    imax_t[at..at + LANES].copy_from_slice(&imax_pair[r]);
                    // The lanes above the threshold as bits (one vector
                    // compare), gathered once the row is done.
                    let hits = as_t[at..at + LANES]
                        .iter()
                        .enumerate()
                        .fold(0u32, |m, (l, &v)| m | (u32::from(v > th) << l));
                    above |= u128::from(hits) << tc;
                    computed |= 1 << (tc / LANES);
                    if let Some(d) = done.as_deref_mut() {
                        d[flag] = 1;
                    }
                } else {
                    match done.as_deref_mut() {
                        Some(d) => d[flag] = 0,
                        None => {
                            as_t[at..at + LANES].fill(0.0);
                            imax_t[at..at + LANES].fill(0);
                        }
                    }
                }
            }
        }
        if above != 0 {
            gather_row(
                &as_t[j * TILE..(j + 1) * TILE],
                above,
                computed,
                j as u32,
                t0,
                nt_w,
                flanks,
                cands,
            );
        }
    }
}

/// How a row of As compares with a candidate's value ([`CpuDetector::row_against`]).
enum Against {
    Above,
    Equal,
    Below,
}

/// Appends to `cands` the samples of one row of a tile (`row`: its As,
/// TILE values) whose bits `above` sets, in ascending order, below `nt_w`.
/// With `flanks`, one whose neighbour sample in the row, within the tile and
/// the samples the span compares it with, holds a larger As is left out; a
/// chunk that `computed` does not mark stands for zeros (its values are
/// stale).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn gather_row(
    row: &[f32],
    above: u128,
    computed: u16,
    j: u32,
    t0: usize,
    nt_w: usize,
    flanks: Option<PeakSpan>,
    cands: &mut Vec<(u32, u64)>,
) {
    let mut bits = above;
    while bits != 0 {
        let tt = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let t = t0 + tt;
        if t >= nt_w {
            break;
        }
        if let Some(span) = flanks {
            let v = row[tt];
            let (lo, hi) = span.range(t);
            let beats = |u: usize| {
                (lo..hi).contains(&(t0 + u)) && computed & (1 << (u / LANES)) != 0 && row[u] > v
            };
            if (tt > 0 && beats(tt - 1)) || (tt + 1 < TILE && beats(tt + 1)) {
                continue;
            }
        }
        cands.push((j, t as u64));
    }
}

/// Where step 4 compares a candidate: the ±`half` samples (nt0min) around
/// it, within the samples `lo_valid .. hi_valid` outside the window's zeroed
/// edges (nt at each end).
#[derive(Clone, Copy)]
struct PeakSpan {
    half: usize,
    lo_valid: usize,
    hi_valid: usize,
}

impl PeakSpan {
    /// The span of a window of `nt_w` samples under `settings`.
    fn of(settings: &DetectionSettings, nt_w: usize) -> PeakSpan {
        let nt = settings.nt;
        PeakSpan {
            half: settings.nt0min(),
            lo_valid: nt.min(nt_w),
            hi_valid: nt_w.saturating_sub(nt),
        }
    }

    /// The samples `lo..hi` a candidate at sample `t` is compared with.
    fn range(self, t: usize) -> (usize, usize) {
        (
            t.saturating_sub(self.half).max(self.lo_valid),
            (t + self.half + 1).min(self.hi_valid),
        )
    }

    /// The part of [`PeakSpan::range`] right beside `t` (t − 1 ..= t + 1),
    /// compared first: most candidates lie on a spike's flank.
    fn beside(self, t: usize) -> (usize, usize) {
        let (lo, hi) = self.range(t);
        (t.saturating_sub(1).max(lo), (t + 2).min(hi))
    }
}

/// One tile's As after the pruned steps 1–3: the tile's first sample `t0`,
/// `as_t` (nf × TILE) and its chunk maxima `cmax_t` (nf × [`CHUNKS`],
/// [`chunk_maxima`]).
#[derive(Clone, Copy)]
struct TileAs<'a> {
    t0: usize,
    as_t: &'a [f32],
    cmax_t: &'a [f32],
}

impl TileAs<'_> {
    /// How the As of centre `j` over the window samples `lo..hi`, as far as
    /// they lie in this tile, compare with `v` > 0: some value above it, else
    /// some value equal to it, else all below (a skipped chunk stands for
    /// zeros; NaN is neither above nor equal). Each chunk's maximum settles
    /// most chunks; only a chunk cut by `lo..hi` whose maximum reaches `v` is
    /// read value by value.
    #[inline]
    fn row_against(self, j: usize, lo: usize, hi: usize, v: f32) -> Against {
        let (lo, hi) = (
            lo.max(self.t0) - self.t0,
            hi.min(self.t0 + TILE).saturating_sub(self.t0),
        );
        let row = &self.as_t[j * TILE..(j + 1) * TILE];
        let cm = &self.cmax_t[j * CHUNKS..(j + 1) * CHUNKS];
        let mut equal = false;
        let mut u = lo;
        while u < hi {
            let chunk = u / LANES;
            let (start, end) = (chunk * LANES, (chunk + 1) * LANES);
            if cm[chunk] >= v {
                if lo <= start && end <= hi {
                    if cm[chunk] > v {
                        return Against::Above;
                    }
                    equal = true;
                } else {
                    for &x in &row[u..end.min(hi)] {
                        if x > v {
                            return Against::Above;
                        }
                        equal |= x == v;
                    }
                }
            }
            u = end;
        }
        if equal {
            Against::Equal
        } else {
            Against::Below
        }
    }

    /// Whether candidate (`j`, `t`) of this tile has a larger As within the
    /// tile, in its own row or a neighbour's (`neighbours`: nf × `nc2`),
    /// among the samples `span` compares it with. Such a candidate fails
    /// step 4 ([`CpuDetector::local_peaks`]), so dropping it early leaves the
    /// detections as they were; one that passes here is tested in full there
    /// (its range may reach into the tiles beside this one).
    fn beaten(self, span: PeakSpan, neighbours: &[u32], nc2: usize, j: usize, t: usize) -> bool {
        let v = self.as_t[j * TILE + t - self.t0];
        let above = |n: usize, (lo, hi): (usize, usize)| {
            matches!(self.row_against(n, lo, hi, v), Against::Above)
        };
        above(j, span.beside(t))
            || std::iter::once(j)
                .chain(
                    neighbours[j * nc2..(j + 1) * nc2]
                        .iter()
                        .map(|&n| n as usize),
                )
                .any(|n| above(n, span.range(t)))
    }
}

/// The largest As of each chunk of one tile (`as_t`: nf × TILE; `done`,
/// `cmax`: nf × [`CHUNKS`]) where the pruned step 2 computed it, 0 where it
/// did not. The `v > m` fold passes over NaN, and As = |A| holds no −0.
fn chunk_maxima(as_t: &[f32], done: &[u8], cmax: &mut [f32]) {
    for ((m, &d), run) in cmax.iter_mut().zip(done).zip(as_t.chunks_exact(LANES)) {
        *m = if d != 0 {
            run.iter().fold(0f32, |m, &v| if v > m { v } else { m })
        } else {
            0.0
        };
    }
}

/// Step 3 for one tile: `amax[j·TILE + t] = max_m as[iC2[m, j]·TILE + t]`
/// (`neighbours[j·nC2 + m]` = iC2\[m, j\]).
pub fn neighbour_max(as_t: &[f32], neighbours: &[u32], nc2: usize, amax_t: &mut [f32]) {
    dispatch!(
        neighbour_max_avx2,
        neighbour_max_impl,
        (as_t: &[f32], neighbours: &[u32], nc2: usize, amax_t: &mut [f32])
    );
}

#[inline(always)]
fn neighbour_max_impl(as_t: &[f32], neighbours: &[u32], nc2: usize, amax_t: &mut [f32]) {
    let nf = neighbours.len() / nc2;
    for j in 0..nf {
        let out = &mut amax_t[j * TILE..(j + 1) * TILE];
        let nb = &neighbours[j * nc2..(j + 1) * nc2];
        out.copy_from_slice(&as_t[nb[0] as usize * TILE..][..TILE]);
        for &m in &nb[1..] {
            let row = &as_t[m as usize * TILE..][..TILE];
            // `max` keeps the loop a plain vector max with an unconditional
            // store. A window with a NaN or ±∞, or whose step 1 overflowed,
            // can give NaN here; that is harmless (`max` never panics) and
            // such a window is checked before its values are used.
            for (o, &v) in out.iter_mut().zip(row) {
                *o = o.max(v);
            }
        }
    }
}

/// Step 4 for one centre: zero `amax` in the first and last `nt` samples, then
/// report every t where `as_[t] > th` and `as_[t]` equals the maximum of `amax`
/// over `[t − half, t + half]` clipped to the window (exact float equality).
pub fn local_peaks(as_: &[f32], amax: &mut [f32], nt: usize, half: usize, th: f32) -> Vec<usize> {
    let n = amax.len();
    let edge = nt.min(n);
    amax[..edge].fill(0.0);
    amax[n.saturating_sub(nt)..].fill(0.0);
    let mut out = Vec::new();
    for (t, &v) in as_.iter().enumerate() {
        if v > th {
            let lo = t.saturating_sub(half);
            let hi = (t + half + 1).min(n);
            let m = amax[lo..hi]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
            if v == m {
                out.push(t);
            }
        }
    }
    out
}

/// Step 5 for one detection: what Kilosort4 reports about it.
#[derive(Debug, Clone)]
pub struct Features {
    centre: u32,
    sample: u64,
    amp: f32,
    /// r, 0–29.
    pub imax: u8,
    /// Sign of the winning output.
    pub sign: i8,
    /// nC values.
    pub adist: Vec<f32>,
    /// µm.
    pub yct: f32,
    /// nC × npc values.
    pub tf: Vec<f32>,
}

impl Features {
    fn with(mut self, centre: u32, sample: u64, amp: f32) -> Features {
        self.centre = centre;
        self.sample = sample;
        self.amp = amp;
        self
    }
}

/// Step 5: from the window `x`, the detection at sample `t` whose sites are
/// `sites` (iC\[:, j\]) and whose step-2 code is `code` = (1 + r)·sign:
/// `adist[c]` = sign·B\[sites\[c\], r mod nk, t\] (recomputed exactly as step 1 does),
/// `yct` = Σ_c w_c·yc\[sites\[c\]\] with w = max(adist, 0)/Σ max(adist, 0), and
/// `tf[c·npc + p]` = Σ_i x\[sites\[c\], t − 30 + i\]·wPCA\[p, i\] (zero outside the window).
pub fn features(
    x: ArrayView2<f32>,
    templates: &UniversalTemplates,
    sites: &[u32],
    yc: &[f32],
    t: usize,
    code: i8,
    npc: usize,
) -> Features {
    let nk = templates.wtemp.nrows();
    let ntaps = templates.wtemp.ncols();
    let half = ntaps / 2;
    let r = (code.unsigned_abs() - 1) as usize;
    let sign = code.signum();
    let k = r % nk;
    let nt_w = x.ncols();
    let wk = templates.wtemp.row(k);
    let wk = wk.as_standard_layout();
    let wk = wk.as_slice().expect("standard layout");
    let wpca = templates.wpca.as_standard_layout();
    let wpca = wpca.as_slice().expect("standard layout");
    let mut adist = Vec::with_capacity(sites.len());
    let mut tf = vec![0f32; sites.len() * npc];
    let wstride = templates.wpca.ncols();
    // The site's ntaps samples centred on t, zero outside the window.
    let mut snip = vec![0f32; ntaps];
    let inside = t >= half && t - half + ntaps <= nt_w;
    for (si, &c) in sites.iter().enumerate() {
        let tf_c = &mut tf[si * npc..(si + 1) * npc];
        let row = x.row(c as usize);
        match row.as_slice() {
            Some(r) if inside => snip.copy_from_slice(&r[t - half..t - half + ntaps]),
            _ => {
                for (i, v) in snip.iter_mut().enumerate() {
                    let s = t as isize + i as isize - half as isize;
                    *v = if s >= 0 && (s as usize) < nt_w {
                        row[s as usize]
                    } else {
                        0.0
                    };
                }
            }
        }
        // Each sum over the taps ascending, as step 1 sums (so the same bits
        // as B); the 1 + npc sums are independent and run side by side.
        let mut acc = 0f32;
        for (i, &v) in snip.iter().enumerate() {
            acc += wk[i] * v;
            for (p, f) in tf_c.iter_mut().enumerate() {
                *f += v * wpca[p * wstride + i];
            }
        }
        adist.push(acc * sign as f32);
    }
    let wsum: f32 = adist.iter().map(|&a| a.max(0.0)).sum();
    let yct = sites
        .iter()
        .zip(&adist)
        .map(|(&c, &a)| (a.max(0.0) / wsum) * yc[c as usize])
        .sum();
    Features {
        centre: 0,
        sample: 0,
        amp: 0.0,
        imax: r as u8,
        sign,
        adist,
        yct,
        tf,
    }
}

/// Detects spikes in one whitened window with a fresh [`CpuDetector`].
///
/// `x`: C sites × NT samples, float32; `yc`: site depths, µm.
///
/// # Errors
/// As [`CpuDetector::detect`].
pub fn detect_window(
    x: ArrayView2<f32>,
    yc: &[f32],
    geometry: &Geometry,
    templates: &UniversalTemplates,
    settings: &DetectionSettings,
) -> Result<Detections, DetectError> {
    CpuDetector::new(geometry.clone(), templates.clone(), settings.clone())?.detect(x, yc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` samples uniform in [−10, 10) from a seeded linear congruential
    /// generator whose state is `state`.
    fn uniform_samples(n: usize, state: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 20.0
            })
            .collect()
    }

    /// The bound terms the filter bank writes equal those computed from its
    /// stored outputs, bit for bit, at the window's edges and inside.
    #[test]
    fn filter_bank_bound_terms_equal_those_from_the_outputs() {
        let wtemp = UniversalTemplates::builtin().wtemp;
        let wtemp = wtemp.as_standard_layout();
        let wtemp = wtemp.as_slice().unwrap();
        let x = uniform_samples(3 * TILE + 17, &mut 5);
        for t0 in [0, TILE, 3 * TILE] {
            let mut plain = vec![0f32; NK * TILE];
            filter_bank(&x, wtemp, t0, &mut plain);
            let mut out = vec![0f32; NK * TILE];
            let mut q = vec![-1f32; TILE];
            filter_bank_with_bound(&x, &taps_by_tap(wtemp), t0, &mut out, Some(&mut q));
            assert_eq!(out, plain);
            for (t, &v) in q.iter().enumerate() {
                let m = (0..NK).fold(0f32, |m, k| m.max(plain[k * TILE + t].abs()));
                assert_eq!(v.to_bits(), m.to_bits(), "t0 {t0}, sample {t}");
            }
        }
    }

    /// Step 1, on whatever vector width this CPU dispatches to (AVX-512 where
    /// it has it), equals the definition bit for bit: for each output, the
    /// float32 sum from zero over the taps in ascending order of wTEMP·x, zero
    /// outside the window. Tiles at both edges, inside, and one running past
    /// the window's end; windows shorter than a tile too.
    #[test]
    fn filter_bank_equals_the_sum_in_tap_order() {
        let wtemp = UniversalTemplates::builtin().wtemp;
        let wtemp = wtemp.as_standard_layout();
        let wtemp = wtemp.as_slice().unwrap();
        let ntaps = wtemp.len() / NK;
        let half = ntaps as i64 / 2;
        let mut state = 9u64;
        for len in [3 * TILE + 45, TILE - 7, 40] {
            let x = uniform_samples(len, &mut state);
            for t0 in (0..len).step_by(TILE) {
                let mut out = vec![f32::NAN; NK * TILE];
                filter_bank(&x, wtemp, t0, &mut out);
                for k in 0..NK {
                    for i in 0..TILE {
                        let mut sum = 0f32;
                        for m in 0..ntaps {
                            let t = (t0 + i) as i64 + m as i64 - half;
                            let v = if t >= 0 && (t as usize) < len {
                                x[t as usize]
                            } else {
                                0.0
                            };
                            sum += wtemp[k * ntaps + m] * v;
                        }
                        assert_eq!(
                            out[k * TILE + i].to_bits(),
                            sum.to_bits(),
                            "len {len}, t0 {t0}, template {k}, sample {i}"
                        );
                    }
                }
            }
        }
    }

    /// Both forms of step 1's inner loop (8 lanes, and AVX-512 where the CPU
    /// has it) give the same outputs, bound terms and non-finite flag, bit
    /// for bit, and the outputs equal the sum in tap order: on finite
    /// samples, with a NaN, +∞ or −∞ among them, and on finite samples so
    /// large that the sums overflow.
    #[test]
    fn both_filter_loops_agree_on_outputs_bounds_and_flags() {
        let wtemp = UniversalTemplates::builtin().wtemp;
        let ntaps = wtemp.ncols();
        let wt: Vec<[f32; NK]> = (0..ntaps)
            .map(|m| std::array::from_fn(|k| wtemp[[k, m]]))
            .collect();
        let need = TILE + ntaps - 1;
        let mut state = 21u64;
        let base = uniform_samples(need, &mut state);
        let cases: Vec<(&str, Vec<f32>, bool)> = vec![
            ("finite", base.clone(), false),
            ("NaN", with(&base, 100, f32::NAN), true),
            ("+inf", with(&base, 0, f32::INFINITY), true),
            ("-inf", with(&base, need - 1, f32::NEG_INFINITY), true),
            ("overflow", vec![3e38; need], true),
        ];
        for (name, seg, flagged) in cases {
            let mut out = vec![0f32; NK * TILE];
            let mut q = vec![0f32; TILE];
            let flag = filter_taps(&seg, &wt, &mut out, Some(&mut q));
            assert_eq!(flag, flagged, "{name}");
            if name == "finite" {
                for k in 0..NK {
                    for i in 0..TILE {
                        let sum = (0..ntaps).fold(0f32, |a, m| a + wt[m][k] * seg[i + m]);
                        assert_eq!(out[k * TILE + i].to_bits(), sum.to_bits(), "{k} {i}");
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                let mut out512 = vec![0f32; NK * TILE];
                let mut q512 = vec![0f32; TILE];
                // SAFETY: the CPU has AVX-512F, checked just above.
                let flag512 =
                    unsafe { filter_taps_avx512(&seg, &wt, &mut out512, Some(&mut q512)) };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(flag512, flag, "{name}: flag");
                assert_eq!(bits(&out512), bits(&out), "{name}: outputs");
                assert_eq!(bits(&q512), bits(&q), "{name}: bound terms");
            }
        }
    }

    /// `base` with `v` at `i`.
    fn with(base: &[f32], i: usize, v: f32) -> Vec<f32> {
        let mut x = base.to_vec();
        x[i] = v;
        x
    }

    /// Uniform values in [−0.5, 0.5) from a 64-bit linear congruential
    /// generator seeded with `seed`.
    fn uniform_centred(mut state: u64) -> impl FnMut() -> f32 {
        move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        }
    }

    /// A tile's step-1 outputs B (24 sites, unit-scale noise with 12 large
    /// events, each `width` samples long), 40 centres of 6 sites and 5 sizes
    /// with random weights, and the dense step 2 of them.
    struct NoisyTile {
        b: Vec<f32>,
        sites: Vec<u32>,
        weights: Vec<f32>,
        weight_max: Vec<f32>,
        /// The dense As and imax (nf × TILE).
        as_d: Vec<f32>,
        im_d: Vec<i8>,
    }

    impl NoisyTile {
        fn new(width: usize) -> Self {
            let (n_ch, nf, nc, nsz) = (24usize, 40usize, 6usize, 5usize);
            let mut rnd = uniform_centred(11);
            let mut b: Vec<f32> = (0..n_ch * NK * TILE).map(|_| rnd() * 3.0).collect();
            for e in 0..12 {
                let c = (e * 7) % n_ch;
                for t in ((e * 53) % TILE..).take(width).filter(|&t| t < TILE) {
                    for k in 0..NK {
                        b[(c * NK + k) * TILE + t] = 10.0 + 4.0 * rnd();
                    }
                }
            }
            let sites: Vec<u32> = (0..nf * nc)
                .map(|i| ((i / nc + i % nc) % n_ch) as u32)
                .collect();
            let weights: Vec<f32> = (0..nf * nc * nsz).map(|_| rnd()).collect();
            let mut as_d = vec![0f32; nf * TILE];
            let mut im_d = vec![0i8; nf * TILE];
            centre_response(&b, &sites, &weights, nsz, &mut as_d, &mut im_d);
            let weight_max = weights.chunks_exact(nsz).map(largest_magnitudes).collect();
            NoisyTile {
                b,
                sites,
                weights,
                weight_max,
                as_d,
                im_d,
            }
        }

        /// The tile at samples 1000 .. 1000 + TILE of a window that ends 3
        /// samples before the tile does, Th_universal 3.
        fn pruned(&self, flanks: Option<PeakSpan>) -> PrunedTile<'_> {
            PrunedTile {
                sites: &self.sites,
                weights: &self.weights,
                weight_max: &self.weight_max,
                nsz: 5,
                th: 3.0,
                t0: 1000,
                nt_w: 1000 + TILE - 3,
                q_ready: false,
                flanks,
            }
        }
    }

    /// With `flanks`, the pruned step 2 leaves out exactly the candidates
    /// beside a larger As of their own row (within the tile, the valid
    /// samples and the computed chunks), on either vector width.
    #[test]
    fn flanks_leave_out_candidates_beside_a_larger_as() {
        let noisy = NoisyTile::new(4);
        let (n_ch, nf) = (24usize, 40usize);
        let (b, as_d) = (&noisy.b, &noisy.as_d);
        let span = PeakSpan {
            half: 2,
            lo_valid: 1003,
            hi_valid: 1000 + TILE - 9,
        };
        let run = |tile: &PrunedTile, wide: bool| {
            let mut q = vec![0f32; pruned_scratch_len(n_ch)];
            let (mut as_t, mut im_t) = (vec![7f32; nf * TILE], vec![7i8; nf * TILE]);
            let mut done = vec![9u8; nf * CHUNKS];
            let mut cands = Vec::new();
            if wide {
                centre_response_pruned_into(
                    b,
                    &mut q,
                    tile,
                    &mut as_t,
                    &mut im_t,
                    Some(&mut done),
                    &mut cands,
                );
            } else {
                centre_response_pruned_sizes(
                    b,
                    &mut q,
                    tile,
                    &mut as_t,
                    &mut im_t,
                    Some(&mut done),
                    &mut cands,
                    Lanes8,
                );
            }
            (cands, done)
        };
        let (all, done) = run(&noisy.pruned(None), true);
        let beside_larger = |&(j, t): &(u32, u64)| {
            let (j, tt) = (j as usize, t as usize - 1000);
            [tt.wrapping_sub(1), tt + 1].into_iter().any(|u| {
                u < TILE
                    && (span.lo_valid..span.hi_valid).contains(&(1000 + u))
                    && done[j * CHUNKS + u / LANES] == 1
                    && as_d[j * TILE + u] > as_d[j * TILE + tt]
            })
        };
        let want: Vec<(u32, u64)> = all.iter().copied().filter(|c| !beside_larger(c)).collect();
        assert!(
            !want.is_empty() && want.len() < all.len(),
            "{} of {}",
            want.len(),
            all.len()
        );
        let flanked = noisy.pruned(Some(span));
        assert_eq!(run(&flanked, true).0, want);
        assert_eq!(run(&flanked, false).0, want);
    }

    /// The coarse bound changes nothing: the pruned step 2 computes exactly the
    /// chunks the per-sample bound alone lets through (there with the dense
    /// values, elsewhere zeros), and the candidates gathered on the way are the
    /// samples where As > Th_universal.
    #[test]
    fn coarse_bound_computes_the_same_chunks_as_the_per_sample_bound() {
        let noisy = NoisyTile::new(1);
        let (n_ch, nf, nc, nsz) = (24usize, 40usize, 6usize, 5usize);
        let th = 3.0f32;
        let NoisyTile {
            b,
            sites,
            weights,
            as_d,
            im_d,
            ..
        } = &noisy;
        let mut q = vec![0f32; pruned_scratch_len(n_ch)];
        let (mut as_p, mut im_p) = (vec![1f32; nf * TILE], vec![1i8; nf * TILE]);
        let tile = noisy.pruned(None);
        let mut cands = Vec::new();
        centre_response_pruned_into(b, &mut q, &tile, &mut as_p, &mut im_p, None, &mut cands);
        // With flags: the same computed values, skipped chunks left as they were.
        let (mut as_f, mut im_f) = (vec![7f32; nf * TILE], vec![7i8; nf * TILE]);
        let mut done = vec![9u8; nf * CHUNKS];
        let mut cands_f = Vec::new();
        centre_response_pruned_into(
            b,
            &mut q,
            &tile,
            &mut as_f,
            &mut im_f,
            Some(&mut done),
            &mut cands_f,
        );
        assert_eq!(cands_f, cands);
        // The 8-lane code (what a CPU without AVX-512 runs) does the same.
        let (mut as_8, mut im_8) = (vec![7f32; nf * TILE], vec![7i8; nf * TILE]);
        let mut done_8 = vec![9u8; nf * CHUNKS];
        let mut cands_8 = Vec::new();
        centre_response_pruned_sizes(
            b,
            &mut q,
            &tile,
            &mut as_8,
            &mut im_8,
            Some(&mut done_8),
            &mut cands_8,
            Lanes8,
        );
        assert_eq!(cands_8, cands);
        assert_eq!(done_8, done);
        assert_eq!(im_8, im_f);
        assert_eq!(
            as_8.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            as_f.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let qs =
            |c: usize, t: usize| (0..NK).fold(0f32, |m, k| m.max(b[(c * NK + k) * TILE + t].abs()));
        let (mut computed, mut want) = (0, Vec::new());
        for j in 0..nf {
            for tc in (0..TILE).step_by(LANES) {
                // The per-sample bound, sites in order.
                let fires = (0..LANES).any(|l| {
                    let sum = sites[j * nc..(j + 1) * nc].iter().enumerate().fold(
                        0f32,
                        |sum, (ci, &c)| {
                            let w = (0..nsz)
                                .map(|s| weights[(j * nc + ci) * nsz + s].abs())
                                .fold(0f32, f32::max);
                            sum + w * qs(c as usize, tc + l)
                        },
                    );
                    sum * 1.01 >= th
                });
                computed += usize::from(fires);
                assert_eq!(done[j * CHUNKS + tc / LANES], u8::from(fires));
                for l in 0..LANES {
                    let i = j * TILE + tc + l;
                    let flagged = if fires { (as_p[i], im_p[i]) } else { (7.0, 7) };
                    assert_eq!((as_f[i], im_f[i]), flagged);
                    if fires {
                        assert_eq!(
                            (as_p[i], im_p[i]),
                            (as_d[i], im_d[i]),
                            "centre {j}, sample {}",
                            tc + l
                        );
                        if as_d[i] > th && tc + l < TILE - 3 {
                            want.push((j as u32, (1000 + tc + l) as u64));
                        }
                    } else {
                        assert_eq!(
                            (as_p[i], im_p[i]),
                            (0.0, 0),
                            "centre {j}, sample {}",
                            tc + l
                        );
                        assert!(as_d[i] <= th, "a pruned chunk held a detection");
                    }
                }
            }
        }
        assert!(
            computed > 0 && computed < nf * TILE / LANES,
            "{computed} chunks computed"
        );
        assert!(!want.is_empty());
        assert_eq!(cands, want);
    }

    /// One [`PairResponse::respond_pair`] call with both chunks asked for.
    fn pair_of(
        r: impl PairResponse,
        nsz: usize,
        b: &[f32],
        sites: &[u32],
        w: &[f32],
        tc: usize,
    ) -> ([f32; 16], [i8; 16]) {
        let (mut a, mut i) = ([7f32; 16], [7i8; 16]);
        let pass = [true; 2];
        match nsz {
            1 => r.respond_pair::<1>(b, sites, w, tc, pass, &mut a, &mut i),
            2 => r.respond_pair::<2>(b, sites, w, tc, pass, &mut a, &mut i),
            3 => r.respond_pair::<3>(b, sites, w, tc, pass, &mut a, &mut i),
            4 => r.respond_pair::<4>(b, sites, w, tc, pass, &mut a, &mut i),
            5 => r.respond_pair::<5>(b, sites, w, tc, pass, &mut a, &mut i),
            6 => r.respond_pair::<6>(b, sites, w, tc, pass, &mut a, &mut i),
            7 => r.respond_pair::<7>(b, sites, w, tc, pass, &mut a, &mut i),
            _ => r.respond_pair::<8>(b, sites, w, tc, pass, &mut a, &mut i),
        }
        (a, i)
    }

    /// The 16-lane AVX-512 step 2 gives the bits of the 8-lane code on every
    /// lane: random sums, exact ties between (size, template) pairs (equal
    /// weights and equal rows), zeros, and NaN and ±∞ in B.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn wide_step_2_has_the_bits_of_the_narrow_one() {
        // The processor's own report, not `SPIKECUBE_CPU_AVX512`: the test
        // checks the AVX-512 form wherever it can run.
        let Some(wide) = std::arch::is_x86_feature_detected!("avx512f").then_some(Lanes16(()))
        else {
            eprintln!("no AVX-512F: nothing to compare");
            return;
        };
        let (n_ch, nc) = (12usize, 5usize);
        let mut rnd = uniform_centred(7);
        let mut b: Vec<f32> = (0..n_ch * NK * TILE).map(|_| rnd() * 8.0).collect();
        // Channel 3: templates 0 and 1 equal (ties across k); channel 4: zero.
        for t in 0..TILE {
            b[(3 * NK + 1) * TILE + t] = b[(3 * NK) * TILE + t];
            for k in 0..NK {
                b[(4 * NK + k) * TILE + t] = 0.0;
            }
        }
        b[(5 * NK + 2) * TILE + 17] = f32::NAN;
        b[(6 * NK) * TILE + 40] = f32::INFINITY;
        b[(6 * NK + 3) * TILE + 41] = f32::NEG_INFINITY;
        b[(7 * NK + 5) * TILE + 66] = f32::INFINITY;
        b[(7 * NK + 5) * TILE + 67] = f32::NAN;
        let site_sets: [[u32; 5]; 5] = [
            [0, 1, 2, 3, 4],
            [3, 3, 4, 4, 4],
            [4, 4, 4, 4, 4],
            [5, 6, 7, 8, 9],
            [11, 10, 9, 6, 5],
        ];
        for nsz in 1..=8usize {
            for (si, sites) in site_sets.iter().enumerate() {
                // Set 1 repeats one weight across sizes: ties across s.
                let w: Vec<f32> = (0..nc * nsz)
                    .map(|i| if si == 1 { 0.5 } else { rnd() + (i % 3) as f32 })
                    .collect();
                for tc in (0..TILE).step_by(2 * LANES) {
                    let (a8, im8) = pair_of(Lanes8, nsz, &b, sites, &w, tc);
                    let (a16, im16) = pair_of(wide, nsz, &b, sites, &w, tc);
                    let bits = |a: &[f32; 16]| a.map(f32::to_bits);
                    assert_eq!(im16, im8, "nsz {nsz}, sites {si}, samples {tc}..");
                    // NaN's payload may differ; every other value bit for bit.
                    for l in 0..16 {
                        if !(a8[l].is_nan() && a16[l].is_nan()) {
                            assert_eq!(
                                bits(&a16)[l],
                                bits(&a8)[l],
                                "nsz {nsz}, sites {si}, sample {}",
                                tc + l
                            );
                        }
                    }
                }
            }
        }
    }

    /// Step 5 sums each of adist's and tF's dot products over the taps in
    /// ascending order from zero, with zeros outside the window: the plain
    /// per-sum code below, bit for bit, at the window's edges and inside,
    /// with and without PC features.
    #[test]
    fn features_equal_the_plain_sums() {
        let templates = UniversalTemplates::builtin();
        let (nk, ntaps) = templates.wtemp.dim();
        let half = ntaps / 2;
        let (n_ch, nt_w) = (9usize, 300usize);
        let mut state = 3u64;
        let x = Array2::from_shape_fn((n_ch, nt_w), |_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        });
        let yc: Vec<f32> = (0..n_ch).map(|c| 15.0 * c as f32).collect();
        let sites = [4u32, 3, 5, 2, 6, 0];
        let plain_dot = |w: &[f32], c: u32, t: usize| -> f32 {
            let mut a = 0f32;
            for (i, &wv) in w.iter().enumerate() {
                let s = t as isize + i as isize - half as isize;
                let v = if s >= 0 && (s as usize) < nt_w {
                    x[[c as usize, s as usize]]
                } else {
                    0.0
                };
                a += wv * v;
            }
            a
        };
        for npc in [0usize, 1, templates.wpca.nrows()] {
            for t in [
                0usize,
                5,
                half - 1,
                half,
                100,
                nt_w - half - 1,
                nt_w - half,
                nt_w - 1,
            ] {
                for code in [1i8, -3, 30, -(nk as i8) - 2] {
                    let f = features(x.view(), &templates, &sites, &yc, t, code, npc);
                    let k = (code.unsigned_abs() as usize - 1) % nk;
                    let wk: Vec<f32> = templates.wtemp.row(k).to_vec();
                    for (i, &c) in sites.iter().enumerate() {
                        let want = plain_dot(&wk, c, t) * code.signum() as f32;
                        assert_eq!(f.adist[i].to_bits(), want.to_bits(), "adist, t {t}");
                        for p in 0..npc {
                            let wp: Vec<f32> = templates.wpca.row(p).to_vec();
                            assert_eq!(
                                f.tf[i * npc + p].to_bits(),
                                plain_dot(&wp, c, t).to_bits(),
                                "tF, t {t}, pc {p}"
                            );
                        }
                    }
                    assert_eq!(f.tf.len(), sites.len() * npc);
                }
            }
        }
    }
}
