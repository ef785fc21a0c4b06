//! Writes the windows spikecube's second (drift-corrected) detection pass
//! detects in, for comparisons with Kilosort4's (`benches/drift_ties.py`
//! reads them). Not a timing: a bench target only so that it builds with the
//! library and needs no command-line flag in the product.
//!
//! Each window is made as `detect --drift-mode kilosort` makes it: read with
//! Kilosort4's edge handling, channel means, median CAR and high-pass
//! (`Preprocessor::filter_only`), then `G_b = M_b·W`
//! (`DriftCorrection::window_whitening`, Kilosort4's kernel extrapolation at
//! the probe's ends) in place of W, with W fitted as `detect` fits it and
//! `dshift`/`yblk` read from a `detect` run's `drift.npy`/`drift_blocks.npy`.
//!
//! Usage: `cargo bench --no-default-features --bench drift_windows -- REC.bin
//! PROBE.json DETECT_OUT BATCH_SIZE DEST` (the SpikeGLX recording, its probe,
//! the `detect` output folder, Kilosort4's batch_size; writes `sc_X_<b>.npy`,
//! float32 sites × (batch_size + 2·nt), into DEST). Settings as
//! `detect --scale 1 --mask-clipped false` (no other input correction).
//! `fit REC.bin PROBE.json - BATCH_SIZE -` only opens the recording and fits
//! the whitening, as `detect` does, and exits (for timing).
//! DETECT_OUT `-` writes the first pass's windows (W·X, no correction).
//! DETECT_OUT may be any folder holding `drift.npy` and `drift_blocks.npy`,
//! e.g. one written by the `estimate` mode (below) from Kilosort4's `st0`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use ndarray::{Array1, Array2};
use spikecube::drift::DriftCorrection;
use spikecube::pipeline::{InputRequest, fit_whitening_for, open_for_detection};
use spikecube::preprocess::{PreprocessSettings, Preprocessor};
use spikecube::recording::{OpenOptions, read_window};

/// `estimate ST0.npy PROBE.json N_WINDOWS DEST`: spikecube's drift estimate
/// (`--drift-mode kilosort`, nblocks 1) from Kilosort4's first-pass `st0`
/// (float64 n × ≥ 5: columns 1 y µm, 2 amplitude, 4 batch), written as
/// `drift.npy` / `drift_blocks.npy` into DEST (which the window mode reads).
fn estimate_from_st0(args: &[String]) -> Result<()> {
    let [st0, probe, n_windows, dest] = args else {
        anyhow::bail!("usage: drift_windows estimate ST0.npy PROBE.json N_WINDOWS DEST");
    };
    let st0: Array2<f64> = spikecube::npy::read(std::path::Path::new(st0))?;
    let probe = spikecube::Probe::load(std::path::Path::new(probe))?;
    let spikes = spikecube::drift::estimate::FirstPassSpikes {
        y: st0.column(1).iter().map(|&v| v as f32).collect(),
        amp: st0.column(2).iter().map(|&v| v as f32).collect(),
        batch: st0.column(4).iter().map(|&v| v as u32).collect(),
        sample: vec![0; st0.nrows()],
    };
    let settings = spikecube::drift::DriftSettings {
        mode: spikecube::drift::DriftMode::Kilosort,
        ..spikecube::drift::DriftSettings::default()
    };
    let est = spikecube::drift::estimate(
        &spikes,
        &probe,
        &settings,
        9.0,
        n_windows.parse()?,
        &mut |w| eprintln!("warning: {w}"),
    )?;
    let spikecube::drift::Estimated::Drift(e) = est else {
        anyhow::bail!("no drift estimate");
    };
    let dest = PathBuf::from(dest);
    std::fs::create_dir_all(&dest)?;
    spikecube::npy::write(&dest.join("drift.npy"), &e.dshift)?;
    spikecube::npy::write(
        &dest.join("drift_blocks.npy"),
        &Array1::from(e.yblk.clone()),
    )?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if args.first().is_some_and(|a| a == "estimate") {
        return estimate_from_st0(&args[1..]);
    }
    let fit_only = args.first().is_some_and(|a| a == "fit");
    let args: &[String] = if fit_only { &args[1..] } else { &args[..] };
    let [rec, probe, det, batch, dest] = args else {
        anyhow::bail!("usage: drift_windows REC.bin PROBE.json DETECT_OUT BATCH_SIZE DEST");
    };
    let req = InputRequest {
        paths: vec![PathBuf::from(rec)],
        open: OpenOptions {
            // `detect`'s default (automatic scale) for `fit`, else `--scale 1`.
            scale: (!fit_only).then_some(1.0),
            ..OpenOptions::default()
        },
        probe: Some(spikecube::Probe::load(std::path::Path::new(probe))?),
        probe_hint: "PROBE.json",
        ..InputRequest::default()
    };
    let (opened, probe, checks) = open_for_detection(&req)?;
    let settings = PreprocessSettings {
        batch_size: batch.parse().context("BATCH_SIZE")?,
        ..PreprocessSettings::default()
    };
    let fit = fit_whitening_for(&opened.recording, &probe, &settings, &checks)?;
    if fit_only {
        // `fit …`: the whitening fit of a `detect` run alone (opening, checks,
        // fit), the part of a run that the drift step does not repeat; timed
        // as a whole process for the drift step's cost (docs/benchmarks-history.md).
        eprintln!("fit: W is {:?}", fit.whitening.dim());
        return Ok(());
    }
    let pre = Preprocessor::new(&fit.settings, fit.whitening.clone())?;
    // DETECT_OUT "-": the first pass's windows (W, no correction).
    let corr = if det == "-" {
        None
    } else {
        let det = PathBuf::from(det);
        let dshift: Array2<f64> = spikecube::npy::read(&det.join("drift.npy"))?;
        let yblk: Array1<f64> = spikecube::npy::read(&det.join("drift_blocks.npy"))?;
        Some(
            DriftCorrection::new(&probe.xc, &probe.yc, dshift, yblk.to_vec(), 20.0)?
                .with_zero_outside(None),
        )
    };
    let dest = PathBuf::from(dest);
    std::fs::create_dir_all(&dest)?;
    let plan = fit.plan;
    for b in 0..plan.n_windows {
        let mut x = Array2::zeros((probe.n_sites(), plan.window_len()));
        read_window(opened.recording.as_ref(), &plan, b, &probe.chan_map, &mut x)?;
        match &corr {
            Some(corr) => {
                pre.filter_only(&mut x)?;
                corr.window_whitening(b, pre.whitening())?.apply(&mut x)?;
            }
            None => pre.apply(&mut x)?,
        }
        spikecube::npy::write(&dest.join(format!("sc_X_{b}.npy")), &x)?;
    }
    eprintln!("{} windows written to {}", plan.n_windows, dest.display());
    Ok(())
}
