//! Noisy channels: sites whose high-pass band power (the whitening fit's
//! covariance diagonal: channel means removed, median reference subtracted when
//! on, filtered above `highpass_cutoff`) is far above the probe's typical
//! site, like the power outliers of SpikeInterface's `detect_bad_channels`.
//! Out-of-brain sites full of artifacts, a broken shield or a noisy reference
//! give thousands of artifact "spikes"; Kilosort4 does not warn. The check only
//! warns (naming the file channels and `--exclude-channels`); it changes nothing.

use ndarray::Array2;

/// A site is noisy when its filtered sd exceeds this multiple of the median
/// site's sd (SpikeInterface's power outliers use a similar ratio of powers).
pub const NOISY_SD_RATIO: f64 = 3.0;

/// Noisy sites of a whitening covariance `cc` (sites × sites, file units²):
/// (file channel from `chan_map`, sd ÷ median sd), in site order. Empty when
/// fewer than 4 sites vary (no robust median).
pub fn noisy_channels(cc: &Array2<f64>, chan_map: &[u64]) -> Vec<(u64, f64)> {
    let sd: Vec<f64> = cc.diag().iter().map(|v| v.max(0.0).sqrt()).collect();
    let mut live: Vec<f64> = sd.iter().copied().filter(|s| *s > 0.0).collect();
    if live.len() < 4 {
        return Vec::new();
    }
    let mid = (live.len() - 1) / 2;
    let (_, m, _) = live.select_nth_unstable_by(mid, f64::total_cmp);
    let median = *m;
    sd.iter()
        .enumerate()
        .filter(|(_, s)| **s > NOISY_SD_RATIO * median)
        .map(|(i, s)| (chan_map.get(i).copied().unwrap_or(i as u64), s / median))
        .collect()
}

/// The warning for [`noisy_channels`] of `cc`, or `None` when there are none:
/// the file channels, how much noisier they are, and the flag that leaves them out.
pub fn noisy_channels_warning(cc: &Array2<f64>, chan_map: &[u64]) -> Option<String> {
    let noisy = noisy_channels(cc, chan_map);
    if noisy.is_empty() {
        return None;
    }
    let (lo, hi) = noisy
        .iter()
        .fold((f64::INFINITY, 0f64), |a, n| (a.0.min(n.1), a.1.max(n.1)));
    let list: Vec<String> = noisy.iter().map(|n| n.0.to_string()).collect();
    Some(format!(
        "{} noisy channel(s) (file columns {}): their filtered sd is {lo:.1}–{hi:.1} × the median site's (more than {NOISY_SD_RATIO}×): artifacts, sites outside the brain or a broken contact; their artifacts are detected as spikes and they distort the whitening of their neighbours: --exclude-channels {} leaves them out",
        noisy.len(),
        if list.len() > 12 {
            format!(
                "{} … {}",
                list[..6].join(", "),
                list[list.len() - 3..].join(", ")
            )
        } else {
            list.join(", ")
        },
        list.join(",")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_far_above_the_median_are_named() {
        let mut cc = Array2::<f64>::zeros((8, 8));
        for i in 0..8 {
            cc[[i, i]] = 100.0 * (1.0 + 0.05 * i as f64);
        }
        let map: Vec<u64> = (10..18).collect();
        assert!(noisy_channels_warning(&cc, &map).is_none());
        cc[[6, 6]] = 100.0 * 25.0; // sd 5×
        cc[[7, 7]] = 100.0 * 12.0; // sd ≈ 3.2× the median (10.7)
        let w = noisy_channels_warning(&cc, &map).unwrap();
        assert!(
            w.contains("file columns 16, 17") && w.contains("--exclude-channels 16,17"),
            "{w}"
        );
    }
}
