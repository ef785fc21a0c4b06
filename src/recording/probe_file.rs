//! [`Probe::load`]: a probe from any file a user names — the probe formats
//! of [`crate::probe`] and the geometry in a SpikeGLX `.meta`. It lives with
//! the recordings because a `.meta` is a recording's metadata: the probe
//! module stays below the recording readers and needs none of them.

use std::path::Path;

use crate::error::ProbeError;
use crate::probe::{Probe, prb};

impl Probe {
    /// Loads a probe file, choosing the format from its content: Kilosort JSON
    /// (has `chanMap`), probeinterface JSON (has `probes`); by extension, a `.prb`
    /// file (parsed as data, never executed) or a SpikeGLX `.meta` (geometry of the
    /// saved AP channels, see [`crate::recording::spikeglx::Meta::probe`]).
    ///
    /// # Errors
    /// [`ProbeError`] naming the file and the field that is missing or invalid.
    pub fn load(path: &Path) -> Result<Probe, ProbeError> {
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("meta"))
        {
            return super::spikeglx::parse_meta(path)
                .and_then(|m| m.probe())
                .map_err(|e| match e {
                    crate::error::RecordingError::Probe(p) => p,
                    other => ProbeError::Parse {
                        path: path.to_owned(),
                        message: other.to_string(),
                    },
                });
        }
        let text = std::fs::read_to_string(path).map_err(|source| ProbeError::Io {
            path: path.to_owned(),
            source,
        })?;
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("prb"))
        {
            return prb::parse(&text, path);
        }
        Probe::parse(&text, path)
    }
}
