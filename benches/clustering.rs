//! Wall time of both clusterings on the `sim32` sort fixture (Kilosort4's own
//! st0/tF0 and st/tF), with 1, 2 and all threads. Run with
//! `cargo bench --bench clustering`; `SPIKECUBE_SORT_CASE=oe16` picks another
//! case under `tests/data/sort/`.

#[path = "../tests/sort_fixture/mod.rs"]
mod sort_fixture;

use std::time::Instant;

use sort_fixture::{Case, final_inputs, first_inputs};
use spikecube::sort::clustering::{self, ClusteringSettings};

fn main() {
    let name = std::env::var("SPIKECUBE_SORT_CASE").unwrap_or_else(|_| "sim32".into());
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/sort")
        .join(&name);
    let c = Case::load(&dir);
    let fi = first_inputs(&c);
    let fl = final_inputs(&c);
    let settings = ClusteringSettings::ks4_compatible();
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut threads = vec![1, 2, all];
    threads.dedup();
    for t in threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .unwrap();
        for rep in 0..2 {
            pool.install(|| {
                let t0 = Instant::now();
                let a = clustering::run(&fi.input(), &settings).unwrap();
                let t1 = Instant::now();
                let b = clustering::run(&fl.input(), &settings).unwrap();
                let t2 = Instant::now();
                println!(
                    "{name} threads {t} run {rep}: first {:.3} s ({} spikes, {} clusters), final {:.3} s ({} spikes, {} clusters)",
                    (t1 - t0).as_secs_f64(),
                    a.clu.len(),
                    a.wall.shape()[0],
                    (t2 - t1).as_secs_f64(),
                    b.clu.len(),
                    b.wall.shape()[0]
                );
            });
        }
    }
}
