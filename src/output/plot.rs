//! Shared pieces of the output pictures (drift map, probe layout), drawn with
//! `plotters` into an RGB buffer and saved as PNG through the `image` crate.
//!
//! Text uses DejaVu Sans, embedded in the program (`data/fonts/DejaVuSans.ttf`,
//! Bitstream Vera licence, see `data/fonts/DejaVuSans-LICENSE.txt`) and handed
//! to plotters' `ab_glyph` renderer, so no system font is needed.

use std::path::Path;
use std::sync::Once;

use anyhow::{Context, Result, anyhow};
use plotters::style::colors::colormaps::ViridisRGB;
use plotters::style::{FontStyle, RGBColor};

/// The font family name every picture uses (registered by [`register_font`]).
pub const FONT: &str = "sans-serif";

static FONT_BYTES: &[u8] = include_bytes!("../../data/fonts/DejaVuSans.ttf");

/// Registers the embedded font with plotters (once per process).
///
/// # Errors
/// Never in practice: only when the embedded font file were not a valid font.
pub fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result =
            plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES).map_err(|_| {
                anyhow!("the embedded font data/fonts/DejaVuSans.ttf is not a valid font")
            });
    });
    result
}

/// The perceptually uniform colour map of the pictures, for `t` in 0–1: viridis
/// from its dark purple to green (the part up to 0.85), so that both ends stay
/// visible on a white background (viridis' last, light yellow part is left out).
pub fn colour_map(t: f64) -> RGBColor {
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    };
    ViridisRGB::get_color(0.85 * t as f32)
}

/// Distinct colours for categories (shanks), cycling after eight.
pub fn category_colour(i: usize) -> RGBColor {
    const C: [(u8, u8, u8); 8] = [
        (31, 119, 180),
        (214, 39, 40),
        (44, 160, 44),
        (148, 103, 189),
        (255, 127, 14),
        (23, 190, 207),
        (140, 86, 75),
        (188, 189, 34),
    ];
    let (r, g, b) = C[i % C.len()];
    RGBColor(r, g, b)
}

/// Turns a plotters error (whose backend error type varies) into an error
/// naming the picture.
pub fn plot_err<E: std::fmt::Debug>(path: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow!("cannot draw {}: {e:?}", path.display())
}

/// Saves an RGB buffer of `width × height` pixels as an 8-bit PNG.
///
/// # Errors
/// When the buffer does not match the size or the file cannot be written (the
/// path is named).
pub fn save_png(path: &Path, buf: Vec<u8>, width: u32, height: u32) -> Result<()> {
    let img = image::RgbImage::from_raw(width, height, buf)
        .context("picture buffer does not match its size")?;
    img.save_with_format(path, image::ImageFormat::Png)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// A font size that lets `text` fit `width` pixels: `size` or smaller (DejaVu
/// Sans glyphs average about 0.6 × the size), never below 12.
pub fn fitting_size(text: &str, width: f64, size: f64) -> f64 {
    let needed = 0.6 * size * text.chars().count() as f64;
    if needed <= width {
        size
    } else {
        (size * width / needed).max(12.0)
    }
}

/// Formats an axis tick value with no trailing zeros (`2500`, `0.25`, `-40`).
pub fn tick_text(v: &f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}
