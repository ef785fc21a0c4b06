//! Settings of the two clusterings, named and defaulted as in Kilosort4 4.1.7
//! (`parameters.py`), and the hard-coded constants of `clustering_qr.py`,
//! `hierarchical.py` and `swarmsplitter.py`.

use serde::{Deserialize, Serialize};

use super::ClusteringError;
use super::device::SeedingDevice;
use super::draws::{SeedingGenerator, SeedingRng};

/// Clusters seeded per group (Kilosort4's `nclust`, hard-coded 200).
pub const N_CLUSTERS_INIT: usize = 200;
/// Label-update rounds per group (Kilosort4's `niter`, hard-coded 200).
pub const N_LABEL_ROUNDS: usize = 200;
/// Candidates drawn per seeding step (Kilosort4's `ntry`, hard-coded 100).
pub const N_CANDIDATES: usize = 100;
/// A group with fewer spikes than this is one cluster (hard-coded 1000).
pub const MIN_GROUP_SPIKES: usize = 1000;
/// A tree node whose merge ratio is below this keeps its split (hard-coded 0.2).
pub const SPLIT_RATIO: f64 = 0.2;
/// A bimodality score below this merges the node (hard-coded 0.6).
pub const BIMODALITY_MERGE: f64 = 0.6;
/// Ridge added to the discriminant's normal matrix (hard-coded 0.01).
pub const RIDGE: f64 = 0.01;

/// How the x-centres of the spatial groups are chosen (Kilosort4's `x_centers`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum XCenters {
    /// This many centres, found by k-means of the site x positions. Kilosort4
    /// starts scipy's k-means from random sites (numpy's generator, seed 5330)
    /// and keeps the best of 20 runs; spikecube starts it once from the counts'
    /// evenly spaced quantiles of the sorted site x (deterministic; for one
    /// centre both give the mean site x).
    Count(usize),
    /// Initial guesses (µm), refined by k-means of the site x positions exactly
    /// as scipy refines them.
    Guesses(Vec<f64>),
}

/// Settings of Kilosort4's graph clustering (`clustering_qr.run`), used by the
/// first (universal spikes) and the final (learned-template spikes) clustering.
///
/// Field names and defaults are Kilosort4 4.1.7's. The whole struct is
/// serialisable so that a run records the seed and every choice in
/// `spikecube.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusteringSettings {
    /// Every `cluster_downsampling`-th spike of a group is a landmark of the
    /// neighbour graph. Default 20.
    pub cluster_downsampling: usize,
    /// At most this many landmarks per group (evenly spaced subsample);
    /// `None` for no limit. Default 25 000.
    pub max_cluster_subset: Option<usize>,
    /// Neighbours (landmarks) per spike in the graph. Default 10.
    pub cluster_neighbors: usize,
    /// Seed of the k-means++-style seeding, used afresh for every group.
    /// Default 5 (Kilosort4's value).
    pub cluster_init_seed: u64,
    /// The generator of the seeding's candidate draws: torch's CPU draws
    /// (default; Kilosort4's candidates as its CPU runs draw them) or
    /// ChaCha8's ([`SeedingGenerator`]).
    pub cluster_init_generator: SeedingGenerator,
    /// x-centres of the spatial groups; `None` finds them from a 50-µm
    /// histogram of site x (Kilosort4's automatic method, meant for probes
    /// with a few columns).
    pub x_centers: Option<XCenters>,
    /// `true` reproduces Kilosort4 4.1.5–4.1.7's `swarmsplitter.check_CCG`,
    /// whose guard `len(st2 == 0)` is true for every non-empty train, so the
    /// cross-refractory test inside the final clustering's merge tree never
    /// merges (Kilosort issue #1042). `false` (default) runs the intended test.
    pub ks4_swarm_ccg_bug: bool,
    /// Where the seeding screens its candidate pairs ([`SeedingDevice`]):
    /// the CPU (default) or a GPU, the same labels either way; not recorded.
    #[serde(skip)]
    pub seeding_device: SeedingDevice,
}

impl Default for ClusteringSettings {
    fn default() -> Self {
        ClusteringSettings {
            cluster_downsampling: 20,
            max_cluster_subset: Some(25_000),
            cluster_neighbors: 10,
            cluster_init_seed: 5,
            cluster_init_generator: SeedingGenerator::Torch,
            x_centers: None,
            ks4_swarm_ccg_bug: false,
            seeding_device: SeedingDevice::cpu(),
        }
    }
}

impl ClusteringSettings {
    /// Kilosort4 4.1.7's behaviour, bugs included (`ks4_swarm_ccg_bug` on).
    pub fn ks4_compatible() -> Self {
        ClusteringSettings {
            ks4_swarm_ccg_bug: true,
            ..Self::default()
        }
    }

    /// The seeding's generator and seed ([`SeedingRng`]).
    pub fn seeding_rng(&self) -> SeedingRng {
        SeedingRng {
            generator: self.cluster_init_generator,
            seed: self.cluster_init_seed,
        }
    }

    /// Checks the values a clustering cannot run with.
    ///
    /// # Errors
    /// [`ClusteringError::Setting`] naming the setting and its value.
    pub fn validate(&self) -> Result<(), ClusteringError> {
        let bad = |name: &'static str, value: String, why: &'static str| {
            Err(ClusteringError::Setting { name, value, why })
        };
        if self.cluster_downsampling == 0 {
            return bad("cluster_downsampling", "0".into(), "must be at least 1");
        }
        if self.cluster_neighbors == 0 {
            return bad("cluster_neighbors", "0".into(), "must be at least 1");
        }
        if self.max_cluster_subset == Some(0) {
            return bad("max_cluster_subset", "0".into(), "must be at least 1");
        }
        match &self.x_centers {
            Some(XCenters::Count(0)) => bad("x_centers", "0".into(), "must be at least 1"),
            Some(XCenters::Guesses(g)) if g.is_empty() || g.iter().any(|v| !v.is_finite()) => bad(
                "x_centers",
                format!("{g:?}"),
                "must be a non-empty list of finite positions (µm)",
            ),
            _ => Ok(()),
        }
    }
}
