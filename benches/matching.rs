//! Time of the CPU learned-template matching on one default-size window
//! (384 sites × 60 122 samples, whitened-like noise plus spikes of the
//! templates every ~40 samples): set-up (`prepare_extract`/`prepare_matching`)
//! and `match_window` (filter product, peels, features; the first window,
//! then the best of 3 more on its buffers, as later windows of a pass, and
//! the best of 3 in place, the window becoming the residual), for K templates,
//! K = 100, 400 and 2 000 by default, each on ~10 neighbouring sites (two
//! columns, 15 µm rows, as Neuropixels 2.0). Uses every rayon thread.
//!
//! Usage: `cargo bench --bench matching [-- K...]`.

use std::time::Instant;

use spikecube::UniversalTemplates;
use spikecube::sort::matching::{
    MatchingSettings, MatchingSetup, match_window, match_window_in_place,
};

#[path = "common/matching_case.rs"]
mod matching_case;
use matching_case::case;

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
        let (u, x) = case(k, n_c, nt, nt_win);
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
        // Later windows reuse the first one's buffers, as in a whole pass.
        let mut t_again = f64::INFINITY;
        for _ in 0..3 {
            let t2 = Instant::now();
            let again = match_window(&setup, x.view()).expect("window");
            t_again = t_again.min(t2.elapsed().as_secs_f64());
            assert_eq!(again, sp, "the same window twice");
        }
        // In place: the window (a fresh copy, made outside the clock)
        // becomes the residual, as in a sort's matching pass.
        let mut t_in_place = f64::INFINITY;
        for _ in 0..3 {
            let mut own = x.clone();
            let t2 = Instant::now();
            let again = match_window_in_place(&setup, &mut own).expect("window");
            t_in_place = t_in_place.min(t2.elapsed().as_secs_f64());
            assert_eq!(again, sp, "in place");
        }
        println!(
            "K = {k}: set-up {t_setup:.3} s ({} pairs, {:.1} MB), window {t_win:.3} s, again {t_again:.3} s, in place {t_in_place:.3} s (best of 3): {} spikes in {} peels, {} threads",
            setup.n_pairs(),
            setup.pair_bytes() as f64 / 1e6,
            sp.len(),
            sp.peels,
            rayon::current_num_threads()
        );
    }
}
