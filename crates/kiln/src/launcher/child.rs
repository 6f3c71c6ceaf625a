//! The job's child process as the launcher watches it: the hosts it runs on, asked whether
//! they still answer; the signals sent to it; its standard error passed through.

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::time::{Duration, Instant};

use super::hosts::answering;

/// How often hosts are asked whether they answer, and how many answers (or misses) in a row
/// take one back (or count it as gone).
pub(super) const ASK_EVERY: Duration = Duration::from_secs(5);
pub(super) const IN_A_ROW: usize = 2;
/// How long a job that lost a host has to end before it is killed.
pub(super) const END_WITHIN: Duration = Duration::from_secs(5);

/// Hosts asked every [`ASK_EVERY`] whether they answer, each one's streak counted: of misses
/// for a running job's hosts (gone after [`IN_A_ROW`]), of answers for the hosts it misses
/// (back after [`IN_A_ROW`]).
pub(super) struct Streaks {
    hosts: Vec<String>,
    /// Whether answers are counted (else misses).
    answers: bool,
    counts: Vec<usize>,
    last: Instant,
}

impl Streaks {
    /// The streaks of misses of `hosts`, which a job runs on.
    pub(super) fn misses(hosts: &[String]) -> Self {
        Self::new(hosts.to_vec(), false)
    }

    /// The streaks of answers of `hosts`, which a job misses.
    pub(super) fn answers(hosts: Vec<String>) -> Self {
        Self::new(hosts, true)
    }

    fn new(hosts: Vec<String>, answers: bool) -> Self {
        Self {
            counts: vec![0; hosts.len()],
            hosts,
            answers,
            last: Instant::now(),
        }
    }

    /// The hosts whose streak has reached [`IN_A_ROW`], at a check (none between checks).
    pub(super) fn check(&mut self, agent: &str) -> Vec<String> {
        if self.hosts.is_empty() || self.last.elapsed() < ASK_EVERY {
            return Vec::new();
        }
        self.last = Instant::now();
        let up = answering(&self.hosts, agent);
        for (host, count) in self.hosts.iter().zip(&mut self.counts) {
            *count = if up.contains(host) == self.answers {
                *count + 1
            } else {
                0
            };
        }
        self.hosts
            .iter()
            .zip(&self.counts)
            .filter(|(_, n)| **n >= IN_A_ROW)
            .map(|(h, _)| h.clone())
            .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A check, due now.
    fn ask(streaks: &mut Streaks, agent: &str) -> Vec<String> {
        streaks.last = Instant::now() - ASK_EVERY * 2;
        streaks.check(agent)
    }

    #[test]
    fn a_streak_of_two_answers_or_two_misses_names_the_host() {
        let hosts = vec!["h".to_string()];
        // `true HOST true` answers; `false HOST true` does not.
        let mut back = Streaks::answers(hosts.clone());
        assert!(ask(&mut back, "true").is_empty());
        assert!(ask(&mut back, "false").is_empty());
        assert!(ask(&mut back, "true").is_empty());
        assert_eq!(ask(&mut back, "true"), hosts);
        // Between checks nothing is asked.
        assert!(back.check("true").is_empty());
        let mut gone = Streaks::misses(&hosts);
        assert!(ask(&mut gone, "false").is_empty());
        assert_eq!(ask(&mut gone, "false"), hosts);
        assert!(ask(&mut Streaks::answers(Vec::new()), "true").is_empty());
    }
}
