//! Time of the sort's Phy export ([`spikecube::sort::phy::write_phy`]) on
//! synthetic merged spikes of a 10-minute 384-site sort: N spikes (default
//! 1 120 000, the H200 run's count) of K = 600 learned templates in U = 400
//! units, (nC = 10, npc = 6) features each, so `pc_features.npy` is about
//! 270 MB. Prints the whole export's seconds and, apart, the seconds of
//! Kilosort4's `make_pc_features` on the same features
//! ([`spikecube::sort::postprocess::pc_features_in_place`]); with
//! `RUST_LOG=spikecube=debug` the export's own pieces too.
//!
//! Usage: `cargo bench --bench phy_export [-- N [RUNS [DIR]]]` (DIR: where the
//! folders are written, default the system's temporary folder).

use std::time::Instant;

use ndarray::{Array2, Array3};
use spikecube::sort::merge::Merged;
use spikecube::sort::phy::{ExportSettings, write_phy};
use spikecube::sort::postprocess::{ChannelSets, pc_features_in_place};

/// xorshift numbers.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-0.5, 0.5).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

const N_UNITS: usize = 400;
const N_TEMPLATES: usize = 600;
const NC: usize = 10;
const NPC: usize = 6;
const NT: usize = 61;

/// The probe's nC nearest sites of each site (ties: lower index), all within reach.
fn channel_sets(xc: &[f32], yc: &[f32]) -> ChannelSets {
    let c = xc.len();
    let mut icc = Array2::<usize>::zeros((NC, c));
    for s in 0..c {
        let mut by: Vec<usize> = (0..c).collect();
        let d = |j: usize| (xc[j] - xc[s]).powi(2) + (yc[j] - yc[s]).powi(2);
        by.sort_by(|&a, &b| d(a).total_cmp(&d(b)).then(a.cmp(&b)));
        for r in 0..NC {
            icc[[r, s]] = by[r];
        }
    }
    let iu = (0..N_TEMPLATES).map(|t| t * c / N_TEMPLATES).collect();
    ChannelSets {
        icc_mask: Array2::from_elem((NC, c), true),
        icc,
        iu,
    }
}

/// n spikes over 10 minutes at 30 kHz, time order; template t belongs to unit
/// u = t·U/K, but for half the templates one spike in 8 is labelled with
/// another unit (u xor 1, or u + 100): templates shared between clusters, as
/// after the final clustering (a 60-s simulated sort had 1.3 templates per
/// unit, and its `make_pc_features` ran in 5 waves).
fn merged(n: usize, c: usize, rng: &mut Rng) -> Merged {
    let mut times: Vec<u64> = (0..n).map(|_| rng.next() % 18_000_000).collect();
    times.sort_unstable();
    let mut st = Array2::<f64>::zeros((n, 3));
    let mut clu = Vec::with_capacity(n);
    for (i, &t) in times.iter().enumerate() {
        let template = (rng.next() % N_TEMPLATES as u64) as usize;
        let mut unit = template * N_UNITS / N_TEMPLATES;
        if rng.next().is_multiple_of(8) {
            match template % 4 {
                0 => unit ^= 1,
                1 => unit = (unit + 100) % N_UNITS,
                _ => {}
            }
        }
        st[[i, 0]] = t as f64;
        st[[i, 1]] = template as f64;
        st[[i, 2]] = 10.0 + 20.0 * f64::from(rng.f() + 0.5);
        clu.push(unit as i32);
    }
    Merged {
        // Each unit's template on the 24 sites around its own, zero elsewhere.
        wall: Array3::from_shape_fn((N_UNITS, c, NPC), |(u, ch, _)| {
            let centre = (u * c / N_UNITS) as i64;
            if (ch as i64 - centre).abs() < 12 {
                rng.f()
            } else {
                0.0
            }
        }),
        clu,
        is_ref: vec![true; N_UNITS],
        st,
        tf: Array3::from_shape_fn((n, NC, NPC), |_| 4.0 * rng.f()),
        n_merges: 0,
        n_refused: 0,
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let n: usize = args
        .first()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_120_000);
    let runs: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(3);
    let dir = args
        .get(2)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("spikecube_phy_export_bench_{}", std::process::id()));
    let probe = spikecube::simulate::default_probe();
    let c = probe.n_sites();
    let sets = channel_sets(&probe.xc, &probe.yc);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let m = merged(n, c, &mut rng);
    let wpca = Array2::from_shape_fn((NPC, NT), |_| rng.f());
    let wrot = Array2::from_shape_fn((c, c), |(i, j)| if i == j { 2.0 } else { 0.0 });
    let settings = ExportSettings::new(30_000.0, c as u64, vec!["raw.bin".into()]);
    let threads = rayon::current_num_threads();
    println!(
        "{n} spikes, {N_TEMPLATES} templates, {N_UNITS} units, {c} sites, ({NC}, {NPC}) features ({threads} threads)"
    );
    for run in 0..runs {
        let templates: Vec<usize> = m.st.column(1).iter().map(|&t| t as usize).collect();
        let rows: Vec<usize> = (0..n).collect();
        let mut tf = m.tf.clone();
        let t = Instant::now();
        pc_features_in_place(&templates, &m.clu, &rows, &mut tf, &sets, N_UNITS)
            .expect("pc features");
        let compute = t.elapsed().as_secs_f64();
        drop(tf);
        let out = dir.join(format!("run{run}"));
        let t = Instant::now();
        let summary = write_phy(
            &out,
            m.clone(),
            wpca.view(),
            wrot.view(),
            &sets,
            &probe,
            &settings,
            serde_json::json!({}),
            "bench",
        )
        .expect("export");
        let export = t.elapsed().as_secs_f64();
        let bytes = std::fs::metadata(out.join("pc_features.npy")).map_or(0, |m| m.len());
        println!(
            "run {run}: export {export:.3} s ({} spikes kept, pc_features.npy {:.0} MB); make_pc_features alone {compute:.3} s",
            summary.n_spikes,
            bytes as f64 / 1e6
        );
        std::fs::remove_dir_all(&out).ok();
    }
    std::fs::remove_dir_all(&dir).ok();
}
