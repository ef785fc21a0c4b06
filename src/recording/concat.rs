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

/// Samples on each side of a junction whose medians give a file's baseline
/// there (1 ms at 30 kHz: slow field potentials barely move in that time).
pub const JUNCTION_EDGE: usize = 30;

/// Samples on each side of a junction over which a channel's noise sd is estimated.
pub const JUNCTION_NOISE: usize = 3000;

/// A baseline step at a junction is reported from this many noise sd on one channel.
pub const JUNCTION_STEP_SDS: f64 = 5.0;

fn median(v: &mut [f32]) -> f64 {
    let mid = v.len() / 2;
    let (_, m, _) = v.select_nth_unstable_by(mid, f32::total_cmp);
    f64::from(*m)
}

/// Per file channel of `map`: (baseline step across the junction, noise sd),
/// file units, from the last samples of `a` and the first of `b`.
fn steps(
    a: &dyn Recording,
    b: &dyn Recording,
    map: &[u64],
) -> Result<Vec<(f64, f64)>, RecordingError> {
    let n_ch = map.len();
    let na = (a.n_samples() as usize).min(JUNCTION_NOISE);
    let nb = (b.n_samples() as usize).min(JUNCTION_NOISE);
    if na < JUNCTION_EDGE || nb < JUNCTION_EDGE {
        return Ok(Vec::new());
    }
    let mut xa = vec![0f32; n_ch * na];
    let mut xb = vec![0f32; n_ch * nb];
    a.read_channels(a.n_samples() - na as u64, na, map, &mut xa)?;
    b.read_channels(0, nb, map, &mut xb)?;
    let mut out = Vec::with_capacity(n_ch);
    for c in 0..n_ch {
        let ra = &xa[c * na..(c + 1) * na];
        let rb = &xb[c * nb..(c + 1) * nb];
        let step = median(&mut rb[..JUNCTION_EDGE].to_vec())
            - median(&mut ra[na - JUNCTION_EDGE..].to_vec());
        let mut d: Vec<f32> = ra
            .windows(2)
            .chain(rb.windows(2))
            .map(|w| (w[1] - w[0]).abs())
            .collect();
        // Median |difference| of white noise = 0.6745·√2·sd.
        let sd = median(&mut d) / (0.6745 * std::f64::consts::SQRT_2);
        out.push((step, sd));
    }
    Ok(out)
}

/// Warnings for baseline steps where one file of a recording ends and the
/// next begins (`paths` opened with `opts`, as [`super::open_many`] opens
/// them): each names the two files, the junction's sample and time, the
/// largest step (file units and noise sd, with its channel) and how many
/// channels step by at least [`JUNCTION_STEP_SDS`] sd. The high-pass filter
/// rings at such a step, and the ringing is detected as spikes around the
/// junction. Only the file channels in `channels` (the probe's `chanMap`) are
/// compared: a sync channel's level is not a baseline. Files that cannot be
/// read give no warning, and what opening them finds is left to the run's own
/// opening ([`super::open_many`]), which reports it once.
pub fn junction_warnings(
    paths: &[PathBuf],
    opts: &super::OpenOptions,
    channels: &[u64],
) -> Vec<String> {
    if paths.len() < 2 {
        return Vec::new();
    }
    let (opened, _reported_by_the_run) = super::with_warning_sink(|| {
        let mut parts = Vec::new();
        for p in paths {
            parts.push(super::open_untrimmed(p, opts)?.recording);
        }
        Ok::<_, RecordingError>(parts)
    });
    let Ok(parts) = opened else {
        return Vec::new();
    };
    let Some(n_file) = parts.first().map(|r| r.n_channels() as u64) else {
        return Vec::new();
    };
    let channels: Vec<u64> = channels.iter().copied().filter(|&c| c < n_file).collect();
    let mut warnings = Vec::new();
    let mut at = 0u64;
    for j in 0..parts.len().saturating_sub(1) {
        at += parts[j].n_samples();
        let Ok(s) = steps(parts[j].as_ref(), parts[j + 1].as_ref(), &channels) else {
            continue;
        };
        let ratio = |&(step, sd): &(f64, f64)| {
            if sd > 0.0 {
                step.abs() / sd
            } else if step != 0.0 {
                f64::INFINITY
            } else {
                0.0
            }
        };
        let over = s.iter().filter(|x| ratio(x) >= JUNCTION_STEP_SDS).count();
        let Some((c, worst)) = s
            .iter()
            .enumerate()
            .max_by(|a, b| ratio(a.1).total_cmp(&ratio(b.1)))
        else {
            continue;
        };
        if over == 0 {
            continue;
        }
        warnings.push(format!(
            "the baseline steps where {} ends and {} begins (sample {at}, {:.3} s): by up to {:.1} file units on channel {} ({:.0} × its noise sd; {over} of {} channels step by {JUNCTION_STEP_SDS} sd or more). The high-pass filter rings at a step and the ringing is detected as spikes within a few ms of it; remove each file's offset (subtract its per-channel median) or sort the files separately",
            paths[j].display(),
            paths[j + 1].display(),
            at as f64 / parts[0].fs(),
            worst.0,
            channels[c],
            ratio(worst),
            s.len()
        ));
    }
    warnings
}
