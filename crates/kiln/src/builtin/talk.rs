//! Talking to a trained language model: `train sample` (a prompt continued; on a run that
//! holds a chat template, the prompt rendered as a user's turn and the answer returned) and
//! `train chat` (a conversation in the terminal, each answer in the context of the turns
//! before it), with temperature, top-k, top-p and a stop at the end of a turn.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use kiln_datasets::chat::{ChatTemplate, Message};
use kiln_models::{LanguageModel, Sampling};

use super::vocab::{TOKENIZER_FILE, Vocab};
use kiln_engine::error::{Error, Result};

/// How the next token is picked: what `train sample` and `train chat` share.
#[derive(Debug, Clone, clap::Args)]
pub struct Picking {
    /// Softmax temperature; 0 picks the most likely token.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample only among the K most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample only among the fewest most likely tokens whose probabilities add up to P
    /// (nucleus sampling), in (0, 1].
    #[arg(long)]
    pub top_p: Option<f64>,
    /// A token that ends the continuation (repeatable); with a chat template, its
    /// end-of-sequence token always does.
    #[arg(long, value_name = "TOKEN")]
    pub stop: Vec<String>,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// `train sample`: continue a prompt with a trained language model (kiln's GPT, a Llama-family
/// or GPT-2 checkpoint).
#[derive(Debug, clap::Args)]
pub struct SampleArgs {
    /// The run directory of a language-model run (kiln's GPT, `llama`, `gpt2` or `hf`).
    #[arg(long, value_name = "PATH")]
    pub run: PathBuf,
    /// The prompt: with a run that holds a chat template (an `instruct` or `chat` run), a
    /// user's turn rendered by it; else text to continue, encoded with the run's tokenizer.
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Continue the prompt as it is, not rendered by the run's chat template.
    #[arg(long)]
    pub raw: bool,
    /// Most tokens to generate (characters, for a character vocabulary).
    #[arg(long, default_value_t = 500)]
    pub tokens: usize,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub picking: Picking,
}

/// `train chat`: a conversation with a fine-tuned run in the terminal.
#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// The run directory of an `instruct` or `chat` run (it holds the chat template).
    #[arg(long, value_name = "PATH")]
    pub run: PathBuf,
    /// A system message before the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens of one answer.
    #[arg(long, default_value_t = 256)]
    pub tokens: usize,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub picking: Picking,
}

/// A run's model, tokenizer and (for a fine-tuning run) chat template.
pub struct Talker {
    model: LanguageModel,
    vocab: Vocab,
    tokenizer_path: PathBuf,
    /// The run's chat template, where it holds one.
    pub template: Option<ChatTemplate>,
}

impl Talker {
    /// The model of the run directory `run`.
    pub fn open(run: &Path) -> Result<Self> {
        let tokenizer_path = run.join(TOKENIZER_FILE);
        if !tokenizer_path.is_file() {
            return Err(Error::checkpoint(format!(
                "{}: not found; is {} a language-model run directory?",
                tokenizer_path.display(),
                run.display()
            )));
        }
        let vocab = Vocab::load(&tokenizer_path)?;
        let template = match vocab {
            Vocab::Subword(_) => ChatTemplate::of_checkpoint(run)?,
            Vocab::Chars(_) => None,
        };
        let device = burn::prelude::Device::flex();
        let model =
            kiln_models::load_lm_run(run, &device).map_err(|e| Error::checkpoint(e.to_string()))?;
        Ok(Self {
            model,
            vocab,
            tokenizer_path,
            template,
        })
    }

    /// The run's vocabulary.
    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    /// How `picking` picks, its stop tokens (and the template's end-of-sequence token) as ids.
    pub fn sampling(&self, picking: &Picking) -> Result<Sampling> {
        if !(picking.temperature >= 0.0 && picking.temperature.is_finite()) {
            return Err(Error::config(format!(
                "--temperature {}: expected a number >= 0",
                picking.temperature
            )));
        }
        if picking.top_k == Some(0) {
            return Err(Error::config("--top-k 0: expected at least 1".to_string()));
        }
        if let Some(p) = picking.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(Error::config(format!(
                "--top-p {p}: expected a number in (0, 1]"
            )));
        }
        let mut stop = Vec::new();
        let eos = self.template.as_ref().and_then(|t| t.token("eos_token"));
        for token in picking.stop.iter().map(String::as_str).chain(eos) {
            let ids = self
                .vocab
                .encode(token)
                .map_err(|e| Error::config(format!("--stop {token:?}: {e}")))?;
            match ids[..] {
                [id] => stop.push(id),
                _ => {
                    return Err(Error::config(format!(
                        "--stop {token:?}: the tokenizer makes {} tokens of it, not one",
                        ids.len()
                    )));
                }
            }
        }
        Ok(Sampling {
            temperature: picking.temperature,
            top_k: picking.top_k,
            top_p: picking.top_p,
            stop,
        })
    }

    /// The ids of `text`.
    pub fn encode(&self, text: &str, what: &str) -> Result<Vec<u32>> {
        let ids = self
            .vocab
            .encode(text)
            .map_err(|e| Error::config(format!("{what}: {e}")))?;
        if ids.is_empty() {
            return Err(Error::config(format!("{what}: must not be empty")));
        }
        Ok(ids)
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.vocab
            .decode(ids)
            .map_err(|e| Error::checkpoint(format!("{}: {e}", self.tokenizer_path.display())))
    }

    /// The ids `prompt` is continued by, at most `tokens`, a stop id last where one ended it.
    pub fn continuation(
        &self,
        prompt: &[u32],
        tokens: usize,
        how: &Sampling,
        seed: u64,
    ) -> Vec<u32> {
        let mut rng = kiln_datasets::rng::SplitMix64::new(seed);
        let ids = self
            .model
            .continue_ids(prompt, tokens, how, &mut || rng.next_f64());
        ids[prompt.len()..].to_vec()
    }

    /// The assistant's answer to `messages` (the template's text of them with the generation
    /// prompt, continued to a stop id or `tokens`), without the stop token.
    pub fn answer(
        &self,
        messages: &[Message],
        tokens: usize,
        how: &Sampling,
        seed: u64,
    ) -> Result<String> {
        let template = self.template.as_ref().ok_or_else(|| {
            Error::config("the run holds no chat template (tokenizer_config.json): it was not an instruct or chat run; `train sample --raw` continues text")
        })?;
        let text = template.render(messages, true).map_err(Error::config)?;
        let prompt = self.encode(&text, "the conversation")?;
        let mut ids = self.continuation(&prompt, tokens, how, seed);
        if ids.last().is_some_and(|id| how.stop.contains(id)) {
            ids.pop();
        }
        self.decode(&ids)
    }
}

/// `train sample`: prints the continuation of a prompt (or the answer to it) by a trained
/// language-model run.
pub fn sample(args: SampleArgs) -> Result<()> {
    say!("{}", generate(&args)?);
    Ok(())
}

/// Generates text from a trained language-model run (kiln's GPT, Llama, GPT-2): with a chat
/// template (and not `--raw`), the answer to the prompt as a user's turn; else prompt +
/// continuation.
pub fn generate(args: &SampleArgs) -> Result<String> {
    let talker = Talker::open(&args.run)?;
    let how = talker.sampling(&args.picking)?;
    if talker.template.is_some() && !args.raw {
        let turn = [Message::new("user", &args.prompt)];
        return talker.answer(&turn, args.tokens, &how, args.picking.seed);
    }
    let prompt = talker.encode(&args.prompt, "--prompt")?;
    let ids = talker.continuation(&prompt, args.tokens, &how, args.picking.seed);
    talker.decode(&[prompt, ids].concat())
}

/// `train chat`: reads a user's turn per line of standard input, prints each answer; an empty
/// line or the end of the input ends it.
pub fn chat(args: ChatArgs) -> Result<()> {
    let talker = Talker::open(&args.run)?;
    let how = talker.sampling(&args.picking)?;
    let mut messages: Vec<Message> = args
        .system
        .iter()
        .map(|s| Message::new("system", s))
        .collect();
    let stdin = std::io::stdin();
    for (turn, line) in stdin.lock().lines().enumerate() {
        let line = line.map_err(|e| Error::data(format!("standard input: {e}")))?;
        if line.trim().is_empty() {
            break;
        }
        messages.push(Message::new("user", &line));
        let seed = args.picking.seed.wrapping_add(turn as u64);
        let answer = talker.answer(&messages, args.tokens, &how, seed)?;
        println!("{answer}");
        messages.push(Message::new("assistant", &answer));
    }
    Ok(())
}
