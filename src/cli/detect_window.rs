//! `spikecube detect-window`: detection on one whitened window, writing
//! Kilosort4's fixture file names and layouts.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use ndarray::{Array1, Array2, Array3};
use spikecube::backend::{Detector, choose};
use spikecube::output::folder::StagedFolder;
use spikecube::{DetectionSettings, Geometry, Probe, UniversalTemplates, npy};

/// Flags of `detect-window`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Whitened window, .npy float32, channels × samples (row i = probe site i).
    #[arg(long)]
    window: PathBuf,
    /// Probe file (Kilosort JSON or probeinterface JSON).
    #[arg(long)]
    probe: PathBuf,
    /// Take iC.npy, iC2.npy and weigh.npy from this folder instead of computing them.
    #[arg(long)]
    neighbourhoods: Option<PathBuf>,
    /// Output folder (created; an existing one is replaced only when it is an
    /// earlier `detect-window` result).
    #[arg(long)]
    out: PathBuf,
    /// Detection threshold (Kilosort4's Th_universal).
    #[arg(allow_negative_numbers = true, long, default_value_t = 9.0)]
    th_universal: f32,
    #[command(flatten)]
    backend: super::common::BackendArg,
}

fn to_u32<D: ndarray::Dimension>(
    a: ndarray::Array<i64, D>,
    file: &str,
) -> Result<ndarray::Array<u32, D>> {
    if let Some(v) = a.iter().find(|&&v| v < 0 || v > u32::MAX as i64) {
        anyhow::bail!("{file}: holds index {v}, which cannot be a site or centre index");
    }
    Ok(a.mapv(|v| v as u32))
}

pub fn run(args: Args) -> Result<ExitCode> {
    let probe = Probe::load(&args.probe)?;
    let settings = DetectionSettings {
        th_universal: args.th_universal,
        ..DetectionSettings::default()
    };
    let x: Array2<f32> = npy::read(&args.window)?;
    let geometry = match &args.neighbourhoods {
        None => Geometry::new(&probe, &settings)?,
        Some(dir) => {
            let i_c = to_u32(npy::read::<i64, _>(&dir.join("iC.npy"))?, "iC.npy")?;
            let i_c2 = to_u32(npy::read::<i64, _>(&dir.join("iC2.npy"))?, "iC2.npy")?;
            let weigh: Array3<f32> = npy::read(&dir.join("weigh.npy"))?;
            let settings = DetectionSettings {
                nearest_chans: i_c.nrows(),
                ..settings.clone()
            };
            Geometry::with_neighbourhoods(&probe, &settings, i_c, i_c2, weigh)?
        }
    };
    let chosen = choose(args.backend.backend)?;
    tracing::info!(
        "detection on {} ({}): {}",
        chosen.backend,
        chosen.device,
        chosen.reason
    );
    let mut detector = Detector::new(&chosen, geometry, UniversalTemplates::builtin(), settings)?;
    let det = detector
        .detect(x.view(), &probe.yc)
        .with_context(|| format!("detecting in {}", args.window.display()))?;
    let g = detector.geometry();
    let staged = StagedFolder::create(&args.out, "detect-window")?;
    let dir = staged.path().to_path_buf();
    let out = |name: &str| dir.join(name);
    let n = det.len();
    let xy = Array2::from_shape_fn((n, 2), |(i, c)| {
        if c == 0 {
            det.centre[i] as i64
        } else {
            det.sample[i] as i64
        }
    });
    npy::write(&out("xy.npy"), &xy)?;
    npy::write(&out("amp.npy"), &Array1::from(det.amp.clone()))?;
    npy::write(
        &out("imax.npy"),
        &Array1::from_iter(det.imax.iter().map(|&v| v as i64)),
    )?;
    npy::write(&out("sign.npy"), &Array1::from(det.sign.clone()))?;
    npy::write(&out("adist.npy"), &det.adist_kilosort())?;
    npy::write(&out("yct.npy"), &Array1::from(det.yct.clone()))?;
    npy::write(&out("tF.npy"), &det.tf_array())?;
    npy::write(&out("xcup.npy"), &Array1::from(g.xcup.clone()))?;
    npy::write(&out("ycup.npy"), &Array1::from(g.ycup.clone()))?;
    npy::write(&out("iC.npy"), &g.i_c.mapv(|v| v as i64))?;
    npy::write(&out("iC2.npy"), &g.i_c2.mapv(|v| v as i64))?;
    npy::write(&out("weigh.npy"), &g.weigh)?;
    staged.publish(serde_json::json!({
        "program": "spikecube",
        "version": env!("CARGO_PKG_VERSION"),
        "window": args.window,
        "probe": args.probe,
        "neighbourhoods": args.neighbourhoods,
        "th_universal": args.th_universal,
        "n_detections": n,
        "backend": chosen,
    }))?;
    tracing::info!("{n} detections written to {}", args.out.display());
    Ok(ExitCode::SUCCESS)
}
