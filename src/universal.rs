//! Which universal templates (wTEMP, wPCA) a run detects with: learned from the
//! recording (Kilosort4's default, `templates_from_data = True`, see
//! [`crate::detect::learn`]), Kilosort4's built-in ones, or a file; and the
//! files that record the choice in the output folder (`wTEMP.npy`, `wPCA.npy`,
//! `templates.png`, `"templates"` in `spikecube.json`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ndarray::Array2;

use crate::detect::UniversalTemplates;
use crate::detect::learn::{LEARN_NSKIP, LearnSettings, learn_from_windows};

/// Where a run's universal templates come from.
#[derive(Debug, Clone)]
pub enum TemplateSource {
    /// Learned from every 25th whitened window (Kilosort4's default);
    /// built-in ones when too few isolated peaks are found.
    Learned(LearnSettings),
    /// Kilosort4's built-in templates (`templates_from_data = False`).
    Builtin,
    /// Read from a file ([`load_npz`]).
    File {
        /// The file.
        path: PathBuf,
        /// Its templates.
        templates: UniversalTemplates,
    },
}

/// The template settings as a user gives them: `detect`'s flags
/// (`--templates-from-data`, `--th-single-ch`, `--seed`, `--min-learn-clips`,
/// `--template-check`, `--templates`) and, by Kilosort4's names where it has
/// them, the Python package's. [`TemplateChoice::source`] turns them into a
/// [`TemplateSource`] for a detector's settings.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateChoice {
    /// Learn the templates from the recording (`None`: yes, unless `templates`
    /// names a file); false: Kilosort4's built-in ones.
    pub templates_from_data: Option<bool>,
    /// Threshold of the single-channel peaks learned from, whitened units.
    #[serde(rename = "Th_single_ch")]
    pub th_single_ch: f32,
    /// Seed of the learning's k-means++ draws.
    pub seed: u64,
    /// Fewer isolated clips than this: the built-in templates, with a warning.
    pub min_learn_clips: usize,
    /// Check each learned template for its peak at `nt0min` (realign or
    /// replace one off centre); false keeps them as learned (Kilosort4).
    pub template_check: bool,
    /// wTEMP and wPCA from this `.npz` file instead of learning them.
    pub templates: Option<PathBuf>,
}

impl TemplateChoice {
    /// The source for a detector with `det`'s `n_templates`, `n_pcs` and `nt`
    /// (a file's templates are read and checked now).
    ///
    /// # Errors
    /// A file given with `templates_from_data` true (two sources), or one that
    /// cannot be read or does not fit ([`load_npz`]).
    pub fn source(&self, det: &crate::DetectionSettings) -> Result<TemplateSource> {
        if let (Some(path), Some(true)) = (&self.templates, self.templates_from_data) {
            bail!(
                "--templates {} and --templates-from-data true ask for two template sources: give one",
                path.display()
            );
        }
        Ok(if let Some(path) = &self.templates {
            TemplateSource::File {
                path: std::fs::canonicalize(path).unwrap_or_else(|_| path.clone()),
                templates: load_npz(path, det.n_templates, det.n_pcs, det.nt)?,
            }
        } else if self.templates_from_data.unwrap_or(true) {
            TemplateSource::Learned(LearnSettings {
                th_single_ch: self.th_single_ch,
                n_templates: det.n_templates,
                n_pcs: det.n_pcs,
                seed: self.seed,
                min_clips: self.min_learn_clips,
                template_check: self.template_check,
                ..LearnSettings::default()
            })
        } else {
            TemplateSource::Builtin
        })
    }
}

/// The templates a run uses, with what to record about them.
#[derive(Debug, Clone)]
pub struct ChosenTemplates {
    /// wTEMP (n_templates × nt) and wPCA (n_pcs × nt).
    pub templates: UniversalTemplates,
    /// `"templates"` of `spikecube.json`: `source` (`learned`, `builtin`, `file`)
    /// and its details.
    pub description: serde_json::Value,
    /// Why learned templates could not be used, when so.
    pub warning: Option<String>,
    /// Wall seconds of the learning's parts (windows, wPCA, wTEMP; zeros
    /// when not learned), for the timings of `spikecube.json`.
    pub seconds: [f64; 3],
}

/// Reads `wTEMP` and `wPCA` from a `.npz` file in Kilosort4's `wTEMP.npz`
/// layout (float32 or float64 arrays, n_templates × nt and n_pcs × nt; the
/// file `np.savez` or `np.savez_compressed` writes) and checks them against the
/// detector: `n_templates` rows of `nt` samples in wTEMP, at least `n_pcs` rows
/// in wPCA, finite values.
///
/// # Errors
/// Naming the file: it cannot be read, lacks a key, or the shapes or values do
/// not fit.
pub fn load_npz(
    path: &Path,
    n_templates: usize,
    n_pcs: usize,
    nt: usize,
) -> Result<UniversalTemplates> {
    use ndarray_npy::NpzReader;
    let f = std::fs::File::open(path)
        .with_context(|| format!("--templates {}: cannot open the file", path.display()))?;
    let mut npz = NpzReader::new(f).with_context(|| {
        format!(
            "--templates {}: not an .npz file (np.savez or np.savez_compressed)",
            path.display()
        )
    })?;
    let mut read = |key: &str| -> Result<Array2<f32>> {
        if let Ok(a) = npz.by_name::<ndarray::OwnedRepr<f32>, ndarray::Ix2>(key) {
            return Ok(a);
        }
        let b: Array2<f64> = npz.by_name(key).with_context(|| {
            format!(
                "--templates {}: no 2-D float32 or float64 array `{key}` (Kilosort4's wTEMP.npz holds wTEMP and wPCA)",
                path.display()
            )
        })?;
        Ok(b.mapv(|v| v as f32))
    };
    let wtemp = read("wTEMP")?;
    let wpca = read("wPCA")?;
    if wtemp.dim() != (n_templates, nt) {
        bail!(
            "--templates {}: wTEMP is {} × {}; the detector needs n_templates × nt = {n_templates} × {nt}",
            path.display(),
            wtemp.nrows(),
            wtemp.ncols()
        );
    }
    if wpca.ncols() != nt || wpca.nrows() < n_pcs {
        bail!(
            "--templates {}: wPCA is {} × {}; the features need at least n_pcs × nt = {n_pcs} × {nt}",
            path.display(),
            wpca.nrows(),
            wpca.ncols()
        );
    }
    if wtemp.iter().chain(wpca.iter()).any(|v| !v.is_finite()) {
        bail!(
            "--templates {}: wTEMP or wPCA holds a non-finite value",
            path.display()
        );
    }
    // An all-zero row detects nothing (wTEMP) or gives a zero feature (wPCA):
    // a file written wrong, which would otherwise look like bad data.
    for (name, m, rows) in [("wTEMP", &wtemp, n_templates), ("wPCA", &wpca, n_pcs)] {
        let zero: Vec<usize> = (0..rows)
            .filter(|&r| m.row(r).iter().all(|&v| v == 0.0))
            .collect();
        if !zero.is_empty() {
            bail!(
                "--templates {}: {name} row{} {} {} all zeros; each template must be a waveform (unit norm, as Kilosort4's)",
                path.display(),
                if zero.len() == 1 { "" } else { "s" },
                zero.iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                if zero.len() == 1 { "is" } else { "are" }
            );
        }
    }
    Ok(UniversalTemplates {
        wtemp,
        wpca: wpca.slice(ndarray::s![..n_pcs, ..]).to_owned(),
    })
}

/// Chooses the run's templates. For [`TemplateSource::Learned`], `window(j)`
/// must return the whitened window j exactly as detection sees it; it is called
/// for j = 0, 25, 50, … < `n_windows`, a few at a time from rayon's threads
/// ([`crate::detect::learn::learn_from_windows`]). With fewer isolated clips than
/// [`LearnSettings::min_clips`] the built-in templates are used and
/// [`ChosenTemplates::warning`] says why.
///
/// # Errors
/// Whatever `window` returns; invalid learning settings; a failed SVD.
pub fn choose(
    source: &TemplateSource,
    n_windows: u64,
    nt: usize,
    nt0min: usize,
    window: impl Fn(u64) -> Result<Array2<f32>> + Sync,
) -> Result<ChosenTemplates> {
    choose_with(source, nt0min, |settings| {
        learn_from_windows(n_windows, nt, nt0min, settings, window)
    })
}

/// [`choose`] with the learning done by `learn` (called only for
/// [`TemplateSource::Learned`], with its settings): e.g.
/// [`crate::detect::learn::learn_from_clips`] on windows a GPU preprocessed.
///
/// # Errors
/// Whatever `learn` returns.
pub fn choose_with(
    source: &TemplateSource,
    nt0min: usize,
    learn: impl FnOnce(&LearnSettings) -> Result<crate::detect::learn::Learned>,
) -> Result<ChosenTemplates> {
    Ok(match source {
        TemplateSource::Builtin => ChosenTemplates {
            templates: UniversalTemplates::builtin(),
            description: serde_json::json!({"source": "builtin"}),
            warning: None,
            seconds: [0.0; 3],
        },
        TemplateSource::File { path, templates } => ChosenTemplates {
            templates: templates.clone(),
            description: serde_json::json!({"source": "file", "path": path}),
            warning: None,
            seconds: [0.0; 3],
        },
        TemplateSource::Learned(settings) => {
            let learned = learn(settings)?;
            let details = serde_json::json!({
                "n_clips": learned.n_clips,
                "n_windows": learned.n_windows,
                "windows_read": learned.windows_read,
                "every_nth_window": LEARN_NSKIP,
                "min_clips": learned.min_clips,
                "seed": settings.seed,
                "learn_settings": settings,
                "kmeans_inertia": learned.inertia,
                "template_check": {
                    "on": settings.template_check,
                    "peak_tolerance_samples": crate::detect::template_check::PEAK_TOLERANCE,
                    "nt0min": nt0min,
                    "off_centre": learned.template_findings,
                },
            });
            let check_warning = (!learned.template_findings.is_empty()).then(|| {
                learned
                    .template_findings
                    .iter()
                    .map(|f| f.describe(settings.n_templates))
                    .collect::<Vec<_>>()
                    .join("; ")
            });
            match learned.templates {
                Some(t) => {
                    tracing::info!(
                        "universal templates learned from {} isolated peaks in {} (seed {})",
                        learned.n_clips,
                        crate::error::count(learned.n_windows, "window"),
                        settings.seed
                    );
                    let mut d = details;
                    d["source"] = "learned".into();
                    ChosenTemplates {
                        templates: t,
                        description: d,
                        warning: check_warning,
                        seconds: learned.seconds,
                    }
                }
                None => {
                    let why = format!(
                        "only {} isolated single-channel peaks (|x| > Th_single_ch = {}, alone within ±6 sites and ±30 samples) in {} of every {LEARN_NSKIP}th; learning templates needs at least {} (--min-learn-clips): detecting with the built-in universal templates instead (as --templates-from-data false)",
                        learned.n_clips,
                        settings.th_single_ch,
                        crate::error::count(learned.windows_read, "window"),
                        learned.min_clips
                    );
                    let mut d = details;
                    d["source"] = "builtin".into();
                    d["fallback_from_learned"] = why.clone().into();
                    ChosenTemplates {
                        templates: UniversalTemplates::builtin(),
                        description: d,
                        warning: Some(why),
                        seconds: learned.seconds,
                    }
                }
            }
        }
    })
}

/// Writes `wTEMP.npy`, `wPCA.npy` (float32) and `templates.png` into `dir`.
///
/// # Errors
/// When a file cannot be written (its path is named).
pub fn write_outputs(dir: &Path, chosen: &ChosenTemplates) -> Result<()> {
    use ndarray_npy::WriteNpyExt;
    for (name, a) in [
        ("wTEMP.npy", &chosen.templates.wtemp),
        ("wPCA.npy", &chosen.templates.wpca),
    ] {
        let p = dir.join(name);
        let f =
            std::fs::File::create(&p).with_context(|| format!("cannot write {}", p.display()))?;
        a.as_standard_layout()
            .write_npy(std::io::BufWriter::new(f))
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    let source = chosen.description["source"].as_str().unwrap_or("?");
    let title = match source {
        "learned" => format!(
            "wTEMP learned from {} clips (seed {})",
            chosen.description["n_clips"], chosen.description["seed"]
        ),
        "file" => "wTEMP from a file".to_string(),
        _ => "wTEMP: Kilosort4's built-in templates".to_string(),
    };
    draw(&dir.join("templates.png"), &chosen.templates.wtemp, &title)
}

/// The temporal templates, one line each, against the sample (0 … nt − 1).
fn draw(path: &Path, wtemp: &Array2<f32>, title: &str) -> Result<()> {
    use crate::output::plot;
    use plotters::prelude::*;
    plot::register_font()?;
    let (w, h) = (800u32, 500u32);
    let nt = wtemp.ncols();
    let lim = wtemp.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6) as f64 * 1.05;
    let err = plot::plot_err(path);
    let mut buf = vec![255u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, (plot::FONT, plot::fitting_size(title, 760.0, 24.0)))
            .margin(15)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..(nt - 1) as f64, -lim..lim)
            .map_err(&err)?;
        // Kilosort4's nt0min for this length (20 of 61): where a spike's trough sits.
        let nt0min = 20 * nt / 61;
        let x_desc = format!(
            "sample of the template (trough at nt0min = {nt0min}, grey line; 30 samples = 1 ms at 30 kHz)"
        );
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc("weight (unit L2 norm per template)")
            .label_style((plot::FONT, 16))
            .axis_desc_style((plot::FONT, 18))
            .light_line_style(WHITE)
            .bold_line_style(BLACK.mix(0.08))
            .x_label_formatter(&plot::tick_text)
            .y_label_formatter(&plot::tick_text)
            .draw()
            .map_err(&err)?;
        for (k, row) in wtemp.rows().into_iter().enumerate() {
            let c = plot::category_colour(k);
            chart
                .draw_series(std::iter::once(PathElement::new(
                    row.iter()
                        .enumerate()
                        .map(|(t, &v)| (t as f64, v as f64))
                        .collect::<Vec<_>>(),
                    c.stroke_width(2),
                )))
                .map_err(&err)?
                .label(format!("wTEMP row {k}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3))
                });
        }
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(nt0min as f64, -lim), (nt0min as f64, lim)],
                BLACK.mix(0.35).stroke_width(1),
            )))
            .map_err(&err)?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .label_font((plot::FONT, 14))
            .draw()
            .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    plot::save_png(path, buf, w, h)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, wtemp: &Array2<f32>, wpca: &Array2<f32>) {
        let mut npz = ndarray_npy::NpzWriter::new(std::fs::File::create(path).unwrap());
        npz.add_array("wTEMP", wtemp).unwrap();
        npz.add_array("wPCA", wpca).unwrap();
        npz.finish().unwrap();
    }

    #[test]
    fn all_zero_template_rows_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.npz");
        let ok = Array2::from_shape_fn((6, 61), |(k, t)| ((k + 1) * (t + 3) % 7) as f32 - 3.0);
        write(&path, &ok, &ok);
        assert!(load_npz(&path, 6, 6, 61).is_ok());
        let mut zero = ok.clone();
        zero.row_mut(2).fill(0.0);
        zero.row_mut(4).fill(0.0);
        write(&path, &zero, &ok);
        let e = format!("{:#}", load_npz(&path, 6, 6, 61).err().unwrap());
        assert!(e.contains("wTEMP rows 2, 4 are all zeros"), "{e}");
        write(&path, &ok, &Array2::zeros((6, 61)));
        let e = format!("{:#}", load_npz(&path, 6, 6, 61).err().unwrap());
        assert!(
            e.contains("wPCA rows 0, 1, 2, 3, 4, 5 are all zeros"),
            "{e}"
        );
        // np.savez_compressed's files load too (deflated members).
        let zipped = dir.path().join("z.npz");
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&zipped).unwrap());
        let deflated = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        for name in ["wTEMP.npy", "wPCA.npy"] {
            use ndarray_npy::WriteNpyExt;
            zip.start_file(name, deflated).unwrap();
            let mut bytes = Vec::new();
            ok.write_npy(&mut bytes).unwrap();
            std::io::Write::write_all(&mut zip, &bytes).unwrap();
        }
        zip.finish().unwrap();
        assert!(load_npz(&zipped, 6, 6, 61).is_ok());
        // Rows of wPCA past n_pcs are not used, so not checked.
        let mut tail = ok.clone();
        tail.row_mut(5).fill(0.0);
        write(&path, &ok, &tail);
        assert!(load_npz(&path, 6, 5, 61).is_ok());
    }
}
