//! Property tests (proptest) on random probes and windows: no panic, detections in
//! (centre, sample) order, every sample within the window's own part [nt, NT − nt),
//! and the pruned detector equal to the dense oracle.

mod common;

use common::{Rng, inject, probe};
use ndarray::Array2;
use proptest::prelude::*;
use spikecube::detect::cpu::CpuDetector;
use spikecube::{DetectionSettings, Geometry, UniversalTemplates};

/// Sites on a jittered grid, up to 3 shanks, coordinates in µm.
fn arb_probe() -> impl Strategy<Value = (Vec<(f32, f32)>, Vec<i64>)> {
    (1usize..40, 1usize..4, 5.0f32..60.0, 0u64..u64::MAX).prop_map(|(n, shanks, pitch, seed)| {
        let mut rng = Rng(seed | 1);
        let mut xy = Vec::with_capacity(n);
        let mut ids = Vec::with_capacity(n);
        for i in 0..n {
            let s = (i % shanks) as i64;
            let col = (rng.uniform() * 3.0).floor() as f32;
            let row = (i / shanks) as f32;
            let jitter = if rng.uniform() < 0.3 {
                (rng.uniform() * 4.0) as f32
            } else {
                0.0
            };
            xy.push((s as f32 * 300.0 + col * pitch + jitter, row * pitch));
            ids.push(s);
        }
        (xy, ids)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn detections_are_sorted_inside_the_window_and_equal_the_oracle(
        (xy, shanks) in arb_probe(),
        nt_w in 123usize..700,
        seed in 0u64..u64::MAX,
        n_spikes in 0usize..12,
        th in prop_oneof![Just(9.0f32), 3.0f32..12.0],
    ) {
        let p = probe(&xy, &shanks);
        let settings = DetectionSettings { th_universal: th, ..DetectionSettings::default() };
        let g = match Geometry::new(&p, &settings) {
            Ok(g) => g,
            // A layout can leave no centre within max_channel_distance: a clean error.
            Err(e) => { prop_assert!(!e.to_string().is_empty()); return Ok(()); }
        };
        prop_assert!(g.weigh.iter().all(|w| w.is_finite()));
        let mut rng = Rng(seed | 1);
        let c = p.n_sites();
        let mut x = Array2::from_shape_fn((c, nt_w), |_| rng.normal() as f32);
        for _ in 0..n_spikes {
            let t0 = (rng.uniform() * nt_w as f64) as usize;
            let gains: Vec<f32> = (0..c).map(|_| if rng.uniform() < 0.3 { rng.uniform() as f32 } else { 0.0 }).collect();
            inject(&mut x, t0, (rng.uniform() * 6.0) as usize % 6, 10.0 + 30.0 * rng.uniform() as f32, &gains);
        }
        let mut det = CpuDetector::new(g, UniversalTemplates::builtin(), settings).unwrap();
        let d = det.detect(x.view(), &p.yc).unwrap();
        let pairs: Vec<(u32, u64)> = d.centre.iter().copied().zip(d.sample.iter().copied()).collect();
        prop_assert!(pairs.windows(2).all(|w| w[0] < w[1]), "not sorted by (centre, sample)");
        for &(_, t) in &pairs {
            prop_assert!(t >= 61 && t < (nt_w - 61) as u64, "sample {} outside [61, {})", t, nt_w - 61);
        }
        prop_assert!(d.amp.iter().all(|&a| a > th));
        prop_assert!(d.imax.iter().all(|&r| r < 30));
        prop_assert!(d.yct.iter().all(|v| v.is_finite()));
        let dense = det.detect_dense(x.view(), &p.yc).unwrap();
        prop_assert_eq!(d, dense);
    }

    #[test]
    fn short_or_mismatched_windows_are_clean_errors(rows in 1usize..6, cols in 0usize..130) {
        let p = probe(&[(0.0, 0.0), (0.0, 20.0), (20.0, 0.0), (20.0, 20.0)], &[0; 4]);
        let s = DetectionSettings::default();
        let g = Geometry::new(&p, &s).unwrap();
        let mut det = CpuDetector::new(g, UniversalTemplates::builtin(), s).unwrap();
        let x = Array2::<f32>::zeros((rows, cols));
        let r = det.detect(x.view(), &p.yc);
        prop_assert_eq!(r.is_ok(), rows == 4 && cols >= 123);
    }
}
