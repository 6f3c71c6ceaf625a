//! The job's child process as the launcher watches it: the hosts it runs on, asked whether
//! they still answer; the signals sent to it; its standard error passed through.

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::time::{Duration, Instant};

use super::hosts::answering;

/// How often the hosts of a running job are asked whether they answer, how many misses in a
/// row mean a host is gone, and how long a job that lost one has to end before it is killed.
pub(super) const HEALTH_EVERY: Duration = Duration::from_secs(5);
pub(super) const MISSES: usize = 2;
pub(super) const END_WITHIN: Duration = Duration::from_secs(5);

/// The hosts of a running job, asked every [`HEALTH_EVERY`] whether they still answer.
pub(super) struct Health<'h> {
    hosts: &'h [String],
    last: Instant,
    misses: Vec<usize>,
}

impl<'h> Health<'h> {
    pub(super) fn new(hosts: &'h [String]) -> Self {
        Self {
            hosts,
            last: Instant::now(),
            misses: vec![0; hosts.len()],
        }
    }

    /// The first host that missed [`MISSES`] checks in a row, once one has.
    pub(super) fn check(&mut self, agent: &str) -> Option<String> {
        if self.hosts.is_empty() || self.last.elapsed() < HEALTH_EVERY {
            return None;
        }
        self.last = Instant::now();
        let up = answering(self.hosts, agent);
        for (i, host) in self.hosts.iter().enumerate() {
            self.misses[i] = if up.contains(host) {
                0
            } else {
                self.misses[i] + 1
            };
            if self.misses[i] >= MISSES {
                return Some(host.clone());
            }
        }
        None
    }
}

/// Sends `signal` to the child.
pub(super) fn send(child: &Child, signal: libc::c_int) {
    // SAFETY: kill(2) on the child's own pid.
    unsafe { libc::kill(child.id() as libc::pid_t, signal) };
}

/// Copies the child's standard error to the launcher's, keeping its last `error:` line.
pub(super) fn pass_through(child: &mut Child) -> std::thread::JoinHandle<Option<String>> {
    let stderr = child.stderr.take();
    std::thread::spawn(move || {
        let mut last = None;
        for line in BufReader::new(stderr?)
            .lines()
            .map_while(std::result::Result::ok)
        {
            eprintln!("{line}");
            if let Some(e) = line.strip_prefix("error: ") {
                last = Some(e.to_string());
            }
        }
        last
    })
}
