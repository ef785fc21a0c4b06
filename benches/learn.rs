//! Time of learning the universal templates (`templates_from_data`) from N
//! clips: clip extraction on one default-size whitened window (384 × 60 122,
//! noise plus isolated spikes), then wPCA and wTEMP (k-means, 10 restarts) on
//! N spike-like unit-norm clips, N = 10 000, 100 000 and 500 000 (the cap).
//!
//! Usage: `cargo bench --bench learn [-- N...]`.

use std::time::Instant;

use ndarray::Array2;
use spikecube::detect::learn::{LearnSettings, extract_clips, learn_wpca, learn_wtemp};

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

/// n clips: one of 8 trough-at-20 shapes of varying width, plus noise, unit norm.
fn clips(n: usize) -> Array2<f32> {
    let mut rng = Noise(0x9e37_79b9_7f4a_7c15);
    let mut x = Array2::<f32>::zeros((n, 61));
    for i in 0..n {
        let w = 2.0 + (i % 8) as f32 * 0.7;
        let mut norm = 0f32;
        for t in 0..61 {
            let d = (t as f32 - 20.0) / w;
            let v = -(-d * d).exp() + 0.3 * (-(d - 3.0).powi(2) / 4.0).exp() + 0.3 * rng.next();
            x[[i, t]] = v;
            norm += v * v;
        }
        x.row_mut(i).mapv_inplace(|v| v / norm.sqrt());
    }
    x
}

fn main() {
    let mut ns: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if ns.is_empty() {
        ns = vec![10_000, 100_000, 500_000];
    }
    let threads = rayon::current_num_threads();
    let mut rng = Noise(1);
    let mut win = Array2::from_shape_fn((384, 60_122), |_| 2.0 * rng.next());
    for k in 0..2000 {
        win[[(k * 37) % 384, 100 + k * 29]] = -12.0;
    }
    let t = Instant::now();
    let (peaks, _) = extract_clips(win.view(), 6.0, 61, 20);
    println!(
        "clip extraction, one 384 × 60 122 window: {:.1} ms, {} clips ({threads} threads)",
        t.elapsed().as_secs_f64() * 1e3,
        peaks.len()
    );
    for n in ns {
        let c = clips(n);
        let t = Instant::now();
        learn_wpca(c.view(), 6).unwrap();
        let t_pca = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (_, km) = learn_wtemp(c.view(), &LearnSettings::default()).unwrap();
        let t_km = t.elapsed().as_secs_f64();
        println!(
            "{n} clips: wPCA {:.3} s, wTEMP (k-means, 10 restarts) {:.2} s, inertia {:.2}, iterations {:?} ({threads} threads)",
            t_pca, t_km, km.inertia, km.iterations
        );
    }
}
