//! Time of the clustering's k-means++ seeding (Kilosort4's
//! `kmeans_plusplus`, 200 clusters, seed 5) on feature matrices of real
//! groups, as `SPIKECUBE_CLUSTER_PROFILE=1 SPIKECUBE_CLUSTER_DUMP=DIR` writes
//! them (`group_<n>x<dim>.npy`, float32, n × dim). Prints, per file, the best
//! of `SPIKECUBE_BENCH_RUNS` (default 3) runs on the CPU with every rayon
//! thread, and a hash of the labels (the same for every run). The draws are
//! torch's, or ChaCha8's with `SPIKECUBE_BENCH_GENERATOR=chacha8`.
//!
//! Usage: `cargo bench --bench seeding -- FILE.npy...`.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::Path;
use std::time::Instant;

use ndarray::Array2;
use spikecube::sort::clustering::SeedingRng;
use spikecube::sort::clustering::seeding::kmeans_plusplus;
use spikecube::sort::clustering::settings::N_CLUSTERS_INIT;

fn main() {
    let runs: usize = std::env::var("SPIKECUBE_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let files: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a.ends_with(".npy"))
        .collect();
    if files.is_empty() {
        eprintln!("usage: cargo bench --bench seeding -- FILE.npy...");
        return;
    }
    let rng = match std::env::var("SPIKECUBE_BENCH_GENERATOR").as_deref() {
        Ok("chacha8") => SeedingRng::chacha8(5),
        _ => SeedingRng::torch(5),
    };
    let mut total = 0.0;
    for f in &files {
        let x: Array2<f32> = spikecube::npy::read(Path::new(f)).expect("a float32 n × dim array");
        let (n, dim) = x.dim();
        let xd = x
            .as_standard_layout()
            .into_owned()
            .into_raw_vec_and_offset()
            .0;
        let mut best = f64::INFINITY;
        let mut hash = None;
        for _ in 0..runs {
            let t = Instant::now();
            let labels = kmeans_plusplus(&xd, dim, N_CLUSTERS_INIT, rng);
            best = best.min(t.elapsed().as_secs_f64());
            let mut h = DefaultHasher::new();
            labels.hash(&mut h);
            let h = h.finish();
            assert!(hash.is_none_or(|v| v == h), "the same labels every run");
            hash = Some(h);
        }
        total += best;
        println!(
            "{n} × {dim}: {best:.3} s (best of {runs}), labels {:016x}, {} threads",
            hash.unwrap_or(0),
            rayon::current_num_threads()
        );
    }
    println!("total {total:.3} s");
}
