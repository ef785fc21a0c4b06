//! Kilosort4's universal-template spike detection (`kilosort/spikedetect.py`).
//!
//! * [`settings`]: [`DetectionSettings`] with Kilosort4's names and defaults.
//! * [`templates`]: the built-in universal templates wTEMP and wPCA.
//! * [`learn`]: wTEMP and wPCA learned from the recording (`templates_from_data`).
//! * [`template_check`]: learned templates checked for their peak at `nt0min`.
//! * [`geometry`]: `template_centers`, `nearest_chans` (iC, iC2) and the spatial weights.
//! * [`cpu`]: the reference detector, one function per step.
//! * `gpu` (features `cuda`, `wgpu`): the same steps as CubeCL kernels, `GpuDetector`.

pub mod cpu;
pub mod geometry;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod gpu;
pub mod learn;
pub mod settings;
pub mod template_check;
pub mod templates;

pub use cpu::{Detections, detect_window};
pub use geometry::Geometry;
pub use settings::DetectionSettings;
pub use templates::UniversalTemplates;
