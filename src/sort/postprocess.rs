//! What Kilosort4 4.1.7 computes between the merges and the Phy files
//! (`postprocessing.py`: `remove_duplicates`, `compute_spike_positions`,
//! `make_pc_features`; `io.py:save_to_phy`; `../shared/docs/sorting-spec.md` §2.8, §3).
//!
//! Layouts (row-major): `tf` (n, nC, npc) float32 features; `wall` (U, C, npc);
//! `wpca` (npc, nt); `icc`, `icc_mask` (nC, C): each site's nC nearest sites
//! and whether each lies within `position_limit`; `iu` (K,): each learned
//! template's largest-norm site. Spike templates index `iu`.
//!
//! Float results are computed in float64 and rounded once to float32, except
//! `templates` (Kilosort4's float32 sum over the PCs, reproduced term by term).

use anyhow::{Result, bail};
use ndarray::{Array2, Array3, ArrayView2, ArrayView3, Axis};
use rayon::prelude::*;

/// Kilosort4's `duplicate_spike_bins`: `int(duplicate_spike_ms · (fs / 1000))`
/// samples (7 at 30 kHz with the default 0.25 ms).
pub fn duplicate_spike_bins(duplicate_spike_ms: f64, fs: f64) -> i64 {
    (duplicate_spike_ms * (fs / 1000.0)).trunc() as i64
}

/// Kilosort4's `remove_duplicates`: going through spikes in the given (time)
/// order, a spike is dropped when it lies less than `dt` samples after the
/// last **kept** spike of its own cluster. Returns the keep mask (n,).
pub fn remove_duplicates(spike_times: &[i64], spike_clusters: &[i32], dt: i64) -> Vec<bool> {
    let mut last: std::collections::HashMap<i32, i64> = std::collections::HashMap::new();
    spike_times
        .iter()
        .zip(spike_clusters)
        .map(|(&t, &c)| {
            let t0 = last.get(&c).copied().unwrap_or(t - dt);
            if t >= t0 + dt {
                last.insert(c, t);
                true
            } else {
                false
            }
        })
        .collect()
}

/// The channel sets the learned-template matching fixed (Kilosort4's
/// `ops['iCC']`, `ops['iCC_mask']`, `ops['iU']`).
#[derive(Debug, Clone)]
pub struct ChannelSets {
    /// (nC, C): site c's nC nearest sites, nearest first.
    pub icc: Array2<usize>,
    /// (nC, C): whether each of those lies within `position_limit` (100 µm).
    pub icc_mask: Array2<bool>,
    /// (K,): each learned template's site of largest norm.
    pub iu: Vec<usize>,
}

impl ChannelSets {
    /// Checks the sets against C sites and the spikes' templates.
    ///
    /// # Errors
    /// When shapes disagree or an index is out of range (named in the message).
    pub fn check(&self, n_sites: usize, spike_templates: &[usize]) -> Result<()> {
        if self.icc.ncols() != n_sites || self.icc_mask.dim() != self.icc.dim() {
            bail!(
                "iCC is {:?} and iCC_mask {:?}, expected (nC, {n_sites})",
                self.icc.dim(),
                self.icc_mask.dim()
            );
        }
        if let Some(&s) = self.icc.iter().find(|&&s| s >= n_sites) {
            bail!("iCC names site {s}, but the probe has {n_sites} sites");
        }
        if let Some(&s) = self.iu.iter().find(|&&s| s >= n_sites) {
            bail!("iU names site {s}, but the probe has {n_sites} sites");
        }
        if let Some(&t) = spike_templates.iter().find(|&&t| t >= self.iu.len()) {
            bail!(
                "a spike's template is {t}, but iU has {} templates",
                self.iu.len()
            );
        }
        Ok(())
    }

    /// Sites nC of template `t`: iCC[:, iU[t]].
    fn sites(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
        self.icc.column(self.iu[t]).into_iter().copied()
    }
}

/// Kilosort4's `compute_spike_positions`: each spike's (x, y), µm, the mean of
/// its template's nC sites' positions weighted by the L2 norm of its features
/// on each site, sites outside `position_limit` weighted 0. (n, 2) float32.
/// Spikes in parallel, each in a fixed order.
pub fn spike_positions(
    spike_templates: &[usize],
    tf: ArrayView3<f32>,
    sets: &ChannelSets,
    xc: &[f32],
    yc: &[f32],
) -> Array2<f32> {
    let nc = tf.shape()[1];
    let xy: Vec<[f32; 2]> = spike_templates
        .par_iter()
        .enumerate()
        .map_init(
            || vec![0.0f64; nc],
            |mass, (i, &t)| {
                let site = sets.iu[t];
                for (c, m) in mass.iter_mut().enumerate() {
                    let norm = tf
                        .slice(ndarray::s![i, c, ..])
                        .iter()
                        .map(|&v| f64::from(v).powi(2))
                        .sum::<f64>()
                        .sqrt();
                    *m = if sets.icc_mask[[c, site]] { norm } else { 0.0 };
                }
                let total: f64 = mass.iter().sum();
                let (mut x, mut y) = (0.0f64, 0.0f64);
                for (c, s) in sets.sites(t).enumerate() {
                    let w = mass[c] / total;
                    x += f64::from(xc[s]) * w;
                    y += f64::from(yc[s]) * w;
                }
                [x as f32, y as f32]
            },
        )
        .collect();
    Array2::from_shape_vec((xy.len(), 2), xy.into_iter().flatten().collect())
        .expect("two values per spike")
}

/// Phy's `amplitudes.npy` in Kilosort4: the L2 norm of each spike's (nC, npc)
/// features (spikes in parallel, each summed in order).
pub fn amplitudes(tf: ArrayView3<f32>) -> Vec<f32> {
    (0..tf.shape()[0])
        .into_par_iter()
        .map(|i| {
            tf.index_axis(Axis(0), i)
                .iter()
                .map(|&v| f64::from(v).powi(2))
                .sum::<f64>()
                .sqrt() as f32
        })
        .collect()
}

/// Each template's L2 norm over (C, npc) (`cluster_Amplitude.tsv`).
pub fn template_amplitudes(wall: ArrayView3<f32>) -> Vec<f32> {
    wall.outer_iter()
        .map(|w| w.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt() as f32)
        .collect()
}

/// The time-domain templates (U, nt, C) = Σ_p Wall[u, c, p]·wPCA[p, t]
/// (Phy's `templates.npy`), float32 summed over p in order, as Kilosort4 does
/// (templates in parallel).
pub fn templates_in_time(wall: ArrayView3<f32>, wpca: ArrayView2<f32>) -> Array3<f32> {
    let (u, c, npc) = wall.dim();
    let nt = wpca.ncols();
    let mut out = Array3::<f32>::zeros((u, nt, c));
    out.as_slice_mut()
        .expect("standard layout")
        .par_chunks_mut((nt * c).max(1))
        .enumerate()
        .for_each(|(k, o)| {
            for ch in 0..c {
                for t in 0..nt {
                    let mut acc = 0.0f32;
                    for p in 0..npc {
                        acc += wall[[k, ch, p]] * wpca[[p, t]];
                    }
                    o[t * c + ch] = acc;
                }
            }
        });
    out
}

/// Kilosort4's `make_pc_features` for one cluster, in place on its spikes'
/// feature rows (see [`make_pc_features`]). `templates` are the cluster's
/// templates (ascending, distinct); `spikes[k]` are the spikes of template
/// `templates[k]` (ascending) and `rows[k]` their (nC·npc) feature rows.
/// Returns the nC sites kept.
fn cluster_pc_features(
    templates: &[usize],
    spikes: &[&[usize]],
    rows: &mut [Vec<&mut [f32]>],
    sets: &ChannelSets,
    nc: usize,
    npc: usize,
) -> Result<Vec<u32>> {
    // Union of the templates' sites, ascending, and each (site row, template) → union index.
    let mut ichan: Vec<usize> = templates.iter().flat_map(|&t| sets.sites(t)).collect();
    ichan.sort_unstable();
    ichan.dedup();
    if ichan.len() < nc {
        bail!(
            "pc features: the cluster's templates cover {} sites, fewer than nC = {nc}",
            ichan.len()
        );
    }
    let nchan = ichan.len();
    let imap: Vec<Vec<usize>> = templates
        .iter()
        .map(|&t| {
            sets.sites(t)
                .map(|s| ichan.binary_search(&s).expect("site in the union"))
                .collect()
        })
        .collect();
    // The spikes in ascending order (Kilosort4's `igood`): each union site's
    // mean is summed over them in that order.
    let mut igood: Vec<(usize, usize, usize)> = spikes
        .iter()
        .enumerate()
        .flat_map(|(k, ss)| ss.iter().enumerate().map(move |(j, &s)| (s, k, j)))
        .collect();
    igood.sort_unstable();
    let n_good = igood.len();
    let mut mean = vec![0.0f64; nchan * npc];
    for &(_, k, j) in &igood {
        let row = &rows[k][j];
        for (c, &u) in imap[k].iter().enumerate() {
            for p in 0..npc {
                mean[u * npc + p] += f64::from(row[c * npc + p]);
            }
        }
    }
    let norm: Vec<f64> = (0..nchan)
        .map(|u| {
            mean[u * npc..(u + 1) * npc]
                .iter()
                .map(|v| (v / n_good as f64).powi(2))
                .sum::<f64>()
                .sqrt()
        })
        .collect();
    let mut ind: Vec<usize> = (0..nchan).collect();
    ind.sort_by(|&a, &b| norm[b].total_cmp(&norm[a]));
    ind.truncate(nc);
    // Each spike's new row r is its old row at the template's site that is
    // union site ind[r], or zeros where the template has no such site.
    let mut tmp = vec![0.0f32; nc * npc];
    for (k, template_rows) in rows.iter_mut().enumerate() {
        let src: Vec<Option<usize>> = ind
            .iter()
            .map(|&u| imap[k].iter().position(|&v| v == u))
            .collect();
        for row in template_rows.iter_mut() {
            for (r, c) in src.iter().enumerate() {
                let out = &mut tmp[r * npc..(r + 1) * npc];
                match c {
                    Some(c) => out.copy_from_slice(&row[c * npc..(c + 1) * npc]),
                    None => out.fill(0.0),
                }
            }
            row.copy_from_slice(&tmp);
        }
    }
    Ok(ind.iter().map(|&u| ichan[u] as u32).collect())
}

/// Kilosort4's `make_pc_features` on the kept spikes: for each cluster in id
/// order, every spike of every template the cluster used (those of other
/// clusters too) gets its features regathered onto the nC sites, among the
/// union of those templates' sites, where the mean feature of those spikes is
/// largest (ties: lower union index first); the cluster's row of
/// `pc_feature_ind` records the sites. A later cluster sharing a template
/// overwrites earlier ones' spikes, and reads the features as earlier
/// clusters left them: Kilosort4 does both, in place.
///
/// Returns `pc_features` (n, npc, nC) and `pc_feature_ind` (`n_clusters`, nC) uint32.
///
/// # Errors
/// When a template's sites are fewer than nC, or the inputs' sizes disagree.
pub fn make_pc_features(
    spike_templates: &[usize],
    spike_clusters: &[i32],
    mut tf: Array3<f32>,
    sets: &ChannelSets,
    n_clusters: usize,
) -> Result<(Array3<f32>, Array2<u32>)> {
    let n = spike_templates.len();
    if tf.shape()[0] != n {
        bail!(
            "pc features: {n} templates and {} feature rows",
            tf.shape()[0]
        );
    }
    let rows: Vec<usize> = (0..n).collect();
    let ind = pc_features_in_place(
        spike_templates,
        spike_clusters,
        &rows,
        &mut tf,
        sets,
        n_clusters,
    )?;
    let pcs = tf.permuted_axes([0, 2, 1]).as_standard_layout().to_owned();
    Ok((pcs, ind))
}

/// [`make_pc_features`] in place on the rows of `tf` (N, nC, npc): spike s
/// (of `spike_templates`, `spike_clusters`) is row `rows[s]` (ascending; other
/// rows are left as they are). Returns `pc_feature_ind` (`n_clusters`, nC).
///
/// Clusters sharing no template touch disjoint rows, so they run in
/// parallel, in waves: a cluster runs after every earlier cluster sharing one
/// of its templates, as in the sequential order, so the result does not
/// depend on the thread count.
///
/// # Errors
/// As [`make_pc_features`]; also when `rows` is not ascending within `tf`.
pub fn pc_features_in_place(
    spike_templates: &[usize],
    spike_clusters: &[i32],
    rows: &[usize],
    tf: &mut Array3<f32>,
    sets: &ChannelSets,
    n_clusters: usize,
) -> Result<Array2<u32>> {
    let n = spike_templates.len();
    if spike_clusters.len() != n || rows.len() != n {
        bail!(
            "pc features: {n} templates, {} cluster labels and {} feature rows",
            spike_clusters.len(),
            rows.len()
        );
    }
    if !rows.windows(2).all(|w| w[0] < w[1]) || rows.last().is_some_and(|&r| r >= tf.shape()[0]) {
        bail!(
            "pc features: the spikes' rows are not ascending within the {} feature rows",
            tf.shape()[0]
        );
    }
    let (nc, npc) = (tf.shape()[1], tf.shape()[2]);
    if sets.icc.nrows() != nc {
        bail!(
            "pc features: tF has nC = {nc} but iCC {} rows",
            sets.icc.nrows()
        );
    }
    let mut by_template: Vec<Vec<usize>> = vec![Vec::new(); sets.iu.len()];
    let mut cluster_templates: Vec<Vec<usize>> = vec![Vec::new(); n_clusters];
    for (s, (&t, &c)) in spike_templates.iter().zip(spike_clusters).enumerate() {
        by_template[t].push(s);
        match usize::try_from(c)
            .ok()
            .and_then(|c| cluster_templates.get_mut(c))
        {
            Some(ts) => ts.push(t),
            None => bail!(
                "pc features: cluster {c} outside 0…{}",
                n_clusters as i64 - 1
            ),
        }
    }
    // Waves: one more than the latest wave of an earlier cluster sharing a template.
    let mut wave_of_template = vec![0usize; sets.iu.len()];
    let mut waves: Vec<Vec<usize>> = Vec::new();
    for (c, ts) in cluster_templates.iter_mut().enumerate() {
        if ts.is_empty() {
            continue;
        }
        ts.sort_unstable();
        ts.dedup();
        let w = ts.iter().map(|&t| wave_of_template[t]).max().unwrap_or(0);
        for &t in ts.iter() {
            wave_of_template[t] = w + 1;
        }
        if waves.len() <= w {
            waves.push(Vec::new());
        }
        waves[w].push(c);
    }
    let row_len = nc * npc;
    let flat = tf.as_slice_mut().expect("feature array in standard layout");
    let mut slots: Vec<Option<&mut [f32]>> = flat.chunks_exact_mut(row_len).map(Some).collect();
    let mut ind = Array2::<u32>::zeros((n_clusters, nc));
    for wave in &waves {
        // Each cluster of the wave takes its spikes' rows (disjoint from the others').
        let mut work: Vec<(usize, Vec<Vec<&mut [f32]>>)> = wave
            .iter()
            .map(|&c| {
                let taken = cluster_templates[c]
                    .iter()
                    .map(|&t| {
                        by_template[t]
                            .iter()
                            .map(|&s| slots[rows[s]].take().expect("row taken once per wave"))
                            .collect()
                    })
                    .collect();
                (c, taken)
            })
            .collect();
        let sites: Vec<Result<Vec<u32>>> = work
            .par_iter_mut()
            .map(|(c, taken)| {
                let ts = &cluster_templates[*c];
                let spikes: Vec<&[usize]> = ts.iter().map(|&t| by_template[t].as_slice()).collect();
                cluster_pc_features(ts, &spikes, taken, sets, nc, npc)
            })
            .collect();
        for ((c, taken), r) in work.into_iter().zip(sites) {
            ind.row_mut(c).assign(&ndarray::Array1::from(r?));
            for (&t, spikes) in cluster_templates[c].iter().zip(taken) {
                for (&s, row) in by_template[t].iter().zip(spikes) {
                    slots[rows[s]] = Some(row);
                }
            }
        }
    }
    Ok(ind)
}

/// `whitening_mat_inv.npy`: the inverse of Wrot + 1e-5·I, the sum taken in
/// float32 as Kilosort4 does, the inverse in float64 (Kilosort4: float32
/// LAPACK), rounded to float32.
///
/// # Errors
/// When the matrix is not square or is singular.
pub fn whitening_inverse(wrot: ArrayView2<f32>) -> Result<Array2<f32>> {
    let n = wrot.nrows();
    if wrot.ncols() != n {
        bail!("the whitening matrix is {:?}, not square", wrot.dim());
    }
    let a = Array2::from_shape_fn((n, n), |(i, j)| {
        wrot[[i, j]] + if i == j { 1e-5f32 } else { 0.0 }
    });
    crate::drift::correct::inverse_with_ridge(&a, 0.0)
        .map_err(|_| anyhow::anyhow!("the whitening matrix (+1e-5·I) is singular"))
}

/// The rows of `tf` at `keep` (a mask over its first axis).
pub fn select_rows<T: Clone>(a: ArrayView3<T>, keep: &[bool]) -> Array3<T> {
    let idx: Vec<usize> = keep
        .iter()
        .enumerate()
        .filter_map(|(i, &k)| k.then_some(i))
        .collect();
    a.select(Axis(0), &idx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_bins() {
        assert_eq!(duplicate_spike_bins(0.25, 30000.0), 7);
        assert_eq!(duplicate_spike_bins(0.25, 25000.0), 6);
    }

    #[test]
    fn duplicates_against_last_kept() {
        // Cluster 0: 0, 5 (dropped), 7 (kept: 7 ≥ 0 + 7), 13 (dropped), 14 (kept).
        let t = [0, 2, 5, 7, 13, 14];
        let c = [0, 1, 0, 0, 0, 0];
        assert_eq!(
            remove_duplicates(&t, &c, 7),
            vec![true, true, false, true, false, true]
        );
    }

    #[test]
    fn pc_features_pick_the_largest_sites() {
        // 4 sites in a row; nC = 2; two templates on sites (0,1) and (1,2).
        let icc = Array2::from_shape_vec((2, 4), vec![0, 1, 2, 3, 1, 0, 1, 2]).unwrap();
        let sets = ChannelSets {
            icc_mask: icc.mapv(|_| true),
            icc,
            iu: vec![0, 2],
        };
        // Template 0 → iCC[:, 0] = (0, 1); template 1 → iCC[:, 2] = (2, 1).
        let mut tf = Array3::<f32>::zeros((3, 2, 1));
        tf[[0, 0, 0]] = 1.0; // spike 0, template 0, site 0
        tf[[0, 1, 0]] = 5.0; // site 1
        tf[[1, 0, 0]] = 9.0; // spike 1, template 1, site 2
        tf[[1, 1, 0]] = 3.0; // site 1
        tf[[2, 0, 0]] = 2.0; // spike 2, template 0 (cluster 1)
        let (pcs, ind) = make_pc_features(&[0, 1, 0], &[0, 0, 1], tf, &sets, 2).unwrap();
        // Cluster 0 (templates 0, 1): union sites (0, 1, 2); mean (1/3, 8/3, 3) → sites 2, 1.
        // Cluster 1 (template 0): union (0, 1), mean over spikes 0 and 2 of the
        // (already regathered) features → written last for spikes 0 and 2.
        assert_eq!(ind.row(0).to_vec(), vec![2, 1]);
        assert_eq!(pcs.shape(), &[3, 1, 2]);
        assert_eq!(pcs[[1, 0, 0]], 9.0);
        assert_eq!(pcs[[1, 0, 1]], 3.0);
        // Spike 0 after cluster 0: (site 2 → 0, site 1 → 5); cluster 1 then reads
        // them as sites (0, 1): mean over spikes 0, 2 = (0, 2.5) → order (1, 0).
        assert_eq!(ind.row(1).to_vec(), vec![1, 0]);
        assert_eq!((pcs[[0, 0, 0]], pcs[[0, 0, 1]]), (5.0, 0.0));
    }

    #[test]
    fn positions_weight_sites() {
        let icc = Array2::from_shape_vec((2, 2), vec![0, 1, 1, 0]).unwrap();
        let mut mask = icc.mapv(|_| true);
        let sets = ChannelSets {
            icc_mask: mask.clone(),
            icc: icc.clone(),
            iu: vec![0],
        };
        let mut tf = Array3::<f32>::zeros((1, 2, 2));
        tf[[0, 0, 0]] = 3.0;
        tf[[0, 1, 1]] = 1.0;
        let p = spike_positions(&[0], tf.view(), &sets, &[0.0, 40.0], &[10.0, 30.0]);
        assert_eq!(p.row(0).to_vec(), vec![10.0, 15.0]);
        mask[[1, 0]] = false;
        let sets = ChannelSets {
            icc_mask: mask,
            icc,
            iu: vec![0],
        };
        let p = spike_positions(&[0], tf.view(), &sets, &[0.0, 40.0], &[10.0, 30.0]);
        assert_eq!(p.row(0).to_vec(), vec![0.0, 10.0]);
    }
}
