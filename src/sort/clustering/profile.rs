//! A diagnostic of the clustering's time (`SPIKECUBE_CLUSTER_PROFILE`): busy
//! seconds of each stage summed over the groups, and the slowest groups, which
//! bound a clustering's wall time once every other group is done. Logged at
//! the end of each clustering; off unless the variable is set, and never
//! changes a result.

use std::sync::Mutex;
use std::time::Instant;

/// Stages of one group's clustering, in the order they run.
pub(crate) const STAGES: [&str; 6] = ["graph", "seeding", "labels", "tree", "split", "means"];

/// Stage seconds of one group.
#[derive(Debug, Default, Clone)]
pub(crate) struct GroupClock {
    pub n_spikes: usize,
    pub dim: usize,
    pub secs: [f64; STAGES.len()],
    last: Option<Instant>,
}

impl GroupClock {
    /// A clock for a group of `n_spikes` × `dim` features, when profiling.
    pub fn start(n_spikes: usize, dim: usize) -> Option<Self> {
        enabled().then(|| GroupClock {
            n_spikes,
            dim,
            secs: [0.0; STAGES.len()],
            last: Some(Instant::now()),
        })
    }

    /// Books the time since the last lap to stage `i`.
    pub fn lap(&mut self, i: usize) {
        let now = Instant::now();
        if let Some(t) = self.last {
            self.secs[i] += now.duration_since(t).as_secs_f64();
        }
        self.last = Some(now);
    }
}

/// Books the time since `clock`'s last lap (if profiling) to stage `i`.
pub(crate) fn lap(clock: &mut Option<GroupClock>, i: usize) {
    if let Some(c) = clock.as_mut() {
        c.lap(i);
    }
}

/// Whether `SPIKECUBE_CLUSTER_PROFILE` is set (read once).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SPIKECUBE_CLUSTER_PROFILE").is_some())
}

/// The clocks of one clustering's groups.
#[derive(Debug, Default)]
pub(crate) struct Profile {
    groups: Mutex<Vec<GroupClock>>,
}

impl Profile {
    pub fn add(&self, c: GroupClock) {
        self.groups
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(c);
    }

    /// Logs the stage sums and the five slowest groups; `wall` s of the run.
    pub fn log(self, wall: f64, threads: usize) {
        let mut g = self
            .groups
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut sums = [0.0; STAGES.len()];
        for c in &g {
            for (s, v) in sums.iter_mut().zip(c.secs) {
                *s += v;
            }
        }
        let busy: f64 = sums.iter().sum();
        let split: Vec<String> = STAGES
            .iter()
            .zip(sums)
            .map(|(n, s)| format!("{n} {s:.2}"))
            .collect();
        tracing::info!(
            "clustering profile: {} groups, {wall:.2} s wall on {threads} threads, {busy:.2} busy s ({})",
            g.len(),
            split.join(", ")
        );
        g.sort_by(|a, b| {
            b.secs
                .iter()
                .sum::<f64>()
                .total_cmp(&a.secs.iter().sum::<f64>())
        });
        for c in g.iter().take(5) {
            let split: Vec<String> = STAGES
                .iter()
                .zip(c.secs)
                .map(|(n, s)| format!("{n} {s:.3}"))
                .collect();
            tracing::info!(
                "clustering profile: group of {} spikes × {} features: {:.2} s ({})",
                c.n_spikes,
                c.dim,
                c.secs.iter().sum::<f64>(),
                split.join(", ")
            );
        }
    }
}
