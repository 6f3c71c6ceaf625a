//! The hosts of a launched run: from the command line, a hostfile or Slurm's node list, and
//! which of them answer now.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kiln_engine::error::{Error, Result};

/// How long a host has to answer `AGENT HOST true`.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// The hosts the launcher may use: `--hosts`, else `--hostfile`, else Slurm's node list; none
/// for one process here.
pub(super) fn configured(hosts: &[String], hostfile: Option<&Path>) -> Result<Vec<String>> {
    if !hosts.is_empty() {
        return Ok(hosts
            .iter()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .collect());
    }
    if let Some(file) = hostfile {
        let text = std::fs::read_to_string(file).map_err(|e| {
            Error::config(format!("--hostfile {}: cannot read: {e}", file.display()))
        })?;
        let found: Vec<String> = text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .map(|l| l.split_whitespace().next().unwrap_or(l).to_string())
            .collect();
        if found.is_empty() {
            return Err(Error::config(format!(
                "--hostfile {}: no host in it",
                file.display()
            )));
        }
        return Ok(found);
    }
    match std::env::var("SLURM_JOB_NODELIST") {
        Ok(list) if !list.trim().is_empty() => expand_nodelist(&list),
        _ => Ok(Vec::new()),
    }
}

/// Slurm's compressed node list as hosts: `node[1-3,7],gpu01` → node1, node2, node3, node7,
/// gpu01 (ranges keep their zero padding: `n[08-10]` → n08, n09, n10).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>> {
    let bad = || {
        Error::config(format!(
            "SLURM_JOB_NODELIST {list:?}: expected names and name[a-b,c]"
        ))
    };
    let mut out = Vec::new();
    let mut rest = list.trim();
    while !rest.is_empty() {
        // One item: up to a comma outside brackets.
        let mut depth = 0;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .map_or(rest.len(), |(i, _)| i);
        let item = &rest[..end];
        rest = rest[end..].trim_start_matches(',');
        match item.split_once('[') {
            None => out.push(item.to_string()),
            Some((prefix, ranges)) => {
                let ranges = ranges.strip_suffix(']').ok_or_else(bad)?;
                for range in ranges.split(',') {
                    let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                    let width = lo.len();
                    let (a, b): (usize, usize) = (
                        lo.parse().map_err(|_| bad())?,
                        hi.parse().map_err(|_| bad())?,
                    );
                    if a > b {
                        return Err(bad());
                    }
                    out.extend((a..=b).map(|n| format!("{prefix}{n:0width$}")));
                }
            }
        }
    }
    Ok(out)
}

/// The hosts among `hosts` that answer `AGENT HOST true` within a few seconds, in order.
pub(super) fn answering(hosts: &[String], agent: &str) -> Vec<String> {
    let checks: Vec<_> = hosts
        .iter()
        .map(|h| {
            let mut words = agent.split_whitespace();
            let program = words.next().unwrap_or("ssh");
            let child = Command::new(program)
                .args(words)
                .arg(h)
                .arg("true")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            (h.clone(), child)
        })
        .collect();
    let deadline = Instant::now() + ANSWER_WITHIN;
    checks
        .into_iter()
        .filter_map(|(host, child)| {
            let mut child = child.ok()?;
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => return status.success().then_some(host),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return None;
                    }
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_node_lists_expand() {
        assert_eq!(
            expand_nodelist("node[1-3,7],gpu01").unwrap(),
            ["node1", "node2", "node3", "node7", "gpu01"]
        );
        assert_eq!(expand_nodelist("n[08-10]").unwrap(), ["n08", "n09", "n10"]);
        assert_eq!(expand_nodelist("solo").unwrap(), ["solo"]);
        assert!(expand_nodelist("n[3-1]").is_err());
    }

    #[test]
    fn a_host_answers_or_does_not() {
        let hosts = vec!["a".to_string(), "b".to_string()];
        // An agent that reaches host "a" only (the host is its first argument).
        let agent = std::env::temp_dir().join(format!("kiln-agent-{}", std::process::id()));
        std::fs::write(&agent, "#!/bin/sh\n[ \"$1\" = a ]\n").unwrap();
        let sh = format!("sh {}", agent.display());
        assert_eq!(answering(&hosts, &sh), ["a"]);
        assert_eq!(answering(&hosts, "true"), hosts);
        assert_eq!(answering(&hosts, "false"), Vec::<String>::new());
        std::fs::remove_file(&agent).unwrap();
    }
}
