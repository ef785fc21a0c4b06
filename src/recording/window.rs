//! Windows ("batches") cut exactly as Kilosort4 4.1.7 cuts them, and a
//! read-ahead loader.
//!
//! Window `i` covers relative samples `i·batch_size − nt .. (i+1)·batch_size + nt`
//! (`batch_size + 2·nt` columns). Its *own* samples are columns `nt ..
//! nt + batch_size`; the `nt` columns on either side are shared with the
//! neighbours. Columns before sample 0 repeat sample 0; columns past the last
//! used sample repeat it (when there are two or more windows) or are zero (when
//! there is a single window, as in Kilosort4).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, bounded};
use ndarray::Array2;

use super::Recording;
use crate::error::RecordingError;

/// How a recording of `n_samples` samples is cut into windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WindowPlan {
    /// Own samples per window (Kilosort4: `batch_size`, NT), samples.
    pub batch_size: u64,
    /// Pad on each side (Kilosort4: `nt`, the template length), samples.
    pub nt: u64,
    /// Samples in the recording (after `tmin`/`tmax`).
    pub n_samples: u64,
    /// Number of windows: `ceil(n_samples / batch_size)`, minus one when the last
    /// window would own fewer than `nt` samples (that tail is dropped).
    pub n_windows: u64,
    /// Samples covered by windows' own parts: `min(n_samples, n_windows·batch_size)`.
    /// Samples from `n_used` on are a dropped tail.
    pub n_used: u64,
}

impl WindowPlan {
    /// Plans the windows of a recording of `n_samples` samples.
    ///
    /// A tail shorter than `nt` is dropped with a `tracing::warn!` naming its length.
    ///
    /// # Errors
    /// [`RecordingError::Setting`] when `batch_size` is 0.
    pub fn new(n_samples: u64, batch_size: u64, nt: u64) -> Result<Self, RecordingError> {
        Self::planned(n_samples, batch_size, nt, true)
    }

    /// [`WindowPlan::new`] without the warning: for a later pass over windows
    /// already planned (and warned about) once in the same run.
    ///
    /// # Errors
    /// As [`WindowPlan::new`].
    pub fn again(n_samples: u64, batch_size: u64, nt: u64) -> Result<Self, RecordingError> {
        Self::planned(n_samples, batch_size, nt, false)
    }

    fn planned(
        n_samples: u64,
        batch_size: u64,
        nt: u64,
        warn: bool,
    ) -> Result<Self, RecordingError> {
        if batch_size == 0 {
            return Err(RecordingError::Setting {
                path: Default::default(),
                setting: "batch_size",
                message: "must be at least 1 sample".into(),
            });
        }
        let mut n_windows = n_samples.div_ceil(batch_size);
        if n_windows > 0 {
            let tail = n_samples - (n_windows - 1) * batch_size;
            if tail < nt {
                n_windows -= 1;
                if warn {
                    tracing::warn!(
                        "the last {tail} samples (of {n_samples}) are fewer than nt = {nt} and are skipped, as Kilosort4 does; {} of {batch_size} samples {}",
                        crate::error::count(n_windows, "window"),
                        if n_windows == 1 { "remains" } else { "remain" }
                    );
                }
            }
        }
        let n_used = n_samples.min(n_windows.saturating_mul(batch_size));
        Ok(WindowPlan {
            batch_size,
            nt,
            n_samples,
            n_windows,
            n_used,
        })
    }

    /// Columns per window: `batch_size + 2·nt`.
    pub fn window_len(&self) -> usize {
        (self.batch_size + 2 * self.nt) as usize
    }

    /// Relative index of window `i`'s first own sample (column `nt`): `i·batch_size`.
    pub fn window_start(&self, i: u64) -> u64 {
        i * self.batch_size
    }

    /// Relative sample held by column 0 of window `i`: `i·batch_size − nt` (may be negative).
    pub fn window_first_column(&self, i: u64) -> i64 {
        (i * self.batch_size) as i64 - self.nt as i64
    }

    /// Own samples of window `i`: `batch_size`, fewer for the last window.
    pub fn own_len(&self, i: u64) -> u64 {
        self.n_used
            .saturating_sub(self.window_start(i))
            .min(self.batch_size)
    }
}

/// One window of data, rows = probe sites in channel-map order, columns = samples.
#[derive(Debug, Clone)]
pub struct Window {
    /// Window index, `0 .. n_windows`.
    pub index: u64,
    /// Absolute sample index of column `nt` (the window's first own sample).
    pub own_start: u64,
    /// Own samples (columns `nt .. nt + own_len`); `batch_size` except maybe for the last.
    pub own_len: u64,
    /// Absolute sample index of column 0 (`own_start − nt`); negative for window 0
    /// when the recording starts less than `nt` samples into the file. Column c
    /// holds absolute sample `first_sample + c` before edge clamping.
    pub first_sample: i64,
    /// `n_sites × (batch_size + 2·nt)` values, f32; empty (0 × 0) when the
    /// samples are in `raw16` instead.
    pub data: Array2<f32>,
    /// The samples as the file's int16 values, when the run reads them so
    /// (a GPU pass on an int16 recording); `data` is empty then.
    pub raw16: Option<Raw16>,
}

impl Window {
    /// Window `i` of `plan` over a recording whose first sample is
    /// `rec_first` (its own samples' start and length, its column 0), holding
    /// `data` or `raw16` as read.
    pub fn of(
        rec_first: u64,
        plan: &WindowPlan,
        i: u64,
        data: Array2<f32>,
        raw16: Option<Raw16>,
    ) -> Window {
        let own_start = rec_first + plan.window_start(i);
        Window {
            index: i,
            own_start,
            own_len: plan.own_len(i),
            first_sample: own_start as i64 - plan.nt as i64,
            data,
            raw16,
        }
    }

    /// Window `i` of `plan` without its samples: for a pass that holds them
    /// already (a window kept on the device after its high-pass,
    /// [`crate::stages::WindowPass::windows_held`]), so it is not read.
    pub fn unread(rec_first: u64, plan: &WindowPlan, i: u64) -> Window {
        Window::of(rec_first, plan, i, Array2::zeros((0, 0)), None)
    }

    /// Whether the window holds its samples (in `data` or `raw16`); false
    /// for [`Window::unread`].
    pub fn has_samples(&self) -> bool {
        self.raw16.is_some() || !self.data.is_empty()
    }
}

/// Reads window `i` of `rec` into `out` (`chan_map.len() × (batch_size + 2·nt)`),
/// row r = file column `chan_map[r]`, with Kilosort4's edge handling (module docs).
///
/// # Errors
/// [`RecordingError::Read`] when `i ≥ n_windows`, `out` has the wrong shape, the
/// plan does not match the recording's length or the read fails.
pub fn read_window(
    rec: &dyn Recording,
    plan: &WindowPlan,
    i: u64,
    chan_map: &[u64],
    out: &mut Array2<f32>,
) -> Result<(), RecordingError> {
    let nw = plan.window_len();
    let rows = chan_map.len();
    if out.dim() != (rows, nw) {
        return Err(RecordingError::Read {
            what: rec.describe(),
            message: format!("window buffer is {:?}, expected ({rows}, {nw})", out.dim()),
        });
    }
    if !out.is_standard_layout() {
        *out = Array2::zeros((rows, nw));
    }
    let data = out.as_slice_mut().ok_or_else(|| RecordingError::Read {
        what: rec.describe(),
        message: "window buffer is not contiguous".into(),
    })?;
    read_window_rows(rec, plan, i, chan_map, data, nw, |a, m, buf, stride| {
        debug_assert_eq!(stride, m);
        rec.read_channels(a, m, chan_map, buf).map(|()| true)
    })
    .map(|_| ())
}

/// As [`read_window`], into `out` as the file's int16 values (rows of
/// `out.stride`): what a GPU pass uploads. Returns `Ok(false)`,
/// with `out` unspecified, when the recording cannot give its values as int16
/// unchanged ([`Recording::read_channels_i16`]).
///
/// # Errors
/// As [`read_window`].
pub fn read_window_i16(
    rec: &dyn Recording,
    plan: &WindowPlan,
    i: u64,
    chan_map: &[u64],
    out: &mut Raw16,
) -> Result<bool, RecordingError> {
    let nw = plan.window_len();
    if (out.n_rows, out.n_cols) != (chan_map.len(), nw) {
        return Err(RecordingError::Read {
            what: rec.describe(),
            message: format!(
                "int16 window buffer is ({}, {}), expected ({}, {nw})",
                out.n_rows,
                out.n_cols,
                chan_map.len()
            ),
        });
    }
    let stride = out.stride;
    let read = read_window_rows(
        rec,
        plan,
        i,
        chan_map,
        out.values_mut(),
        stride,
        |a, m, buf, stride| rec.read_channels_i16(a, m, chan_map, buf, stride),
    )?;
    if read && stride > nw {
        // The values past each row's end (one when the window has an
        // odd number of samples) go to a GPU with the row; they are set here so
        // that every byte of the buffer is written by the read (its storage may
        // be a reused page-locked block: `PinnedPool::take` does not zero).
        for row in out.values_mut().chunks_mut(stride) {
            row[nw..].fill(0);
        }
    }
    Ok(read)
}

/// Whether `rec` gives the values of the channels of `chan_map` as int16
/// unchanged ([`read_window_i16`] reads them; [`Recording::read_channels_i16`]
/// answers for one sample of the first channel). A GPU pass reads such
/// windows on several threads, into page-locked buffers made ahead.
pub fn gives_int16(rec: &dyn Recording, chan_map: &[u64]) -> bool {
    let mut one = [0i16; 1];
    !chan_map.is_empty()
        && rec.n_samples() > 0
        && matches!(
            rec.read_channels_i16(0, 1, &chan_map[..1], &mut one, 1),
            Ok(true)
        )
}

/// The window logic of [`read_window`] for rows of `stride` values of any
/// sample type: `read(first, count, rows, stride)` reads samples into rows of
/// `stride`; the edge columns are then filled as Kilosort4 fills them.
fn read_window_rows<T: Copy + Default>(
    rec: &dyn Recording,
    plan: &WindowPlan,
    i: u64,
    chan_map: &[u64],
    data: &mut [T],
    stride: usize,
    mut read: impl FnMut(u64, usize, &mut [T], usize) -> Result<bool, RecordingError>,
) -> Result<bool, RecordingError> {
    let err = |message: String| RecordingError::Read {
        what: rec.describe(),
        message,
    };
    let nw = plan.window_len();
    let rows = chan_map.len();
    if i >= plan.n_windows {
        return Err(err(format!(
            "window {i} requested but the plan has {} windows",
            plan.n_windows
        )));
    }
    if plan.n_samples != rec.n_samples() {
        return Err(err(format!(
            "the window plan is for {} samples but the recording has {}",
            plan.n_samples,
            rec.n_samples()
        )));
    }
    if stride < nw || data.len() != rows * stride {
        return Err(err(format!(
            "window buffer holds {} values, expected {rows} rows of {stride} ≥ {nw}",
            data.len()
        )));
    }
    let s0 = plan.window_first_column(i);
    let nt = plan.nt as usize;
    let single = plan.n_windows == 1;
    // The samples that may be read: all of the file for a single window (its right
    // pad reads into a dropped tail), else the used samples only.
    let limit = if single { plan.n_samples } else { plan.n_used };
    let a = s0.max(0) as u64; // first sample read
    let b = ((s0 + nw as i64).max(0) as u64).min(limit); // end of samples read
    let col_a = (a as i64 - s0) as usize;
    let m = b.saturating_sub(a) as usize;
    if m == nw {
        return read(a, m, data, stride);
    }
    let mut tmp = vec![T::default(); rows * m];
    if !read(a, m, &mut tmp, m)? {
        return Ok(false);
    }
    for r in 0..rows {
        let row = &mut data[r * stride..r * stride + nw];
        let src = &tmp[r * m..(r + 1) * m];
        row[col_a..col_a + m].copy_from_slice(src);
        if m == 0 {
            row.fill(T::default());
            continue;
        }
        let first = src[0];
        let last = src[m - 1];
        row[..col_a].fill(first);
        if single {
            // Kilosort4 zero-fills after the data when there is only one batch.
            row[col_a + m..].fill(T::default());
            debug_assert!(col_a == nt);
        } else {
            row[col_a + m..].fill(last);
        }
    }
    Ok(true)
}

/// Storage for a [`Raw16`] window: a plain vector, or memory a GPU back end
/// uploads from directly (page-locked with CUDA).
pub trait Raw16Buffer: Send {
    /// The values.
    fn values(&self) -> &[i16];
    /// The values, writable.
    fn values_mut(&mut self) -> &mut [i16];
    /// The buffer itself, for the back end that made it to take back.
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
    /// The buffer itself, to see which kind it is.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl Raw16Buffer for Vec<i16> {
    fn values(&self) -> &[i16] {
        self
    }
    fn values_mut(&mut self) -> &mut [i16] {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A window's samples as the file's int16 values, rows in channel-map order:
/// row r in `values()[r·stride .. r·stride + n_cols]` (a GPU pass uploads
/// this, with no float copy on the host).
pub struct Raw16 {
    /// Rows (probe sites).
    pub n_rows: usize,
    /// Samples per row (`batch_size + 2·nt`).
    pub n_cols: usize,
    /// Values from one row's start to the next's (≥ `n_cols`).
    pub stride: usize,
    buf: Box<dyn Raw16Buffer>,
}

impl Raw16 {
    /// The row length (values) a run reads int16 windows of `n_cols` samples
    /// into: `n_cols` rounded up to even, so that rows are whole 32-bit words
    /// (the layout a GPU pass uploads as it is).
    pub fn stride_for(n_cols: usize) -> usize {
        n_cols.div_ceil(2) * 2
    }

    /// A window of `n_rows × n_cols` in `buf` (rows of `stride`).
    ///
    /// # Errors
    /// [`RecordingError::Read`] when `stride < n_cols` or `buf` does not hold
    /// `n_rows · stride` values.
    pub fn new(
        n_rows: usize,
        n_cols: usize,
        stride: usize,
        buf: Box<dyn Raw16Buffer>,
    ) -> Result<Self, RecordingError> {
        if stride < n_cols || buf.values().len() != n_rows * stride {
            return Err(RecordingError::Read {
                what: "int16 window buffer".into(),
                message: format!(
                    "holds {} values; {n_rows} rows of {stride} ≥ {n_cols} were asked for",
                    buf.values().len()
                ),
            });
        }
        Ok(Raw16 {
            n_rows,
            n_cols,
            stride,
            buf,
        })
    }

    /// All values, rows of `stride`.
    pub fn values(&self) -> &[i16] {
        self.buf.values()
    }

    /// All values, writable.
    pub fn values_mut(&mut self) -> &mut [i16] {
        self.buf.values_mut()
    }

    /// Row `r`'s `n_cols` samples.
    pub fn row(&self, r: usize) -> &[i16] {
        &self.values()[r * self.stride..r * self.stride + self.n_cols]
    }

    /// The window as f32 (`n_rows × n_cols`), the values [`read_window`] gives.
    pub fn to_f32(&self) -> Array2<f32> {
        Array2::from_shape_fn((self.n_rows, self.n_cols), |(r, c)| {
            f32::from(self.values()[r * self.stride + c])
        })
    }

    /// The storage, to see which kind it is.
    pub fn buffer(&self) -> &dyn std::any::Any {
        self.buf.as_any()
    }

    /// The storage, for the back end that made it.
    pub fn into_buffer(self) -> Box<dyn std::any::Any + Send> {
        self.buf.into_any()
    }
}

impl Clone for Raw16 {
    fn clone(&self) -> Self {
        Raw16 {
            n_rows: self.n_rows,
            n_cols: self.n_cols,
            stride: self.stride,
            buf: Box::new(self.values().to_vec()),
        }
    }
}

impl std::fmt::Debug for Raw16 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Raw16")
            .field("n_rows", &self.n_rows)
            .field("n_cols", &self.n_cols)
            .field("stride", &self.stride)
            .finish_non_exhaustive()
    }
}

/// Reads windows ahead on a thread and hands them over by value.
///
/// At most `capacity + 2` windows exist at a time (one being filled, `capacity`
/// queued, one held by the consumer), whatever the file's length. Errors reach
/// the consumer as `Err` items; after an error the thread stops. Dropping the
/// loader stops the thread and waits for it.
pub struct WindowLoader {
    rx: Option<Receiver<Result<Window, RecordingError>>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl WindowLoader {
    /// Starts reading windows `indices` (in that order) of `rec`, rows = `chan_map`.
    /// `capacity` (at least 1) windows are read ahead.
    ///
    /// # Errors
    /// [`RecordingError::Loader`] when the thread cannot be started.
    pub fn new(
        rec: Arc<dyn Recording>,
        plan: WindowPlan,
        chan_map: Vec<u64>,
        indices: Vec<u64>,
        capacity: usize,
    ) -> Result<Self, RecordingError> {
        let (tx, rx) = bounded(capacity.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let handle = std::thread::Builder::new()
            .name("spikecube-window-reader".into())
            .spawn(move || {
                let first = rec.first_sample();
                for i in indices {
                    if stop2.load(Ordering::Relaxed) {
                        return;
                    }
                    let mut data = Array2::zeros((chan_map.len(), plan.window_len()));
                    let res = read_window(rec.as_ref(), &plan, i, &chan_map, &mut data).map(|()| {
                        let own_start = first + plan.window_start(i);
                        Window {
                            index: i,
                            own_start,
                            own_len: plan.own_len(i),
                            first_sample: own_start as i64 - plan.nt as i64,
                            data,
                            raw16: None,
                        }
                    });
                    let failed = res.is_err();
                    if tx.send(res).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| RecordingError::Loader(format!("cannot start the thread: {e}")))?;
        Ok(WindowLoader {
            rx: Some(rx),
            stop,
            handle: Some(handle),
        })
    }

    /// Reads every window of the plan in order, two ahead.
    ///
    /// # Errors
    /// As [`WindowLoader::new`].
    pub fn all(
        rec: Arc<dyn Recording>,
        plan: WindowPlan,
        chan_map: Vec<u64>,
    ) -> Result<Self, RecordingError> {
        let indices = (0..plan.n_windows).collect();
        Self::new(rec, plan, chan_map, indices, 2)
    }
}

impl Iterator for WindowLoader {
    type Item = Result<Window, RecordingError>;

    fn next(&mut self) -> Option<Self::Item> {
        let rx = self.rx.as_ref()?;
        match rx.recv() {
            Ok(item) => Some(item),
            Err(_) => {
                self.rx = None;
                let handle = self.handle.take()?;
                match handle.join() {
                    Ok(()) => None,
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "panic".into());
                        Some(Err(RecordingError::Loader(msg)))
                    }
                }
            }
        }
    }
}

impl Drop for WindowLoader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Disconnect first so a thread blocked on a full channel wakes up.
        self.rx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The int16 read gives the f32 read's values in every window, the edge
    /// windows' padding included, for several windows and for one.
    #[test]
    fn int16_windows_equal_float_windows() {
        let nc = 5usize;
        for ns in [1000usize, 230] {
            let mut bytes = Vec::new();
            for t in 0..ns {
                for c in 0..nc {
                    let v = ((t * 7919 + c * 104_729) % 65_536) as u16 as i16;
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("x.bin");
            std::fs::write(&path, &bytes).unwrap();
            let rec = crate::recording::BinaryRecording::open_flat(
                &path,
                nc as u64,
                30_000.0,
                crate::recording::Dtype::Int16,
                0,
            )
            .unwrap();
            let plan = WindowPlan::new(ns as u64, 300, 11).unwrap();
            let chan_map = [4u64, 0, 2];
            let n = plan.window_len();
            for i in 0..plan.n_windows {
                let mut f = Array2::zeros((3, n));
                read_window(&rec, &plan, i, &chan_map, &mut f).unwrap();
                let stride = n + 3;
                let mut r = Raw16::new(3, n, stride, Box::new(vec![0i16; 3 * stride])).unwrap();
                assert!(read_window_i16(&rec, &plan, i, &chan_map, &mut r).unwrap());
                assert_eq!(r.to_f32(), f, "{ns} samples, window {i}");
            }
        }
    }

    /// The samples of [`parallel_reads_equal_the_plain_read`]'s file.
    fn value(t: usize, c: usize) -> i16 {
        // Stuck stretches at a channel's extreme (±900) that cross the
        // decoding runs' boundaries (every 1024 samples from a read's start).
        let stuck = [
            (3, 1000, 1100, 900),
            (9, 2000, 2100, -900),
            (17, 3050, 3100, 900),
            (12, 4080, 4300, -900),
            (18, 0, 40, 900),
            (5, 4950, 5000, -900),
        ];
        for &(ch, a, b, v) in &stuck {
            if c == ch && (a..b).contains(&t) {
                return v;
            }
        }
        match c {
            0 => 0,
            1 => 17,
            _ => ((t * 7919 + c * 104_729) % 1601) as i16 - 800,
        }
    }

    /// A recording read one value at a time: the definition the memory-mapped
    /// reader's parallel, tiled decoding must give.
    struct Plain {
        n_channels: usize,
        n_samples: usize,
    }

    impl Recording for Plain {
        fn n_channels(&self) -> usize {
            self.n_channels
        }
        fn n_samples(&self) -> u64 {
            self.n_samples as u64
        }
        fn fs(&self) -> f64 {
            30_000.0
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
            crate::recording::check_read(self, start, count, chan_map, out.len())?;
            for (r, &c) in chan_map.iter().enumerate() {
                for t in 0..count {
                    out[r * count + t] = f32::from(value(start as usize + t, c as usize));
                }
            }
            Ok(())
        }
        fn describe(&self) -> String {
            "plain".into()
        }
    }

    /// Windows read in parallel runs of tiled channel groups (int16 rows and
    /// f32), at the recording's start and end (edge padding) and for a single
    /// window (zero padding), equal the plain value-by-value read, and so do
    /// the input checks on them: the same stuck runs (crossing the decoding
    /// runs' boundaries), channel findings and masked values.
    #[test]
    fn parallel_reads_equal_the_plain_read() {
        use crate::checks::{ChannelHealth, WindowColumns, check_window};
        let (nc, ns) = (19usize, 5000usize);
        let mut bytes = Vec::with_capacity(nc * ns * 2);
        for t in 0..ns {
            for c in 0..nc {
                bytes.extend_from_slice(&value(t, c).to_le_bytes());
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        std::fs::write(&path, &bytes).unwrap();
        let rec = crate::recording::BinaryRecording::open_flat(
            &path,
            nc as u64,
            30_000.0,
            crate::recording::Dtype::Int16,
            0,
        )
        .unwrap();
        let plain = Plain {
            n_channels: nc,
            n_samples: ns,
        };
        // Every channel but 11, one (7) twice, out of order.
        let chan_map: Vec<u64> = [
            18u64, 0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17,
        ]
        .to_vec();
        let rows = chan_map.len();
        // Three windows of 2100 (the last one short), and one window of all.
        for batch in [2100u64, 6000] {
            let plan = WindowPlan::new(ns as u64, batch, 61).unwrap();
            let n = plan.window_len();
            let stride = Raw16::stride_for(n) + 2;
            let mut healths = [(); 3].map(|()| ChannelHealth::new(&chan_map));
            let mut n_runs = 0;
            for i in 0..plan.n_windows {
                let mut want = Array2::zeros((rows, n));
                read_window(&plain, &plan, i, &chan_map, &mut want).unwrap();
                let mut got = Array2::zeros((rows, n));
                read_window(&rec, &plan, i, &chan_map, &mut got).unwrap();
                assert_eq!(got, want, "batch {batch}, window {i}, f32");
                let mut raw =
                    Raw16::new(rows, n, stride, Box::new(vec![0i16; rows * stride])).unwrap();
                assert!(read_window_i16(&rec, &plan, i, &chan_map, &mut raw).unwrap());
                assert_eq!(raw.to_f32(), want, "batch {batch}, window {i}, int16");
                let own_start = plan.window_start(i);
                let window = |data, raw16| Window {
                    index: i,
                    own_start,
                    own_len: plan.own_len(i),
                    first_sample: own_start as i64 - plan.nt as i64,
                    data,
                    raw16,
                };
                let mut ws = [
                    window(want, None),
                    window(got, None),
                    window(Array2::zeros((0, 0)), Some(raw)),
                ];
                let cols = WindowColumns::of(&plan, i);
                let mut found = Vec::new();
                for (w, h) in ws.iter_mut().zip(healths.iter_mut()) {
                    found.push(check_window(w, &cols, 8, Some(h), true));
                }
                assert_eq!(found[1], found[0], "batch {batch}, window {i}");
                assert_eq!(found[2], found[0], "batch {batch}, window {i}");
                n_runs += found[0].iter().map(Vec::len).sum::<usize>();
                let masked = ws[0].data.clone();
                assert_eq!(ws[1].data, masked);
                assert_eq!(ws[2].raw16.as_ref().unwrap().to_f32(), masked);
            }
            assert!(n_runs >= 6, "batch {batch}: {n_runs} stuck runs");
            let state: Vec<String> = healths.iter().map(|h| format!("{h:?}")).collect();
            assert_eq!(state[1], state[0]);
            assert_eq!(state[2], state[0]);
            let kinds: Vec<(u64, &str)> = healths[0]
                .findings()
                .iter()
                .map(|f| (f.channel, f.kind))
                .collect();
            assert!(kinds.contains(&(0, "zero")), "{kinds:?}");
            assert!(kinds.contains(&(1, "flat")), "{kinds:?}");
            assert!(kinds.contains(&(7, "duplicate")), "{kinds:?}");
            assert!(kinds.contains(&(12, "clipped")), "{kinds:?}");
        }
    }
}
