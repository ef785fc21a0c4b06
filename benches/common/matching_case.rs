//! The matching benches' case: K templates on ~10 neighbouring sites of a
//! 384-site probe and a window of noise plus their spikes every 40 samples
//! (the same for the CPU and the GPU bench).

use ndarray::{Array2, Array3};
use spikecube::UniversalTemplates;

/// xorshift noise in [-0.5, 0.5).
pub struct Noise(u64);
impl Noise {
    pub fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// Templates on ~10 neighbouring sites and a window with their spikes.
pub fn case(k: usize, n_c: usize, nt: usize, nt_win: usize) -> (Array3<f32>, Array2<f32>) {
    let wpca = UniversalTemplates::builtin().wpca;
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
    let (mut t, mut j) = (100, 0);
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
    (u, x)
}
