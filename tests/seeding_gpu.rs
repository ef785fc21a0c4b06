//! The seeding with its candidate pairs screened on a GPU
//! (`kmeans_plusplus_on` with a `SeedingDevice`) against the CPU seeding
//! (`kmeans_plusplus`, itself checked against a literal implementation in
//! the library's tests): the labels must be the same, value for value, on
//! wgpu (Mesa lavapipe in CI) and, when asked for, CUDA (`#[ignore]`d:
//! `cargo test --release --test seeding_gpu -- --include-ignored` on a
//! machine with an NVIDIA GPU).
#![cfg(any(feature = "cuda", feature = "wgpu"))]

mod common;

use spikecube::sort::clustering::SeedingDevice;
use spikecube::sort::clustering::seeding::{kmeans_plusplus, kmeans_plusplus_on};

/// A xorshift generator of uniform numbers in [−0.5, 0.5).
fn uniform_gen(mut x: u64) -> impl FnMut() -> f32 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f32 / (1u64 << 53) as f32 - 0.5
    }
}

/// `n` spikes × `dim` features around `blobs` centres of three scales, with
/// three spreads, every 97th spike a copy of the one before.
fn blobs(n: usize, dim: usize, blobs: usize, seed: u64) -> Vec<f32> {
    let mut next = uniform_gen(seed);
    let centres: Vec<Vec<f32>> = (0..blobs)
        .map(|b| {
            (0..dim)
                .map(|_| next() * 25.0 * (1 + b % 3) as f32)
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
        let spread = [0.4, 1.5, 4.0][i % 3];
        xd.extend(
            centres[(i * 7) % blobs]
                .iter()
                .map(|&v| v + spread * next()),
        );
    }
    xd
}

fn check(device: &SeedingDevice) {
    let mut next = uniform_gen(3);
    let cases: Vec<(&str, usize, Vec<f32>)> = vec![
        ("blobs, 84 features", 84, blobs(6000, 84, 25, 1)),
        ("blobs, 60 features", 60, blobs(4100, 60, 18, 2)),
        // Small integers: exact dot products, gains often equal to v0.
        (
            "integer ties, 4 features",
            4,
            (0..3000 * 4).map(|_| (next() * 5.0).round()).collect(),
        ),
        // Wider than the device takes: screened on the CPU.
        ("blobs, 300 features", 300, blobs(1500, 300, 10, 4)),
    ];
    for (name, dim, xd) in &cases {
        for seed in [5u64, 8] {
            let want = kmeans_plusplus(xd, *dim, 200, seed);
            let got = kmeans_plusplus_on(xd, *dim, 200, seed, device);
            let diff = want.iter().zip(&got).filter(|(a, b)| a != b).count();
            assert_eq!(diff, 0, "{name}, seed {seed}: {diff} labels differ");
            let again = kmeans_plusplus_on(xd, *dim, 200, seed, device);
            assert_eq!(got, again, "{name}, seed {seed}: a second run differs");
        }
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_screened_seeding_equals_cpu() {
    crate::common::require_vulkan();
    check(&SeedingDevice::wgpu());
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_screened_seeding_equals_cpu() {
    check(&SeedingDevice::cuda());
}
