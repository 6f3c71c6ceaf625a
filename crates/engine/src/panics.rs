//! Panics as kiln reports them: a worker's panic becomes the run's one-line error, so the
//! default hook's message and backtrace are kept off the terminal for kiln's own threads.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};

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
            if PROBING.load(Ordering::SeqCst) > 0 {
                // A start-up probe is under way: whichever thread panicked (a runtime's own,
                // too), the probe reports it.
                let mut caught = CAUGHT.lock().unwrap_or_else(|e| e.into_inner());
                caught.push(one_line(info));
                return;
            }
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

/// A panic as one line: its message, then where (a dependency's file from its crate's
/// folder on, not the registry's path).
fn one_line(info: &std::panic::PanicHookInfo<'_>) -> String {
    let message = info
        .payload()
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| info.payload().downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
        .replace('\n', " ");
    match info.location() {
        Some(at) => {
            let file = at.file();
            let file = file
                .split_once("/registry/src/")
                .and_then(|(_, rest)| rest.split_once('/'))
                .map_or(file, |(_, crate_path)| crate_path);
            format!("{message} (at {file}:{})", at.line())
        }
        None => message,
    }
}

/// Probes under way: while any is, every thread's panic is kept for it and not printed.
static PROBING: AtomicUsize = AtomicUsize::new(0);
/// The panics met by the probes under way, as the hook formats them, on one line each.
static CAUGHT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Runs `f` on a probe thread and returns what it returned, or the first panic met meanwhile
/// on any thread, on one line (where and what), none of it printed. For start-up checks that
/// go through a library that panics where its runtime cannot start, in a thread of its own
/// (Burn's CUDA runtime does), so that the run can refuse in one line instead.
pub fn probe<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> std::result::Result<T, String> {
    quiet_worker_panics();
    PROBING.fetch_add(1, Ordering::SeqCst);
    let joined = std::thread::Builder::new()
        .name(format!("{PROBE_THREAD}-start"))
        .spawn(move || std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)))
        .map_err(|e| format!("cannot start a thread: {e}"))
        .and_then(|h| h.join().map_err(|p| panic_message(&p)));
    PROBING.fetch_sub(1, Ordering::SeqCst);
    let first = {
        let mut caught = CAUGHT.lock().unwrap_or_else(|e| e.into_inner());
        let first = caught.first().cloned();
        if PROBING.load(Ordering::SeqCst) == 0 {
            caught.clear();
        }
        first
    };
    match joined {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(payload)) => Err(first.unwrap_or_else(|| panic_message(&payload))),
        Err(why) => Err(first.unwrap_or(why)),
    }
}

#[cfg(test)]
mod tests {
    use super::probe;

    #[test]
    fn a_probe_returns_the_first_panic_of_any_thread_in_one_line() {
        assert_eq!(probe(|| 7), Ok(7));
        let why = probe(|| {
            // The root cause panics in a thread of the library's own; the caller then
            // panics on the closed channel, as Burn's device handle does.
            let inner = std::thread::spawn(|| panic!("driver said no\n(error 34)"));
            inner.join().expect("the runtime thread answers");
        })
        .unwrap_err();
        assert!(why.contains("driver said no (error 34)"), "{why}");
        assert!(why.contains("panics.rs"), "{why}");
        assert!(!why.contains("runtime thread answers"), "{why}");
    }
}
