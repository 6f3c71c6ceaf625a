//! Hosts that come back: while a job runs on fewer hosts than it was given, the launcher asks
//! the missing ones whether they answer again (`child::Streaks`); one that answers two checks
//! in a row is taken
//! back with a planned restart (the job stops with its checkpoint and starts again on the
//! larger world, the samples of every step kept). A host that fails again within
//! `--readmit-after` seconds of being taken back is left out for the rest of the job.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Which hosts were taken back when, and which are left out.
#[derive(Debug, Default)]
pub(super) struct Readmission {
    /// A host that fails again within this long of being taken back is left out.
    pub(super) after: Duration,
    taken_back: BTreeMap<String, Instant>,
    left_out: Vec<String>,
}

impl Readmission {
    pub(super) fn new(after: Duration) -> Self {
        Self {
            after,
            ..Self::default()
        }
    }

    /// `hosts` without those left out.
    pub(super) fn usable(&self, hosts: Vec<String>) -> Vec<String> {
        hosts
            .into_iter()
            .filter(|h| !self.left_out.contains(h))
            .collect()
    }

    /// Notes that `host` was lost; returns whether it is now left out (it failed again within
    /// `after` of being taken back).
    pub(super) fn lost(&mut self, host: &str) -> bool {
        let again = self
            .taken_back
            .get(host)
            .is_some_and(|at| at.elapsed() < self.after);
        if again && !self.left_out.iter().any(|h| h == host) {
            self.left_out.push(host.to_string());
        }
        again
    }

    /// Notes that `hosts` were taken back now.
    pub(super) fn taken_back(&mut self, hosts: &[String]) {
        for h in hosts {
            self.taken_back.insert(h.clone(), Instant::now());
        }
    }

    /// The hosts left out so far.
    pub(super) fn left_out(&self) -> &[String] {
        &self.left_out
    }
}

/// The configured hosts a job running on `running` misses, those left out excepted.
pub(super) fn missing(
    configured: &[String],
    running: &[String],
    left_out: &[String],
) -> Vec<String> {
    configured
        .iter()
        .filter(|h| !running.contains(h) && !left_out.contains(h))
        .cloned()
        .collect()
}

/// `running` and `back` in the order of `configured` (the order ranks are placed in).
pub(super) fn with_back(configured: &[String], running: &[String], back: &[String]) -> Vec<String> {
    configured
        .iter()
        .filter(|h| running.contains(h) || back.contains(h))
        .cloned()
        .collect()
}

/// `after` without the `lost` hosts that were lost again soon after being taken back
/// (`--readmit-after`): those are left out for the rest of the job, said in one line each.
pub(super) fn leave_out_flapping(
    lost: &[&String],
    after: Vec<String>,
    readmission: &mut Readmission,
) -> Vec<String> {
    for host in lost {
        if readmission.lost(host) {
            eprintln!(
                "train launch: {host} failed again within {} s of being taken back; it is left \
                 out for the rest of the job",
                readmission.after.as_secs_f64()
            );
        }
    }
    readmission.usable(after)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_host_that_fails_again_soon_after_it_came_back_is_left_out() {
        let mut r = Readmission::new(Duration::from_secs(60));
        // Lost for the first time: not left out.
        assert!(!r.lost("b"));
        assert_eq!(r.usable(hosts(&["a", "b"])), hosts(&["a", "b"]));
        r.taken_back(&hosts(&["b"]));
        assert!(r.lost("b"));
        assert_eq!(r.usable(hosts(&["a", "b"])), hosts(&["a"]));
        assert_eq!(r.left_out(), hosts(&["b"]));
        // Long after it came back, a failure is a failure, not a flapping host.
        let mut r = Readmission::new(Duration::ZERO);
        r.taken_back(&hosts(&["b"]));
        assert!(!r.lost("b"));
    }

    #[test]
    fn the_missing_hosts_are_the_configured_ones_not_running_nor_left_out() {
        let all = hosts(&["a", "b", "c", "d"]);
        assert_eq!(
            missing(&all, &hosts(&["a"]), &hosts(&["d"])),
            hosts(&["b", "c"])
        );
        assert_eq!(
            with_back(&all, &hosts(&["a", "c"]), &hosts(&["b"])),
            hosts(&["a", "b", "c"])
        );
        // With every host running, none is missing.
        assert!(missing(&all, &all, &[]).is_empty());
    }
}
