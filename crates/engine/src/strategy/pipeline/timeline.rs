//! The timeline of a stage's last flush: when each forward and backward ran, for the
//! measured bubble and `train plot`'s schedule chart.

use std::sync::OnceLock;
use std::time::Instant;

use super::schedule::Op;

/// Seconds since one moment shared by every thread of the process, so that stages' timelines
/// line up.
pub(super) fn now() -> f64 {
    static ANCHOR: OnceLock<Instant> = OnceLock::new();
    ANCHOR.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// One operation as it ran: which, and when (seconds on the shared clock). A forward's start
/// is taken after its input arrived, a backward's after its upstream gradient did, so waiting
/// is not counted as work.
#[derive(Debug, Clone, Copy)]
pub(super) struct Event {
    pub(super) op: Op,
    pub(super) start: f64,
    pub(super) end: f64,
}

/// What a stage measured over a logging window.
#[derive(Debug, Default)]
pub(super) struct Timeline {
    /// Seconds of forward and backward work.
    pub(super) busy: f64,
    /// Seconds from each flush's start to its last operation's end.
    pub(super) span: f64,
    /// The most micro-batches whose activations the stage held at once.
    pub(super) held: usize,
    /// The last flush's operations, and when it started.
    pub(super) last: Vec<Event>,
    pub(super) last_start: f64,
}
