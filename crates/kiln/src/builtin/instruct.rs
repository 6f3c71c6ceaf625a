//! Fine-tuning a language model on one's own examples (`data.dataset = "instruct"` or
//! `"chat"`): records of a JSONL file rendered with the checkpoint's chat template (or kiln's
//! plain prompt format), tokenized with its `tokenizer.json`, the loss on the answers alone
//! (`data.train_on`), batches of similar lengths padded on the right — the padding has no loss
//! and, the attention being causal, no real position sees it.

use kiln_datasets::chat::{ChatTemplate, Encoded, Fields, Records, read_records};
use kiln_datasets::subword::SubwordTokenizer;
use kiln_models::{ModelSection, ModelSpec, Registered};
use std::path::{Path, PathBuf};

use super::config::{Config, DatasetKind, FieldNames, Overlong, TrainOn};
use super::launch::launch;
use super::sequences::{InstructWorkload, Sequence, pack};
use super::text::{WithFamily, hf_config, with_family, write_hf_config};
use super::vocab::TOKENIZER_FILE;
use kiln_engine::error::{Error, Result};
use kiln_engine::run::{RunOptions, RunResult};

/// Seed of the order examples are packed in (`data.pack`).
const PACK_SEED: u64 = 0x9ac6_5eed;

/// Seed of the split into training and validation records when no `data.eval_path` is set:
/// the same for every run seed.
const SPLIT_SEED: u64 = 0x5e1f_7e11;

/// Trains the language model `config` describes on the examples of `data.path`.
pub fn train(config: &Config, options: &RunOptions) -> Result<RunResult> {
    let d = &config.data;
    let path = d.path.clone().ok_or_else(|| {
        Error::config(format!(
            "key `data.path`: the {:?} dataset reads a JSONL file of records; set data.path",
            kiln_engine::config::name_of(&d.dataset)
        ))
    })?;
    let source = tokenizer_dir(config)?;
    let tokenizer = SubwordTokenizer::load(&source.join(TOKENIZER_FILE))?;
    let template = match ChatTemplate::of_checkpoint(&source)? {
        Some(t) => t,
        None => ChatTemplate::plain(&end_of_sequence(&source, &tokenizer)?),
    };
    let fields = fields(d.dataset, d.fields.as_ref());
    let train_records = read(&path, fields.as_ref())?;
    let mut aside = Aside::default();
    let (train, val) = match &d.eval_path {
        Some(eval) => {
            let val = read(eval, fields.as_ref())?;
            let train = encode_all(config, &template, &tokenizer, &train_records, &mut aside);
            let val = encode_all(config, &template, &tokenizer, &val, &mut aside);
            (train, val)
        }
        None => {
            let examples = encode_all(config, &template, &tokenizer, &train_records, &mut aside);
            split(examples, d.train_fraction)
        }
    };
    aside.check(&path, d.max_dropped)?;
    if train.is_empty() || val.is_empty() {
        return Err(Error::data(format!(
            "{}: {} training and {} validation examples; both need at least one (set \
             data.train_fraction or data.eval_path)",
            path.display(),
            train.len(),
            val.len()
        )));
    }
    let run = Examples {
        config,
        options,
        train,
        val,
        tokenizer,
        template,
        source,
        aside,
        path,
    };
    with_family(config, run.tokenizer.vocab_size(), &run.source.clone(), run)
}

/// The directory of the tokenizer and its chat template: `data.tokenizer` (a directory, or
/// the directory of a `tokenizer.json`), else the checkpoint `init.from` names.
fn tokenizer_dir(config: &Config) -> Result<PathBuf> {
    let dir = match (&config.data.tokenizer, &config.kiln.init.from) {
        (Some(t), _) if t.is_dir() => t.clone(),
        (Some(t), _) => t.parent().map(Path::to_path_buf).unwrap_or_default(),
        (None, Some(from)) if from.is_dir() => from.clone(),
        _ => {
            return Err(Error::config(
                "key `data.tokenizer`: instruct and chat data are tokenized with a checkpoint's \
                 tokenizer.json (and rendered with its chat template); set init.from to a \
                 Hugging Face directory or data.tokenizer to one",
            ));
        }
    };
    if !dir.join(TOKENIZER_FILE).is_file() {
        return Err(Error::config(format!(
            "{}: no {TOKENIZER_FILE} (instruct and chat data take a Hugging Face tokenizer)",
            dir.display()
        )));
    }
    Ok(dir)
}

/// The end-of-sequence token kiln's plain format ends an answer with: the settings'
/// `eos_token`, else the token of `config.json`'s `eos_token_id`, else a token of the
/// vocabulary's that ends documents by convention: `<|endoftext|>` (kiln's byte-level BPE and
/// GPT-2's) or `</s>`.
pub(super) fn end_of_sequence(dir: &Path, tokenizer: &SubwordTokenizer) -> Result<String> {
    let from_settings = kiln_datasets::chat::template::special_tokens_of(dir)?
        .into_iter()
        .find_map(|(name, token)| (name == "eos_token").then_some(token));
    let from_config = || {
        let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
        let config: serde_json::Value = serde_json::from_str(&text).ok()?;
        let id = config.get("eos_token_id")?.as_u64()?;
        tokenizer.id_to_token(u32::try_from(id).ok()?)
    };
    let from_vocabulary = || {
        ["<|endoftext|>", "</s>"]
            .into_iter()
            .find(|t| tokenizer.token_id(t).is_some())
            .map(str::to_string)
    };
    let eos = from_settings.or_else(from_config).or_else(from_vocabulary);
    eos.ok_or_else(|| {
        Error::data(format!(
            "{}: no chat template and no end-of-sequence token (tokenizer_config.json's \
             eos_token, config.json's eos_token_id, or <|endoftext|> or </s> in the \
             vocabulary) for kiln's plain prompt format to end answers with",
            dir.display()
        ))
    })
}

/// The fields `data.fields` names for `dataset`; `None` for pairs of the usual names, which
/// the first record decides.
pub(super) fn fields(dataset: DatasetKind, names: Option<&FieldNames>) -> Option<Fields> {
    let n = names.cloned().unwrap_or_default();
    match dataset {
        DatasetKind::Chat => Some(Fields::Messages(
            n.messages.unwrap_or_else(|| "messages".into()),
        )),
        _ => match (&n.prompt, &n.response) {
            (None, None) if n.input.is_none() => None,
            _ => Some(Fields::Pair {
                prompt: n.prompt.unwrap_or_else(|| "instruction".into()),
                input: n.input,
                response: n.response.unwrap_or_else(|| "output".into()),
                system: Some(n.system.unwrap_or_else(|| "system".into())),
            }),
        },
    }
}

pub(super) fn read(path: &Path, fields: Option<&Fields>) -> Result<Records> {
    if !path.is_file() {
        return Err(Error::data(format!(
            "{}: no such file (a JSONL or Parquet file of records)",
            path.display()
        )));
    }
    Ok(read_records(path, fields)?)
}

/// An example and where it came from (`file:line`).
struct Example {
    at: String,
    encoded: Encoded,
}

/// The records read, and those set aside (`file:line: why`).
#[derive(Debug, Default)]
struct Aside {
    read: usize,
    said: Vec<String>,
}

impl Aside {
    /// Refuses a run that sets aside more than `max` of the records (`path`: what the message
    /// names first); says which it set aside otherwise.
    fn check(&self, path: &Path, max: f64) -> Result<()> {
        let (n, read) = (self.said.len(), self.read.max(1));
        let first: Vec<&str> = self.said.iter().take(3).map(String::as_str).collect();
        let more = n.saturating_sub(3);
        let listed = if more > 0 {
            format!("{}; and {more} more", first.join("; "))
        } else {
            first.join("; ")
        };
        if n as f64 > max * read as f64 {
            return Err(Error::data(format!(
                "{}: {n} of {read} records cannot be used, more than data.max_dropped = {max} \
                 allows: {listed}",
                path.display()
            )));
        }
        if n > 0 {
            say!("{n} of {read} records set aside: {listed}");
        }
        Ok(())
    }
}

/// The examples of `records` (every length: the context is applied once the model is known),
/// the records that cannot be used added to `aside`.
fn encode_all(
    config: &Config,
    template: &ChatTemplate,
    tokenizer: &SubwordTokenizer,
    records: &Records,
    aside: &mut Aside,
) -> Vec<Example> {
    let train_on = match config.data.train_on {
        TrainOn::Responses => kiln_datasets::chat::TrainOn::Responses,
        TrainOn::All => kiln_datasets::chat::TrainOn::All,
    };
    aside.read += records.read();
    for r in &records.rejected {
        aside
            .said
            .push(format!("{}: {}", records.at(r.line), r.why));
    }
    let mut examples = Vec::new();
    for example in &records.examples {
        let at = records.at(example.line);
        match kiln_datasets::chat::encode(template, tokenizer, &example.messages, train_on) {
            Ok(encoded) => examples.push(Example { at, encoded }),
            Err(why) => aside.said.push(format!("{at}: {why}")),
        }
    }
    examples
}

/// `examples` within `context` inputs (and one more target): a longer one truncated or
/// dropped (and set aside) as `data.overlong` says; one whose truncation leaves no token to
/// train on set aside too.
fn within(
    examples: Vec<Example>,
    context: usize,
    overlong: Overlong,
    aside: &mut Aside,
) -> Vec<Encoded> {
    let limit = context + 1;
    let mut kept = Vec::with_capacity(examples.len());
    for e in examples {
        let n = e.encoded.ids.len();
        match overlong {
            _ if n <= limit => kept.push(e.encoded),
            Overlong::Truncate => {
                let cut = e.encoded.truncated(limit);
                if cut.trained_count() > 0 {
                    kept.push(cut);
                } else {
                    aside.said.push(format!(
                        "{}: {n} tokens, longer than the context + 1 = {limit}, and no token \
                         it trains on within them (data.overlong = \"truncate\")",
                        e.at
                    ));
                }
            }
            Overlong::Drop => aside.said.push(format!(
                "{}: {n} tokens, longer than the context + 1 = {limit} (data.overlong = \"drop\")",
                e.at
            )),
        }
    }
    kept
}

/// A seeded shuffle's first `fraction` for training, the rest for validation (at least one
/// each where there are two).
fn split(examples: Vec<Example>, fraction: f64) -> (Vec<Example>, Vec<Example>) {
    let n = examples.len();
    let order = kiln_datasets::rng::permutation(n, SPLIT_SEED);
    let cut = match n {
        0 | 1 => n,
        _ => ((n as f64 * fraction).round() as usize).clamp(1, n - 1),
    };
    let mut slots: Vec<Option<Example>> = examples.into_iter().map(Some).collect();
    let mut take = |r: &[usize]| -> Vec<Example> {
        r.iter().map(|&i| slots[i].take().expect("once")).collect()
    };
    let train = take(&order[..cut]);
    let val = take(&order[cut..]);
    (train, val)
}

/// What the run is given once the family is known.
struct Examples<'a> {
    config: &'a Config,
    options: &'a RunOptions,
    train: Vec<Example>,
    val: Vec<Example>,
    tokenizer: SubwordTokenizer,
    template: ChatTemplate,
    source: PathBuf,
    aside: Aside,
    path: PathBuf,
}

impl WithFamily for Examples<'_> {
    fn run<M: Registered>(
        self,
        model_config: M::Config,
        context: usize,
        model: ModelSection,
    ) -> Result<RunResult> {
        let longest = M::context(&model_config);
        if context == 0 || context > longest {
            return Err(Error::config(format!(
                "key `data.context`: {context} tokens; the model takes 1 to {longest}"
            )));
        }
        let mut aside = self.aside;
        let before = aside.said.len();
        let overlong = self.config.data.overlong;
        let train = within(self.train, context, overlong, &mut aside);
        let val = within(self.val, context, overlong, &mut aside);
        // Said again only when the length set more aside.
        if aside.said.len() > before {
            aside.check(&self.path, self.config.data.max_dropped)?;
        }
        let spec = ModelSpec { model, input: None };
        spec.validate().map_err(Error::config)?;
        let hf = hf_config::<M>(self.config, &model_config)?;
        let tokens = |set: &[Encoded]| -> (usize, usize) {
            let all = set.iter().map(|e| e.ids.len()).sum();
            let trained = set.iter().map(|e| e.trained_count()).sum();
            (all, trained)
        };
        let (all, trained) = tokens(&train);
        let mean_len = all / train.len().max(1);
        let rows = vec![
            (
                "data",
                format!(
                    "{}: {} train / {} val examples ({} records set aside), {all} tokens of which \
                     {trained} train ({:?}); {}; vocabulary {}",
                    self.path.display(),
                    train.len(),
                    val.len(),
                    aside.said.len(),
                    kiln_engine::config::name_of(&self.config.data.train_on),
                    self.template.origin,
                    self.tokenizer.vocab_size(),
                ),
            ),
            (
                "model flops",
                format!(
                    "{:.3e} per token (6N + 12LHQT) at the mean length",
                    M::flops_per_token(&model_config, mean_len)
                ),
            ),
        ];
        let pad = pad_id(&self.tokenizer, &self.template);
        let seed = self.config.kiln.run.seed;
        let train = if self.config.data.pack {
            // Packed in a seeded order, so that a row holds examples of any length.
            let order = kiln_datasets::rng::permutation(train.len(), PACK_SEED);
            let shuffled: Vec<Encoded> = order.iter().map(|&i| train[i].clone()).collect();
            pack(&shuffled, context)
        } else {
            train.iter().map(Sequence::of).collect()
        };
        let val = val.iter().map(Sequence::of).collect();
        let workload = InstructWorkload::<M>::new(train, val, model_config, seed, pad);
        let source = self.source;
        let tokenizer = self.tokenizer;
        launch(self.config, self.options, &workload, &spec, rows, |dir| {
            save_tokenizer(dir, &source, &tokenizer, &self.template)?;
            if let Some(json) = hf {
                let hf_dir = write_hf_config(dir, &json)?;
                save_tokenizer(&hf_dir, &source, &tokenizer, &self.template)?;
            }
            Ok(())
        })
    }
}

/// The id that pads a batch's shorter examples (it has no loss and is never attended to):
/// the template's end-of-sequence token where the tokenizer has it, else 0.
fn pad_id(tokenizer: &SubwordTokenizer, template: &ChatTemplate) -> i64 {
    ["pad_token", "eos_token"]
        .iter()
        .filter_map(|n| template.token(n))
        .find_map(|t| tokenizer.token_id(t))
        .map_or(0, i64::from)
}

/// The tokenizer and the chat template into `dir`: `tokenizer.json`, and the checkpoint's
/// `tokenizer_config.json` (and `chat_template.jinja`) as they were, or, for kiln's plain
/// format, a `tokenizer_config.json` that holds it.
fn save_tokenizer(
    dir: &Path,
    source: &Path,
    tokenizer: &SubwordTokenizer,
    template: &ChatTemplate,
) -> Result<()> {
    tokenizer.save(&dir.join(TOKENIZER_FILE))?;
    let mut copied = false;
    for name in [
        kiln_datasets::chat::template::TOKENIZER_CONFIG,
        kiln_datasets::chat::template::TEMPLATE_FILE,
    ] {
        let from = source.join(name);
        if from.is_file() {
            let bytes = std::fs::read(&from).map_err(|e| Error::io(&from, e))?;
            kiln_engine::files::write_atomic(&dir.join(name), &bytes)?;
            copied |= name == kiln_datasets::chat::template::TOKENIZER_CONFIG;
        }
    }
    if !copied || !template.from_checkpoint() {
        let mut settings = serde_json::Map::new();
        settings.insert("tokenizer_class".into(), "PreTrainedTokenizerFast".into());
        settings.insert("chat_template".into(), template.source().into());
        for (name, token) in &template.tokens {
            settings.insert(name.clone(), token.clone().into());
        }
        let path = dir.join(kiln_datasets::chat::template::TOKENIZER_CONFIG);
        let text = serde_json::to_string_pretty(&settings).expect("settings serialise");
        kiln_engine::files::write_atomic(&path, text.as_bytes())?;
    }
    Ok(())
}
