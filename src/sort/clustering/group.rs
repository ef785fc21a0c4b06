//! The clustering of one spatial group (Kilosort4 4.1.7
//! `clustering_qr.py:cluster`, then `hierarchical.maketree`,
//! `swarmsplitter.split` and `new_clusters`).

use super::knn::{knn, landmarks};
use super::labels::{Graph, Labels, propagate};
use super::profile::{GroupClock, lap};
use super::seeding::kmeans_plusplus_on;
use super::settings::{ClusteringSettings, N_CLUSTERS_INIT, N_LABEL_ROUNDS};
use super::split::{SplitInput, new_clusters, split};
use super::tree::{find_merges, leaf_sets, prepare};

/// What the clustering of one group went through.
#[derive(Debug, Clone)]
pub struct GroupOutcome {
    /// Final labels of the group's spikes (0‥`n_clusters`).
    pub labels: Vec<u32>,
    /// Final clusters.
    pub n_clusters: usize,
    /// Labels after the label updates and relabelling, before the tree
    /// (Kilosort4's `cluster` output); empty for a group left whole.
    pub graph_labels: Vec<u32>,
    /// Clusters after the label updates.
    pub n_graph_clusters: usize,
    /// Label-update rounds run before a fixed point (≤ 200).
    pub rounds_run: usize,
}

/// The neighbour graph of a group's features `xd` (n × `dim`).
pub fn build_graph(xd: &[f32], dim: usize, settings: &ClusteringSettings) -> Graph {
    crate::cancel::check("the clustering's graphs");
    let n = xd.len() / dim;
    let lm = landmarks(
        n,
        settings.cluster_downsampling,
        settings.max_cluster_subset,
    );
    let k = settings.cluster_neighbors.min(lm.len());
    let kn = knn(xd, dim, &lm, k);
    Graph::new(kn, k, &lm)
}

/// Clusters one group of at least 1000 spikes: neighbour graph, seeding (or
/// `init`, initial labels 0‥200 given from elsewhere, e.g. Kilosort4's own),
/// label updates, merge tree and cuts. `times` (s) turns on the CCG test of
/// the final clustering.
pub fn cluster_group(
    xd: &[f32],
    dim: usize,
    times: Option<&[f64]>,
    init: Option<&[u32]>,
    settings: &ClusteringSettings,
) -> GroupOutcome {
    cluster_group_clocked(xd, dim, times, None, init, settings, &mut None)
}

/// [`cluster_group`] with its neighbour graph when already built ([`build_graph`]),
/// its stages timed on `clock` when profiling.
pub(crate) fn cluster_group_clocked(
    xd: &[f32],
    dim: usize,
    times: Option<&[f64]>,
    graph: Option<Graph>,
    init: Option<&[u32]>,
    settings: &ClusteringSettings,
    clock: &mut Option<GroupClock>,
) -> GroupOutcome {
    if clock.is_some() {
        dump_features(xd, dim, init.is_none());
    }
    let g = graph.unwrap_or_else(|| build_graph(xd, dim, settings));
    lap(clock, 0);
    let seeded;
    let init = match init {
        Some(v) => v,
        None => {
            seeded = kmeans_plusplus_on(
                xd,
                dim,
                N_CLUSTERS_INIT,
                settings.seeding_rng(),
                &settings.seeding_device,
            );
            &seeded
        }
    };
    lap(clock, 1);
    let nclust = init
        .iter()
        .map(|&l| l as usize + 1)
        .max()
        .unwrap_or(1)
        .max(N_CLUSTERS_INIT);
    let Labels {
        iclust,
        isub,
        nclust: nc,
        rounds_run,
    } = propagate(&g, init, nclust, N_LABEL_ROUNDS);
    lap(clock, 2);
    let (cc, cneg) = prepare(&g, &iclust, &isub, nc);
    let merges = find_merges(cc, cneg, nc);
    let sets = leaf_sets(&merges, nc);
    lap(clock, 3);
    let valid = split(&SplitInput {
        xd,
        dim,
        iclust: &iclust,
        merges: &merges,
        leaf_sets: &sets,
        times,
        ks4_ccg_bug: settings.ks4_swarm_ccg_bug,
    });
    let labels = new_clusters(&iclust, &merges, &valid, &sets);
    lap(clock, 4);
    let n_clusters = labels.iter().map(|&l| l as usize + 1).max().unwrap_or(1);
    GroupOutcome {
        labels,
        n_clusters,
        graph_labels: iclust,
        n_graph_clusters: nc,
        rounds_run,
    }
}

/// With profiling on and `SPIKECUBE_CLUSTER_DUMP` naming a folder, writes the
/// feature matrix (n × `dim`, float32) of each group of at least 15 000
/// spikes there as `group_<n>x<dim>.npy`, for studying the clustering's cost
/// on real groups offline (a diagnostic; errors are ignored).
fn dump_features(xd: &[f32], dim: usize, seeded: bool) {
    let Some(dir) = std::env::var_os("SPIKECUBE_CLUSTER_DUMP") else {
        return;
    };
    let n = xd.len() / dim.max(1);
    if !seeded || n < 15_000 {
        return;
    }
    let dir = std::path::PathBuf::from(dir);
    let _ = std::fs::create_dir_all(&dir);
    if let Ok(a) = ndarray::ArrayView2::from_shape((n, dim), xd) {
        let _ = crate::npy::write(&dir.join(format!("group_{n}x{dim}.npy")), &a);
    }
}
