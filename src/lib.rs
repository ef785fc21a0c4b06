//! # spikecube
//!
//! Kilosort4's universal-template spike detection, reimplemented in Rust: the
//! same detections as Kilosort4 4.1.7 (`spikedetect.run` with
//! `templates_from_data = False`), on the CPU (rayon) or, later, on any GPU
//! through CubeCL.
//!
//! The pipeline flows one way:
//!
//! ```text
//! recording file ─▶ windows ─▶ preprocess ─▶ detect ─▶ spikes on disk
//!       ▲ probe ───────────────────┘ (geometry: centres, neighbours, weights)
//! ```
//!
//! * [`probe`]: site geometry and its loaders.
//! * [`recording`]: readers (flat binary, SpikeGLX, Open Ephys) and windows cut as Kilosort4 cuts them.
//! * [`preprocess`]: channel mean, median CAR, high-pass, whitening.
//! * [`detect`]: template centres, neighbourhoods, the reference CPU detector.
//! * [`output`]: `.npy` files, Phy's `params.py`, provenance and the drift map.
//! * [`pipeline`]: the whole run, recording to output folder.
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
//! * [`simulate`]: synthetic SpikeGLX recordings with ground truth.
#![deny(missing_docs)]

pub mod backend;
pub mod checks;
pub mod detect;
pub mod drift;
pub mod error;
pub mod npy;
pub mod output;
pub mod pipeline;
pub mod preprocess;
pub mod preprocess_folder;
pub mod probe;
pub mod recording;
pub mod simulate;
pub mod stages;
pub mod universal;

pub use detect::{DetectionSettings, Detections, Geometry, UniversalTemplates};
pub use probe::Probe;
