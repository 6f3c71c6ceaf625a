//! Faults: the test facility that injects one into a rank (`KILN_FAULT_INJECT`), and how a
//! rank tells the failure that started an abort from the aborts it caused.

use crate::error::Error;
use std::time::Duration;

pub(super) const ABORTED: &str = "stopped because ";

/// Whether `e` is a rank's report that another rank aborted the group.
pub(super) fn is_abort_echo(e: &Error) -> bool {
    matches!(e, Error::Worker(m) if m.starts_with(ABORTED))
}

/// The environment variable that injects a fault into one rank, to test how a run ends (a test
/// facility, in-process and across processes): `KILN_FAULT_INJECT=rank:step` panics after that
/// step, `rank:step:hang` stops making progress after it, `rank:step:slow=MS` adds MS
/// milliseconds of compute to every step from that one on (a straggler), and
/// `rank:step:loader-hang` / `rank:step:loader-panic` make a loader thread of the rank
/// (`data.workers` > 0) hang or panic building that step's batch, and `0:step:slow-write=MS`
/// makes the checkpoint writer wait MS milliseconds before writing each checkpoint from that
/// step on (a slow disk; the run's numbers do not change).
pub const FAULT_VAR: &str = "KILN_FAULT_INJECT";

/// The attempt of a run the launcher (`train launch`) started: 0 for the first, then one more
/// for each restart. An injected fault happens in the first `KILN_FAULT_ATTEMPTS` attempts
/// (default 1), so that a restarted run can get past it.
pub const ATTEMPT_VAR: &str = "KILN_LAUNCH_ATTEMPT";

/// How many attempts of a launched run an injected fault happens in (default 1).
pub const FAULT_ATTEMPTS_VAR: &str = "KILN_FAULT_ATTEMPTS";

/// A fault the variable injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    Panic,
    Hang,
    Slow(Duration),
    /// A loader thread of the rank stops making progress building the step's batch.
    LoaderHang,
    /// A loader thread of the rank panics building the step's batch.
    LoaderPanic,
    /// The checkpoint writer waits this long before each write.
    SlowWrite(Duration),
}

/// How long the checkpoint writer waits before writing the checkpoint of `step`, by the
/// injected fault.
pub(super) fn write_delay(step: usize) -> Option<Duration> {
    match injected_fault()? {
        (0, at, Fault::SlowWrite(d)) if step >= at => Some(d),
        _ => None,
    }
}

/// The fault injected into `rank`'s loader threads as they build the batches of step `step`
/// (1-based): `true` hangs, `false` panics.
pub(super) fn loader_fault(rank: usize, step: usize) -> Option<bool> {
    match injected_fault()? {
        (r, at, Fault::LoaderHang) if r == rank && at == step => Some(true),
        (r, at, Fault::LoaderPanic) if r == rank && at == step => Some(false),
        _ => None,
    }
}

/// The `(rank, step, fault)` the variable asks for, if it does.
pub(super) fn injected_fault() -> Option<(usize, usize, Fault)> {
    static FAULT: std::sync::OnceLock<Option<(usize, usize, Fault)>> = std::sync::OnceLock::new();
    *FAULT.get_or_init(|| {
        let raw = std::env::var(FAULT_VAR).ok()?;
        let number = |var: &str| std::env::var(var).ok()?.trim().parse::<usize>().ok();
        if number(ATTEMPT_VAR).unwrap_or(0) >= number(FAULT_ATTEMPTS_VAR).unwrap_or(1) {
            return None;
        }
        let mut parts = raw.split(':').map(str::trim);
        let rank = parts.next()?.parse().ok()?;
        let step = parts.next()?.parse().ok()?;
        let fault = match parts.next() {
            None => Fault::Panic,
            Some("hang") => Fault::Hang,
            Some("loader-hang") => Fault::LoaderHang,
            Some("loader-panic") => Fault::LoaderPanic,
            Some(write) if write.starts_with("slow-write=") => {
                let ms = write.strip_prefix("slow-write=")?.parse().ok()?;
                Fault::SlowWrite(Duration::from_millis(ms))
            }
            Some(slow) => {
                let ms = slow.strip_prefix("slow=")?.parse().ok()?;
                Fault::Slow(Duration::from_millis(ms))
            }
        };
        Some((rank, step, fault))
    })
}
