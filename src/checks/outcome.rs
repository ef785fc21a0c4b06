//! Checks of a run's outcome: results that are possible but almost always mean
//! that the input was read wrongly.

/// Recording length, seconds, from which a run that finds no spike is warned about.
pub const ZERO_SPIKES_MIN_SECONDS: f64 = 2.0;

/// A warning when a run over `seconds` of recording (at least
/// [`ZERO_SPIKES_MIN_SECONDS`]) found no spike at all: a real extracellular
/// recording of that length has some, so the data were most likely read
/// wrongly. The message lists the usual causes and their flags.
pub fn zero_spikes_warning(n_spikes: u64, seconds: f64) -> Option<String> {
    (n_spikes == 0 && seconds >= ZERO_SPIKES_MIN_SECONDS).then(|| {
        format!(
            "no spikes were found in {seconds:.1} s of recording; this almost always means the data were read wrongly: check --dtype (int16, uint16, int32, float32), --n-channels, --offset and --scale (values far from int16 counts), the probe (--probe), and the thresholds (--th-universal)"
        )
    })
}

/// What `artifact_threshold` did in a run: `zeroed` of `n_windows` windows
/// (of `batch_size` samples at `fs` Hz) reached it and were zeroed whole, as
/// Kilosort4 does. A warning when any was (with the seconds lost and the
/// spikes' fate); `None` when the threshold is off or zeroed nothing (logged).
pub fn artifact_windows_warning(
    threshold: Option<f64>,
    zeroed: u64,
    n_windows: u64,
    batch_size: usize,
    fs: f64,
) -> Option<String> {
    let t = threshold.filter(|t| t.is_finite())?;
    if zeroed == 0 {
        tracing::info!("--artifact-threshold {t}: no window reached it; nothing was zeroed");
        return None;
    }
    Some(format!(
        "--artifact-threshold {t}: {zeroed} of {n_windows} windows reached it and were zeroed whole (about {:.1} s of recording, every spike in them lost), as Kilosort4 does; a higher threshold, or removing the artifacts before sorting, keeps them",
        zeroed as f64 * batch_size as f64 / fs
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_spikes_warns_from_two_seconds() {
        assert!(zero_spikes_warning(0, 1.9).is_none());
        assert!(zero_spikes_warning(1, 100.0).is_none());
        let w = zero_spikes_warning(0, 57.5).unwrap();
        assert!(w.contains("57.5 s") && w.contains("--dtype"), "{w}");
    }

    #[test]
    fn zeroed_windows_are_counted_in_seconds() {
        assert!(artifact_windows_warning(None, 3, 10, 60_000, 30_000.0).is_none());
        assert!(artifact_windows_warning(Some(500.0), 0, 10, 60_000, 30_000.0).is_none());
        let w = artifact_windows_warning(Some(500.0), 3, 10, 60_000, 30_000.0).unwrap();
        assert!(w.contains("3 of 10 windows") && w.contains("6.0 s"), "{w}");
    }
}
