//! The initial labels of one group (Kilosort4 4.1.7
//! `clustering_qr.py:kmeans_plusplus`): a greedy "best of 100 candidates"
//! k-means++ seeding.
//!
//! Every spike keeps the best explained variance so far, v0 (start 0). At each
//! of the `n_clusters` steps, 100 distinct candidate spikes are drawn with
//! probability ∝ relu(‖x‖² − v0) (without replacement); the gain of candidate c
//! for spike x is 2x·c − ‖c‖²; the candidate with the largest summed positive
//! gain over v0 is kept, and every spike it improves takes its label. Spikes
//! never improved keep label 0.
//!
//! Kilosort4 draws with torch's generator, seeded at every call; the draws
//! here ([`super::draws`]) are torch's CPU draws by default, or a ChaCha8
//! stream's, seeded with `cluster_init_seed` at every call: the same for any
//! run, thread count or machine. Dot products are summed in float32 in
//! feature order; per-candidate totals in float64 over fixed blocks of spikes.
//!
//! Most candidates are drawn at many steps (spikes far from every seed keep a
//! large weight), and v0 only grows, so a candidate's gains need computing
//! once: afterwards only the few spikes whose gain still beats v0 matter, and
//! they are kept in a per-group memo (`Memo`). The sums and labels have the
//! bits of the computation spike by spike, candidate by candidate.

use rayon::prelude::*;

use super::device::{SCREEN_TILE, SeedingDevice};
use super::draws::{Drawer, SeedingRng};

/// Spikes per block of the gain sums (fixed, so totals do not depend on the
/// thread count).
pub(super) const SPIKE_BLOCK: usize = 2048;

/// x·c summed in float32 in feature order (the one order used everywhere here,
/// so that a spike's gain from itself equals its own ‖x‖²).
#[inline]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// A spike whose gain from a candidate beat its v0: (spike index, gain
/// t = 2x·c − ‖c‖² in float32, computed as in [`block_gains`]).
type Gain = (u32, f32);

/// Most memoised gains held per spike of the group (see [`Memo`]): bounds
/// the memo's memory to 128 bytes a spike. On the synthetic 384-site data
/// this keeps 97 % of what an unbounded memo saves (72 % vs 74 % of the
/// candidates' gains come from the memo).
const MEMO_GAINS_PER_SPIKE: usize = 16;

/// The gains of every candidate computed so far in one group, kept for when
/// it is drawn again (a spike far from every seed is drawn at many steps).
///
/// For candidate spike c, `lists[c]` holds, in ascending spike order, the
/// spikes whose gain t exceeded their v0 when last checked, with t (which
/// never changes). Every other spike's t was ≤ its v0 then, and v0 never
/// decreases, so it stays ≤ v0: its d = fl(t − v0) is ≤ 0 (rounding is
/// monotone) and adds exactly +0 to the candidate's sum, and it would not
/// take the candidate's label. A memoised candidate therefore gets the same
/// sums and labels from its list alone, with no dot product.
struct Memo {
    lists: Vec<Option<Vec<Gain>>>,
    /// Gains held in all lists.
    held: usize,
    /// Most gains held ([`MEMO_GAINS_PER_SPIKE`] per spike): past it the
    /// memo is shrunk ([`Memo::shrink`]); a candidate whose list was dropped
    /// is recomputed if drawn again.
    cap: usize,
}

/// Initial labels (0‥`n_clusters`) of the `xd.len() / dim` spikes of one group
/// (rows of `xd`, float32), by Kilosort4's greedy k-means++ seeding, the
/// candidates drawn by `rng` ([`SeedingRng`]: torch's draws or ChaCha8's).
pub fn kmeans_plusplus(xd: &[f32], dim: usize, n_clusters: usize, rng: SeedingRng) -> Vec<u32> {
    kmeans_plusplus_on(xd, dim, n_clusters, rng, &SeedingDevice::cpu())
}

/// One step of a group's seeding, as [`kmeans_plusplus_traced`] records it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeedStep {
    /// The spike (row of the group) kept as the step's seed.
    pub spike: u32,
    /// Its summed positive gain Σ relu(t − v0) (float64, fixed order).
    pub total: f64,
    /// The largest total of the step's other candidates (−∞ when alone).
    /// Two candidates can tie in exact arithmetic: two spikes close to each
    /// other and far from every seed, each improving only the pair, have the
    /// same total, 2x₁·x₂ − v0₁ − v0₂; Kilosort4's float32 rounding then
    /// decides which it keeps.
    pub runner_up: f64,
}

/// [`kmeans_plusplus`] on the CPU with each step's seed and totals: for
/// diagnostics and the fixture tests. The same labels.
pub fn kmeans_plusplus_traced(
    xd: &[f32],
    dim: usize,
    n_clusters: usize,
    rng: SeedingRng,
) -> (Vec<u32>, Vec<SeedStep>) {
    let n = xd.len() / dim.max(1);
    let mut s = Seeder::new(xd, dim, n_clusters, rng, default_memo_cap(n), cpu_screen());
    s.trace = Some(Vec::new());
    while s.draw().is_some() {
        s.step(None);
    }
    let trace = s.trace.take().unwrap_or_default();
    (s.iclust, trace)
}

/// [`kmeans_plusplus`] with the fresh candidates' pairs screened on `device`
/// when it is a GPU that takes the group ([`SeedingDevice`]): the same labels,
/// bit for bit.
pub fn kmeans_plusplus_on(
    xd: &[f32],
    dim: usize,
    n_clusters: usize,
    rng: SeedingRng,
    device: &SeedingDevice,
) -> Vec<u32> {
    kmeans_plusplus_many(&[(xd, dim)], n_clusters, rng, device)
        .pop()
        .unwrap_or_default()
}

/// [`kmeans_plusplus`] of several groups (`(xd, dim)` each) at once with
/// every gain computed on `device` (all groups' steps in lockstep, the
/// draws on `draw_threads` host threads): each group's labels are those of
/// [`kmeans_plusplus`] on it alone. `None` when the device cannot (no GPU,
/// no float64, or a group it does not take: wider than
/// [`MAX_DEVICE_DIM`](super::device::MAX_DEVICE_DIM) or with a non-finite
/// feature).
pub fn kmeans_plusplus_on_device(
    groups: &[(&[f32], usize)],
    n_clusters: usize,
    rng: SeedingRng,
    device: &SeedingDevice,
    draw_threads: usize,
) -> Option<Vec<Vec<u32>>> {
    let mut steps = device.exact(groups)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(draw_threads.max(1))
        .build()
        .ok()?;
    Some(super::lockstep::seed_lockstep(
        groups,
        n_clusters,
        rng,
        steps.as_mut(),
        &pool,
    ))
}

/// [`kmeans_plusplus`] of several groups (`(xd, dim)` each) at once, step by
/// step: each step's fresh candidate pairs of every group the device takes
/// are screened in one launch on `device` (one round trip a step for all
/// groups), the others on the CPU. Each group's labels are those of
/// [`kmeans_plusplus`] on it alone.
pub fn kmeans_plusplus_many(
    groups: &[(&[f32], usize)],
    n_clusters: usize,
    rng: SeedingRng,
    device: &SeedingDevice,
) -> Vec<Vec<u32>> {
    seed_many(
        groups,
        n_clusters,
        rng,
        &default_memo_cap,
        cpu_screen(),
        device,
    )
}

/// The memo's cap for a group of `n` spikes ([`MEMO_GAINS_PER_SPIKE`] a spike).
fn default_memo_cap(n: usize) -> usize {
    n.saturating_mul(MEMO_GAINS_PER_SPIKE)
}

/// The CPU screen's level: the integer screen pays only where its 16-bit
/// products run in AVX-512; elsewhere every gain is computed in float32 (the
/// same bits).
fn cpu_screen() -> Option<Level> {
    let level = Level::detect();
    (level >= Level::Avx512Bw).then_some(level)
}

/// [`kmeans_plusplus`] with a memo of at most `memo_cap` gains and the
/// fresh candidates' gains screened on `device` when it takes the group, else
/// at `screen_level` ([`Screen`]; `None`: all computed).
#[cfg(test)]
fn seed_labels(
    xd: &[f32],
    dim: usize,
    n_clusters: usize,
    rng: SeedingRng,
    memo_cap: usize,
    screen_level: Option<Level>,
    device: &SeedingDevice,
) -> Vec<u32> {
    seed_many(
        &[(xd, dim)],
        n_clusters,
        rng,
        &|_| memo_cap,
        screen_level,
        device,
    )
    .pop()
    .unwrap_or_default()
}

/// The seeding of `groups` in lockstep ([`kmeans_plusplus_many`]), a group
/// of n spikes with a memo of `memo_cap(n)` gains.
fn seed_many(
    groups: &[(&[f32], usize)],
    n_clusters: usize,
    rng: SeedingRng,
    memo_cap: &(dyn Fn(usize) -> usize + Sync),
    screen_level: Option<Level>,
    device: &SeedingDevice,
) -> Vec<Vec<u32>> {
    let taken: Vec<bool> = groups
        .iter()
        .map(|&(xd, dim)| device.takes(xd, dim))
        .collect();
    let mut seeders: Vec<Seeder> = groups
        .par_iter()
        .zip(&taken)
        .map(|(&(xd, dim), &on)| {
            let n = xd.len() / dim.max(1);
            // The groups the device takes need no CPU screen.
            let level = if on { None } else { screen_level };
            let mut s = Seeder::new(xd, dim, n_clusters, rng, memo_cap(n), level);
            s.track_changes = on;
            s
        })
        .collect();
    let mut batch = {
        let inputs: Vec<(&[f32], usize, &[f32])> = seeders
            .iter()
            .map(|s| (s.xd, s.dim, s.vtot.as_slice()))
            .collect();
        device.batch(&inputs, &taken)
    };
    loop {
        crate::cancel::check("the clustering's seeding");
        let asks: Vec<Option<(Vec<u32>, Vec<f32>)>> =
            seeders.par_iter_mut().map(Seeder::draw).collect();
        if asks.iter().all(Option::is_none) {
            break;
        }
        let flags: Vec<Option<Vec<u8>>> = match &mut batch {
            Some(b) => {
                let v0: Vec<&[f32]> = seeders.iter().map(|s| s.vexp0.as_slice()).collect();
                let changed: Vec<&[(u32, f32)]> =
                    seeders.iter().map(|s| s.changed.as_slice()).collect();
                let f = b.flags(&v0, &changed, &asks);
                for s in &mut seeders {
                    s.changed.clear();
                }
                f
            }
            None => vec![None; seeders.len()],
        };
        seeders
            .par_iter_mut()
            .zip(asks)
            .zip(flags)
            .for_each(|((s, ask), f)| {
                if ask.is_some() {
                    s.step(f);
                }
            });
    }
    seeders.into_iter().map(|s| s.iclust).collect()
}

/// The state of one group's seeding between steps.
struct Seeder<'a> {
    xd: &'a [f32],
    dim: usize,
    n_clusters: usize,
    /// Each spike's ‖x‖² (float32, feature order).
    vtot: Vec<f32>,
    /// Each spike's best gain so far, v0.
    vexp0: Vec<f32>,
    iclust: Vec<u32>,
    rng: Drawer,
    memo: Memo,
    screen: Option<Screen>,
    /// The next step.
    j: usize,
    /// This step's candidates (spike rows).
    cand: Vec<usize>,
    done: bool,
    /// Whether a device holds a copy of v0 ([`Seeder::changed`] kept).
    track_changes: bool,
    /// The (spike, new v0) of the steps since the device last saw v0.
    changed: Vec<(u32, f32)>,
    /// Each step's seed and totals, when traced ([`kmeans_plusplus_traced`]).
    trace: Option<Vec<SeedStep>>,
}

impl<'a> Seeder<'a> {
    fn new(
        xd: &'a [f32],
        dim: usize,
        n_clusters: usize,
        rng: SeedingRng,
        memo_cap: usize,
        screen_level: Option<Level>,
    ) -> Self {
        let n = xd.len() / dim.max(1);
        let rows = |i: usize| &xd[i * dim..(i + 1) * dim];
        let vtot: Vec<f32> = (0..n).map(|i| dot(rows(i), rows(i))).collect();
        Seeder {
            xd,
            dim,
            n_clusters,
            vtot,
            vexp0: vec![0f32; n],
            iclust: vec![0u32; n],
            rng: Drawer::new(rng),
            memo: Memo {
                lists: (0..n).map(|_| None).collect(),
                held: 0,
                cap: memo_cap,
            },
            screen: screen_level.and_then(|level| Screen::new(xd, dim, level)),
            j: 0,
            cand: Vec::new(),
            done: n == 0,
            track_changes: false,
            changed: Vec::new(),
            trace: None,
        }
    }

    /// Draws the next step's candidates; returns the fresh ones (not in the
    /// memo, in draw order; rows of the group) with their ‖c‖², or `None`
    /// when the seeding is over (all steps taken, or every spike explained
    /// exactly so that no candidate can gain).
    fn draw(&mut self) -> Option<(Vec<u32>, Vec<f32>)> {
        if self.done || self.j >= self.n_clusters {
            self.done = true;
            return None;
        }
        self.cand = self.rng.candidates(&self.vtot, &self.vexp0);
        if self.cand.is_empty() {
            self.done = true;
            return None;
        }
        let fresh: Vec<u32> = self
            .cand
            .iter()
            .filter(|&&s| self.memo.lists[s].is_none())
            .map(|&s| s as u32)
            .collect();
        let cn = fresh.iter().map(|&s| self.vtot[s as usize]).collect();
        Some((fresh, cn))
    }

    /// Takes the drawn step: the best candidate (its fresh pairs screened by
    /// the device's `flags` when given, else by the CPU screen), whose
    /// improved spikes take its label and gain.
    fn step(&mut self, flags: Option<Vec<u8>>) {
        let (xd, dim) = (self.xd, self.dim);
        let (best, won, [total, runner_up]) = best_candidate(
            xd,
            dim,
            &self.cand,
            &self.vexp0,
            &mut self.memo,
            self.screen.as_ref(),
            flags,
        );
        let c = self.cand[best];
        if let Some(t) = &mut self.trace {
            t.push(SeedStep {
                spike: c as u32,
                total,
                runner_up,
            });
        }
        let won = won.unwrap_or_else(|| beating(xd, &xd[c * dim..(c + 1) * dim], &self.vexp0));
        // The spikes whose gain from the kept candidate beats their v0 (its
        // gain 2x·c − ‖c‖² > v0) take its label and that gain as their v0.
        for &(i, t) in &won {
            self.vexp0[i as usize] = t;
            self.iclust[i as usize] = self.j as u32;
        }
        if self.track_changes {
            self.changed.extend_from_slice(&won);
        }
        if self.memo.held > self.memo.cap {
            self.memo.shrink(&self.vexp0);
        }
        self.j += 1;
    }
}

impl Memo {
    /// Drops the gains that no longer beat v0 (they never will again), then,
    /// while more than half the cap is held, the longest lists.
    fn shrink(&mut self, v0: &[f32]) {
        self.lists.par_iter_mut().flatten().for_each(|l| {
            l.retain(|&(i, t)| t > v0[i as usize]);
        });
        self.held = self.lists.iter().flatten().map(Vec::len).sum();
        if self.held > self.cap / 2 {
            let mut by_len: Vec<(usize, usize)> = self
                .lists
                .iter()
                .enumerate()
                .filter_map(|(s, l)| l.as_ref().map(|l| (l.len(), s)))
                .collect();
            by_len.sort_unstable_by(|a, b| b.cmp(a));
            for (len, s) in by_len {
                if self.held <= self.cap / 2 {
                    break;
                }
                self.lists[s] = None;
                self.held -= len;
            }
        }
    }
}

/// The spikes (ascending) whose gain t = 2x·c − ‖c‖² from candidate row `c`
/// beats their `v0`, with t (x·c summed in float32 in feature order, as in
/// [`block_gains`]).
fn beating(xd: &[f32], c: &[f32], v0: &[f32]) -> Vec<Gain> {
    let dim = c.len();
    let cn = dot(c, c);
    let parts: Vec<Vec<Gain>> = xd
        .par_chunks(SPIKE_BLOCK * dim)
        .zip(v0.par_chunks(SPIKE_BLOCK))
        .enumerate()
        .map(|(b, (x, v0))| {
            let mut out = Vec::new();
            for (i, (row, &e)) in x.chunks_exact(dim).zip(v0).enumerate() {
                let t = 2.0 * dot(row, c) - cn;
                if t > e {
                    out.push(((b * SPIKE_BLOCK + i) as u32, t));
                }
            }
            out
        })
        .collect();
    parts.concat()
}

/// Candidates per register tile of the gain kernel (one 16-lane vector).
const TILE_C: usize = 16;
/// Spikes per register tile of the gain kernel.
const TILE_S: usize = 6;
/// Most gains recorded for one candidate in one block of [`SPIKE_BLOCK`]
/// spikes; a candidate with more in any block gets no list (it is not
/// memoised; kept, its spikes are found again by [`beating`]). Bounds a
/// list to 1/16 of the group.
const BLOCK_GAINS_MAX: usize = SPIKE_BLOCK / 16;

/// The candidate (position in `cand`) with the largest summed positive gain
/// Σ relu(2x·c − ‖c‖² − v0), the first on ties, and the spikes whose gain from
/// it beats their v0 (ascending), with those gains, when it has a list.
///
/// Each x·c is summed in float32 in feature order (multiply, then add; no
/// fused multiply-add); each candidate's positive gains are added in float64
/// in spike order within blocks of [`SPIKE_BLOCK`] spikes, and the blocks'
/// totals in block order. Candidates seen before at this group's earlier steps
/// are summed from their [`Memo`] lists, the others by [`block_gains`]; both
/// give the bits of one spike and one candidate at a time.
fn best_candidate(
    xd: &[f32],
    dim: usize,
    cand: &[usize],
    vexp0: &[f32],
    memo: &mut Memo,
    screen: Option<&Screen>,
    flags: Option<Vec<u8>>,
) -> (usize, Option<Vec<Gain>>, [f64; 2]) {
    let nc = cand.len();
    let mut total = vec![0f64; nc];
    let mut lists: Vec<Option<Vec<Gain>>> = cand.iter().map(|&s| memo.lists[s].take()).collect();
    for l in lists.iter().flatten() {
        memo.held -= l.len();
    }
    let fresh: Vec<usize> = (0..nc).filter(|&c| lists[c].is_none()).collect();
    total
        .par_iter_mut()
        .zip(lists.par_iter_mut())
        .for_each(|(t, l)| {
            if let Some(l) = l {
                *t = recheck(l, vexp0);
            }
        });
    if !fresh.is_empty() {
        let (sums, gains) = fresh_gains(xd, dim, cand, &fresh, vexp0, screen, flags);
        for ((&c, s), g) in fresh.iter().zip(sums).zip(gains) {
            total[c] = s;
            lists[c] = g;
        }
    }
    let mut best = 0;
    for c in 1..nc {
        if total[c] > total[best] {
            best = c;
        }
    }
    let won = lists[best].take();
    // The kept candidate's spikes take its gain as v0: nothing beats it
    // later (and it is never drawn again, its own v0 becoming ‖c‖²).
    lists[best] = Some(Vec::new());
    for (&s, l) in cand.iter().zip(lists) {
        if let Some(l) = l {
            memo.held += l.len();
            memo.lists[s] = Some(l);
        }
    }
    let runner_up = (0..nc)
        .filter(|&c| c != best)
        .map(|c| total[c])
        .fold(f64::NEG_INFINITY, f64::max);
    (best, won, [total[best], runner_up])
}

/// The summed positive gains Σ relu(t − v0) of one memoised candidate (float64,
/// in spike order within blocks of [`SPIKE_BLOCK`], blocks in order, as
/// [`block_gains`] sums them: the spikes left out add +0), dropping from
/// `list` the spikes whose t no longer beats v0.
fn recheck(list: &mut Vec<Gain>, v0: &[f32]) -> f64 {
    let mut total = 0f64;
    let mut block_sum = 0f64;
    let mut block = 0;
    list.retain(|&(i, t)| {
        let i = i as usize;
        if i / SPIKE_BLOCK != block {
            total += block_sum;
            block_sum = 0.0;
            block = i / SPIKE_BLOCK;
        }
        let e = v0[i];
        let d = t - e;
        if d > 0.0 {
            block_sum += f64::from(d);
        }
        t > e
    });
    total + block_sum
}

/// The gains of one block of spikes against the fresh candidates.
struct BlockOut {
    /// Summed positive gains per candidate column.
    sum: Vec<f64>,
    /// (candidate column, spike in the block, t) of each gain t that beats
    /// v0, each column's spikes ascending; at most [`BLOCK_GAINS_MAX`] per
    /// column.
    gains: Vec<(u16, u16, f32)>,
    /// Gains beating v0 per column (also those past the limit).
    count: Vec<usize>,
}

/// The summed positive gains of the candidates `cand[fresh]` (float64, in
/// spike order within blocks of [`SPIKE_BLOCK`], blocks in order) and, for
/// each, the spikes (ascending) whose gain t beats their v0, with t (`None`
/// past [`BLOCK_GAINS_MAX`] in a block). With a device's `flags` (per spike,
/// bit t for tile t of the fresh candidates), only the flagged spikes are
/// computed (the others add +0), else those the CPU `screen` lets through,
/// else all.
fn fresh_gains(
    xd: &[f32],
    dim: usize,
    cand: &[usize],
    fresh: &[usize],
    vexp0: &[f32],
    screen: Option<&Screen>,
    flags: Option<Vec<u8>>,
) -> (Vec<f64>, Vec<Option<Vec<Gain>>>) {
    let nf = fresh.len();
    let ncp = nf.div_ceil(TILE_C) * TILE_C;
    // Candidates by tiles of TILE_C, each tile feature-major (dim × TILE_C,
    // zero-padded): one feature of a tile's candidates is one run.
    let mut ct = vec![0f32; dim * ncp];
    let mut cn = vec![0f32; ncp];
    for (c, &f) in fresh.iter().enumerate() {
        let row = &xd[cand[f] * dim..(cand[f] + 1) * dim];
        cn[c] = dot(row, row);
        let tile = &mut ct[(c / TILE_C) * dim * TILE_C..];
        for (k, &v) in row.iter().enumerate() {
            tile[k * TILE_C + c % TILE_C] = v;
        }
    }
    let level = Level::detect();
    let lanes = if flags.is_some() {
        None
    } else {
        screen.map(|scr| scr.lanes(xd, dim, cand, fresh, ncp))
    };
    let blocks: Vec<BlockOut> = xd
        .par_chunks(SPIKE_BLOCK * dim)
        .zip(vexp0.par_chunks(SPIKE_BLOCK))
        .enumerate()
        .map(|(b, (block, v0))| {
            let mut out = BlockOut {
                sum: vec![0f64; ncp],
                gains: Vec::new(),
                count: vec![0; ncp],
            };
            match (screen, &lanes) {
                _ if flags.is_some() => {
                    let first = b * SPIKE_BLOCK;
                    let fl = &flags.as_ref().expect("checked")[first..first + v0.len()];
                    flagged_block(block, v0, fl, &ct, &cn, dim, nf, level, &mut out);
                }
                (Some(scr), Some(lanes)) => {
                    let first = b * SPIKE_BLOCK;
                    let mut sc = ScreenedBlock {
                        block,
                        v0,
                        first,
                        ct: &ct,
                        dim,
                        live: nf,
                    };
                    sc.run(scr, lanes, &cn, &mut out);
                }
                _ => block_gains(block, v0, &ct, &cn, dim, nf, &mut out),
            }
            out
        })
        .collect();
    let mut total = vec![0f64; nf];
    let mut lists: Vec<Option<Vec<Gain>>> = vec![Some(Vec::new()); nf];
    for (b, out) in blocks.into_iter().enumerate() {
        for (t, v) in total.iter_mut().zip(&out.sum) {
            *t += v;
        }
        for (l, &k) in lists.iter_mut().zip(&out.count) {
            if k > BLOCK_GAINS_MAX {
                *l = None;
            }
        }
        let base = b * SPIKE_BLOCK;
        for (c, s, t) in out.gains {
            if let Some(l) = &mut lists[usize::from(c)] {
                l.push(((base + usize::from(s)) as u32, t));
            }
        }
    }
    (total, lists)
}

/// Adds, for each candidate column of `ct` (tiles of dim × [`TILE_C`]), the
/// positive gains 2x·c − ‖c‖² − v0 of the spikes of `block` (rows of `dim`)
/// to `out.sum`, in spike order, and records in `out` the spikes whose gain
/// t = 2x·c − ‖c‖² beats their v0, for the first `live` columns. Compiled for
/// AVX-512 and AVX2 too and chosen at run time: the same operations on more
/// lanes, the same bits.
fn block_gains(
    block: &[f32],
    v0: &[f32],
    ct: &[f32],
    cn: &[f32],
    dim: usize,
    live: usize,
    out: &mut BlockOut,
) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512(
            b: &[f32],
            v0: &[f32],
            ct: &[f32],
            cn: &[f32],
            dim: usize,
            live: usize,
            o: &mut BlockOut,
        ) {
            block_gains_impl(b, v0, ct, cn, dim, live, o)
        }
        #[target_feature(enable = "avx2")]
        fn avx2(
            b: &[f32],
            v0: &[f32],
            ct: &[f32],
            cn: &[f32],
            dim: usize,
            live: usize,
            o: &mut BlockOut,
        ) {
            block_gains_impl(b, v0, ct, cn, dim, live, o)
        }
        if crate::simd::avx512() {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            unsafe { avx512(block, v0, ct, cn, dim, live, out) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { avx2(block, v0, ct, cn, dim, live, out) };
            return;
        }
    }
    block_gains_impl(block, v0, ct, cn, dim, live, out)
}

#[inline(always)]
fn block_gains_impl(
    block: &[f32],
    v0: &[f32],
    ct: &[f32],
    cn: &[f32],
    dim: usize,
    live: usize,
    out: &mut BlockOut,
) {
    // Rows past the block's end read zeros (their results are not used).
    let zero = vec![0f32; dim];
    for (s0, v0s) in (0..v0.len()).step_by(TILE_S).zip(v0.chunks(TILE_S)) {
        let x: [&[f32]; TILE_S] = std::array::from_fn(|r| {
            block
                .get((s0 + r) * dim..(s0 + r + 1) * dim)
                .unwrap_or(&zero)
        });
        for (c0, ((cp, cnr), sr)) in (0..).step_by(TILE_C).zip(
            ct.chunks_exact(dim * TILE_C)
                .zip(cn.chunks_exact(TILE_C))
                .zip(out.sum.chunks_exact_mut(TILE_C)),
        ) {
            let acc = tile_dots(&x, cp);
            // Lanes past the last live column are padding.
            let live_mask = live_lanes(live, c0);
            for (r, (a, &e)) in acc.iter().zip(v0s).enumerate() {
                book_gains(
                    a,
                    cnr,
                    e,
                    sr,
                    live_mask,
                    (c0, (s0 + r) as u16),
                    &mut out.count,
                    &mut out.gains,
                );
            }
        }
    }
}

/// The live lanes of the tile of candidates from column `c0` when the first
/// `live` columns are live (bit l for column c0 + l; 0 for a tile past them).
#[inline]
fn live_lanes(live: usize, c0: usize) -> u32 {
    let lanes = live.saturating_sub(c0).min(TILE_C);
    if lanes == TILE_C {
        u32::MAX
    } else {
        (1u32 << lanes) - 1
    }
}

/// Books one spike's gains t = 2x·c − ‖c‖² over the tile of candidates from
/// `c0` (`a`: its dot products, `cnr`: the candidates' ‖c‖²): the positive
/// excess over its v0 `e` is added to the tile's sums `sr` (adding +0 leaves
/// a sum of positive terms unchanged), and each live candidate (`live_mask`)
/// it beats counts it and, up to [`BLOCK_GAINS_MAX`], lists (candidate,
/// `spike`, t).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn book_gains(
    a: &[f32; TILE_C],
    cnr: &[f32],
    e: f32,
    sr: &mut [f64],
    live_mask: u32,
    (c0, spike): (usize, u16),
    count: &mut [usize],
    gains: &mut Vec<(u16, u16, f32)>,
) {
    let mut t = [0f32; TILE_C];
    let mut beats = 0u32;
    for l in 0..TILE_C {
        t[l] = 2.0 * a[l] - cnr[l];
        let d = t[l] - e;
        sr[l] += if d > 0.0 { f64::from(d) } else { 0.0 };
        beats |= u32::from(t[l] > e) << l;
    }
    beats &= live_mask;
    while beats != 0 {
        let l = beats.trailing_zeros() as usize;
        beats &= beats - 1;
        count[c0 + l] += 1;
        if count[c0 + l] <= BLOCK_GAINS_MAX {
            gains.push(((c0 + l) as u16, spike, t[l]));
        }
    }
}

/// x·c of [`TILE_S`] rows `x` (each of dim features) and the [`TILE_C`]
/// candidates of one tile `cp` (dim × TILE_C, feature-major), each summed in
/// float32 in feature order.
#[inline(always)]
fn tile_dots(x: &[&[f32]; TILE_S], cp: &[f32]) -> [[f32; TILE_C]; TILE_S] {
    let [mut a0, mut a1, mut a2, mut a3, mut a4, mut a5] = [[0f32; TILE_C]; TILE_S];
    let [x0, x1, x2, x3, x4, x5] = *x;
    let feats = x0.iter().zip(x1).zip(x2).zip(x3).zip(x4).zip(x5);
    for ((((((&v0, &v1), &v2), &v3), &v4), &v5), c) in feats.zip(cp.chunks_exact(TILE_C)) {
        let c: &[f32; TILE_C] = c.try_into().expect("tile width");
        add_product(&mut a0, v0, c);
        add_product(&mut a1, v1, c);
        add_product(&mut a2, v2, c);
        add_product(&mut a3, v3, c);
        add_product(&mut a4, v4, c);
        add_product(&mut a5, v5, c);
    }
    [a0, a1, a2, a3, a4, a5]
}

/// a += x·c lane by lane (multiply, then add).
#[inline(always)]
fn add_product(a: &mut [f32; TILE_C], x: f32, c: &[f32; TILE_C]) {
    for (a, &c) in a.iter_mut().zip(c) {
        *a += x * c;
    }
}

/// The SIMD level of the gain screen's kernels (see [`Screen`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    /// Portable code.
    Base,
    /// AVX-512F and AVX-512BW (integer pair products by `vpmaddwd`).
    Avx512Bw,
    /// AVX-512BW and AVX-512 VNNI (`vpdpwssd`).
    Avx512Vnni,
}

impl Level {
    /// The best level this CPU has.
    fn detect() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if crate::simd::avx512() && has!("avx512bw") {
                if has!("avx512vnni") {
                    return Level::Avx512Vnni;
                }
                return Level::Avx512Bw;
            }
        }
        Level::Base
    }
}

/// Largest |x| (feature value) with which the screen runs: beyond it f32
/// dot products could overflow.
const SCREEN_MAX_ABS: f32 = 1e15;

/// An exact screen of the fresh candidates' gains: each spike's features
/// rounded to 16-bit integers (its own scale), whose integer dot products
/// with a candidate's (exact in 32 bits) bound the float32 gain
/// t = 2x·c − ‖c‖² from above. A spike whose bound is ≤ its v0 would add
/// exactly +0 to the candidate's sum and not take its label (t ≤ v0), so it
/// is skipped; the others get the float32 computation of [`block_gains`]:
/// the sums, lists and labels keep their bits.
///
/// The bound, for x = δ_x·q + r and c = δ_c·p + s (q, p the integer rows):
/// x·c = δ_xδ_c q·p + δ_x q·s + δ_c r·p + r·s, so by Cauchy–Schwarz
/// |x·c − δ_xδ_c q·p| ≤ (‖x‖ + ‖r‖)‖s‖ + ‖r‖(‖c‖ + ‖s‖) + ‖r‖‖s‖ =: E;
/// the float32 t differs from the exact 2x·c − ‖c‖² by at most
/// (γ_dim + 2u)(‖x‖ + ‖c‖)² (u = 2⁻²⁴, γ_dim = dim·u/(1 − dim·u): the dot
/// products summed in order, the last subtraction rounded), which
/// `margin`·(‖x‖² + ‖c‖²) covers twice over; the norms are float64 upper
/// bounds and ‖c‖² a lower one, and the spare margin covers the float64
/// rounding of the bound itself (relative 1e-15 against at least 8u), plus
/// 1e-30 for float32 products that underflow.
struct Screen {
    level: Level,
    /// Integer pairs per row (features 2k and 2k + 1 in one i32, low half
    /// first; an odd last feature pairs with 0).
    npair: usize,
    /// Each spike's integer row (n × `npair`).
    q: Vec<i32>,
    /// Each spike's scale δ_x.
    scale: Vec<f64>,
    /// Upper bounds of ‖x‖.
    norm: Vec<f64>,
    /// Upper bounds of ‖r‖ = ‖x − δ_x·q‖.
    res: Vec<f64>,
    /// Lower bounds of ‖x‖².
    norm2_lo: Vec<f64>,
    /// The largest ‖x‖ + ‖r‖ of the group.
    a_max: f64,
    /// The largest ‖r‖ of the group.
    r_max: f64,
    /// The float32 rounding margin factor, (4·dim + 16)·u.
    margin: f64,
}

/// One tile of [`TILE_C`] fresh candidates as the screen sees them.
struct ScreenTile {
    /// Integer rows, pair-major (npair × TILE_C).
    cq: Vec<i32>,
    /// 2δ_c.
    dc2: [f64; TILE_C],
    /// The terms of the bound that depend on the candidate only (the group's
    /// largest ‖x‖ + ‖r‖ and ‖r‖ standing for the spike's):
    /// max(‖x‖ + ‖r‖)·2‖s‖ + max‖r‖·2(‖c‖ + 2‖s‖) + margin·‖c‖² − ‖c‖²
    /// (−∞ on padding lanes).
    h: [f64; TILE_C],
}

/// One spike's terms of the screen's bound.
#[derive(Clone, Copy)]
struct RowTerms {
    /// δ_x.
    scale: f64,
    /// margin·‖x‖² + 1e-30 − v0 (−∞ for a padding row).
    g: f64,
}

/// The terms of a padding row (never a survivor).
const PAD_ROW: RowTerms = RowTerms {
    scale: 0.0,
    g: f64::NEG_INFINITY,
};

impl Screen {
    /// The screen of the rows of `xd` (n × `dim`), or `None` when a feature
    /// is not finite or too large for it.
    fn new(xd: &[f32], dim: usize, level: Level) -> Option<Screen> {
        if dim == 0
            || dim > 100_000
            || xd
                .iter()
                .any(|v| !v.is_finite() || v.abs() > SCREEN_MAX_ABS)
        {
            return None;
        }
        let n = xd.len() / dim;
        let npair = dim.div_ceil(2);
        // |q| ≤ qmax keeps every integer dot product under 2³⁰.
        let qmax = ((1u64 << 30) / (2 * npair) as u64).isqrt().min(32_767) as f64;
        let rel = 1.0 + dim as f64 * f64::EPSILON * 4.0;
        let mut q = vec![0i32; n * npair];
        let mut scale = vec![0f64; n];
        let mut norm = vec![0f64; n];
        let mut res = vec![0f64; n];
        let mut norm2_lo = vec![0f64; n];
        q.par_chunks_mut(npair.max(1))
            .zip(xd.par_chunks(dim))
            .zip(scale.par_iter_mut())
            .zip(norm.par_iter_mut())
            .zip(res.par_iter_mut())
            .zip(norm2_lo.par_iter_mut())
            .for_each(|(((((qr, x), sc), nr), rs), n2)| {
                let maxabs = x.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
                let delta = maxabs / qmax;
                let (mut ss, mut rr) = (0f64, 0f64);
                for (k, &v) in x.iter().enumerate() {
                    let v = f64::from(v);
                    let qi = if delta > 0.0 {
                        (v / delta).round_ties_even().clamp(-qmax, qmax)
                    } else {
                        0.0
                    };
                    let half = qi as i32 as u16 as u32;
                    let word = if k % 2 == 0 { half } else { half << 16 };
                    qr[k / 2] |= word as i32;
                    ss += v * v;
                    let r = v - delta * qi;
                    rr += r * r;
                }
                *sc = delta;
                let nx = ss.sqrt() * rel;
                *nr = nx;
                *rs = rr.sqrt() * rel + 1e-12 * nx;
                *n2 = ss / rel;
            });
        let a_max = norm.iter().zip(&res).fold(0f64, |m, (n, r)| m.max(n + r));
        let r_max = res.iter().fold(0f64, |m, &r| m.max(r));
        Some(Screen {
            a_max,
            r_max,
            level,
            npair,
            q,
            scale,
            norm,
            res,
            norm2_lo,
            margin: (4 * dim + 16) as f64 * f32::EPSILON as f64 / 2.0,
        })
    }

    /// The tiles of the candidates `cand[fresh]` (ncp lanes, padded).
    fn lanes(
        &self,
        _xd: &[f32],
        _dim: usize,
        cand: &[usize],
        fresh: &[usize],
        ncp: usize,
    ) -> Vec<ScreenTile> {
        let np = self.npair;
        (0..ncp / TILE_C)
            .map(|t| {
                let mut tile = ScreenTile {
                    cq: vec![0; np * TILE_C],
                    dc2: [0.0; TILE_C],
                    h: [f64::NEG_INFINITY; TILE_C],
                };
                for l in 0..TILE_C {
                    let Some(&k) = fresh.get(t * TILE_C + l) else {
                        break;
                    };
                    let s = cand[k];
                    for p in 0..np {
                        tile.cq[p * TILE_C + l] = self.q[s * np + p];
                    }
                    tile.dc2[l] = 2.0 * self.scale[s];
                    let (nc, rc) = (self.norm[s], self.res[s]);
                    tile.h[l] = self.a_max * 2.0 * rc
                        + self.r_max * 2.0 * (nc + 2.0 * rc)
                        + (self.margin * nc * nc - self.norm2_lo[s]);
                }
                tile
            })
            .collect()
    }

    /// Spike `i`'s terms of the bound, given its v0 `e`.
    #[inline]
    fn row(&self, i: usize, e: f32) -> RowTerms {
        let nx = self.norm[i];
        RowTerms {
            scale: self.scale[i],
            g: self.margin * nx * nx + 1e-30 - f64::from(e),
        }
    }
}

/// One block of spikes (of [`SPIKE_BLOCK`]) against the fresh candidates,
/// through the [`Screen`].
struct ScreenedBlock<'a> {
    /// The block's rows (dim each).
    block: &'a [f32],
    /// Their v0.
    v0: &'a [f32],
    /// The group index of the block's first spike.
    first: usize,
    /// The candidates' float rows, tiled as in [`fresh_gains`].
    ct: &'a [f32],
    dim: usize,
    /// Live candidate columns.
    live: usize,
}

impl ScreenedBlock<'_> {
    /// As [`block_gains`]: the same sums (in spike order; the skipped spikes
    /// would add +0), gains and counts (the skipped spikes do not beat v0),
    /// the gains column by column.
    fn run(&mut self, scr: &Screen, tiles: &[ScreenTile], cn: &[f32], out: &mut BlockOut) {
        let (dim, np, nb) = (self.dim, scr.npair, self.v0.len());
        let zero_q = vec![0i32; np];
        let zero_x = vec![0f32; dim];
        let mut survivors: Vec<usize> = Vec::with_capacity(nb);
        let terms: Vec<RowTerms> = (0..nb.div_ceil(TILE_S) * TILE_S)
            .map(|s| match self.v0.get(s) {
                Some(&e) => scr.row(self.first + s, e),
                None => PAD_ROW,
            })
            .collect();
        for (t, tile) in tiles.iter().enumerate() {
            let c0 = t * TILE_C;
            let live_mask = live_lanes(self.live, c0);
            if live_mask == 0 {
                continue;
            }
            survivors.clear();
            for s0 in (0..nb).step_by(TILE_S) {
                let x: [&[i32]; TILE_S] = std::array::from_fn(|r| {
                    let i = self.first + s0 + r;
                    if s0 + r < nb {
                        &scr.q[i * np..(i + 1) * np]
                    } else {
                        &zero_q
                    }
                });
                let rows: &[RowTerms; TILE_S] =
                    terms[s0..s0 + TILE_S].try_into().expect("tile height");
                let m = screen_rows(scr.level, &x, tile, rows);
                for (r, &m) in m.iter().enumerate() {
                    if m & live_mask != 0 && s0 + r < nb {
                        survivors.push(s0 + r);
                    }
                }
            }
            let cp = &self.ct[t * dim * TILE_C..(t + 1) * dim * TILE_C];
            let tile = Survivors {
                cp,
                cnr: &cn[c0..c0 + TILE_C],
                c0,
                live_mask,
            };
            tile.book(
                self.block, self.v0, dim, scr.level, &survivors, &zero_x, out,
            );
        }
    }
}

/// One tile of [`TILE_C`] candidates and the spikes of a block that its
/// screen let through.
struct Survivors<'a> {
    /// The tile's candidates, feature-major (dim × [`TILE_C`]).
    cp: &'a [f32],
    /// Their ‖c‖².
    cnr: &'a [f32],
    /// The tile's first candidate column.
    c0: usize,
    /// Live candidate lanes.
    live_mask: u32,
}

impl Survivors<'_> {
    /// Books the gains of the spikes `survivors` (ascending, within `block`)
    /// as [`block_gains`] does ([`book_gains`] of their exact dot products).
    #[allow(clippy::too_many_arguments)]
    fn book(
        &self,
        block: &[f32],
        v0: &[f32],
        dim: usize,
        level: Level,
        survivors: &[usize],
        zero_x: &[f32],
        out: &mut BlockOut,
    ) {
        let c0 = self.c0;
        for chunk in survivors.chunks(TILE_S) {
            let x: [&[f32]; TILE_S] = std::array::from_fn(|r| match chunk.get(r) {
                Some(&s) => &block[s * dim..(s + 1) * dim],
                None => zero_x,
            });
            let acc = exact_dots(level, &x, self.cp);
            for (&s, a) in chunk.iter().zip(&acc) {
                book_gains(
                    a,
                    self.cnr,
                    v0[s],
                    &mut out.sum[c0..c0 + TILE_C],
                    self.live_mask,
                    (c0, s as u16),
                    &mut out.count,
                    &mut out.gains,
                );
            }
        }
    }
}

/// As [`block_gains`], for the spikes of `block` that the device flagged
/// (`flags`: bit t of a spike for tile t of the candidates; a spike not
/// flagged for a tile adds +0 to its sums and beats none of its candidates).
#[allow(clippy::too_many_arguments)]
fn flagged_block(
    block: &[f32],
    v0: &[f32],
    flags: &[u8],
    ct: &[f32],
    cn: &[f32],
    dim: usize,
    live: usize,
    level: Level,
    out: &mut BlockOut,
) {
    let zero_x = vec![0f32; dim];
    let mut survivors: Vec<usize> = Vec::with_capacity(v0.len());
    for (t, (cp, cnr)) in ct
        .chunks_exact(dim * TILE_C)
        .zip(cn.chunks_exact(TILE_C))
        .enumerate()
    {
        let c0 = t * TILE_C;
        let live_mask = live_lanes(live, c0);
        if live_mask == 0 {
            continue;
        }
        survivors.clear();
        survivors.extend((0..v0.len()).filter(|&s| flags[s] >> t & 1 != 0));
        let tile = Survivors {
            cp,
            cnr,
            c0,
            live_mask,
        };
        tile.book(block, v0, dim, level, &survivors, &zero_x, out);
    }
}

const _: () = assert!(
    SCREEN_TILE == TILE_C,
    "one device flag per tile of candidates"
);

/// [`tile_dots`] at `level` (the same bits at every level).
fn exact_dots(level: Level, x: &[&[f32]; TILE_S], cp: &[f32]) -> [[f32; TILE_C]; TILE_S] {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512(x: &[&[f32]; TILE_S], cp: &[f32]) -> [[f32; TILE_C]; TILE_S] {
            tile_dots(x, cp)
        }
        if level >= Level::Avx512Bw {
            // SAFETY: the level was detected on this CPU (or is Base).
            return unsafe { avx512(x, cp) };
        }
    }
    let _ = level;
    tile_dots(x, cp)
}

/// [`screen_masks`] of the integer dot products `a` (one 512-bit vector of
/// 16 i32 a row) in AVX-512 (inside a function with AVX-512F enabled).
#[cfg(target_arch = "x86_64")]
macro_rules! masks_512 {
    ($a:expr, $tile:expr, $rows:expr) => {{
        use std::arch::x86_64::*;
        let (tile, rows): (&ScreenTile, &[RowTerms; TILE_S]) = ($tile, $rows);
        // SAFETY: each array holds 16 f64, two 512-bit vectors.
        let (dc0, dc1, h0, h1) = unsafe {
            (
                _mm512_loadu_pd(tile.dc2.as_ptr()),
                _mm512_loadu_pd(tile.dc2[8..].as_ptr()),
                _mm512_loadu_pd(tile.h.as_ptr()),
                _mm512_loadu_pd(tile.h[8..].as_ptr()),
            )
        };
        let zero = _mm512_setzero_pd();
        let mut m = [0u32; TILE_S];
        for ((m, a), r) in m.iter_mut().zip($a).zip(rows) {
            let (sc, g) = (_mm512_set1_pd(r.scale), _mm512_set1_pd(r.g));
            let q0 = _mm512_cvtepi32_pd(_mm512_castsi512_si256(a));
            let q1 = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(a));
            let v0 = _mm512_add_pd(
                _mm512_mul_pd(_mm512_mul_pd(sc, dc0), q0),
                _mm512_add_pd(g, h0),
            );
            let v1 = _mm512_add_pd(
                _mm512_mul_pd(_mm512_mul_pd(sc, dc1), q1),
                _mm512_add_pd(g, h1),
            );
            // Not (v ≤ 0): NaN counts as a survivor.
            let k0 = _mm512_cmp_pd_mask::<_CMP_NLE_UQ>(v0, zero);
            let k1 = _mm512_cmp_pd_mask::<_CMP_NLE_UQ>(v1, zero);
            *m = u32::from(k0) | (u32::from(k1) << 8);
        }
        m
    }};
}

/// Which candidate lanes of `tile` each of [`TILE_S`] integer rows `x` may
/// gain from (bit l: the screen's bound is above v0), at `level`.
fn screen_rows(
    level: Level,
    x: &[&[i32]; TILE_S],
    tile: &ScreenTile,
    rows: &[RowTerms; TILE_S],
) -> [u32; TILE_S] {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
        fn vnni(
            x: &[&[i32]; TILE_S],
            tile: &ScreenTile,
            rows: &[RowTerms; TILE_S],
        ) -> [u32; TILE_S] {
            use std::arch::x86_64::*;
            let np = tile.cq.len() / TILE_C;
            let x = x.map(|r| &r[..np]);
            let mut a = [_mm512_setzero_si512(); TILE_S];
            for (p, c) in tile.cq.chunks_exact(TILE_C).enumerate().take(np) {
                // SAFETY: `c` holds TILE_C = 16 i32, one 512-bit vector.
                let c = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
                for (a, xr) in a.iter_mut().zip(x) {
                    *a = _mm512_dpwssd_epi32(*a, _mm512_set1_epi32(xr[p]), c);
                }
            }
            masks_512!(a, tile, rows)
        }
        #[target_feature(enable = "avx512f,avx512bw")]
        fn bw(x: &[&[i32]; TILE_S], tile: &ScreenTile, rows: &[RowTerms; TILE_S]) -> [u32; TILE_S] {
            use std::arch::x86_64::*;
            let np = tile.cq.len() / TILE_C;
            let x = x.map(|r| &r[..np]);
            let mut a = [_mm512_setzero_si512(); TILE_S];
            for (p, c) in tile.cq.chunks_exact(TILE_C).enumerate().take(np) {
                // SAFETY: `c` holds TILE_C = 16 i32, one 512-bit vector.
                let c = unsafe { _mm512_loadu_si512(c.as_ptr().cast()) };
                for (a, xr) in a.iter_mut().zip(x) {
                    *a = _mm512_add_epi32(*a, _mm512_madd_epi16(_mm512_set1_epi32(xr[p]), c));
                }
            }
            masks_512!(a, tile, rows)
        }
        match level {
            // SAFETY: the level was detected on this CPU.
            Level::Avx512Vnni => return unsafe { vnni(x, tile, rows) },
            // SAFETY: the level was detected on this CPU.
            Level::Avx512Bw => return unsafe { bw(x, tile, rows) },
            Level::Base => {}
        }
    }
    let _ = level;
    let mut acc = [[0i32; TILE_C]; TILE_S];
    for (p, c) in tile.cq.chunks_exact(TILE_C).enumerate() {
        for (a, xr) in acc.iter_mut().zip(x) {
            let w = xr[p];
            let (xl, xh) = (i32::from(w as i16), w >> 16);
            for (a, &cw) in a.iter_mut().zip(c) {
                *a += xl * i32::from(cw as i16) + xh * (cw >> 16);
            }
        }
    }
    screen_masks(&acc, tile, rows)
}

/// The lanes whose bound, per row, is not ≤ 0: δ_x·2δ_c·Q plus
/// max(‖x‖ + ‖r‖)·2‖s‖ plus max‖r‖·2(‖c‖ + 2‖s‖) plus
/// margin·(‖x‖² + ‖c‖²) + 1e-30 − ‖c‖² − v0.
#[inline(always)]
fn screen_masks(
    acc: &[[i32; TILE_C]; TILE_S],
    tile: &ScreenTile,
    rows: &[RowTerms; TILE_S],
) -> [u32; TILE_S] {
    let mut m = [0u32; TILE_S];
    for ((m, a), r) in m.iter_mut().zip(acc).zip(rows) {
        let mut v = [0f64; TILE_C];
        for l in 0..TILE_C {
            v[l] = (r.scale * tile.dc2[l]) * f64::from(a[l]) + (r.g + tile.h[l]);
        }
        for (l, &v) in v.iter().enumerate() {
            *m |= u32::from(v > 0.0 || v.is_nan()) << l;
        }
    }
    m
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn separated_blobs_get_their_own_labels() {
        // Three tight blobs far apart and three seeds: each blob's spikes share
        // a label and the blobs differ.
        let centres = [[10.0f32, 0.0], [0.0, 10.0], [-10.0, -10.0]];
        let mut xd = Vec::new();
        for i in 0..300 {
            let c = centres[i % 3];
            let e = (i / 3) as f32 * 1e-3;
            xd.extend_from_slice(&[c[0] + e, c[1] - e]);
        }
        let lab = kmeans_plusplus(&xd, 2, 3, SeedingRng::torch(5));
        for i in 3..300 {
            assert_eq!(lab[i], lab[i % 3], "spike {i}");
        }
        assert!(lab[0] != lab[1] && lab[1] != lab[2] && lab[0] != lab[2]);
        assert_eq!(lab, kmeans_plusplus(&xd, 2, 3, SeedingRng::torch(5)));
    }

    /// No screen, and the screen at every level this CPU has.
    fn levels() -> Vec<Option<Level>> {
        let mut v = vec![None, Some(Level::Base)];
        for l in [Level::Avx512Bw, Level::Avx512Vnni] {
            if l <= Level::detect() {
                v.push(Some(l));
            }
        }
        v
    }

    /// The seeding computed literally: every spike against every candidate,
    /// one dot product at a time.
    #[allow(clippy::needless_range_loop)]
    fn literal(xd: &[f32], dim: usize, n_clusters: usize, seed: SeedingRng) -> Vec<u32> {
        let n = xd.len() / dim;
        let rows = |i: usize| &xd[i * dim..(i + 1) * dim];
        let vtot: Vec<f32> = (0..n).map(|i| dot(rows(i), rows(i))).collect();
        let mut v0 = vec![0f32; n];
        let mut lab = vec![0u32; n];
        let mut rng = Drawer::new(seed);
        for j in 0..n_clusters {
            let cand = rng.candidates(&vtot, &v0);
            if cand.is_empty() {
                break;
            }
            let mut total = vec![0f64; cand.len()];
            for b0 in (0..n).step_by(SPIKE_BLOCK) {
                let mut sum = vec![0f64; cand.len()];
                for i in b0..(b0 + SPIKE_BLOCK).min(n) {
                    for (s, &c) in sum.iter_mut().zip(&cand) {
                        let d = 2.0 * dot(rows(i), rows(c)) - dot(rows(c), rows(c)) - v0[i];
                        if d > 0.0 {
                            *s += f64::from(d);
                        }
                    }
                }
                total.iter_mut().zip(&sum).for_each(|(t, s)| *t += s);
            }
            let best = (1..cand.len()).fold(0, |b, c| if total[c] > total[b] { c } else { b });
            let c = rows(cand[best]);
            for i in 0..n {
                let g = 2.0 * dot(rows(i), c) - dot(c, c);
                if g > v0[i] {
                    v0[i] = g;
                    lab[i] = j as u32;
                }
            }
        }
        lab
    }

    #[test]
    fn tiled_seeding_equals_literal_seeding() {
        // Blobs of different sizes and spreads, some points repeated, in a
        // dimension that is and one that is not a multiple of the tiles.
        for (dim, n, blobs) in [(84usize, 5000usize, 30usize), (7, 2500, 12)] {
            let mut x = 99u64;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f32 / (1u64 << 53) as f32 - 0.5
            };
            let centres: Vec<Vec<f32>> = (0..blobs)
                .map(|b| {
                    (0..dim)
                        .map(|_| next() * 20.0 * (1 + b % 3) as f32)
                        .collect()
                })
                .collect();
            let mut xd = Vec::with_capacity(n * dim);
            for i in 0..n {
                if i % 97 == 5 {
                    let prev = xd[(i - 1) * dim..i * dim].to_vec();
                    xd.extend(prev);
                    continue;
                }
                let c = &centres[(i * 7) % blobs];
                let spread = 0.5 + (i % 5) as f32;
                xd.extend(c.iter().map(|&v| v + spread * next()));
            }
            for seed in [SeedingRng::torch(1), SeedingRng::chacha8(5)] {
                let want = literal(&xd, dim, 60, seed);
                assert_eq!(
                    kmeans_plusplus(&xd, dim, 60, seed),
                    want,
                    "dim {dim}, seed {seed:?}"
                );
                for level in levels() {
                    for threads in [1, 2, 3] {
                        let pool = rayon::ThreadPoolBuilder::new()
                            .num_threads(threads)
                            .build()
                            .unwrap();
                        let cap = n * MEMO_GAINS_PER_SPIKE;
                        let got = pool.install(|| {
                            seed_labels(&xd, dim, 60, seed, cap, level, &SeedingDevice::cpu())
                        });
                        assert_eq!(
                            got, want,
                            "dim {dim}, seed {seed:?}, {level:?}, {threads} threads"
                        );
                    }
                }
            }
        }
    }

    /// A xorshift generator of uniform numbers in [−0.5, 0.5).
    pub(crate) fn uniform_gen(mut x: u64) -> impl FnMut() -> f32 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f32 / (1u64 << 53) as f32 - 0.5
        }
    }

    /// A device screen evaluated on the CPU as a device may: each dot product
    /// in reverse feature order with fused multiply-adds, then the bound of
    /// the device kernel; or every spike flagged.
    struct CpuDeviceBatch {
        groups: Vec<(Vec<f32>, usize, Vec<f32>)>,
        taken: Vec<bool>,
        flag_all: bool,
    }

    impl super::super::device::BatchScreen for CpuDeviceBatch {
        fn flags(
            &mut self,
            v0: &[&[f32]],
            _changed: &[&[(u32, f32)]],
            asks: &[Option<super::super::device::Ask>],
        ) -> Vec<Option<Vec<u8>>> {
            let mut out = Vec::new();
            for (g, ((xd, dim, xn), ask)) in self.groups.iter().zip(asks).enumerate() {
                let Some((cand, cn)) = ask.as_ref().filter(|a| self.taken[g] && !a.0.is_empty())
                else {
                    out.push(None);
                    continue;
                };
                let f = super::super::device::slack_factor(*dim);
                let row = |i: usize| &xd[i * dim..(i + 1) * dim];
                let flags = (0..xn.len())
                    .map(|s| {
                        let mut bits = 0u8;
                        for (k, (&c, &cc)) in cand.iter().zip(cn).enumerate() {
                            let acc = row(s)
                                .iter()
                                .zip(row(c as usize))
                                .rev()
                                .fold(0f32, |a, (&x, &y)| x.mul_add(y, a));
                            let t = 2f32.mul_add(acc, -cc);
                            let e = v0[g][s];
                            let slack = f * (xn[s] + 2.0 * cc + e.abs()) + 1e-30;
                            if self.flag_all || t > e - slack {
                                bits |= 1 << (k / SCREEN_TILE);
                            }
                        }
                        bits
                    })
                    .collect();
                out.push(Some(flags));
            }
            out
        }
    }

    struct CpuDevice {
        flag_all: bool,
    }

    impl super::super::device::ScreenFactory for CpuDevice {
        fn batch(
            &self,
            groups: &[(&[f32], usize, &[f32])],
            taken: &[bool],
        ) -> Box<dyn super::super::device::BatchScreen> {
            Box::new(CpuDeviceBatch {
                groups: groups
                    .iter()
                    .map(|&(x, d, n)| (x.to_vec(), d, n.to_vec()))
                    .collect(),
                taken: taken.to_vec(),
                flag_all: self.flag_all,
            })
        }
        fn name(&self) -> String {
            "cpu-as-device".into()
        }
    }

    #[test]
    fn device_screened_seeding_equals_literal_seeding() {
        // Blobs, repeated points and exact ties (small integer features), as
        // in the tests above, screened by a device that sums in another
        // order with fused operations, and by one that flags every spike.
        let mut next = uniform_gen(11);
        let mut cases: Vec<(usize, Vec<f32>)> = Vec::new();
        let (dim, n, blobs) = (72usize, 3000usize, 20usize);
        let centres: Vec<Vec<f32>> = (0..blobs)
            .map(|b| {
                (0..dim)
                    .map(|_| next() * 30.0 * (1 + b % 3) as f32)
                    .collect()
            })
            .collect();
        let mut xd = Vec::with_capacity(n * dim);
        for i in 0..n {
            let spread = [0.3, 1.0, 3.0][i % 3];
            xd.extend(
                centres[(i * 7) % blobs]
                    .iter()
                    .map(|&v| v + spread * next()),
            );
        }
        cases.push((dim, xd));
        let dim = 4;
        cases.push((
            dim,
            (0..2000 * dim).map(|_| (next() * 5.0).round()).collect(),
        ));
        for (dim, xd) in &cases {
            let n = xd.len() / dim;
            for seed in [SeedingRng::torch(1), SeedingRng::chacha8(5)] {
                let want = literal(xd, *dim, 120, seed);
                for flag_all in [false, true] {
                    let dev =
                        SeedingDevice::from_factory(std::sync::Arc::new(CpuDevice { flag_all }));
                    for cap in [0, n * MEMO_GAINS_PER_SPIKE] {
                        let got = seed_labels(xd, *dim, 120, seed, cap, None, &dev);
                        assert_eq!(
                            got, want,
                            "dim {dim}, seed {seed:?}, all {flag_all}, cap {cap}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn groups_seeded_in_lockstep_equal_each_alone() {
        // Groups of different sizes and dims, one too wide for the device
        // (screened on the CPU), one with a non-finite feature, one empty of
        // steps (all spikes at the origin).
        let mut next = uniform_gen(21);
        let mut groups: Vec<(Vec<f32>, usize)> = Vec::new();
        for (n, dim) in [(900usize, 12usize), (2500, 30), (400, 300), (1200, 7)] {
            groups.push((
                (0..n * dim)
                    .map(|i| next() * (1 + i % 5) as f32 * 8.0)
                    .collect(),
                dim,
            ));
        }
        groups[3].0[5] = f32::NAN;
        groups.push((vec![0f32; 50 * 3], 3));
        let views: Vec<(&[f32], usize)> = groups.iter().map(|(x, d)| (x.as_slice(), *d)).collect();
        for flag_all in [false, true] {
            let dev = SeedingDevice::from_factory(std::sync::Arc::new(CpuDevice { flag_all }));
            let many = kmeans_plusplus_many(&views, 90, SeedingRng::torch(3), &dev);
            for (g, &(x, d)) in views.iter().enumerate() {
                assert_eq!(
                    many[g],
                    kmeans_plusplus(x, d, 90, SeedingRng::torch(3)),
                    "group {g}, all {flag_all}"
                );
            }
        }
    }

    #[test]
    fn memoised_candidates_equal_literal_seeding() {
        // Few spikes and many steps: most candidates are drawn again and
        // again, so most sums come from the memo; a memo of 0 or 50 gains is
        // shrunk (and lists dropped) at nearly every step.
        let (dim, n, blobs) = (5usize, 400usize, 9usize);
        let mut next = uniform_gen(7);
        let centres: Vec<Vec<f32>> = (0..blobs)
            .map(|_| (0..dim).map(|_| next() * 40.0).collect())
            .collect();
        let mut xd = Vec::with_capacity(n * dim);
        for i in 0..n {
            let spread = [0.2, 1.0, 4.0][i % 3];
            xd.extend(centres[i % blobs].iter().map(|&v| v + spread * next()));
        }
        for seed in [SeedingRng::torch(2), SeedingRng::chacha8(9)] {
            let want = literal(&xd, dim, 80, seed);
            for cap in [0, 50, usize::MAX] {
                for level in levels() {
                    assert_eq!(
                        seed_labels(&xd, dim, 80, seed, cap, level, &SeedingDevice::cpu()),
                        want,
                        "seed {seed:?}, memo cap {cap}, screen {level:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn ties_and_repeated_points_equal_literal_seeding() {
        // Small integer features: every dot product is exact, so gains often
        // equal v0 exactly (such a spike neither adds to a sum nor takes the
        // label), most points repeat many times, many are equidistant from
        // the candidates, and the seeding runs out of unexplained spikes
        // before its last step. Over one block of spikes, so that early
        // candidates have too many gains per block to be memoised.
        let (dim, n) = (4usize, 3000usize);
        let mut next = uniform_gen(3);
        let mut xd = Vec::with_capacity(n * dim);
        for _ in 0..n {
            xd.extend((0..dim).map(|_| (next() * 5.0).round()));
        }
        for seed in [
            SeedingRng::torch(1),
            SeedingRng::chacha8(4),
            SeedingRng::torch(6),
        ] {
            let want = literal(&xd, dim, 150, seed);
            assert_eq!(kmeans_plusplus(&xd, dim, 150, seed), want, "seed {seed:?}");
            for level in levels() {
                let got = seed_labels(
                    &xd,
                    dim,
                    150,
                    seed,
                    n * MEMO_GAINS_PER_SPIKE,
                    level,
                    &SeedingDevice::cpu(),
                );
                assert_eq!(got, want, "seed {seed:?}, screen {level:?}");
            }
        }
    }

    /// Σ relu(2x·c − ‖c‖² − v0) in the literal order (float64 over blocks of
    /// [`SPIKE_BLOCK`]) and the most spikes of one block whose gain beats v0.
    fn literal_sum(xd: &[f32], c: &[f32], v0: &[f32]) -> (f64, usize) {
        let dim = c.len();
        let cn = dot(c, c);
        let mut total = 0f64;
        let mut most = 0;
        for (x, v0) in xd.chunks(SPIKE_BLOCK * dim).zip(v0.chunks(SPIKE_BLOCK)) {
            let mut s = 0f64;
            let mut beat = 0;
            for (row, &e) in x.chunks_exact(dim).zip(v0) {
                let d = 2.0 * dot(row, c) - cn - e;
                if d > 0.0 {
                    s += f64::from(d);
                }
                beat += usize::from(2.0 * dot(row, c) - cn > e);
            }
            total += s;
            most = most.max(beat);
        }
        (total, most)
    }

    #[test]
    fn fresh_and_memoised_gains_give_literal_sums_and_the_beating_spikes() {
        // Sums per candidate with the bits of the literal order; each list
        // either the spikes whose gain beats v0 or, past the per-block limit,
        // none; and once v0 has grown, the sums from the lists alone with
        // the literal bits too.
        // Rows of very different scales (and some zero rows) for the
        // screen's per-row integer scales.
        let (dim, n) = (7usize, 5000usize);
        let mut next = uniform_gen(11);
        let xd: Vec<f32> = (0..n * dim)
            .map(|k| match (k / dim) % 11 {
                4 => 0.0,
                7 => next() * 1e-3,
                9 => next() * 300.0,
                _ => next() * 10.0,
            })
            .collect();
        let v0: Vec<f32> = (0..n)
            .map(|i| {
                if i % 3 == 0 {
                    0.0
                } else {
                    (next() + 0.5) * 60.0
                }
            })
            .collect();
        let cand: Vec<usize> = (0..40).map(|c| (c * 997) % n).collect();
        let fresh: Vec<usize> = (0..cand.len()).filter(|c| c % 4 != 1).collect();
        let v1: Vec<f32> = v0.iter().map(|&e| e + (next() + 0.5) * 40.0).collect();
        for level in levels() {
            let screen = level.and_then(|l| Screen::new(&xd, dim, l));
            assert_eq!(screen.is_some(), level.is_some());
            check_fresh_gains(&xd, dim, &cand, &fresh, (&v0, &v1), screen.as_ref());
        }
    }

    /// [`fresh_gains`] against the literal sums and lists, and the lists
    /// rechecked at `v1`.
    fn check_fresh_gains(
        xd: &[f32],
        dim: usize,
        cand: &[usize],
        fresh: &[usize],
        (v0, v1): (&[f32], &[f32]),
        screen: Option<&Screen>,
    ) {
        let (sums, mut lists) = fresh_gains(xd, dim, cand, fresh, v0, screen, None);
        let row = |i: usize| &xd[i * dim..(i + 1) * dim];
        let (mut kept, mut dropped) = (0, 0);
        for (k, &f) in fresh.iter().enumerate() {
            let c = row(cand[f]);
            let (total, most) = literal_sum(xd, c, v0);
            assert_eq!(sums[k].to_bits(), total.to_bits(), "candidate {f}");
            match &mut lists[k] {
                None => {
                    assert!(most > BLOCK_GAINS_MAX, "candidate {f}");
                    dropped += 1;
                }
                Some(l) => {
                    assert!(most <= BLOCK_GAINS_MAX, "candidate {f}");
                    assert_eq!(*l, beating(xd, c, v0), "candidate {f}");
                    let again = recheck(l, v1);
                    let want = literal_sum(xd, c, v1).0;
                    assert_eq!(again.to_bits(), want.to_bits(), "candidate {f}");
                    assert_eq!(*l, beating(xd, c, v1), "candidate {f}");
                    kept += 1;
                }
            }
        }
        assert!(kept > 0 && dropped > 0, "{kept} kept, {dropped} dropped");
    }
}
