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
}
