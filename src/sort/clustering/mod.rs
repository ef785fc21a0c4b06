//! Kilosort4's graph clustering of spikes into units (4.1.7
//! `clustering_qr.run`, `hierarchical.py`, `swarmsplitter.py`), used twice:
//! the first clustering of the universal-template spikes (st0, tF → clu0,
//! Wall0) and the final clustering of the learned-template spikes
//! (st, tF, iCC[:, iU] → clu, Wall).
//!
//! The probe is cut into spatial groups ([`groups`]); each group's spikes are
//! clustered on their own ([`group`]): an exact k-nearest-landmark graph
//! ([`knn`]), a seeded k-means++-style start ([`seeding`]), 200 rounds of
//! bipartite-modularity label updates ([`labels`]), an agglomerative merge
//! tree ([`tree`]) and its top-down cuts ([`split`], with the CCG test of
//! [`ccg`] in the final clustering). Groups run in parallel (rayon), the
//! largest first; every decision uses integer counts or fixed-order sums, so
//! the labels are the same bytes for any thread count. With a GPU
//! ([`ClusteringSettings::seeding_device`], the sort's CUDA or wgpu device)
//! the seeding of every group runs there, all groups' steps in lockstep with
//! every gain computed in the CPU's arithmetic ([`lockstep`]), beside the
//! neighbour graphs on the CPU threads, by batches of groups
//! ([`SeedingDevice::with_batch_spikes`]); where the device has no float64,
//! or with `SPIKECUBE_SEED_LOCKSTEP=0`, the device only screens each group's
//! candidate pairs ([`device`]) and the CPU computes the gains it flags. The
//! labels are the same bytes either way.
//!
//! Where it differs from Kilosort4 4.1.7 (see README, "Where spikecube
//! differs"): the seeding draws torch's CPU candidates ([`draws`]), which
//! Kilosort4's GPU runs do not, and sums its gains in fixed-order float64;
//! neighbour distances are exact float32 sums with ties to
//! the lower landmark, not faiss's BLAS expansion; the expected-edge term of
//! the label updates is float64; and by default the final clustering's CCG
//! test runs as intended (`ks4_swarm_ccg_bug` restores 4.1.7's skipped test).

pub mod ccg;
pub mod device;
pub mod draws;
pub mod group;
pub mod groups;
pub mod knn;
pub mod labels;
mod lockstep;
mod profile;
pub mod seeding;
pub mod settings;
pub mod split;
pub mod tree;

use ndarray::{Array2, Array3, ArrayView2, ArrayView3};

pub use device::{DEVICE_BATCH_SPIKES, DEVICE_MIN_SPIKES, SeedingDevice};
pub use draws::{SeedingGenerator, SeedingRng, TorchCpuGenerator};
pub use group::{GroupOutcome, cluster_group};
pub use groups::{GroupData, Positions};
use settings::N_CLUSTERS_INIT;
pub use settings::{ClusteringSettings, MIN_GROUP_SPIKES, XCenters};

/// Errors of the clustering.
#[derive(Debug, thiserror::Error)]
pub enum ClusteringError {
    /// Inputs of the wrong shape or with out-of-range values.
    #[error("clustering input: {0}")]
    Input(String),
    /// A setting the clustering cannot run with.
    #[error("clustering setting `{name}` = {value}: {why}")]
    Setting {
        /// The setting's name (Kilosort4's).
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Every spike's template chose a group centre without spikes
    /// (Kilosort4: "`get_data_cpu` never found suitable channels").
    #[error("no spatial group has spikes (dmin {dmin} µm, {n_centres} group centres)")]
    NoGroups {
        /// The y spacing parameter.
        dmin: f64,
        /// Group centres tried.
        n_centres: usize,
    },
    /// Every cluster template is zero (Kilosort4: "Wall is empty").
    #[error("every cluster template (Wall) is zero after clustering {0} spikes")]
    EmptyWall(usize),
}

/// Everything one clustering call needs.
#[derive(Debug, Clone, Copy)]
pub struct ClusterInput<'a> {
    /// Each spike's template (final) or universal-template centre (first),
    /// indices into `positions` and the columns of `chans`; (n,).
    pub spike_template: &'a [u32],
    /// Features (n, nC, n_pcs), float32.
    pub tf: ArrayView3<'a, f32>,
    /// Where the templates are (µm); (K,).
    pub positions: Positions<'a>,
    /// Each template's nC channels (nC, K).
    pub chans: ArrayView2<'a, usize>,
    /// Site x positions (µm), for the x-centres; (C,).
    pub xc: &'a [f32],
    /// Universal-template centre depths (µm), for the y-centres.
    pub ycup: &'a [f64],
    /// Vertical site pitch (µm); y-centres are 2·dmin apart.
    pub dmin: f64,
    /// Channels of the probe (C), the second axis of Wall.
    pub n_chan: usize,
    /// Spike times (s), final clustering only (turns on the CCG test).
    pub times: Option<&'a [f64]>,
}

/// One group's place in the result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSummary {
    /// Flat index of its centre (x-centre · n_y + y-centre).
    pub centre: usize,
    /// Spikes in it.
    pub n_spikes: usize,
    /// Its feature length (6 × channels in the union).
    pub dim: usize,
    /// Its first cluster id in `clu`.
    pub first_cluster: usize,
    /// Its clusters.
    pub n_clusters: usize,
    /// Clusters after the label updates, before the tree (0 when left whole).
    pub n_graph_clusters: usize,
    /// Label-update rounds run (0 when left whole).
    pub rounds_run: usize,
}

/// The result of one clustering.
#[derive(Debug, Clone)]
pub struct Clustering {
    /// Cluster of each spike (n,), int32 as Kilosort4's `clu`.
    pub clu: Vec<i32>,
    /// Cluster templates (K, C, n_pcs): each cluster's mean features at its
    /// group's channels, zeros elsewhere (Kilosort4's `Wall`).
    pub wall: Array3<f32>,
    /// The groups, in Kilosort4's loop order (x-centre outer, y-centre inner).
    pub groups: Vec<GroupSummary>,
}

/// The group centres of a clustering in call order, and each template's centre.
#[derive(Debug, Clone)]
pub struct GroupPlan {
    /// Each template's nearest centre (flat index); (K,).
    pub nearest: Vec<usize>,
    /// Centres chosen by at least one template, ascending (Kilosort4's loop order).
    pub centres: Vec<usize>,
    /// x-centres (µm).
    pub xcent: Vec<f32>,
    /// y-centres (µm).
    pub ycent: Vec<f64>,
}

impl<'a> ClusterInput<'a> {
    /// Checks shapes and index ranges.
    ///
    /// # Errors
    /// [`ClusteringError::Input`] naming the array and the numbers.
    pub fn validate(&self) -> Result<(), ClusteringError> {
        let n = self.spike_template.len();
        let (nt, nc, npc) = self.tf.dim();
        let k = self.positions.x.len();
        let bad = |s: String| Err(ClusteringError::Input(s));
        if n == 0 {
            return bad("no spikes to cluster".into());
        }
        if nt != n {
            return bad(format!("tF has {nt} rows but there are {n} spikes"));
        }
        if npc == 0 || nc == 0 {
            return bad(format!("tF has shape ({nt}, {nc}, {npc})"));
        }
        if self.positions.y.len() != k || self.chans.dim() != (nc, k) {
            return bad(format!(
                "{k} template x positions, {} y positions, channel lists of shape {:?}; expected ({nc}, {k})",
                self.positions.y.len(),
                self.chans.dim()
            ));
        }
        if let Some(&t) = self.spike_template.iter().find(|&&t| t as usize >= k) {
            return bad(format!("spike template id {t} is out of range (K = {k})"));
        }
        if let Some(&c) = self.chans.iter().find(|&&c| c >= self.n_chan) {
            return bad(format!(
                "channel {c} in the templates' channel lists, but C = {}",
                self.n_chan
            ));
        }
        if let Some(t) = self.times.filter(|t| t.len() != n) {
            return bad(format!("{} spike times for {n} spikes", t.len()));
        }
        Ok(())
    }

    /// The spatial groups (Kilosort4's `x_centers`, `y_centers`,
    /// `get_nearest_centers`).
    ///
    /// # Errors
    /// As [`groups::x_centers`] and [`groups::y_centers`].
    pub fn plan(&self, settings: &ClusteringSettings) -> Result<GroupPlan, ClusteringError> {
        let xcent = groups::x_centers(self.xc, settings.x_centers.as_ref())?;
        let ycent = groups::y_centers(self.ycup, self.dmin)?;
        let nearest = groups::nearest_centers(self.positions, &xcent, &ycent);
        let mut centres = nearest.clone();
        centres.sort_unstable();
        centres.dedup();
        Ok(GroupPlan {
            nearest,
            centres,
            xcent,
            ycent,
        })
    }

    /// The data of the group `g` of `plan.centres` made of `spikes` (its
    /// members, ascending; `None` when empty).
    fn group_of(&self, plan: &GroupPlan, g: usize, spikes: Vec<usize>) -> Option<GroupData> {
        groups::group_data_of(
            plan.centres[g],
            spikes,
            &plan.nearest,
            self.spike_template,
            self.tf,
            self.chans,
        )
    }

    /// The data of the group around `centre` (`None` when it has no spikes).
    pub fn group(&self, plan: &GroupPlan, centre: usize) -> Option<GroupData> {
        groups::group_data(
            centre,
            &plan.nearest,
            self.spike_template,
            self.tf,
            self.chans,
        )
    }
}

/// One group's labels and cluster templates.
struct GroupResult {
    data_spikes: Vec<usize>,
    labels: Vec<u32>,
    /// (clusters, chans × n_pcs) means.
    means: Array2<f32>,
    chans: Vec<usize>,
    summary: GroupSummary,
}

/// Clusters one group: whole when under 1000 spikes, else the graph clustering
/// (with its neighbour graph and initial labels when made beforehand).
fn run_group(
    inp: &ClusterInput<'_>,
    data: GroupData,
    pre: Prepared,
    settings: &ClusteringSettings,
    prof: &profile::Profile,
) -> GroupResult {
    crate::cancel::check("the clustering");
    let n = data.spikes.len();
    let mut clock = profile::GroupClock::start(n, data.dim);
    let (labels, ng, rounds) = if n < MIN_GROUP_SPIKES {
        (vec![0u32; n], 0, 0)
    } else {
        let times: Option<Vec<f64>> = inp
            .times
            .map(|t| data.spikes.iter().map(|&s| t[s]).collect());
        let o = group::cluster_group_clocked(
            &data.xd,
            data.dim,
            times.as_deref(),
            pre.graph,
            pre.init.as_deref(),
            settings,
            &mut clock,
        );
        (o.labels, o.n_graph_clusters, o.rounds_run)
    };
    let k = labels.iter().map(|&l| l as usize + 1).max().unwrap_or(1);
    let means = cluster_means(&data.xd, data.dim, &labels, k);
    profile::lap(&mut clock, 5);
    if let Some(c) = clock {
        prof.add(c);
    }
    GroupResult {
        data_spikes: data.spikes,
        labels,
        means,
        chans: data.chans,
        summary: GroupSummary {
            centre: data.centre,
            n_spikes: n,
            dim: data.dim,
            first_cluster: 0,
            n_clusters: k,
            n_graph_clusters: ng,
            rounds_run: rounds,
        },
    }
}

/// What a group's clustering can start from: its neighbour graph and its
/// initial labels, when made beforehand (by [`run_groups_lockstep`]).
#[derive(Default)]
struct Prepared {
    graph: Option<labels::Graph>,
    init: Option<Vec<u32>>,
}

/// Whether the seeding may run with every gain on the device: yes unless
/// `SPIKECUBE_SEED_LOCKSTEP=0` (then the device only screens the pairs of
/// each group, group by group; the same labels).
fn lockstep_enabled() -> bool {
    std::env::var("SPIKECUBE_SEED_LOCKSTEP").map_or(true, |v| v != "0")
}

/// [`run_groups`] with the seeding of every group on the device
/// ([`lockstep`]), by batches of at most
/// [`SeedingDevice::batch_spikes`] spikes (largest groups first; default
/// [`DEVICE_BATCH_SPIKES`]), each clustered whole before the next starts,
/// which bounds the seeding's device memory (features, v0, labels, changes:
/// about 4·(dim + 4) bytes a spike, 1.4 GB at 84 features, beside the
/// uploads) and the host memory of the groups' features and neighbour
/// graphs. In each batch: the groups' data; then, at the
/// same time, the seeding of the groups the device takes (on a thread of
/// its own; the draws on as many threads as the current pool has, or
/// `SPIKECUBE_SEED_DRAW_THREADS`; the labels do not depend on it) and every
/// group's neighbour graph (the current pool, largest first); then the rest
/// of each group's clustering (label updates, tree, cuts; largest first).
/// The labels are those of [`run_groups`]. `None` (nothing done) without a
/// device seeding.
fn run_groups_lockstep(
    inp: &ClusterInput<'_>,
    plan: &GroupPlan,
    settings: &ClusteringSettings,
) -> Option<Vec<GroupResult>> {
    let device = &settings.seeding_device;
    if !device.is_device() || !lockstep_enabled() {
        return None;
    }
    let draw_threads = std::env::var("SPIKECUBE_SEED_DRAW_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(rayon::current_num_threads);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(draw_threads)
        .thread_name(|i| format!("seed-draws-{i}"))
        .build()
        .ok()?;
    let mut members = groups::group_members(&plan.centres, &plan.nearest, inp.spike_template);
    let order = largest_first(&members);
    let mut batches: Vec<Vec<usize>> = Vec::new();
    let mut in_batch = 0usize;
    for &g in &order {
        let n = members[g].len();
        if batches.is_empty() || in_batch + n > device.batch_spikes() {
            batches.push(Vec::new());
            in_batch = 0;
        }
        in_batch += n;
        batches.last_mut().expect("pushed").push(g);
    }
    let mut results: Vec<(usize, GroupResult)> = Vec::with_capacity(order.len());
    for batch in &batches {
        let spikes: Vec<(usize, Vec<usize>)> = batch
            .iter()
            .map(|&g| (g, std::mem::take(&mut members[g])))
            .collect();
        results.extend(lockstep_batch(inp, plan, settings, spikes, &pool));
    }
    Some(in_centre_order(results))
}

/// One batch of [`run_groups_lockstep`]: the groups `(g, spikes)`, largest
/// first; returns `(g, result)` of each group with data.
fn lockstep_batch(
    inp: &ClusterInput<'_>,
    plan: &GroupPlan,
    settings: &ClusteringSettings,
    spikes: Vec<(usize, Vec<usize>)>,
    pool: &rayon::ThreadPool,
) -> Vec<(usize, GroupResult)> {
    use rayon::prelude::*;
    use std::time::Instant;
    let device = &settings.seeding_device;
    let t0 = Instant::now();
    let datas: Vec<(usize, Option<GroupData>)> = spikes
        .into_par_iter()
        .with_max_len(1)
        .map(|(g, spikes)| (g, inp.group_of(plan, g, spikes)))
        .collect();
    // Positions in `datas` (largest first) of the groups to cluster, and
    // whether the device takes each (the others are seeded on the CPU with
    // the rest of their clustering).
    let clustered: Vec<usize> = (0..datas.len())
        .filter(|&i| {
            datas[i]
                .1
                .as_ref()
                .is_some_and(|d| d.spikes.len() >= MIN_GROUP_SPIKES)
        })
        .collect();
    let data = |i: usize| datas[i].1.as_ref().expect("clustered groups have data");
    let taken: Vec<usize> = clustered
        .par_iter()
        .copied()
        .filter(|&i| device.takes(&data(i).xd, data(i).dim))
        .collect();
    let t_data = t0.elapsed().as_secs_f64();
    let (seeds, graphs, t_seed, t_graphs) = std::thread::scope(|sc| {
        let seeding = sc.spawn(|| {
            let t = Instant::now();
            let views: Vec<(&[f32], usize)> = taken
                .iter()
                .map(|&i| (data(i).xd.as_slice(), data(i).dim))
                .collect();
            // Groups the device cannot seed are seeded on the CPU later.
            let steps = if views.is_empty() {
                None
            } else {
                device.exact_taken(&views)
            };
            let labels = steps.map(|mut steps| {
                lockstep::seed_lockstep(
                    &views,
                    N_CLUSTERS_INIT,
                    settings.seeding_rng(),
                    steps.as_mut(),
                    pool,
                )
            });
            let out: Vec<(usize, Vec<u32>)> = match labels {
                Some(l) => taken.iter().copied().zip(l).collect(),
                None => Vec::new(),
            };
            (out, t.elapsed().as_secs_f64())
        });
        let t = Instant::now();
        let graphs: Vec<(usize, labels::Graph)> = clustered
            .par_iter()
            .with_max_len(1)
            .map(|&i| (i, group::build_graph(&data(i).xd, data(i).dim, settings)))
            .collect();
        let t_graphs = t.elapsed().as_secs_f64();
        let (seeds, t_seed) = seeding
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        (seeds, graphs, t_seed, t_graphs)
    });
    let t_tail = Instant::now();
    let mut pre: Vec<Prepared> = (0..datas.len()).map(|_| Prepared::default()).collect();
    for (i, graph) in graphs {
        pre[i].graph = Some(graph);
    }
    let n_seeded = seeds.len();
    for (i, init) in seeds {
        pre[i].init = Some(init);
    }
    let n_groups = datas.len();
    let prof = profile::Profile::default();
    let results = pull_in_order(datas.into_iter().zip(pre).collect(), |((g, d), p)| {
        Some((g, run_group(inp, d?, p, settings, &prof)))
    });
    let msg = format!(
        "clustering on the device's seeding: {n_groups} groups, data {t_data:.2} s, then graphs {t_graphs:.2} s beside the seeding of {n_seeded} groups {t_seed:.2} s, then the rest {:.2} s; {:.2} s in all",
        t_tail.elapsed().as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    if profile::enabled() {
        tracing::info!("{msg}");
        prof.log(t0.elapsed().as_secs_f64(), rayon::current_num_threads());
    } else {
        tracing::debug!("{msg}");
    }
    results
}

/// Clusters every group of `plan` with spikes, largest first ([`pull_in_order`]);
/// the results in `plan.centres` order.
fn run_groups(
    inp: &ClusterInput<'_>,
    plan: &GroupPlan,
    settings: &ClusteringSettings,
) -> Vec<GroupResult> {
    if let Some(r) = run_groups_lockstep(inp, plan, settings) {
        return r;
    }
    let mut members = groups::group_members(&plan.centres, &plan.nearest, inp.spike_template);
    let items: Vec<(usize, Vec<usize>)> = largest_first(&members)
        .into_iter()
        .map(|g| (g, std::mem::take(&mut members[g])))
        .collect();
    let t0 = std::time::Instant::now();
    let prof = profile::Profile::default();
    let results = pull_in_order(items, |(g, spikes)| {
        let d = inp.group_of(plan, g, spikes)?;
        Some((g, run_group(inp, d, Prepared::default(), settings, &prof)))
    });
    if profile::enabled() {
        prof.log(t0.elapsed().as_secs_f64(), rayon::current_num_threads());
    }
    in_centre_order(results)
}

/// The groups with spikes (indices into `members`), by spike count,
/// descending; equal counts keep centre order (the order only affects
/// timing).
fn largest_first(members: &[Vec<usize>]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..members.len())
        .filter(|&g| !members[g].is_empty())
        .collect();
    order.sort_by_key(|&g| std::cmp::Reverse(members[g].len()));
    order
}

/// The results of groups `(g, result)` in group (`plan.centres`) order.
fn in_centre_order(mut results: Vec<(usize, GroupResult)>) -> Vec<GroupResult> {
    results.sort_unstable_by_key(|r| r.0);
    results.into_iter().map(|r| r.1).collect()
}

/// `run` of each of `items` (groups, largest first), the results of those
/// that give one, in no particular order.
///
/// Each thread of the current rayon pool (`rayon::broadcast`, one pull loop a
/// thread) takes the next item of the shared list until the list is empty.
/// The groups' own stages still split their work with rayon: that costs
/// little while every thread has a group, and lets a thread that has run out
/// of groups help the ones still running (at the end, the largest, started
/// first). A thread waiting inside its group can only pick up pieces of other
/// groups' stages, never a whole group (unless another clustering runs in the
/// same pool at the same time): the pull loops are not jobs that can be
/// stolen, so the largest groups are not held back behind small ones (with a
/// parallel iterator over the groups, a thread waiting inside one group can
/// steal and run a whole range of others first). Which thread runs a group
/// does not change its result.
///
/// The call returns once every thread of the pool has seen the list empty:
/// the pool should not be busy with long unrelated jobs meanwhile.
fn pull_in_order<T: Send, R: Send>(items: Vec<T>, run: impl Fn(T) -> Option<R> + Sync) -> Vec<R> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let slots: Vec<Mutex<Option<T>>> = items.into_iter().map(|t| Mutex::new(Some(t))).collect();
    let next = AtomicUsize::new(0);
    let per_thread: Vec<Vec<R>> = rayon::broadcast(|_| {
        let mut done = Vec::new();
        loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = slots.get(k) else {
                break;
            };
            let item = slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(r) = item.and_then(&run) {
                done.push(r);
            }
        }
        done
    });
    per_thread.into_iter().flatten().collect()
}

/// Mean feature row of each label (k × dim), summed in float64 in spike order.
fn cluster_means(xd: &[f32], dim: usize, labels: &[u32], k: usize) -> Array2<f32> {
    let mut sum = vec![0f64; k * dim];
    let mut cnt = vec![0usize; k];
    for (row, &l) in xd.chunks_exact(dim).zip(labels) {
        let l = l as usize;
        cnt[l] += 1;
        for (s, &v) in sum[l * dim..(l + 1) * dim].iter_mut().zip(row) {
            *s += f64::from(v);
        }
    }
    Array2::from_shape_fn((k, dim), |(l, f)| {
        if cnt[l] == 0 {
            f32::NAN
        } else {
            (sum[l * dim + f] / cnt[l] as f64) as f32
        }
    })
}

/// Runs one clustering (Kilosort4's `clustering_qr.run`): groups in parallel,
/// cluster ids numbered in group order.
///
/// # Errors
/// Bad inputs or settings, no group with spikes, or an all-zero Wall.
pub fn run(
    inp: &ClusterInput<'_>,
    settings: &ClusteringSettings,
) -> Result<Clustering, ClusteringError> {
    settings.validate()?;
    inp.validate()?;
    let plan = inp.plan(settings)?;
    let results = run_groups(inp, &plan, settings);
    if results.is_empty() {
        return Err(ClusteringError::NoGroups {
            dmin: inp.dmin,
            n_centres: plan.centres.len(),
        });
    }
    let npc = inp.tf.dim().2;
    let total: usize = results.iter().map(|r| r.summary.n_clusters).sum();
    let mut wall = Array3::<f32>::zeros((total, inp.n_chan, npc));
    let mut clu = vec![0i32; inp.spike_template.len()];
    let mut groups = Vec::with_capacity(results.len());
    let mut nmax = 0usize;
    for mut r in results {
        for (&s, &l) in r.data_spikes.iter().zip(&r.labels) {
            clu[s] = (nmax + l as usize) as i32;
        }
        for j in 0..r.summary.n_clusters {
            for (p, &ch) in r.chans.iter().enumerate() {
                for f in 0..npc {
                    wall[[nmax + j, ch, f]] = r.means[[j, p * npc + f]];
                }
            }
        }
        r.summary.first_cluster = nmax;
        nmax += r.summary.n_clusters;
        groups.push(r.summary);
    }
    if wall.iter().all(|&v| v == 0.0) {
        return Err(ClusteringError::EmptyWall(clu.len()));
    }
    Ok(Clustering { clu, wall, groups })
}

/// The first clustering (Kilosort4's `run(mode='spikes')`): spikes grouped by
/// their universal-template centre `st0_centre` (st0[:, 5]), centres at
/// (`xcup`, `ycup`) with channels `ic` (nC × centres), features `tf0`.
///
/// # Errors
/// As [`run`].
#[allow(clippy::too_many_arguments)]
pub fn first_clustering(
    st0_centre: &[u32],
    tf0: ArrayView3<'_, f32>,
    ic: ArrayView2<'_, usize>,
    xcup: &[f64],
    ycup: &[f64],
    xc: &[f32],
    dmin: f64,
    n_chan: usize,
    settings: &ClusteringSettings,
) -> Result<Clustering, ClusteringError> {
    run(
        &ClusterInput {
            spike_template: st0_centre,
            tf: tf0.reborrow(),
            positions: Positions {
                x: xcup,
                y: ycup,
                x_in_f32: false,
            },
            chans: ic.reborrow(),
            xc,
            ycup,
            dmin,
            n_chan,
            times: None,
        },
        settings,
    )
}

/// The final clustering (Kilosort4's `run(mode='template')`): spikes grouped by
/// their learned template `st_template` (st[:, 1]), template k at site
/// `iu[k]` (`xc`, `yc`, float32) with channels `icc[:, iu[k]]`, spike times
/// `times_s` (st[:, 0] / fs) for the CCG test.
///
/// # Errors
/// As [`run`]; a template site outside the probe.
#[allow(clippy::too_many_arguments)]
pub fn final_clustering(
    st_template: &[u32],
    times_s: &[f64],
    tf: ArrayView3<'_, f32>,
    icc: ArrayView2<'_, usize>,
    iu: &[usize],
    xc: &[f32],
    yc: &[f32],
    ycup: &[f64],
    dmin: f64,
    settings: &ClusteringSettings,
) -> Result<Clustering, ClusteringError> {
    let n_chan = xc.len();
    if let Some(&s) = iu.iter().find(|&&s| s >= n_chan || s >= icc.ncols()) {
        return Err(ClusteringError::Input(format!(
            "template site iU = {s}, but the probe has {n_chan} sites and iCC {} columns",
            icc.ncols()
        )));
    }
    let x: Vec<f64> = iu.iter().map(|&s| f64::from(xc[s])).collect();
    let y: Vec<f64> = iu.iter().map(|&s| f64::from(yc[s])).collect();
    let chans = Array2::from_shape_fn((icc.nrows(), iu.len()), |(r, k)| icc[[r, iu[k]]]);
    run(
        &ClusterInput {
            spike_template: st_template,
            tf: tf.reborrow(),
            positions: Positions {
                x: &x,
                y: &y,
                x_in_f32: true,
            },
            chans: chans.view(),
            xc,
            ycup,
            dmin,
            n_chan,
            times: Some(times_s),
        },
        settings,
    )
}
