//! The two clusterings against Kilosort4 4.1.7's own, on the sort fixtures
//! (`tests/data/sort/<case>/`, made by `make_sort_fixtures.py`): given
//! Kilosort4's inputs, ≥ 95 % of its clusters must have a partner in ours
//! with agreement ≥ 0.95 (SpikeInterface's score, Hungarian pairing); the
//! seeding with torch's draws gives Kilosort4's initial labels; and, started
//! from Kilosort4's own initial labels, the label updates reproduce its
//! labels per group.

mod common;
mod sort_fixture;

use ndarray::{Array1, Array2, Array3, Ix1};
use sort_fixture::{Case, cases, final_inputs, first_inputs};
use spikecube::sort::clustering::{
    self, ClusterInput, Clustering, ClusteringSettings, MIN_GROUP_SPIKES, TorchCpuGenerator,
    cluster_group,
    group::build_graph,
    labels::propagate,
    seeding::{kmeans_plusplus, kmeans_plusplus_traced},
};

/// Optimal assignment maximising the summed score (Hungarian method, O(n³)),
/// on a rectangular matrix (rows × cols); returns, per row, its column.
fn hungarian_max(score: &Array2<f64>) -> Vec<Option<usize>> {
    let (nr, nc) = score.dim();
    let n = nr.max(nc);
    let big = score.iter().copied().fold(0.0, f64::max);
    // Minimise cost = big − score on a square matrix padded with `big`.
    let cost = |i: usize, j: usize| {
        if i < nr && j < nc {
            big - score[[i, j]]
        } else {
            big
        }
    };
    let (mut u, mut v) = (vec![0f64; n + 1], vec![0f64; n + 1]);
    let (mut p, mut way) = (vec![0usize; n + 1], vec![0usize; n + 1]);
    for i in 1..=n {
        p[0] = i;
        let mut j0 = 0;
        let mut minv = vec![f64::INFINITY; n + 1];
        let mut used = vec![false; n + 1];
        loop {
            used[j0] = true;
            let i0 = p[j0];
            let (mut delta, mut j1) = (f64::INFINITY, 0);
            for j in 1..=n {
                if !used[j] {
                    let cur = cost(i0 - 1, j - 1) - u[i0] - v[j];
                    if cur < minv[j] {
                        minv[j] = cur;
                        way[j] = j0;
                    }
                    if minv[j] < delta {
                        delta = minv[j];
                        j1 = j;
                    }
                }
            }
            for j in 0..=n {
                if used[j] {
                    u[p[j]] += delta;
                    v[j] -= delta;
                } else {
                    minv[j] -= delta;
                }
            }
            j0 = j1;
            if p[j0] == 0 {
                break;
            }
        }
        loop {
            let j1 = way[j0];
            p[j0] = p[j1];
            j0 = j1;
            if j0 == 0 {
                break;
            }
        }
    }
    let mut out = vec![None; nr];
    for j in 1..=n {
        if p[j] >= 1 && p[j] - 1 < nr && j - 1 < nc {
            out[p[j] - 1] = Some(j - 1);
        }
    }
    out
}

/// Per Kilosort4 cluster: its size and the agreement with its Hungarian
/// partner in ours (SpikeInterface: matches / (n1 + n2 − matches); spikes are
/// identical, so matches are shared spikes).
fn agreement(theirs: &[i32], ours: &[i32]) -> Vec<(usize, f64)> {
    let k1 = theirs.iter().map(|&c| c as usize + 1).max().unwrap_or(0);
    let k2 = ours.iter().map(|&c| c as usize + 1).max().unwrap_or(0);
    let mut both = Array2::<f64>::zeros((k1, k2));
    let (mut n1, mut n2) = (vec![0f64; k1], vec![0f64; k2]);
    for (&a, &b) in theirs.iter().zip(ours) {
        both[[a as usize, b as usize]] += 1.0;
        n1[a as usize] += 1.0;
        n2[b as usize] += 1.0;
    }
    let score = Array2::from_shape_fn((k1, k2), |(a, b)| {
        let m = both[[a, b]];
        if m == 0.0 {
            0.0
        } else {
            m / (n1[a] + n2[b] - m)
        }
    });
    let pairs = hungarian_max(&score);
    (0..k1)
        .map(|a| (n1[a] as usize, pairs[a].map_or(0.0, |b| score[[a, b]])))
        .collect()
}

/// Prints the agreement table and returns the fraction of Kilosort4's
/// non-empty clusters matched with agreement ≥ 0.95.
fn report(what: &str, case: &str, theirs: &[i32], ours: &Clustering) -> f64 {
    let ag = agreement(theirs, &ours.clu);
    let present: Vec<&(usize, f64)> = ag.iter().filter(|(n, _)| *n > 0).collect();
    let good = present.iter().filter(|(_, a)| *a >= 0.95).count();
    let frac = good as f64 / present.len() as f64;
    let k2 = ours.clu.iter().map(|&c| c + 1).max().unwrap_or(0);
    eprintln!(
        "{case} {what}: Kilosort4 {} clusters, ours {k2}; {good} ({:.1} %) matched with agreement ≥ 0.95",
        present.len(),
        100.0 * frac
    );
    for (k, (n, a)) in ag.iter().enumerate() {
        if *n > 0 && *a < 0.95 {
            eprintln!("  Kilosort4 cluster {k} ({n} spikes): best agreement {a:.3}");
        }
    }
    frac
}

#[test]
fn first_clustering_agrees_with_kilosort4() {
    for dir in cases() {
        let c = Case::load(&dir);
        let fi = first_inputs(&c);
        let clu0: Array1<i32> = c
            .npz("first_out.npz")
            .f64("clu0")
            .into_dimensionality::<Ix1>()
            .unwrap()
            .mapv(|v| v as i32);
        let t = std::time::Instant::now();
        let ours = clustering::run(&fi.input(), &ClusteringSettings::ks4_compatible()).unwrap();
        eprintln!(
            "{}: first clustering {:.2} s",
            c.name,
            t.elapsed().as_secs_f64()
        );
        let wall0 = c.npz("first_out.npz").f32("Wall0");
        assert_eq!(ours.wall.shape()[1..], wall0.shape()[1..]);
        let frac = report("first clustering", &c.name, clu0.as_slice().unwrap(), &ours);
        assert!(
            frac >= 0.95,
            "{}: only {:.1} % of Kilosort4's clusters matched",
            c.name,
            100.0 * frac
        );
    }
}

/// The final clustering in the Kilosort4-compatible mode (torch's draws,
/// `cluster_init_seed` 5, 4.1.7's skipped CCG test), against Kilosort4's
/// labels. The other seeds' figures are printed to show how much the draws
/// move a clustering: with ChaCha8's draws at seed 5 this case matched 31 of
/// 34 clusters, and Kilosort4 itself with seed 6 matches only 32 of its own
/// seed-5 clusters.
#[test]
fn final_clustering_agrees_with_kilosort4() {
    for dir in cases() {
        let c = Case::load(&dir);
        if !dir.join("final_out.npz").exists() {
            panic!("{}: final_out.npz missing", dir.display());
        }
        let fi = final_inputs(&c);
        let clu: Array1<i32> = c
            .npz("final_out.npz")
            .f64("clu")
            .into_dimensionality::<Ix1>()
            .unwrap()
            .mapv(|v| v as i32);
        let mut at_default = None;
        for seed in [5u64, 1, 2, 3, 4] {
            let s = ClusteringSettings {
                cluster_init_seed: seed,
                ..ClusteringSettings::ks4_compatible()
            };
            let t = std::time::Instant::now();
            let ours = clustering::run(&fi.input(), &s).unwrap();
            eprintln!(
                "{}: final clustering (seed {seed}) {:.2} s",
                c.name,
                t.elapsed().as_secs_f64()
            );
            let frac = report(
                &format!("final clustering, seed {seed}"),
                &c.name,
                clu.as_slice().unwrap(),
                &ours,
            );
            at_default.get_or_insert(frac);
        }
        let frac = at_default.unwrap();
        assert!(
            frac >= 0.95,
            "{}: only {:.1} % of Kilosort4's clusters matched at its seed 5",
            c.name,
            100.0 * frac
        );
        // The intended CCG test changes decisions only towards merging.
        let bug = clustering::run(&fi.input(), &ClusteringSettings::ks4_compatible()).unwrap();
        let fixed = clustering::run(&fi.input(), &ClusteringSettings::default()).unwrap();
        let (k_bug, k_fixed) = (bug.wall.shape()[0], fixed.wall.shape()[0]);
        eprintln!(
            "{}: final clusters with 4.1.7's skipped CCG test {k_bug}, with the test {k_fixed}",
            c.name
        );
        assert!(k_fixed <= k_bug);
    }
}

/// The groups a clustering clusters (at least [`MIN_GROUP_SPIKES`] spikes),
/// in Kilosort4's order (the order of its per-group fixture files).
fn clustered_groups(
    input: &ClusterInput<'_>,
    plan: &spikecube::sort::clustering::GroupPlan,
) -> Vec<spikecube::sort::clustering::GroupData> {
    plan.centres
        .iter()
        .filter_map(|&cn| input.group(plan, cn))
        .filter(|d| d.spikes.len() >= MIN_GROUP_SPIKES)
        .collect()
}

/// Runs the label updates of every clustered group from Kilosort4's own
/// initial labels and counts the spikes whose label differs from Kilosort4's
/// (after the relabelling, before the tree).
fn from_ks4_init(
    c: &Case,
    input: &ClusterInput<'_>,
    file: &str,
    clu: &[i32],
) -> (usize, usize, usize) {
    let settings = ClusteringSettings::ks4_compatible();
    let plan = input.plan(&settings).unwrap();
    if !c.dir.join(file).exists() {
        // Kilosort4 writes no per-group file when every group is left whole.
        let big = plan
            .centres
            .iter()
            .filter_map(|&cn| input.group(&plan, cn))
            .any(|d| d.spikes.len() >= MIN_GROUP_SPIKES);
        assert!(
            !big,
            "{}: {file} missing but a group has ≥ {MIN_GROUP_SPIKES} spikes",
            c.name
        );
        return (0, 0, 0);
    }
    let g = c.npz(file);
    let ns: Vec<usize> = g.f64("n").iter().map(|&v| v as usize).collect();
    let ds: Vec<usize> = g.f64("d").iter().map(|&v| v as usize).collect();
    let init: Vec<u32> = g.f64("init").iter().map(|&v| v as u32).collect();
    let fin: Vec<u32> = g.f64("final").iter().map(|&v| v as u32).collect();
    let groups = clustered_groups(input, &plan);
    assert_eq!(groups.len(), ns.len(), "{}: clustered groups", c.name);
    let (mut off, mut differ, mut groups_differ, mut final_differ) = (0, 0, 0, 0);
    for (gi, d) in groups.iter().enumerate() {
        assert_eq!(
            (d.spikes.len(), d.dim),
            (ns[gi], ds[gi]),
            "{}: group {gi} size",
            c.name
        );
        let graph = build_graph(&d.xd, d.dim, &settings);
        let lab = propagate(&graph, &init[off..off + ns[gi]], 200, 200);
        let theirs = &fin[off..off + ns[gi]];
        let nd = lab
            .iclust
            .iter()
            .zip(theirs)
            .filter(|(a, b)| a != b)
            .count();
        if nd > 0 {
            groups_differ += 1;
            eprintln!(
                "  {}: group {gi} ({} spikes): {nd} labels differ",
                c.name, ns[gi]
            );
        }
        differ += nd;
        // The tree and its cuts from the same start give Kilosort4's clusters.
        let times: Option<Vec<f64>> = input
            .times
            .map(|t| d.spikes.iter().map(|&s| t[s]).collect());
        let o = cluster_group(
            &d.xd,
            d.dim,
            times.as_deref(),
            Some(&init[off..off + ns[gi]]),
            &settings,
        );
        let ks: Vec<i32> = d.spikes.iter().map(|&s| clu[s]).collect();
        let base = *ks.iter().min().unwrap();
        let tree_differ = o
            .labels
            .iter()
            .zip(&ks)
            .filter(|(a, b)| **a as i32 != **b - base)
            .count();
        if tree_differ > 0 {
            eprintln!(
                "  {}: group {gi}: {tree_differ} final labels differ after the tree",
                c.name
            );
        }
        final_differ += tree_differ;
        off += ns[gi];
    }
    eprintln!(
        "{} {file}: after the tree, {final_differ} of {off} labels differ",
        c.name
    );
    eprintln!(
        "{} {file}: {differ} of {off} labels differ from Kilosort4's, in {groups_differ} of {} groups",
        c.name,
        ns.len()
    );
    (differ + final_differ, off, groups_differ)
}

#[test]
fn label_updates_from_kilosort4_init_reproduce_its_labels() {
    for dir in cases() {
        let c = Case::load(&dir);
        let fi = first_inputs(&c);
        let clu0 = c.npz("first_out.npz").f64("clu0").mapv(|v| v as i32);
        let (d1, n1, _) = from_ks4_init(
            &c,
            &fi.input(),
            "groups_first.npz",
            clu0.as_slice().unwrap(),
        );
        let fl = final_inputs(&c);
        let clu = c.npz("final_out.npz").f64("clu").mapv(|v| v as i32);
        let (d2, n2, _) =
            from_ks4_init(&c, &fl.input(), "groups_final.npz", clu.as_slice().unwrap());
        // Exact: only a near-tied neighbour distance (faiss's float32 BLAS
        // expansion against our direct sums) or a float32 tie in Kilosort4's
        // expected-edge term could move a label, and none does on these cases.
        assert!(d1 == 0 && d2 == 0, "{}: {d1}/{n1}, {d2}/{n2}", c.name);
    }
}

#[test]
fn labels_are_identical_for_1_2_and_16_threads() {
    // A case whose groups are clustered (not all left whole).
    let dir = cases()
        .into_iter()
        .find(|d| d.join("groups_first.npz").exists())
        .expect("a clustered case");
    let c = Case::load(&dir);
    let fi = first_inputs(&c);
    let fl = final_inputs(&c);
    let settings = ClusteringSettings::default();
    let run_with = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let a = clustering::run(&fi.input(), &settings).unwrap();
            let b = clustering::run(&fl.input(), &settings).unwrap();
            (a.clu, a.wall, b.clu, b.wall)
        })
    };
    let one = run_with(1);
    for t in [2, 16] {
        let other = run_with(t);
        assert!(
            one.0 == other.0 && one.2 == other.2,
            "labels differ with {t} threads"
        );
        let same_bits = |x: &Array3<f32>, y: &Array3<f32>| {
            x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits())
        };
        assert!(
            same_bits(&one.1, &other.1) && same_bits(&one.3, &other.3),
            "Wall differs with {t} threads"
        );
    }
}

/// Both clusterings with the seeding on a GPU (every gain there, the groups
/// in one batch or in several) give the CPU's labels and Wall, bit for bit:
/// wgpu (Mesa lavapipe in CI).
#[cfg(feature = "wgpu")]
#[test]
fn labels_are_identical_with_the_seeding_on_wgpu() {
    crate::common::require_vulkan();
    for dir in cases() {
        let c = Case::load(&dir);
        let fi = first_inputs(&c);
        let fl = final_inputs(&c);
        let cpu = ClusteringSettings::default();
        let gpu = ClusteringSettings {
            seeding_device: spikecube::sort::clustering::SeedingDevice::wgpu(),
            ..ClusteringSettings::default()
        };
        // The groups in batches of at most 3000 spikes (several batches).
        let batched = ClusteringSettings {
            seeding_device: spikecube::sort::clustering::SeedingDevice::wgpu()
                .with_batch_spikes(3000),
            ..ClusteringSettings::default()
        };
        for (what, input) in [("first", fi.input()), ("final", fl.input())] {
            let a = clustering::run(&input, &cpu).unwrap();
            let in_batches = clustering::run(&input, &batched).unwrap();
            assert!(
                a.clu == in_batches.clu,
                "{}: {what} clustering labels differ with the groups in batches",
                c.name
            );
            let b = clustering::run(&input, &gpu).unwrap();
            assert!(
                a.clu == b.clu,
                "{}: {what} clustering labels differ",
                c.name
            );
            assert!(
                a.wall
                    .iter()
                    .zip(&b.wall)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{}: {what} clustering Wall differs",
                c.name
            );
        }
    }
}

/// Relative gap under which two candidates' totals count as tied: Kilosort4
/// sums a candidate's gains in float32 (BLAS products, torch's reductions),
/// whose rounding moves a total by about 10⁻⁶ of itself.
const TIE: f64 = 1e-5;

/// Each clustered group's initial labels from the seeding with torch's
/// draws (`cluster_init_generator` = torch, `cluster_init_seed` 5), against
/// Kilosort4's own (its `kmeans_plusplus`, run on the CPU). A group must give
/// Kilosort4's labels for every spike unless, at or before the first step
/// whose seed Kilosort4 labelled with another step, two candidates tied
/// ([`spikecube::sort::clustering::seeding::SeedStep::runner_up`]: which of a tied pair Kilosort4 keeps is decided
/// by its float32 rounding). Returns (spikes whose label differs, spikes,
/// groups that differ).
fn seeding_against_ks4(c: &Case, input: &ClusterInput<'_>, file: &str) -> (usize, usize, usize) {
    let settings = ClusteringSettings::ks4_compatible();
    let plan = input.plan(&settings).unwrap();
    if !c.dir.join(file).exists() {
        return (0, 0, 0);
    }
    let g = c.npz(file);
    let ns: Vec<usize> = g.f64("n").iter().map(|&v| v as usize).collect();
    let init: Vec<u32> = g.f64("init").iter().map(|&v| v as u32).collect();
    let groups = clustered_groups(input, &plan);
    assert_eq!(groups.len(), ns.len(), "{}: clustered groups", c.name);
    let (mut off, mut differ, mut groups_differ) = (0, 0, 0);
    for (gi, d) in groups.iter().enumerate() {
        let (ours, trace) = kmeans_plusplus_traced(&d.xd, d.dim, 200, settings.seeding_rng());
        assert_eq!(
            ours,
            kmeans_plusplus(&d.xd, d.dim, 200, settings.seeding_rng())
        );
        let theirs = &init[off..off + ns[gi]];
        let nd = ours.iter().zip(theirs).filter(|(a, b)| a != b).count();
        if nd > 0 {
            groups_differ += 1;
            // The first step whose seed Kilosort4 did not keep at that step
            // (a seed keeps its label: no other spike explains it better).
            let first = trace
                .iter()
                .enumerate()
                .find(|(j, s)| theirs[s.spike as usize] != *j as u32)
                .map_or(trace.len(), |(j, _)| j);
            let tie = trace[..(first + 1).min(trace.len())]
                .iter()
                .position(|s| s.total - s.runner_up <= TIE * s.total);
            eprintln!(
                "  {} {file}: group {gi} ({} spikes): {nd} initial labels differ; \
                 first seed Kilosort4 kept elsewhere at step {first}, tie at step {tie:?}",
                c.name, ns[gi]
            );
            assert!(
                tie.is_some(),
                "{} {file}: group {gi} differs from step {first} without a tie",
                c.name
            );
        }
        differ += nd;
        off += ns[gi];
    }
    eprintln!(
        "{} {file}: {differ} of {off} initial labels differ from Kilosort4's, in {groups_differ} of {} groups",
        c.name,
        ns.len()
    );
    (differ, off, groups_differ)
}

/// The seeding with torch's draws gives Kilosort4's initial labels: the same
/// 100 candidates at each of the 200 steps (torch's CPU generator, MT19937,
/// and `torch.multinomial`'s exponential race) and the same choice among
/// them, in every group up to a step where two candidates tie. On `sim32`,
/// 11 of the 14 clustered groups give Kilosort4's labels for every spike; in
/// the other 3 the first difference follows a tie (two exactly tied
/// symmetric pairs, one pair 2·10⁻⁷ apart).
#[test]
fn seeding_with_torch_draws_gives_kilosort4s_initial_labels() {
    let (mut same, mut all) = (0, 0);
    for dir in cases() {
        let c = Case::load(&dir);
        let fi = first_inputs(&c);
        let fl = final_inputs(&c);
        for (input, file) in [
            (fi.input(), "groups_first.npz"),
            (fl.input(), "groups_final.npz"),
        ] {
            if c.dir.join(file).exists() {
                let n = c.npz(file).f64("n").len();
                let (_, _, gd) = seeding_against_ks4(&c, &input, file);
                all += n;
                same += n - gd;
            }
        }
    }
    eprintln!("{same} of {all} groups seeded exactly as Kilosort4 seeded them");
    assert!(all > 0 && same * 4 >= all * 3, "{same} of {all} groups");
}

/// torch's own CPU draws (`tests/data/sort/torch_multinomial.npz`, written by
/// torch 2.15.0 with `make_torch_draws.py` beside it: `torch.manual_seed(seed)`, then three
/// `torch.multinomial(w, 100)` calls per case, and 1000 elements of
/// `exponential_()` after seed 5) against [`TorchCpuGenerator`]: the same
/// exponentials bit for bit and the same indices in the same order (where
/// fewer than 100 weights are positive, the positive ones, which come first).
#[test]
fn torch_generator_draws_what_torch_draws() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/sort/torch_multinomial.npz");
    let z = sort_fixture::Npz::open(&path);
    let mut g = TorchCpuGenerator::manual_seed(5);
    let exp = z.f32("exp");
    for (i, &e) in exp.iter().enumerate() {
        assert_eq!(g.exponential().to_bits(), e.to_bits(), "exponential {i}");
    }
    let ncases = z.scalar("ncases") as usize;
    assert!(ncases > 0);
    for k in 0..ncases {
        let w: Vec<f32> = z.f32(&format!("w{k}")).iter().copied().collect();
        let seed = z.u64(&format!("seed{k}"));
        let idx = z.f64(&format!("idx{k}"));
        let positive = w.iter().filter(|&&v| v > 0.0).count();
        let mut g = TorchCpuGenerator::manual_seed(seed);
        for call in 0..idx.shape()[0] {
            let theirs: Vec<usize> = idx
                .index_axis(ndarray::Axis(0), call)
                .iter()
                .map(|&v| v as usize)
                .collect();
            let ours = g.multinomial(&w, theirs.len());
            let m = positive.min(theirs.len());
            assert_eq!(
                ours[..m],
                theirs[..m],
                "case {k} (seed {seed}), call {call}"
            );
        }
    }
}
