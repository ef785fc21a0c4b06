//! Helpers shared by the integration tests: where the Kilosort4 fixtures are,
//! and how to load a fixture case.
#![allow(dead_code)]

use std::path::PathBuf;

use ndarray::{Array1, Array2, Array3};
use spikecube::{DetectionSettings, Geometry, Probe, npy};

/// `../shared` beside the repository (CI lays a copy there). Missing fixtures are
/// a failure, never a skip.
pub fn shared() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared");
    assert!(
        p.join("fixtures").is_dir(),
        "the Kilosort4 fixtures are missing: expected {}/fixtures",
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
        let dir = shared().join("fixtures/detection").join(name);
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
