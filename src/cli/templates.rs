//! Flags choosing the universal templates of `detect` (learned, built-in or a file).

use std::path::PathBuf;

use anyhow::Result;
use spikecube::DetectionSettings;
use spikecube::universal::{TemplateChoice, TemplateSource};

/// Universal templates: learned from the data (Kilosort4's default), built-in, or a file.
#[derive(Debug, Clone, clap::Args)]
pub struct TemplateArgs {
    /// Learn the universal templates (wTEMP, wPCA) from isolated peaks of the
    /// recording, as Kilosort4 does by default (templates_from_data); false
    /// detects with Kilosort4's built-in templates. [default: true; false
    /// with --templates]
    #[arg(long, action = clap::ArgAction::Set)]
    pub templates_from_data: Option<bool>,
    /// Threshold for the single-channel peaks templates are learned from, whitened units (Kilosort4's Th_single_ch).
    #[arg(allow_negative_numbers = true, long, default_value_t = 6.0)]
    pub th_single_ch: f32,
    /// Temporal templates (Kilosort4's n_templates; the detector takes 6).
    #[arg(long, default_value_t = 6)]
    pub n_templates: usize,
    /// PC features per site (Kilosort4's n_pcs, 1–6).
    #[arg(long, default_value_t = 6)]
    pub n_pcs: usize,
    /// Seed of the k-means++ draws when learning templates (same seed, same templates on any machine and thread count).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Fewer isolated clips than this: use the built-in templates, with a
    /// warning (spikecube's; Kilosort4 learns from any number: 6 comes closest).
    #[arg(long, default_value_t = spikecube::detect::learn::DEFAULT_MIN_CLIPS)]
    pub min_learn_clips: usize,
    /// Check each learned template for its peak at nt0min (±3 samples) and
    /// realign or replace one that is off centre, with a warning (false keeps
    /// it, as Kilosort4 does: every spike may then be detected twice).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub template_check: bool,
    /// Use wTEMP and wPCA from this .npz file (Kilosort4's wTEMP.npz layout, or
    /// a spikecube output's wTEMP.npy/wPCA.npy saved with np.savez) instead of
    /// learning them.
    #[arg(long, value_name = "FILE.npz")]
    pub templates: Option<PathBuf>,
}

impl TemplateArgs {
    /// Sets `n_templates` and `n_pcs` in `det` and returns the template source.
    ///
    /// # Errors
    /// When the `--templates` file cannot be read or does not fit.
    pub fn apply(&self, det: &mut DetectionSettings) -> Result<TemplateSource> {
        det.n_templates = self.n_templates;
        det.n_pcs = self.n_pcs;
        det.validate()?;
        TemplateChoice {
            templates_from_data: self.templates_from_data,
            th_single_ch: self.th_single_ch,
            seed: self.seed,
            min_learn_clips: self.min_learn_clips,
            template_check: self.template_check,
            templates: self.templates.clone(),
        }
        .source(det)
    }
}
