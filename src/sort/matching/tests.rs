//! The matching's previous, literal implementation (a straightforward loop
//! nest per step), kept as the reference of the optimised one: on random
//! windows, with overlapping and exactly tied spikes, both must give the same
//! spikes with the same bits, on any thread count.

use ndarray::{Array2, Array3, ShapeBuilder};

use super::*;

mod reference {
    //! B in tiles of `TILE` samples, one template at a time; a sequential
    //! best-template scan; the subtraction one spike at a time.

    use super::super::{MatchError, MatchingSetup, WindowSpikes, features, shape_err};
    use ndarray::{Array2, ArrayView2};
    use rayon::prelude::*;

    const TILE: usize = 1024;

    /// B (time-major, NT × K) of a window: the filter bank product, in tiles.
    fn filter_product(setup: &MatchingSetup, x: ArrayView2<f32>) -> Vec<f32> {
        let (k, npc, _) = setup.u.dim();
        let n = x.ncols();
        let nt = setup.settings.nt;
        let half = nt / 2;
        let used: Vec<usize> = {
            let mut m = vec![false; x.nrows()];
            for s in &setup.support {
                for &c in s {
                    m[c as usize] = true;
                }
            }
            (0..x.nrows()).filter(|&c| m[c]).collect()
        };
        let mut slot = vec![usize::MAX; x.nrows()];
        for (i, &c) in used.iter().enumerate() {
            slot[c] = i;
        }
        let mut b = vec![0f32; n * k];
        b.par_chunks_mut(TILE * k)
            .enumerate()
            .for_each(|(tile, out)| {
                let t0 = tile * TILE;
                let w = out.len() / k;
                // F[slot][p][t]: the filtered site over this tile.
                let mut f = vec![0f32; used.len() * npc * w];
                let mut seg = vec![0f32; w + 2 * half];
                for (si, &c) in used.iter().enumerate() {
                    let row = x.row(c);
                    for (i, v) in seg.iter_mut().enumerate() {
                        let t = (t0 + i) as i64 - half as i64;
                        *v = if t >= 0 && (t as usize) < n {
                            row[t as usize]
                        } else {
                            0.0
                        };
                    }
                    for p in 0..npc {
                        let fo = &mut f[(si * npc + p) * w..(si * npc + p + 1) * w];
                        for i in 0..nt {
                            let wv = setup.wpca[[p, i]];
                            for (o, &xv) in fo.iter_mut().zip(&seg[i..i + w]) {
                                *o += xv * wv;
                            }
                        }
                    }
                }
                let mut acc = vec![0f32; w];
                for j in 0..k {
                    acc.fill(0.0);
                    for &c in &setup.support[j] {
                        let si = slot[c as usize];
                        for p in 0..npc {
                            let uv = setup.u[[j, p, c as usize]];
                            let fo = &f[(si * npc + p) * w..(si * npc + p + 1) * w];
                            for (a, &fv) in acc.iter_mut().zip(fo) {
                                *a += uv * fv;
                            }
                        }
                    }
                    for (t, &a) in acc.iter().enumerate() {
                        out[t * k + j] = a;
                    }
                }
            });
        b
    }

    /// Per-sample best template and its Cf over `lo..hi` (zero in the first and
    /// last nt columns, as Kilosort4 zeroes Cf there).
    fn best_templates(
        setup: &MatchingSetup,
        b: &[f32],
        n: usize,
        lo: usize,
        hi: usize,
        cfmax: &mut [f32],
        imax: &mut [u32],
    ) {
        let k = setup.nm.len();
        let nt = setup.settings.nt;
        let nm = &setup.nm;
        cfmax[lo..hi]
            .par_iter_mut()
            .zip(imax[lo..hi].par_iter_mut())
            .enumerate()
            .for_each(|(i, (cm, im))| {
                let t = lo + i;
                if t < nt || t + nt >= n {
                    *cm = 0.0;
                    *im = 0;
                    return;
                }
                let row = &b[t * k..(t + 1) * k];
                let mut best = (0u32, f32::NEG_INFINITY);
                for (j, (&v, &m)) in row.iter().zip(nm).enumerate() {
                    let r = v.max(0.0);
                    let cf = (r * r) / m;
                    if cf > best.1 {
                        best = (j as u32, cf);
                    }
                }
                *cm = best.1;
                *im = best.0;
            });
    }

    /// Merges sorted, possibly overlapping intervals into disjoint ones.
    fn merge_intervals(mut v: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
        v.sort_unstable();
        let mut out: Vec<(usize, usize)> = Vec::with_capacity(v.len());
        for (lo, hi) in v {
            match out.last_mut() {
                Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        out
    }

    /// Samples t of `ranges` (clipped to nt … NT − nt) whose best Cf exceeds
    /// `th2` and is the largest within ±nt (Kilosort4's max-pool test), ascending.
    fn peaks(cfmax: &[f32], nt: usize, th2: f32, ranges: &[(usize, usize)]) -> Vec<usize> {
        let n = cfmax.len();
        let mut out = Vec::new();
        for &(lo, hi) in ranges {
            for t in lo.max(nt)..hi.min(n.saturating_sub(nt)) {
                let v = cfmax[t];
                if v > th2 {
                    let a = t.saturating_sub(nt);
                    let z = (t + nt + 1).min(n);
                    if cfmax[a..z].iter().all(|&w| w <= v) {
                        out.push(t);
                    }
                }
            }
        }
        out
    }

    /// Kilosort4's `run_matching` on one window plus `extract`'s features.
    ///
    /// `x`: C × NT preprocessed window (NT = batch_size + 2·nt in a full pass;
    /// any NT > 2·nt works).
    ///
    /// # Errors
    /// [`MatchError::Shape`] when `x` does not have C rows or has at most 2·nt columns.
    pub(super) fn match_window(
        setup: &MatchingSetup,
        x: ArrayView2<f32>,
    ) -> Result<WindowSpikes, MatchError> {
        let (k, _, n_c) = setup.u.dim();
        let nt = setup.settings.nt;
        let n = x.ncols();
        if x.nrows() != n_c || n <= 2 * nt {
            return Err(shape_err(
                "window",
                format!(
                    "is {} × {n}; expected {n_c} sites and more than {} samples",
                    x.nrows(),
                    2 * nt
                ),
            ));
        }
        let mut b = filter_product(setup, x);
        let mut xres = x.as_standard_layout().into_owned();
        let th2 = (setup.settings.th_learned * setup.settings.th_learned) as f32;
        let mut cfmax = vec![0f32; n];
        let mut imax = vec![0u32; n];
        best_templates(setup, &b, n, 0, n, &mut cfmax, &mut imax);
        let mut ranges = vec![(0, n)];
        let mut out = WindowSpikes::default();
        for peel in 0..setup.settings.max_peels {
            out.peels = peel + 1;
            let spikes = peaks(&cfmax, nt, th2, &ranges);
            if spikes.is_empty() {
                break;
            }
            let found: Vec<(usize, usize, f32)> = spikes
                .iter()
                .map(|&t| {
                    let j = imax[t] as usize;
                    (t, j, b[t * k + j] / setup.nm[j])
                })
                .collect();
            for &(t, j, amp) in &found {
                out.col.push(t as u32);
                out.template.push(j as u32);
                out.amp.push(amp);
                out.th_amp.push(cfmax[t].sqrt());
            }
            for parity in 0..2 {
                let half_spikes: Vec<(usize, usize, f32)> =
                    found.iter().copied().skip(parity).step_by(2).collect();
                subtract(setup, &half_spikes, &mut b, &mut xres, n);
            }
            let dirty = merge_intervals(
                found
                    .iter()
                    .map(|&(t, _, _)| (t - nt, (t + nt + 1).min(n)))
                    .collect(),
            );
            for &(lo, hi) in &dirty {
                best_templates(setup, &b, n, lo, hi, &mut cfmax, &mut imax);
            }
            ranges = merge_intervals(
                dirty
                    .iter()
                    .map(|&(lo, hi)| (lo.saturating_sub(nt), (hi + nt).min(n)))
                    .collect(),
            );
            if peel + 1 == setup.settings.max_peels {
                tracing::debug!(
                    "matching stopped at max_peels = {} with {} spikes in the last peel",
                    setup.settings.max_peels,
                    found.len()
                );
            }
        }
        out.tf = features(setup, xres.view(), &out);
        Ok(out)
    }

    /// Subtracts one half-peel's spikes (ascending samples) from B and the residual.
    ///
    /// Kilosort4 writes each half with one indexed assignment (`X[:, idx] -= v`):
    /// every column of a spike's range becomes (value before the half) − (its
    /// term), for all rows. Ranges within a half overlap only when two samples
    /// within nt tie exactly; then the later spike's write wins for the shared
    /// columns, which is what is done here (Kilosort4's order there is unspecified).
    fn subtract(
        setup: &MatchingSetup,
        spikes: &[(usize, usize, f32)],
        b: &mut [f32],
        xres: &mut Array2<f32>,
        n: usize,
    ) {
        if spikes.is_empty() {
            return;
        }
        let k = setup.nm.len();
        let nt = setup.settings.nt;
        let half = nt / 2;
        let nl = 2 * nt + 1;
        let ctcs: Vec<std::borrow::Cow<'_, [f32]>> = spikes
            .par_iter()
            .map(|&(_, j, _)| setup.ctc_of(j))
            .collect();
        let overlap_b = spikes.windows(2).any(|w| w[1].0 - w[0].0 <= 2 * nt);
        let overlap_x = spikes.windows(2).any(|w| w[1].0 - w[0].0 <= 2 * half);
        let b_before = overlap_b.then(|| b.to_vec());
        let x_before = overlap_x.then(|| xres.clone());
        for (&(t, j, amp), ctc) in spikes.iter().zip(&ctcs) {
            let lo = t - nt;
            if let Some(orig) = &b_before {
                let hi = (t + nt + 1).min(n);
                b[lo * k..hi * k].copy_from_slice(&orig[lo * k..hi * k]);
            }
            let p = &setup.partners[j];
            for d in 0..nl {
                let row = &mut b[(lo + d) * k..(lo + d + 1) * k];
                for (pi, &kk) in p.k.iter().enumerate() {
                    row[kk as usize] -= amp * ctc[pi * nl + d];
                }
            }
            let xlo = t - half;
            if let Some(orig) = &x_before {
                xres.slice_mut(ndarray::s![.., xlo..xlo + nt])
                    .assign(&orig.slice(ndarray::s![.., xlo..xlo + nt]));
            }
            for (si, &c) in setup.support[j].iter().enumerate() {
                let w = &setup.wave[j][si * nt..(si + 1) * nt];
                let mut row = xres.row_mut(c as usize);
                for (i, &wv) in w.iter().enumerate() {
                    row[xlo + i] -= amp * wv;
                }
            }
        }
    }
}

/// xorshift numbers in [-0.5, 0.5).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next() + 0.5) * n as f32) as usize % n
    }
}

/// K templates on `width` neighbouring sites each (template 0 on every
/// site), site positions in two columns 15 µm apart.
fn random_setup(rng: &mut Rng, n_c: usize, k: usize, width: usize, budget: usize) -> MatchingSetup {
    random_setup_with_copies(rng, n_c, k, width, budget, &[])
}

/// [`random_setup`] with template `to` an exact copy of template `from` for
/// each `(from, to)` of `copies`: equal B and Cf at every sample.
fn random_setup_with_copies(
    rng: &mut Rng,
    n_c: usize,
    k: usize,
    width: usize,
    budget: usize,
    copies: &[(usize, usize)],
) -> MatchingSetup {
    let wpca = crate::UniversalTemplates::builtin().wpca;
    let npc = wpca.nrows();
    let mut u = Array3::<f32>::zeros((k, npc, n_c));
    for j in 0..k {
        let (lo, hi) = if j == 0 {
            (0, n_c)
        } else {
            let c0 = rng.below(n_c - width + 1);
            (c0, c0 + width)
        };
        for c in lo..hi {
            let g = 4.0 + 8.0 * (rng.next() + 0.5);
            for p in 0..npc {
                u[[j, p, c]] = g * if p == 0 { 1.0 } else { 0.5 * rng.next() };
            }
        }
    }
    for &(from, to) in copies {
        let t = u.slice(ndarray::s![from, .., ..]).to_owned();
        u.slice_mut(ndarray::s![to, .., ..]).assign(&t);
    }
    let xc: Vec<f32> = (0..n_c).map(|i| 32.0 * (i % 2) as f32).collect();
    let yc: Vec<f32> = (0..n_c).map(|i| 15.0 * (i / 2) as f32).collect();
    let settings = MatchingSettings {
        nearest_chans: 4.min(n_c),
        ctc_budget_bytes: budget,
        ..MatchingSettings::default()
    };
    MatchingSetup::new(u.view(), wpca.view(), &xc, &yc, &settings).unwrap()
}

/// Noise plus `n_spikes` template waveforms at random samples (every other
/// one within 40 samples of the previous), and, when `tied`, a stretch where
/// every site repeats one 20-sample pattern, so that B has exactly equal
/// maxima 20 samples apart there.
fn random_window(
    rng: &mut Rng,
    setup: &MatchingSetup,
    n: usize,
    n_spikes: usize,
    tied: bool,
) -> Array2<f32> {
    let (k, _, n_c) = setup.u.dim();
    let nt = setup.settings.nt;
    let mut x = Array2::<f32>::zeros((n_c, n));
    x.mapv_inplace(|_| 2.0 * rng.next());
    let mut t = 0;
    for s in 0..n_spikes {
        t = if s % 2 == 1 && t + 40 < n {
            t + 1 + rng.below(40)
        } else {
            rng.below(n)
        };
        let j = rng.below(k);
        let amp = 1.0 + 2.0 * (rng.next() + 0.5);
        for (si, &c) in setup.support[j].iter().enumerate() {
            for i in 0..nt {
                let col = (t + i) as i64 - (nt / 2) as i64;
                if col >= 0 && (col as usize) < n {
                    x[[c as usize, col as usize]] += amp * setup.wave[j][si * nt + i];
                }
            }
        }
    }
    if tied {
        const PERIOD: usize = 20;
        let pattern: Vec<f32> = (0..PERIOD)
            .map(|i| {
                30.0 * (std::f32::consts::TAU * i as f32 / PERIOD as f32).sin() + 5.0 * rng.next()
            })
            .collect();
        let r0 = n / 3;
        for c in 0..n_c {
            for t in r0..(r0 + 600).min(n) {
                x[[c, t]] = pattern[(t - r0) % PERIOD];
            }
        }
    }
    x
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_same(a: &WindowSpikes, b: &WindowSpikes, what: &str) {
    assert_eq!(a.peels, b.peels, "{what}: peels");
    assert_eq!(a.col, b.col, "{what}: samples");
    assert_eq!(a.template, b.template, "{what}: templates");
    assert_eq!(bits(&a.amp), bits(&b.amp), "{what}: amp");
    assert_eq!(bits(&a.th_amp), bits(&b.th_amp), "{what}: th_amp");
    assert_eq!(bits(&a.tf), bits(&b.tf), "{what}: tF");
}

/// The instruction sets this CPU can run.
fn simd_levels() -> Vec<Simd> {
    let mut v = vec![Simd::Base];
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            v.push(Simd::Avx2);
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            v.push(Simd::Avx512);
        }
    }
    v
}

/// The optimised pass against the reference on one window, on 1, 2 and 3
/// threads and every instruction set the CPU has, twice (the second time
/// on the first's buffers); returns the spikes.
fn check(setup: &MatchingSetup, x: &Array2<f32>, what: &str) -> WindowSpikes {
    let want = reference::match_window(setup, x.view()).unwrap();
    for simd in simd_levels() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for pass in 0..2 {
                let got = pool.install(|| match_window_with(setup, x.view(), simd).unwrap());
                assert_same(
                    &got,
                    &want,
                    &format!("{what}, {simd:?}, {threads} threads, pass {pass}"),
                );
            }
        }
    }
    // In place (the window becomes the residual), in either memory order.
    let mut own = x.clone();
    let got = match_window_in_place(setup, &mut own).unwrap();
    assert_same(&got, &want, &format!("{what}, in place"));
    let mut fortran = Array2::zeros(x.raw_dim().f());
    fortran.assign(x);
    let got = match_window_in_place(setup, &mut fortran).unwrap();
    assert_same(&got, &want, &format!("{what}, in place, column-major"));
    want
}

#[test]
fn optimised_matching_equals_the_reference_bit_for_bit() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    // K not a multiple of the scan's lanes, and K below them.
    for (n_c, k, width) in [(24, 37, 6), (16, 5, 4), (40, 70, 10)] {
        let setup = random_setup(&mut rng, n_c, k, width, 512 << 20);
        for (n, n_spikes) in [(3000, 60), (1500, 200), (2 * 61 + 7, 3)] {
            let x = random_window(&mut rng, &setup, n, n_spikes, false);
            let sp = check(&setup, &x, &format!("C {n_c}, K {k}, NT {n}"));
            if n >= 1500 {
                assert!(sp.len() > 10, "too few spikes ({}) to test", sp.len());
                assert!(sp.peels > 1);
            }
        }
    }
}

#[test]
fn optimised_matching_equals_the_reference_on_exact_ties() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let setup = random_setup(&mut rng, 20, 30, 6, 512 << 20);
    let x = random_window(&mut rng, &setup, 4000, 40, true);
    let sp = check(&setup, &x, "tied");
    // Spikes of one peel closer than nt: the ranges of one half overlap.
    let close = sp.col.windows(2).any(|w| w[1] > w[0] && w[1] - w[0] < 61);
    assert!(close, "no tied spikes within nt");
}

#[test]
fn optimised_matching_equals_the_reference_with_per_spike_cross_correlations() {
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    let setup = random_setup(&mut rng, 24, 40, 6, 0);
    assert!(!setup.ctc_precomputed());
    let x = random_window(&mut rng, &setup, 3000, 80, true);
    check(&setup, &x, "per-spike ctc");
}

/// Templates with exactly equal Cf at every sample, in one group of the
/// best-template scan and in groups after it: the lowest template wins
/// everywhere, as in one scan in template order, also where the peels
/// rescan only some groups.
#[test]
fn optimised_matching_equals_the_reference_on_tied_templates() {
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    // K = 40: groups of 16, 16 and 8 templates.
    let copies = [(3, 9), (3, 21), (3, 38), (17, 33), (20, 5)];
    let setup = random_setup_with_copies(&mut rng, 24, 40, 6, 512 << 20, &copies);
    let x = random_window(&mut rng, &setup, 3000, 120, false);
    let sp = check(&setup, &x, "tied templates");
    assert!(sp.peels > 1);
    for (from, to) in copies {
        let low = from.min(to) as u32;
        let high = from.max(to) as u32;
        assert!(
            !sp.template.contains(&high),
            "template {high} (a copy of {low}) was chosen"
        );
    }
    assert!(
        copies
            .iter()
            .any(|&(from, to)| sp.template.contains(&(from.min(to) as u32))),
        "no spike of a copied template to test"
    );
}
