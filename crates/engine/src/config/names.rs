//! The words of config errors and values: a refusal naming its key, an enum value as the
//! config spells it, serde's messages in a user's words.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// A refusal of `key`'s value.
pub(super) fn bad(key: &str, msg: String) -> Result<()> {
    Err(Error::config(format!("key `{key}`: {msg}")))
}

/// A string no enum of a config takes: put where serde refused a value, it makes serde list
/// the names the key takes.
const PROBE: &str = "\u{2}kiln-probe";

/// What serde refused at `path` while reading a `T` from `value`, in a user's words (see
/// [`humanize`]); a key that takes one of a few names (an enum) says which, whatever the
/// refused value was: `expected one of "auto", "on", "off", got boolean `true``.
pub(crate) fn refusal<T: DeserializeOwned>(
    value: &toml::Value,
    path: &str,
    message: &str,
) -> String {
    let message = humanize(message, path);
    if let Some((refused, names)) = message
        .strip_prefix("unknown variant ")
        .and_then(|rest| rest.split_once(", expected "))
    {
        // Serde's own list of names, quoted as the config spells them.
        return format!("unknown variant {refused}, expected {}", quote_names(names));
    }
    let Some((got, expected)) = message
        .strip_prefix("invalid type: ")
        .and_then(|m| m.split_once(", expected "))
    else {
        return message;
    };
    // What the value was, as the config wrote it (serde can only say "unit variant").
    let mut probe = value.clone();
    let shown = slot(&mut probe, path).map(|v| describe(v));
    let got = shown.as_deref().unwrap_or(got);
    if expected.starts_with("one of \"") {
        // A switch says its names (and that it takes a boolean) itself.
        return format!("expected {expected}, got {got}");
    }
    match accepted_names::<T>(value, path) {
        Some(names) => format!("expected {names}, got {got}"),
        None => message,
    }
}

/// The names the enum at `path` takes, as serde lists them when it meets a name it does not
/// know; `None` where the key is not an enum's.
fn accepted_names<T: DeserializeOwned>(value: &toml::Value, path: &str) -> Option<String> {
    let mut probe = value.clone();
    *slot(&mut probe, path)? = toml::Value::String(PROBE.into());
    let e = serde_path_to_error::deserialize::<_, T>(probe).err()?;
    if e.path().to_string() != path {
        return None;
    }
    let m = one_line(e.inner());
    let names = m.strip_prefix(&format!("unknown variant `{PROBE}`, expected "))?;
    // The deserializer may say where it was (" in `monitor.sinks`"): the caller says it too.
    let names = names.split(" in `").next().unwrap_or(names);
    Some(quote_names(names.trim_end()))
}

/// A TOML value as an error shows it: its kind and the value.
fn describe(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("string {s:?}"),
        toml::Value::Integer(i) => format!("integer `{i}`"),
        toml::Value::Float(f) => format!("float `{f}`"),
        toml::Value::Boolean(b) => format!("boolean `{b}`"),
        toml::Value::Datetime(d) => format!("date `{d}`"),
        toml::Value::Array(_) => "an array".into(),
        toml::Value::Table(_) => "a table".into(),
    }
}

/// Serde's `` `a`, `b` `` as `"a", "b"`.
fn quote_names(text: &str) -> String {
    text.replace('`', "\"")
}

/// The value at a dotted path (`dist.overlap`, `monitor.sinks[1]`) of a TOML value.
fn slot<'v>(value: &'v mut toml::Value, path: &str) -> Option<&'v mut toml::Value> {
    let mut node = value;
    for part in path.split('.') {
        let (key, indices) = match part.find('[') {
            Some(at) => (&part[..at], &part[at..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            node = node.as_table_mut()?.get_mut(key)?;
        }
        for index in indices.split('[').filter(|s| !s.is_empty()) {
            let i: usize = index.trim_end_matches(']').parse().ok()?;
            node = node.as_array_mut()?.get_mut(i)?;
        }
    }
    Some(node)
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

/// Reads a switch-like enum (`dist.overlap`, `hardware.cpu_split`): one of `names` (found by
/// `from_name`), or a boolean, which people type for a switch: `true` is `yes`, `false` is
/// `no`. Anything else is refused with the names.
pub(super) fn switch<'de, D, T>(
    d: D,
    names: &'static [&'static str],
    from_name: fn(&str) -> Option<T>,
    yes: T,
    no: T,
) -> std::result::Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct Switch<T> {
        names: &'static [&'static str],
        from_name: fn(&str) -> Option<T>,
        yes: T,
        no: T,
    }
    impl<T> serde::de::Visitor<'_> for Switch<T> {
        type Value = T;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let quoted: Vec<String> = self.names.iter().map(|n| format!("{n:?}")).collect();
            write!(f, "one of {} (or true, false)", quoted.join(", "))
        }

        fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<T, E> {
            Ok(if v { self.yes } else { self.no })
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<T, E> {
            (self.from_name)(v).ok_or_else(|| E::unknown_variant(v, self.names))
        }
    }
    d.deserialize_any(Switch {
        names,
        from_name,
        yes,
        no,
    })
}
