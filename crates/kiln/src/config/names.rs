//! The words of config errors and values: a refusal naming its key, an enum value as the
//! config spells it, serde's messages in a user's words.

use serde::Serialize;

use crate::error::{Error, Result};

/// A refusal of `key`'s value.
pub(super) fn bad(key: &str, msg: String) -> Result<()> {
    Err(Error::config(format!("key `{key}`: {msg}")))
}

/// Serde's messages in a user's words: type names as kinds of value, without the location
/// that the caller already prints.
pub(crate) fn humanize(message: &str, path: &str) -> String {
    let mut m = message.replace(&format!(" in `{path}`"), "");
    for (rust, words) in [
        ("expected usize", "expected a non-negative integer"),
        ("expected u64", "expected a non-negative integer"),
        ("expected u32", "expected a non-negative integer"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
    ] {
        m = m.replace(rust, words);
    }
    m
}

/// The config spelling of an enum value (`"fashion-mnist"`, `"cosine"`).
pub fn name_of<T: Serialize>(v: &T) -> String {
    toml::Value::try_from(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A multi-line error message folded onto one line.
pub fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}
