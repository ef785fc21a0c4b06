//! Sample-type sanity of a flat binary file, before any rescaling: values that
//! only make sense under another dtype (unsigned data read as int16, float32 bit
//! patterns read as int16 or int32, int16 pairs read as float32 or int32) get a
//! warning naming the likely dtype and the flag to give.
//!
//! Kilosort4 reads whatever `data_dtype` says; a wrong one gives garbage or
//! nothing, and its automatic-scale hints then point the wrong way. The check
//! looks at up to [`SAMPLE_BYTES`] bytes from three places of the file's data
//! (after the offset), reinterpreting the same bytes under the other dtypes:
//!
//! * int16 whose values sit mostly beyond ±16 384 (≥ [`WIDE_FRACTION`]): unsigned
//!   data centred on 32 768 wrap to both rails when read as int16 → uint16;
//! * uint16 whose values sit mostly near 0 and 65 535 (≤ 1 − [`WIDE_FRACTION`]
//!   beyond ±16 384 as int16): signed data around 0 → int16;
//! * int16 or int32 whose bytes, read as float32, are ordinary numbers
//!   (≥ [`FLOAT_SANE_FRACTION`] zero or with 1e-12 ≤ |v| ≤ 1e12, at least half
//!   of them non-zero) → float32;
//! * float32 whose values are mostly NaN, infinite or denormal-sized
//!   (|v| < 1e-20) or absurdly large (> 1e20), ≥ [`FLOAT_INSANE_FRACTION`]) →
//!   int16 (or uint16, as above);
//! * int32 whose values are mostly beyond ±2¹⁶ while the 16-bit halves look
//!   like int16 (or uint16) data → int16 (uint16).

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use crate::recording::{Dtype, OpenOptions};

/// Bytes read from each of the three places of the file.
pub const SAMPLE_BYTES: u64 = 1 << 18;

/// Fraction of int16 values beyond ±16 384 above which the data look unsigned.
pub const WIDE_FRACTION: f64 = 0.9;

/// Fraction of ordinary float32 numbers above which the bytes look like float32.
pub const FLOAT_SANE_FRACTION: f64 = 0.95;

/// Fraction of NaN / infinite / denormal-sized float32 values above which
/// float32 data look like 16-bit integers.
pub const FLOAT_INSANE_FRACTION: f64 = 0.5;

/// What the sampled bytes look like under each reading.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DtypeFacts {
    /// int16 values with |v| ≥ 16 384, fraction.
    pub i16_wide: f64,
    /// float32 values that are 0 or 1e-12 ≤ |v| ≤ 1e12, fraction.
    pub f32_sane: f64,
    /// float32 values that are non-zero and ordinary, fraction.
    pub f32_sane_nonzero: f64,
    /// float32 values that are NaN, infinite, or non-zero with |v| < 1e-20 or > 1e20, fraction.
    pub f32_insane: f64,
    /// int32 values with |v| ≥ 2¹⁶ (16-bit pairs with a high half other than 0 and −1), fraction.
    pub i32_big: f64,
}

impl DtypeFacts {
    /// The facts of `bytes` (little-endian; a length that is a multiple of 4).
    pub fn of(bytes: &[u8]) -> Self {
        let n16 = (bytes.len() / 2).max(1) as f64;
        let n32 = (bytes.len() / 4).max(1) as f64;
        let i16_wide = bytes
            .chunks_exact(2)
            .filter(|b| i16::from_le_bytes([b[0], b[1]]).unsigned_abs() >= 16_384)
            .count() as f64
            / n16;
        let (mut sane, mut sane_nz, mut insane, mut big) = (0usize, 0usize, 0usize, 0usize);
        for b in bytes.chunks_exact(4) {
            let q = [b[0], b[1], b[2], b[3]];
            let v = f32::from_le_bytes(q).abs();
            if v == 0.0 {
                sane += 1;
            } else if (1e-12..=1e12).contains(&v) {
                sane += 1;
                sane_nz += 1;
            }
            if !v.is_finite() || (v != 0.0 && v < 1e-20) || v > 1e20 {
                insane += 1;
            }
            if i32::from_le_bytes(q).unsigned_abs() >= 1 << 16 {
                big += 1;
            }
        }
        DtypeFacts {
            i16_wide,
            f32_sane: sane as f64 / n32,
            f32_sane_nonzero: sane_nz as f64 / n32,
            f32_insane: insane as f64 / n32,
            i32_big: big as f64 / n32,
        }
    }

    fn looks_float32(&self) -> bool {
        self.f32_sane >= FLOAT_SANE_FRACTION && self.f32_sane_nonzero >= 0.5
    }

    /// The 16-bit type the bytes look like (int16 or uint16), if either.
    fn sixteen_bit(&self) -> Option<Dtype> {
        if self.i16_wide >= WIDE_FRACTION {
            Some(Dtype::Uint16)
        } else if self.i16_wide <= 1.0 - WIDE_FRACTION {
            Some(Dtype::Int16)
        } else {
            None
        }
    }

    /// The dtype the bytes look like when read as `given`, and why; `None`
    /// when `given` is plausible.
    pub fn suspect(&self, given: Dtype) -> Option<(Dtype, String)> {
        let pct = |f: f64| format!("{:.0} %", 100.0 * f);
        let float = || {
            (
                Dtype::Float32,
                format!(
                    "{} of the values read as float32 are ordinary numbers (1e-12 ≤ |v| ≤ 1e12 or 0)",
                    pct(self.f32_sane)
                ),
            )
        };
        match given {
            Dtype::Int16 if self.looks_float32() => Some(float()),
            Dtype::Int16 if self.i16_wide >= WIDE_FRACTION => Some((
                Dtype::Uint16,
                format!(
                    "{} of the int16 values sit beyond ±16 384 (unsigned data centred on 32 768 wrap to both rails)",
                    pct(self.i16_wide)
                ),
            )),
            Dtype::Uint16 if self.looks_float32() => Some(float()),
            Dtype::Uint16 if self.i16_wide <= 1.0 - WIDE_FRACTION => Some((
                Dtype::Int16,
                format!(
                    "{} of the uint16 values sit within 16 384 of 0 or 65 535 (signed data around 0 wrap to both ends)",
                    pct(1.0 - self.i16_wide)
                ),
            )),
            Dtype::Float32 if self.f32_insane >= FLOAT_INSANE_FRACTION => {
                let alt = self.sixteen_bit().unwrap_or(Dtype::Int16);
                Some((
                    alt,
                    format!(
                        "{} of the float32 values are NaN, infinite or absurdly small or large (|v| < 1e-20 or > 1e20)",
                        pct(self.f32_insane)
                    ),
                ))
            }
            Dtype::Int32 if self.looks_float32() => Some(float()),
            Dtype::Int32 if self.i32_big >= 0.5 => self.sixteen_bit().map(|alt| {
                (
                    alt,
                    format!(
                        "{} of the int32 values are beyond ±65 536 while their 16-bit halves look like {} samples",
                        pct(self.i32_big),
                        alt.name()
                    ),
                )
            }),
            _ => None,
        }
    }
}

/// Reads up to [`SAMPLE_BYTES`] from the start, the middle and three quarters
/// of the data of `path` (after `offset`), each piece starting a multiple of
/// `align` bytes after the offset. Empty when the file cannot be read.
fn sample(path: &Path, offset: u64, align: u64) -> Vec<u8> {
    let Ok(mut f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let Ok(meta) = f.metadata() else {
        return Vec::new();
    };
    let data = meta.len().saturating_sub(offset);
    let piece = SAMPLE_BYTES.min(data) / align * align;
    if piece == 0 {
        return Vec::new();
    }
    let mut starts = vec![0, data / 2 / align * align, data / 4 * 3 / align * align];
    starts.dedup();
    let mut out = Vec::new();
    for s in starts {
        let len = piece.min(data - s) / 4 * 4;
        let mut buf = vec![0u8; len as usize];
        if f.seek(SeekFrom::Start(offset + s)).is_err() || f.read_exact(&mut buf).is_err() {
            return Vec::new();
        }
        out.extend_from_slice(&buf);
    }
    out
}

/// A warning when the flat binary file `path`, read as `opts` says (`dtype`,
/// `offset`, `n_channels`, `fs`), holds values that only make sense under
/// another dtype (module docs): it names the likely dtype with its evidence,
/// the recording's duration under both readings, and the flag to give. `None`
/// when the reading looks right, the options lack a channel count or rate, or
/// the file cannot be read (opening it reports that).
pub fn dtype_warning(path: &Path, opts: &OpenOptions) -> Option<String> {
    let (Some(n_ch), Some(fs)) = (opts.n_channels, opts.fs) else {
        return None;
    };
    if n_ch == 0 || fs.is_nan() || fs <= 0.0 {
        return None;
    }
    let given = opts.dtype;
    let bytes = sample(path, opts.offset, 4 * n_ch * given.itemsize());
    if bytes.len() < 4096 {
        return None;
    }
    let (alt, why) = DtypeFacts::of(&bytes).suspect(given)?;
    let data = std::fs::metadata(path)
        .map(|m| m.len().saturating_sub(opts.offset))
        .unwrap_or(0);
    let secs = |d: Dtype| (data / (n_ch * d.itemsize())) as f64 / fs;
    Some(format!(
        "{}: the samples look like {alt}, not {given}: {why}; read as {given} the file holds {:.2} s, as {alt} {:.2} s. Results read as {given} are likely garbage (or no spikes): use --dtype {alt} (Python: dtype=\"{alt}\")",
        path.display(),
        secs(given),
        secs(alt),
        alt = alt.name(),
        given = given.name(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, sd: f64, seed: u64) -> Vec<f64> {
        // A small deterministic generator: sums of uniforms (≈ normal).
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                let mut acc = 0.0;
                for _ in 0..12 {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    acc += (s >> 11) as f64 / (1u64 << 53) as f64;
                }
                (acc - 6.0) * sd
            })
            .collect()
    }

    fn i16_bytes(x: &[f64]) -> Vec<u8> {
        x.iter()
            .flat_map(|v| (v.round() as i16).to_le_bytes())
            .collect()
    }

    #[test]
    fn each_misreading_is_named_and_right_readings_pass() {
        for sd in [5.0, 10.0, 200.0] {
            let x = noise(40_000, sd, 7);
            let int16 = i16_bytes(&x);
            let uint16: Vec<u8> = x
                .iter()
                .flat_map(|v| ((v.round() + 32768.0) as u16).to_le_bytes())
                .collect();
            let f32_uv: Vec<u8> = x
                .iter()
                .flat_map(|v| ((v.round() * 0.195) as f32).to_le_bytes())
                .collect();
            let f32_v: Vec<u8> = x
                .iter()
                .flat_map(|v| ((v.round() * 0.195e-6) as f32).to_le_bytes())
                .collect();
            let int32: Vec<u8> = x
                .iter()
                .flat_map(|v| (v.round() as i32 * 64).to_le_bytes())
                .collect();
            let of = |b: &[u8], d: Dtype| DtypeFacts::of(b).suspect(d).map(|s| s.0);
            // Right readings.
            assert_eq!(of(&int16, Dtype::Int16), None, "sd {sd}");
            assert_eq!(of(&uint16, Dtype::Uint16), None, "sd {sd}");
            assert_eq!(of(&f32_uv, Dtype::Float32), None, "sd {sd}");
            assert_eq!(of(&f32_v, Dtype::Float32), None, "sd {sd}");
            assert_eq!(of(&int32, Dtype::Int32), None, "sd {sd}");
            // Wrong ones.
            assert_eq!(of(&uint16, Dtype::Int16), Some(Dtype::Uint16), "sd {sd}");
            assert_eq!(of(&int16, Dtype::Uint16), Some(Dtype::Int16), "sd {sd}");
            assert_eq!(of(&f32_uv, Dtype::Int16), Some(Dtype::Float32), "sd {sd}");
            assert_eq!(of(&f32_v, Dtype::Int16), Some(Dtype::Float32), "sd {sd}");
            assert_eq!(of(&f32_uv, Dtype::Int32), Some(Dtype::Float32), "sd {sd}");
            assert_eq!(of(&int16, Dtype::Float32), Some(Dtype::Int16), "sd {sd}");
            assert_eq!(of(&uint16, Dtype::Float32), Some(Dtype::Uint16), "sd {sd}");
            assert_eq!(of(&int16, Dtype::Int32), Some(Dtype::Int16), "sd {sd}");
        }
        // All zeros: nothing to say.
        assert_eq!(DtypeFacts::of(&[0u8; 4096]).suspect(Dtype::Int16), None);
    }
}
