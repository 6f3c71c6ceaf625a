//! SIGINT and SIGTERM: the first asks the run to stop after the step in flight, with a
//! checkpoint; a second ends the process at once.
//!
//! Schedulers (Slurm, Kubernetes) send SIGTERM and kill after a grace period; a person presses
//! Ctrl-C. [`install`] (the `train` command calls it) sets handlers that only count signals;
//! the training loop asks [`requested`] after every step and, on every rank alike, stops with a
//! checkpoint ([`TrainConfig::checkpoint_on_signal`](crate::config::TrainConfig)).

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

static COUNT: AtomicUsize = AtomicUsize::new(0);
static LAST: AtomicI32 = AtomicI32::new(0);

/// The exit code of a run stopped by a signal after writing its checkpoint.
pub const STOPPED_EXIT_CODE: i32 = 3;

extern "C" fn on_signal(signal: libc::c_int) {
    LAST.store(signal, Ordering::SeqCst);
    if COUNT.fetch_add(1, Ordering::SeqCst) >= 1 {
        // The second signal: no checkpoint, no clean-up, now (async-signal-safe).
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Installs the handlers of SIGINT and SIGTERM for this process, and ignores SIGXFSZ (a file
/// grown past its size limit then fails to write, which kiln reports, instead of killing the
/// process).
pub fn install() {
    // SAFETY: the handler only touches atomics and calls `_exit`, both async-signal-safe.
    unsafe {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
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
        s => format!("signal {s}"),
    }
}
