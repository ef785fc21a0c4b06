//! Kilosort4 preprocessing: channel mean, median CAR, FFT high-pass, local whitening.
//!
//! Follows Kilosort4 4.1.7 (`kilosort/preprocessing.py`, `io.BinaryFiltered.filter`),
//! as written up in `shared/docs/preprocessing-spec.md`. Each padded window
//! (C sites × N = `batch_size + 2·nt` samples, f32, rows in chanMap order) goes
//! through:
//!
//! 1. [`remove_channel_means`] and, if `do_CAR`, [`subtract_channel_median`]
//!    (the lower median across channels) — together [`common_reference`];
//! 2. the zero-phase high-pass ([`HighpassFilter`], kernel from
//!    [`highpass_kernel`]), circular within the window;
//! 3. the artifact check (`artifact_threshold`): a window reaching it becomes zeros;
//! 4. whitening `X ← W·X` ([`Whitening`]), W from [`fit_whitening`].
//!
//! [`Preprocessor`] holds the precomputed pieces and runs all steps in place;
//! [`Preprocessor::fit`] fits W from a reader closure first.
//!
//! Accuracy against Kilosort4's own outputs (`tests/preprocessing.rs`, the
//! 32-channel fixture, N = 6122): CAR bitwise; kernel within 4e-22; CAR +
//! high-pass within 6e-6 of the RMS; W within 8e-7 of its peak (Kilosort's
//! own W moves by as much between thread counts); whole batches within
//! 1.8e-5 of the RMS. At N = 60 122 the high-pass agreed with Kilosort's to
//! 2.1e-5 of the RMS on random data, as close as Kilosort's float32 FFT is to
//! exact arithmetic. Not covered: drift correction (Kilosort multiplies a
//! per-batch matrix onto W), `shift`/`scale`, `tmin`/`tmax`, dtype conversion
//! and padding, which belong to the reader.

pub mod blanking;
mod car;
mod covariance;
/// Partial sums of a channel mean (the device's float32 means add in the same
/// lanes).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub(crate) use car::ROW_MEAN_LANES;
/// Columns of one block of the whitening covariance's f64 sums (the device's
/// Gram kernel sums in the same blocks).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub(crate) use covariance::KC as COVARIANCE_BLOCK;
mod highpass;
mod highpass_iir;
mod whitening;

pub use blanking::{Blanking, DEFAULT_ARTIFACT_WINDOW_MS, zero_columns};
pub use car::{
    channel_medians, common_reference, invert_sign, remove_channel_means, subtract_channel_median,
};
pub use highpass::{
    HighpassFilter, KERNEL_CENTRE, KERNEL_LEN, butterworth_highpass, fit_kernel_to_window,
    highpass_kernel, highpass_kernel_f64,
};
pub use highpass_iir::{
    CircularIir, IIR_BOUND, IIR_CHUNK, IirFloat, MAX_WARM, crop_difference, iir_chunk,
    warm_up_bound, window_shift,
};
pub use whitening::{
    FitOptions, FitTimes, WHITENING_EPS, Whitening, accumulate_covariance,
    accumulate_covariance_plain, covariance_windows, fit_whitening, whitening_covariance,
    whitening_covariance_into, whitening_covariance_timed, whitening_covariance_with,
    whitening_from_covariance, whitening_neighbours,
};

use ndarray::Array2;
use serde::{Deserialize, Serialize};

use crate::error::PreprocessError;

/// Preprocessing settings, named and defaulted as in Kilosort4 4.1.7
/// (`kilosort.parameters.DEFAULT_SETTINGS` and `run_kilosort` arguments).
///
/// In JSON the names are Kilosort's (`do_CAR` keeps its capitals); a missing
/// field takes its default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PreprocessSettings {
    /// Sampling rate, Hz. Default 30 000.
    pub fs: f64,
    /// Samples per batch (NT), without the pads. Default 60 000.
    pub batch_size: usize,
    /// Pad on each side of a batch, samples (also the waveform length). Default 61.
    pub nt: usize,
    /// High-pass cutoff, Hz (3rd-order Butterworth, applied forward and backward). Default 300.
    pub highpass_cutoff: f64,
    /// Number of nearest sites (including the site itself) in each channel's
    /// local whitening. Default 32.
    pub whitening_range: usize,
    /// Every `nskip`-th batch enters the whitening covariance. Default 25.
    pub nskip: usize,
    /// Subtract the median across channels at each sample. Default true.
    #[serde(rename = "do_CAR")]
    pub do_car: bool,
    /// Multiply the data by −1 first. In Kilosort4 4.1.7 this reaches only the
    /// whitening fit (and drift estimation), not the batches used for
    /// detection; [`fit_whitening`] honours it and [`Preprocessor`] does not.
    /// Default false.
    pub invert_sign: bool,
    /// A high-passed window with any |value| at or above this is replaced by
    /// zeros. `None` (JSON `null` or absent) is Kilosort's default, infinity:
    /// no check.
    pub artifact_threshold: Option<f64>,
}

impl Default for PreprocessSettings {
    fn default() -> Self {
        PreprocessSettings {
            fs: 30_000.0,
            batch_size: 60_000,
            nt: 61,
            highpass_cutoff: 300.0,
            whitening_range: 32,
            nskip: 25,
            do_car: true,
            invert_sign: false,
            artifact_threshold: None,
        }
    }
}

impl PreprocessSettings {
    /// Padded window length N = `batch_size + 2·nt`, samples.
    pub fn window_len(&self) -> usize {
        self.batch_size + 2 * self.nt
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// [`PreprocessError::Setting`] naming the setting: `fs` not positive and
    /// finite; `highpass_cutoff` not in (0, fs/2); `batch_size`, `nskip` or
    /// `whitening_range` 0; `batch_size` below `nt`; `artifact_threshold` NaN or ≤ 0.
    pub fn validate(&self) -> Result<(), PreprocessError> {
        butterworth_highpass(self.fs, self.highpass_cutoff)?;
        for (name, v) in [
            ("batch_size", self.batch_size),
            ("nskip", self.nskip),
            ("whitening_range", self.whitening_range),
        ] {
            if v == 0 {
                return Err(PreprocessError::Setting {
                    name,
                    message: "is 0; it must be at least 1".into(),
                });
            }
        }
        if self.batch_size < self.nt {
            return Err(PreprocessError::Setting {
                name: "batch_size",
                message: format!(
                    "is {}; it must be at least nt = {} samples, so that a window holds a whole waveform",
                    self.batch_size, self.nt
                ),
            });
        }
        if let Some(t) = self.artifact_threshold
            && (t.is_nan() || t <= 0.0)
        {
            return Err(PreprocessError::Setting {
                name: "artifact_threshold",
                message: format!("is {t}; it must be positive (null means infinity, no check)"),
            });
        }
        Ok(())
    }
}

/// Whether any |value| of the window reaches `threshold` (Kilosort4's artifact
/// check after the high-pass). `None` or +∞ never does.
pub(crate) fn exceeds_artifact_threshold(window: &Array2<f32>, threshold: Option<f64>) -> bool {
    match threshold {
        Some(t) if t.is_finite() => window.iter().any(|v| f64::from(v.abs()) >= t),
        _ => false,
    }
}

/// Kilosort4's per-window preprocessing with every constant precomputed: the
/// FFT of the fitted high-pass kernel and the whitening matrix.
///
/// [`Preprocessor::apply`] does what Kilosort's detection-stage
/// `BinaryFiltered.filter` does to `padded_batch_to_torch(i)`'s raw rows
/// (without drift correction): channel means, median CAR (`do_CAR`), high-pass,
/// artifact check, whitening. As in Kilosort4 4.1.7 it never inverts the sign.
#[derive(Debug, Clone)]
pub struct Preprocessor {
    n_sites: usize,
    n: usize,
    do_car: bool,
    artifact_threshold: Option<f64>,
    highpass: HighpassFilter,
    /// The high-pass as a circular IIR (device form), when it equals `highpass`.
    iir: Option<CircularIir>,
    whitening: Whitening,
    /// Windows this preprocessor and its clones zeroed at `artifact_threshold`.
    artifact_windows: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Stretches zeroed after preprocessing (stimulus artifacts), if any.
    blanking: Option<std::sync::Arc<Blanking>>,
}

impl Preprocessor {
    /// Builds the preprocessor from the settings (kernel from
    /// [`highpass_kernel`]) and a (C × C) whitening matrix.
    ///
    /// # Errors
    /// [`PreprocessError::Setting`] for invalid settings,
    /// [`PreprocessError::Shape`] if `whiten_mat` is not square.
    pub fn new(
        settings: &PreprocessSettings,
        whiten_mat: Array2<f32>,
    ) -> Result<Self, PreprocessError> {
        let kernel = highpass_kernel(settings.fs, settings.highpass_cutoff)?;
        Preprocessor::with_kernel(settings, &kernel, whiten_mat)
    }

    /// As [`Preprocessor::new`] but with a given full high-pass kernel (e.g.
    /// Kilosort's `hp_filter`, 30 122 taps).
    ///
    /// # Errors
    /// As [`Preprocessor::new`], and [`PreprocessError::Setting`] for an empty
    /// or odd-length kernel.
    pub fn with_kernel(
        settings: &PreprocessSettings,
        kernel: &[f32],
        whiten_mat: Array2<f32>,
    ) -> Result<Self, PreprocessError> {
        settings.validate()?;
        let n = settings.window_len();
        let whitening = Whitening::new(whiten_mat)?;
        Ok(Preprocessor {
            n_sites: whitening.matrix().nrows(),
            n,
            do_car: settings.do_car,
            artifact_threshold: settings.artifact_threshold,
            highpass: HighpassFilter::new(kernel, n)?,
            iir: highpass_iir::iir_for_kernel(settings.fs, settings.highpass_cutoff, kernel, n)?,
            whitening,
            artifact_windows: Default::default(),
            blanking: None,
        })
    }

    /// Fits the whitening matrix with [`fit_whitening`] and builds the
    /// preprocessor from it: the usual way to start, given a reader.
    ///
    /// `read_raw_window(i)` returns raw window i as (C × N) f32, rows in
    /// chanMap order (see [`fit_whitening`]).
    ///
    /// # Errors
    /// As [`fit_whitening`] and [`Preprocessor::new`].
    pub fn fit<E, F>(
        n_windows: u64,
        read_raw_window: F,
        probe: &crate::probe::Probe,
        settings: &PreprocessSettings,
    ) -> Result<Self, E>
    where
        F: FnMut(u64) -> Result<Array2<f32>, E> + Send,
        E: From<PreprocessError> + Send,
    {
        let w = fit_whitening(n_windows, read_raw_window, probe, settings)?;
        Ok(Preprocessor::new(settings, w)?)
    }

    /// This preprocessor with stretches to blank after preprocessing
    /// ([`Blanking`]; `None`: none). A preprocessor that blanks has no device
    /// form ([`Preprocessor::device_form`]): every back end detects in the
    /// same host-preprocessed, blanked windows.
    pub fn with_blanking(mut self, blanking: Option<std::sync::Arc<Blanking>>) -> Self {
        self.blanking = blanking;
        self
    }

    /// The blanking, if any.
    pub fn blanking(&self) -> Option<&Blanking> {
        self.blanking.as_deref()
    }

    /// The column ranges `[start, end)` of raw window `raw` (C × N, column 0
    /// at absolute sample `first_sample`, as read) to zero once it is
    /// preprocessed ([`Blanking::ranges`]); empty without blanking. Found
    /// before preprocessing because transients are found in the raw values.
    pub fn blank_ranges(&self, raw: &Array2<f32>, first_sample: i64) -> Vec<(usize, usize)> {
        match &self.blanking {
            Some(b) => b.ranges(raw, first_sample),
            None => Vec::new(),
        }
    }

    /// [`Preprocessor::apply`] on a window whose column 0 is absolute sample
    /// `first_sample`, then the blanking's stretches zeroed.
    ///
    /// # Errors
    /// As [`Preprocessor::apply`].
    pub fn apply_at(
        &self,
        window: &mut Array2<f32>,
        first_sample: i64,
    ) -> Result<(), PreprocessError> {
        let ranges = self.blank_ranges(window, first_sample);
        self.apply(window)?;
        zero_columns(window, &ranges);
        Ok(())
    }

    /// Window shape (C sites, N samples) this preprocessor expects.
    pub fn window_shape(&self) -> (usize, usize) {
        (self.n_sites, self.n)
    }

    /// The high-pass stage.
    pub fn highpass(&self) -> &HighpassFilter {
        &self.highpass
    }

    /// The high-pass as a circular IIR ([`CircularIir`]), when it equals
    /// [`Preprocessor::highpass`] within [`IIR_BOUND`] of max|x|.
    pub fn highpass_iir(&self) -> Option<&CircularIir> {
        self.iir.as_ref()
    }

    /// The whitening stage.
    pub fn whitening(&self) -> &Whitening {
        &self.whitening
    }

    /// The high-pass of a (C × N) window in place: the circular IIR with f64
    /// state in the device's chunks ([`CircularIir::apply`], the arithmetic of
    /// the device kernels, so that CPU and GPU give the same bits) where the
    /// filter has that form, else the FFT form ([`HighpassFilter::apply`]).
    /// The two are the same operator within [`IIR_BOUND`] of max|x|.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if the window does not have N columns.
    fn apply_highpass(&self, window: &mut Array2<f32>) -> Result<(), PreprocessError> {
        highpass_window(&self.highpass, self.iir.as_ref(), window)
    }

    /// Steps 1–3: channel means, median CAR (if `do_CAR`), high-pass, artifact
    /// check; no whitening. `window`: (C × N) f32 raw values, modified in place.
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if the window is not C × N.
    pub fn filter_only(&self, window: &mut Array2<f32>) -> Result<(), PreprocessError> {
        self.check_shape(window)?;
        common_reference(window, self.do_car)?;
        self.apply_highpass(window)?;
        if exceeds_artifact_threshold(window, self.artifact_threshold) {
            self.count_artifact_window();
            window.fill(0.0);
        }
        Ok(())
    }

    /// The whole chain in place: (C × N) raw f32 window → Kilosort's
    /// preprocessed batch (CAR, high-pass, artifact check, `W·X`).
    ///
    /// # Errors
    /// [`PreprocessError::Shape`] if the window is not C × N.
    pub fn apply(&self, window: &mut Array2<f32>) -> Result<(), PreprocessError> {
        self.apply_timed(window, &mut |_, _| {})
    }

    /// As [`Preprocessor::apply`], reporting the busy seconds of each part to
    /// `lap(part, seconds)`: `car` (channel means and median CAR), `highpass`
    /// (with the artifact check) and `whitening`.
    ///
    /// # Errors
    /// As [`Preprocessor::apply`].
    pub fn apply_timed(
        &self,
        window: &mut Array2<f32>,
        lap: &mut dyn FnMut(&'static str, f64),
    ) -> Result<(), PreprocessError> {
        if self.filter_timed(window, lap)? {
            return Ok(());
        }
        self.whiten_timed(window, lap)
    }

    /// The first part of [`Preprocessor::apply_timed`]: channel means, median
    /// CAR, high-pass and the artifact check, with the busy seconds of `car`
    /// and `highpass`. Returns whether the window exceeded the artifact
    /// threshold (it is zero then, counted, and the chain whitens nothing);
    /// [`Preprocessor::whiten_timed`] is the rest.
    ///
    /// # Errors
    /// As [`Preprocessor::apply`].
    pub fn filter_timed(
        &self,
        window: &mut Array2<f32>,
        lap: &mut dyn FnMut(&'static str, f64),
    ) -> Result<bool, PreprocessError> {
        self.check_shape(window)?;
        let t0 = std::time::Instant::now();
        common_reference(window, self.do_car)?;
        let t1 = std::time::Instant::now();
        lap("car", (t1 - t0).as_secs_f64());
        self.apply_highpass(window)?;
        let artifact = exceeds_artifact_threshold(window, self.artifact_threshold);
        lap("highpass", t1.elapsed().as_secs_f64());
        if artifact {
            self.count_artifact_window();
            window.fill(0.0);
        }
        Ok(artifact)
    }

    /// The last part of [`Preprocessor::apply_timed`]: `W·X` in place on a
    /// window [`Preprocessor::filter_timed`] left, with its busy seconds as
    /// `whitening`.
    ///
    /// # Errors
    /// As [`Preprocessor::apply`].
    pub fn whiten_timed(
        &self,
        window: &mut Array2<f32>,
        lap: &mut dyn FnMut(&'static str, f64),
    ) -> Result<(), PreprocessError> {
        let t0 = std::time::Instant::now();
        self.whitening.apply(window)?;
        lap("whitening", t0.elapsed().as_secs_f64());
        Ok(())
    }

    /// [`Preprocessor::whiten_timed`] into a new array, `window` left as it
    /// was (the same bits): for keeping a high-passed window without copying
    /// it.
    ///
    /// # Errors
    /// As [`Preprocessor::apply`].
    pub fn whiten_to_new_timed(
        &self,
        window: &Array2<f32>,
        lap: &mut dyn FnMut(&'static str, f64),
    ) -> Result<Array2<f32>, PreprocessError> {
        let t0 = std::time::Instant::now();
        let out = self.whitening.apply_to_new(window)?;
        lap("whitening", t0.elapsed().as_secs_f64());
        Ok(out)
    }

    /// Counts a window zeroed by the artifact threshold
    /// ([`Preprocessor::artifact_windows`]) when its high-pass ran in an
    /// earlier pass (a window kept after its high-pass and whitened again).
    pub(crate) fn count_artifact_window(&self) {
        self.artifact_windows
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Windows zeroed at `artifact_threshold` so far by this preprocessor and
    /// its clones (they share the count).
    pub fn artifact_windows(&self) -> u64 {
        self.artifact_windows
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn check_shape(&self, window: &Array2<f32>) -> Result<(), PreprocessError> {
        if window.dim() != (self.n_sites, self.n) {
            return Err(PreprocessError::Shape {
                what: "window",
                rows: window.nrows(),
                cols: window.ncols(),
                expected_rows: self.n_sites,
                expected_cols: self.n,
            });
        }
        Ok(())
    }
}

/// Tap floor of the device high-pass ([`DevicePreprocessing`]): taps below this
/// fraction of the peak are dropped. At 300 Hz / 30 kHz this keeps lags
/// ±≈500, and the dropped taps sum to about 1e-7 of the peak.
pub const DEVICE_TAP_FLOOR: f32 = 1e-9;

/// The constants of [`Preprocessor::apply`] in the form the GPU kernels take
/// (`crate::detect::gpu::preprocess`): the high-pass as a short direct
/// correlation, the whitening as a CSR sparse matrix.
#[derive(Debug, Clone)]
pub struct DevicePreprocessing {
    /// Sites C.
    pub n_sites: usize,
    /// Window length N, samples.
    pub n: usize,
    /// Median CAR on (`do_CAR`).
    pub do_car: bool,
    /// High-pass taps h\[q\], q < K: y\[t\] = Σ_q h\[q\]·x\[(t + first + q) mod N\].
    pub taps: Vec<f32>,
    /// Offset of the first tap, samples (negative: before t).
    pub first: i32,
    /// The dropped taps' absolute sum over the peak tap (a bound on the
    /// high-pass's error relative to the input's largest magnitude).
    pub dropped_tail: f64,
    /// The same high-pass as a circular forward–backward IIR, when it equals
    /// the CPU's within [`IIR_BOUND`] of max|x| (window long enough, kernel the
    /// Butterworth design's of `fs` and `highpass_cutoff`; see [`CircularIir`]);
    /// the device runs it where it has f64 arithmetic.
    pub iir: Option<CircularIir>,
    /// Whitening rows: row j's non-zeros are `cols/vals[start[j]..start[j + 1]]`, in column order.
    pub w_start: Vec<u32>,
    /// Column (site) of each non-zero.
    pub w_cols: Vec<u32>,
    /// Value of each non-zero.
    pub w_vals: Vec<f32>,
}

impl Preprocessor {
    /// This preprocessor's constants for the device, with the high-pass taps above
    /// `floor` × the peak ([`DEVICE_TAP_FLOOR`] by default). `None` when a step has
    /// no device version: Kilosort4's artifact check (`artifact_threshold`),
    /// or the blanking of stimulus artifacts ([`Preprocessor::with_blanking`]).
    pub fn device_form(&self, floor: f32) -> Option<DevicePreprocessing> {
        if self.artifact_threshold.is_some_and(|t| t.is_finite()) || self.blanking.is_some() {
            return None;
        }
        let taps = self.highpass.taps();
        let n = self.n;
        let peak = taps.iter().fold(0.0f32, |a, &b| a.max(b.abs()));
        let keep = |v: &f32| v.abs() > floor * peak;
        let f = taps.iter().position(keep).unwrap_or(0);
        let l = taps.iter().rposition(keep).unwrap_or(0);
        let tail: f64 = taps[..f]
            .iter()
            .chain(&taps[l + 1..])
            .map(|&v| f64::from(v.abs()))
            .sum::<f64>()
            / f64::from(peak.max(f32::MIN_POSITIVE));
        // The CPU's summation order (the same code applies drift correction's
        // G_b = M_b·W).
        let (w_start, w_cols, w_vals) = self.whitening.csr();
        Some(DevicePreprocessing {
            n_sites: self.n_sites,
            n,
            do_car: self.do_car,
            taps: taps[f..=l].to_vec(),
            first: f as i32 - (n / 2) as i32,
            dropped_tail: tail,
            iir: self.iir.clone(),
            w_start,
            w_cols,
            w_vals,
        })
    }
}

/// The high-pass of a (C × N) window in place: `iir` (f64 state, the device's
/// chunks: the device kernels' arithmetic, so the same bits) when given, else
/// the FFT form `hp`. [`Preprocessor`] and the whitening fit both filter so.
///
/// # Errors
/// [`PreprocessError::Shape`] if the window does not have N columns.
pub(crate) fn highpass_window(
    hp: &HighpassFilter,
    iir: Option<&CircularIir>,
    window: &mut Array2<f32>,
) -> Result<(), PreprocessError> {
    match iir {
        Some(iir) => iir.apply_f64(window, highpass_iir::iir_chunk()),
        None => hp.apply(window),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_json_uses_kilosort_names() {
        let s: PreprocessSettings =
            serde_json::from_str(r#"{"do_CAR": false, "batch_size": 6000}"#).unwrap();
        assert!(!s.do_car);
        assert_eq!(s.batch_size, 6000);
        assert_eq!(s.nskip, 25);
        assert_eq!(s.window_len(), 6122);
        assert!(s.artifact_threshold.is_none());
        let back = serde_json::to_string(&s).unwrap();
        assert!(back.contains("\"do_CAR\":false"));
    }

    #[test]
    fn bad_settings_are_errors() {
        let s = PreprocessSettings {
            nskip: 0,
            ..Default::default()
        };
        assert!(s.validate().is_err());
        let s = PreprocessSettings {
            artifact_threshold: Some(-1.0),
            ..Default::default()
        };
        assert!(s.validate().is_err());
    }

    #[test]
    fn artifact_threshold_zeroes_the_window() {
        let s = PreprocessSettings {
            batch_size: 100,
            artifact_threshold: Some(1.0),
            ..Default::default()
        };
        let p = Preprocessor::new(&s, Array2::eye(3)).unwrap();
        let mut w = Array2::from_shape_fn((3, 222), |(i, t)| ((i * 31 + t * 17) % 23) as f32);
        p.apply(&mut w).unwrap();
        assert!(w.iter().all(|&v| v == 0.0));
        let s = PreprocessSettings {
            artifact_threshold: Some(1e6),
            ..s
        };
        let p = Preprocessor::new(&s, Array2::eye(3)).unwrap();
        let mut w = Array2::from_shape_fn((3, 222), |(i, t)| ((i * 31 + t * 17) % 23) as f32);
        p.apply(&mut w).unwrap();
        assert!(w.iter().any(|&v| v != 0.0));
    }

    #[test]
    fn wrong_window_shape_is_an_error() {
        let s = PreprocessSettings {
            batch_size: 100,
            ..Default::default()
        };
        let p = Preprocessor::new(&s, Array2::eye(4)).unwrap();
        let mut w = Array2::<f32>::zeros((4, 100));
        assert!(p.apply(&mut w).is_err());
        let mut w = Array2::<f32>::zeros((4, 222));
        assert!(p.apply(&mut w).is_ok());
    }
}
