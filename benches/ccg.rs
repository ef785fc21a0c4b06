//! Time of one Kilosort4 cross-correlogram ([`spikecube::sort::ccg::compute_ccg`],
//! 1-ms bins over ±500 ms) between two units of a 10-minute recording, as the
//! merges and the final clustering's merge tree compute thousands of them:
//! trains of N spikes each (default 2 400, about 4 Hz), Poisson-like, from a
//! fixed seed. Prints the best of 5 rounds of 200 correlograms and a checksum
//! of the counts (the same for every build that computes the same bins).
//!
//! Usage: `cargo bench --bench ccg [-- N]`.

use std::time::Instant;

use spikecube::sort::ccg::{NBINS, TBIN, compute_ccg};

fn train(seed: u64, n: usize, seconds: f64) -> Vec<f64> {
    let mut x = seed;
    let mut t: Vec<f64> = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 11) as f64 / (1u64 << 53) as f64 * seconds
        })
        .collect();
    // Sample times at 30 kHz, as the sort's are.
    for v in t.iter_mut() {
        *v = (*v * 30000.0).round() / 30000.0;
    }
    t.sort_by(f64::total_cmp);
    t
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2400);
    let a = train(1, n, 600.0);
    let b = train(2, n, 600.0);
    let mut best = f64::INFINITY;
    let mut sum = 0.0;
    for _ in 0..5 {
        let t0 = Instant::now();
        sum = 0.0;
        for i in 0..200 {
            let c = compute_ccg(&a, if i % 2 == 0 { &b } else { &a }, TBIN, NBINS);
            sum += c
                .counts
                .iter()
                .enumerate()
                .map(|(j, v)| j as f64 * v)
                .sum::<f64>();
        }
        best = best.min(t0.elapsed().as_secs_f64() / 200.0);
    }
    println!(
        "{n} spikes a train: {:.1} µs a correlogram (best of 5 rounds of 200); checksum {sum}",
        best * 1e6
    );
}
