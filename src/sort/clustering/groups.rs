//! Spatial groups of the clustering (Kilosort4 4.1.7 `clustering_qr.py`:
//! `x_centers`, `y_centers`, `get_nearest_centers`, `get_data_cpu`).
//!
//! The probe is cut into group centres: x-centres from the site x positions,
//! y-centres every 2·dmin. Each template (or universal-template centre) goes to
//! its nearest group centre, and a group holds the spikes of its templates,
//! their features scattered onto the union of the templates' channels.

use ndarray::{ArrayView2, ArrayView3};

use super::ClusteringError;
use super::settings::XCenters;

/// Width (µm) of the site-x histogram bins of the automatic x-centres.
const X_BIN_WIDTH: f32 = 50.0;
/// Distortion change (µm) below which scipy's k-means stops.
const KMEANS_THRESH: f64 = 1e-5;

/// x-centres (µm, float32 as scipy returns them) of the spatial groups.
///
/// With `setting` `None`, Kilosort4's automatic method: a histogram of the site
/// x positions `xc` in bins of about 50 µm, padded by two bins on each side,
/// smoothed by a Gaussian of σ = 0.5 bin (in integer counts, as scipy keeps
/// the histogram's integer type), its local maxima as initial guesses, then
/// scipy's k-means of `xc` from those guesses (one centre, i.e. the mean, when
/// there is at most one peak). Computed in float32 as Kilosort4 computes it.
///
/// # Errors
/// [`ClusteringError::Input`] when `xc` is empty or not finite.
pub fn x_centers(xc: &[f32], setting: Option<&XCenters>) -> Result<Vec<f32>, ClusteringError> {
    if xc.is_empty() || xc.iter().any(|v| !v.is_finite()) {
        return Err(ClusteringError::Input(format!(
            "site x positions (xc): {} values, all must be finite and there must be at least one",
            xc.len()
        )));
    }
    let guesses: Vec<f32> = match setting {
        Some(XCenters::Guesses(g)) => g.iter().map(|&v| v as f32).collect(),
        Some(XCenters::Count(k)) => quantile_guesses(xc, *k),
        None => {
            let peaks = histogram_peaks(xc);
            if peaks.len() <= 1 {
                return Ok(vec![mean_f32(xc)]);
            }
            peaks
        }
    };
    if guesses.len() == 1 && matches!(setting, Some(XCenters::Count(_))) {
        return Ok(vec![mean_f32(xc)]);
    }
    Ok(lloyd_1d(xc, guesses))
}

/// The mean of `x`, summed in order in float32 (scipy's cluster update).
fn mean_f32(x: &[f32]) -> f32 {
    let mut s = 0f32;
    for &v in x {
        s += v;
    }
    s / x.len() as f32
}

/// `k` evenly spaced quantiles of the sorted positions: spikecube's
/// deterministic start for `x_centers = k`.
fn quantile_guesses(xc: &[f32], k: usize) -> Vec<f32> {
    let mut s = xc.to_vec();
    s.sort_by(f32::total_cmp);
    if k == 1 {
        return vec![s[s.len() / 2]];
    }
    (0..k).map(|i| s[i * (s.len() - 1) / (k - 1)]).collect()
}

/// Initial x guesses of the automatic method: the left edges of the local
/// maxima of the smoothed histogram of site x.
fn histogram_peaks(xc: &[f32]) -> Vec<f32> {
    let min_x = xc.iter().copied().fold(f32::INFINITY, f32::min);
    let max_x = xc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let num_edges = ((max_x - min_x) / X_BIN_WIDTH) as usize + 4;
    let edges = linspace_f32(
        min_x - 2.0 * X_BIN_WIDTH,
        max_x + 2.0 * X_BIN_WIDTH,
        num_edges,
    );
    let nb = num_edges - 1;
    let mut hist = vec![0i64; nb];
    for &x in xc {
        // numpy's rule: edges[i] <= x < edges[i+1], the last bin closed.
        if x < edges[0] || x > edges[nb] {
            continue;
        }
        let i = edges.partition_point(|&e| e <= x);
        hist[(i.max(1) - 1).min(nb - 1)] += 1;
    }
    let smooth = smooth_counts(&hist);
    local_maxima(&smooth)
        .into_iter()
        .map(|p| edges[p])
        .collect()
}

/// numpy's `linspace` in float32: `start + i·((stop − start)/(num − 1))`, the
/// last point exactly `stop`.
fn linspace_f32(start: f32, stop: f32, num: usize) -> Vec<f32> {
    if num == 1 {
        return vec![start];
    }
    let step = (stop - start) / (num - 1) as f32;
    let mut y: Vec<f32> = (0..num).map(|i| i as f32 * step + start).collect();
    y[num - 1] = stop;
    y
}

/// scipy's `gaussian_filter(hist, 0.5)` on integer counts: a 5-tap Gaussian
/// (radius 2), mirrored ("reflect") at the ends, summed in float64 and
/// truncated back to integers.
fn smooth_counts(h: &[i64]) -> Vec<i64> {
    let raw: Vec<f64> = (-2i32..=2)
        .map(|x| (-0.5 / 0.25 * f64::from(x * x)).exp())
        .collect();
    let total: f64 = raw.iter().sum();
    let w: Vec<f64> = raw.iter().map(|v| v / total).collect();
    let n = h.len() as isize;
    let at = |i: isize| -> f64 {
        let mut j = i;
        // Reflect about the edges (d c b a | a b c d | d c b a).
        while j < 0 || j >= n {
            j = if j < 0 { -j - 1 } else { 2 * n - j - 1 };
        }
        h[j as usize] as f64
    };
    (0..n)
        .map(|i| {
            let mut t = at(i) * w[2];
            for d in [2isize, 1] {
                t += (at(i - d) + at(i + d)) * w[(2 - d) as usize];
            }
            t as i64
        })
        .collect()
}

/// scipy's `find_peaks` without conditions: indices of local maxima, the
/// middle (rounded down) of a flat top.
fn local_maxima(x: &[i64]) -> Vec<usize> {
    let mut peaks = Vec::new();
    if x.len() < 3 {
        return peaks;
    }
    let last = x.len() - 1;
    let mut i = 1;
    while i < last {
        if x[i - 1] < x[i] {
            let mut ahead = i + 1;
            while ahead < last && x[ahead] == x[i] {
                ahead += 1;
            }
            if x[ahead] < x[i] {
                peaks.push((i + ahead - 1) / 2);
                i = ahead;
            }
        }
        i += 1;
    }
    peaks
}

/// scipy's `_kmeans` on one-dimensional data: Lloyd steps (nearest code, first
/// on ties; codes without members dropped; means summed in order in float32)
/// until the mean distance changes by at most 1e-5.
fn lloyd_1d(x: &[f32], mut code: Vec<f32>) -> Vec<f32> {
    let mut prev = f64::INFINITY;
    loop {
        let mut sums = vec![0f32; code.len()];
        let mut counts = vec![0usize; code.len()];
        let mut dist = 0f64;
        for &v in x {
            let mut best = 0;
            let mut bd = f32::INFINITY;
            for (c, &m) in code.iter().enumerate() {
                let d = (v - m).abs();
                if d < bd {
                    bd = d;
                    best = c;
                }
            }
            dist += f64::from(bd);
            sums[best] += v;
            counts[best] += 1;
        }
        let avg = dist / x.len() as f64;
        code = sums
            .iter()
            .zip(&counts)
            .filter(|(_, n)| **n > 0)
            .map(|(s, &n)| s / n as f32)
            .collect();
        let diff = (prev - avg).abs();
        prev = avg;
        if diff <= KMEANS_THRESH {
            return code;
        }
    }
}

/// y-centres (µm) of the spatial groups: numpy's
/// `arange(min(ycup) + dmin − 1, max(ycup) + dmin + 1, 2·dmin)` (values
/// `start + i·((start + step) − start)`, as numpy fills a float range).
///
/// # Errors
/// [`ClusteringError::Input`] when `ycup` is empty or `dmin` is not positive.
pub fn y_centers(ycup: &[f64], dmin: f64) -> Result<Vec<f64>, ClusteringError> {
    if ycup.is_empty() || dmin.is_nan() || dmin <= 0.0 || ycup.iter().any(|v| !v.is_finite()) {
        return Err(ClusteringError::Input(format!(
            "y-centres need template-centre depths (ycup: {} values, finite) and dmin > 0 (got {dmin})",
            ycup.len()
        )));
    }
    let lo = ycup.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ycup.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (start, stop, step) = (lo + dmin - 1.0, hi + dmin + 1.0, 2.0 * dmin);
    let n = ((stop - start) / step).ceil().max(0.0) as usize;
    let delta = (start + step) - start;
    Ok((0..n).map(|i| start + i as f64 * delta).collect())
}

/// Where the grouped items are (µm): the universal-template centres in the
/// first clustering (float64), the learned templates' best sites in the final
/// one (float32 in Kilosort4, which then computes the x distance in float32).
#[derive(Debug, Clone, Copy)]
pub struct Positions<'a> {
    /// x of each item.
    pub x: &'a [f64],
    /// y of each item.
    pub y: &'a [f64],
    /// Compute (x − x-centre)² in float32, as Kilosort4 does for templates.
    pub x_in_f32: bool,
}

/// For each item, the flat index `jj·n_y + kk` of its nearest group centre
/// (x-centre `jj`, y-centre `kk`) by squared distance; ties go to the lower
/// index (Kilosort4 adds 1e-20·rand, a no-op at these magnitudes).
pub fn nearest_centers(pos: Positions<'_>, xcent: &[f32], ycent: &[f64]) -> Vec<usize> {
    (0..pos.x.len())
        .map(|t| {
            let mut best = 0;
            let mut bd = f64::INFINITY;
            for (jj, &xc) in xcent.iter().enumerate() {
                let dx2 = if pos.x_in_f32 {
                    let d = pos.x[t] as f32 - xc;
                    f64::from(d * d)
                } else {
                    let d = pos.x[t] - f64::from(xc);
                    d * d
                };
                for (kk, &yc) in ycent.iter().enumerate() {
                    let dy = pos.y[t] - yc;
                    let d = dx2 + dy * dy;
                    if d < bd {
                        bd = d;
                        best = jj * ycent.len() + kk;
                    }
                }
            }
            best
        })
        .collect()
}

/// One spatial group's spikes and features (Kilosort4's `get_data_cpu`).
#[derive(Debug, Clone)]
pub struct GroupData {
    /// Flat index of the group centre (`jj·n_y + kk`).
    pub centre: usize,
    /// Spikes of the group (indices into the clustering's input), ascending.
    pub spikes: Vec<usize>,
    /// The union of the group's templates' channels, ascending.
    pub chans: Vec<usize>,
    /// Features per spike (`spikes.len()` × `dim`), row-major, float32: the
    /// spike's nC × n_pcs features put at its template's channels' positions in
    /// `chans`, zeros elsewhere, flattened channel-major.
    pub xd: Vec<f32>,
    /// Feature length: `chans.len()` · n_pcs.
    pub dim: usize,
}

/// The spikes of the templates whose nearest centre is `centre`, and their
/// feature matrix on the union of those templates' channels.
///
/// `spike_template` (n,) is each spike's template; `nearest` (K,) each
/// template's centre; `tf` (n, nC, n_pcs) the features; `chans` (nC, K) each
/// template's channels. Returns `None` when no spike belongs to the group.
pub fn group_data(
    centre: usize,
    nearest: &[usize],
    spike_template: &[u32],
    tf: ArrayView3<'_, f32>,
    chans: ArrayView2<'_, usize>,
) -> Option<GroupData> {
    let spikes: Vec<usize> = (0..spike_template.len())
        .filter(|&s| nearest[spike_template[s] as usize] == centre)
        .collect();
    group_data_of(centre, spikes, nearest, spike_template, tf, chans)
}

/// The spikes of each centre of `centres` (ascending centre indices), in one
/// pass over the spikes: `out[g]` holds, ascending, the spikes whose
/// template's nearest centre (`nearest`, (K,)) is `centres[g]`. A spike whose
/// template's centre is not listed is in no group.
pub fn group_members(
    centres: &[usize],
    nearest: &[usize],
    spike_template: &[u32],
) -> Vec<Vec<usize>> {
    let slot_of = |c: usize| centres.binary_search(&c).ok();
    let template_slot: Vec<Option<usize>> = nearest.iter().map(|&c| slot_of(c)).collect();
    let mut counts = vec![0usize; centres.len()];
    for &t in spike_template {
        if let Some(g) = template_slot[t as usize] {
            counts[g] += 1;
        }
    }
    let mut out: Vec<Vec<usize>> = counts.iter().map(|&c| Vec::with_capacity(c)).collect();
    for (s, &t) in spike_template.iter().enumerate() {
        if let Some(g) = template_slot[t as usize] {
            out[g].push(s);
        }
    }
    out
}

/// The feature matrix of the group around `centre` whose spikes are `spikes`
/// (ascending, each with its template's nearest centre `centre`): as
/// [`group_data`], with the spikes already found (e.g. by
/// [`group_members`]). Returns `None` when `spikes` is empty.
pub fn group_data_of(
    centre: usize,
    spikes: Vec<usize>,
    nearest: &[usize],
    spike_template: &[u32],
    tf: ArrayView3<'_, f32>,
    chans: ArrayView2<'_, usize>,
) -> Option<GroupData> {
    if spikes.is_empty() {
        return None;
    }
    let in_group: Vec<bool> = nearest.iter().map(|&c| c == centre).collect();
    let mut union: Vec<usize> = (0..nearest.len())
        .filter(|&t| in_group[t])
        .flat_map(|t| chans.column(t).to_vec())
        .collect();
    union.sort_unstable();
    union.dedup();
    let mut pos_of = vec![usize::MAX; union.last().map_or(0, |c| c + 1)];
    for (p, &c) in union.iter().enumerate() {
        pos_of[c] = p;
    }
    let (nc, npc) = (tf.shape()[1], tf.shape()[2]);
    let dim = union.len() * npc;
    let mut xd = vec![0f32; spikes.len() * dim];
    for (row, &s) in xd.chunks_exact_mut(dim).zip(&spikes) {
        let t = spike_template[s] as usize;
        for c in 0..nc {
            let p = pos_of[chans[[c, t]]];
            for f in 0..npc {
                row[p * npc + f] = tf[[s, c, f]];
            }
        }
    }
    Some(GroupData {
        centre,
        spikes,
        chans: union,
        xd,
        dim,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tile(v: &[f32], n: usize) -> Vec<f32> {
        v.iter().copied().cycle().take(v.len() * n).collect()
    }

    /// Values computed with Kilosort4 4.1.7's `x_centers` (scipy 1.17.1).
    #[test]
    fn x_centers_match_kilosort4() {
        let cases: Vec<(Vec<f32>, Vec<f32>)> = vec![
            (tile(&[43.0, 11.0, 59.0, 27.0], 96), vec![35.0]),
            (tile(&[0.0, 32.0], 192), vec![16.0]),
            (
                (0..4)
                    .flat_map(|s| {
                        tile(&[0.0, 32.0], 48)
                            .into_iter()
                            .map(move |x| x + 250.0 * s as f32)
                    })
                    .collect(),
                vec![16.0, 266.0, 516.0, 766.0],
            ),
            (vec![0.0; 32], vec![0.0]),
            (
                (0..8)
                    .flat_map(|i| std::iter::repeat_n(40.0 * i as f32, 8))
                    .collect(),
                vec![60.0, 220.0],
            ),
            (
                vec![0.0, 5.0, 100.0, 103.0, 200.0, 400.0, 401.0, 402.0],
                vec![2.5, 134.33333, 401.0],
            ),
        ];
        for (xc, want) in cases {
            assert_eq!(
                x_centers(&xc, None).unwrap(),
                want,
                "xc {:?}",
                &xc[..8.min(xc.len())]
            );
        }
    }

    #[test]
    fn smoothing_truncates_like_scipy() {
        // scipy.ndimage.gaussian_filter(int64 array, 0.5).
        let h = [0, 3, 0, 0, 5, 1, 0, 7, 7, 0];
        assert_eq!(smooth_counts(&h), vec![0, 2, 0, 0, 4, 1, 0, 6, 6, 0]);
    }

    #[test]
    fn y_centers_match_numpy_arange() {
        let ycup: Vec<f64> = (0..54).map(|i| 3.25 + 7.5 * i as f64).collect();
        let y = y_centers(&ycup, 15.0).unwrap();
        let want: Vec<f64> = (0..14).map(|i| 17.25 + 30.0 * i as f64).collect();
        assert_eq!(y, want);
    }

    #[test]
    fn nearest_centre_ties_go_to_the_first() {
        let pos = Positions {
            x: &[0.0, 0.0],
            y: &[10.0, 11.0],
            x_in_f32: false,
        };
        assert_eq!(nearest_centers(pos, &[0.0], &[0.0, 20.0]), vec![0, 1]);
    }

    #[test]
    fn members_in_one_pass_equal_each_group_filtered() {
        // 12 templates on 7 centres (two with none), 500 spikes; the listed
        // centres leave one used centre out, whose spikes are in no group.
        let nearest = [3usize, 0, 5, 3, 6, 0, 2, 5, 5, 3, 6, 2];
        let mut x = 17u64;
        let spike_template: Vec<u32> = (0..500)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((x >> 33) % 12) as u32
            })
            .collect();
        let centres = [0usize, 1, 2, 3, 5];
        let members = group_members(&centres, &nearest, &spike_template);
        assert_eq!(members.len(), centres.len());
        for (g, &c) in centres.iter().enumerate() {
            let want: Vec<usize> = (0..spike_template.len())
                .filter(|&s| nearest[spike_template[s] as usize] == c)
                .collect();
            assert_eq!(members[g], want, "centre {c}");
        }
        assert!(members[1].is_empty() && !members[0].is_empty());
    }
}
