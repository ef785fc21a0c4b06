//! The detection pass's input checks over a run's windows, as one value:
//! each window's channel facts and transients found on a reading thread
//! ([`WindowCheck::run`]), then added up in window order ([`PassChecks`]).
//! The drift step's first pass reads the same raw windows as the detection
//! pass, so when the detection pass will not read a window again (it holds
//! the window on its device, high-passed) the first pass runs these checks
//! in its stead; the totals are the same either way.

use crate::recording::{Window, WindowPlan};

use super::{ChannelHealth, WindowColumns, WindowHealth};

/// What [`WindowCheck::run`] finds in one window: its channel facts and the
/// absolute start sample of each transient starting in its own samples.
pub type WindowFound = (WindowHealth, Vec<i64>);

/// One window's input checks as the detection pass runs them: stuck
/// (clipped) stretches masked when asked (`--mask-clipped`), the channel
/// facts, and the transients common to most channels in the window's own
/// samples ([`super::precheck_window_with_transients`]).
#[derive(Debug, Clone, Copy)]
pub struct WindowCheck {
    plan: WindowPlan,
    /// Shortest stuck run, samples ([`super::stuck_min_run`]).
    min_run: usize,
    mask_clipped: bool,
    /// Samples joining transient columns into one event
    /// ([`super::transients::transient_gap`]).
    gap: usize,
}

impl WindowCheck {
    /// The checks of `plan`'s windows of a recording sampled at `fs` Hz.
    pub fn new(plan: WindowPlan, fs: f64, mask_clipped: bool) -> Self {
        WindowCheck {
            plan,
            min_run: super::stuck_min_run(fs),
            mask_clipped,
            gap: super::transients::transient_gap(fs),
        }
    }

    /// Checks window `w` as read (masking its stuck stretches when asked):
    /// its channel facts and the absolute start sample of each transient
    /// starting in its own samples.
    pub fn run(&self, w: &mut Window) -> WindowFound {
        let cols = WindowColumns::of(&self.plan, w.index);
        let (health, events) = super::precheck_window_with_transients(
            w,
            &cols,
            self.min_run,
            self.mask_clipped,
            self.gap,
        );
        let own = super::transients::own_events(
            &events,
            w.first_sample,
            self.plan.nt as usize,
            w.own_len as usize,
        );
        (health, own)
    }

    /// [`WindowCheck::run`] when `full`, else only [`WindowCheck::mask`]: the
    /// per-window part of a pass that may have its checks from another.
    pub fn run_or_mask(&self, w: &mut Window, full: bool) -> Option<WindowFound> {
        if full {
            return Some(self.run(w));
        }
        self.mask(w);
        None
    }

    /// Masks window `w`'s stuck stretches as [`WindowCheck::run`] does (when
    /// asked; nothing for a window without samples), and nothing else: for a
    /// window read again after its checks were found.
    pub fn mask(&self, w: &mut Window) {
        if self.mask_clipped && w.has_samples() {
            let cols = WindowColumns::of(&self.plan, w.index);
            super::mask_stuck_window(w, &cols, self.min_run);
        }
    }
}

/// What [`WindowCheck::run`] found over a pass's windows, added up in window
/// order.
#[derive(Debug, Clone)]
pub struct PassChecks {
    /// The channels' facts.
    pub health: ChannelHealth,
    /// Transients common to most channels: the absolute sample of each
    /// one's start, in order.
    pub transients: Vec<i64>,
    /// Windows added.
    windows: u64,
}

impl PassChecks {
    /// Nothing seen yet, for the probe's channel map.
    pub fn new(chan_map: &[u64]) -> Self {
        PassChecks {
            health: ChannelHealth::new(chan_map),
            transients: Vec::new(),
            windows: 0,
        }
    }

    /// Adds the next window's checks (windows in order).
    pub fn merge(&mut self, (health, transients): WindowFound) {
        self.health.merge(&health);
        self.transients.extend(transients);
        self.windows += 1;
    }

    /// Windows added so far.
    pub fn windows(&self) -> u64 {
        self.windows
    }
}
