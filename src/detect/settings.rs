//! Detection settings, named and defaulted as in Kilosort4 4.1.7
//! (`kilosort.parameters.DEFAULT_SETTINGS`).

use serde::{Deserialize, Serialize};

use crate::error::DetectError;

/// Settings of the universal-template detection pass (Kilosort4's `spikedetect`).
///
/// Every field keeps Kilosort4's name (snake case; `Th_universal` becomes
/// `th_universal` in Rust and stays `Th_universal` in JSON) and default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DetectionSettings {
    /// Detection threshold on the best spatio-temporal filter output |A|; a
    /// detection needs |A| strictly above it. Default 9.
    #[serde(rename = "Th_universal")]
    pub th_universal: f32,
    /// Waveform length in samples; also the padding on each side of a window.
    /// Must be 61 with the built-in universal templates. Default 61.
    pub nt: usize,
    /// Alignment sample of the templates; half-width of the ±`nt0min` time
    /// max-pool. `None` derives `floor(20·nt/61)` = 20.
    pub nt0min: Option<usize>,
    /// Vertical site pitch in µm; template centres are spaced `dmin/2` vertically.
    /// `None` derives it from the median spacing of the unique site depths.
    pub dmin: Option<f64>,
    /// Horizontal site pitch in µm; centres are spaced about `dminx/2` horizontally. Default 32.
    pub dminx: f64,
    /// Smallest spatial size, µm; the sizes are `min_template_size·(1..=template_sizes)`. Default 10.
    pub min_template_size: f64,
    /// Number of spatial sizes. Default 5.
    pub template_sizes: usize,
    /// Sites per template centre (nC); lowered to the site count when the probe has fewer. Default 10.
    pub nearest_chans: usize,
    /// Template centres in each centre's neighbourhood for the neighbour max (nC2);
    /// all centres when there are fewer. Default 100.
    pub nearest_templates: usize,
    /// Centres farther than this (µm) from every site are dropped (inclusive). Default 32.
    pub max_channel_distance: f64,
    /// Number of universal temporal templates (rows of wTEMP). Default 6.
    pub n_templates: usize,
    /// Number of temporal PCs for the features (rows of wPCA). Default 6.
    pub n_pcs: usize,
    /// Keep each template centre's neighbour centres (`iC2`) on its own shank, so a
    /// spike on one shank never suppresses a spike on another (field failures BR-04,
    /// BR-06). Kilosort4 lets `iC2` cross shanks when a shank has fewer than
    /// `nearest_templates` centres nearby; `false` reproduces that. A centre's sites
    /// (`iC`) are always taken from its own shank. Default true. Not a Kilosort4 setting.
    pub separate_shanks: bool,
    /// A folder holding Kilosort4's `iC.npy`, `iC2.npy` and `weigh.npy` (e.g.
    /// from its `ops`) to use instead of computing them (`--neighbourhoods`):
    /// Kilosort4 orders equally distant sites and centres by numpy's unstable
    /// argsort, whose order depends on the CPU, where spikecube takes the
    /// lower index; with Kilosort4's own files a comparison needs no tie rule.
    /// Default `None`. Not a Kilosort4 setting.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub neighbourhoods: Option<std::path::PathBuf>,
}

impl Default for DetectionSettings {
    fn default() -> Self {
        DetectionSettings {
            th_universal: 9.0,
            nt: 61,
            nt0min: None,
            dmin: None,
            dminx: 32.0,
            min_template_size: 10.0,
            template_sizes: 5,
            nearest_chans: 10,
            nearest_templates: 100,
            max_channel_distance: 32.0,
            n_templates: 6,
            n_pcs: 6,
            separate_shanks: true,
            neighbourhoods: None,
        }
    }
}

impl DetectionSettings {
    /// The alignment sample: `nt0min`, or `floor(20·nt/61)` when unset (Kilosort4's rule).
    pub fn nt0min(&self) -> usize {
        self.nt0min.unwrap_or(20 * self.nt / 61)
    }

    /// `nearest_chans` clamped to the number of sites, as Kilosort4's `initialize_ops` does.
    pub fn n_chans_used(&self, n_sites: usize) -> usize {
        self.nearest_chans.min(n_sites)
    }

    /// Checks ranges and the constraints of the built-in templates.
    ///
    /// # Errors
    /// [`DetectError::Setting`] naming the setting and the allowed values.
    pub fn validate(&self) -> Result<(), DetectError> {
        let bad = |name, message: String| Err(DetectError::Setting { name, message });
        if self.nt != 61 {
            return bad(
                "nt",
                format!(
                    "is {}; the built-in universal templates are 61 samples long, so nt must be 61",
                    self.nt
                ),
            );
        }
        if self.n_templates != 6 {
            return bad(
                "n_templates",
                format!(
                    "is {}; the detector's filter bank takes 6 temporal templates (built-in or learned)",
                    self.n_templates
                ),
            );
        }
        if self.n_pcs == 0 || self.n_pcs > 6 {
            return bad(
                "n_pcs",
                format!(
                    "is {}; must be 1 to 6 (rows of the built-in wPCA)",
                    self.n_pcs
                ),
            );
        }
        if self.nt0min() >= self.nt {
            return bad(
                "nt0min",
                format!("is {}; must be below nt = {}", self.nt0min(), self.nt),
            );
        }
        if !(self.th_universal.is_finite() && self.th_universal > 0.0) {
            return bad(
                "Th_universal",
                format!("is {}; must be a positive number", self.th_universal),
            );
        }
        if let Some(d) = self.dmin
            && !(d.is_finite() && d > 0.0)
        {
            return bad(
                "dmin",
                format!("is {d} µm; must be positive (or unset to derive it from the probe)"),
            );
        }
        if !(self.dminx.is_finite() && self.dminx > 0.0) {
            return bad("dminx", format!("is {} µm; must be positive", self.dminx));
        }
        if !(self.min_template_size.is_finite() && self.min_template_size > 0.0) {
            return bad(
                "min_template_size",
                format!("is {} µm; must be positive", self.min_template_size),
            );
        }
        if self.template_sizes == 0 || self.template_sizes > 32 {
            return bad(
                "template_sizes",
                format!("is {}; must be 1 to 32", self.template_sizes),
            );
        }
        if self.nearest_chans == 0 {
            return bad("nearest_chans", "is 0; must be at least 1".into());
        }
        if self.nearest_templates == 0 {
            return bad("nearest_templates", "is 0; must be at least 1".into());
        }
        if !(self.max_channel_distance.is_finite() && self.max_channel_distance >= 0.0) {
            return bad(
                "max_channel_distance",
                format!(
                    "is {} µm; must be a non-negative number",
                    self.max_channel_distance
                ),
            );
        }
        Ok(())
    }
}
