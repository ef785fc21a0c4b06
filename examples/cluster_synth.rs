//! Both clusterings on synthetic features of a given size, for timing and
//! memory (no Kilosort4 needed): a 384-site Neuropixels-1.0-like probe
//! (4 columns, 20 µm rows), `--units` units at random places, each with its own
//! 6-PC shape decaying over 30 µm, spikes with unit-variance noise, as the
//! first clustering sees them (universal-template centres, tF (n, 10, 6)) and
//! as the final one does (learned templates, their sites, spike times).
//!
//! ```text
//! cargo build --release --locked --example cluster_synth
//! target/release/examples/cluster_synth --spikes 1200000 [--final-spikes N]
//!     [--units 400] [--minutes 10] [--threads T] [--stages] [--only first|final]
//!     [--backend cpu|cuda|wgpu]   (where the seeding runs)
//! /usr/bin/time -v target/release/examples/cluster_synth --spikes 20000000 --minutes 240
//! ```
//!
//! Prints the wall time and CPU time of each clustering (`clustering::run`,
//! groups in parallel), a hash of its labels (to check that a change keeps
//! them), and with `--stages` a second, group-by-group pass timing in CPU
//! seconds the neighbour graph, the seeding, the label updates and the tree
//! and cuts (each stage with all threads; use `--threads 1` for each group's
//! work), with the largest groups and a 16-thread schedule estimate. Peak
//! memory: run it under `/usr/bin/time -v`.

use std::time::Instant;

use ndarray::{Array2, Array3};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rayon::prelude::*;
use spikecube::sort::clustering::{
    self, ClusterInput, ClusteringSettings, MIN_GROUP_SPIKES, Positions,
    group::build_graph,
    labels::{Labels, propagate},
    seeding::kmeans_plusplus,
    settings::{N_CLUSTERS_INIT, N_LABEL_ROUNDS},
    split::{SplitInput, new_clusters, split},
    tree::{find_merges, leaf_sets, prepare},
};

const N_CHAN: usize = 384;
const NC: usize = 10;
const NPC: usize = 6;
const DMIN: f64 = 20.0;

struct Args {
    spikes: usize,
    final_spikes: usize,
    units: usize,
    minutes: f64,
    threads: usize,
    stages: bool,
    only: Option<String>,
    backend: String,
}

fn parse() -> Args {
    let mut a = Args {
        spikes: 1_200_000,
        final_spikes: 0,
        units: 400,
        minutes: 10.0,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        stages: false,
        only: None,
        backend: "cpu".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--spikes" => a.spikes = val().parse().expect("--spikes"),
            "--final-spikes" => a.final_spikes = val().parse().expect("--final-spikes"),
            "--units" => a.units = val().parse().expect("--units"),
            "--minutes" => a.minutes = val().parse().expect("--minutes"),
            "--threads" => a.threads = val().parse().expect("--threads"),
            "--stages" => a.stages = true,
            "--only" => a.only = Some(val()),
            "--backend" => a.backend = val(),
            _ => panic!("unknown argument {k}"),
        }
    }
    if a.final_spikes == 0 {
        a.final_spikes = a.spikes + a.spikes / 12;
    }
    a
}

fn uniform(r: &mut ChaCha8Rng) -> f64 {
    (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn normal(r: &mut ChaCha8Rng) -> f64 {
    let u1 = uniform(r).max(1e-300);
    let u2 = uniform(r);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Site positions (µm) of the probe.
fn probe() -> (Vec<f32>, Vec<f32>) {
    let xs = [43.0f32, 11.0, 59.0, 27.0];
    let xc = (0..N_CHAN).map(|i| xs[i % 4]).collect();
    let yc = (0..N_CHAN).map(|i| 20.0 * (i / 2) as f32).collect();
    (xc, yc)
}

/// The `NC` sites nearest to (x, y), nearest first (lower index on ties).
fn nearest_sites(xc: &[f32], yc: &[f32], x: f64, y: f64) -> Vec<usize> {
    let mut d: Vec<(f64, usize)> = (0..N_CHAN)
        .map(|s| {
            let (dx, dy) = (f64::from(xc[s]) - x, f64::from(yc[s]) - y);
            (dx * dx + dy * dy, s)
        })
        .collect();
    d.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    d[..NC].iter().map(|p| p.1).collect()
}

/// Units: position, a 6-PC shape, amplitude, and spike counts summing to `n`.
struct Units {
    x: Vec<f64>,
    y: Vec<f64>,
    shape: Vec<[f64; NPC]>,
    amp: Vec<f64>,
    count: Vec<usize>,
}

fn units(n_units: usize, n: usize, rng: &mut ChaCha8Rng) -> Units {
    let mut u = Units {
        x: vec![],
        y: vec![],
        shape: vec![],
        amp: vec![],
        count: vec![],
    };
    let mut rate = Vec::new();
    for _ in 0..n_units {
        u.x.push(70.0 * uniform(rng));
        u.y.push(3830.0 * uniform(rng));
        let mut s = [0f64; NPC];
        s.iter_mut().for_each(|v| *v = normal(rng));
        let norm = s.iter().map(|v| v * v).sum::<f64>().sqrt();
        s.iter_mut().for_each(|v| *v /= norm);
        u.shape.push(s);
        u.amp.push(6.0 + 24.0 * uniform(rng));
        rate.push((1.2 * normal(rng)).exp());
    }
    let total: f64 = rate.iter().sum();
    u.count = rate
        .iter()
        .map(|r| (r / total * n as f64) as usize)
        .collect();
    let short = n - u.count.iter().sum::<usize>();
    for i in 0..short {
        u.count[i % n_units] += 1;
    }
    u
}

/// Spike (unit, time in s), sorted by time; each unit fires as a Poisson
/// process with a 2-ms dead time.
fn spikes(u: &Units, seconds: f64, rng: &mut ChaCha8Rng) -> Vec<(u32, f64)> {
    let mut all = Vec::with_capacity(u.count.iter().sum());
    for (k, &c) in u.count.iter().enumerate() {
        let mean_gap = seconds / c.max(1) as f64 - 0.002;
        let mut t = 0.0;
        for _ in 0..c {
            t += 0.002 + mean_gap.max(1e-6) * (-uniform(rng).max(1e-300).ln());
            all.push((k as u32, t % seconds));
        }
    }
    all.sort_by(|a, b| a.1.total_cmp(&b.1));
    all
}

/// One spike's features on `chans`: the unit's shape times its amplitude
/// falling off with distance, plus unit-variance noise.
#[allow(clippy::too_many_arguments)]
fn features(
    out: &mut [f32],
    u: &Units,
    k: usize,
    chans: &[usize],
    xc: &[f32],
    yc: &[f32],
    rng: &mut ChaCha8Rng,
) {
    let scale = 1.0 + 0.1 * normal(rng);
    for (p, &s) in chans.iter().enumerate() {
        let (dx, dy) = (f64::from(xc[s]) - u.x[k], f64::from(yc[s]) - u.y[k]);
        let a = u.amp[k] * scale * (-(dx * dx + dy * dy).sqrt() / 30.0).exp();
        for f in 0..NPC {
            out[p * NPC + f] = (a * u.shape[k][f] + normal(rng)) as f32;
        }
    }
}

struct Data {
    template: Vec<u32>,
    times: Vec<f64>,
    tf: Array3<f32>,
    x: Vec<f64>,
    y: Vec<f64>,
    chans: Array2<usize>,
}

/// The first clustering's view: centres on a 2 × 384 grid (x 19 and 51 µm,
/// y every 10 µm), each spike at the centre nearest its unit (±5 µm jitter).
fn first_data(u: &Units, sp: &[(u32, f64)], seed: u64) -> Data {
    let (xc, yc) = probe();
    let ny = 384;
    let x: Vec<f64> = (0..2 * ny).map(|i| [19.0, 51.0][i / ny]).collect();
    let y: Vec<f64> = (0..2 * ny).map(|i| 10.0 * (i % ny) as f64).collect();
    let mut chans = Array2::zeros((NC, 2 * ny));
    for c in 0..2 * ny {
        for (r, s) in nearest_sites(&xc, &yc, x[c], y[c]).into_iter().enumerate() {
            chans[[r, c]] = s;
        }
    }
    let n = sp.len();
    let mut tf = Array3::<f32>::zeros((n, NC, NPC));
    let mut template = vec![0u32; n];
    let rows = tf.as_slice_mut().unwrap();
    rows.par_chunks_mut(NC * NPC)
        .zip(template.par_iter_mut())
        .zip(sp.par_iter())
        .enumerate()
        .for_each(|(i, ((row, t), &(k, _)))| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37));
            let k = k as usize;
            let jx = u.x[k] + 5.0 * normal(&mut rng);
            let jy = u.y[k] + 5.0 * normal(&mut rng);
            let col = usize::from(jx > 35.0);
            let iy = (jy / 10.0).round().clamp(0.0, (ny - 1) as f64) as usize;
            let c = col * ny + iy;
            *t = c as u32;
            let ch: Vec<usize> = (0..NC).map(|r| chans[[r, c]]).collect();
            features(row, u, k, &ch, &xc, &yc, &mut rng);
        });
    Data {
        template,
        times: sp.iter().map(|p| p.1).collect(),
        tf,
        x,
        y,
        chans,
    }
}

/// The final clustering's view: one learned template per unit (a second one
/// for every fifth unit) at the unit's nearest site, channels `iCC[:, iU]`.
fn final_data(u: &Units, sp: &[(u32, f64)], seed: u64) -> Data {
    let (xc, yc) = probe();
    let nu = u.x.len();
    let mut iu = Vec::new();
    for k in 0..nu {
        iu.push(nearest_sites(&xc, &yc, u.x[k], u.y[k])[0]);
    }
    for k in (0..nu).step_by(5) {
        iu.push(nearest_sites(&xc, &yc, u.x[k], u.y[k])[1]);
    }
    let kt = iu.len();
    let mut chans = Array2::zeros((NC, kt));
    for (t, &s) in iu.iter().enumerate() {
        let near = nearest_sites(&xc, &yc, f64::from(xc[s]), f64::from(yc[s]));
        for (r, c) in near.into_iter().enumerate() {
            chans[[r, t]] = c;
        }
    }
    let n = sp.len();
    let mut tf = Array3::<f32>::zeros((n, NC, NPC));
    let mut template = vec![0u32; n];
    let rows = tf.as_slice_mut().unwrap();
    rows.par_chunks_mut(NC * NPC)
        .zip(template.par_iter_mut())
        .zip(sp.par_iter())
        .enumerate()
        .for_each(|(i, ((row, t), &(k, _)))| {
            let mut rng = ChaCha8Rng::seed_from_u64(!seed ^ (i as u64).wrapping_mul(0x9E37));
            let k = k as usize;
            let second = k.is_multiple_of(5) && uniform(&mut rng) < 0.3;
            let tt = if second { nu + k / 5 } else { k };
            *t = tt as u32;
            let ch: Vec<usize> = (0..NC).map(|r| chans[[r, tt]]).collect();
            features(row, u, k, &ch, &xc, &yc, &mut rng);
        });
    Data {
        template,
        times: sp.iter().map(|p| p.1).collect(),
        tf,
        x: iu.iter().map(|&s| f64::from(xc[s])).collect(),
        y: iu.iter().map(|&s| f64::from(yc[s])).collect(),
        chans,
    }
}

fn fnv(v: &[i32]) -> u64 {
    v.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u32 as u64).wrapping_mul(0x100000001b3)
    })
}

/// CPU seconds (user + system, every thread) the process has used so far;
/// 0 where `getrusage` is not available.
fn cpu_seconds() -> f64 {
    #[cfg(unix)]
    {
        // SAFETY: an all-zero `rusage` is a valid value of that plain C struct.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `ru` is a valid, writable `rusage` for the call to fill.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
            return 0.0;
        }
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        tv(ru.ru_utime) + tv(ru.ru_stime)
    }
    #[cfg(not(unix))]
    {
        0.0
    }
}

/// Greedy longest-first schedule of independent `jobs` (seconds) on
/// `threads` workers: the wall time it ends at.
fn lpt(jobs: &[f64], threads: usize) -> f64 {
    let mut sorted = jobs.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut load = vec![0f64; threads.max(1)];
    for j in sorted {
        let m = (0..load.len())
            .min_by(|&a, &b| load[a].total_cmp(&load[b]))
            .unwrap_or(0);
        load[m] += j;
    }
    load.into_iter().fold(0.0, f64::max)
}

/// Group by group, each stage timed in CPU seconds of the process (all
/// threads inside a stage; with more than one thread this counts rayon's idle
/// spinning too, so run it with `--threads 1` for each group's work); prints
/// the stage totals, the largest groups, and what a longest-first schedule
/// of whole groups, each on one thread, would take on 16 threads.
fn stages(inp: &ClusterInput<'_>, s: &ClusteringSettings) {
    let plan = inp.plan(s).unwrap();
    let mut t = [0f64; 4];
    let mut per_group: Vec<(usize, usize, [f64; 4])> = Vec::new();
    let (mut ng, mut nmax, mut dims) = (0, 0, 0);
    for &c in &plan.centres {
        let Some(d) = inp.group(&plan, c) else {
            continue;
        };
        if d.spikes.len() < MIN_GROUP_SPIKES {
            continue;
        }
        ng += 1;
        nmax = nmax.max(d.spikes.len());
        dims = dims.max(d.dim);
        let t0 = cpu_seconds();
        let g = build_graph(&d.xd, d.dim, s);
        let t1 = cpu_seconds();
        let init = kmeans_plusplus(&d.xd, d.dim, N_CLUSTERS_INIT, s.seeding_rng());
        let t2 = cpu_seconds();
        let Labels {
            iclust,
            isub,
            nclust,
            ..
        } = propagate(&g, &init, N_CLUSTERS_INIT, N_LABEL_ROUNDS);
        let t3 = cpu_seconds();
        let times: Option<Vec<f64>> = inp
            .times
            .map(|tm| d.spikes.iter().map(|&i| tm[i]).collect());
        let (cc, cneg) = prepare(&g, &iclust, &isub, nclust);
        let merges = find_merges(cc, cneg, nclust);
        let sets = leaf_sets(&merges, nclust);
        let valid = split(&SplitInput {
            xd: &d.xd,
            dim: d.dim,
            iclust: &iclust,
            merges: &merges,
            leaf_sets: &sets,
            times: times.as_deref(),
            ks4_ccg_bug: s.ks4_swarm_ccg_bug,
        });
        let _ = new_clusters(&iclust, &merges, &valid, &sets);
        let t4 = cpu_seconds();
        let mut g_t = [0f64; 4];
        for ((acc, gt), (a, b)) in
            t.iter_mut()
                .zip(g_t.iter_mut())
                .zip([(t0, t1), (t1, t2), (t2, t3), (t3, t4)])
        {
            *gt = b - a;
            *acc += *gt;
        }
        per_group.push((d.spikes.len(), d.dim, g_t));
    }
    println!(
        "  stages over {ng} clustered groups (largest {nmax} spikes, dim ≤ {dims}), CPU seconds: kNN {:.2}, seeding {:.2}, label updates {:.2}, tree+cuts {:.2}",
        t[0], t[1], t[2], t[3]
    );
    let total = |g: &(usize, usize, [f64; 4])| g.2.iter().sum::<f64>();
    per_group.sort_by(|a, b| total(b).total_cmp(&total(a)));
    println!("  largest groups (spikes, dim: kNN, seeding, labels, tree+cuts = total, CPU s):");
    for g in per_group.iter().take(8) {
        println!(
            "    {:>7} {:>3}: {:.3} {:.3} {:.3} {:.3} = {:.3}",
            g.0,
            g.1,
            g.2[0],
            g.2[1],
            g.2[2],
            g.2[3],
            total(g)
        );
    }
    let jobs: Vec<f64> = per_group.iter().map(total).collect();
    let sum: f64 = jobs.iter().sum();
    println!(
        "  groups' CPU time: sum {:.2} s, largest {:.2} s; whole groups longest-first on 16 threads: {:.2} s (sum/16 {:.2} s)",
        sum,
        jobs.first().copied().unwrap_or(0.0),
        lpt(&jobs, 16),
        sum / 16.0
    );
}

fn run_one(what: &str, d: &Data, with_times: bool, a: &Args) {
    let (xc, _) = probe();
    let ycup: Vec<f64> = (0..384).map(|i| 10.0 * i as f64).collect();
    let inp = ClusterInput {
        spike_template: &d.template,
        tf: d.tf.view(),
        positions: Positions {
            x: &d.x,
            y: &d.y,
            x_in_f32: with_times,
        },
        chans: d.chans.view(),
        xc: &xc,
        ycup: &ycup,
        dmin: DMIN,
        n_chan: N_CHAN,
        times: with_times.then_some(d.times.as_slice()),
    };
    let mut s = ClusteringSettings::ks4_compatible();
    s.seeding_device = seeding_device(&a.backend);
    let (t0, c0) = (Instant::now(), cpu_seconds());
    let out = clustering::run(&inp, &s).expect("clustering");
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - c0;
    let big = out.groups.iter().filter(|g| g.n_spikes >= MIN_GROUP_SPIKES);
    println!(
        "{what}: {:.2} s ({:.2} CPU s), {} spikes, {} groups ({} clustered), {} clusters, labels hash {:016x}",
        wall,
        cpu,
        d.template.len(),
        out.groups.len(),
        big.count(),
        out.wall.shape()[0],
        fnv(&out.clu)
    );
    if a.stages {
        stages(&inp, &s);
    }
}

/// The seeding's device for `--backend` (cpu, cuda or wgpu).
fn seeding_device(backend: &str) -> clustering::SeedingDevice {
    match backend {
        #[cfg(feature = "cuda")]
        "cuda" => clustering::SeedingDevice::cuda(),
        #[cfg(feature = "wgpu")]
        "wgpu" => clustering::SeedingDevice::wgpu(),
        "cpu" => clustering::SeedingDevice::cpu(),
        b => panic!("--backend {b}: cpu, cuda or wgpu (with their features)"),
    }
}

fn main() {
    let a = parse();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(a.threads)
        .build()
        .unwrap();
    pool.install(|| {
        let seconds = a.minutes * 60.0;
        println!(
            "synthetic 384-site probe, {} units, {} min, {} threads",
            a.units, a.minutes, a.threads
        );
        if a.only.as_deref() != Some("final") {
            let t = Instant::now();
            let mut rng = ChaCha8Rng::seed_from_u64(1);
            let u = units(a.units, a.spikes, &mut rng);
            let sp = spikes(&u, seconds, &mut rng);
            let d = first_data(&u, &sp, 11);
            drop(sp);
            println!("  (made in {:.1} s)", t.elapsed().as_secs_f64());
            run_one("first clustering", &d, false, &a);
        }
        if a.only.as_deref() != Some("first") {
            let t = Instant::now();
            let mut rng = ChaCha8Rng::seed_from_u64(2);
            let u = units(a.units, a.final_spikes, &mut rng);
            let sp = spikes(&u, seconds, &mut rng);
            let d = final_data(&u, &sp, 12);
            drop(sp);
            println!("  (made in {:.1} s)", t.elapsed().as_secs_f64());
            run_one("final clustering", &d, true, &a);
        }
    });
}
