//! Files concatenated in time, and a time range of a recording.

use std::path::PathBuf;
use std::sync::Arc;

use super::{Recording, check_read};
use crate::error::RecordingError;

/// Several recordings of the same channel count and rate, one after the other.
/// Sample `k` of file `j` is sample `starts[j] + k` of the concatenation.
pub struct ConcatRecording {
    parts: Vec<Arc<dyn Recording>>,
    /// Start of each part in the concatenation, plus the total at the end.
    starts: Vec<u64>,
}

impl ConcatRecording {
    /// Concatenates `parts` (at least one); `paths` name them in messages.
    ///
    /// # Errors
    /// [`RecordingError::Setting`] when a part differs from the first in channel
    /// count or sampling rate (rates must agree to 1e-9 relative).
    pub fn new(parts: Vec<Arc<dyn Recording>>, paths: &[PathBuf]) -> Result<Self, RecordingError> {
        let Some(first) = parts.first() else {
            return Err(RecordingError::Setting {
                path: PathBuf::new(),
                setting: "files",
                message: "no recording files to concatenate".into(),
            });
        };
        let name = |j: usize| paths.get(j).cloned().unwrap_or_default();
        let mut starts = vec![0u64];
        for (j, p) in parts.iter().enumerate() {
            if p.n_channels() != first.n_channels() {
                return Err(RecordingError::Setting {
                    path: name(j),
                    setting: "n_chan_bin",
                    message: format!(
                        "file {j} has {} channels but file 0 ({}) has {}; concatenated files must agree",
                        p.n_channels(),
                        name(0).display(),
                        first.n_channels()
                    ),
                });
            }
            if (p.fs() - first.fs()).abs() > 1e-9 * first.fs() {
                return Err(RecordingError::Setting {
                    path: name(j),
                    setting: "fs",
                    message: format!(
                        "file {j} is sampled at {} Hz but file 0 ({}) at {} Hz; concatenated files must agree",
                        p.fs(),
                        name(0).display(),
                        first.fs()
                    ),
                });
            }
            let last = *starts.last().unwrap_or(&0);
            starts.push(last + p.n_samples());
        }
        Ok(ConcatRecording { parts, starts })
    }
}

impl Recording for ConcatRecording {
    fn n_channels(&self) -> usize {
        self.parts[0].n_channels()
    }
    fn n_samples(&self) -> u64 {
        *self.starts.last().unwrap_or(&0)
    }
    fn fs(&self) -> f64 {
        self.parts[0].fs()
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
        let end = start + count as u64;
        let mut tmp = Vec::new();
        for (j, part) in self.parts.iter().enumerate() {
            let (s, e) = (self.starts[j], self.starts[j + 1]);
            let (a, b) = (start.max(s), end.min(e));
            if a >= b {
                continue;
            }
            let m = (b - a) as usize;
            tmp.resize(chan_map.len() * m, 0.0);
            part.read_channels(a - s, m, chan_map, &mut tmp)?;
            let col = (a - start) as usize;
            for row in 0..chan_map.len() {
                out[row * count + col..row * count + col + m]
                    .copy_from_slice(&tmp[row * m..(row + 1) * m]);
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
        crate::recording::check_read_strided(self, start, count, chan_map, out.len(), stride)?;
        // Within one file only; a read across files takes the float path.
        let end = start + count as u64;
        for (j, part) in self.parts.iter().enumerate() {
            let (s, e) = (self.starts[j], self.starts[j + 1]);
            if start >= s && end <= e {
                return part.read_channels_i16(start - s, count, chan_map, out, stride);
            }
        }
        Ok(false)
    }
    fn describe(&self) -> String {
        let parts: Vec<String> = self.parts.iter().map(|p| p.describe()).collect();
        format!("concatenation of [{}]", parts.join("; "))
    }
}

/// Samples `start .. start + len` of another recording, numbered from 0, with
/// `first_sample()` = the inner recording's `first_sample() + start`.
pub(crate) struct TimeSlice {
    inner: Arc<dyn Recording>,
    start: u64,
    len: u64,
}

impl TimeSlice {
    pub(crate) fn new(inner: Arc<dyn Recording>, start: u64, len: u64) -> Self {
        TimeSlice { inner, start, len }
    }
}

impl Recording for TimeSlice {
    fn n_channels(&self) -> usize {
        self.inner.n_channels()
    }
    fn n_samples(&self) -> u64 {
        self.len
    }
    fn fs(&self) -> f64 {
        self.inner.fs()
    }
    fn first_sample(&self) -> u64 {
        self.inner.first_sample() + self.start
    }
    fn read_channels(
        &self,
        start: u64,
        count: usize,
        chan_map: &[u64],
        out: &mut [f32],
    ) -> Result<(), RecordingError> {
        check_read(self, start, count, chan_map, out.len())?;
        self.inner
            .read_channels(self.start + start, count, chan_map, out)
    }
    fn read_channels_i16(
        &self,
        start: u64,
        count: usize,
        chan_map: &[u64],
        out: &mut [i16],
        stride: usize,
    ) -> Result<bool, RecordingError> {
        crate::recording::check_read_strided(self, start, count, chan_map, out.len(), stride)?;
        self.inner
            .read_channels_i16(self.start + start, count, chan_map, out, stride)
    }
    fn describe(&self) -> String {
        format!(
            "{} restricted to samples [{}, {})",
            self.inner.describe(),
            self.start,
            self.start + self.len
        )
    }
}
