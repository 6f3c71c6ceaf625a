//! From a file and `--set` assignments to one TOML table, and the source an error names.

use std::path::Path;

use super::names::one_line;
use crate::error::{Error, Result};

/// The TOML table of the config file at `path` (none: an empty table) with `overrides`
/// applied, and the name of its source for errors.
pub fn read_table(path: Option<&Path>, overrides: &[String]) -> Result<(toml::Table, String)> {
    let (mut table, origin) = match path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| Error::config(format!("{}: cannot read: {e}", p.display())))?;
            let table: toml::Table = toml::from_str(&text).map_err(|e| {
                Error::config(format!("{}: invalid TOML: {}", p.display(), one_line(&e)))
            })?;
            (table, p.display().to_string())
        }
        None => (toml::Table::new(), "built-in defaults".to_string()),
    };
    for o in overrides {
        apply_override(&mut table, o)?;
    }
    Ok((table, origin))
}

/// `e` (a refusal of a value) named after its source, `origin`.
pub fn with_origin(e: Error, origin: &str) -> Error {
    match e {
        Error::Config(m) => Error::config(format!("{origin}: {m}")),
        other => other,
    }
}

/// Applies one `a.b.c=value` override to a TOML table. The value is read as a TOML value, and
/// as a plain string when it is not one.
pub fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<()> {
    let Some((key, raw)) = assignment.split_once('=') else {
        return Err(Error::config(format!(
            "--set {assignment:?}: expected KEY=VALUE, e.g. train.epochs=3"
        )));
    };
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(Error::config(format!(
            "--set {assignment:?}: the key must be dotted names, e.g. optim.lr"
        )));
    }
    let value = parse_value(raw.trim());
    let parts: Vec<&str> = key.split('.').collect();
    let mut node = table;
    for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
        let entry = node
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        node = match entry {
            toml::Value::Table(t) => t,
            _ => {
                return Err(Error::config(format!(
                    "--set {key}: `{}` is a value, not a section",
                    parts[..=i].join(".")
                )));
            }
        };
    }
    node.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

fn parse_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match toml::from_str::<toml::Table>(&doc) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}
