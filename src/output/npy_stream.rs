//! A `.npy` file written row by row: the header is written first with room for
//! any row count, rows are appended as raw little-endian bytes, and
//! [`NpyStream::finish`] rewrites the header with the final count.
//!
//! The header is a valid `.npy` version 1.0 header at every moment (its shape
//! says 0 rows until `finish`), padded with spaces so that the data starts at
//! a multiple of 64 bytes. Its length does not depend on the count: it is
//! sized for the widest count (20 decimal digits), so patching never moves the data.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Magic string and version 1.0 of the `.npy` format.
const MAGIC: &[u8] = b"\x93NUMPY\x01\x00";
/// Widest row count, in decimal digits (u64::MAX has 20).
const COUNT_WIDTH: usize = 20;

/// A `.npy` file being written row by row.
///
/// Shape `(rows, inner...)`: `inner` is fixed at creation, `rows` grows with
/// [`NpyStream::append_bytes`]. Memory use is one buffered writer (64 KiB),
/// whatever the row count.
#[derive(Debug)]
pub struct NpyStream {
    path: PathBuf,
    w: BufWriter<File>,
    descr: String,
    inner: Vec<usize>,
    row_bytes: usize,
    rows: u64,
    header_len: usize,
}

/// The header text (dictionary, spaces, newline) for `rows` rows, padded to `total` bytes
/// including the 10-byte prefix, or to the next multiple of 64 when `total` is `None`.
fn header(descr: &str, rows: &str, inner: &[usize], total: Option<usize>) -> Vec<u8> {
    let mut shape = rows.to_string();
    for d in inner {
        shape.push_str(&format!(", {d}"));
    }
    if inner.is_empty() {
        shape.push(',');
    }
    let dict = format!("{{'descr': {descr}, 'fortran_order': False, 'shape': ({shape}), }}");
    let unpadded = MAGIC.len() + 2 + dict.len() + 1;
    let total = total.unwrap_or(unpadded.div_ceil(64) * 64);
    // The reserved width holds any u64 count, so the text always fits.
    debug_assert!(
        unpadded <= total,
        "npy header text longer than its reserved size"
    );
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(MAGIC);
    let len = (total - MAGIC.len() - 2) as u16;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.resize(total - 1, b' ');
    out.push(b'\n');
    out
}

impl NpyStream {
    /// Creates `path` for an array of element type `descr` (a Python literal as it
    /// appears in the header: `'<i8'`, `'<f4'`, or a structured list such as
    /// `[('a', '<i8'), ('b', '<f8')]`) whose rows have shape `inner` and take
    /// `row_bytes` bytes each.
    ///
    /// # Errors
    /// When the file cannot be created or written (the path is named).
    pub fn create(path: &Path, descr: &str, inner: &[usize], row_bytes: usize) -> Result<Self> {
        let widest = "9".repeat(COUNT_WIDTH);
        let h = header(descr, &widest, inner, None);
        let header_len = h.len();
        if header_len - MAGIC.len() - 2 > u16::MAX as usize {
            bail!(
                "{}: the .npy header would be too long for format 1.0",
                path.display()
            );
        }
        let f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = BufWriter::with_capacity(1 << 16, f);
        w.write_all(&header(descr, "0", inner, Some(header_len)))
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(NpyStream {
            path: path.to_owned(),
            w,
            descr: descr.to_owned(),
            inner: inner.to_vec(),
            row_bytes,
            rows: 0,
            header_len,
        })
    }

    /// Appends `bytes.len() / row_bytes` rows of raw little-endian data.
    ///
    /// # Errors
    /// When `bytes` is not a whole number of rows, or writing fails.
    pub fn append_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        if self.row_bytes == 0 || !bytes.len().is_multiple_of(self.row_bytes) {
            bail!(
                "{}: {} bytes is not a whole number of {}-byte rows",
                self.path.display(),
                bytes.len(),
                self.row_bytes
            );
        }
        self.w
            .write_all(bytes)
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        self.rows += (bytes.len() / self.row_bytes) as u64;
        Ok(())
    }

    /// Asks the operating system to start writing the data appended so far to
    /// the disk, without waiting for it (Linux's `sync_file_range` with
    /// `SYNC_FILE_RANGE_WRITE`), so that the disk works while later rows are
    /// made and [`NpyStream::finish`]'s sync has less left to wait for. Only a
    /// hint: elsewhere, or when the call fails, nothing happens (the data is
    /// still synced by `finish`).
    ///
    /// # Errors
    /// When the buffered rows cannot be written.
    pub fn start_writeback(&mut self) -> Result<()> {
        self.w
            .flush()
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let fd = self.w.get_ref().as_raw_fd();
            // SAFETY: a plain system call on an open descriptor; offset 0 and
            // length 0 mean the whole file.
            unsafe {
                libc::sync_file_range(fd, 0, 0, libc::SYNC_FILE_RANGE_WRITE);
            }
        }
        Ok(())
    }

    /// Rows written so far.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Flushes the data, writes the final row count into the header and syncs the file.
    ///
    /// # Errors
    /// When writing or syncing fails (the path is named).
    pub fn finish(self) -> Result<u64> {
        self.finish_with(true)
    }

    /// [`NpyStream::finish`], syncing the file to the disk only when `sync`
    /// (a working file that a later stage of the same process reads and then
    /// removes needs no sync).
    ///
    /// # Errors
    /// When writing or syncing fails (the path is named).
    pub fn finish_with(self, sync: bool) -> Result<u64> {
        let NpyStream {
            path,
            w,
            descr,
            inner,
            rows,
            header_len,
            ..
        } = self;
        let ctx = || format!("cannot finish {}", path.display());
        let mut f = w
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(ctx)?;
        f.seek(SeekFrom::Start(0)).with_context(ctx)?;
        f.write_all(&header(&descr, &rows.to_string(), &inner, Some(header_len)))
            .with_context(ctx)?;
        if sync {
            f.sync_all().with_context(ctx)?;
        } else {
            f.flush().with_context(ctx)?;
        }
        Ok(rows)
    }
}

/// Little-endian bytes of a slice of numbers, for [`NpyStream::append_bytes`].
pub trait LeBytes: Copy {
    /// Appends the little-endian bytes of `self` to `out`.
    fn put(self, out: &mut Vec<u8>);
}

macro_rules! le_bytes {
    ($($t:ty),*) => {$(
        impl LeBytes for $t {
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
le_bytes!(i8, u8, i16, i32, u32, i64, u64, f32, f64);

/// Bytes converted per write by [`write_all`].
const CHUNK_BYTES: usize = 1 << 20;

/// Writes a whole array through [`NpyStream`] (same header layout), converting
/// it to bytes about 1 MiB at a time.
///
/// # Errors
/// As [`NpyStream::create`] and [`NpyStream::finish`].
pub fn write_all<T: LeBytes>(
    path: &Path,
    descr: &str,
    shape: &[usize],
    values: &[T],
) -> Result<()> {
    let (rows, inner) = shape.split_first().map_or((0, &[][..]), |(r, i)| (*r, i));
    let per_row: usize = inner.iter().product();
    if rows * per_row != values.len() {
        bail!(
            "{}: shape {shape:?} needs {} values, got {}",
            path.display(),
            rows * per_row,
            values.len()
        );
    }
    let size = std::mem::size_of::<T>();
    let mut s = NpyStream::create(path, descr, inner, per_row * size)?;
    if per_row > 0 {
        // Whole rows of about 1 MiB at a time: no copy of the whole array.
        let rows_per_chunk = (CHUNK_BYTES / (per_row * size)).max(1);
        let mut buf = Vec::with_capacity(rows_per_chunk * per_row * size);
        for chunk in values.chunks(rows_per_chunk * per_row) {
            buf.clear();
            for &v in chunk {
                v.put(&mut buf);
            }
            s.append_bytes(&buf)?;
        }
    } else {
        // Rows of zero elements carry no bytes; the count is only in the header.
        s.rows = rows as u64;
    }
    s.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream finished without the sync is the same file as one finished with it.
    #[test]
    fn finishing_without_the_sync_writes_the_same_file() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<f32> = (0..12).map(|v| v as f32 * 0.5).collect();
        let mut bytes = Vec::new();
        rows.iter().for_each(|&v| v.put(&mut bytes));
        let mut files = Vec::new();
        for sync in [true, false] {
            let path = dir.path().join(format!("a_{sync}.npy"));
            let mut s = NpyStream::create(&path, "'<f4'", &[3], 12).unwrap();
            s.append_bytes(&bytes).unwrap();
            assert_eq!(s.finish_with(sync).unwrap(), 4);
            files.push(std::fs::read(&path).unwrap());
        }
        assert_eq!(files[0], files[1]);
        let a: ndarray::Array2<f32> =
            ndarray_npy::read_npy(dir.path().join("a_false.npy")).unwrap();
        assert_eq!(a.shape(), &[4, 3]);
        assert_eq!(a.iter().copied().collect::<Vec<_>>(), rows);
    }
}
