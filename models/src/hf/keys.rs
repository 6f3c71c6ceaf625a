//! What a family's own Hugging Face code reads with: a `config.json`'s keys with one-line
//! errors, and the test of which weight-file tensors it leaves out.

use serde_json::Value;

/// Which of a file's tensors are left out on purpose.
pub(crate) type Ignored = Box<dyn Fn(&str) -> bool>;

/// A `config.json`'s keys, read with one-line errors.
pub(crate) struct Keys<'a>(pub(crate) &'a Value);

impl Keys<'_> {
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize, String> {
        self.opt_usize(key)?
            .ok_or_else(|| format!("key `{key}`: missing (a whole number)"))
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| format!("key `{key}`: expected a whole number, got {v}")),
        }
    }

    pub(crate) fn f64_or(&self, key: &str, default: f64) -> Result<f64, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| format!("key `{key}`: expected a number, got {v}")),
        }
    }

    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| format!("key `{key}`: expected true or false, got {v}")),
        }
    }

    pub(crate) fn str_or<'b>(&'b self, key: &str, default: &'b str) -> Result<&'b str, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| format!("key `{key}`: expected a string, got {v}")),
        }
    }
}
