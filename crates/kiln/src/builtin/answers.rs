//! `train answer`: a run's greedy answers to the records of a file, each scored against the
//! record's own answer — the accuracy of a fine-tune on held-out examples, and of the base
//! model it started from, asked the same way.

use std::io::Write;
use std::path::{Path, PathBuf};

use kiln_datasets::chat::ChatTemplate;

use super::instruct::{end_of_sequence, fields, read};
use super::talk::{Picking, Talker};
use super::vocab::Vocab;
use kiln_engine::error::{Error, Result};

/// `train answer`: a run's greedy answers to a file's records, scored by exact match.
#[derive(Debug, clap::Args)]
pub struct AnswerArgs {
    /// The run directory: an `instruct` or `chat` run (asked with its chat template), or a
    /// language-model run on text (asked in kiln's plain prompt format, the one an instruct
    /// run of a checkpoint without a template trains on).
    #[arg(long, value_name = "PATH")]
    pub run: PathBuf,
    /// JSONL or Parquet records, read with the run's `data.fields` (prompt/answer pairs of
    /// the usual names for a run on text): each record's last turn is the answer expected,
    /// the turns before it the prompt.
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Most tokens of one answer.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Ask only the first N records.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Also score the answers part by part, split on SEP (`--parts ", "` scores "name,
    /// year" by its name and by its year).
    #[arg(long, value_name = "SEP")]
    pub parts: Option<String>,
    /// Write each record's place, prompt, expected and given answer here (JSONL).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// One record asked: where it is, what was expected and what the run answered.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Answered {
    /// `file:line` (or `file: row N`) of the record.
    pub at: String,
    /// The last user turn of the prompt.
    pub prompt: String,
    /// The record's answer.
    pub expected: String,
    /// The run's greedy answer.
    pub answer: String,
    /// Whether the two are equal (surrounding white space aside).
    pub exact: bool,
}

/// The answers to a file and how many matched.
#[derive(Debug, Clone)]
pub struct Scores {
    /// Each record asked, in the file's order.
    pub answered: Vec<Answered>,
    /// Answers equal to the expected ones.
    pub exact: usize,
    /// With `--parts`: for each part (by position), the answers whose part equals the
    /// expected answer's.
    pub parts: Vec<usize>,
    /// Records set aside (unreadable, or without an assistant's turn last), `file:line: why`.
    pub aside: Vec<String>,
}

/// Asks the run of `args` every record of `args.data` and scores its answers.
pub fn score(args: &AnswerArgs) -> Result<Scores> {
    let mut talker = Talker::open(&args.run)?;
    if talker.template.is_none() {
        talker.template = Some(plain_template(&args.run, &talker)?);
    }
    let how = talker.sampling(&Picking {
        temperature: 0.0,
        top_k: None,
        top_p: None,
        stop: Vec::new(),
        seed: 1,
    })?;
    let config = super::load(Some(&args.run.join("config.toml")), &[])?;
    let fields = fields(config.data.dataset, config.data.fields.as_ref());
    let records = read(&args.data, fields.as_ref())?;
    let limit = args.limit.unwrap_or(usize::MAX);
    let mut scores = Scores {
        answered: Vec::new(),
        exact: 0,
        parts: Vec::new(),
        aside: records
            .rejected
            .iter()
            .map(|r| format!("{}: {}", records.at(r.line), r.why))
            .collect(),
    };
    for example in records.examples.iter().take(limit) {
        let at = records.at(example.line);
        let Some((last, prompt)) = example.messages.split_last() else {
            continue;
        };
        if last.role != "assistant" || prompt.is_empty() {
            scores
                .aside
                .push(format!("{at}: the last turn is not an assistant's answer"));
            continue;
        }
        let answer = talker.answer(prompt, args.tokens, &how, 1)?;
        let expected = last.content.trim().to_string();
        let exact = answer.trim() == expected;
        scores.exact += usize::from(exact);
        if let Some(sep) = &args.parts {
            let given: Vec<&str> = answer.split(sep.as_str()).map(str::trim).collect();
            for (i, part) in expected.split(sep.as_str()).map(str::trim).enumerate() {
                if scores.parts.len() <= i {
                    scores.parts.push(0);
                }
                scores.parts[i] += usize::from(given.get(i) == Some(&part));
            }
        }
        let user = prompt.iter().rev().find(|m| m.role == "user");
        scores.answered.push(Answered {
            at,
            prompt: user.map_or_else(String::new, |m| m.content.clone()),
            expected,
            answer: answer.trim().to_string(),
            exact,
        });
    }
    Ok(scores)
}

/// kiln's plain prompt format for a run without a chat template, ending answers with the
/// run's end-of-sequence token.
fn plain_template(run: &Path, talker: &Talker) -> Result<ChatTemplate> {
    match talker.vocab() {
        Vocab::Subword(tokenizer) => Ok(ChatTemplate::plain(&end_of_sequence(run, tokenizer)?)),
        Vocab::Chars(_) => Err(Error::config(format!(
            "{}: a run with a character vocabulary has no end-of-sequence token to end an \
             answer with; `train answer` asks runs with a subword tokenizer",
            run.display()
        ))),
    }
}

/// `train answer`: prints the share of exact matches (and of each part's), writes the
/// answers to `--out`.
pub fn answer(args: AnswerArgs) -> Result<()> {
    let scores = score(&args)?;
    let n = scores.answered.len();
    if let Some(out) = &args.out {
        let mut text = Vec::new();
        for a in &scores.answered {
            let line = serde_json::to_string(a).expect("an answer serialises");
            writeln!(text, "{line}").expect("writes to memory");
        }
        kiln_engine::files::write_atomic(out, &text)?;
    }
    let share = |k: usize| format!("{k} of {n} ({:.1} %)", 100.0 * k as f64 / n.max(1) as f64);
    say!(
        "{} on {}: {n} records",
        args.run.display(),
        args.data.display()
    );
    say!("  exact match  {}", share(scores.exact));
    for (i, &k) in scores.parts.iter().enumerate() {
        say!("  part {}       {}", i + 1, share(k));
    }
    if !scores.aside.is_empty() {
        say!(
            "  {} records set aside, first: {}",
            scores.aside.len(),
            scores.aside[0]
        );
    }
    Ok(())
}
