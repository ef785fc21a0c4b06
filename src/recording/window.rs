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
                tracing::warn!(
                    "the last {tail} samples (of {n_samples}) are fewer than nt = {nt} and are skipped, as Kilosort4 does; {} of {batch_size} samples remain",
                    crate::error::count(n_windows, "window")
                );
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
    /// `n_sites × (batch_size + 2·nt)` values, f32.
    pub data: Array2<f32>,
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
    if out.dim() != (rows, nw) {
        return Err(err(format!(
            "window buffer is {:?}, expected ({rows}, {nw})",
            out.dim()
        )));
    }
    if !out.is_standard_layout() {
        *out = Array2::zeros((rows, nw));
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
    let data = out
        .as_slice_mut()
        .ok_or_else(|| err("window buffer is not contiguous".into()))?;
    if m == nw {
        rec.read_channels(a, m, chan_map, data)?;
        return Ok(());
    }
    let mut tmp = vec![0f32; rows * m];
    rec.read_channels(a, m, chan_map, &mut tmp)?;
    for r in 0..rows {
        let row = &mut data[r * nw..(r + 1) * nw];
        let src = &tmp[r * m..(r + 1) * m];
        row[col_a..col_a + m].copy_from_slice(src);
        if m == 0 {
            row.fill(0.0);
            continue;
        }
        let first = src[0];
        let last = src[m - 1];
        row[..col_a].fill(first);
        if single {
            // Kilosort4 zero-fills after the data when there is only one batch.
            row[col_a + m..].fill(0.0);
            debug_assert!(col_a == nt);
        } else {
            row[col_a + m..].fill(last);
        }
    }
    Ok(())
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
