//! Loading the sort fixtures (`tests/data/sort/<case>/`, Kilosort4 4.1.7's
//! arrays from `make_sort_fixtures.py`): `.npz` files (compressed or not) and
//! the inputs of the two clusterings. Shared by the tests and the benchmark.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use ndarray::{Array2, Array3, ArrayD, Ix2, Ix3};
use ndarray_npy::ReadNpyExt;
use spikecube::sort::clustering::{ClusterInput, Positions};

/// Arrays of one `.npz` (compressed or not), by name without `.npy`.
pub struct Npz(BTreeMap<String, Vec<u8>>);

impl Npz {
    pub fn open(path: &Path) -> Npz {
        let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut z = zip::ZipArchive::new(f).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut m = BTreeMap::new();
        for i in 0..z.len() {
            let e = z.by_index_raw(i).unwrap();
            let name = e.name().trim_end_matches(".npy").to_string();
            let method = e.compression();
            let mut raw = Vec::new();
            { e }.read_to_end(&mut raw).unwrap();
            // np.savez_compressed deflates; the zip crate here has no
            // deflate, so the raw entry is inflated with flate2.
            let bytes = if method == zip::CompressionMethod::Stored {
                raw
            } else if method == zip::CompressionMethod::DEFLATE {
                let mut out = Vec::new();
                flate2::read::DeflateDecoder::new(&raw[..])
                    .read_to_end(&mut out)
                    .unwrap();
                out
            } else {
                panic!("{}: {name} compressed with {method:?}", path.display())
            };
            m.insert(name, bytes);
        }
        Npz(m)
    }

    pub fn bytes(&self, name: &str) -> &[u8] {
        self.0.get(name).unwrap_or_else(|| {
            panic!(
                "no array `{name}` (have {:?})",
                self.0.keys().collect::<Vec<_>>()
            )
        })
    }

    /// Any float or integer array as float64.
    pub fn f64(&self, name: &str) -> ArrayD<f64> {
        let b = self.bytes(name);
        if let Ok(a) = ArrayD::<f64>::read_npy(b) {
            return a;
        }
        if let Ok(a) = ArrayD::<f32>::read_npy(b) {
            return a.mapv(f64::from);
        }
        if let Ok(a) = ArrayD::<i64>::read_npy(b) {
            return a.mapv(|v| v as f64);
        }
        if let Ok(a) = ArrayD::<i32>::read_npy(b) {
            return a.mapv(f64::from);
        }
        if let Ok(a) = ArrayD::<bool>::read_npy(b) {
            return a.mapv(|v| f64::from(u8::from(v)));
        }
        panic!("array `{name}` is not float or int");
    }

    pub fn f32(&self, name: &str) -> ArrayD<f32> {
        ArrayD::<f32>::read_npy(self.bytes(name))
            .unwrap_or_else(|_| self.f64(name).mapv(|v| v as f32))
    }

    pub fn usize2(&self, name: &str) -> Array2<usize> {
        self.f64(name)
            .into_dimensionality::<Ix2>()
            .unwrap()
            .mapv(|v| v as usize)
    }

    pub fn scalar(&self, name: &str) -> f64 {
        let a = self.f64(name);
        a.iter().next().copied().unwrap()
    }

    /// A uint64 scalar (exact beyond 2⁵³).
    pub fn u64(&self, name: &str) -> u64 {
        ArrayD::<u64>::read_npy(self.bytes(name))
            .unwrap_or_else(|e| panic!("{name}: not a uint64 array: {e}"))
            .iter()
            .next()
            .copied()
            .unwrap()
    }
}

/// The fixture cases: folders of `tests/data/sort/` with a `first_in.npz`.
pub fn cases() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/sort");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("first_in.npz").exists())
        .collect();
    v.sort();
    assert!(
        !v.is_empty(),
        "no sort fixture case (a folder with first_in.npz) under {}",
        root.display()
    );
    v
}

/// One case's arrays.
pub struct Case {
    pub name: String,
    pub ops: Npz,
    pub dir: PathBuf,
}

impl Case {
    pub fn load(dir: &Path) -> Case {
        Case {
            name: dir.file_name().unwrap().to_string_lossy().into(),
            ops: Npz::open(&dir.join("ops.npz")),
            dir: dir.to_path_buf(),
        }
    }
    pub fn npz(&self, f: &str) -> Npz {
        Npz::open(&self.dir.join(f))
    }
    pub fn xc(&self) -> Vec<f32> {
        self.ops.f32("xc").iter().copied().collect()
    }
    pub fn ycup(&self) -> Vec<f64> {
        self.ops.f64("ycup").iter().copied().collect()
    }
}

/// Owned inputs of the first clustering.
pub struct FirstInputs {
    pub centre: Vec<u32>,
    pub tf: Array3<f32>,
    pub ic: Array2<usize>,
    pub xcup: Vec<f64>,
    pub ycup: Vec<f64>,
    pub xc: Vec<f32>,
    pub dmin: f64,
}

pub fn first_inputs(c: &Case) -> FirstInputs {
    let fi = c.npz("first_in.npz");
    let st0 = fi.f64("st0").into_dimensionality::<Ix2>().unwrap();
    FirstInputs {
        centre: st0.column(5).iter().map(|&v| v as u32).collect(),
        tf: fi.f32("tF0").into_dimensionality::<Ix3>().unwrap(),
        ic: c.ops.usize2("iC"),
        xcup: c.ops.f64("xcup").iter().copied().collect(),
        ycup: c.ycup(),
        xc: c.xc(),
        dmin: c.ops.scalar("dmin"),
    }
}

impl FirstInputs {
    pub fn input(&self) -> ClusterInput<'_> {
        ClusterInput {
            spike_template: &self.centre,
            tf: self.tf.view(),
            positions: Positions {
                x: &self.xcup,
                y: &self.ycup,
                x_in_f32: false,
            },
            chans: self.ic.view(),
            xc: &self.xc,
            ycup: &self.ycup,
            dmin: self.dmin,
            n_chan: self.xc.len(),
            times: None,
        }
    }
}

/// Owned inputs of the final clustering.
pub struct FinalInputs {
    pub template: Vec<u32>,
    pub times: Vec<f64>,
    pub tf: Array3<f32>,
    pub x: Vec<f64>,
    pub y: Vec<f64>,
    pub chans: Array2<usize>,
    pub xc: Vec<f32>,
    pub ycup: Vec<f64>,
    pub dmin: f64,
}

pub fn final_inputs(c: &Case) -> FinalInputs {
    let ex = c.npz("extract_out.npz");
    let st = ex.f64("st").into_dimensionality::<Ix2>().unwrap();
    let fs = c.ops.scalar("fs");
    let iu: Vec<usize> = ex.f64("iU").iter().map(|&v| v as usize).collect();
    let icc = ex.usize2("iCC");
    let xc = c.xc();
    let yc: Vec<f32> = c.ops.f32("yc").iter().copied().collect();
    FinalInputs {
        template: st.column(1).iter().map(|&v| v as u32).collect(),
        times: st.column(0).iter().map(|&v| v / fs).collect(),
        tf: ex.f32("tF").into_dimensionality::<Ix3>().unwrap(),
        x: iu.iter().map(|&s| f64::from(xc[s])).collect(),
        y: iu.iter().map(|&s| f64::from(yc[s])).collect(),
        chans: Array2::from_shape_fn((icc.nrows(), iu.len()), |(r, k)| icc[[r, iu[k]]]),
        xc,
        ycup: c.ycup(),
        dmin: c.ops.scalar("dmin"),
    }
}

impl FinalInputs {
    pub fn input(&self) -> ClusterInput<'_> {
        ClusterInput {
            spike_template: &self.template,
            tf: self.tf.view(),
            positions: Positions {
                x: &self.x,
                y: &self.y,
                x_in_f32: true,
            },
            chans: self.chans.view(),
            xc: &self.xc,
            ycup: &self.ycup,
            dmin: self.dmin,
            n_chan: self.xc.len(),
            times: Some(&self.times),
        }
    }
}
