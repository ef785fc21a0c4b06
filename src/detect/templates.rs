//! Kilosort4's built-in universal templates, shipped with spikecube as data
//! (`data/universal_templates/`, read from the `wTEMP.npz` of `kilosort==4.1.7`).

use ndarray::Array2;
use ndarray_npy::ReadNpyExt;

static WTEMP_NPY: &[u8] = include_bytes!("../../data/universal_templates/wTEMP.npy");
static WPCA_NPY: &[u8] = include_bytes!("../../data/universal_templates/wPCA.npy");

/// The universal templates: temporal waveforms correlated with every channel
/// (`wtemp`) and the temporal PCs the spike features are projected on (`wpca`).
#[derive(Debug, Clone, PartialEq)]
pub struct UniversalTemplates {
    /// wTEMP: 6 × 61 float32, unit L2 norm per row, troughs at sample 19–20.
    pub wtemp: Array2<f32>,
    /// wPCA: 6 × 61 float32, orthonormal rows.
    pub wpca: Array2<f32>,
}

impl UniversalTemplates {
    /// Kilosort4's built-in templates (`templates_from_data = False`).
    pub fn builtin() -> UniversalTemplates {
        let read = |bytes: &[u8]| {
            Array2::<f32>::read_npy(std::io::Cursor::new(bytes)).expect(
                "the built-in template file shipped with spikecube is a valid 6 × 61 float32 .npy",
            )
        };
        UniversalTemplates {
            wtemp: read(WTEMP_NPY).as_standard_layout().to_owned(),
            wpca: read(WPCA_NPY).as_standard_layout().to_owned(),
        }
    }
}
