//! Helpers shared by the integration tests: where the Kilosort4 fixtures are,
//! and how to load a fixture case.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ndarray::{Array1, Array2, Array3};
use spikecube::{DetectionSettings, Geometry, Probe, npy};

/// The test data carried in the repository (`tests/data/`: Kilosort4 fixtures
/// under `fixtures/`, real recordings and probe files under `data/`).
pub fn test_data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// `rel` under [`test_data`], which must exist: a missing file or folder is a
/// failure naming the path where it was expected, never a skip.
pub fn data(rel: &str) -> PathBuf {
    let p = test_data().join(rel);
    assert!(
        p.exists(),
        "test data missing: expected {} (the repository's tests/data/ should hold it)",
        p.display()
    );
    p
}

/// The six detection fixture cases.
pub const CASES: [&str; 6] = [
    "tetrode_like",
    "linear32",
    "np2_1shank",
    "np1",
    "np2_4shank",
    "np2_4shank_staggered",
];

/// One detection fixture case, loaded.
pub struct Case {
    pub name: String,
    pub dir: PathBuf,
    pub probe: Probe,
    pub x: Array2<f32>,
    pub settings: DetectionSettings,
}

impl Case {
    pub fn load(name: &str) -> Case {
        let dir = data(&format!("fixtures/detection/{name}"));
        let probe = Probe::load(&dir.join("probe.json")).unwrap();
        let x = npy::read(&dir.join("X.npy")).unwrap();
        Case {
            name: name.into(),
            dir,
            probe,
            x,
            settings: DetectionSettings::default(),
        }
    }
    pub fn i64_2(&self, f: &str) -> Array2<i64> {
        npy::read(&self.dir.join(f)).unwrap()
    }
    pub fn f32_1(&self, f: &str) -> Array1<f32> {
        npy::read(&self.dir.join(f)).unwrap()
    }
    pub fn f64_1(&self, f: &str) -> Array1<f64> {
        npy::read(&self.dir.join(f)).unwrap()
    }
    /// Geometry with Kilosort4's own iC, iC2 and weigh (for bit-exact comparison).
    pub fn kilosort_geometry(&self) -> Geometry {
        let i_c = self.i64_2("iC.npy").mapv(|v| v as u32);
        let i_c2 = self.i64_2("iC2.npy").mapv(|v| v as u32);
        let weigh: Array3<f32> = npy::read(&self.dir.join("weigh.npy")).unwrap();
        let settings = DetectionSettings {
            nearest_chans: i_c.nrows(),
            ..self.settings.clone()
        };
        Geometry::with_neighbourhoods(&self.probe, &settings, i_c, i_c2, weigh).unwrap()
    }
}

/// Small deterministic generator (xorshift64*) with Box–Muller normals, for tests.
pub struct Rng(pub u64);
impl Rng {
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// A probe from site positions (µm) and shank ids; channel map 0..n.
pub fn probe(xy: &[(f32, f32)], shanks: &[i64]) -> Probe {
    Probe {
        xc: xy.iter().map(|p| p.0).collect(),
        yc: xy.iter().map(|p| p.1).collect(),
        kcoords: shanks.to_vec(),
        chan_map: (0..xy.len() as u64).collect(),
        n_chan: xy.len() as u64,
        source: "test probe".into(),
    }
}

/// Unit-variance white noise, C × NT (a whitened window).
pub fn noise(c: usize, nt: usize, seed: u64) -> Array2<f32> {
    let mut rng = Rng(seed | 1);
    Array2::from_shape_fn((c, nt), |_| rng.normal() as f32)
}

/// Adds `amp`·wTEMP[k] with its trough (template sample 20) at sample `t0`, scaled
/// per channel by `gains` (negative-going, like the templates, for amp > 0).
pub fn inject(x: &mut Array2<f32>, t0: usize, k: usize, amp: f32, gains: &[f32]) {
    let t = spikecube::UniversalTemplates::builtin();
    for (c, &g) in gains.iter().enumerate() {
        for i in 0..61 {
            let s = t0 as isize + i as isize - 20;
            if s >= 0 && (s as usize) < x.ncols() {
                x[[c, s as usize]] += amp * g * t.wtemp[[k, i]];
            }
        }
    }
}

/// Runs the `spikecube` binary of this build with `args`.
pub fn spikecube(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spikecube"))
        .args(args)
        .output()
        .unwrap()
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Fails (never skips) when no Vulkan adapter is there for the wgpu tests,
/// saying what to install.
pub fn require_vulkan() {
    assert!(
        !spikecube::backend::probe_wgpu().is_empty(),
        "no Vulkan adapter: install a Vulkan driver (CI: apt-get install mesa-vulkan-drivers libvulkan1)"
    );
}

/// `spikecube simulate` on the 32-site probe of `tests/data/sort/probe32.json`
/// (`seconds`, `n_units` units at 15 Hz, `seed`) into `dir/sim`; returns that
/// folder (its binary is `sim_g0_t0.imec0.ap.bin`).
#[allow(dead_code)]
pub fn simulate32(dir: &Path, seconds: &str, n_units: &str, seed: &str) -> PathBuf {
    let probe = data("sort/probe32.json");
    let out = dir.join("sim");
    let o = spikecube(&[
        "simulate",
        "--probe",
        s(&probe),
        "--seconds",
        seconds,
        "--n-units",
        n_units,
        "--rate",
        "15",
        "--seed",
        seed,
        "--out",
        s(&out),
        "-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}
