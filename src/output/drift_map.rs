//! The drift map: spike depth against time, coloured by amplitude.
//!
//! Spikes are kept in a bounded, uniformly drawn subsample (reservoir
//! sampling with a fixed seed, so the picture is the same for the same
//! input), never all of them: memory is `capacity × 16` bytes whatever the
//! spike count.

use std::path::Path;

use anyhow::Result;

use super::plot::{BLACK, Canvas, GREY, WHITE, colour_scale, tick_label, ticks};

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

    /// Draws the picture (1400 × 900 pixels): time in seconds along x, depth in
    /// µm up the y axis (deeper sites, larger y, at the top, as on the probe),
    /// one translucent dot per kept spike coloured by amplitude (colour bar on
    /// the right, clipped at the 1st and 99th percentiles), and writes it as PNG.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn render(&self, path: &Path, axes: &DriftAxes) -> Result<()> {
        let (w, h) = (1400u32, 900u32);
        let (left, right, top, bottom) = (110i64, 1230i64, 60i64, 800i64);
        let mut c = Canvas::new(w, h, WHITE);

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
        let pad = (y1 - y0) * 0.02;
        let (y0, y1) = (y0 - pad, y1 + pad);
        let px_x = |t: f64| left as f64 + t / t_max * (right - left) as f64;
        let px_y = |y: f64| bottom as f64 - (y - y0) / (y1 - y0) * (bottom - top) as f64;

        // Grid and ticks.
        let xt = ticks(0.0, t_max, 8);
        let yt = ticks(y0, y1, 8);
        let xstep = if xt.len() > 1 { xt[1] - xt[0] } else { 1.0 };
        let ystep = if yt.len() > 1 { yt[1] - yt[0] } else { 1.0 };
        for &t in &xt {
            let x = px_x(t).round() as i64;
            c.line(x, top, x, bottom, GREY);
            c.line(x, bottom, x, bottom + 6, BLACK);
            let s = tick_label(t, xstep);
            c.text(x - Canvas::text_width(&s, 2) / 2, bottom + 12, &s, 2, BLACK);
        }
        for &y in &yt {
            let py = px_y(y).round() as i64;
            c.line(left, py, right, py, GREY);
            c.line(left - 6, py, left, py, BLACK);
            let s = tick_label(y, ystep);
            c.text(left - 12 - Canvas::text_width(&s, 2), py - 7, &s, 2, BLACK);
        }

        // Dots, weakest first so strong spikes stay visible.
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
        let mut order: Vec<usize> = (0..self.points.len()).collect();
        order.sort_by(|&i, &j| self.points[i].2.total_cmp(&self.points[j].2));
        let alpha = (30_000.0 / self.points.len().max(1) as f32).clamp(0.15, 0.7);
        // Bigger dots when there are few, so sparse maps stay readable.
        let radius = match self.points.len() {
            0..5_000 => 2.6,
            5_000..50_000 => 2.0,
            _ => 1.6,
        };
        for i in order {
            let (s, y, a) = self.points[i];
            let colour = colour_scale((a as f64 - a0) / (a1 - a0));
            c.disc(px_x(s as f64 / fs), px_y(y as f64), radius, colour, alpha);
        }
        c.frame(left, top, right, bottom, BLACK);

        // Colour bar.
        let (bx0, bx1) = (1262i64, 1282i64);
        for py in top..=bottom {
            let t = (bottom - py) as f64 / (bottom - top) as f64;
            c.rect(bx0, py, bx1, py, colour_scale(t), 1.0);
        }
        c.frame(bx0, top, bx1, bottom, BLACK);
        let at = ticks(a0, a1, 6);
        let astep = if at.len() > 1 { at[1] - at[0] } else { 1.0 };
        for &a in &at {
            let py = (bottom as f64 - (a - a0) / (a1 - a0) * (bottom - top) as f64).round() as i64;
            c.line(bx1, py, bx1 + 5, py, BLACK);
            c.text(bx1 + 9, py - 7, &tick_label(a, astep), 2, BLACK);
        }
        c.text_vertical(1365, (top + bottom) / 2 + 50, "amplitude", 2, BLACK);

        // Titles.
        c.text(
            (left + right) / 2 - Canvas::text_width("time (s)", 3) / 2,
            bottom + 42,
            "time (s)",
            3,
            BLACK,
        );
        c.text_vertical(20, (top + bottom) / 2 + 75, "depth (µm)", 3, BLACK);
        let title = format!(
            "drift map: {} spikes, {} shown",
            self.seen,
            self.points.len()
        );
        c.text(left, 18, &title, 3, BLACK);
        c.save_png(path)
    }
}
