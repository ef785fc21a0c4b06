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
//! * [`simulate`]: synthetic SpikeGLX recordings with ground truth.
#![deny(missing_docs)]

pub mod detect;
pub mod error;
pub mod npy;
pub mod output;
pub mod pipeline;
pub mod preprocess;
pub mod probe;
pub mod recording;
pub mod simulate;

pub use detect::{DetectionSettings, Detections, Geometry, UniversalTemplates};
pub use probe::Probe;
