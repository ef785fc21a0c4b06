//! A check of learned universal templates (wTEMP rows) against what a spike
//! template must be: its largest sample (|w|) at `nt0min`, where the learning
//! step aligned every clip's peak.
//!
//! Kilosort4 uses whatever k-means returns. A centroid whose peak sits far from
//! `nt0min` (e.g. a cluster of clips of a small peak followed, just outside the
//! ±30-sample isolation box, by a large spike) makes every real spike also match
//! it `peak − nt0min` samples early, beyond the ±20-sample suppression: each
//! spike is then detected twice. Such a row is realigned (shifted so its peak
//! lands on `nt0min`) when the shift keeps at least [`MIN_KEPT_ENERGY`] of its
//! energy, and otherwise replaced by the built-in template least like the rows
//! kept (the largest |cosine| with them smallest), so the six rows still span
//! different shapes. `--template-check false` keeps the rows as they are
//! (Kilosort4), still reporting them.

use ndarray::{Array1, Array2, ArrayView1};

use crate::detect::templates::UniversalTemplates;

/// How far (samples) a template's peak may sit from `nt0min`.
pub const PEAK_TOLERANCE: usize = 3;

/// Fraction of a template's energy (Σw²) that must remain inside the template
/// after shifting its peak to `nt0min` for it to be realigned rather than replaced.
pub const MIN_KEPT_ENERGY: f64 = 0.8;

/// What was found (and done) for one off-centre template.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TemplateFinding {
    /// Row of wTEMP (0-based, ordered by cluster size, largest first).
    pub template: usize,
    /// Sample of its largest |w|.
    pub peak_sample: usize,
    /// Where it should be.
    pub nt0min: usize,
    /// Fraction of its energy a shift to `nt0min` would keep.
    pub kept_energy: f64,
    /// `realigned`, `replaced` (by built-in row `builtin_row`) or `kept`
    /// (check off, Kilosort4's behaviour).
    pub action: String,
    /// The built-in template row that replaced it, when replaced.
    pub builtin_row: Option<usize>,
}

impl TemplateFinding {
    /// One line for the run's warnings.
    pub fn describe(&self, n_templates: usize) -> String {
        let off = self.peak_sample as i64 - self.nt0min as i64;
        let what = match (self.action.as_str(), self.builtin_row) {
            ("realigned", _) => format!(
                "realigned (shifted by {} samples, keeping {:.0} % of its energy)",
                -off,
                100.0 * self.kept_energy
            ),
            ("replaced", Some(b)) => format!(
                "replaced by built-in template {b} (a shift would keep only {:.0} % of its energy)",
                100.0 * self.kept_energy
            ),
            _ => "kept as learned (--template-check false, as Kilosort4)".into(),
        };
        format!(
            "learned template {} of {n_templates} peaks at sample {}, not at nt0min = {} (tolerance ±{PEAK_TOLERANCE}): every spike would also match it {} samples {}, outside the ±20-sample suppression, and be detected twice; {what}",
            self.template,
            self.peak_sample,
            self.nt0min,
            off.unsigned_abs(),
            if off > 0 { "early" } else { "late" },
        )
    }
}

fn peak(w: ArrayView1<f32>) -> usize {
    let mut best = 0;
    for (i, v) in w.iter().enumerate() {
        if v.abs() > w[best].abs() {
            best = i;
        }
    }
    best
}

/// `w` shifted by `shift` samples (positive: later), zero-filled, and the
/// fraction of its energy kept.
fn shifted(w: ArrayView1<f32>, shift: i64) -> (Array1<f32>, f64) {
    let n = w.len() as i64;
    let mut out = Array1::<f32>::zeros(w.len());
    for t in 0..n {
        let s = t - shift;
        if (0..n).contains(&s) {
            out[t as usize] = w[s as usize];
        }
    }
    let e = |a: ArrayView1<f32>| a.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
    let total = e(w);
    let kept = if total > 0.0 {
        e(out.view()) / total
    } else {
        0.0
    };
    (out, kept)
}

fn unit(mut w: Array1<f32>) -> Array1<f32> {
    let norm = w.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
    if norm > 0.0 {
        w.mapv_inplace(|v| (f64::from(v) / norm) as f32);
    }
    w
}

fn cosine(a: ArrayView1<f32>, b: ArrayView1<f32>) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum();
    let na: f64 = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    if na > 0.0 && nb > 0.0 {
        dot / (na * nb)
    } else {
        0.0
    }
}

/// Checks every row of `wtemp` (n_templates × nt, unit rows) for its peak at
/// `nt0min` ± [`PEAK_TOLERANCE`]; with `fix`, realigns or replaces each row
/// that fails (module docs) in place. Returns a finding per failing row, in
/// row order. A replacement needs built-in templates of the same length `nt`;
/// otherwise the row is realigned whatever energy the shift keeps.
pub fn check_wtemp(wtemp: &mut Array2<f32>, nt0min: usize, fix: bool) -> Vec<TemplateFinding> {
    let nt = wtemp.ncols();
    let builtin = UniversalTemplates::builtin().wtemp;
    let bad: Vec<usize> = (0..wtemp.nrows())
        .filter(|&r| peak(wtemp.row(r)).abs_diff(nt0min) > PEAK_TOLERANCE)
        .collect();
    let mut findings = Vec::new();
    let mut used_builtin: Vec<usize> = Vec::new();
    for &r in &bad {
        let p = peak(wtemp.row(r));
        let (moved, kept) = shifted(wtemp.row(r), nt0min as i64 - p as i64);
        let mut f = TemplateFinding {
            template: r,
            peak_sample: p,
            nt0min,
            kept_energy: kept,
            action: "kept".into(),
            builtin_row: None,
        };
        if fix {
            if kept >= MIN_KEPT_ENERGY || builtin.ncols() != nt {
                wtemp.row_mut(r).assign(&unit(moved));
                f.action = "realigned".into();
            } else {
                // The built-in row least like the rows that stay.
                let others: Vec<usize> = (0..wtemp.nrows()).filter(|&o| o != r).collect();
                let likeness = |b: usize| {
                    others
                        .iter()
                        .map(|&o| cosine(builtin.row(b), wtemp.row(o)).abs())
                        .fold(0.0, f64::max)
                };
                let choice = (0..builtin.nrows())
                    .filter(|b| !used_builtin.contains(b))
                    .min_by(|&a, &b| likeness(a).total_cmp(&likeness(b)).then(a.cmp(&b)));
                if let Some(b) = choice {
                    used_builtin.push(b);
                    let row = unit(builtin.row(b).to_owned());
                    wtemp.row_mut(r).assign(&row);
                    f.action = "replaced".into();
                    f.builtin_row = Some(b);
                } else {
                    wtemp.row_mut(r).assign(&unit(moved));
                    f.action = "realigned".into();
                }
            }
        }
        findings.push(f);
    }
    findings
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn centred_rows_pass_and_off_centre_rows_are_fixed() {
        let builtin = UniversalTemplates::builtin().wtemp;
        let mut w = builtin.clone();
        assert!(check_wtemp(&mut w, 20, true).is_empty());
        assert_eq!(w, builtin);
        // Row 1 moved 31 samples later (a trough at 51): most of it stays
        // inside, so it is realigned back.
        let (late, _) = shifted(builtin.row(1), 31);
        w.row_mut(1).assign(&unit(late));
        // Row 4: a bump at 20 and a larger trough at 51: a shift of the trough
        // to 20 would lose the bump (a third of the energy), so it is replaced.
        let two = Array1::from_shape_fn(61, |t| {
            let t = t as f32;
            -(-((t - 51.0).powi(2)) / 8.0).exp() + 0.7 * (-((t - 20.0).powi(2)) / 8.0).exp()
        });
        let two = unit(two);
        w.row_mut(4).assign(&two);
        let mut kept = w.clone();
        let found = check_wtemp(&mut kept, 20, false);
        assert_eq!(found.len(), 2);
        assert!(found.iter().all(|f| f.action == "kept"));
        assert_eq!(kept, w);
        let found = check_wtemp(&mut w, 20, true);
        assert_eq!(
            found
                .iter()
                .map(|f| (f.template, f.peak_sample))
                .collect::<Vec<_>>(),
            vec![(1, 51), (4, 51)]
        );
        for r in 0..6 {
            assert!(peak(w.row(r)).abs_diff(20) <= PEAK_TOLERANCE, "row {r}");
            let n: f32 = w.row(r).iter().map(|v| v * v).sum();
            assert!((n - 1.0).abs() < 1e-5);
        }
        assert_eq!(found[0].action, "realigned");
        assert_eq!(found[1].action, "replaced");
        assert!(found[0].describe(6).contains("31 samples early"));
        assert!(
            found[1]
                .describe(6)
                .contains("replaced by built-in template")
        );
    }
}
