//! Time of the drift estimate's registration (Kilosort4's `align_block2`,
//! [`spikecube::drift::register`]) and of its search-range check
//! ([`spikecube::drift::estimate::check_search_range`]) on the first-pass
//! spikes of a 10-minute 384-site recording: 300 batches of 2 s, a
//! Neuropixels 2.0-like single shank (rows every 15 µm, 5-µm depth bins:
//! 575 bins), 1 900 spikes a second from 400 units whose depth drifts
//! slowly by up to ±20 µm. Prints the best of `RUNS` (default 3) runs of
//! each and a hash of the results (the same for every run and build that
//! computes the same bits).
//!
//! Usage: `cargo bench --bench drift_register [-- RUNS]`.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Instant;

use spikecube::drift::estimate::check_search_range;
use spikecube::drift::{FirstPassSpikes, bin_spikes, register};

/// xorshift numbers.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [0, 1).
    fn f(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(3);
    let n_sites = 384;
    let yc: Vec<f32> = (0..n_sites).map(|i| 15.0 * (i / 2) as f32).collect();
    let (n_batches, per_batch, n_units) = (300usize, 3_800usize, 400usize);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let depth: Vec<f64> = (0..n_units).map(|_| 20.0 + 2820.0 * rng.f()).collect();
    let amp: Vec<f64> = (0..n_units).map(|_| 10.0 + 60.0 * rng.f()).collect();
    let mut spikes = FirstPassSpikes::default();
    for b in 0..n_batches {
        let shift = 20.0 * (b as f64 / 50.0).sin();
        for _ in 0..per_batch {
            let u = (rng.next() % n_units as u64) as usize;
            let y = depth[u] + shift + 6.0 * (rng.f() - 0.5);
            spikes.y.push(y.clamp(0.0, 2865.0) as f32);
            spikes.amp.push((amp[u] * (0.8 + 0.4 * rng.f())) as f32);
            spikes.batch.push(b as u32);
            spikes.sample.push((b * 60_000) as i64);
        }
    }
    let hist = bin_spikes(&spikes, &yc, 5.0, 9.0, n_batches).expect("histogram");
    let reference = spikecube::drift::estimate::reference_batch(n_batches);
    let mut best = (f64::INFINITY, f64::INFINITY);
    let mut hashes = Vec::new();
    for _ in 0..runs {
        let t0 = Instant::now();
        let reg = register(&hist, 1, [0.5, 0.5, 0.5], reference).expect("registration");
        let t1 = Instant::now();
        let check = check_search_range(&hist, &reg, reference);
        let t2 = Instant::now();
        best.0 = best.0.min((t1 - t0).as_secs_f64());
        best.1 = best.1.min((t2 - t1).as_secs_f64());
        let mut h = DefaultHasher::new();
        reg.rigid.hash(&mut h);
        for v in reg.scores.iter().chain(reg.imin.iter()) {
            v.to_bits().hash(&mut h);
        }
        check.missed.hash(&mut h);
        check.edge_batches.hash(&mut h);
        hashes.push(h.finish());
    }
    hashes.dedup();
    println!(
        "{n_batches} batches × {} depth bins: register {:.3} s, check_search_range {:.3} s (best of {runs}, {} threads); results hash {:016x}{}",
        hist.n_depth(),
        best.0,
        best.1,
        rayon::current_num_threads(),
        hashes[0],
        if hashes.len() > 1 {
            " (runs differ!)"
        } else {
            ""
        }
    );
}
