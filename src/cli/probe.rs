//! `spikecube probe`: a pre-flight report on a probe layout — what detection
//! will make of it (template centres, neighbourhoods) and warnings for layouts
//! that cannot work — with an optional picture to scale.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use spikecube::detect::geometry::template_centers;
use spikecube::{DetectionSettings, Geometry, Probe};

/// Flags of `probe`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Probe file (Kilosort JSON, probeinterface JSON, .prb read as data) or a
    /// SpikeGLX recording (.bin or .meta) whose metadata holds the geometry.
    probe: PathBuf,
    /// Also draw the sites (squares) and kept template centres (dots), to
    /// scale and coloured by shank, into this PNG file.
    #[arg(long)]
    png: Option<PathBuf>,
    /// Vertical site pitch, µm (Kilosort4's dmin); derived from the probe when unset.
    #[arg(allow_negative_numbers = true, long)]
    dmin: Option<f64>,
    /// Horizontal site pitch, µm (Kilosort4's dminx).
    #[arg(allow_negative_numbers = true, long, default_value_t = 32.0)]
    dminx: f64,
    /// Sites per template centre (Kilosort4's nearest_chans).
    #[arg(long, default_value_t = 10)]
    nearest_chans: usize,
    /// Centres farther than this from every site are dropped, µm (Kilosort4's max_channel_distance).
    #[arg(allow_negative_numbers = true, long, default_value_t = 32.0)]
    max_channel_distance: f64,
}

/// Loads the probe of `path`: a probe file, a SpikeGLX `.meta`, or a SpikeGLX
/// `.bin` (its `.meta` beside it).
fn load_probe(path: &std::path::Path) -> Result<Probe> {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("bin"))
    {
        let (_, meta) = spikecube::recording::spikeglx::bin_and_meta(path);
        return Ok(Probe::load(&meta)?);
    }
    Probe::load(path).map_err(|e| {
        anyhow::anyhow!(
            "{e} (`spikecube probe` reads a probe file: Kilosort JSON, probeinterface JSON or .prb; or a SpikeGLX .bin/.meta; a flat binary recording holds no geometry: give its probe file)"
        )
    })
}

/// For a SpikeGLX recording (`.bin` with its `.meta`): the channel check that
/// `detect` runs before it starts (the windows of the whitening fit, default
/// batch size and nskip), as a warning line when it finds anything.
fn recording_check(path: &Path, probe: &Probe) -> Result<Option<String>> {
    let is_bin = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("bin"));
    if !is_bin || !path.with_extension("meta").is_file() {
        return Ok(None);
    }
    let opened = spikecube::recording::open(path, &spikecube::recording::OpenOptions::default())?;
    for w in &opened.warnings {
        tracing::warn!("{w}");
    }
    let settings = spikecube::preprocess::PreprocessSettings {
        fs: opened.recording.fs(),
        ..Default::default()
    };
    let health = spikecube::pipeline::channel_check(opened.recording.as_ref(), probe, &settings)?;
    say!(
        "channels     checked over {} samples (the windows of the whitening fit)",
        health.samples()
    );
    Ok(health.warning("the windows of the whitening fit", true))
}

/// The report's findings.
struct Report {
    lines: Vec<String>,
    warnings: Vec<String>,
}

fn report(probe: &Probe, settings: &DetectionSettings) -> (Report, Option<Geometry>) {
    let mut lines = Vec::new();
    let mut warnings = Vec::new();
    let n = probe.n_sites();
    let (x0, x1, y0, y1) = probe.extent();
    let mut shanks: BTreeMap<i64, usize> = BTreeMap::new();
    for &k in &probe.kcoords {
        *shanks.entry(k).or_default() += 1;
    }
    lines.push(format!("probe        {}", probe.source.display()));
    lines.push(format!(
        "sites        {n} (file has {} channels)",
        probe.n_chan
    ));
    lines.push(format!(
        "shanks       {} ({})",
        shanks.len(),
        shanks
            .iter()
            .map(|(k, c)| format!("id {k}: {c} sites"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    lines.push(format!("x extent     {x0} … {x1} µm ({} µm wide)", x1 - x0));
    lines.push(format!("y extent     {y0} … {y1} µm ({} µm tall)", y1 - y0));

    match template_centers(probe, settings) {
        Ok(grid) => {
            let derived = if settings.dmin.is_some() {
                "given"
            } else {
                "derived"
            };
            lines.push(format!(
                "dmin         {} µm ({derived}); dminx {} µm",
                grid.dmin, settings.dminx
            ));
            lines.push(format!(
                "centre grid  {} × {} = {} (xup × yup)",
                grid.xup.len(),
                grid.yup.len(),
                grid.xup.len() * grid.yup.len()
            ));
            let mut ys = probe.yc.clone();
            ys.sort_by(f32::total_cmp);
            ys.dedup();
            if ys.len() > 1 && grid.dmin < 2.0 {
                warnings.push(format!(
                    "the vertical pitch is {} µm: coordinates look like millimetres or site indices, not µm",
                    grid.dmin
                ));
            }
        }
        Err(e) => warnings.push(format!("no centre grid: {e}")),
    }
    let span = (x1 - x0).max(y1 - y0);
    if span > 0.0 && span < 20.0 {
        warnings.push(format!(
            "the whole probe spans {span} µm: coordinates look like millimetres, not µm"
        ));
    }
    if span > 50_000.0 {
        warnings.push(format!(
            "the probe spans {span} µm (over 5 cm): coordinates may be in nm or another unit"
        ));
    }
    let mut pos: Vec<(u32, u32, usize)> = (0..n)
        .map(|i| (probe.xc[i].to_bits(), probe.yc[i].to_bits(), i))
        .collect();
    pos.sort_unstable();
    let dups: Vec<String> = pos
        .windows(2)
        .filter(|w| w[0].0 == w[1].0 && w[0].1 == w[1].1)
        .map(|w| {
            format!(
                "sites {} and {} at ({}, {})",
                w[0].2, w[1].2, probe.xc[w[0].2], probe.yc[w[0].2]
            )
        })
        .collect();
    if !dups.is_empty() {
        warnings.push(format!(
            "{} duplicate site positions: {}{}",
            dups.len(),
            dups.iter().take(5).cloned().collect::<Vec<_>>().join("; "),
            if dups.len() > 5 { "; …" } else { "" }
        ));
    }
    let small: Vec<String> = shanks
        .iter()
        .filter(|&(_, &c)| c < settings.nearest_chans)
        .map(|(k, c)| format!("shank {k} has {c} sites"))
        .collect();
    // On a single shank this is Kilosort4's own clamp to the site count, not a problem.
    if !small.is_empty() && shanks.len() > 1 {
        let fewest = shanks.values().min().copied().unwrap_or(0);
        warnings.push(format!(
            "{}, fewer than nearest_chans = {}: since centres never take sites from another shank, every centre uses {fewest} sites",
            small.join("; "),
            settings.nearest_chans
        ));
    }
    let geometry = match Geometry::new(probe, settings) {
        Ok(g) => {
            let grid_n = g.xup.len() * g.yup.len();
            lines.push(format!(
                "centres      {} kept, {} dropped (farther than max_channel_distance = {} µm from every site)",
                g.n_centres(),
                grid_n - g.n_centres(),
                settings.max_channel_distance
            ));
            lines.push(format!(
                "neighbours   nearest_chans {} sites per centre (asked {}), nearest_templates {} centres",
                g.n_chans(),
                settings.nearest_chans,
                g.n_neighbours()
            ));
            Some(g)
        }
        Err(e) => {
            warnings.push(format!("detection cannot run on this layout: {e}"));
            None
        }
    };
    (Report { lines, warnings }, geometry)
}

/// Draws sites (squares, coloured by shank, with their channel numbers: every
/// site up to 64 sites, else every 10th) and template centres (dots) to scale,
/// with a shank legend, axes in µm and a title naming the probe.
fn draw(probe: &Probe, geometry: Option<&Geometry>, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    use spikecube::output::plot::{self, FONT, category_colour, plot_err};
    plot::register_font()?;
    let err = plot_err(path);
    let (x0, x1, y0, y1) = probe.extent();
    let (x0, x1, y0, y1) = (
        x0 as f64 - 20.0,
        x1 as f64 + 20.0,
        y0 as f64 - 20.0,
        y1 as f64 + 20.0,
    );
    let (wu, hu) = ((x1 - x0).max(1.0), (y1 - y0).max(1.0));
    let scale = (1800.0 / hu).min(1400.0 / wu).min(12.0);
    // A long, narrow probe drawn to scale is a sliver (a 32-µm-wide, 3-mm-long
    // shank would take 20 of 1800 px): its x axis is stretched so the probe
    // takes at least 300 px, and the axis says by how much.
    let x_scale = scale.max((300.0 / wu).min(12.0));
    // At least 420 px wide: a narrow probe is widened around its middle so its
    // labels and ticks fit.
    let plot_w = (wu * x_scale).max(420.0);
    let plot_h = (hu * scale).max(200.0);
    let xm = (x0 + x1) / 2.0;
    let (x0, x1) = (xm - plot_w / x_scale / 2.0, xm + plot_w / x_scale / 2.0);
    let x_desc = if x_scale > scale * 1.01 {
        format!("x (µm; drawn {:.0}× wider than y)", x_scale / scale)
    } else {
        "x (µm)".to_string()
    };
    let ym = (y0 + y1) / 2.0;
    let (y0, y1) = (ym - plot_h / scale / 2.0, ym + plot_h / scale / 2.0);
    let (left, bottom, top, legend_w) = (100u32, 70u32, 70u32, 200u32);
    let w = plot_w.ceil() as u32 + left + 30 + legend_w;
    let h = plot_h.ceil() as u32 + top + bottom;

    let mut ids = probe.kcoords.clone();
    ids.sort_unstable();
    ids.dedup();
    let colour = |k: i64| category_colour(ids.binary_search(&k).unwrap_or(0));
    // The file and its folder (`tetrode_like/probe.json`), enough to tell probes apart.
    let comps: Vec<String> = probe
        .source
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let name = comps[comps.len().saturating_sub(2)..].join("/");
    let title = format!(
        "{name}: {}, {}",
        spikecube::error::count(probe.n_sites() as u64, "site"),
        spikecube::error::count(ids.len() as u64, "shank")
    );
    let title_size = plot::fitting_size(&title, (w - 40) as f64, 26.0);

    let mut buf = vec![255u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let (main, side) = root.split_horizontally(w - legend_w);
        let mut chart = ChartBuilder::on(&main)
            .caption(&title, (FONT, title_size))
            .margin(15)
            .x_label_area_size(bottom - 15)
            .y_label_area_size(left - 15)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(&err)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc("y (µm)")
            .label_style((FONT, 16))
            .axis_desc_style((FONT, 20))
            .light_line_style(WHITE)
            .bold_line_style(BLACK.mix(0.06))
            .x_labels(((plot_w / 60.0) as usize).max(4))
            .y_labels(((plot_h / 60.0) as usize).max(3))
            .x_label_formatter(&plot::tick_text)
            .y_label_formatter(&plot::tick_text)
            .draw()
            .map_err(&err)?;
        let half = 6.0;
        chart
            .draw_series((0..probe.n_sites()).map(|i| {
                let (x, y) = (probe.xc[i] as f64, probe.yc[i] as f64);
                Rectangle::new(
                    [(x - half, y - half), (x + half, y + half)],
                    colour(probe.kcoords[i]).mix(0.55).filled(),
                )
            }))
            .map_err(&err)?;
        if let Some(g) = geometry {
            let r = (2.0 * scale).clamp(1.0, 4.0).round() as i32;
            chart
                .draw_series((0..g.n_centres()).map(|j| {
                    Circle::new(
                        (g.xcup[j], g.ycup[j]),
                        r,
                        colour(g.centre_shank[j]).filled(),
                    )
                }))
                .map_err(&err)?;
        }
        // Channel numbers (file columns): left of sites in the left half of
        // their shank, right of the others.
        let step = if probe.n_sites() <= 64 { 1 } else { 10 };
        let mid = shank_middles(probe, &ids);
        let label_size = if scale >= 2.0 { 16 } else { 13 };
        chart
            .draw_series((0..probe.n_sites()).step_by(step).map(|i| {
                let right = probe.xc[i] > mid[&probe.kcoords[i]];
                let (dx, hpos) = if right {
                    (half + 3.0 / x_scale, HPos::Left)
                } else {
                    (-half - 3.0 / x_scale, HPos::Right)
                };
                Text::new(
                    probe.chan_map[i].to_string(),
                    (probe.xc[i] as f64 + dx, probe.yc[i] as f64),
                    (FONT, label_size)
                        .into_font()
                        .color(&BLACK)
                        .pos(Pos::new(hpos, VPos::Center)),
                )
            }))
            .map_err(&err)?;

        draw_legend(&side, &ids, top as i32, step > 1, path)?;
        root.present().map_err(&err)?;
    }
    plot::save_png(path, buf, w, h)
}

/// The middle of each shank's sites along x, µm, by shank id.
fn shank_middles(probe: &Probe, ids: &[i64]) -> std::collections::HashMap<i64, f32> {
    let mut mid = std::collections::HashMap::new();
    for &k in ids {
        let xs: Vec<f32> = (0..probe.n_sites())
            .filter(|&i| probe.kcoords[i] == k)
            .map(|i| probe.xc[i])
            .collect();
        let (lo, hi) = xs
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        mid.insert(k, (lo + hi) / 2.0);
    }
    mid
}

/// The legend of [`draw`] on `side`, from pixel row `top`: one entry per
/// shank (24 at most), then the symbols.
fn draw_legend<DB: plotters::prelude::DrawingBackend>(
    side: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    ids: &[i64],
    top: i32,
    every_10th: bool,
    path: &Path,
) -> Result<()> {
    use plotters::prelude::*;
    use spikecube::output::plot::{FONT, category_colour, plot_err};
    let err = plot_err(path);
    let text = |s: &str, x: i32, y: i32, size: u32| {
        Text::new(
            s.to_string(),
            (x, y),
            (FONT, size).into_font().color(&BLACK),
        )
    };
    let mut y = top;
    side.draw(&text("shank", 10, y, 18)).map_err(&err)?;
    y += 28;
    for (n, &k) in ids.iter().enumerate().take(24) {
        side.draw(&Rectangle::new(
            [(12, y + 2), (26, y + 16)],
            category_colour(n).mix(0.55).filled(),
        ))
        .map_err(&err)?;
        side.draw(&text(&k.to_string(), 34, y, 16)).map_err(&err)?;
        y += 22;
    }
    if ids.len() > 24 {
        side.draw(&text(&format!("… {} more", ids.len() - 24), 12, y, 16))
            .map_err(&err)?;
        y += 22;
    }
    y += 16;
    for line in [
        "squares: sites".to_string(),
        "numbers: channel".to_string(),
        format!(
            "  (file column){}",
            if every_10th { ", every 10th" } else { "" }
        ),
        "dots: template".to_string(),
        "  centres".to_string(),
    ] {
        side.draw(&text(&line, 10, y, 15)).map_err(&err)?;
        y += 20;
    }
    Ok(())
}

pub fn run(args: Args) -> Result<ExitCode> {
    let probe = load_probe(&args.probe)?;
    let settings = DetectionSettings {
        dmin: args.dmin,
        dminx: args.dminx,
        nearest_chans: args.nearest_chans,
        max_channel_distance: args.max_channel_distance,
        ..DetectionSettings::default()
    };
    settings.validate()?;
    let (r, geometry) = report(&probe, &settings);
    for l in &r.lines {
        say!("{l}");
    }
    for w in &r.warnings {
        say!("warning: {w}");
    }
    if let Some(w) = recording_check(&args.probe, &probe)? {
        say!("warning: {w}");
    }
    if let Some(p) = &args.png {
        draw(&probe, geometry.as_ref(), p)?;
        say!("picture      {}", p.display());
    }
    Ok(if geometry.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use spikecube::simulate::default_probe;

    fn warnings(p: &Probe) -> Vec<String> {
        report(p, &DetectionSettings::default()).0.warnings
    }

    #[test]
    fn np2_has_1149_centres_and_no_warnings() {
        let (r, g) = report(&default_probe(), &DetectionSettings::default());
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(g.unwrap().n_centres(), 1149);
        assert!(
            r.lines.iter().any(|l| l.contains("3 × 383")),
            "{:?}",
            r.lines
        );
    }

    #[test]
    fn millimetre_coordinates_are_flagged() {
        let mut p = default_probe();
        p.xc.iter_mut().for_each(|v| *v /= 1000.0);
        p.yc.iter_mut().for_each(|v| *v /= 1000.0);
        let w = warnings(&p);
        assert!(w.iter().any(|m| m.contains("millimetres")), "{w:?}");
    }

    #[test]
    fn duplicates_and_small_shanks_are_flagged() {
        let mut p = default_probe();
        p.yc[1] = p.yc[3];
        p.xc[1] = p.xc[3];
        let w = warnings(&p);
        assert!(
            w.iter()
                .any(|m| m.contains("1 duplicate site positions: sites 1 and 3")),
            "{w:?}"
        );

        let mut p = default_probe();
        p.kcoords[0] = 7;
        let w = warnings(&p);
        assert!(w.iter().any(|m| m.contains("shank 7 has 1 sites")), "{w:?}");
    }

    #[test]
    fn a_probe_without_centres_is_reported() {
        // Two sites, (0, 10) and (10, 0): with one centre column (x = 0) and rows
        // 3.5 µm apart from y = 0, the nearest centre is 3 µm from a site.
        let p = Probe {
            xc: vec![0.0, 10.0],
            yc: vec![10.0, 0.0],
            kcoords: vec![0, 0],
            chan_map: vec![0, 1],
            n_chan: 2,
            source: PathBuf::from("two sites"),
        };
        let settings = DetectionSettings {
            dmin: Some(7.0),
            dminx: 1.0e9,
            max_channel_distance: 1.0,
            ..DetectionSettings::default()
        };
        let (r, g) = report(&p, &settings);
        assert!(g.is_none());
        assert!(
            r.warnings.iter().any(|m| m.contains("cannot run")),
            "{:?}",
            r.warnings
        );
    }
}
