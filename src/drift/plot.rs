//! `drift.png`: the estimated drift against time.
//!
//! Top panel: the first pass's spikes (grey dots, depth against time) with,
//! per block j, the line `yblk_j − dshift[b, j]` at each window's centre time:
//! where the tissue at the block's centre was seen, so each line follows the
//! spike bands around it when the estimate is right. Bottom panel: `dshift`
//! itself (µm, Kilosort4's sign: positive when the spikes sit lower than in
//! the template), one line per block.

use std::path::Path;

use anyhow::Result;

use super::DriftEstimate;
use super::estimate::FirstPassSpikes;
use crate::output::plot;
use crate::probe::Probe;

/// Most spikes drawn (an even subsample of the first pass beyond that).
const MAX_DOTS: usize = 60_000;

/// Draws `drift.png` (1400 × 1000 pixels): `window_s` is the window length
/// (s) and `fs` the sample rate (Hz), for the time axis.
///
/// # Errors
/// When the picture cannot be drawn or written.
pub fn render(
    path: &Path,
    spikes: &FirstPassSpikes,
    est: &DriftEstimate,
    window_s: f64,
    fs: f64,
    probe: &Probe,
) -> Result<()> {
    use plotters::prelude::*;
    plot::register_font()?;
    let (w, h) = (1400u32, 1000u32);
    let nwin = est.dshift.nrows();
    // The last window is usually shorter: the axis ends at the last spike's
    // window end or the last window's centre, whichever is later, never past
    // the recording (nwin windows at most).
    let last_spike = spikes
        .sample
        .iter()
        .copied()
        .max()
        .map_or(0.0, |t| t as f64 / fs);
    let t_max = ((nwin as f64 - 0.5) * window_s)
        .max(last_spike)
        .min(nwin as f64 * window_s)
        .max(1e-3);
    let (_, _, y0, y1) = probe.extent();
    let (y0, y1) = (y0 as f64 - 20.0, y1 as f64 + 20.0);
    let (mut d0, mut d1) = est
        .dshift
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    if !(d0.is_finite() && d1.is_finite()) {
        (d0, d1) = (-1.0, 1.0);
    }
    let pad = ((d1 - d0) * 0.1).max(2.0);
    // Room above the lines for the legend (one row per block).
    let legend_room = (d1 - d0 + 2.0 * pad) * (0.12 * est.yblk.len() as f64 + 0.1);
    let (d0, d1) = (d0 - pad, d1 + pad + legend_room);
    let step = spikes.len().div_ceil(MAX_DOTS).max(1);
    let centre = |b: usize| (b as f64 + 0.5) * window_s;
    let err = plot::plot_err(path);
    let mut buf = vec![255u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let (top, bottom) = root.split_vertically(640);
        let title = format!(
            "drift: {} first-pass spikes, {} block{}, dshift {:.1} to {:.1} µm",
            spikes.len(),
            est.yblk.len(),
            if est.yblk.len() == 1 { "" } else { "s" },
            d0 + pad,
            d1 - pad - legend_room
        );
        let size = plot::fitting_size(&title, 1300.0, 28.0);
        let mut chart = ChartBuilder::on(&top)
            .caption(&title, (plot::FONT, size))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(100)
            .build_cartesian_2d(0f64..t_max, y0..y1)
            .map_err(&err)?;
        chart
            .configure_mesh()
            .y_desc("depth (µm): spikes, and yblk − dshift per block")
            .label_style((plot::FONT, 18))
            .axis_desc_style((plot::FONT, 20))
            .light_line_style(WHITE)
            .bold_line_style(BLACK.mix(0.08))
            .x_label_formatter(&plot::tick_text)
            .y_label_formatter(&plot::tick_text)
            .draw()
            .map_err(&err)?;
        chart
            .draw_series((0..spikes.len()).step_by(step).map(|i| {
                Circle::new(
                    (spikes.sample[i] as f64 / fs, spikes.y[i] as f64),
                    1,
                    RGBColor(90, 90, 90).mix(0.35).filled(),
                )
            }))
            .map_err(&err)?;
        for j in 0..est.yblk.len() {
            let c = plot::category_colour(j);
            chart
                .draw_series(std::iter::once(PathElement::new(
                    (0..nwin)
                        .map(|b| (centre(b), est.yblk[j] - est.dshift[[b, j]]))
                        .collect::<Vec<_>>(),
                    c.stroke_width(3),
                )))
                .map_err(&err)?;
        }
        let mut chart = ChartBuilder::on(&bottom)
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(100)
            .build_cartesian_2d(0f64..t_max, d0..d1)
            .map_err(&err)?;
        chart
            .configure_mesh()
            .x_desc("time (s)")
            .y_desc("dshift (µm)")
            .label_style((plot::FONT, 18))
            .axis_desc_style((plot::FONT, 20))
            .light_line_style(WHITE)
            .bold_line_style(BLACK.mix(0.08))
            .x_label_formatter(&plot::tick_text)
            .y_label_formatter(&plot::tick_text)
            .draw()
            .map_err(&err)?;
        for j in 0..est.yblk.len() {
            let c = plot::category_colour(j);
            chart
                .draw_series(std::iter::once(PathElement::new(
                    (0..nwin)
                        .map(|b| (centre(b), est.dshift[[b, j]]))
                        .collect::<Vec<_>>(),
                    c.stroke_width(2),
                )))
                .map_err(&err)?
                .label(format!("block {j}: yblk {:.0} µm", est.yblk[j]))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK.mix(0.3))
            .label_font((plot::FONT, 16))
            .draw()
            .map_err(&err)?;
        root.present().map_err(&err)?;
    }
    plot::save_png(path, buf, w, h)
}
