//! A small raster canvas for the output pictures (drift map, probe layout):
//! alpha-blended dots and rectangles, lines, and text in a built-in 5 × 7
//! pixel font (digits, lower-case letters, a few signs; upper case is drawn as
//! lower case), so no system font or font file is needed. Saved as PNG
//! through the `image` crate.

use std::path::Path;

use anyhow::{Context, Result};

/// An RGB colour, 0–255 per channel.
pub type Rgb = [u8; 3];

/// White.
pub const WHITE: Rgb = [255, 255, 255];
/// Black.
pub const BLACK: Rgb = [0, 0, 0];
/// Light grey for grid lines.
pub const GREY: Rgb = [225, 225, 225];

/// An RGB picture of `width × height` pixels, origin at the top-left corner.
#[derive(Debug, Clone)]
pub struct Canvas {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    px: Vec<[f32; 3]>,
}

impl Canvas {
    /// A canvas filled with `bg`.
    pub fn new(width: u32, height: u32, bg: Rgb) -> Canvas {
        let c = [bg[0] as f32, bg[1] as f32, bg[2] as f32];
        Canvas {
            width,
            height,
            px: vec![c; width as usize * height as usize],
        }
    }

    /// Blends `colour` over pixel (x, y) with opacity `alpha` (0–1); outside pixels are ignored.
    pub fn blend(&mut self, x: i64, y: i64, colour: Rgb, alpha: f32) {
        if x < 0 || y < 0 || x >= self.width as i64 || y >= self.height as i64 {
            return;
        }
        let p = &mut self.px[y as usize * self.width as usize + x as usize];
        for k in 0..3 {
            p[k] += (colour[k] as f32 - p[k]) * alpha;
        }
    }

    /// Fills the rectangle `[x0, x1] × [y0, y1]` (pixels, inclusive) with `colour` at opacity `alpha`.
    pub fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, colour: Rgb, alpha: f32) {
        for y in y0.min(y1)..=y0.max(y1) {
            for x in x0.min(x1)..=x0.max(x1) {
                self.blend(x, y, colour, alpha);
            }
        }
    }

    /// Draws the outline of a rectangle, one pixel wide.
    pub fn frame(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, colour: Rgb) {
        self.line(x0, y0, x1, y0, colour);
        self.line(x0, y1, x1, y1, colour);
        self.line(x0, y0, x0, y1, colour);
        self.line(x1, y0, x1, y1, colour);
    }

    /// Draws a one-pixel line (Bresenham).
    pub fn line(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, colour: Rgb) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.blend(x, y, colour, 1.0);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Fills a disc of radius `r` pixels centred at (cx, cy) (pixel units, sub-pixel centre).
    pub fn disc(&mut self, cx: f64, cy: f64, r: f64, colour: Rgb, alpha: f32) {
        let (x0, x1) = ((cx - r).floor() as i64, (cx + r).ceil() as i64);
        let (y0, y1) = ((cy - r).floor() as i64, (cy + r).ceil() as i64);
        for y in y0..=y1 {
            for x in x0..=x1 {
                let (ddx, ddy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
                if ddx * ddx + ddy * ddy <= r * r {
                    self.blend(x, y, colour, alpha);
                }
            }
        }
    }

    /// Width in pixels of `text` at magnification `scale`.
    pub fn text_width(text: &str, scale: u32) -> i64 {
        (text.chars().count() as i64 * 6 - 1).max(0) * scale as i64
    }

    /// Draws `text` with its top-left corner at (x, y), each font pixel `scale` pixels wide.
    pub fn text(&mut self, x: i64, y: i64, text: &str, scale: u32, colour: Rgb) {
        let s = scale as i64;
        for (i, ch) in text.chars().enumerate() {
            let rows = glyph(ch);
            let gx = x + i as i64 * 6 * s;
            for (r, row) in rows.iter().enumerate() {
                for (c, b) in row.bytes().enumerate() {
                    if b == b'#' {
                        self.rect(
                            gx + c as i64 * s,
                            y + r as i64 * s,
                            gx + (c as i64 + 1) * s - 1,
                            y + (r as i64 + 1) * s - 1,
                            colour,
                            1.0,
                        );
                    }
                }
            }
        }
    }

    /// Draws `text` rotated a quarter turn anticlockwise (reading bottom to top),
    /// its baseline-left corner at (x, y).
    pub fn text_vertical(&mut self, x: i64, y: i64, text: &str, scale: u32, colour: Rgb) {
        let s = scale as i64;
        for (i, ch) in text.chars().enumerate() {
            let rows = glyph(ch);
            let gy = y - i as i64 * 6 * s;
            for (r, row) in rows.iter().enumerate() {
                for (c, b) in row.bytes().enumerate() {
                    if b == b'#' {
                        // Font column c goes up, font row r goes right.
                        let px = x + r as i64 * s;
                        let py = gy - (c as i64 + 1) * s + 1;
                        self.rect(px, py, px + s - 1, py + s - 1, colour, 1.0);
                    }
                }
            }
        }
    }

    /// Saves the canvas as an 8-bit RGB PNG.
    ///
    /// # Errors
    /// When the file cannot be written (the path is named).
    pub fn save_png(&self, path: &Path) -> Result<()> {
        let mut buf = Vec::with_capacity(self.px.len() * 3);
        for p in &self.px {
            for v in p {
                buf.push(v.round().clamp(0.0, 255.0) as u8);
            }
        }
        let img = image::RgbImage::from_raw(self.width, self.height, buf)
            .context("canvas buffer does not match its size")?;
        img.save_with_format(path, image::ImageFormat::Png)
            .with_context(|| format!("cannot write {}", path.display()))
    }
}

/// A sequential colour scale for `t` in 0–1: dark blue, through teal and green, to yellow.
pub fn colour_scale(t: f64) -> Rgb {
    const STOPS: [[f64; 3]; 5] = [
        [48.0, 18.0, 90.0],
        [45.0, 95.0, 150.0],
        [30.0, 155.0, 140.0],
        [120.0, 200.0, 80.0],
        [250.0, 225.0, 40.0],
    ];
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let f = t * (STOPS.len() - 1) as f64;
    let i = (f.floor() as usize).min(STOPS.len() - 2);
    let u = f - i as f64;
    let mut c = [0u8; 3];
    for k in 0..3 {
        c[k] = (STOPS[i][k] + (STOPS[i + 1][k] - STOPS[i][k]) * u).round() as u8;
    }
    c
}

/// Distinct colours for categories (shanks), cycling after eight.
pub fn category_colour(i: usize) -> Rgb {
    const C: [Rgb; 8] = [
        [31, 119, 180],
        [214, 39, 40],
        [44, 160, 44],
        [148, 103, 189],
        [255, 127, 14],
        [23, 190, 207],
        [140, 86, 75],
        [188, 189, 34],
    ];
    C[i % C.len()]
}

/// "Nice" tick positions covering `[lo, hi]`: about `n` steps of 1, 2 or 5 × 10^k.
pub fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite()) || hi <= lo || n == 0 {
        return vec![lo];
    }
    let raw = (hi - lo) / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// Formats a tick value with no more decimals than the tick step needs.
pub fn tick_label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 || step <= 0.0 {
        0
    } else {
        (-step.log10()).ceil() as usize
    };
    let s = format!("{v:.decimals$}");
    if s.starts_with("-0") && s.trim_start_matches(['-', '0', '.']).is_empty() {
        s[1..].to_string()
    } else {
        s
    }
}

/// The 5 × 7 bitmap of a character ('#' = ink). Unknown characters draw as a box.
fn glyph(ch: char) -> [&'static str; 7] {
    match ch.to_ascii_lowercase() {
        '0' => [
            ".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###.",
        ],
        '1' => [
            "..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###.",
        ],
        '2' => [
            ".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####",
        ],
        '3' => [
            "####.", "....#", "....#", ".###.", "....#", "....#", "####.",
        ],
        '4' => [
            "...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#.",
        ],
        '5' => [
            "#####", "#....", "####.", "....#", "....#", "#...#", ".###.",
        ],
        '6' => [
            "..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###.",
        ],
        '7' => [
            "#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#...",
        ],
        '8' => [
            ".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###.",
        ],
        '9' => [
            ".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##..",
        ],
        'a' => [
            ".....", ".....", ".###.", "....#", ".####", "#...#", ".####",
        ],
        'b' => [
            "#....", "#....", "####.", "#...#", "#...#", "#...#", "####.",
        ],
        'c' => [
            ".....", ".....", ".###.", "#....", "#....", "#...#", ".###.",
        ],
        'd' => [
            "....#", "....#", ".####", "#...#", "#...#", "#...#", ".####",
        ],
        'e' => [
            ".....", ".....", ".###.", "#...#", "#####", "#....", ".###.",
        ],
        'f' => [
            "..##.", ".#..#", ".#...", "###..", ".#...", ".#...", ".#...",
        ],
        'g' => [
            ".....", ".####", "#...#", "#...#", ".####", "....#", ".###.",
        ],
        'h' => [
            "#....", "#....", "#.##.", "##..#", "#...#", "#...#", "#...#",
        ],
        'i' => [
            "..#..", ".....", ".##..", "..#..", "..#..", "..#..", ".###.",
        ],
        'j' => [
            "...#.", ".....", "..##.", "...#.", "...#.", "#..#.", ".##..",
        ],
        'k' => [
            "#....", "#....", "#..#.", "#.#..", "##...", "#.#..", "#..#.",
        ],
        'l' => [
            ".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###.",
        ],
        'm' => [
            ".....", ".....", "##.#.", "#.#.#", "#.#.#", "#...#", "#...#",
        ],
        'n' => [
            ".....", ".....", "#.##.", "##..#", "#...#", "#...#", "#...#",
        ],
        'o' => [
            ".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###.",
        ],
        'p' => [
            ".....", ".....", "####.", "#...#", "####.", "#....", "#....",
        ],
        'q' => [
            ".....", ".....", ".####", "#...#", ".####", "....#", "....#",
        ],
        'r' => [
            ".....", ".....", "#.##.", "##..#", "#....", "#....", "#....",
        ],
        's' => [
            ".....", ".....", ".####", "#....", ".###.", "....#", "####.",
        ],
        't' => [
            ".#...", ".#...", "###..", ".#...", ".#...", ".#..#", "..##.",
        ],
        'u' => [
            ".....", ".....", "#...#", "#...#", "#...#", "#..##", ".##.#",
        ],
        'v' => [
            ".....", ".....", "#...#", "#...#", "#...#", ".#.#.", "..#..",
        ],
        'w' => [
            ".....", ".....", "#...#", "#...#", "#.#.#", "#.#.#", ".#.#.",
        ],
        'x' => [
            ".....", ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#",
        ],
        'y' => [
            ".....", ".....", "#...#", "#...#", ".####", "....#", ".###.",
        ],
        'z' => [
            ".....", ".....", "#####", "...#.", "..#..", ".#...", "#####",
        ],
        'µ' => [
            ".....", ".....", "#...#", "#...#", "#..##", "###.#", "#....",
        ],
        ' ' => [
            ".....", ".....", ".....", ".....", ".....", ".....", ".....",
        ],
        '.' => [
            ".....", ".....", ".....", ".....", ".....", ".##..", ".##..",
        ],
        ',' => [
            ".....", ".....", ".....", ".....", ".##..", "..#..", ".#...",
        ],
        ':' => [
            ".....", ".##..", ".##..", ".....", ".##..", ".##..", ".....",
        ],
        '-' => [
            ".....", ".....", ".....", "#####", ".....", ".....", ".....",
        ],
        '+' => [
            ".....", "..#..", "..#..", "#####", "..#..", "..#..", ".....",
        ],
        '=' => [
            ".....", ".....", "#####", ".....", "#####", ".....", ".....",
        ],
        '/' => [
            ".....", "....#", "...#.", "..#..", ".#...", "#....", ".....",
        ],
        '(' => [
            "...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#.",
        ],
        ')' => [
            ".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#...",
        ],
        '_' => [
            ".....", ".....", ".....", ".....", ".....", ".....", "#####",
        ],
        '%' => [
            "##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##",
        ],
        '×' => [
            ".....", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", ".....",
        ],
        _ => [
            "#####", "#...#", "#...#", "#...#", "#...#", "#...#", "#####",
        ],
    }
}
