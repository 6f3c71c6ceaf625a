//! What `/proc` says of this process and machine: resident memory, CPU seconds of the
//! process, of the machine and of each thread.

use std::path::Path;

/// A memory field of this process's `/proc/self/status` (`VmRSS`, `VmHWM`), in MiB; `None`
/// where there is no such file.
pub fn process_memory_mib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status_kib(&status, key).map(|k| k as f64 / 1024.0)
}

/// The process's peak resident memory, in KiB, when [`restart_resident_peak`] last restarted
/// the kernel's count (the largest such, where it restarted more than once).
static EARLIER_PEAK_KIB: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Restarts the kernel's count of this process's peak resident memory (`VmHWM`; Linux's
/// `clear_refs` 5) and keeps the peak it had reached ([`earlier_resident_peak_mib`]): the
/// trainer restarts it when the ranks start, so that a run's `peak_rss_mib` is its training's
/// and not the planner's probes' before it.
pub fn restart_resident_peak() {
    if let Some(mib) = process_memory_mib("VmHWM") {
        let kib = (mib * 1024.0).round() as u64;
        EARLIER_PEAK_KIB.fetch_max(kib, std::sync::atomic::Ordering::Relaxed);
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The peak resident memory, in MiB, the process had reached when [`restart_resident_peak`]
/// restarted the count (`None` before it did, or where there is no `/proc`).
pub fn earlier_resident_peak_mib() -> Option<f64> {
    let kib = EARLIER_PEAK_KIB.load(std::sync::atomic::Ordering::Relaxed);
    (kib > 0).then(|| kib as f64 / 1024.0)
}

/// A `Key:   123 kB` field of `/proc/<pid>/status`, in KiB.
pub(super) fn status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// User + system CPU seconds of the whole process so far.
#[cfg(unix)]
pub(super) fn process_cpu_seconds() -> Option<f64> {
    // SAFETY: getrusage writes one plain struct that we own.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return None;
        }
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some(secs(usage.ru_utime) + secs(usage.ru_stime))
}

#[cfg(not(unix))]
pub(super) fn process_cpu_seconds() -> Option<f64> {
    None
}

/// Clock ticks per second of `/proc` CPU times.
pub(super) fn clock_ticks() -> f64 {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads a configuration value.
        let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if t > 0 {
            return t as f64;
        }
    }
    100.0
}

/// (busy, total) ticks of all CPUs from `/proc/stat`.
pub(super) fn host_cpu_ticks() -> Option<(u64, u64)> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

pub(super) fn parse_proc_stat(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// CPU seconds of each replica's threads (`kiln-worker-R` and its pool), from the per-thread
/// `stat` files under `task_dir`.
pub(super) fn thread_cpu_seconds(task_dir: &Path, world: usize) -> Option<Vec<f64>> {
    let ticks = clock_ticks();
    let mut per_rank = vec![0.0; world];
    for entry in std::fs::read_dir(task_dir).ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((rank, t)) = parse_thread_stat(&stat)
            && let Some(slot) = per_rank.get_mut(rank)
        {
            *slot += t as f64 / ticks;
        }
    }
    Some(per_rank)
}

/// The replica rank named by a thread's `stat` line, and its user + system ticks.
pub(super) fn parse_thread_stat(stat: &str) -> Option<(usize, u64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let digits: String = comm
        .strip_prefix("kiln-worker-")?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let rank = digits.parse().ok()?;
    // After the name: state (field 3), ..., utime (14), stime (15).
    let fields: Vec<&str> = stat.get(close + 1..)?.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((rank, utime + stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_parse() {
        let status = "Name:\ttrain\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(status_kib(status, "VmRSS"), Some(102_400));
        assert_eq!(status_kib(status, "VmHWM"), Some(204_800));
        assert_eq!(status_kib(status, "VmSwap"), None);
        let stat = "cpu  100 5 50 800 40 3 2 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        // busy = user + nice + system + irq + softirq + steal; idle = idle + iowait
        assert_eq!(parse_proc_stat(stat), Some((160, 1000)));
        let thread = "4242 (kiln-worker-1-p) S 1 2 3 4 5 6 7 8 9 10 250 30 0 0 20 0 1 0";
        assert_eq!(parse_thread_stat(thread), Some((1, 280)));
        let other = "4243 (train) R 1 2 3 4 5 6 7 8 9 10 250 30 0 0 20 0 1 0";
        assert_eq!(parse_thread_stat(other), None);
        let odd = "4244 (kiln-worker-12) S 1 2 3 4 5 6 7 8 9 10 7 3";
        assert_eq!(parse_thread_stat(odd), Some((12, 10)));
    }
}
