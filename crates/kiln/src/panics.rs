//! Panics as kiln reports them: a worker's panic becomes the run's one-line error, so the
//! default hook's message and backtrace are kept off the terminal for kiln's own threads.

use std::sync::Once;

/// The name prefix of the threads that run ranks and loaders: their panics are reported by
/// the trainer as one line (with `RUST_BACKTRACE` set, the default report is printed too).
pub const WORKER_THREAD: &str = "kiln-worker";
/// The name prefix of the threads that probe a model before a run: what they meet is a
/// refusal, one line, and never printed by the hook, whatever `RUST_BACKTRACE` says.
pub const PROBE_THREAD: &str = "kiln-probe";

/// The message a panic carried.
pub fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Keeps the panics of kiln's worker and probe threads from printing the default hook's
/// message and backtrace note: the trainer reports them itself as one line. Every other
/// thread's panic goes to the hook that was installed before. Installed once per process;
/// later calls do nothing.
pub fn quiet_worker_panics() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("");
            let quiet = name.starts_with(PROBE_THREAD)
                || (name.starts_with(WORKER_THREAD)
                    && std::env::var_os("RUST_BACKTRACE").is_none());
            if !quiet {
                previous(info);
            }
        }));
    });
}
