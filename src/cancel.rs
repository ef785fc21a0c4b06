//! A process-wide request to stop the run in progress, for callers that
//! cannot stop it otherwise: the Python package, whose Ctrl-C handler runs
//! only when the main thread gets back to Python, sets it from a thread that
//! watches for SIGINT ([`request`]). The command line has no need of it: its
//! signal thread removes the unfinished output and exits at once.
//!
//! Stages that read no windows (the clusterings, their seeding and graphs)
//! look at the request before each group of spikes ([`check`]); the
//! windowed stages stop through their readers and progress reports. A
//! stopped run unwinds with the payload [`Cancelled`], which the caller
//! catches (`std::panic::catch_unwind`); the staged output folders are
//! removed on the way, as for any error.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// The unwinding payload of a run stopped by [`check`].
#[derive(Debug)]
pub struct Cancelled;

/// Asks the run in progress to stop at its next [`check`].
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Withdraws the request (before a new run).
pub fn reset() {
    REQUESTED.store(false, Ordering::SeqCst);
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}

/// Unwinds with [`Cancelled`] (without the panic hook's message) when a stop
/// was asked for; returns otherwise. `what` says where, for the log.
pub fn check(what: &str) {
    if requested() {
        tracing::debug!("stopped on request during {what}");
        std::panic::resume_unwind(Box::new(Cancelled));
    }
}
