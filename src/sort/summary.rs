//! `units.png`: the picture a user looks at first in a sort's Phy folder.
//!
//! Four panels, all per unit, `good` units (refractory autocorrelogram,
//! `cluster_KSLabel.tsv`) in colour and `mua` units in grey:
//!
//! 1. the units on the probe: each unit at the median x and depth of its
//!    spikes (µm), the sites as grey squares behind them, the marker's area
//!    growing with the firing rate;
//! 2. template amplitude (whitened units) against depth: units that are
//!    too small to trust, and the probe's silent stretches, stand out;
//! 3. firing rate (Hz, log scale) against depth;
//! 4. the autocorrelograms (±50 ms, 1-ms bins) of eight units, with the
//!    ±2-ms refractory stretch shaded: the first thing to look at to judge
//!    whether a unit is one neuron. The four largest units (the ones most
//!    worth keeping) and the four firing fastest among the rest (a unit
//!    firing far faster than its neighbours is the likeliest merge of
//!    several neurons, or noise, and its ACG has the counts to show it);
//!    their ids are written beside their dots in panels 2 and 3, so that
//!    each can be found in Phy.

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

use crate::output::plot;

/// Per-unit figures the picture shows; `u` units, ids `0..u`.
#[derive(Debug, Clone)]
pub struct UnitSummary {
    /// Spikes per unit.
    pub n_spikes: Vec<usize>,
    /// Median spike x per unit, µm (NaN for a unit without spikes).
    pub x: Vec<f64>,
    /// Median spike depth per unit, µm.
    pub y: Vec<f64>,
    /// Template amplitude per unit (`cluster_Amplitude.tsv`), whitened units.
    pub amplitude: Vec<f64>,
    /// `good` (refractory) per unit.
    pub good: Vec<bool>,
    /// Recording length, s (firing rates are spikes / this).
    pub seconds: f64,
}

impl UnitSummary {
    /// The figures from the kept spikes: unit `clu[i]`, position `pos[i]`
    /// (x, y µm); `amplitude` and `good` per unit.
    pub fn new(
        clu: &[i32],
        pos: &[[f32; 2]],
        amplitude: Vec<f64>,
        good: Vec<bool>,
        seconds: f64,
    ) -> UnitSummary {
        let u = amplitude.len();
        let mut xs: Vec<Vec<f32>> = vec![Vec::new(); u];
        let mut ys: Vec<Vec<f32>> = vec![Vec::new(); u];
        for (&c, p) in clu.iter().zip(pos) {
            if let Some(k) = usize::try_from(c).ok().filter(|&k| k < u) {
                xs[k].push(p[0]);
                ys[k].push(p[1]);
            }
        }
        UnitSummary {
            n_spikes: xs.iter().map(Vec::len).collect(),
            x: xs.iter_mut().map(|v| median(v)).collect(),
            y: ys.iter_mut().map(|v| median(v)).collect(),
            amplitude,
            good,
            seconds: seconds.max(1e-9),
        }
    }

    fn rate(&self, k: usize) -> f64 {
        self.n_spikes[k] as f64 / self.seconds
    }
}

fn median(v: &mut [f32]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f32::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        f64::from(v[m])
    } else {
        0.5 * (f64::from(v[m - 1]) + f64::from(v[m]))
    }
}

/// Autocorrelogram counts of sorted spike `times` (samples) in 1-ms bins
/// over ±`half_ms` (2·half_ms bins; the zero lag of a spike with itself is
/// not counted).
pub fn acg(times: &[i64], fs: f64, half_ms: usize) -> Vec<u32> {
    let bin = fs / 1000.0;
    let reach = (half_ms as f64 * bin).ceil() as i64;
    let mut counts = vec![0u32; 2 * half_ms];
    for (i, &t) in times.iter().enumerate() {
        for &s in &times[i + 1..] {
            let d = s - t;
            if d >= reach {
                break;
            }
            let b = (d as f64 / bin).floor() as usize;
            if b < half_ms {
                counts[half_ms + b] += 1;
                counts[half_ms - 1 - b] += 1;
            }
        }
    }
    counts
}

const GOOD: RGBColor = RGBColor(31, 119, 180);
const MUA: RGBColor = RGBColor(150, 150, 150);

fn colour(good: bool) -> RGBColor {
    if good { GOOD } else { MUA }
}

/// Draws `units.png` at `path` (2000 × 1000 pixels).
///
/// `times` and `clu` are the kept spikes (samples, unit id), `xc`/`yc` the
/// probe's sites (µm), `fs` the sampling rate (Hz).
///
/// # Errors
/// When the picture cannot be drawn or written (the path is named).
pub fn draw_units(
    path: &Path,
    s: &UnitSummary,
    times: &[i64],
    clu: &[i32],
    fs: f64,
    xc: &[f32],
    yc: &[f32],
) -> Result<()> {
    plot::register_font()?;
    let (w, h) = (2000u32, 1000u32);
    let err = plot::plot_err(path);
    let u = s.amplitude.len();
    let n_good = s.good.iter().filter(|&&g| g).count();
    let (ymin, ymax) = range(yc.iter().map(|&v| f64::from(v)), 20.0);
    let (xmin, xmax) = range(xc.iter().map(|&v| f64::from(v)), 20.0);
    let amax = s.amplitude.iter().copied().fold(1.0, f64::max) * 1.05;
    let rates: Vec<f64> = (0..u).map(|k| s.rate(k)).collect();
    let rmin = rates
        .iter()
        .copied()
        .filter(|&r| r > 0.0)
        .fold(f64::INFINITY, f64::min)
        .min(0.1);
    let rmax = rates.iter().copied().fold(1.0, f64::max) * 1.5;
    let radius = |k: usize| (2.0 + 2.0 * rates[k].max(0.0).sqrt()).clamp(3.0, 14.0) as i32;
    // Good units drawn last, on top.
    let mut order: Vec<usize> = (0..u).filter(|&k| s.n_spikes[k] > 0).collect();
    order.sort_by_key(|&k| s.good[k]);
    let shown = acg_units(s);
    // Unit k's id, just right of and above its dot at `at`.
    let id_label = |k: usize, at: (f64, f64)| {
        EmptyElement::at(at) + Text::new(k.to_string(), (7, -16), (plot::FONT, 15).into_font())
    };

    let mut buf = vec![255u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(&err)?;
        let title = format!(
            "{} units ({n_good} good, blue; mua grey), {} spikes, {:.1} s",
            u,
            times.len(),
            s.seconds
        );
        let root = root.titled(&title, (plot::FONT, 30)).map_err(&err)?;
        let (left, right) = root.split_horizontally(1150);
        let panels = left.split_evenly((1, 3));
        let style = |c: &mut ChartBuilder<'_, '_, BitMapBackend<'_>>| {
            c.margin(12).x_label_area_size(60).y_label_area_size(80);
        };

        // 1. Units on the probe.
        let mut cb = ChartBuilder::on(&panels[0]);
        style(&mut cb);
        let mut ch = cb
            .caption("units on the probe", (plot::FONT, 22))
            .build_cartesian_2d(xmin..xmax, ymin..ymax)
            .map_err(&err)?;
        ch.configure_mesh()
            .x_desc("x (µm)")
            .y_desc("depth (µm)")
            .label_style((plot::FONT, 16))
            .axis_desc_style((plot::FONT, 18))
            .light_line_style(WHITE)
            .x_labels(4)
            .x_label_formatter(&plot::tick_text)
            .y_label_formatter(&plot::tick_text)
            .draw()
            .map_err(&err)?;
        ch.draw_series(xc.iter().zip(yc).map(|(&x, &y)| {
            Rectangle::new(
                [
                    (f64::from(x) - 3.0, f64::from(y) - 3.0),
                    (f64::from(x) + 3.0, f64::from(y) + 3.0),
                ],
                BLACK.mix(0.12).filled(),
            )
        }))
        .map_err(&err)?;
        ch.draw_series(order.iter().map(|&k| {
            Circle::new(
                (s.x[k], s.y[k]),
                radius(k),
                colour(s.good[k]).mix(0.6).filled(),
            )
        }))
        .map_err(&err)?;

        // 2. Amplitude against depth.
        let mut cb = ChartBuilder::on(&panels[1]);
        style(&mut cb);
        let mut ch = cb
            .caption("amplitude by depth", (plot::FONT, 22))
            .build_cartesian_2d(0.0..amax, ymin..ymax)
            .map_err(&err)?;
        ch.configure_mesh()
            .x_desc("template amplitude")
            .y_desc("depth (µm)")
            .label_style((plot::FONT, 16))
            .axis_desc_style((plot::FONT, 18))
            .light_line_style(WHITE)
            .x_labels(5)
            .x_label_formatter(&plot::tick_text)
            .y_label_formatter(&plot::tick_text)
            .draw()
            .map_err(&err)?;
        ch.draw_series(order.iter().map(|&k| {
            Circle::new(
                (s.amplitude[k], s.y[k]),
                5,
                colour(s.good[k]).mix(0.7).filled(),
            )
        }))
        .map_err(&err)?;
        ch.draw_series(shown.iter().map(|&k| id_label(k, (s.amplitude[k], s.y[k]))))
            .map_err(&err)?;

        // 3. Firing rate against depth (log scale).
        let mut cb = ChartBuilder::on(&panels[2]);
        style(&mut cb);
        let mut ch = cb
            .caption("firing rate by depth", (plot::FONT, 22))
            .build_cartesian_2d((rmin..rmax).log_scale(), ymin..ymax)
            .map_err(&err)?;
        ch.configure_mesh()
            .x_desc("firing rate (Hz)")
            .y_desc("depth (µm)")
            .label_style((plot::FONT, 16))
            .axis_desc_style((plot::FONT, 18))
            .light_line_style(WHITE)
            .x_labels(5)
            .x_label_formatter(&plot::tick_text)
            .y_label_formatter(&plot::tick_text)
            .draw()
            .map_err(&err)?;
        ch.draw_series(
            order
                .iter()
                .filter(|&&k| rates[k] > 0.0)
                .map(|&k| Circle::new((rates[k], s.y[k]), 5, colour(s.good[k]).mix(0.7).filled())),
        )
        .map_err(&err)?;
        ch.draw_series(
            shown
                .iter()
                .filter(|&&k| rates[k] > 0.0)
                .map(|&k| id_label(k, (rates[k], s.y[k]))),
        )
        .map_err(&err)?;

        // 4. Autocorrelograms of the units chosen above.
        draw_acgs(&right, s, &shown, times, clu, fs, path)?;
        root.present().map_err(&err)?;
    }
    plot::save_png(path, buf, w, h)
}

/// Units whose ACGs the picture shows (at most eight, of those with two
/// spikes or more): the four of largest template amplitude, then the four
/// firing fastest among the others (ties to the lower id).
pub fn acg_units(s: &UnitSummary) -> Vec<usize> {
    let with_pairs: Vec<usize> = (0..s.amplitude.len())
        .filter(|&k| s.n_spikes[k] > 1)
        .collect();
    let mut big = with_pairs.clone();
    big.sort_by(|&a, &b| s.amplitude[b].total_cmp(&s.amplitude[a]).then(a.cmp(&b)));
    big.truncate(4);
    let mut fast: Vec<usize> = with_pairs
        .into_iter()
        .filter(|k| !big.contains(k))
        .collect();
    fast.sort_by(|&a, &b| s.n_spikes[b].cmp(&s.n_spikes[a]).then(a.cmp(&b)));
    fast.truncate(4);
    big.extend(fast);
    big
}

/// The ACG panel: the units of [`acg_units`], in that order.
fn draw_acgs(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    s: &UnitSummary,
    shown: &[usize],
    times: &[i64],
    clu: &[i32],
    fs: f64,
    path: &Path,
) -> Result<()> {
    let err = plot::plot_err(path);
    const HALF_MS: usize = 50;
    let cells = area.split_evenly((4, 2));
    for (i, (cell, &k)) in cells.iter().zip(shown).enumerate() {
        let own: Vec<i64> = times
            .iter()
            .zip(clu)
            .filter(|&(_, &c)| c as usize == k)
            .map(|(&t, _)| t)
            .collect();
        let counts = acg(&own, fs, HALF_MS);
        let top = f64::from(counts.iter().copied().max().unwrap_or(0)).max(1.0) * 1.1;
        let caption = format!(
            "unit {k}: {:.1} Hz, {}, {}",
            s.rate(k),
            if s.good[k] { "good" } else { "mua" },
            if i < 4 { "large" } else { "fast" }
        );
        let mut ch = ChartBuilder::on(cell)
            .caption(&caption, (plot::FONT, 18))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(50)
            .build_cartesian_2d(-(HALF_MS as f64)..HALF_MS as f64, 0.0..top)
            .map_err(&err)?;
        ch.configure_mesh()
            .disable_mesh()
            .x_desc("lag (ms)")
            .label_style((plot::FONT, 13))
            .axis_desc_style((plot::FONT, 14))
            .x_labels(5)
            .y_labels(3)
            .x_label_formatter(&plot::tick_text)
            .y_label_formatter(&plot::tick_text)
            .draw()
            .map_err(&err)?;
        ch.draw_series(std::iter::once(Rectangle::new(
            [(-2.0, 0.0), (2.0, top)],
            RGBColor(214, 39, 40).mix(0.12).filled(),
        )))
        .map_err(&err)?;
        ch.draw_series(counts.iter().enumerate().map(|(b, &n)| {
            let lo = b as f64 - HALF_MS as f64;
            Rectangle::new(
                [(lo, 0.0), (lo + 1.0, f64::from(n))],
                colour(s.good[k]).filled(),
            )
        }))
        .map_err(&err)?;
    }
    Ok(())
}

/// (min − pad, max + pad) of `v`, or (0, 1) when empty.
fn range(v: impl Iterator<Item = f64>, pad: f64) -> (f64, f64) {
    let (lo, hi) = v
        .filter(|x| x.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
            (lo.min(x), hi.max(x))
        });
    if lo <= hi {
        (lo - pad, hi + pad)
    } else {
        (0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acg_counts_each_pair_on_both_sides() {
        // 30 kHz: lags of 1.5 ms and 10 ms and 60 ms (outside ±50).
        let t = [0i64, 45, 300, 1800];
        let c = acg(&t, 30_000.0, 50);
        assert_eq!(c.len(), 100);
        let at = |ms: i64| c[(50 + ms) as usize];
        assert_eq!(at(1), 1); // 45 samples = 1.5 ms: bin [1, 2)
        assert_eq!(at(-2), 1);
        assert_eq!(at(10), 1); // 300 samples
        assert_eq!(at(8), 1); // 255 samples = 8.5 ms
        assert_eq!(c.iter().sum::<u32>(), 6);
    }

    #[test]
    fn acg_units_are_the_largest_then_the_fastest() {
        // Amplitudes: unit 5 largest, then 0, 6, 2, 7...; spikes: unit 3
        // fires most, then 1, 4; unit 8 has one spike (no ACG).
        let amplitude = vec![9.0, 2.0, 7.0, 1.0, 1.5, 10.0, 8.0, 6.0, 20.0, 0.5];
        let n_spikes = vec![10, 50, 10, 90, 40, 10, 10, 10, 1, 30];
        let s = UnitSummary {
            x: vec![0.0; 10],
            y: vec![0.0; 10],
            good: vec![true; 10],
            seconds: 10.0,
            amplitude,
            n_spikes,
        };
        assert_eq!(acg_units(&s), vec![5, 0, 6, 2, 3, 1, 4, 9]);
        let few = UnitSummary {
            n_spikes: vec![3, 0, 2],
            x: vec![0.0; 3],
            y: vec![0.0; 3],
            amplitude: vec![1.0, 5.0, 2.0],
            good: vec![false; 3],
            seconds: 1.0,
        };
        assert_eq!(acg_units(&few), vec![2, 0]);
    }

    #[test]
    fn medians_and_rates() {
        let clu = [0, 1, 0, 0];
        let pos = [[0.0, 10.0], [5.0, 50.0], [2.0, 30.0], [4.0, 20.0]];
        let s = UnitSummary::new(
            &clu,
            &pos,
            vec![10.0, 5.0, 1.0],
            vec![true, false, false],
            2.0,
        );
        assert_eq!(s.n_spikes, vec![3, 1, 0]);
        assert_eq!((s.x[0], s.y[0]), (2.0, 20.0));
        assert!(s.x[2].is_nan());
        assert_eq!(s.rate(0), 1.5);
    }
}
