//! Time of the CPU learned-template matching on one default-size window
//! (384 sites × 60 122 samples, whitened-like noise plus spikes of the
//! templates every ~40 samples): set-up (`prepare_extract`/`prepare_matching`)
//! and `match_window` (filter product, peels, features), for K templates,
//! K = 100, 400 and 2 000 by default, each on ~10 neighbouring sites (two
//! columns, 15 µm rows, as Neuropixels 2.0). Uses every rayon thread.
//!
//! Usage: `cargo bench --bench matching [-- K...]`.

use std::time::Instant;

use ndarray::{Array2, Array3};
use spikecube::UniversalTemplates;
use spikecube::sort::matching::{MatchingSettings, MatchingSetup, match_window};

/// xorshift noise in [-0.5, 0.5).
struct Noise(u64);
impl Noise {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

fn main() {
    let ks: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let ks = if ks.is_empty() {
        vec![100, 400, 2000]
    } else {
        ks
    };
    let (n_c, nt, nt_win) = (384usize, 61usize, 60_122usize);
    let wpca = UniversalTemplates::builtin().wpca;
    let xc: Vec<f32> = (0..n_c).map(|i| 32.0 * (i % 2) as f32).collect();
    let yc: Vec<f32> = (0..n_c).map(|i| 15.0 * (i / 2) as f32).collect();
    for k in ks {
        let mut rng = Noise(0x9e37_79b9_7f4a_7c15 ^ k as u64);
        let mut u = Array3::<f32>::zeros((k, 6, n_c));
        for j in 0..k {
            let centre = (j * 7919) % (n_c - 10);
            for c in centre..centre + 10 {
                let g = 10.0 * (-((c - centre) as f32 - 5.0).powi(2) / 8.0).exp();
                for p in 0..6 {
                    u[[j, p, c]] = g * (if p == 0 { 1.0 } else { 0.4 * rng.next() });
                }
            }
        }
        let mut x = Array2::<f32>::zeros((n_c, nt_win));
        x.mapv_inplace(|_| 2.0 * rng.next());
        let mut t = 100;
        let mut j = 0;
        while t + 100 < nt_win {
            for c in 0..n_c {
                for i in 0..nt {
                    let w: f32 = (0..6).map(|p| u[[j % k, p, c]] * wpca[[p, i]]).sum();
                    x[[c, t - nt / 2 + i]] += 1.5 * w;
                }
            }
            t += 40;
            j += 7;
        }
        let t0 = Instant::now();
        let setup = MatchingSetup::new(
            u.view(),
            wpca.view(),
            &xc,
            &yc,
            &MatchingSettings::default(),
        )
        .expect("set-up");
        let t_setup = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let sp = match_window(&setup, x.view()).expect("window");
        let t_win = t1.elapsed().as_secs_f64();
        println!(
            "K = {k}: set-up {t_setup:.3} s ({} pairs, {:.1} MB), window {t_win:.3} s: {} spikes in {} peels, {} threads",
            setup.n_pairs(),
            setup.pair_bytes() as f64 / 1e6,
            sp.len(),
            sp.peels,
            rayon::current_num_threads()
        );
    }
}
