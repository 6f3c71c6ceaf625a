//! A checkpoint's chat template: the Jinja template of its `tokenizer_config.json`
//! (`chat_template`, a string or a list of named templates) or of a `chat_template.jinja`
//! beside it, rendered as `transformers` renders it — blocks trimmed and left-stripped,
//! `raise_exception`, Python's string methods, the special tokens (`bos_token`, `eos_token`,
//! …) and `add_generation_prompt` in scope — with `minijinja`. A checkpoint without one gets a
//! plain prompt format ([`ChatTemplate::plain`]).

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

use super::records::Message;
use crate::error::DatasetError;

/// The file of a checkpoint's tokenizer settings, its chat template among them.
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";

/// The file `transformers` writes a chat template to on its own, beside the settings.
pub const TEMPLATE_FILE: &str = "chat_template.jinja";

/// kiln's prompt format for checkpoints without a template: `### Instruction:` and
/// `### Response:` headings, the end-of-sequence token after each answer.
const PLAIN: &str = "{%- for m in messages -%}\
{%- if m.role == 'system' -%}{{ m.content }}{{ '\\n\\n' }}\
{%- elif m.role == 'user' -%}{{ '### Instruction:\\n' }}{{ m.content }}{{ '\\n\\n' }}\
{%- else -%}{{ '### Response:\\n' }}{{ m.content }}{{ eos_token }}{{ '\\n\\n' }}\
{%- endif -%}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '### Response:\\n' }}{%- endif -%}";

/// A compiled chat template and the special tokens it is rendered with.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    checkpoint: bool,
    /// Where it came from, for messages: a file, or kiln's plain format.
    pub origin: String,
    /// Special tokens by name (`bos_token`, `eos_token`, `pad_token`, `unk_token`) as the
    /// template sees them.
    pub tokens: Vec<(String, String)>,
}

impl ChatTemplate {
    /// The template of the checkpoint directory `dir` (its `chat_template.jinja`, else its
    /// `tokenizer_config.json`'s `chat_template`) with the special tokens of its
    /// `tokenizer_config.json`; `None` when it has no template.
    pub fn of_checkpoint(dir: &Path) -> Result<Option<Self>, DatasetError> {
        let config_path = dir.join(TOKENIZER_CONFIG);
        let config = settings(dir)?;
        let tokens = special_tokens(&config);
        let file = dir.join(TEMPLATE_FILE);
        let (source, origin) = if file.is_file() {
            let source = std::fs::read_to_string(&file)
                .map_err(|e| DatasetError::bad(&file, format!("cannot read it: {e}")))?;
            (source, file)
        } else {
            match template_in(&config, &config_path)? {
                Some(source) => (source, config_path),
                None => return Ok(None),
            }
        };
        let origin_text = origin.display().to_string();
        let mut template =
            Self::new(source, origin_text, tokens).map_err(|e| DatasetError::bad(&origin, e))?;
        template.checkpoint = true;
        Ok(Some(template))
    }

    /// kiln's plain prompt format (`### Instruction:` / `### Response:`), each answer ended by
    /// `eos` — the checkpoint's end-of-sequence token, which a model trained on it learns to
    /// stop with.
    pub fn plain(eos: &str) -> Self {
        let tokens = vec![("eos_token".to_string(), eos.to_string())];
        Self::new(
            PLAIN.to_string(),
            "kiln's plain prompt format".into(),
            tokens,
        )
        .expect("the plain format compiles")
    }

    /// `source` compiled, rendered with `tokens` in scope.
    pub fn new(
        source: String,
        origin: String,
        tokens: Vec<(String, String)>,
    ) -> Result<Self, String> {
        let mut env = Environment::new();
        // What `transformers` compiles chat templates with.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source.clone())
            .map_err(|e| format!("the chat template does not compile: {}", one_line(&e)))?;
        Ok(Self {
            env,
            source,
            checkpoint: false,
            origin,
            tokens,
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether it is a checkpoint's own (not kiln's plain format, nor one made up).
    pub fn from_checkpoint(&self) -> bool {
        self.checkpoint
    }

    /// The special token `name` (`eos_token`, …), where the settings give it.
    pub fn token(&self, name: &str) -> Option<&str> {
        self.tokens
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// The text of `messages`, followed by the start of the assistant's turn with
    /// `add_generation_prompt`.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let turns: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from(BTreeMap::from([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ]))
            })
            .collect();
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::from([
            ("messages", Value::from(turns)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
        ]);
        for (name, token) in &self.tokens {
            ctx.insert(name, Value::from(token.as_str()));
        }
        let template = self.env.get_template("chat").map_err(|e| one_line(&e))?;
        template
            .render(Value::from(ctx))
            .map_err(|e| format!("{} does not render: {}", self.origin, one_line(&e)))
    }
}

/// The checkpoint directory `dir`'s `tokenizer_config.json` (an empty object where it has none).
fn settings(dir: &Path) -> Result<Json, DatasetError> {
    let path = dir.join(TOKENIZER_CONFIG);
    if !path.is_file() {
        return Ok(Json::Object(Default::default()));
    }
    let text = std::fs::read_to_string(&path)
        .map_err(|e| DatasetError::bad(&path, format!("cannot read it: {e}")))?;
    serde_json::from_str(&text)
        .map_err(|e| DatasetError::bad(&path, format!("does not parse as JSON: {e}")))
}

/// The special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`) the checkpoint
/// directory `dir`'s `tokenizer_config.json` names, as a template sees them.
pub fn special_tokens_of(dir: &Path) -> Result<Vec<(String, String)>, DatasetError> {
    Ok(special_tokens(&settings(dir)?))
}

/// An error of minijinja's with its cause, on one line.
fn one_line(e: &Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text = format!("{text}: {s}");
        source = s.source();
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The `chat_template` of a `tokenizer_config.json`: a string, or the one named `default` of
/// a list of `{name, template}`.
fn template_in(config: &Json, path: &Path) -> Result<Option<String>, DatasetError> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let named: Vec<(&str, &str)> = list
                .iter()
                .filter_map(|t| Some((t.get("name")?.as_str()?, t.get("template")?.as_str()?)))
                .collect();
            match named.iter().find(|(n, _)| *n == "default") {
                Some((_, t)) => Ok(Some(t.to_string())),
                None if named.len() == 1 => Ok(Some(named[0].1.to_string())),
                None => Err(DatasetError::bad(
                    path,
                    format!(
                        "`chat_template` lists templates named {} and none `default`",
                        named.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
                    ),
                )),
            }
        }
        Some(_) => Err(DatasetError::bad(
            path,
            "`chat_template` is neither a string nor a list of {name, template}",
        )),
    }
}

/// `bos_token`, `eos_token`, `pad_token`, `unk_token` of the settings: a string or an added
/// token's `{"content": …}`.
fn special_tokens(config: &Json) -> Vec<(String, String)> {
    ["bos_token", "eos_token", "pad_token", "unk_token"]
        .iter()
        .filter_map(|name| {
            let v = config.get(*name)?;
            let text = v
                .as_str()
                .or_else(|| v.get("content").and_then(Json::as_str))?;
            Some((name.to_string(), text.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plain_format_marks_turns_and_ends_answers() {
        let t = ChatTemplate::plain("</s>");
        let m = [
            Message::new("system", "Be brief."),
            Message::new("user", "Hi?"),
            Message::new("assistant", "Hello."),
            Message::new("user", "Bye?"),
        ];
        assert_eq!(
            t.render(&m, true).unwrap(),
            "Be brief.\n\n### Instruction:\nHi?\n\n### Response:\nHello.</s>\n\n\
             ### Instruction:\nBye?\n\n### Response:\n"
        );
    }

    #[test]
    fn a_template_that_raises_or_does_not_compile_says_so() {
        let t = ChatTemplate::new(
            "{{ raise_exception('only users here') if messages[0].role != 'user' }}".into(),
            "test".into(),
            vec![],
        )
        .unwrap();
        let e = t
            .render(&[Message::new("assistant", "x")], false)
            .unwrap_err();
        assert!(
            e.contains("test does not render") && e.contains("only users here"),
            "{e}"
        );
        let e = ChatTemplate::new("{% for %}".into(), "test".into(), vec![]).unwrap_err();
        assert!(e.contains("does not compile"), "{e}");
        // Python's string methods, as templates call them.
        let t = ChatTemplate::new(
            "{{ messages[0].content.strip().upper() }}".into(),
            "test".into(),
            vec![],
        )
        .unwrap();
        assert_eq!(
            t.render(&[Message::new("user", " hi \n")], false).unwrap(),
            "HI"
        );
    }
}
