//! One clock for a run's stages: [`StageTimer`] measures each stage it runs
//! and keeps the seconds by name, for `spikecube.json`'s `timings_s`.
//!
//! Stages are timed where the run chains them (`timer.time("templates", |t|
//! …)`), and a stage that measures its own parts (the per-window stages'
//! busy seconds, the whitening fit's parts, the drift step's parts) hands
//! them over with [`StageTimer::add`] under their `stage.part` names. A name
//! recorded twice keeps its last value.

use std::collections::BTreeMap;
use std::time::Instant;

/// Seconds per stage of one run, by name, and the run's start.
#[derive(Debug, Clone)]
pub struct StageTimer {
    started: Instant,
    seconds: BTreeMap<String, f64>,
}

impl Default for StageTimer {
    fn default() -> Self {
        Self::start()
    }
}

impl StageTimer {
    /// A timer whose run starts now, with no stage recorded.
    pub fn start() -> Self {
        StageTimer {
            started: Instant::now(),
            seconds: BTreeMap::new(),
        }
    }

    /// Runs `stage`, records its wall seconds under `name` (also when it
    /// returns an error) and returns what it returned. `stage` is given the
    /// timer, to record its parts.
    pub fn time<T>(&mut self, name: &str, stage: impl FnOnce(&mut Self) -> T) -> T {
        let t = Instant::now();
        let out = stage(self);
        self.add(name, t.elapsed().as_secs_f64());
        out
    }

    /// Records `seconds` under `name` (measured elsewhere: a stage's parts).
    pub fn add(&mut self, name: impl Into<String>, seconds: f64) {
        self.seconds.insert(name.into(), seconds);
    }

    /// Forgets `name` (a stage that did nothing worth reporting on this run).
    pub fn discard(&mut self, name: &str) {
        self.seconds.remove(name);
    }

    /// Seconds recorded under `name`, if any.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.seconds.get(name).copied()
    }

    /// When the timer started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Wall seconds since the timer started.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The seconds recorded, by name.
    pub fn seconds(&self) -> &BTreeMap<String, f64> {
        &self.seconds
    }

    /// Records the wall seconds since the start under `name` and returns the
    /// seconds recorded, by name.
    pub fn finish(mut self, name: &str) -> BTreeMap<String, f64> {
        let total = self.elapsed();
        self.add(name, total);
        self.seconds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_are_recorded_by_name_and_the_last_value_is_kept() {
        let mut t = StageTimer::start();
        let v = t.time("a", |_| 7);
        assert_eq!(v, 7);
        assert!(t.get("a").is_some_and(|s| s >= 0.0));
        t.add("b.part", 1.5);
        t.add("b.part", 2.5);
        assert_eq!(t.get("b.part"), Some(2.5));
        t.discard("a");
        assert_eq!(t.get("a"), None);
        let all = t.finish("total");
        assert_eq!(all.keys().collect::<Vec<_>>(), ["b.part", "total"]);
    }
}
