//! Kilosort4's own sort arrays, as recorded by
//! `tests/data/sort/make_sort_fixtures.py` (`np.savez_compressed` files), read
//! as the input of spikecube's merges and Phy export: the export's check
//! against Kilosort4 and the hidden `spikecube export-phy` command use them.
//!
//! Files read from one folder: `ops.npz` (wPCA, Wrot, fs, settings_json),
//! `extract_out.npz` (st, tF, iCC, iCC_mask, iU), `final_out.npz` (clu, Wall)
//! and, for the already-merged variant, `merge_out.npz` (Wall, clu, is_ref, st, tF).

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ndarray::{Array, Array1, Array3, Dimension};
use ndarray_npy::{ReadNpyExt, ReadableElement};

use super::phy::{ExportSettings, SortResult};
use crate::sort::merge::Merged;
use crate::sort::postprocess::ChannelSets;

/// The members of a `.npz` file (stored or deflated), by name without `.npy`.
#[derive(Debug)]
pub struct Npz {
    path: PathBuf,
    entries: HashMap<String, Vec<u8>>,
}

fn u16_at(b: &[u8], o: usize) -> Result<u16> {
    b.get(o..o + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .context("truncated zip structure")
}

fn u32_at(b: &[u8], o: usize) -> Result<u32> {
    b.get(o..o + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .context("truncated zip structure")
}

fn u64_at(b: &[u8], o: usize) -> Result<u64> {
    let lo = u64::from(u32_at(b, o)?);
    let hi = u64::from(u32_at(b, o + 4)?);
    Ok(lo | (hi << 32))
}

/// (compressed size, local header offset) of a central entry, zip64 fields applied.
fn zip64_fields(b: &[u8], e: usize, comp: u64, uncomp: u64, off: u64) -> Result<(u64, u64)> {
    let (nlen, xlen) = (u16_at(b, e + 28)? as usize, u16_at(b, e + 30)? as usize);
    let mut x = e + 46 + nlen;
    let end = x + xlen;
    let (mut comp, mut off) = (comp, off);
    while x + 4 <= end {
        let (id, len) = (u16_at(b, x)?, u16_at(b, x + 2)? as usize);
        if id == 1 {
            let mut p = x + 4;
            if uncomp == 0xFFFF_FFFF {
                p += 8;
            }
            if comp == 0xFFFF_FFFF {
                comp = u64_at(b, p)?;
                p += 8;
            }
            if off == 0xFFFF_FFFF {
                off = u64_at(b, p)?;
            }
        }
        x += 4 + len;
    }
    Ok((comp, off))
}

impl Npz {
    /// Reads every member of `path`.
    ///
    /// # Errors
    /// When the file cannot be read, is not a zip file, or uses a compression
    /// other than stored or deflate.
    pub fn open(path: &Path) -> Result<Npz> {
        let b = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let entries = Self::parse(&b)
            .with_context(|| format!("{}: not a readable .npz file", path.display()))?;
        Ok(Npz {
            path: path.to_path_buf(),
            entries,
        })
    }

    fn parse(b: &[u8]) -> Result<HashMap<String, Vec<u8>>> {
        let eocd = (0..b.len().saturating_sub(21))
            .rev()
            .find(|&i| b[i..i + 4] == [0x50, 0x4b, 0x05, 0x06])
            .context("no end of central directory")?;
        let mut count = u64::from(u16_at(b, eocd + 10)?);
        let mut cd = u64::from(u32_at(b, eocd + 16)?);
        if (cd == 0xFFFF_FFFF || count == 0xFFFF)
            && eocd >= 20
            && u32_at(b, eocd - 20)? == 0x0706_4b50
        {
            let z = u64_at(b, eocd - 12)? as usize;
            count = u64_at(b, z + 32)?;
            cd = u64_at(b, z + 48)?;
        }
        let mut e = cd as usize;
        let mut out = HashMap::new();
        for _ in 0..count {
            if u32_at(b, e)? != 0x0201_4b50 {
                bail!("bad central directory entry");
            }
            let method = u16_at(b, e + 10)?;
            let comp = u64::from(u32_at(b, e + 20)?);
            let uncomp = u64::from(u32_at(b, e + 24)?);
            let (nlen, xlen, clen) = (
                u16_at(b, e + 28)? as usize,
                u16_at(b, e + 30)? as usize,
                u16_at(b, e + 32)? as usize,
            );
            let off = u64::from(u32_at(b, e + 42)?);
            let name =
                String::from_utf8_lossy(b.get(e + 46..e + 46 + nlen).context("name")?).into_owned();
            let (comp, off) = zip64_fields(b, e, comp, uncomp, off)?;
            let l = off as usize;
            if u32_at(b, l)? != 0x0403_4b50 {
                bail!("bad local header for {name}");
            }
            let start = l + 30 + u16_at(b, l + 26)? as usize + u16_at(b, l + 28)? as usize;
            let data = b
                .get(start..start + comp as usize)
                .context("truncated member")?;
            let bytes = match method {
                0 => data.to_vec(),
                8 => {
                    let mut v = Vec::new();
                    flate2::read::DeflateDecoder::new(data).read_to_end(&mut v)?;
                    v
                }
                m => bail!("member {name} uses zip compression method {m}"),
            };
            let key = name.strip_suffix(".npy").unwrap_or(&name).to_string();
            out.insert(key, bytes);
            e += 46 + nlen + xlen + clen;
        }
        Ok(out)
    }

    /// Whether the file has member `name`.
    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Member `name` as an array of element type `A` and dimension `D`.
    ///
    /// # Errors
    /// When the member is missing or its dtype or rank differ.
    pub fn get<A: ReadableElement, D: Dimension>(&self, name: &str) -> Result<Array<A, D>> {
        let bytes = self
            .entries
            .get(name)
            .with_context(|| format!("{} has no array `{name}`", self.path.display()))?;
        Array::<A, D>::read_npy(&bytes[..]).with_context(|| {
            format!(
                "{}: array `{name}` has another dtype or rank",
                self.path.display()
            )
        })
    }

    /// A 0-d NumPy unicode string member (`<U…`, UTF-32LE), such as `settings_json`.
    ///
    /// # Errors
    /// When the member is missing or is not a unicode scalar.
    pub fn get_str(&self, name: &str) -> Result<String> {
        let bytes = self
            .entries
            .get(name)
            .with_context(|| format!("{} has no member `{name}`", self.path.display()))?;
        let hlen_at = if bytes.get(6) == Some(&1) { 2 } else { 4 };
        let hlen = if hlen_at == 2 {
            u16_at(bytes, 8)? as usize
        } else {
            u32_at(bytes, 8)? as usize
        };
        let start = 8 + hlen_at + hlen;
        let header = String::from_utf8_lossy(bytes.get(8 + hlen_at..start).context("header")?);
        if !header.contains("'<U") {
            bail!("{}: `{name}` is not a unicode string", self.path.display());
        }
        let chars: Option<String> = bytes[start..]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .take_while(|&c| c != 0)
            .map(char::from_u32)
            .collect();
        chars.with_context(|| format!("{}: `{name}` is not valid UTF-32", self.path.display()))
    }
}

/// The recording's files from the settings' `filename`: one path, or a list
/// written as Python's `str` of a list (`['a.bin', 'b.bin']`).
fn file_list(s: &str) -> Vec<PathBuf> {
    let t = s.trim();
    match t.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        Some(inner) => inner
            .split(", ")
            .map(|p| p.trim().trim_matches(|c| c == '\'' || c == '"'))
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .collect(),
        None => vec![PathBuf::from(t)],
    }
}

fn to_usize<D: Dimension>(a: Array<i64, D>, what: &str) -> Result<Array<usize, D>> {
    if let Some(v) = a.iter().find(|&&v| v < 0) {
        bail!("{what} holds a negative index {v}");
    }
    Ok(a.mapv(|v| v as usize))
}

/// Kilosort4's arrays of one fixture folder, ready for [`super::phy`].
#[derive(Debug, Clone)]
pub struct KilosortArrays {
    /// The final clustering's result (`final_out.npz`, `extract_out.npz`, `ops.npz`).
    pub result: SortResult,
    /// Kilosort4's merged arrays (`merge_out.npz`), when the folder has them.
    pub merged: Option<Merged>,
    /// Export settings from `ops.npz`'s settings (fs, n_chan_bin, filename,
    /// tmin, duplicate_spike_ms, acg/ccg thresholds); dtype int16.
    pub settings: ExportSettings,
}

/// Reads a fixture folder (module docs).
///
/// # Errors
/// When a file or array is missing or has another dtype or shape.
pub fn load(dir: &Path) -> Result<KilosortArrays> {
    let ops = Npz::open(&dir.join("ops.npz"))?;
    let ext = Npz::open(&dir.join("extract_out.npz"))?;
    let fin = Npz::open(&dir.join("final_out.npz"))?;
    // Python's json writes inf and nan as bare words (`"tmax": Infinity`).
    let text = ops
        .get_str("settings_json")?
        .replace(": -Infinity", ": null")
        .replace(": Infinity", ": null")
        .replace(": NaN", ": null");
    let settings: serde_json::Value =
        serde_json::from_str(&text).context("ops.npz: settings_json is not JSON")?;
    let num = |k: &str, d: f64| settings.get(k).and_then(|v| v.as_f64()).unwrap_or(d);
    let fs = ops
        .get::<f64, ndarray::Ix0>("fs")
        .map(|a| a.into_scalar())
        .unwrap_or(num("fs", 30000.0));
    let filename = settings
        .get("filename")
        .and_then(|v| v.as_str())
        .unwrap_or("no_path.bin");
    let mut es = ExportSettings::new(fs, num("n_chan_bin", 0.0) as u64, file_list(filename));
    es.imin = ((num("tmin", 0.0) * fs) as i64).max(0);
    es.duplicate_spike_ms = num("duplicate_spike_ms", 0.25);
    es.merge.thresholds.acg = num("acg_threshold", 0.2);
    es.merge.thresholds.ccg = num("ccg_threshold", 0.25);

    let sets = ChannelSets {
        icc: to_usize(ext.get::<i64, ndarray::Ix2>("iCC")?, "iCC")?,
        icc_mask: ext.get::<bool, ndarray::Ix2>("iCC_mask")?,
        iu: to_usize(ext.get::<i64, ndarray::Ix1>("iU")?, "iU")?.to_vec(),
    };
    let result = SortResult {
        st: ext.get::<f64, ndarray::Ix2>("st")?,
        tf: ext.get::<f32, ndarray::Ix3>("tF")?,
        clu: fin.get::<i32, ndarray::Ix1>("clu")?.to_vec(),
        wall: fin.get::<f32, ndarray::Ix3>("Wall")?,
        wpca: ops.get::<f32, ndarray::Ix2>("wPCA")?,
        wrot: ops.get::<f32, ndarray::Ix2>("Wrot")?,
        sets,
    };
    let merged = if dir.join("merge_out.npz").exists() {
        let m = Npz::open(&dir.join("merge_out.npz"))?;
        let is_ref: Array1<bool> = match m.get::<bool, ndarray::Ix1>("is_ref") {
            Ok(a) => a,
            Err(_) => m.get::<f64, ndarray::Ix1>("is_ref")?.mapv(|v| v != 0.0),
        };
        let clu: Vec<i32> = match m.get::<i32, ndarray::Ix1>("clu") {
            Ok(a) => a.to_vec(),
            Err(_) => m
                .get::<i64, ndarray::Ix1>("clu")?
                .iter()
                .map(|&v| v as i32)
                .collect(),
        };
        let wall: Array3<f32> = m.get("Wall")?;
        Some(Merged {
            n_merges: result.wall.shape()[0].saturating_sub(wall.shape()[0]),
            n_refused: 0,
            wall,
            clu,
            is_ref: is_ref.to_vec(),
            st: m.get::<f64, ndarray::Ix2>("st")?,
            tf: m.get("tF")?,
        })
    } else {
        None
    };
    Ok(KilosortArrays {
        result,
        merged,
        settings: es,
    })
}
