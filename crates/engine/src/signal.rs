//! SIGINT and SIGTERM: the first asks the run to stop after the step in flight, with a
//! checkpoint; a second ends the process at once.
//!
//! Schedulers (Slurm, Kubernetes) send SIGTERM and kill after a grace period; a person presses
//! Ctrl-C. [`install`] (the `train` command calls it) sets handlers that only count signals;
//! the training loop asks [`requested`] after every step and, on every rank alike, stops with a
//! checkpoint ([`TrainConfig::checkpoint_on_signal`](crate::config::TrainConfig)).
//!
//! SIGUSR1 asks every rank of the process to write its flight record (the collectives it ran
//! last, the one it is in) into the run's `flight/` directory, and the run goes on.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

static COUNT: AtomicUsize = AtomicUsize::new(0);
static DUMP: AtomicBool = AtomicBool::new(false);
static LAST: AtomicI32 = AtomicI32::new(0);

/// The exit code of a run stopped by a signal after writing its checkpoint.
pub const STOPPED_EXIT_CODE: i32 = crate::error::exit::STOPPED;

extern "C" fn on_signal(signal: libc::c_int) {
    LAST.store(signal, Ordering::SeqCst);
    if COUNT.fetch_add(1, Ordering::SeqCst) >= 1 {
        // The second signal: no checkpoint, no clean-up, now (async-signal-safe).
        unsafe { libc::_exit(128 + signal) };
    }
}

extern "C" fn on_dump(_signal: libc::c_int) {
    DUMP.store(true, Ordering::SeqCst);
}

/// Installs the handlers of SIGINT and SIGTERM (stop with a checkpoint) and SIGUSR1 (write the
/// flight records) for this process, and ignores SIGXFSZ (a file grown past its size limit
/// then fails to write, which kiln reports, instead of killing the process).
pub fn install() {
    // SAFETY: the handlers only touch atomics and call `_exit`, both async-signal-safe.
    unsafe {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGUSR2, handler);
        let dump = on_dump as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGUSR1, dump);
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// Whether SIGUSR1 asked for the flight records since the last call.
pub fn take_dump_request() -> bool {
    DUMP.swap(false, Ordering::SeqCst)
}

/// The signal that asked the run to stop, if one did.
pub fn requested() -> Option<i32> {
    (COUNT.load(Ordering::SeqCst) > 0).then(|| LAST.load(Ordering::SeqCst))
}

/// A signal's name (`SIGTERM`).
pub fn name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGUSR2 => "SIGUSR2".into(),
        s => format!("signal {s}"),
    }
}
