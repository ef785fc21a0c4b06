//! The whitening fit's speed work changes no bit: the covariance
//! and W of every schedule ([`FitOptions`]) and thread count equal those of
//! the code before it (one step at a time, faer's full `X·Xᵀ` per 4096
//! columns), on synthetic recordings of 384 and 61 sites, with sign
//! inversion, without CAR and with a window zeroed by the artifact check.

use ndarray::Array2;
use spikecube::Probe;
use spikecube::preprocess::{
    FitOptions, FitTimes, PreprocessSettings, accumulate_covariance, accumulate_covariance_plain,
    fit_whitening, whitening_covariance_into, whitening_covariance_with, whitening_from_covariance,
};

fn two_column_probe(c: usize) -> Probe {
    Probe {
        xc: (0..c).map(|i| 32.0 * (i % 2) as f32).collect(),
        yc: (0..c).map(|i| 15.0 * (i / 2) as f32).collect(),
        kcoords: vec![0; c],
        chan_map: (0..c as u64).collect(),
        n_chan: c as u64,
        source: "synthetic two-column probe".into(),
    }
}

/// Window `i` of a deterministic noisy recording: uniform noise, a shared
/// slow component, per-channel offsets; window `spike_window` carries one
/// huge sample (for the artifact check).
fn raw_window(c: usize, n: usize, i: u64, spike_window: Option<u64>) -> Array2<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ (i + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut x = Array2::from_shape_fn((c, n), |(r, t)| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        u * 60.0 + 20.0 * ((t as f32) * 0.003 + r as f32 * 0.1).sin() + (r % 7) as f32
    });
    if spike_window == Some(i) {
        x[(c / 2, n / 2)] = 30_000.0;
    }
    x
}

fn bits<'a>(v: impl IntoIterator<Item = &'a f64>) -> Vec<u64> {
    v.into_iter().map(|x| x.to_bits()).collect()
}

fn case(c: usize, settings: &PreprocessSettings, n_windows: u64, spike_window: Option<u64>) {
    let probe = two_column_probe(c);
    let n = settings.window_len();
    let read =
        |i: u64| -> Result<Array2<f32>, anyhow::Error> { Ok(raw_window(c, n, i, spike_window)) };
    let plain = FitOptions::plain();
    let pool1 = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let reference = pool1
        .install(|| {
            whitening_covariance_with(
                n_windows,
                read,
                &probe,
                settings,
                plain,
                &mut FitTimes::default(),
            )
        })
        .unwrap();
    let w_ref = whitening_from_covariance(&reference, &probe, settings.whitening_range).unwrap();
    assert!(reference.iter().all(|v| v.is_finite()) && reference[(0, 0)] > 0.0);
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for pipelined in [false, true] {
            for fast_product in [false, true] {
                let options = FitOptions {
                    pipelined,
                    fast_product,
                    reuse_buffers: true,
                };
                let mut times = FitTimes::default();
                let cc = pool
                    .install(|| {
                        whitening_covariance_with(
                            n_windows, read, &probe, settings, options, &mut times,
                        )
                    })
                    .unwrap();
                assert_eq!(
                    bits(&cc),
                    bits(&reference),
                    "{c} sites: covariance, {options:?}, {threads} threads"
                );
                assert!(times.0.contains_key("product") && times.0.contains_key("car"));
            }
        }
        // Read into the fit's reused buffers (as `spikecube detect` reads).
        let mut reads = 0;
        let cc = pool
            .install(|| {
                whitening_covariance_into(
                    n_windows,
                    |i, x: &mut Array2<f32>| -> Result<(), anyhow::Error> {
                        reads += 1;
                        x.assign(&raw_window(c, n, i, spike_window));
                        Ok(())
                    },
                    &probe,
                    settings,
                    FitOptions::default(),
                    &mut FitTimes::default(),
                )
            })
            .unwrap();
        assert_eq!(bits(&cc), bits(&reference), "{c} sites: read into buffers");
        assert!(reads >= 1);
        let w = pool
            .install(|| fit_whitening::<anyhow::Error, _>(n_windows, read, &probe, settings))
            .unwrap();
        let wb = |w: &Array2<f32>| w.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(wb(&w), wb(&w_ref), "{c} sites: W, {threads} threads");
    }
}

#[test]
fn fit_schedules_and_thread_counts_give_the_plain_fits_bits_384_sites() {
    let settings = PreprocessSettings {
        batch_size: 6000,
        nskip: 2,
        ..PreprocessSettings::default()
    };
    // Windows 0, 2, 4 of 6.
    case(384, &settings, 6, None);
}

#[test]
fn fit_schedules_and_thread_counts_give_the_plain_fits_bits_61_sites() {
    let settings = PreprocessSettings {
        batch_size: 9000,
        nskip: 1,
        invert_sign: true,
        do_car: false,
        whitening_range: 61,
        artifact_threshold: Some(5000.0),
        ..PreprocessSettings::default()
    };
    // Windows 0 … 3 of 5; window 2 is zeroed by the artifact check.
    case(61, &settings, 5, Some(2));
}

#[test]
fn fit_schedules_and_thread_counts_give_the_plain_fits_bits_many_windows() {
    let settings = PreprocessSettings {
        batch_size: 3000,
        nskip: 1,
        whitening_range: 8,
        ..PreprocessSettings::default()
    };
    // Windows 0 … 8 of 10: buffers are reused several times.
    case(48, &settings, 10, None);
}

/// `accumulate_covariance` (fast where it keeps the bits) and the plain
/// product agree bit for bit on a sliced (non-contiguous) block too.
#[test]
fn accumulate_covariance_equals_the_plain_product() {
    for (c, n, nt) in [
        (384usize, 4096 * 3 + 700, 61usize),
        (5, 300, 10),
        (1, 5000, 61),
    ] {
        let x = raw_window(c, n, 7, None);
        let central = x.slice(ndarray::s![.., nt..n - nt]);
        let mut a = Array2::<f64>::zeros((c, c));
        let mut b = Array2::<f64>::zeros((c, c));
        accumulate_covariance(&mut a, central).unwrap();
        accumulate_covariance(&mut a, central).unwrap();
        accumulate_covariance_plain(&mut b, central).unwrap();
        accumulate_covariance_plain(&mut b, central).unwrap();
        assert_eq!(bits(&a), bits(&b), "{c} × {n}");
    }
}
