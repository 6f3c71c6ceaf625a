//! Checkpoints that prove themselves: each file verified against `state.json`, the newest
//! whole checkpoint, and `train checkpoints`' report.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::state::LoopState;

use super::manifest::{STATE_FILE, digest, read_manifest};
use super::store::{latest, list, read_best};

/// A checkpoint's loop state, once every file its `state.json` records is there whole: the
/// size and the SHA-256 it was written with. The error names the file and the damage —
/// missing, short, long, or bytes that do not match — never a setting. A checkpoint of an
/// older kiln records no digests and is read as it is (`Ok` with `verified` false).
pub fn verify(dir: &Path) -> Result<Verified> {
    let manifest = read_manifest(dir)?;
    for (name, want) in &manifest.files {
        let path = dir.join(name);
        let len = match std::fs::metadata(&path) {
            Ok(m) => m.len(),
            Err(_) => {
                return Err(Error::checkpoint(format!(
                    "{}: missing (state.json records {} bytes)",
                    path.display(),
                    want.bytes
                )));
            }
        };
        if len != want.bytes {
            let how = if len < want.bytes {
                "truncated"
            } else {
                "grown"
            };
            return Err(Error::checkpoint(format!(
                "{}: corrupt: {len} bytes where state.json records {} ({how})",
                path.display(),
                want.bytes
            )));
        }
        if digest(&path)?.sha256 != want.sha256 {
            return Err(Error::checkpoint(format!(
                "{}: corrupt: its bytes do not match the SHA-256 state.json records",
                path.display()
            )));
        }
    }
    Ok(Verified {
        verified: !manifest.files.is_empty(),
        ranks: manifest.sharded.map(|s| s.world),
        state: manifest.state,
    })
}

/// A checkpoint that [`verify`] read.
#[derive(Debug, Clone)]
pub struct Verified {
    /// Its loop state.
    pub state: LoopState,
    /// Whether its files were checked (a checkpoint of an older kiln records no digests).
    pub verified: bool,
    /// The ranks that wrote a sharded checkpoint (`None`: a gathered one).
    pub ranks: Option<usize>,
}

/// The checkpoint a resume starts from: the newest whole one, and each newer one that did not
/// verify, with what is wrong with it (its error names the file).
#[derive(Debug)]
pub struct Newest {
    /// Its step.
    pub step: usize,
    /// Its directory.
    pub dir: PathBuf,
    /// The newer checkpoints passed over, newest first.
    pub damaged: Vec<(usize, Error)>,
}

/// The newest checkpoint of a run whose files verify ([`Newest`]); an error when none does.
pub fn newest_whole(run_dir: &Path) -> Result<Newest> {
    let mut damaged = Vec::new();
    for (step, dir) in list(run_dir).into_iter().rev() {
        match verify(&dir) {
            Ok(_) => return Ok(Newest { step, dir, damaged }),
            Err(e) => damaged.push((step, e)),
        }
    }
    if damaged.is_empty() {
        let (step, dir) = latest(run_dir)?;
        return Ok(Newest { step, dir, damaged });
    }
    let all: Vec<String> = damaged
        .iter()
        .map(|(_, e)| e.message().to_string())
        .collect();
    Err(Error::checkpoint(format!(
        "{}: no checkpoint is whole: {}",
        run_dir.join("checkpoints").display(),
        all.join("; ")
    )))
}

/// `train checkpoints RUN`: one line per checkpoint (oldest first) — its step, whether its files
/// verify (or what is wrong with one), its files and sizes, the best one — and a last line
/// saying which one `--resume` starts from (`None` when none is whole). An error when the run
/// has none.
pub fn report(run: &Path) -> Result<(Vec<String>, Option<usize>)> {
    let all = list(run);
    if all.is_empty() {
        return Err(Error::checkpoint(format!(
            "{}: no complete checkpoint (expected checkpoints/step-N/{STATE_FILE})",
            run.display()
        )));
    }
    let best = read_best(run);
    let mut lines = Vec::new();
    let mut whole = None;
    for (step, dir) in &all {
        let files: Vec<(String, u64)> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| Some((e.file_name().into_string().ok()?, e.metadata().ok()?.len())))
            .collect();
        let state = match verify(dir) {
            Ok(v) => {
                whole = Some(*step);
                if let Some(n) = v.ranks {
                    format!(
                        "whole, sharded by {n} rank{}",
                        if n == 1 { "" } else { "s" }
                    )
                } else if v.verified {
                    "whole".to_string()
                } else {
                    "unverified (no digests: written by an older kiln)".to_string()
                }
            }
            Err(e) => format!("DAMAGED: {}", e.message()),
        };
        let mark = match &best {
            Some(b) if b.step == *step => format!("  best {} {:.6}", b.metric, b.value),
            _ => String::new(),
        };
        lines.push(format!(
            "step {step:>8}  {state}  [{}]{mark}",
            file_list(files)
        ));
    }
    if let Some(s) = whole {
        lines.push(format!("--resume {} starts from step {s}", run.display()));
    }
    Ok((lines, whole))
}

/// Fewer files of one kind than this are listed one by one.
const LISTED: usize = 4;

/// A checkpoint's files for its line, by name, each with its size — except that `LISTED` or
/// more of one kind (names alike but for their digits: the ranks' `rank-NNNNN.bin` of a
/// sharded checkpoint) are one entry, the first and the last named, with their count and total.
fn file_list(mut files: Vec<(String, u64)>) -> String {
    files.sort();
    let kind = |name: &str| -> String {
        name.chars()
            .map(|c| if c.is_ascii_digit() { '#' } else { c })
            .collect()
    };
    let mut kinds: Vec<(String, Vec<(String, u64)>)> = Vec::new();
    for (name, len) in files {
        let k = kind(&name);
        match kinds.iter_mut().find(|(seen, _)| *seen == k) {
            Some((_, members)) => members.push((name, len)),
            None => kinds.push((k, vec![(name, len)])),
        }
    }
    let mut entries = Vec::new();
    for (_, members) in kinds {
        if members.len() < LISTED {
            entries.extend(
                members
                    .iter()
                    .map(|(name, len)| format!("{name} {}", human_bytes(*len))),
            );
        } else {
            let total = members.iter().map(|(_, len)| len).sum();
            entries.push(format!(
                "{} … {} ({} files, {})",
                members[0].0,
                members[members.len() - 1].0,
                members.len(),
                human_bytes(total)
            ));
        }
    }
    entries.join(", ")
}

/// A byte count in B, KiB, MiB or GiB.
pub(super) fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_files_of_a_kind_are_one_entry_and_a_few_are_listed() {
        let mut files: Vec<(String, u64)> = (0..64)
            .flat_map(|r| {
                [
                    (format!("rank-{r:05}.bin"), 1 << 20),
                    (format!("rank-{r:05}.json"), 100),
                ]
            })
            .collect();
        files.push(("state.json".into(), 2048));
        files.push(("rest-00000.bpk".into(), 10));
        assert_eq!(
            file_list(files),
            "rank-00000.bin … rank-00063.bin (64 files, 64.0 MiB), \
             rank-00000.json … rank-00063.json (64 files, 6.2 KiB), rest-00000.bpk 10 B, \
             state.json 2.0 KiB"
        );
        let two = vec![
            ("rank-00001.bin".to_string(), 5),
            ("rank-00000.bin".to_string(), 7),
            ("model.bpk".to_string(), 3),
        ];
        assert_eq!(
            file_list(two),
            "model.bpk 3 B, rank-00000.bin 7 B, rank-00001.bin 5 B"
        );
    }
}
