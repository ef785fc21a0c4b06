//! The drift map: spike depth against time, coloured by amplitude.
//!
//! Spikes are kept in a bounded, uniformly drawn subsample (reservoir
//! sampling with a fixed seed, so the picture is the same for the same
//! input), never all of them: memory is `capacity × 16` bytes whatever the
//! spike count.

use std::path::Path;

use anyhow::Result;

use super::plot;

/// Default number of spikes kept for the picture.
pub const DEFAULT_CAPACITY: usize = 200_000;

/// A bounded subsample of (time, depth, amplitude) for the drift map.
#[derive(Debug, Clone)]
pub struct DriftMap {
    capacity: usize,
    seen: u64,
    state: u64,
    points: Vec<(i64, f32, f32)>,
}

/// Axes of the picture.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DriftAxes {
    /// Sample rate, Hz: converts sample indices to seconds.
    pub fs: f64,
    /// Recording length in samples (the time axis runs from 0 to `n_samples / fs` s);
    /// 0 takes the latest kept spike instead.
    pub n_samples: u64,
    /// Depth range shown, µm, bottom to top.
    pub y_range: (f64, f64),
}

impl DriftMap {
    /// An empty map keeping at most `capacity` spikes.
    pub fn new(capacity: usize) -> DriftMap {
        DriftMap {
            capacity: capacity.max(1),
            seen: 0,
            state: 0x5EED_D21F_7A11_0001,
            points: Vec::new(),
        }
    }

    /// Offers one spike: absolute `sample`, depth `y` (µm) and amplitude `amp`.
    pub fn push(&mut self, sample: i64, y: f32, amp: f32) {
        let k = self.seen;
        self.seen += 1;
        if self.points.len() < self.capacity {
            self.points.push((sample, y, amp));
            return;
        }
        // Replace a kept spike with probability capacity / (k + 1).
        let j = self.next() % (k + 1);
        if (j as usize) < self.capacity {
            self.points[j as usize] = (sample, y, amp);
        }
    }

    /// Spikes offered so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Spikes kept for the picture.
    pub fn kept(&self) -> usize {
        self.points.len()
    }

    fn next(&mut self) -> u64 {
        // SplitMix64 step.
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Draws the picture (1400 × 900 pixels) with plotters: time in seconds
    /// along x, depth along the probe in µm up the y axis (larger y, higher on
    /// the probe, at the top), one translucent dot per kept spike coloured by
    /// amplitude on a perceptually uniform map (viridis, clipped so both ends
    /// show on white), a colour bar labelled "amplitude (whitened units)"
    /// (clipped at the 1st and 99th percentiles), a title that is shrunk to
    /// fit, and writes it as PNG.
    ///
    /// # Errors
    /// When the picture cannot be drawn or the file cannot be written.
    pub fn render(&self, path: &Path, axes: &DriftAxes) -> Result<()> {
        use plotters::prelude::*;
        plot::register_font()?;
        let (w, h) = (1400u32, 900u32);
        let fs = if axes.fs.is_finite() && axes.fs > 0.0 {
            axes.fs
        } else {
            1.0
        };
        let last = self.points.iter().map(|p| p.0).max().unwrap_or(0).max(1);
        let t_max = if axes.n_samples > 0 {
            axes.n_samples as f64 / fs
        } else {
            last as f64 / fs
        }
        .max(1e-3);
        let (mut y0, mut y1) = axes.y_range;
        if !(y0.is_finite() && y1.is_finite()) || y1 <= y0 {
            let (lo, hi) = self
                .points
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
                    (lo.min(p.1 as f64), hi.max(p.1 as f64))
                });
            (y0, y1) = if lo < hi { (lo, hi) } else { (0.0, 1.0) };
        }
        let pad = ((y1 - y0) * 0.02).max(1.0);
        let (y0, y1) = (y0 - pad, y1 + pad);

        let mut amps: Vec<f32> = self.points.iter().map(|p| p.2).collect();
        amps.sort_by(f32::total_cmp);
        let q = |f: f64| -> f64 {
            if amps.is_empty() {
                0.0
            } else {
                amps[((amps.len() - 1) as f64 * f).round() as usize] as f64
            }
        };
        let (a0, a1) = (q(0.01), q(0.99).max(q(0.01) + 1e-6));
        // Largest amplitudes drawn last, on top.
        let mut order: Vec<usize> = (0..self.points.len()).collect();
        order.sort_by(|&i, &j| self.points[i].2.total_cmp(&self.points[j].2));
        let alpha = (30_000.0 / self.points.len().max(1) as f64).clamp(0.15, 0.7);
        let radius = match self.points.len() {
            0..5_000 => 3,
            _ => 2,
        };

        let title = format!(
            "drift map: {} detected, {} shown",
            crate::error::count(self.seen, "spike"),
            self.points.len()
        );
        let title_size = plot::fitting_size(&title, 1150.0, 30.0);
        let err = plot::plot_err(path);
        let mut buf = vec![255u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
            root.fill(&WHITE).map_err(&err)?;
            let (main, bar) = root.split_horizontally(1210);
            let mut chart = ChartBuilder::on(&main)
                .caption(&title, (plot::FONT, title_size))
                .margin(20)
                .x_label_area_size(70)
                .y_label_area_size(100)
                .build_cartesian_2d(0f64..t_max, y0..y1)
                .map_err(&err)?;
            chart
                .configure_mesh()
                .x_desc("time (s)")
                .y_desc("depth along the probe (µm)")
                .label_style((plot::FONT, 20))
                .axis_desc_style((plot::FONT, 24))
                .light_line_style(WHITE)
                .bold_line_style(BLACK.mix(0.08))
                .x_labels(10)
                .y_labels(10)
                .x_label_formatter(&plot::tick_text)
                .y_label_formatter(&plot::tick_text)
                .draw()
                .map_err(&err)?;
            chart
                .draw_series(order.iter().map(|&i| {
                    let (s, y, a) = self.points[i];
                    let c = plot::colour_map((a as f64 - a0) / (a1 - a0));
                    Circle::new((s as f64 / fs, y as f64), radius, c.mix(alpha).filled())
                }))
                .map_err(&err)?;

            // The colour bar, its plot area level with the main one.
            let mut cb = ChartBuilder::on(&bar)
                .caption(" ", (plot::FONT, title_size))
                .margin_top(20)
                .margin_bottom(20)
                .margin_left(10)
                .margin_right(10)
                .x_label_area_size(70)
                .right_y_label_area_size(110)
                .build_cartesian_2d(0f64..1f64, a0..a1)
                .map_err(&err)?;
            cb.configure_mesh()
                .disable_x_mesh()
                .disable_y_mesh()
                .disable_x_axis()
                .y_desc("amplitude (whitened units)")
                .label_style((plot::FONT, 18))
                .axis_desc_style((plot::FONT, 22))
                .y_labels(8)
                .y_label_formatter(&plot::tick_text)
                .draw()
                .map_err(&err)?;
            let n = 256;
            cb.draw_series((0..n).map(|k| {
                let lo = a0 + (a1 - a0) * k as f64 / n as f64;
                let hi = a0 + (a1 - a0) * (k + 1) as f64 / n as f64;
                Rectangle::new(
                    [(0.0, lo), (1.0, hi)],
                    plot::colour_map(k as f64 / (n - 1) as f64).filled(),
                )
            }))
            .map_err(&err)?;
            root.present().map_err(&err)?;
        }
        plot::save_png(path, buf, w, h)
    }
}
