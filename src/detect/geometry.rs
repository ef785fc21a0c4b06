//! Detection geometry (Kilosort4 `spikedetect.template_centers`, `nearest_chans`
//! and the weights made in `spikedetect.run`): the grid of template centres, each
//! centre's nearest sites (`iC`), its nearest centres (`iC2`) and the spatial
//! weights (`weigh`).
//!
//! Rules (spec §4–6):
//! * Centres: per shank, rows `arange(ymin, ymax + 0.01, dmin/2)` (numpy's
//!   arithmetic, float64 from float32 inputs) and columns `linspace(xmin, xmax, n)`
//!   with `n = round_half_even((xmax − xmin)/(dminx/2)) + 1` (float32); the union of
//!   rows and of columns forms an x-major grid; a grid point is kept when its
//!   nearest site is at most `max_channel_distance` away (inclusive).
//! * Ties in the distance sorts go to the lower index (a stable sort). Kilosort4
//!   uses numpy's unstable sort, whose tie order depends on the CPU; see the spec §5.
//! * Shanks are hard boundaries (field failures BR-04, BR-06): a centre belongs to
//!   the shank of its nearest site; its `iC` holds sites of that shank only, and
//!   `nearest_chans` is lowered to the smallest shank's site count. With
//!   `separate_shanks` (the default) its `iC2` holds centres of that shank only
//!   (slots left over when the shank has fewer centres than `nearest_templates`
//!   repeat the centre itself, which leaves the neighbour max unchanged). On a
//!   single shank, or whenever each shank has at least `nearest_chans` sites and
//!   every centre's `nearest_templates` nearest centres lie on its shank, this is
//!   Kilosort4's rule exactly.

use ndarray::{Array2, Array3};
use rayon::prelude::*;

use crate::detect::settings::DetectionSettings;
use crate::error::DetectError;
use crate::probe::Probe;

/// Template centres and neighbourhoods of one probe under one set of settings.
///
/// Shapes use Kilosort4's: Nf centres, nC = `n_chans` sites per centre,
/// nC2 = `n_neighbours` centres per centre, nsz = `template_sizes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Geometry {
    /// Vertical pitch used, µm (Kilosort4's `ops['dmin']`).
    pub dmin: f64,
    /// Horizontal pitch used, µm (`ops['dminx']`).
    pub dminx: f64,
    /// Sorted unique grid columns, µm (`ops['xup']`).
    pub xup: Vec<f64>,
    /// Sorted unique grid rows, µm (`ops['yup']`).
    pub yup: Vec<f64>,
    /// Centre x, µm, Nf values in Kilosort4's order (`ops['xcup']`).
    pub xcup: Vec<f64>,
    /// Centre y, µm, Nf values (`ops['ycup']`).
    pub ycup: Vec<f64>,
    /// Shank id of each centre (the shank of its nearest site), Nf values.
    pub centre_shank: Vec<i64>,
    /// Nearest sites, nC × Nf: `i_c[[c, j]]` is the c-th nearest site of centre j (`iC`).
    pub i_c: Array2<u32>,
    /// Nearest centres, nC2 × Nf: `i_c2[[m, j]]` is the m-th nearest centre of centre j (`iC2`).
    pub i_c2: Array2<u32>,
    /// Spatial weights, nsz × nC × Nf, float32; for each (s, j) the squares sum to 1 (`weigh`).
    pub weigh: Array3<f32>,
}

impl Geometry {
    /// Number of template centres Nf.
    pub fn n_centres(&self) -> usize {
        self.xcup.len()
    }
    /// Sites per centre nC.
    pub fn n_chans(&self) -> usize {
        self.i_c.nrows()
    }
    /// Centres per neighbourhood nC2.
    pub fn n_neighbours(&self) -> usize {
        self.i_c2.nrows()
    }
    /// Number of spatial sizes nsz.
    pub fn n_sizes(&self) -> usize {
        self.weigh.shape()[0]
    }

    /// Builds centres, neighbourhoods and weights for a probe (Kilosort4's set-up
    /// in `spikedetect.run`, with the shank rule in the module docs).
    ///
    /// # Errors
    /// [`DetectError::Setting`] for invalid settings, [`DetectError::NoCentres`] when
    /// no grid point lies within `max_channel_distance` of a site.
    ///
    /// With `settings.neighbourhoods` set, iC, iC2 and weigh come from that
    /// folder ([`Geometry::with_neighbourhoods`]); a missing or unfitting file
    /// is [`DetectError::Input`] naming it.
    pub fn new(probe: &Probe, settings: &DetectionSettings) -> Result<Geometry, DetectError> {
        let Some(dir) = &settings.neighbourhoods else {
            return Geometry::computed(probe, settings);
        };
        let read_index = |name: &str| -> Result<Array2<u32>, DetectError> {
            let path = dir.join(name);
            let bad = |message: String| DetectError::Input {
                what: path.display().to_string(),
                message,
            };
            let a: Array2<i64> = crate::npy::read(&path).map_err(|e| bad(format!("{e:#}")))?;
            if let Some(v) = a.iter().find(|&&v| v < 0 || v > i64::from(u32::MAX)) {
                return Err(bad(format!(
                    "holds {v}, which is not a site or centre index"
                )));
            }
            Ok(a.mapv(|v| v as u32))
        };
        let i_c = read_index("iC.npy")?;
        let i_c2 = read_index("iC2.npy")?;
        let path = dir.join("weigh.npy");
        let weigh: Array3<f32> = crate::npy::read(&path).map_err(|e| DetectError::Input {
            what: path.display().to_string(),
            message: format!("{e:#}"),
        })?;
        let settings = DetectionSettings {
            nearest_chans: i_c.nrows(),
            neighbourhoods: None,
            ..settings.clone()
        };
        Geometry::with_neighbourhoods(probe, &settings, i_c, i_c2, weigh)
    }

    /// [`Geometry::new`] from the probe and settings alone.
    fn computed(probe: &Probe, settings: &DetectionSettings) -> Result<Geometry, DetectError> {
        settings.validate()?;
        let grid = template_centers(probe, settings)?;
        let n_sites = probe.n_sites();
        let xc: Vec<f64> = probe.xc.iter().map(|&v| v as f64).collect();
        let yc: Vec<f64> = probe.yc.iter().map(|&v| v as f64).collect();

        // Keep grid points whose nearest site is within range (inclusive).
        let max_d2 = settings.max_channel_distance * settings.max_channel_distance;
        let mut xcup = Vec::new();
        let mut ycup = Vec::new();
        let mut centre_shank = Vec::new();
        for &x in &grid.xup {
            for &y in &grid.yup {
                let (best, d2) = (0..n_sites)
                    .map(|i| (i, sq_dist(x, y, xc[i], yc[i])))
                    .fold((0, f64::INFINITY), |a, b| if b.1 < a.1 { b } else { a });
                if d2 <= max_d2 {
                    xcup.push(x);
                    ycup.push(y);
                    centre_shank.push(probe.kcoords[best]);
                }
            }
        }
        let nf = xcup.len();
        if nf == 0 {
            return Err(DetectError::NoCentres {
                max_channel_distance: settings.max_channel_distance,
            });
        }

        // nearest_chans, lowered to the smallest shank's site count.
        let mut shanks: Vec<i64> = probe.kcoords.clone();
        shanks.sort_unstable();
        shanks.dedup();
        let smallest_shank = shanks
            .iter()
            .map(|s| probe.kcoords.iter().filter(|&&k| k == *s).count())
            .min()
            .unwrap_or(n_sites);
        let nc = settings.n_chans_used(smallest_shank);
        if nc < settings.nearest_chans {
            if smallest_shank < n_sites && nc < settings.n_chans_used(n_sites) {
                tracing::warn!(
                    "nearest_chans lowered from {} to {nc}: the smallest shank has {smallest_shank} sites, and a centre's sites never cross shanks",
                    settings.nearest_chans
                );
            } else {
                tracing::info!(
                    "nearest_chans lowered from {} to {nc}, the number of sites",
                    settings.nearest_chans
                );
            }
        }

        // The k nearest by (squared distance, index): a total order, so the
        // k smallest are the same whether all are sorted or only those
        // (one centre at a time, centres in parallel, for a fast start-up).
        fn nearest(mut d: Vec<(f64, usize)>, k: usize) -> Vec<(f64, usize)> {
            let order =
                |a: &(f64, usize), b: &(f64, usize)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
            if k < d.len() {
                d.select_nth_unstable_by(k, order);
                d.truncate(k);
            }
            d.sort_by(order);
            d
        }
        let mut i_c = Array2::<u32>::zeros((nc, nf));
        let mut ds = Array2::<f64>::zeros((nc, nf));
        let near_sites: Vec<Vec<(f64, usize)>> = (0..nf)
            .into_par_iter()
            .map(|j| {
                let d: Vec<(f64, usize)> = (0..n_sites)
                    .filter(|&i| probe.kcoords[i] == centre_shank[j])
                    .map(|i| (sq_dist(xcup[j], ycup[j], xc[i], yc[i]), i))
                    .collect();
                nearest(d, nc)
            })
            .collect();
        for (j, d) in near_sites.iter().enumerate() {
            for c in 0..nc {
                i_c[[c, j]] = d[c].1 as u32;
                ds[[c, j]] = d[c].0;
            }
        }

        let nc2 = settings.nearest_templates.min(nf);
        let mut i_c2 = Array2::<u32>::zeros((nc2, nf));
        let near_centres: Vec<Vec<(f64, usize)>> = (0..nf)
            .into_par_iter()
            .map(|j| {
                let d: Vec<(f64, usize)> = (0..nf)
                    .filter(|&m| !settings.separate_shanks || centre_shank[m] == centre_shank[j])
                    .map(|m| (sq_dist(xcup[j], ycup[j], xcup[m], ycup[m]), m))
                    .collect();
                nearest(d, nc2)
            })
            .collect();
        for (j, d) in near_centres.iter().enumerate() {
            for m in 0..nc2 {
                i_c2[[m, j]] = d.get(m).map_or(j, |e| e.1) as u32;
            }
        }

        let weigh = spatial_weights(&ds, settings);
        Ok(Geometry {
            dmin: grid.dmin,
            dminx: settings.dminx,
            xup: grid.xup,
            yup: grid.yup,
            xcup,
            ycup,
            centre_shank,
            i_c,
            i_c2,
            weigh,
        })
    }

    /// Builds a geometry from Kilosort4's own `iC`, `iC2` and `weigh` (for a
    /// bit-exact comparison, spec §5), with centre positions from `template_centers`.
    ///
    /// # Errors
    /// [`DetectError::Input`] when the arrays' shapes disagree with each other, with
    /// the probe or with the centre grid, or an index is out of range.
    pub fn with_neighbourhoods(
        probe: &Probe,
        settings: &DetectionSettings,
        i_c: Array2<u32>,
        i_c2: Array2<u32>,
        weigh: Array3<f32>,
    ) -> Result<Geometry, DetectError> {
        let mut g = Geometry::computed(probe, settings)?;
        let nf = i_c.ncols();
        let bad = |what: &str, message: String| DetectError::Input {
            what: what.to_owned(),
            message,
        };
        if nf != g.n_centres() {
            return Err(bad(
                "iC.npy",
                format!(
                    "has {nf} columns (template centres) but this probe and these settings give {} centres",
                    g.n_centres()
                ),
            ));
        }
        if i_c.nrows() == 0 || i_c.iter().any(|&c| c as usize >= probe.n_sites()) {
            return Err(bad(
                "iC.npy",
                format!(
                    "must hold site indices below {} in at least one row",
                    probe.n_sites()
                ),
            ));
        }
        if i_c2.ncols() != nf || i_c2.nrows() == 0 || i_c2.iter().any(|&m| m as usize >= nf) {
            return Err(bad(
                "iC2.npy",
                format!(
                    "has shape {:?}; expected (nC2, {nf}) with centre indices below {nf}",
                    i_c2.shape()
                ),
            ));
        }
        if weigh.shape()[1..] != [i_c.nrows(), nf] || weigh.shape()[0] != settings.template_sizes {
            return Err(bad(
                "weigh.npy",
                format!(
                    "has shape {:?}; expected ({}, {}, {nf}) (template_sizes, nearest_chans, centres)",
                    weigh.shape(),
                    settings.template_sizes,
                    i_c.nrows()
                ),
            ));
        }
        g.i_c = i_c;
        g.i_c2 = i_c2;
        g.weigh = weigh;
        Ok(g)
    }
}

/// The unfiltered centre grid of `template_centers`.
#[derive(Debug, Clone, PartialEq)]
pub struct CentreGrid {
    /// Vertical pitch used, µm.
    pub dmin: f64,
    /// Sorted unique columns, µm.
    pub xup: Vec<f64>,
    /// Sorted unique rows, µm.
    pub yup: Vec<f64>,
}

/// Kilosort4's `template_centers`: the grid rows `yup` and columns `xup` (µm),
/// built per shank and merged (spec §4, steps 1–3).
///
/// # Errors
/// [`DetectError::Setting`] when the derived or given spacing is not positive.
pub fn template_centers(
    probe: &Probe,
    settings: &DetectionSettings,
) -> Result<CentreGrid, DetectError> {
    // dmin: numpy median of the float32 differences of the unique depths.
    // The step of the rows is dmin/2, in float32 when dmin was derived (float32
    // arithmetic in Kilosort4), in float64 when the user gave it.
    let (dmin, half_step): (f64, Step) = match settings.dmin {
        Some(d) => (d, Step::F64(d / 2.0)),
        None => {
            let mut ys = probe.yc.clone();
            ys.sort_by(f32::total_cmp);
            ys.dedup();
            if ys.len() < 2 {
                (1.0, Step::F64(0.5))
            } else {
                let mut diffs: Vec<f32> = ys.windows(2).map(|w| w[1] - w[0]).collect();
                diffs.sort_by(f32::total_cmp);
                let n = diffs.len();
                let med = if n % 2 == 1 {
                    diffs[n / 2]
                } else {
                    (diffs[n / 2 - 1] + diffs[n / 2]) / 2.0
                };
                (med as f64, Step::F32(med / 2.0))
            }
        }
    };
    let step = half_step.value();
    if !(step.is_finite() && step > 0.0) {
        return Err(DetectError::Setting {
            name: "dmin",
            message: format!("the vertical centre spacing dmin/2 = {step} µm is not positive"),
        });
    }
    let mut shanks = probe.kcoords.clone();
    shanks.sort_unstable();
    shanks.dedup();
    let mut xup = Vec::new();
    let mut yup = Vec::new();
    for s in shanks {
        let idx: Vec<usize> = (0..probe.n_sites())
            .filter(|&i| probe.kcoords[i] == s)
            .collect();
        let fold = |v: &[f32]| {
            idx.iter()
                .map(|&i| v[i])
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| {
                    (lo.min(x), hi.max(x))
                })
        };
        let (x0, x1) = fold(&probe.xc);
        let (y0, y1) = fold(&probe.yc);
        yup.extend(numpy_arange(y0, y1 + 0.01f32, half_step)?);
        let n = round_half_even(((x1 - x0) / (settings.dminx / 2.0) as f32) as f64) as i64 + 1;
        xup.extend(numpy_linspace_f32(x0, x1, n.max(0) as usize));
    }
    for v in [&mut xup, &mut yup] {
        v.sort_by(f64::total_cmp);
        v.dedup();
    }
    Ok(CentreGrid { dmin, xup, yup })
}

/// The row step dmin/2 with the precision Kilosort4 computes it in.
#[derive(Debug, Clone, Copy)]
enum Step {
    F32(f32),
    F64(f64),
}

impl Step {
    fn value(self) -> f64 {
        match self {
            Step::F32(v) => v as f64,
            Step::F64(v) => v,
        }
    }
}

/// numpy's `arange(start, stop, step)` with float32 `start`/`stop`: float64 output,
/// length `ceil((stop − start)/step)`, values `start + i·δ` with
/// `δ = (start + step) − start` (the second element computed in the step's precision).
fn numpy_arange(start: f32, stop: f32, step: Step) -> Result<Vec<f64>, DetectError> {
    let (s0, s1) = (start as f64, stop as f64);
    let len = ((s1 - s0) / step.value()).ceil();
    if !(len.is_finite()) || len > 1e7 {
        return Err(DetectError::Setting {
            name: "dmin",
            message: format!(
                "rows from {start} to {stop} µm every {} µm would make {len} template rows; check the probe's units (µm) and dmin",
                step.value()
            ),
        });
    }
    let len = len.max(0.0) as usize;
    let second = match step {
        Step::F32(v) => (start + v) as f64,
        Step::F64(v) => s0 + v,
    };
    let delta = second - s0;
    Ok((0..len)
        .map(|i| match i {
            0 => s0,
            1 => second,
            _ => s0 + i as f64 * delta,
        })
        .collect())
}

/// numpy's `linspace(start, stop, num)` for float32 inputs: float32 arithmetic,
/// `start + i·step` with `step = (stop − start)/(num − 1)`, the last value `stop`.
fn numpy_linspace_f32(start: f32, stop: f32, num: usize) -> Vec<f64> {
    if num == 0 {
        return Vec::new();
    }
    if num == 1 {
        return vec![start as f64];
    }
    let div = (num - 1) as f32;
    let delta = stop - start;
    let step = delta / div;
    let mut v: Vec<f64> = (0..num)
        .map(|i| {
            let y = if step == 0.0 {
                (i as f32 / div) * delta
            } else {
                i as f32 * step
            };
            (y + start) as f64
        })
        .collect();
    v[num - 1] = stop as f64;
    v
}

/// Round half to even, as numpy's `round`.
pub fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 {
        2.0 * (x / 2.0).round()
    } else {
        r
    }
}

fn sq_dist(x0: f64, y0: f64, x1: f64, y1: f64) -> f64 {
    let dy = y0 - y1;
    let dx = x0 - x1;
    dy * dy + dx * dx
}

/// Spatial weights (spec §6): `exp(−d²/σ_s²)` in float32 with
/// σ_s = `min_template_size`·(s+1) µm, normalised so the squares over the nC sites
/// sum to 1. `ds` holds squared distances, µm², nC × Nf.
///
/// Where the squared weights underflow (a site layout much sparser than the sizes,
/// field failure BR-03), Kilosort4 divides 0 by 0 or by a denormal; here the same
/// Gaussian is then evaluated relative to the nearest site instead, which is
/// mathematically equal and never NaN. With the default `max_channel_distance`
/// (32 µm) this never happens.
pub fn spatial_weights(ds: &Array2<f64>, settings: &DetectionSettings) -> Array3<f32> {
    let (nc, nf) = ds.dim();
    let nsz = settings.template_sizes;
    let mut w = Array3::<f32>::zeros((nsz, nc, nf));
    for s in 0..nsz {
        let sigma = (settings.min_template_size * (s + 1) as f64) as f32;
        let sig2 = sigma * sigma;
        for j in 0..nf {
            let raw: Vec<f32> = (0..nc)
                .map(|c| (-(ds[[c, j]] as f32) / sig2).exp())
                .collect();
            let sum2 = raw.iter().map(|v| v * v).sum::<f32>();
            let norm = sum2.sqrt();
            // Kilosort4's formula whenever its sum of squares is a normal float32.
            if sum2 >= f32::MIN_POSITIVE && sum2.is_finite() {
                for c in 0..nc {
                    w[[s, c, j]] = raw[c] / norm;
                }
            } else {
                let d0 = (0..nc)
                    .map(|c| ds[[c, j]] as f32)
                    .fold(f32::INFINITY, f32::min);
                let rel: Vec<f32> = (0..nc)
                    .map(|c| (-(ds[[c, j]] as f32 - d0) / sig2).exp())
                    .collect();
                let norm = rel.iter().map(|v| v * v).sum::<f32>().sqrt();
                for c in 0..nc {
                    w[[s, c, j]] = rel[c] / norm;
                }
            }
        }
    }
    w
}
