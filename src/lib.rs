//! # spikecube
//!
//! Kilosort4 (4.1.7) reimplemented in Rust: its preprocessing, universal
//! templates, drift correction and spike detection, with the same detections
//! as Kilosort4's `run_kilosort` up to and including the detection pass after
//! drift correction. Every step runs on the CPU (rayon; the reference, giving
//! the same bits for any number of threads) or on a GPU through CubeCL: CUDA on
//! NVIDIA cards, wgpu (Vulkan, Metal) elsewhere, with the same spikes and
//! floats within float32 rounding of the CPU's.
//!
//! The default run is Kilosort4's default: universal templates learned from
//! the data (`templates_from_data = True`), a first detection pass, the drift
//! estimate (`nblocks = 1`), templates learned again from the drift-corrected
//! windows, and the detection pass with drift correction. The sorting stages
//! that follow in Kilosort4 (clustering, template matching, merges, Phy
//! output) are being added under `src/sort/`, after the detection pass.
//!
//! A run is a chain of stages ([`pipeline`]; docs/architecture.md draws it):
//!
//! ```text
//! recording + probe ─▶ open ─▶ device ─▶ whitening fit ─▶ universal templates
//!     ─▶ drift (first pass, estimate) ─▶ detection pass ─▶ outputs (folder)
//!                                                  └─▶ (sort stages, to come)
//! ```
//!
//! * [`probe`]: site geometry and its loaders.
//! * [`recording`]: readers (flat binary, SpikeGLX, Open Ephys) and windows cut as Kilosort4 cuts them.
//! * [`checks`]: input checks (scale, channel health, stuck stretches, layout).
//! * [`preprocess`]: channel mean, median CAR, high-pass, whitening and its fit.
//! * [`detect`]: template centres, neighbourhoods, learned templates, the CPU
//!   detector and the GPU kernels.
//! * [`backend`]: choosing a back end and the [`backend::Detector`] on it.
//! * [`universal`]: where a run's templates come from.
//! * [`drift`]: the drift estimate and its correction.
//! * [`stages`]: one pass over a recording's windows, read, preprocessed and
//!   detected on overlapping threads ([`stages::WindowPass`]: host or device).
//! * [`pipeline`]: the whole run, recording to output folder, stage by stage;
//!   [`timing`] times its stages.
//! * [`output`]: `.npy` files, Phy's `params.py`, provenance and the drift map.
//! * [`simulate`]: synthetic SpikeGLX recordings with ground truth.
//! * [`preprocess_folder`]: the output folder of `spikecube preprocess`.
//!
//! Detection on one whitened window (C sites × NT samples):
//!
//! ```
//! use ndarray::Array2;
//! use spikecube::detect::cpu::CpuDetector;
//! use spikecube::{DetectionSettings, Geometry, Probe, UniversalTemplates};
//!
//! // Four sites on a 20 µm square (µm), one shank, file columns 0–3.
//! let probe = Probe {
//!     xc: vec![0.0, 20.0, 0.0, 20.0],
//!     yc: vec![0.0, 0.0, 20.0, 20.0],
//!     kcoords: vec![0; 4],
//!     chan_map: vec![0, 1, 2, 3],
//!     n_chan: 4,
//!     source: "example".into(),
//! };
//! let settings = DetectionSettings::default();
//! let geometry = Geometry::new(&probe, &settings)?;
//! assert_eq!(geometry.n_centres(), 6);
//!
//! // A window of 2 122 samples (2 000 own + 61 on each side) with one spike:
//! // the template shape itself, 40× larger than unit noise, on site 0.
//! let templates = UniversalTemplates::builtin();
//! let mut x = Array2::<f32>::zeros((4, 2122));
//! for i in 0..61 {
//!     x[[0, 1000 - 20 + i]] = 40.0 * templates.wtemp[[0, i]];
//! }
//! let mut detector = CpuDetector::new(geometry, templates, settings)?;
//! let spikes = detector.detect(x.view(), &probe.yc)?;
//! // Detected 10 samples after the trough (Kilosort4's convention).
//! assert!(spikes.sample.iter().all(|&t| t == 1010));
//! assert!(!spikes.is_empty());
//! # Ok::<(), spikecube::error::DetectError>(())
//! ```
#![deny(missing_docs)]

pub mod backend;
pub mod batch;
pub mod cancel;
pub mod checks;
pub mod detect;
pub mod drift;
pub mod error;
pub mod npy;
pub mod output;
pub mod pipeline;
mod prefetch;
pub mod preprocess;
pub mod preprocess_folder;
pub mod probe;
pub mod provenance;
pub mod recording;
mod simd;
pub mod simulate;
pub mod sort;
pub mod stages;
pub mod timing;
pub mod universal;

pub use detect::{DetectionSettings, Detections, Geometry, UniversalTemplates};
pub use probe::Probe;
