//! Phy's `params.py`: one `name = value` line per parameter, values written as
//! plain Python literals (strings single-quoted with escapes, so any path is
//! read back exactly; numbers in Rust's shortest round-trip form).

use std::path::Path;

use anyhow::{Result, bail};

/// What Phy needs to open the raw recording next to the spike files.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Path of the raw recording (as the caller wants it written: absolute, or relative to the output folder).
    pub dat_path: String,
    /// Channels (columns) in the raw file, including any sync channel.
    pub n_channels_dat: u64,
    /// NumPy name of the sample type in the raw file, such as `int16`.
    pub dtype: String,
    /// Bytes to skip at the start of the raw file.
    pub offset: u64,
    /// Sample rate, Hz.
    pub sample_rate: f64,
    /// Whether the raw file is already high-pass filtered.
    pub hp_filtered: bool,
}

/// A Python string literal for `s`: single quotes; backslash, quote and control
/// characters escaped; other characters kept as they are (Python source is UTF-8).
pub fn py_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// A Python float literal (always with a decimal point or exponent).
///
/// # Errors
/// When `v` is not finite (Python has no literal for it).
pub fn py_float(v: f64, name: &str) -> Result<String> {
    if !v.is_finite() {
        bail!("params.py: {name} = {v} is not a finite number");
    }
    let s = format!("{v:?}");
    Ok(s)
}

impl Params {
    /// The text of `params.py`.
    ///
    /// # Errors
    /// When `sample_rate` is not finite and positive, or `dtype` is not a plain NumPy type name.
    pub fn to_python(&self) -> Result<String> {
        if !(self.sample_rate.is_finite() && self.sample_rate > 0.0) {
            bail!(
                "params.py: sample_rate = {} Hz must be a positive number",
                self.sample_rate
            );
        }
        if self.dtype.is_empty() || !self.dtype.chars().all(|c| c.is_ascii_alphanumeric()) {
            bail!(
                "params.py: dtype `{}` is not a NumPy type name such as int16",
                self.dtype
            );
        }
        Ok(format!(
            "dat_path = {}\nn_channels_dat = {}\ndtype = {}\noffset = {}\nsample_rate = {}\nhp_filtered = {}\n",
            py_str(&self.dat_path),
            self.n_channels_dat,
            py_str(&self.dtype),
            self.offset,
            py_float(self.sample_rate, "sample_rate")?,
            if self.hp_filtered { "True" } else { "False" },
        ))
    }

    /// Writes `params.py` to `path`.
    ///
    /// # Errors
    /// As [`Params::to_python`], and when the file cannot be written.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = self.to_python()?;
        std::fs::write(path, text)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
    }
}
