//! The heap as kiln's allocator counts it: [`Allocator`] is mimalloc with two counters, the
//! bytes live and their peak, so that a run can say how much memory its tensors and everything
//! else took at most — exactly, where the resident set size also counts freed pages the
//! allocator keeps. Programs that declare another global allocator read `None`.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use mimalloc::MiMalloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// The allocator kiln's programs use: mimalloc, counting. A program of one's own declares it
/// with `#[global_allocator] static ALLOCATOR: kiln::Allocator = kiln::Allocator;`. Burn's CPU
/// kernels allocate and free large buffers at every op; the system allocator hands many of
/// them back to the OS and takes page faults to get them again (see BENCHMARKS.md).
#[derive(Debug, Clone, Copy, Default)]
pub struct Allocator;

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Relaxed) + bytes;
    if now > PEAK.load(Relaxed) {
        PEAK.fetch_max(now, Relaxed);
    }
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes, Relaxed);
}

// SAFETY: every call is mimalloc's own, with the caller's arguments; the counters only add
// and subtract the sizes of the blocks that succeeded.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which mimalloc shares.
        let p = unsafe { MiMalloc.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { MiMalloc.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from mimalloc) with `layout`.
        unsafe { MiMalloc.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout`; the caller upholds the rest.
        let p = unsafe { MiMalloc.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                grew(new_size - layout.size());
            } else {
                shrank(layout.size() - new_size);
            }
        }
        p
    }
}

/// Bytes live on the heap now, if kiln's [`Allocator`] is the global allocator.
pub fn live() -> Option<usize> {
    let peak = PEAK.load(Relaxed);
    (peak > 0).then(|| LIVE.load(Relaxed))
}

/// The most bytes live at once since the start, or since [`reset_peak`].
pub fn peak() -> Option<usize> {
    let peak = PEAK.load(Relaxed);
    (peak > 0).then_some(peak)
}

/// Starts a new peak from what is live now (for measuring one phase); nothing in a program
/// without kiln's allocator.
pub fn reset_peak() {
    if PEAK.load(Relaxed) > 0 {
        PEAK.store(LIVE.load(Relaxed).max(1), Relaxed);
    }
}

/// Hands the pages mimalloc keeps after frees back to the system, so that the resident set
/// holds what is live (and the code, stacks and data outside the heap): the planner measures
/// what a step adds from there. A forced collection: it does not wait for the purge delay
/// ([`keep_freed_pages`]). The calling thread's heap, those of the threads of the rayon pool
/// it runs in (the global pool outside one: where a CPU device's kernels allocate and free) and
/// the abandoned ones are collected: a collection reaches only its own thread's heap, and with
/// its thread's alone handed back, a GPT run under ddp with recompute peaked at 260 MiB at its
/// end (its validation, checkpoint and export) against 228 in its steps, the end allocating on
/// top of the pool's kept pages. Call it while the pool is idle, from
/// a thread that no other thread of the pool waits for.
pub fn release_free() {
    // SAFETY: `mi_collect` takes no pointer and may be called from any thread at any time.
    unsafe { libmimalloc_sys::mi_collect(true) };
    rayon::broadcast(|_| {
        // SAFETY: as above.
        unsafe { libmimalloc_sys::mi_collect(true) };
    });
}

/// mimalloc's `mi_option_purge_delay` (its place in `mi_option_t` of the bundled mimalloc 3,
/// and of mimalloc 2; `libmimalloc-sys` does not name it): how many milliseconds a freed page
/// waits before it goes back to the system (times `arena_purge_mult` for a whole arena).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
/// mimalloc 3's own default for [`PURGE_DELAY`].
const MIMALLOC_DEFAULT_PURGE_DELAY: std::ffi::c_long = 1000;
/// The delay a run sets: an hour, longer than any gap between two steps.
const RUN_PURGE_DELAY: std::ffi::c_long = 3_600_000;

/// Keeps the pages a step frees for the next step instead of handing them back to the system
/// a second after they were freed (mimalloc's default): every op's output is a fresh buffer, and a page
/// handed back costs a page fault and a zeroed page when the next step takes it again (on this
/// project's 2-core machine the GPT recipe's step took 1.5× as long with the default,
/// BENCHMARKS.md). [`release_free`] still hands everything back at once where the planner and
/// the worker measure from a clean heap. Leaves a delay that the environment chose
/// (`MIMALLOC_PURGE_DELAY`) or that a program set as it is; does nothing to another allocator.
pub fn keep_freed_pages() {
    // SAFETY: option reads and writes take no pointer and may be called at any time.
    unsafe {
        if libmimalloc_sys::mi_option_get(PURGE_DELAY) == MIMALLOC_DEFAULT_PURGE_DELAY {
            libmimalloc_sys::mi_option_set(PURGE_DELAY, RUN_PURGE_DELAY);
        }
    }
}

/// The allocator as a run (and the planner measuring for one) sets it: freed pages kept
/// ([`keep_freed_pages`]) and, under a memory limit (`limited`), transparent huge pages
/// forgone ([`forgo_huge_pages`]) where kiln's allocator is the program's and the environment
/// did not choose (`MIMALLOC_ALLOW_THP`): what the run holds is then what the planner
/// predicted.
pub fn pages_for_a_run(limited: bool) {
    keep_freed_pages();
    if limited && live().is_some() && std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        forgo_huge_pages();
    }
}

/// mimalloc 3's `mi_option_allow_thp` (its place in `mi_option_t`; `libmimalloc-sys` does not
/// name it): whether mimalloc asks the kernel for transparent huge pages (`MADV_HUGEPAGE`) on
/// the memory it maps. Its default is 1.
const ALLOW_THP: libmimalloc_sys::mi_option_t = 43;

/// Turns transparent huge pages off for this process: mimalloc asks for none on what it maps
/// from now on, and (on Linux) the kernel backs no page fault with one from now on, on memory
/// mapped before as well (`PR_SET_THP_DISABLE`). With them, mimalloc's arenas fault in 2 MiB
/// at a time, so the resident set of a run moved with where its buffers fell: the planner's
/// probe of one GPT zero2 plan read 236–243 MiB from launch to launch and its runs peaked at
/// 222–263, against 218–222 and 215–235 without them; the MNIST ConvNet on one device held
/// 187–202 MiB with them and 160–163 without, at about the same step time. They pay on
/// larger tensors, though: the Llama recipe's step took 5–9 % longer without them, so a run
/// forgoes them only under a memory limit ([`pages_for_a_run`]; BENCHMARKS.md).
pub fn forgo_huge_pages() {
    // SAFETY: an option write takes no pointer and may be called at any time.
    unsafe { libmimalloc_sys::mi_option_set(ALLOW_THP, 0) };
    #[cfg(target_os = "linux")]
    // SAFETY: `PR_SET_THP_DISABLE` takes integer arguments only and changes one flag of this
    // process; a kernel without it returns an error, which leaves things as they were.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

/// Times [`hold_under`] has handed the kept pages back.
static HELD: AtomicUsize = AtomicUsize::new(0);

/// Keeps the process under a resident memory limit at a step's end: where `resident_mib` (the
/// process's resident set now) is past `threshold_mib`, the freed pages the calling thread's
/// allocator keeps — and those of threads that have ended — go back to the system
/// ([`release_free`]). A run keeps freed pages so that its steps do not fault them in again
/// ([`keep_freed_pages`]); how many it keeps depends on how its threads' allocations and frees
/// interleave, which differs from launch to launch (the same zero3 run of the GPT under a limit,
/// ten launches beside a build: 200–238 MiB at their peak against a heap of 60–68 MiB), so a
/// limit that the planner's prediction keeps would not hold without this. Returns whether it
/// handed pages back.
///
/// The first time, the run also stops keeping freed pages an hour: from then on mimalloc hands
/// back what stays free for [`HOLD_PURGE_DELAY`] milliseconds, so that the pages freed within
/// a step do not pile up before its end either (zero3 of the GPT beside a build: peak 220–227
/// MiB keeping them, 192–200 at 50 ms, for steps 91–99 against 104–108 ms). A run that never
/// nears its limit keeps them as before.
pub fn hold_under(resident_mib: Option<f64>, threshold_mib: f64) -> bool {
    if resident_mib.is_some_and(|r| r > threshold_mib) {
        if HELD.fetch_add(1, Relaxed) == 0 {
            // SAFETY: setting a mimalloc option is safe at any time; the purge reads it when
            // it next runs.
            unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, HOLD_PURGE_DELAY) };
        }
        release_free();
        true
    } else {
        false
    }
}

/// The milliseconds mimalloc keeps a freed page once [`hold_under`] has found a run past its
/// threshold.
pub const HOLD_PURGE_DELAY: std::ffi::c_long = 50;

/// How many times [`hold_under`] has handed the kept pages back in this process.
pub fn times_held() -> usize {
    HELD.load(Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_forgone_are_off_in_mimalloc_and_in_the_kernel() {
        // SAFETY: an option read takes no pointer.
        let before = unsafe { libmimalloc_sys::mi_option_get(ALLOW_THP) };
        // A wrong option index would not have read mimalloc 3's default of 1.
        if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
            assert_eq!(before, 1, "mi_option_allow_thp's default");
        }
        forgo_huge_pages();
        assert_eq!(unsafe { libmimalloc_sys::mi_option_get(ALLOW_THP) }, 0);
        #[cfg(target_os = "linux")]
        {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            // Linux 5.0 and later say so in the process's status.
            if let Some(line) = status.lines().find(|l| l.starts_with("THP_enabled:")) {
                assert!(line.ends_with('0'), "{line}");
            }
        }
    }

    #[test]
    fn a_run_keeps_freed_pages_unless_the_environment_chose_a_delay_or_nears_its_limit() {
        keep_freed_pages();
        // SAFETY: an option read takes no pointer.
        let now = unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) };
        // A wrong option index would not have read mimalloc's default of 1000 and set nothing.
        match std::env::var("MIMALLOC_PURGE_DELAY") {
            Ok(chosen) => assert_eq!(Some(now), chosen.trim().parse().ok()),
            Err(_) => assert_eq!(now, RUN_PURGE_DELAY),
        }
        // Twice changes nothing, and a forced collection still runs.
        keep_freed_pages();
        assert_eq!(unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) }, now);
        release_free();
        // Under a limit (one test, since the option is the process's): nothing below the
        // threshold; past it, pages go back and freed pages are kept 50 ms from then on.
        assert_eq!(times_held(), 0, "no other test of this process holds");
        assert!(!hold_under(Some(100.0), 200.0));
        assert!(!hold_under(None, 200.0), "no reading, nothing done");
        assert_eq!(times_held(), 0);
        assert!(hold_under(Some(300.0), 200.0));
        assert_eq!(times_held(), 1);
        assert_eq!(
            unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) },
            HOLD_PURGE_DELAY
        );
    }
}
