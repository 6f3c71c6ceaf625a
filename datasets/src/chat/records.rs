//! Records of a JSONL file as conversations: a prompt and its answer per record (field names
//! settable: Alpaca's `instruction`/`input`/`output`, `prompt`/`completion`, one's own), or a
//! `messages` list of `{role, content}`. A record that cannot be used is set aside with its
//! line and the reason, not dropped silently; the caller decides how many it tolerates.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::DatasetError;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// What was said.
    pub content: String,
}

impl Message {
    /// A turn of `role` saying `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// The roles a record may give a turn.
pub const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Which fields of a record hold what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fields {
    /// A prompt and its answer: the user's turn is `prompt`, followed after a blank line by
    /// `input` where the record has it and it is not empty (Alpaca's layout); the assistant's
    /// is `response`; `system`, where the record has it, is a system turn before them.
    Pair {
        /// The field of the prompt.
        prompt: String,
        /// The field of an optional input that follows the prompt.
        input: Option<String>,
        /// The field of the answer.
        response: String,
        /// The field of an optional system message.
        system: Option<String>,
    },
    /// A conversation: the field holds a list of `{"role": …, "content": …}`.
    Messages(String),
}

impl Fields {
    /// Alpaca's `instruction`, `input`, `output` (and `system`).
    pub fn alpaca() -> Self {
        Self::pair("instruction", Some("input"), "output")
    }

    /// `prompt` and `completion` (and `system`).
    pub fn prompt_completion() -> Self {
        Self::pair("prompt", None, "completion")
    }

    /// A pair of the named fields, with an optional `system` field.
    pub fn pair(prompt: &str, input: Option<&str>, response: &str) -> Self {
        Fields::Pair {
            prompt: prompt.to_string(),
            input: input.map(str::to_string),
            response: response.to_string(),
            system: Some("system".to_string()),
        }
    }

    /// The fields a record of a prompt-and-answer file uses: Alpaca's where it has
    /// `instruction`, else `prompt`/`completion` where it has `prompt`.
    pub fn detect_pair(record: &Map<String, Value>) -> Option<Self> {
        if record.contains_key("instruction") {
            Some(Self::alpaca())
        } else if record.contains_key("prompt") {
            Some(Self::prompt_completion())
        } else {
            None
        }
    }

    /// The record as a conversation, or why it is not one.
    pub fn conversation(&self, record: &Map<String, Value>) -> Result<Vec<Message>, String> {
        match self {
            Fields::Pair {
                prompt,
                input,
                response,
                system,
            } => {
                let mut messages = Vec::new();
                if let Some(s) = system.as_deref().and_then(|f| record.get(f)) {
                    let s = text(s, system.as_deref().expect("named"))?;
                    messages.push(Message::new("system", s));
                }
                let mut user = text(field(record, prompt)?, prompt)?.to_string();
                if let Some(i) = input.as_deref().and_then(|f| record.get(f)) {
                    let i = text(i, input.as_deref().expect("named"))?;
                    if !i.is_empty() {
                        user = format!("{user}\n\n{i}");
                    }
                }
                messages.push(Message::new("user", &user));
                let answer = text(field(record, response)?, response)?;
                messages.push(Message::new("assistant", answer));
                Ok(messages)
            }
            Fields::Messages(name) => {
                let Value::Array(turns) = field(record, name)? else {
                    return Err(format!("field `{name}` is not a list of turns"));
                };
                if turns.is_empty() {
                    return Err(format!("field `{name}` is an empty list"));
                }
                turns
                    .iter()
                    .enumerate()
                    .map(|(i, turn)| {
                        turn_of(turn).map_err(|e| format!("turn {i} of `{name}`: {e}"))
                    })
                    .collect()
            }
        }
    }
}

fn field<'a>(record: &'a Map<String, Value>, name: &str) -> Result<&'a Value, String> {
    record.get(name).ok_or_else(|| {
        let keys: Vec<&str> = record.keys().map(String::as_str).collect();
        format!(
            "no field `{name}` (the record has {})",
            if keys.is_empty() {
                "none".to_string()
            } else {
                keys.join(", ")
            }
        )
    })
}

fn text<'a>(value: &'a Value, name: &str) -> Result<&'a str, String> {
    value
        .as_str()
        .ok_or_else(|| format!("field `{name}` is not a string"))
}

fn turn_of(turn: &Value) -> Result<Message, String> {
    let Value::Object(turn) = turn else {
        return Err("not an object with `role` and `content`".to_string());
    };
    let role = text(field(turn, "role")?, "role")?;
    if !ROLES.contains(&role) {
        return Err(format!(
            "role {role:?} is none of {} (the roles a chat template knows)",
            ROLES.join(", ")
        ));
    }
    let content = text(field(turn, "content")?, "content")?;
    Ok(Message::new(role, content))
}

/// A record that was set aside: its line and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// Its line in the file (its row in a Parquet file), from 1.
    pub line: usize,
    /// What is wrong with it.
    pub why: String,
}

/// A conversation and the line of the file it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// Its line in the file (its row in a Parquet file), from 1.
    pub line: usize,
    /// Its turns.
    pub messages: Vec<Message>,
}

/// What a JSONL or Parquet file gave: its conversations and the records set aside.
#[derive(Debug, Clone)]
pub struct Records {
    /// The file.
    pub path: PathBuf,
    /// Whether its records are a Parquet file's rows (else a JSONL file's lines).
    pub rows: bool,
    /// The usable records, in file order.
    pub examples: Vec<Example>,
    /// The others, with their reasons.
    pub rejected: Vec<Rejected>,
}

impl Records {
    /// The records read: usable and set aside.
    pub fn read(&self) -> usize {
        self.examples.len() + self.rejected.len()
    }

    /// Where record `n` (from 1) is: `file:n` (its line), or `file: row n` (a Parquet row).
    pub fn at(&self, n: usize) -> String {
        if self.rows {
            format!("{}: row {n}", self.path.display())
        } else {
            format!("{}:{n}", self.path.display())
        }
    }

    /// `file:line: why` of the first `most` records set aside, separated by `; `.
    pub fn describe_rejected(&self, most: usize) -> String {
        let mut lines: Vec<String> = self
            .rejected
            .iter()
            .take(most)
            .map(|r| format!("{}: {}", self.at(r.line), r.why))
            .collect();
        if self.rejected.len() > most {
            lines.push(format!("and {} more", self.rejected.len() - most));
        }
        lines.join("; ")
    }
}

/// A record's number (its line or row, from 1) and its JSON, or why it has none.
type Parsed = (usize, Result<Value, String>);

/// The records of `path` as conversations through `fields`: a Parquet file's rows (`.parquet`)
/// or a JSONL file's lines (one JSON object per line; blank lines skipped). For
/// prompt-and-answer files, `None` takes the fields from the first record that parses
/// ([`Fields::detect_pair`]).
pub fn read_records(path: &Path, fields: Option<&Fields>) -> Result<Records, DatasetError> {
    let parquet = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
    let parsed: Vec<Parsed> = if parquet {
        parquet_rows(path)?
    } else {
        let text = std::fs::read_to_string(path)
            .map_err(|e| DatasetError::bad(path, format!("cannot read it as UTF-8 text: {e}")))?;
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                let v = serde_json::from_str::<Value>(l)
                    .map_err(|e| format!("does not parse as JSON: {e}"));
                (i + 1, v)
            })
            .collect()
    };
    let mut fields = fields.cloned();
    let mut records = Records {
        path: path.to_path_buf(),
        rows: parquet,
        examples: Vec::new(),
        rejected: Vec::new(),
    };
    for (line, value) in parsed {
        let record = match value {
            Ok(Value::Object(record)) => record,
            Ok(_) => {
                records.rejected.push(Rejected {
                    line,
                    why: "not a JSON object".to_string(),
                });
                continue;
            }
            Err(why) => {
                records.rejected.push(Rejected { line, why });
                continue;
            }
        };
        if fields.is_none() {
            fields = Fields::detect_pair(&record);
        }
        let Some(f) = &fields else {
            let keys: Vec<&str> = record.keys().map(String::as_str).collect();
            return Err(DatasetError::bad(
                path,
                format!(
                    "{}: a record with neither `instruction` nor `prompt` (it has {}); name the \
                     fields in data.fields",
                    if parquet {
                        format!("row {line}")
                    } else {
                        format!("line {line}")
                    },
                    keys.join(", ")
                ),
            ));
        };
        match f.conversation(&record) {
            Ok(messages) => records.examples.push(Example { line, messages }),
            Err(why) => records.rejected.push(Rejected { line, why }),
        }
    }
    Ok(records)
}

/// Every row of the Parquet file `path` as JSON (numbered from 1), or why it cannot be read.
fn parquet_rows(path: &Path) -> Result<Vec<Parsed>, DatasetError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file = std::fs::File::open(path)
        .map_err(|e| DatasetError::bad(path, format!("cannot open it: {e}")))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| DatasetError::bad(path, format!("not a Parquet file kiln reads: {e}")))?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| DatasetError::bad(path, format!("cannot read its rows: {e}")))?;
    Ok(rows
        .enumerate()
        .map(|(i, row)| {
            let value = row
                .map(|r| r.to_json_value())
                .map_err(|e| format!("cannot be read: {e}"));
            (i + 1, value)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-records-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn pairs_become_conversations_and_bad_records_are_named_by_line() {
        let path = file(
            "pairs.jsonl",
            "{\"instruction\": \"Add\", \"input\": \"2 and 3\", \"output\": \"5\"}\n\
             \n\
             {\"instruction\": \"Say hi\", \"input\": \"\", \"output\": \"hi\", \"system\": \"Be brief\"}\n\
             {\"instruction\": \"no answer\"}\n\
             {not json\n\
             [1, 2]\n\
             {\"instruction\": 3, \"output\": \"x\"}\n",
        );
        let r = read_records(&path, None).unwrap();
        assert_eq!(r.read(), 6);
        assert_eq!(
            r.examples[0].messages,
            [
                Message::new("user", "Add\n\n2 and 3"),
                Message::new("assistant", "5")
            ]
        );
        assert_eq!(r.examples[1].line, 3);
        assert_eq!(
            r.examples[1].messages,
            [
                Message::new("system", "Be brief"),
                Message::new("user", "Say hi"),
                Message::new("assistant", "hi")
            ]
        );
        let lines: Vec<usize> = r.rejected.iter().map(|x| x.line).collect();
        assert_eq!(lines, [4, 5, 6, 7]);
        assert!(
            r.rejected[0].why.contains("no field `output`"),
            "{:?}",
            r.rejected
        );
        assert!(r.rejected[1].why.contains("does not parse as JSON"));
        assert!(r.rejected[2].why.contains("not a JSON object"));
        assert!(r.rejected[3].why.contains("`instruction` is not a string"));
        let said = r.describe_rejected(2);
        assert!(said.contains("pairs.jsonl:4: no field `output`"), "{said}");
        assert!(said.contains("and 2 more"), "{said}");
    }

    #[test]
    fn conversations_are_read_and_an_unknown_role_is_refused() {
        let path = file(
            "chat.jsonl",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}]}\n\
             {\"messages\": [{\"role\": \"bot\", \"content\": \"hi\"}]}\n\
             {\"messages\": []}\n\
             {\"turns\": []}\n",
        );
        let r = read_records(&path, Some(&Fields::Messages("messages".into()))).unwrap();
        assert_eq!(r.examples.len(), 1);
        assert_eq!(
            r.examples[0].messages[1],
            Message::new("assistant", "hello")
        );
        assert!(
            r.rejected[0].why.contains("role \"bot\" is none of"),
            "{:?}",
            r.rejected
        );
        assert!(r.rejected[1].why.contains("empty list"));
        assert!(
            r.rejected[2]
                .why
                .contains("no field `messages` (the record has turns)")
        );
        // Settable names, and a file whose records name neither kind of field.
        let path = file("own.jsonl", "{\"q\": \"a?\", \"a\": \"b\"}\n");
        let own = Fields::pair("q", None, "a");
        let r = read_records(&path, Some(&own)).unwrap();
        assert_eq!(r.examples[0].messages[0], Message::new("user", "a?"));
        let e = read_records(&path, None).unwrap_err().to_string();
        assert!(
            e.contains("own.jsonl: line 1") && e.contains("data.fields"),
            "{e}"
        );
    }
}
