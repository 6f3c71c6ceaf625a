//! From a file and `--set` assignments to one TOML table, the source an error names, and a
//! program's own section read with kiln's errors.

use std::path::Path;

use serde::de::DeserializeOwned;

use super::names::{one_line, refusal};
use crate::error::{Error, Result};

/// Where a config's values came from: a file (or a built-in recipe) and what the command line
/// set over it (`--set` assignments and flags), so that an error names the one that gave the
/// refused value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    file: String,
    /// Each key the command line set, with what the user typed, in the order applied.
    set: Vec<(String, String)>,
}

impl Origin {
    /// Values that all come from `file` (a path, or the name of a built-in recipe).
    pub fn file(file: impl Into<String>) -> Self {
        Self {
            file: file.into(),
            set: Vec::new(),
        }
    }

    /// Notes that the command line set `key`, as `typed` (`--set train.epochs=3`,
    /// `--batch-size 0`); a later note of the same key wins.
    pub fn note(&mut self, key: &str, typed: String) {
        self.set.push((key.to_string(), typed));
    }

    /// The file the values came from.
    pub fn file_name(&self) -> &str {
        &self.file
    }

    /// Where the value of `key` came from: what the command line typed when it set the key
    /// (or a section holding it, or a key inside it), otherwise the file.
    pub fn of(&self, key: &str) -> &str {
        let within = |outer: &str, inner: &str| {
            inner == outer
                || inner
                    .strip_prefix(outer)
                    .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
        };
        self.set
            .iter()
            .rev()
            .find(|(set, _)| within(set, key) || within(key, set))
            .map_or(&self.file, |(_, typed)| typed)
    }

    /// `e` (a refusal of a value) named after the source of the key it names.
    pub fn name(&self, e: Error) -> Error {
        match e {
            Error::Config(m) => {
                let key = m
                    .split_once("key `")
                    .and_then(|(_, rest)| rest.split_once('`'))
                    .map(|(key, _)| key);
                let origin = key.map_or(self.file.as_str(), |k| self.of(k));
                Error::config(format!("{origin}: {m}"))
            }
            other => other,
        }
    }
}

impl From<&str> for Origin {
    fn from(file: &str) -> Self {
        Origin::file(file)
    }
}

/// The TOML table of the config file at `path` (none: an empty table) with `overrides`
/// applied, and the name of its source for errors.
pub fn read_table(path: Option<&Path>, overrides: &[String]) -> Result<(toml::Table, String)> {
    read_source(path, overrides).map(|(table, origin)| (table, origin.file))
}

/// [`read_table`], with the source of every value: the file, and each override's key.
pub fn read_source(path: Option<&Path>, overrides: &[String]) -> Result<(toml::Table, Origin)> {
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
    let mut origin = Origin::file(origin);
    for o in overrides {
        let key = apply_override(&mut table, o)?;
        origin.note(&key, format!("--set {}", o.trim()));
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

/// Applies one `a.b.c=value` override to a TOML table and returns the key it set. The value is
/// read as a TOML value, and as a plain string when it is not one.
pub fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<String> {
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
    Ok(key.to_string())
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

/// Section `name` of `origin` as a `T`, with kiln's one-line errors: the dotted key, and what
/// was expected. Keys `T` does not know are errors even where `T` does not deny them.
pub fn section<T: DeserializeOwned>(value: toml::Value, name: &str, origin: &Origin) -> Result<T> {
    // Read as the one entry of a table, so that paths and messages name the section as they
    // do for kiln's own.
    let mut wrapped = toml::Table::new();
    wrapped.insert(name.to_string(), value);
    let wrapped = toml::Value::Table(wrapped);
    let mut unknown = Vec::new();
    let parsed: std::result::Result<std::collections::BTreeMap<String, T>, _> =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(
            wrapped.clone(),
            &mut |path: serde_ignored::Path<'_>| unknown.push(path.to_string()),
        ));
    let mut parsed = parsed.map_err(|e| {
        let path = e.path().to_string();
        let inner =
            refusal::<std::collections::BTreeMap<String, T>>(&wrapped, &path, &one_line(e.inner()));
        Error::config(format!("{}: key `{path}`: {inner}", origin.of(&path)))
    })?;
    if let Some(path) = unknown.first() {
        let field = path.rsplit('.').next().unwrap_or(path);
        return Err(Error::config(format!(
            "{}: key `{path}`: unknown field `{field}`",
            origin.of(path)
        )));
    }
    Ok(parsed.remove(name).expect("the section was read"))
}
