//! The seeding's candidate draws (Kilosort4 4.1.7
//! `clustering_qr.py:kmeans_plusplus`: `torch.manual_seed(seed)` at every
//! call, then at each step `torch.multinomial(relu(vtot − vexp0), 100)`
//! without replacement).
//!
//! Two generators, chosen by [`SeedingGenerator`]:
//!
//! - [`SeedingGenerator::Torch`] draws what torch's CPU generator draws for
//!   that call, so a group seeded from Kilosort4's input gets Kilosort4's
//!   candidates (as Kilosort4 run on the CPU draws them; its CUDA runs use
//!   another generator). torch samples without replacement by the
//!   exponential-race method: every spike i gets e_i ~ Exp(1) and the
//!   candidates are the 100 largest w_i / e_i, largest first. Here e_i is
//!   made from two outputs of MT19937 (the generator torch's CPU side
//!   uses, seeded by the reference `init_genrand` with the low 32 bits of
//!   the seed): the 53 low bits of (first · 2³² + second), times 2⁻⁵³, give
//!   u ∈ [0, 1), and e = −log1p(−u) in float64, rounded to float32; the ratio
//!   is a float32 division. Groups of more than 2²⁴ spikes draw over an evenly
//!   thinned subset, as Kilosort4 does (its `subsample_idx`). Where ratios tie
//!   (in practice only at weight 0, when fewer than 100 spikes are left
//!   unexplained) the lower spike comes first; torch's `topk` leaves that
//!   order unspecified.
//! - [`SeedingGenerator::ChaCha8`] draws one candidate at a time with
//!   probability ∝ weight from a ChaCha8 generator (rejecting repeats), and
//!   never draws a spike of weight 0.
//!
//! Both are deterministic: the same candidates for any thread count and on
//! every machine (every operation is a correctly rounded float operation or
//! glibc's `log1p`, which is the same function on every x86-64 and aarch64
//! Linux build).

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use serde::{Deserialize, Serialize};

use super::knn::linspace_round;
use super::settings::N_CANDIDATES;
use crate::detect::learn::uniform;

/// The generator of the seeding's candidate draws (see the module text).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SeedingGenerator {
    /// torch's CPU generator and `torch.multinomial`'s sampling: Kilosort4's
    /// candidates as its CPU runs draw them.
    #[default]
    Torch,
    /// A ChaCha8 stream, one weighted draw at a time.
    ChaCha8,
}

impl std::str::FromStr for SeedingGenerator {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "torch" => Ok(SeedingGenerator::Torch),
            "chacha8" => Ok(SeedingGenerator::ChaCha8),
            _ => Err(format!(
                "unknown seeding generator `{s}` (expected `torch` or `chacha8`)"
            )),
        }
    }
}

/// A generator and its seed: what a group's seeding starts from (Kilosort4
/// reseeds at every group with `cluster_init_seed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeedingRng {
    /// Which generator draws.
    pub generator: SeedingGenerator,
    /// Its seed (`cluster_init_seed`).
    pub seed: u64,
}

impl SeedingRng {
    /// torch's draws from `seed`.
    pub fn torch(seed: u64) -> Self {
        SeedingRng {
            generator: SeedingGenerator::Torch,
            seed,
        }
    }

    /// ChaCha8 draws from `seed`.
    pub fn chacha8(seed: u64) -> Self {
        SeedingRng {
            generator: SeedingGenerator::ChaCha8,
            seed,
        }
    }
}

/// torch's CPU generator as `torch.manual_seed(seed)` leaves it, with the two
/// draws the seeding uses (see the module text).
#[derive(Clone)]
pub struct TorchCpuGenerator {
    mt: rand_mt::Mt,
}

impl TorchCpuGenerator {
    /// `torch.manual_seed(seed)`: MT19937 seeded with the low 32 bits.
    pub fn manual_seed(seed: u64) -> Self {
        TorchCpuGenerator {
            mt: rand_mt::Mt::new(seed as u32),
        }
    }

    /// The next element of `torch.empty(n).exponential_()` (float32, rate 1).
    pub fn exponential(&mut self) -> f32 {
        (-(-self.uniform()).ln_1p()) as f32
    }

    /// `torch.multinomial(w, ntry)` (without replacement) on a float32 CPU
    /// tensor of non-negative weights: `min(ntry, w.len())` distinct indices,
    /// the largest w_i / e_i first. Indices of equal ratios (in practice
    /// weight 0, drawn when fewer than `ntry` weights are positive) come in
    /// index order, where torch's order is unspecified.
    pub fn multinomial(&mut self, w: &[f32], ntry: usize) -> Vec<usize> {
        torch_multinomial(w.len(), |i| w[i], ntry, self)
    }

    /// u ∈ [0, 1) from the 53 low bits of `random64()`.
    fn uniform(&mut self) -> f64 {
        const MASK: u64 = (1 << 53) - 1;
        (random64(&mut self.mt) & MASK) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// One group's generator state between steps.
pub(super) enum Drawer {
    Torch(Box<TorchCpuGenerator>),
    ChaCha8(Box<ChaCha8Rng>),
}

/// Largest number of spikes `torch.multinomial` samples from (2²⁴);
/// Kilosort4 thins larger groups to it before drawing.
const TORCH_MAX_CATEGORIES: usize = 1 << 24;

impl Drawer {
    /// The generator as Kilosort4 leaves it after seeding it for a group.
    pub(super) fn new(rng: SeedingRng) -> Self {
        match rng.generator {
            SeedingGenerator::Torch => {
                Drawer::Torch(Box::new(TorchCpuGenerator::manual_seed(rng.seed)))
            }
            SeedingGenerator::ChaCha8 => {
                Drawer::ChaCha8(Box::new(ChaCha8Rng::seed_from_u64(rng.seed)))
            }
        }
    }

    /// One step's candidates (spike rows, in the order drawn or ranked):
    /// up to [`N_CANDIDATES`] distinct spikes drawn with probability ∝
    /// w = relu(‖x‖² − v0) (`vtot`, `v0` per spike); none when every w is 0
    /// (where torch would refuse to sample).
    pub(super) fn candidates(&mut self, vtot: &[f32], v0: &[f32]) -> Vec<usize> {
        let weight = |i: usize| (vtot[i] - v0[i]).max(0.0);
        if !(0..vtot.len()).any(|i| weight(i) > 0.0) {
            return Vec::new();
        }
        match self {
            Drawer::Torch(g) => torch_multinomial(vtot.len(), weight, N_CANDIDATES, g),
            Drawer::ChaCha8(rng) => {
                let w: Vec<f32> = (0..vtot.len()).map(weight).collect();
                draw_without_replacement(&w, N_CANDIDATES, rng)
            }
        }
    }
}

/// torch's `random64()` on its CPU generator: two MT19937 outputs, the
/// first in the high half.
#[inline]
fn random64(mt: &mut rand_mt::Mt) -> u64 {
    let hi = mt.next_u32();
    let lo = mt.next_u32();
    (u64::from(hi) << 32) | u64::from(lo)
}

/// `torch.multinomial(w, ntry)` without replacement on the CPU, over the `n`
/// weights `weight(i)`: the `ntry` largest w_i / e_i (float32), largest
/// first, e_i drawn in spike order ([`race`]); over the evenly thinned subset
/// when there are more than 2²⁴ spikes.
fn torch_multinomial(
    n: usize,
    weight: impl Fn(usize) -> f32,
    ntry: usize,
    g: &mut TorchCpuGenerator,
) -> Vec<usize> {
    if n <= TORCH_MAX_CATEGORIES {
        return race(n, weight, ntry, g);
    }
    let mut keep = vec![true; n];
    for r in linspace_round(n - 1, n - TORCH_MAX_CATEGORIES) {
        keep[r] = false;
    }
    let kept: Vec<usize> = (0..n).filter(|&i| keep[i]).collect();
    race(kept.len(), |j| weight(kept[j]), ntry, g)
        .into_iter()
        .map(|j| kept[j])
        .collect()
}

/// The exponential race over `m` weights (`weight(i)`, float32, not
/// negative): every spike i in order gets e_i ~ Exp(1) from `g`, and the
/// `ntry` largest float32 ratios w_i / e_i are returned, largest first
/// (equal ratios by index).
///
/// Every e_i is drawn (the generator's state after the race is torch's),
/// but the logarithm is taken only where the ratio can enter the top
/// `ntry`: −log1p(−u) ≥ u, so w/u bounds the ratio from above (within the
/// float32 and log1p roundings, less than 2⁻²⁰ of it), and a spike whose
/// bound is below the smallest ratio kept so far cannot displace it (a later
/// spike with an equal ratio ranks after it).
fn race(
    m: usize,
    weight: impl Fn(usize) -> f32,
    ntry: usize,
    g: &mut TorchCpuGenerator,
) -> Vec<usize> {
    /// Bound on the relative rounding between w/u and the float32 ratio.
    const MARGIN: f64 = 1.0 + 1.0 / (1u64 << 20) as f64;
    let ntry = ntry.min(m);
    if ntry == 0 {
        return Vec::new();
    }
    // The best `ntry` so far as a heap whose top is the worst kept, the one
    // a newcomer must beat; `bar` is its ratio once the heap is full.
    let mut heap: std::collections::BinaryHeap<Ranked> =
        std::collections::BinaryHeap::with_capacity(ntry + 1);
    let mut bar = f64::NEG_INFINITY;
    for i in 0..m {
        let u = g.uniform();
        let wi = weight(i);
        // w/u < bar, as w < bar·u (u ≥ 0; u = 0 or a NaN product go on to
        // the exact ratio); a 0 weight never beats a full heap.
        if heap.len() == ntry && (wi <= 0.0 || f64::from(wi) * MARGIN < bar * u) {
            continue;
        }
        let e = (-(-u).ln_1p()) as f32;
        let r = Ranked {
            ratio: wi / e,
            spike: i as u32,
        };
        if heap.len() < ntry {
            heap.push(r);
        } else if heap.peek().is_some_and(|top| r.beats(top)) {
            heap.pop();
            heap.push(r);
        } else {
            continue;
        }
        if heap.len() == ntry {
            bar = heap
                .peek()
                .map_or(f64::NEG_INFINITY, |t| f64::from(t.ratio));
        }
    }
    let mut top = heap.into_vec();
    top.sort_unstable_by(|a, b| b.order(a));
    top.into_iter().map(|r| r.spike as usize).collect()
}

/// A spike's float32 ratio w/e in the exponential race.
#[derive(Clone, Copy)]
struct Ranked {
    ratio: f32,
    spike: u32,
}

impl Ranked {
    /// Rank order: larger ratio first, then lower spike first
    /// (`Greater` = ranks before).
    fn order(&self, other: &Self) -> std::cmp::Ordering {
        self.ratio
            .total_cmp(&other.ratio)
            .then(other.spike.cmp(&self.spike))
    }

    fn beats(&self, other: &Self) -> bool {
        self.order(other) == std::cmp::Ordering::Greater
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.order(other).is_eq()
    }
}

impl Eq for Ranked {}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Ranked {
    /// Reversed rank order: the max-heap's top is the worst kept.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.order(self)
    }
}

/// Most rejected (already drawn) candidates in a row before the weights are
/// rebuilt without the drawn ones.
const MAX_REJECTS: usize = 64;

/// Up to `ntry` distinct indices drawn with probability ∝ `w` (non-negative),
/// one after another without replacement (a drawn index is redrawn; after many
/// redraws in a row the weights are rebuilt without the drawn ones, which
/// gives the same distribution). Indices with weight 0 are never drawn.
pub(super) fn draw_without_replacement(w: &[f32], ntry: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
    let positive = w.iter().filter(|&&v| v > 0.0).count();
    let ntry = ntry.min(positive);
    let mut chosen: Vec<usize> = Vec::with_capacity(ntry);
    let mut is_chosen = vec![false; w.len()];
    let build = |is_chosen: &[bool]| -> Vec<f64> {
        let mut acc = 0f64;
        w.iter()
            .zip(is_chosen)
            .map(|(&v, &c)| {
                if !c && v > 0.0 {
                    acc += f64::from(v);
                }
                acc
            })
            .collect()
    };
    let mut cum = build(&is_chosen);
    let mut rejects = 0;
    while chosen.len() < ntry {
        let total = *cum.last().unwrap_or(&0.0);
        let r = uniform(rng) * total;
        let i = cum.partition_point(|&c| c <= r).min(w.len() - 1);
        if is_chosen[i] || w[i] <= 0.0 {
            rejects += 1;
            if rejects >= MAX_REJECTS {
                cum = build(&is_chosen);
                rejects = 0;
            }
            continue;
        }
        rejects = 0;
        is_chosen[i] = true;
        chosen.push(i);
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_is_the_reference_generator() {
        // The reference MT19937 (init_genrand(5489)): its 10 000th output is
        // 4 123 659 995 (C++11's check value for std::mt19937).
        let mut mt = rand_mt::Mt::new(5489);
        let mut last = 0;
        for _ in 0..10_000 {
            last = mt.next_u32();
        }
        assert_eq!(last, 4_123_659_995);
    }

    #[test]
    fn torch_draws_rank_ratios_and_are_distinct() {
        let mut w = vec![0f32; 3000];
        for (i, v) in w.iter_mut().enumerate() {
            *v = (i % 7) as f32;
        }
        let mut d = Drawer::new(SeedingRng::torch(5));
        let v0 = vec![0f32; w.len()];
        let c = d.candidates(&w, &v0);
        assert_eq!(c.len(), N_CANDIDATES);
        let mut s = c.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), N_CANDIDATES);
        assert!(c.iter().all(|&i| w[i] > 0.0));
        // The same generator state gives the same ranking, recomputed here.
        let mut g = TorchCpuGenerator::manual_seed(5);
        let r: Vec<f32> = w.iter().map(|&v| v / g.exponential()).collect();
        for p in c.windows(2) {
            assert!(r[p[0]] >= r[p[1]]);
        }
        let bar = r[*c.last().unwrap()];
        let above = r.iter().filter(|&&v| v > bar).count();
        assert_eq!(above, N_CANDIDATES - 1);
        // Fewer than 100 positive weights: they come first, then weight-0
        // spikes by index (torch's topk returns 100 all the same).
        let mut few = vec![0f32; 500];
        for i in [3usize, 40, 41, 400] {
            few[i] = 2.0;
        }
        let c = Drawer::new(SeedingRng::torch(1)).candidates(&few, &vec![0f32; 500]);
        assert_eq!(c.len(), N_CANDIDATES);
        let mut head = c[..4].to_vec();
        head.sort_unstable();
        assert_eq!(head, vec![3, 40, 41, 400]);
        assert_eq!(&c[4..8], &[0, 1, 2, 4]);
        // All weights 0: nothing to draw.
        assert!(
            Drawer::new(SeedingRng::torch(1))
                .candidates(&[1f32; 10], &[1f32; 10])
                .is_empty()
        );
    }

    /// `torch.multinomial` computed literally: every ratio, all sorted.
    fn literal_multinomial(w: &[f32], ntry: usize, g: &mut TorchCpuGenerator) -> Vec<usize> {
        let mut r: Vec<(f32, usize)> = w
            .iter()
            .enumerate()
            .map(|(i, &v)| (v / g.exponential(), i))
            .collect();
        r.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        r.into_iter().take(ntry).map(|(_, i)| i).collect()
    }

    #[test]
    fn bounded_race_equals_the_literal_race() {
        let mut x = 88172645463325252u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        let (mut a, mut b) = (
            TorchCpuGenerator::manual_seed(7),
            TorchCpuGenerator::manual_seed(7),
        );
        for case in 0..60 {
            let n = [150, 1000, 4000][case % 3];
            let w: Vec<f32> = (0..n)
                .map(|i| match case % 4 {
                    // spread weights, a few zeros
                    0 => (next() * 1e3) as f32 * f32::from(i % 17 != 0),
                    // equal weights
                    1 => 2.5,
                    // mostly zeros: fewer positive than drawn
                    2 => f32::from(i % 50 == 0),
                    // heavy tail
                    _ => (1.0 / (next() + 1e-6)) as f32,
                })
                .collect();
            let ntry = [100, 1, 37][case % 3];
            assert_eq!(
                a.multinomial(&w, ntry),
                literal_multinomial(&w, ntry, &mut b),
                "case {case}"
            );
            // The generators stay in step (every e is drawn).
            assert_eq!(a.exponential(), b.exponential(), "case {case}");
        }
    }

    #[test]
    fn chacha8_draws_are_distinct_and_skip_zero_weights() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut w = vec![0f32; 500];
        for i in (0..500).step_by(3) {
            w[i] = 1.0 + i as f32;
        }
        w[7] = 1e9; // concentrated weight: forces the rebuild path
        let d = draw_without_replacement(&w, 100, &mut rng);
        assert_eq!(d.len(), 100);
        let mut s = d.clone();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), 100);
        assert!(d.iter().all(|&i| w[i] > 0.0));
        assert_eq!(d[0], 7);
    }
}
