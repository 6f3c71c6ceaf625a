//! A conversation as token ids with the answers marked: the template's text of the whole
//! conversation tokenized once, each assistant turn's part of it found by rendering the turns
//! before it (with the generation prompt) and the turns up to it, and the tokens that start
//! inside such a part marked as answers.

use super::records::Message;
use super::template::ChatTemplate;
use crate::subword::SubwordTokenizer;

/// Which tokens a fine-tuning loss is taken on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainOn {
    /// The assistant's turns alone (what the template adds to end a turn included): the
    /// prompt's and the template's other tokens are given.
    Responses,
    /// Every token.
    All,
}

/// A conversation's token ids, and which of them are answers the loss is taken on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The ids of the rendered conversation.
    pub ids: Vec<u32>,
    /// Per id: whether predicting it is trained.
    pub trained: Vec<bool>,
}

impl Encoded {
    /// How many ids are trained.
    pub fn trained_count(&self) -> usize {
        self.trained.iter().filter(|&&t| t).count()
    }

    /// The first `len` ids (and their marks).
    pub fn truncated(&self, len: usize) -> Self {
        let len = len.min(self.ids.len());
        Self {
            ids: self.ids[..len].to_vec(),
            trained: self.trained[..len].to_vec(),
        }
    }
}

/// `messages` rendered by `template` (no generation prompt: the conversation is whole) and
/// tokenized by `tokenizer`, the answers marked as `train_on` says. Fails on a template that
/// does not render, on a conversation without an answer to train on, and where a turn's text
/// changes once later turns follow it (the answers could not be told apart; `TrainOn::All`
/// trains on such a template).
pub fn encode(
    template: &ChatTemplate,
    tokenizer: &SubwordTokenizer,
    messages: &[Message],
    train_on: TrainOn,
) -> Result<Encoded, String> {
    let text = template.render(messages, false)?;
    let (ids, offsets) = tokenizer.encode_with_offsets(&text)?;
    if train_on == TrainOn::All {
        let trained = vec![true; ids.len()];
        return Ok(Encoded { ids, trained });
    }
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.role != "assistant" {
            continue;
        }
        let before = template.render(&messages[..i], true)?;
        let through = template.render(&messages[..=i], false)?;
        for (part, what) in [
            (&before, "the prompt before"),
            (&through, "the turns up to"),
        ] {
            if !text.starts_with(part.as_str()) {
                return Err(format!(
                    "{} renders {what} answer {} (turn {i}) otherwise than the whole \
                     conversation begins, so its answers cannot be told apart; \
                     data.train_on = \"all\" trains on every token",
                    template.origin,
                    spans.len() + 1
                ));
            }
        }
        spans.push(before.len()..through.len());
    }
    if spans.is_empty() {
        return Err("no assistant turn to train on".to_string());
    }
    let trained: Vec<bool> = offsets
        .iter()
        .map(|&(start, _)| spans.iter().any(|s| s.contains(&start)))
        .collect();
    if !trained.contains(&true) {
        return Err("the answers are empty: no token to train on".to_string());
    }
    Ok(Encoded { ids, trained })
}
