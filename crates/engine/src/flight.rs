//! `train flight RUN_DIR`: reads the ranks' flight records (`flight/rank-K.jsonl`, written on a
//! deadline, a failure or SIGUSR1) and says where each rank was and which one is behind.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::comm::watch::describe;
use crate::error::{Error, Result};

/// One rank's flight record.
struct Flight {
    rank: usize,
    header: Value,
    entries: Vec<Value>,
}

impl Flight {
    fn written(&self) -> f64 {
        self.header["written"].as_f64().unwrap_or(0.0)
    }

    fn in_flight(&self) -> Option<&Value> {
        self.header.get("in_flight").filter(|v| !v.is_null())
    }

    /// The newest collective (not a transfer) of `group` the rank left.
    fn last_in(&self, group: &str) -> Option<&Value> {
        self.entries
            .iter()
            .rev()
            .find(|e| e["group"] == group && e["peer"].is_null())
    }

    /// Where the rank was when its record was written, in words.
    fn state(&self) -> String {
        let steps = self.header["steps"].as_u64().unwrap_or(0);
        match self.in_flight() {
            Some(e) => format!(
                "in {} for {:.1} s, {steps} steps done",
                describe(e),
                self.written() - e["start"].as_f64().unwrap_or(0.0)
            ),
            None => {
                let since = self.written() - self.header["since"].as_f64().unwrap_or(0.0);
                let last = self.entries.last().map_or("none".into(), describe);
                format!("in no collective for {since:.1} s, {steps} steps done (last: {last})")
            }
        }
    }
}

fn read(dir: &Path) -> Result<Vec<Flight>> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        Error::Io(format!(
            "{}: no flight records ({e}); they are written when a collective passes its \
             deadline, when a rank fails, and on SIGUSR1",
            dir.display()
        ))
    })?;
    let mut flights = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(rank) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("rank-")?.strip_suffix(".jsonl"))
            .and_then(|r| r.parse().ok())
        else {
            continue;
        };
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let mut lines = text.lines().filter(|l| !l.trim().is_empty()).map(|l| {
            serde_json::from_str::<Value>(l)
                .map_err(|e| Error::Io(format!("{}: bad line {l:?}: {e}", path.display())))
        });
        let header = lines
            .next()
            .ok_or_else(|| Error::Io(format!("{}: empty flight record", path.display())))??;
        flights.push(Flight {
            rank,
            header,
            entries: lines.collect::<Result<_>>()?,
        });
    }
    if flights.is_empty() {
        return Err(Error::Io(format!(
            "{}: no flight records (rank-K.jsonl); they are written when a collective passes its \
             deadline, when a rank fails, and on SIGUSR1",
            dir.display()
        )));
    }
    flights.sort_by_key(|f| f.rank);
    Ok(flights)
}

/// The report of `train flight` on the run in `run`: one line per rank, then the diagnosis.
pub fn report(run: &Path) -> Result<Vec<String>> {
    let flights = read(&run.join("flight"))?;
    let reason = flights[0].header["reason"].as_str().unwrap_or("?");
    let mut lines = vec![format!(
        "{} ranks' flight records in {}, written for: {reason}",
        flights.len(),
        run.join("flight").display()
    )];
    for f in &flights {
        lines.push(format!(
            "rank {} (process {}, {}): {}",
            f.rank,
            f.header["process"],
            f.header["host"].as_str().unwrap_or("?"),
            f.state()
        ));
    }
    lines.extend(diagnose(&flights));
    Ok(lines)
}

/// A collective ranks wait in: the waiting ranks, the group's members, the collective in words.
type Awaited = (Vec<usize>, Vec<usize>, String);

/// Which ranks are behind: those a collective waits for.
fn diagnose(flights: &[Flight]) -> Vec<String> {
    let by_rank: BTreeMap<usize, &Flight> = flights.iter().map(|f| (f.rank, f)).collect();
    // The collectives ranks wait in, each with its waiting ranks.
    let mut waits: BTreeMap<(String, u64), Awaited> = BTreeMap::new();
    for f in flights {
        let Some(e) = f.in_flight().filter(|e| e["peer"].is_null()) else {
            continue;
        };
        let key = (
            e["group"].as_str().unwrap_or("?").to_string(),
            e["seq"].as_u64().unwrap_or(0),
        );
        let members = e["members"]
            .as_array()
            .map(|m| {
                m.iter()
                    .filter_map(Value::as_u64)
                    .map(|m| m as usize)
                    .collect()
            })
            .unwrap_or_default();
        waits
            .entry(key)
            .or_insert_with(|| (Vec::new(), members, describe(e)))
            .0
            .push(f.rank);
    }
    let mut out = Vec::new();
    for ((group, seq), (waiting, members, what)) in &waits {
        let absent: Vec<&usize> = members.iter().filter(|m| !waiting.contains(m)).collect();
        let waiting: Vec<String> = waiting.iter().map(usize::to_string).collect();
        // An absent rank that already left the collective is ahead, not behind: its part
        // did not reach the ranks that still wait.
        let left = |m: &usize| {
            by_rank
                .get(m)
                .and_then(|f| f.last_in(group))
                .and_then(|e| e["seq"].as_u64())
                .is_some_and(|last| last >= *seq)
        };
        let (ahead, behind): (Vec<&usize>, Vec<&usize>) = absent.into_iter().partition(|m| left(m));
        if !behind.is_empty() {
            let names: Vec<String> = behind
                .iter()
                .map(|m| match by_rank.get(m) {
                    None => format!("rank {m} (no flight record)"),
                    Some(f) => {
                        let last = f
                            .last_in(group)
                            .map_or("none of it".into(), |e| format!("#{}", e["seq"]));
                        format!(
                            "rank {m} (left {last} of {group}, not #{seq}; {})",
                            f.state()
                        )
                    }
                })
                .collect();
            out.push(format!(
                "behind: {}; ranks {} wait for it in {what}",
                names.join(", "),
                waiting.join(", ")
            ));
        }
        if !ahead.is_empty() {
            let ahead: Vec<String> = ahead.iter().map(|m| m.to_string()).collect();
            out.push(format!(
                "not delivered: ranks {} left {what}, ranks {} still wait in it: the transport \
                 between them did not deliver (a cut or stalled link)",
                ahead.join(", "),
                waiting.join(", ")
            ));
        }
    }
    if out.is_empty() {
        out.push(if waits.is_empty() {
            "no rank was in a collective: none waits for another".to_string()
        } else {
            "every rank of each awaited collective was in it: the transport did not deliver (a cut or stalled link)".to_string()
        });
    }
    out
}
