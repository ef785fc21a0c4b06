//! The seeding with its candidate pairs screened on a GPU
//! (`kmeans_plusplus_on` with a `SeedingDevice`) against the CPU seeding
//! (`kmeans_plusplus`, itself checked against a literal implementation in
//! the library's tests): the labels must be the same, value for value, on
//! wgpu (Mesa lavapipe in CI) and, when asked for, CUDA (`#[ignore]`d:
//! `cargo test --release --test seeding_gpu -- --include-ignored` on a
//! machine with an NVIDIA GPU).
#![cfg(any(feature = "cuda", feature = "wgpu"))]

mod common;

use spikecube::sort::clustering::seeding::{
    kmeans_plusplus, kmeans_plusplus_on, kmeans_plusplus_on_device,
};
use spikecube::sort::clustering::{SeedingDevice, SeedingRng};

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
        for seed in [SeedingRng::torch(5), SeedingRng::chacha8(8)] {
            let want = kmeans_plusplus(xd, *dim, 200, seed);
            let got = kmeans_plusplus_on(xd, *dim, 200, seed, device);
            let diff = want.iter().zip(&got).filter(|(a, b)| a != b).count();
            assert_eq!(diff, 0, "{name}, seed {seed:?}: {diff} labels differ");
            let again = kmeans_plusplus_on(xd, *dim, 200, seed, device);
            assert_eq!(got, again, "{name}, seed {seed:?}: a second run differs");
        }
    }
}

/// The seeding with every gain on the device, all groups in lockstep:
/// blobs over several blocks of 2048 spikes, integer features with exact
/// ties (gains equal to v0, equal totals), a group of spikes at the origin
/// (no step) and a group of identical spikes.
fn check_lockstep(device: &SeedingDevice) {
    let mut next = uniform_gen(9);
    let mut groups: Vec<(Vec<f32>, usize)> = vec![
        (blobs(4500, 84, 25, 1), 84),
        (blobs(4100, 60, 18, 2), 60),
        ((0..3000 * 4).map(|_| (next() * 5.0).round()).collect(), 4),
        (blobs(1200, 72, 30, 3), 72),
        (vec![0f32; 1000 * 6], 6),
        (blobs(1, 12, 1, 5).repeat(1500), 12),
    ];
    groups.push((blobs(2100, 256, 12, 6), 256));
    let views: Vec<(&[f32], usize)> = groups.iter().map(|(x, d)| (x.as_slice(), *d)).collect();
    // Draws on 3 threads, then on 1 (the labels do not depend on it).
    for (seed, threads) in [(SeedingRng::torch(5), 3usize), (SeedingRng::chacha8(8), 1)] {
        let got = kmeans_plusplus_on_device(&views, 200, seed, device, threads)
            .expect("the device seeds these groups");
        for (g, &(xd, dim)) in views.iter().enumerate() {
            let want = kmeans_plusplus(xd, dim, 200, seed);
            let diff = want.iter().zip(&got[g]).filter(|(a, b)| a != b).count();
            assert_eq!(
                diff, 0,
                "group {g} ({dim} features), seed {seed:?}: {diff} labels differ"
            );
        }
    }
    // A group wider than the device takes: not seeded there.
    let wide = blobs(1500, 300, 10, 4);
    assert!(
        kmeans_plusplus_on_device(&[(&wide, 300)], 200, SeedingRng::torch(5), device, 2).is_none()
    );
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_screened_seeding_equals_cpu() {
    crate::common::require_vulkan();
    check(&SeedingDevice::wgpu());
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_lockstep_seeding_equals_cpu() {
    crate::common::require_vulkan();
    // Launches folded onto a second axis past 7 cubes, as only the largest
    // groups' launches are otherwise (the labels do not change).
    // SAFETY: no other test of this file reads or writes this variable.
    unsafe { std::env::set_var("SPIKECUBE_SEED_DISPATCH_X", "7") };
    check_lockstep(&SeedingDevice::wgpu());
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_lockstep_seeding_equals_cpu() {
    check_lockstep(&SeedingDevice::cuda());
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_screened_seeding_equals_cpu() {
    check(&SeedingDevice::cuda());
}
