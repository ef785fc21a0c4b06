//! Flat, headerless, sample-major binary files, memory-mapped.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;

use super::{Dtype, Recording, check_read, nearest_channel_counts};
use crate::error::RecordingError;

/// What to do with bytes after the last whole frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartialFrame {
    /// Refuse the file (flat binary: the user's channel count is likely wrong).
    Error,
    /// Ignore the bytes with a warning (SpikeGLX, Open Ephys: an interrupted write).
    Warn,
}

/// Parameters of a flat binary file.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BinaryParams {
    pub n_channels: u64,
    pub fs: f64,
    pub dtype: Dtype,
    pub offset: u64,
    pub scale: Option<f32>,
    pub shift: Option<f32>,
    pub partial_frame: PartialFrame,
}

/// A flat binary file (sample-major: all channels of sample 0, then of sample 1,
/// ...), little-endian, memory-mapped (int16 files are read with positional
/// reads on unix). Samples are converted to f32 only when read.
#[derive(Debug)]
pub struct BinaryRecording {
    path: PathBuf,
    map: Option<Mmap>,
    /// The file, for positional reads (int16, unix).
    file: File,
    n_channels: usize,
    n_samples: u64,
    fs: f64,
    dtype: Dtype,
    offset: u64,
    scale: Option<f32>,
    shift: Option<f32>,
}

impl BinaryRecording {
    /// Opens `path` as a flat binary file of `n_channels` channels of `dtype`,
    /// skipping `offset` header bytes; `fs` in Hz.
    ///
    /// The sample count is `floor((file size − offset) / (n_channels · itemsize))`;
    /// any remainder is an error ([`RecordingError::Size`], with the nearest
    /// channel counts that would fit).
    ///
    /// # Errors
    /// [`RecordingError::Io`] when the file cannot be opened or mapped,
    /// [`RecordingError::Setting`] for a zero channel count, a non-positive rate or
    /// an offset past the end, [`RecordingError::Size`] for a partial frame.
    pub fn open_flat(
        path: &Path,
        n_channels: u64,
        fs: f64,
        dtype: Dtype,
        offset: u64,
    ) -> Result<Self, RecordingError> {
        Self::open(
            path,
            &BinaryParams {
                n_channels,
                fs,
                dtype,
                offset,
                scale: None,
                shift: None,
                partial_frame: PartialFrame::Error,
            },
        )
    }

    pub(crate) fn open(path: &Path, p: &BinaryParams) -> Result<Self, RecordingError> {
        let setting = |setting: &'static str, message: String| RecordingError::Setting {
            path: path.to_owned(),
            setting,
            message,
        };
        if p.n_channels == 0 || p.n_channels > u32::MAX as u64 {
            return Err(setting(
                "n_chan_bin",
                format!("{} channels is not a usable channel count", p.n_channels),
            ));
        }
        if !(p.fs.is_finite() && p.fs > 0.0) {
            return Err(setting(
                "fs",
                format!("{} Hz is not a usable sampling rate", p.fs),
            ));
        }
        let io = |source| RecordingError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let file_bytes = file.metadata().map_err(io)?.len();
        if p.offset > file_bytes {
            return Err(setting(
                "offset",
                format!(
                    "offset {} bytes is past the end of the {file_bytes}-byte file",
                    p.offset
                ),
            ));
        }
        let data_bytes = file_bytes - p.offset;
        let itemsize = p.dtype.itemsize();
        let frame_bytes = p.n_channels * itemsize;
        let remainder = data_bytes % frame_bytes;
        let n_samples = data_bytes / frame_bytes;
        if remainder != 0 {
            match p.partial_frame {
                PartialFrame::Error => {
                    return Err(RecordingError::Size {
                        path: path.to_owned(),
                        file_bytes,
                        offset: p.offset,
                        data_bytes,
                        dtype: p.dtype.name(),
                        itemsize,
                        n_channels: p.n_channels,
                        frame_bytes,
                        remainder,
                        nearest: nearest_channel_counts(data_bytes, itemsize, p.n_channels),
                    });
                }
                PartialFrame::Warn => super::open_warning(format!(
                    "{}: {} bytes after the last whole frame are ignored: {data_bytes} data bytes = {n_samples} frames of {frame_bytes} bytes ({} channels × {itemsize} bytes of {}) + {remainder} bytes",
                    path.display(),
                    remainder,
                    p.n_channels,
                    p.dtype.name()
                )),
            }
        }
        // An empty file cannot be mapped on every platform; keep `None` then.
        let map = if file_bytes == 0 {
            None
        } else {
            // SAFETY: the map is read-only. Like every reader of a memory-mapped
            // file we rely on nobody truncating the file while it is open.
            Some(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        Ok(BinaryRecording {
            path: path.to_owned(),
            map,
            file,
            n_channels: p.n_channels as usize,
            n_samples,
            fs: p.fs,
            dtype: p.dtype,
            offset: p.offset,
            scale: p.scale,
            shift: p.shift,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The sample type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
}

/// Decodes samples `start .. start + count` of the columns `chan_map` into
/// rows of `stride` values of `out` (row i at `i·stride`), `conv` turning one
/// item's bytes into a value.
#[allow(clippy::too_many_arguments)]
fn decode<const N: usize, T: Send>(
    data: &[u8],
    start: u64,
    count: usize,
    stride: usize,
    n_channels: usize,
    chan_map: &[u64],
    out: &mut [T],
    conv: impl Fn([u8; N]) -> T + Sync,
) {
    let frame = n_channels * N;
    let base = start as usize * frame;
    // Runs of DECODE_CHUNK samples in parallel: each run fills its own columns
    // of every output row (a list of row pieces per run).
    let n_runs = count.div_ceil(DECODE_CHUNK);
    let mut runs: Vec<Vec<&mut [T]>> = (0..n_runs)
        .map(|_| Vec::with_capacity(chan_map.len()))
        .collect();
    for row in out.chunks_mut(stride.max(1)).take(chan_map.len()) {
        for (run, piece) in runs.iter_mut().zip(row[..count].chunks_mut(DECODE_CHUNK)) {
            run.push(piece);
        }
    }
    runs.into_par_iter().enumerate().for_each(|(i, mut rows)| {
        let t0 = i * DECODE_CHUNK;
        let len = rows.first().map_or(0, |r| r.len());
        // Row by row over DECODE_BLOCK frames at a time: the frames stay in
        // the L1/L2 cache while each row's values are stored contiguously.
        let mut d0 = 0;
        while d0 < len {
            let d1 = (d0 + DECODE_BLOCK).min(len);
            let frames = &data[base + (t0 + d0) * frame..base + (t0 + d1) * frame];
            // One sequential touch per cache line first, so that the strided
            // reads below hit the cache instead of waiting on memory each.
            let touch = frames.iter().step_by(64).fold(0u8, |a, &b| a ^ b);
            std::hint::black_box(touch);
            for (piece, &c) in rows.iter_mut().zip(chan_map) {
                let o = c as usize * N;
                for (v, f) in piece[d0..d1].iter_mut().zip(frames.chunks_exact(frame)) {
                    let mut b = [0u8; N];
                    b.copy_from_slice(&f[o..o + N]);
                    *v = conv(b);
                }
            }
            d0 = d1;
        }
    });
}

/// [`decode`] for int16 files: the same values in the same places, with the
/// frames transposed 8 channels × 8 samples at a time ([`transpose8x8`])
/// instead of one value at a time; `conv` turns a value into the output type.
/// Channel groups that run past the frame's end, and samples past the last
/// whole 8, are decoded one value at a time. The frames come from `source`.
///
/// # Errors
/// When a positional read fails.
#[allow(clippy::too_many_arguments)]
fn decode_i16<T: Send>(
    source: Frames<'_>,
    start: u64,
    count: usize,
    stride: usize,
    n_channels: usize,
    chan_map: &[u64],
    out: &mut [T],
    conv: impl Fn(i16) -> T + Sync,
) -> std::io::Result<()> {
    let frame = n_channels * 2;
    let base = start as usize * frame;
    // (file channel, output row), by channel: the rows each group of eight
    // channels feeds (a channel may feed several rows, or none).
    let mut feeds: Vec<(usize, usize)> = chan_map
        .iter()
        .enumerate()
        .map(|(r, &c)| (c as usize, r))
        .collect();
    feeds.sort_unstable();
    let mut groups: Vec<(usize, &[(usize, usize)])> = Vec::new();
    let mut rest = &feeds[..];
    while let Some(&(c, _)) = rest.first() {
        let g = c / 8;
        let n = rest.iter().take_while(|&&(c, _)| c / 8 == g).count();
        groups.push((g * 8, &rest[..n]));
        rest = &rest[n..];
    }
    let n_runs = count.div_ceil(DECODE_CHUNK);
    let mut runs: Vec<Vec<&mut [T]>> = (0..n_runs)
        .map(|_| Vec::with_capacity(chan_map.len()))
        .collect();
    for row in out.chunks_mut(stride.max(1)).take(chan_map.len()) {
        for (run, piece) in runs.iter_mut().zip(row[..count].chunks_mut(DECODE_CHUNK)) {
            run.push(piece);
        }
    }
    let value = |f: &[u8], c: usize| i16::from_le_bytes([f[2 * c], f[2 * c + 1]]);
    runs.into_par_iter()
        .enumerate()
        .try_for_each(|(i, mut rows)| {
            let t0 = i * DECODE_CHUNK;
            let len = rows.first().map_or(0, |r| r.len());
            let mut d0 = 0;
            let mut scratch = Vec::new();
            while d0 < len {
                let d1 = (d0 + DECODE_BLOCK).min(len);
                let (a, b) = (base + (t0 + d0) * frame, base + (t0 + d1) * frame);
                let frames: &[u8] = match &source {
                    Frames::Map(data, _) => {
                        let frames = &data[a..b];
                        // One sequential touch per cache line first, so that
                        // the loads below hit the cache.
                        let touch = frames.iter().step_by(64).fold(0u8, |a, &b| a ^ b);
                        std::hint::black_box(touch);
                        frames
                    }
                    #[cfg(unix)]
                    Frames::Read(file, offset) => {
                        use std::os::unix::fs::FileExt;
                        scratch.resize(b - a, 0u8);
                        file.read_exact_at(&mut scratch, offset + a as u64)?;
                        &scratch
                    }
                };
                // Samples d0 .. d0 + whole: in tiles of eight.
                let whole = (d1 - d0) / 8 * 8;
                for &(c0, feeds) in &groups {
                    let tiled = if c0 + 8 <= n_channels { whole } else { 0 };
                    for k in (0..tiled).step_by(8) {
                        let tile = transpose8x8(&frames[k * frame..], frame, 2 * c0);
                        for &(c, r) in feeds {
                            let dst = &mut rows[r][d0 + k..d0 + k + 8];
                            for (v, &x) in dst.iter_mut().zip(&tile[c - c0]) {
                                *v = conv(x);
                            }
                        }
                    }
                    for &(c, r) in feeds {
                        let dst = &mut rows[r][d0 + tiled..d1];
                        let src = frames[tiled * frame..].chunks_exact(frame);
                        for (v, f) in dst.iter_mut().zip(src) {
                            *v = conv(value(f, c));
                        }
                    }
                }
                d0 = d1;
            }
            if let Frames::Map(_, release) = &source {
                release(start + t0 as u64, len);
            }
            Ok(())
        })
}

/// Where [`decode_i16`] takes a file's frames from.
enum Frames<'a> {
    /// The memory map from the first frame; each run calls `release(first
    /// sample, count)` on its samples once they are decoded.
    #[cfg_attr(unix, allow(dead_code))]
    Map(&'a [u8], &'a (dyn Fn(u64, usize) + Sync)),
    /// Positional reads (`pread`) of the file, frame 0 at this byte offset,
    /// into a block buffer per run: no page of the file is mapped, so there
    /// are no page faults, nothing to release and nothing for many threads
    /// to contend on in the process's memory map.
    #[cfg(unix)]
    Read(&'a File, u64),
}

/// Eight frames' values of the eight channels starting at byte `off` of each
/// frame (frame k at `frames[k·frame ..]`), transposed: `[channel][frame]`.
///
/// # Panics
/// When `frames` holds fewer than `7·frame + off + 16` bytes.
#[cfg(target_arch = "x86_64")]
fn transpose8x8(frames: &[u8], frame: usize, off: usize) -> [[i16; 8]; 8] {
    use std::arch::x86_64::*;
    assert!(frames.len() >= 7 * frame + off + 16);
    // SAFETY: the assertion keeps every 16-byte load inside `frames`; the
    // loads and the stores are unaligned forms; the output is 8 × 16 bytes.
    unsafe {
        let p = frames.as_ptr().add(off);
        let a: [__m128i; 8] =
            std::array::from_fn(|k| _mm_loadu_si128(p.add(k * frame).cast::<__m128i>()));
        let b0 = _mm_unpacklo_epi16(a[0], a[1]);
        let b1 = _mm_unpackhi_epi16(a[0], a[1]);
        let b2 = _mm_unpacklo_epi16(a[2], a[3]);
        let b3 = _mm_unpackhi_epi16(a[2], a[3]);
        let b4 = _mm_unpacklo_epi16(a[4], a[5]);
        let b5 = _mm_unpackhi_epi16(a[4], a[5]);
        let b6 = _mm_unpacklo_epi16(a[6], a[7]);
        let b7 = _mm_unpackhi_epi16(a[6], a[7]);
        let c0 = _mm_unpacklo_epi32(b0, b2);
        let c1 = _mm_unpackhi_epi32(b0, b2);
        let c2 = _mm_unpacklo_epi32(b1, b3);
        let c3 = _mm_unpackhi_epi32(b1, b3);
        let c4 = _mm_unpacklo_epi32(b4, b6);
        let c5 = _mm_unpackhi_epi32(b4, b6);
        let c6 = _mm_unpacklo_epi32(b5, b7);
        let c7 = _mm_unpackhi_epi32(b5, b7);
        let d = [
            _mm_unpacklo_epi64(c0, c4),
            _mm_unpackhi_epi64(c0, c4),
            _mm_unpacklo_epi64(c1, c5),
            _mm_unpackhi_epi64(c1, c5),
            _mm_unpacklo_epi64(c2, c6),
            _mm_unpackhi_epi64(c2, c6),
            _mm_unpacklo_epi64(c3, c7),
            _mm_unpackhi_epi64(c3, c7),
        ];
        let mut out = [[0i16; 8]; 8];
        for (o, v) in out.iter_mut().zip(d) {
            _mm_storeu_si128(o.as_mut_ptr().cast::<__m128i>(), v);
        }
        out
    }
}

/// [`transpose8x8`] without SIMD (other targets; the reference in tests).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn transpose8x8_plain(frames: &[u8], frame: usize, off: usize) -> [[i16; 8]; 8] {
    std::array::from_fn(|c| {
        std::array::from_fn(|k| {
            let i = k * frame + off + 2 * c;
            i16::from_le_bytes([frames[i], frames[i + 1]])
        })
    })
}

#[cfg(not(target_arch = "x86_64"))]
use transpose8x8_plain as transpose8x8;

/// Samples decoded per parallel run in [`decode`] and [`decode_i16`] (× the
/// file's channels × the item size: about 0.8 MB of a 385-channel int16
/// file; 59 runs per default window, enough to share among 16 threads).
const DECODE_CHUNK: usize = 1024;
/// Frames decoded row by row at a time within a run (about 200 kB of a
/// 385-channel int16 file: they stay in the L2 cache).
const DECODE_BLOCK: usize = 256;

impl Recording for BinaryRecording {
    fn n_channels(&self) -> usize {
        self.n_channels
    }
    fn n_samples(&self) -> u64 {
        self.n_samples
    }
    fn fs(&self) -> f64 {
        self.fs
    }
    fn first_sample(&self) -> u64 {
        0
    }
    fn read_channels(
        &self,
        start: u64,
        count: usize,
        chan_map: &[u64],
        out: &mut [f32],
    ) -> Result<(), RecordingError> {
        check_read(self, start, count, chan_map, out.len())?;
        if count == 0 || chan_map.is_empty() {
            return Ok(());
        }
        let Some(map) = &self.map else {
            return Ok(());
        };
        let data = &map[self.offset as usize..];
        let nc = self.n_channels;
        match self.dtype {
            Dtype::Int16 => {
                let release = |a: u64, m: usize| self.release_pages(a, m);
                let source = self.frames(data, &release);
                decode_i16(source, start, count, count, nc, chan_map, out, f32::from)
                    .map_err(|e| self.io_error(e))?;
            }
            Dtype::Uint16 => decode::<2, f32>(data, start, count, count, nc, chan_map, out, |b| {
                (i32::from(u16::from_le_bytes(b)) - 32768) as f32
            }),
            Dtype::Int32 => decode::<4, f32>(data, start, count, count, nc, chan_map, out, |b| {
                i32::from_le_bytes(b) as f32
            }),
            Dtype::Float32 => decode::<4, f32>(
                data,
                start,
                count,
                count,
                nc,
                chan_map,
                out,
                f32::from_le_bytes,
            ),
        }
        if self.dtype != Dtype::Int16 {
            self.release_pages(start, count);
        }
        if self.scale.is_some() || self.shift.is_some() {
            let (a, b) = (self.scale.unwrap_or(1.0), self.shift.unwrap_or(0.0));
            for v in out.iter_mut() {
                *v = *v * a + b;
            }
        }
        Ok(())
    }
    fn read_channels_i16(
        &self,
        start: u64,
        count: usize,
        chan_map: &[u64],
        out: &mut [i16],
        stride: usize,
    ) -> Result<bool, RecordingError> {
        if self.dtype != Dtype::Int16 || self.scale.is_some() || self.shift.is_some() {
            return Ok(false);
        }
        crate::recording::check_read_strided(self, start, count, chan_map, out.len(), stride)?;
        if count == 0 || chan_map.is_empty() {
            return Ok(true);
        }
        let Some(map) = &self.map else {
            return Ok(true);
        };
        let data = &map[self.offset as usize..];
        let release = |a: u64, m: usize| self.release_pages(a, m);
        let source = self.frames(data, &release);
        let nc = self.n_channels;
        decode_i16(source, start, count, stride, nc, chan_map, out, |v| v)
            .map_err(|e| self.io_error(e))?;
        Ok(true)
    }
    fn describe(&self) -> String {
        format!(
            "{} ({}, {} channels, {} samples at {} Hz, offset {} bytes)",
            self.path.display(),
            self.dtype.name(),
            self.n_channels,
            self.n_samples,
            self.fs,
            self.offset
        )
    }
}

impl BinaryRecording {
    /// Where an int16 read takes its frames from: positional reads of the
    /// file on unix, the memory map `data` elsewhere.
    fn frames<'a>(
        &'a self,
        data: &'a [u8],
        release: &'a (dyn Fn(u64, usize) + Sync),
    ) -> Frames<'a> {
        #[cfg(unix)]
        {
            let _ = (data, release);
            Frames::Read(&self.file, self.offset)
        }
        #[cfg(not(unix))]
        {
            Frames::Map(data, release)
        }
    }

    /// A failed read of the file, as the error to report.
    fn io_error(&self, source: std::io::Error) -> RecordingError {
        RecordingError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Drops samples `start .. start + count` from this process's memory.
    fn release_pages(&self, start: u64, count: usize) {
        let Some(map) = &self.map else {
            return;
        };
        let nc = self.n_channels;
        // Drop the pages just read from this process's memory: a run reads each
        // sample about once, and without this the mapped file would count in full
        // towards the process's resident memory on long recordings (BR-23). The
        // page cache keeps them; a later read maps them again from the file.
        let frame = nc * self.dtype.itemsize() as usize;
        let begin = self.offset as usize + start as usize * frame;
        // SAFETY: the mapping is read-only and shared with a file that is only
        // read: after MADV_DONTNEED the kernel refills the pages from the file on
        // the next access, with the same contents, and no slice of them is held.
        let _ = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, begin, count * frame)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parallel, blocked decoding reads every value where the frame-by-frame
    /// definition puts it: runs and blocks of every length, a channel map that
    /// skips and reorders channels, a start inside the file.
    #[test]
    fn decoding_in_runs_equals_frame_by_frame() {
        // 7 channels: no whole group of eight; 19: two whole groups and a
        // partial one; 16: whole groups only.
        for (nc, chan_map) in [
            (7usize, &[6u64, 0, 3, 3][..]),
            (19, &[18, 0, 3, 3, 9, 17, 8, 15, 7][..]),
            (
                16,
                &[15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0][..],
            ),
        ] {
            decoding_case(nc, chan_map);
        }
    }

    /// Frames from the memory map and from positional reads decode alike.
    #[test]
    fn mapped_and_positional_frames_decode_alike() {
        let (nc, ns) = (19usize, 3 * DECODE_CHUNK + 5);
        let bytes: Vec<u8> = (0..nc * ns * 2).map(|i| (i * 131 % 253) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        let offset = 6;
        let mut file = vec![9u8; offset];
        file.extend_from_slice(&bytes);
        std::fs::write(&path, &file).unwrap();
        let rec = BinaryRecording::open_flat(&path, nc as u64, 30_000.0, Dtype::Int16, 6).unwrap();
        let map = &rec.map.as_ref().unwrap()[offset..];
        let chan_map = [3u64, 18, 0, 9, 9];
        for (start, count) in [(0u64, ns), (7, DECODE_CHUNK + 9)] {
            let decoded = |source: Frames<'_>| {
                let mut out = vec![0i16; chan_map.len() * count];
                decode_i16(source, start, count, count, nc, &chan_map, &mut out, |v| v).unwrap();
                out
            };
            let released = std::sync::atomic::AtomicUsize::new(0);
            let release = |_: u64, m: usize| {
                released.fetch_add(m, std::sync::atomic::Ordering::Relaxed);
            };
            let mapped = decoded(Frames::Map(map, &release));
            assert_eq!(released.into_inner(), count, "every sample released once");
            #[cfg(unix)]
            assert_eq!(decoded(Frames::Read(&rec.file, offset as u64)), mapped);
            let mut want = vec![0i16; chan_map.len() * count];
            rec.read_channels_i16(start, count, &chan_map, &mut want, count)
                .unwrap();
            assert_eq!(mapped, want);
        }
    }

    /// The SIMD transposition equals the plain one.
    #[test]
    fn tile_transposition_equals_plain() {
        let frame = 26;
        let bytes: Vec<u8> = (0..8 * frame + 5).map(|i| (i * 37 % 251) as u8).collect();
        for off in [0, 2, 10] {
            assert_eq!(
                transpose8x8(&bytes, frame, off),
                transpose8x8_plain(&bytes, frame, off)
            );
        }
    }

    fn decoding_case(nc: usize, chan_map: &[u64]) {
        let ns = 2 * DECODE_CHUNK + DECODE_BLOCK + 13;
        let value = |t: usize, c: usize| ((t * 31 + c * 1009) % 65_536) as u16 as i16;
        let mut bytes = Vec::with_capacity(nc * ns * 2);
        for t in 0..ns {
            for c in 0..nc {
                bytes.extend_from_slice(&value(t, c).to_le_bytes());
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        std::fs::write(&path, &bytes).unwrap();
        let rec = BinaryRecording::open_flat(&path, nc as u64, 30_000.0, Dtype::Int16, 0).unwrap();
        for (start, count) in [
            (0usize, ns),
            (5, ns - 5),
            (DECODE_CHUNK - 1, DECODE_CHUNK + 3),
            (17, 1),
            (3, 8 * DECODE_BLOCK + 7),
            (ns - 9, 9),
        ] {
            let mut out = vec![0f32; chan_map.len() * count];
            rec.read_channels(start as u64, count, chan_map, &mut out)
                .unwrap();
            for (r, &c) in chan_map.iter().enumerate() {
                for t in 0..count {
                    assert_eq!(
                        out[r * count + t],
                        f32::from(value(start + t, c as usize)),
                        "start {start}, count {count}, row {r}, sample {t}"
                    );
                }
            }
            // The int16 read, into rows longer than the samples: the same
            // values, the row ends untouched.
            let stride = count + 3;
            let mut raw = vec![-7i16; chan_map.len() * stride];
            assert!(
                rec.read_channels_i16(start as u64, count, chan_map, &mut raw, stride)
                    .unwrap()
            );
            for (r, &c) in chan_map.iter().enumerate() {
                for t in 0..count {
                    assert_eq!(raw[r * stride + t], value(start + t, c as usize));
                }
                assert_eq!(&raw[r * stride + count..(r + 1) * stride], &[-7, -7, -7]);
            }
        }
    }
}
