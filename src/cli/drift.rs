//! Drift flags of `detect` (Kilosort4's names and defaults; see `spikecube::drift`).

use spikecube::drift::{DriftMode, DriftSettings};

/// Drift estimation and correction.
#[derive(Debug, clap::Args)]
pub struct DriftArgs {
    /// Drift correction: 0 turns it off; 1 (default) is rigid correction;
    /// n > 1 gives 2n − 1 overlapping depth blocks, non-rigid (Kilosort4's
    /// nblocks).
    #[arg(long, default_value_t = 1)]
    pub nblocks: usize,
    /// Gaussian σ of the drift scores over (lag, window, block), three
    /// numbers: `0.5,0.5,0.5` or `0.5 0.5 0.5`.
    #[arg(long, value_delimiter = ',', num_args = 1..=3, default_values_t = [0.5, 0.5, 0.5])]
    pub drift_smoothing: Vec<f64>,
    /// Width of the interpolation kernel of the correction, µm (Kilosort4's
    /// sig_interp).
    #[arg(allow_negative_numbers = true, long, default_value_t = 20.0)]
    pub sig_interp: f64,
    /// Height of the depth bins of the drift histogram, µm (Kilosort4's
    /// binning_depth).
    #[arg(allow_negative_numbers = true, long, default_value_t = 5.0)]
    pub binning_depth: f64,
    /// Stop after estimating drift: write drift.npy, drift_blocks.npy,
    /// drift.png and the first pass's (uncorrected) spikes (`detect` only;
    /// `sort` refuses it).
    #[arg(long)]
    pub drift_only: bool,
    /// `spikecube` (default) makes Kilosort4's sharp edges safe (empty windows,
    /// probes too short for the search, too many blocks); `kilosort` keeps them.
    #[arg(long, value_enum, default_value_t = DriftMode::Spikecube)]
    pub drift_mode: DriftMode,
    /// µm: sites whose drift-corrected position lies more than this beyond the
    /// probe's end read zero (no data there); `inf` keeps Kilosort4's
    /// extrapolation (always so with --drift-mode kilosort).
    #[arg(allow_negative_numbers = true, long, default_value_t = 15.0)]
    pub drift_edge_margin: f64,
}

impl DriftArgs {
    /// The settings.
    ///
    /// # Errors
    /// `--drift-smoothing` without exactly three numbers.
    pub fn settings(&self) -> anyhow::Result<DriftSettings> {
        let s = &self.drift_smoothing;
        if s.len() != 3 {
            anyhow::bail!(
                "--drift-smoothing takes three numbers (σ over lag, window, block), e.g. 0.5,0.5,0.5; got {}",
                s.len()
            );
        }
        Ok(DriftSettings {
            nblocks: self.nblocks,
            binning_depth: self.binning_depth,
            drift_smoothing: [s[0], s[1], s[2]],
            sig_interp: self.sig_interp,
            drift_only: self.drift_only,
            mode: self.drift_mode,
            edge_margin: self.drift_edge_margin,
        })
    }
}
