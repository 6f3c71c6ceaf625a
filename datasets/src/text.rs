//! Character-level text data: a tokenizer, a contiguous train/validation split, and the
//! deterministic choice of training and evaluation windows.
//!
//! Language-model training reads fixed-length windows out of one long token stream. Which
//! windows a step uses is derived from the seed and the step number alone, so a run resumed
//! from a checkpoint, or spread over a different number of devices, sees exactly the same data.

use std::collections::BTreeSet;
use std::fmt;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::char_json::{self, push_json_char};
use crate::error::DatasetError;
use crate::rng::SplitMix64;

/// Canonical URL of Tiny Shakespeare, for users with internet access.
pub const TINY_SHAKESPEARE_URL: &str =
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt";

/// The value of the `kind` field that marks a saved character tokenizer.
const JSON_KIND: &str = "char";

/// The fewest tokens a train or validation part may hold: one input and the target after it.
const MIN_PART: usize = 2;

/// The odd multiplier that spreads consecutive step numbers across the seed space (2^64
/// divided by the golden ratio), so that neighbouring steps get unrelated generators.
const STEP_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// Character-level tokenizer: the sorted set of distinct chars of a text; ids are `u32`
/// indices into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CharTokenizer {
    /// The distinct characters, strictly increasing by Unicode scalar value.
    vocab: Vec<char>,
}

impl CharTokenizer {
    /// Builds the vocabulary of every distinct character in `text`, sorted by scalar value.
    ///
    /// Sorting makes the ids depend only on the set of characters, not on where they first
    /// occur, so two texts with the same alphabet share one tokenizer. An empty text yields an
    /// empty vocabulary.
    pub fn from_text(text: &str) -> Self {
        let distinct: BTreeSet<char> = text.chars().collect();
        CharTokenizer {
            vocab: distinct.into_iter().collect(),
        }
    }

    /// The number of distinct characters, which is also one more than the largest id.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The id of every character of `text`, in order.
    ///
    /// Fails on the first character that is not in the vocabulary, naming it and its position
    /// counted in characters.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DatasetError> {
        text.chars()
            .enumerate()
            .map(|(position, ch)| {
                self.id(ch).ok_or(DatasetError::UnknownChar {
                    ch,
                    position,
                    vocab_size: self.vocab.len(),
                })
            })
            .collect()
    }

    /// The text that `ids` stand for; an id outside the vocabulary becomes U+FFFD.
    ///
    /// Decoding is lenient because it mostly renders model samples, where a stray id should
    /// show up as a visible replacement character rather than abort the run.
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&id| {
                usize::try_from(id)
                    .ok()
                    .and_then(|i| self.vocab.get(i))
                    .copied()
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect()
    }

    /// The vocabulary: the character with id `i` is at index `i`.
    pub fn chars(&self) -> &[char] {
        &self.vocab
    }

    /// The id of `ch`, if it is in the vocabulary.
    fn id(&self, ch: char) -> Option<u32> {
        // The vocabulary is sorted, so a binary search finds the index without a side table.
        self.vocab
            .binary_search(&ch)
            .ok()
            .map(|i| u32::try_from(i).expect("a vocabulary of distinct chars fits in u32"))
    }

    /// The tokenizer as one line of JSON: `{"kind":"char","vocab":["a","b",...]}`.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(32 + 4 * self.vocab.len());
        out.push_str("{\"kind\":\"");
        out.push_str(JSON_KIND);
        out.push_str("\",\"vocab\":[");
        for (i, &ch) in self.vocab.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            push_json_char(&mut out, ch);
        }
        out.push_str("]}");
        out
    }

    /// Parses the JSON written by [`CharTokenizer::to_json`] and checks that it describes a
    /// usable tokenizer.
    ///
    /// The kind must be `"char"`, the vocabulary non-empty, every entry exactly one character,
    /// and the entries strictly increasing, since ids are positions and a reordered or repeated
    /// entry would silently change what a trained model's outputs mean.
    pub fn from_json(text: &str) -> Result<Self, DatasetError> {
        parse_tokenizer(text).map_err(|reason| DatasetError::BadTokenizer { path: None, reason })
    }

    /// Writes the tokenizer's JSON to `path` through a temporary sibling file.
    ///
    /// The rename at the end is atomic, so a crash mid-write leaves either the old file or the
    /// new one, never a truncated tokenizer next to a checkpoint.
    pub fn save(&self, path: &Path) -> Result<(), DatasetError> {
        write_atomically(path, self.to_json().as_bytes())
    }

    /// Reads and validates a tokenizer saved by [`CharTokenizer::save`].
    pub fn load(path: &Path) -> Result<Self, DatasetError> {
        let text =
            fs::read_to_string(path).map_err(|e| DatasetError::io(path, "cannot read", e))?;
        parse_tokenizer(&text).map_err(|reason| DatasetError::BadTokenizer {
            path: Some(path.to_path_buf()),
            reason,
        })
    }
}

/// A tokenised text split into contiguous train and validation parts.
#[derive(Clone)]
pub struct TextData {
    /// The tokenizer built from the whole text, so both parts encode without unknown chars.
    pub tokenizer: CharTokenizer,
    /// The token ids of the leading part of the text.
    pub train: Vec<u32>,
    /// The token ids of the rest of the text, which follows `train` without a gap.
    pub val: Vec<u32>,
    /// A short name for logs and run metadata, e.g. "moby-dick".
    pub name: String,
}

impl TextData {
    /// Reads a UTF-8 file and splits it: the vocabulary comes from the whole file, the first
    /// `train_fraction` (e.g. 0.9) of the characters become `train` and the rest `val`.
    ///
    /// The name is the file name without its extension. Invalid UTF-8 (reported with its byte
    /// offset), an empty file, a fraction outside (0, 1) and a text too short for the split
    /// are all errors naming the file.
    pub fn from_file(path: &Path, train_fraction: f64) -> Result<Self, DatasetError> {
        let (name, text) = read_text(path)?;
        split_text(&text, &name, train_fraction).map_err(|r| bad_text(path, &name, r))
    }

    /// Reads a UTF-8 file as [`TextData::from_file`] does, encoded with `tokenizer` (a trained
    /// model's vocabulary) instead of one built from the file: characters outside it are left
    /// out, and their count is returned.
    pub fn from_file_with(
        path: &Path,
        train_fraction: f64,
        tokenizer: CharTokenizer,
    ) -> Result<(Self, usize), DatasetError> {
        let (name, text) = read_text(path)?;
        let kept: String = text
            .chars()
            .filter(|c| tokenizer.id(*c).is_some())
            .collect();
        let dropped = text.chars().count() - kept.chars().count();
        let data = split_with(&kept, tokenizer, &name, train_fraction)
            .map_err(|r| bad_text(path, &name, r))?;
        Ok((data, dropped))
    }

    /// Splits in-memory text the same way as [`TextData::from_file`], under the given name.
    pub fn from_text(text: &str, name: &str, train_fraction: f64) -> Result<Self, DatasetError> {
        split_text(text, name, train_fraction).map_err(|reason| DatasetError::BadText {
            path: None,
            name: name.to_string(),
            reason,
        })
    }
}

// A derived Debug would print every token id, which buries the useful size information.
impl fmt::Debug for TextData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TextData")
            .field("name", &self.name)
            .field("vocab_size", &self.tokenizer.vocab_size())
            .field("train_len", &self.train.len())
            .field("val_len", &self.val.len())
            .finish_non_exhaustive()
    }
}

/// Downloads the text at `url` to `path`, replacing any file already there.
///
/// The body must be non-empty UTF-8 before anything is written, and it lands through a
/// temporary sibling file renamed into place, so a failed or corrupt transfer never leaves a
/// file under the final name. Missing parent directories are created.
pub fn download_text(url: &str, path: &Path) -> Result<(), DatasetError> {
    let failed = |reason: String| DatasetError::Download {
        url: url.to_string(),
        reason,
    };
    let response = ureq::get(url).call().map_err(|e| failed(e.to_string()))?;
    let mut body = Vec::new();
    // Reading through the plain reader sidesteps ureq's default cap on buffered bodies, which
    // a large corpus could exceed.
    response
        .into_body()
        .into_reader()
        .read_to_end(&mut body)
        .map_err(|e| failed(e.to_string()))?;
    check_text(&body).map_err(|reason| failed(format!("the response is {reason}")))?;
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent)
            .map_err(|e| DatasetError::io(parent, "cannot create directory", e))?;
    }
    write_atomically(path, &body)
}

/// Start offsets of the `global_batch` windows of `block + 1` tokens used at global step
/// `step`, drawn from `(seed, step)` only.
///
/// Window `i` starts at a uniform position in `0..=len - (block + 1)`, so every window fits:
/// `start + block + 1 <= len`. The list is the same whatever the number of devices; each rank
/// takes its contiguous share with [`rank_share`]. Because nothing depends on earlier steps, a
/// resumed run draws the same windows as an uninterrupted one.
///
/// # Panics
///
/// Panics if `len <= block`, since no window would fit; callers validate lengths first.
pub fn window_starts(
    len: usize,
    block: usize,
    seed: u64,
    step: u64,
    global_batch: usize,
) -> Vec<usize> {
    let span = window_span(len, block);
    // Multiplying the step by an odd constant before mixing keeps consecutive steps from
    // seeding generators whose states differ by a small amount; drawing the final seed from a
    // throwaway generator then scrambles the combined value fully.
    let step_seed = SplitMix64::new(seed ^ step.wrapping_mul(STEP_MIX)).next_u64();
    draw_starts(&mut SplitMix64::new(step_seed), span, global_batch)
}

/// Fixed evaluation windows: `count` start offsets drawn from `seed`, the same on every call,
/// so that a mean validation loss is always taken over the same set.
///
/// # Panics
///
/// Panics if `len <= block`, since no window would fit; callers validate lengths first.
pub fn eval_starts(len: usize, block: usize, seed: u64, count: usize) -> Vec<usize> {
    let span = window_span(len, block);
    draw_starts(&mut SplitMix64::new(seed), span, count)
}

/// The contiguous share of `all` that rank `rank` of `world` processes: items
/// `[rank * b, (rank + 1) * b)` where `b = all.len() / world`.
///
/// Concatenating the shares of ranks `0..world` gives back `all`, which is what makes a step's
/// data independent of the device count.
///
/// # Panics
///
/// Panics if `world` is zero, `rank >= world`, or `all.len()` is not a multiple of `world`,
/// because an uneven split would drop or duplicate examples.
pub fn rank_share<T>(all: &[T], world: usize, rank: usize) -> &[T] {
    assert!(world > 0, "rank_share needs a world size of at least 1");
    assert!(
        rank < world,
        "rank {rank} is out of range for a world of {world}"
    );
    assert!(
        all.len().is_multiple_of(world),
        "a batch of {} cannot be split evenly over {world} ranks",
        all.len()
    );
    let share = all.len() / world;
    &all[rank * share..(rank + 1) * share]
}

/// The number of valid window starts in a stream of `len` tokens for windows of `block + 1`.
fn window_span(len: usize, block: usize) -> u64 {
    assert!(
        len > block,
        "a window of {block} + 1 tokens does not fit in a stream of {len} tokens"
    );
    (len - block) as u64
}

/// Draws `count` independent uniform starts in `0..span`.
fn draw_starts(rng: &mut SplitMix64, span: u64, count: usize) -> Vec<usize> {
    (0..count).map(|_| rng.below(span) as usize).collect()
}

/// The number of characters that go to the training part when `len` are split at `fraction`.
/// The training part of `len` tokens split at `fraction`: the first this many, as
/// [`TextData`] splits a text.
pub fn train_part(len: usize, fraction: f64) -> usize {
    train_len(len, fraction)
}

fn train_len(len: usize, fraction: f64) -> usize {
    // Rounding rather than truncating keeps a product like 0.29 * 100 = 28.999... from losing
    // a character to floating-point error.
    ((len as f64 * fraction).round() as usize).min(len)
}

/// The shortest text whose split at `fraction` leaves at least `MIN_PART` characters in both parts.
fn min_split_len(fraction: f64) -> usize {
    // Each part needs its share of the text to round to at least MIN_PART, which bounds the
    // length from below; the search then walks up to the exact answer in a few steps.
    let smaller = fraction.min(1.0 - fraction);
    let estimate = ((MIN_PART as f64 - 0.5) / smaller).floor() - 1.0;
    let mut len = (estimate.min(1e15) as usize).max(2 * MIN_PART);
    while !(train_len(len, fraction) >= MIN_PART && len - train_len(len, fraction) >= MIN_PART) {
        len += 1;
    }
    len
}

/// Builds the tokenizer and both parts of a text; errors are reasons without a location.
fn split_text(text: &str, name: &str, fraction: f64) -> Result<TextData, String> {
    split_with(text, CharTokenizer::from_text(text), name, fraction)
}

/// [`split_text`] with `tokenizer`, whose vocabulary holds every character of `text`.
fn split_with(
    text: &str,
    tokenizer: CharTokenizer,
    name: &str,
    fraction: f64,
) -> Result<TextData, String> {
    if !(fraction > 0.0 && fraction < 1.0) {
        return Err(format!(
            "train fraction {fraction} must lie strictly between 0 and 1"
        ));
    }
    let mut train = tokenizer
        .encode(text)
        .expect("the vocabulary holds every character of the text");
    let len = train.len();
    let cut = train_len(len, fraction);
    if cut < MIN_PART || len - cut < MIN_PART {
        return Err(format!(
            "the text has {len} characters, but a {fraction} train/val split needs at least {} so that each part holds {MIN_PART}",
            min_split_len(fraction)
        ));
    }
    let val = train.split_off(cut);
    Ok(TextData {
        tokenizer,
        train,
        val,
        name: name.to_string(),
    })
}

/// A text file's name (its stem) and its text, checked to be non-empty UTF-8; errors name
/// the file.
/// The text of the UTF-8 file `path` (checked as [`TextData::from_file`] checks it) and the
/// name it goes by (its file stem).
pub fn read_text_file(path: &Path) -> Result<(String, String), DatasetError> {
    read_text(path)
}

/// The byte offset in `text` of the character that starts its second part when its first
/// `fraction` of characters (rounded) is the first part.
pub fn char_boundary(text: &str, fraction: f64) -> usize {
    let chars = text.chars().count();
    let keep = train_len(chars, fraction);
    text.char_indices().nth(keep).map_or(text.len(), |(i, _)| i)
}

fn read_text(path: &Path) -> Result<(String, String), DatasetError> {
    let name = path.file_stem().map_or_else(
        || path.display().to_string(),
        |stem| stem.to_string_lossy().into_owned(),
    );
    let bytes = fs::read(path).map_err(|e| DatasetError::io(path, "cannot read", e))?;
    check_text(&bytes).map_err(|r| bad_text(path, &name, r))?;
    let text = String::from_utf8(bytes).expect("checked as UTF-8 above");
    Ok((name, text))
}

/// The error of a text file that cannot be used, and why.
fn bad_text(path: &Path, name: &str, reason: String) -> DatasetError {
    DatasetError::BadText {
        path: Some(path.to_path_buf()),
        name: name.to_string(),
        reason,
    }
}

/// Checks that `bytes` are non-empty UTF-8 and returns them as text.
fn check_text(bytes: &[u8]) -> Result<&str, String> {
    let text = std::str::from_utf8(bytes)
        .map_err(|e| format!("not valid UTF-8 at byte offset {}", e.valid_up_to()))?;
    if text.is_empty() {
        return Err("empty, so there is no text to train on".to_string());
    }
    Ok(text)
}

/// Writes `contents` to `path` via a temporary sibling file and a rename.
pub(crate) fn write_atomically(path: &Path, contents: &[u8]) -> Result<(), DatasetError> {
    let mut partial_name = path.as_os_str().to_owned();
    partial_name.push(".partial");
    let partial = PathBuf::from(partial_name);
    let result = File::create(&partial)
        .and_then(|mut file| {
            file.write_all(contents)?;
            file.sync_all()
        })
        .map_err(|e| DatasetError::io(&partial, "cannot write", e))
        .and_then(|()| {
            fs::rename(&partial, path).map_err(|e| DatasetError::io(path, "cannot rename into", e))
        });
    if result.is_err() {
        // The partial file is useless after a failure, and leaving it would clutter the
        // directory with something that looks like data.
        let _ = fs::remove_file(&partial);
    }
    result
}

/// Parses and validates a tokenizer's JSON, returning a reason on failure.
fn parse_tokenizer(text: &str) -> Result<CharTokenizer, String> {
    char_json::parse_vocab(text, JSON_KIND).map(|vocab| CharTokenizer { vocab })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory unique to one test, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("kiln-datasets-text-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn tokenizer_round_trips_ascii() {
        let text = "hello, world\n";
        let tok = CharTokenizer::from_text(text);
        assert_eq!(
            tok.chars(),
            &['\n', ' ', ',', 'd', 'e', 'h', 'l', 'o', 'r', 'w']
        );
        assert_eq!(tok.vocab_size(), 10);
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids.len(), text.len());
        assert_eq!(ids[0], 5);
        assert_eq!(tok.decode(&ids), text);
    }

    #[test]
    fn tokenizer_round_trips_non_ascii() {
        let text = "café — naïve 🦀 crab";
        let tok = CharTokenizer::from_text(text);
        let ids = tok.encode(text).unwrap();
        // Ids count characters, not bytes, so multi-byte characters take one id each.
        assert_eq!(ids.len(), text.chars().count());
        assert_eq!(tok.decode(&ids), text);
        assert_eq!(*tok.chars().last().unwrap(), '🦀');
        assert!(tok.chars().windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_trained_vocabulary_reads_another_text_leaving_out_what_it_lacks() {
        let dir = std::env::temp_dir().join(format!("kiln-text-with-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("other.txt");
        fs::write(&path, "abc%abc%".repeat(40)).unwrap();
        let tok = CharTokenizer::from_text("cba");
        let (data, dropped) = TextData::from_file_with(&path, 0.5, tok.clone()).unwrap();
        assert_eq!(dropped, 80);
        assert_eq!(data.tokenizer.chars(), tok.chars());
        assert_eq!(data.train.len() + data.val.len(), 240);
        assert_eq!(tok.decode(&data.train[..4]), "abca");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn decode_replaces_out_of_range_ids() {
        let tok = CharTokenizer::from_text("ab");
        assert_eq!(tok.decode(&[0, 2, 1, u32::MAX]), "a\u{fffd}b\u{fffd}");
    }

    #[test]
    fn unknown_char_is_named_with_its_position() {
        let tok = CharTokenizer::from_text("abc");
        let err = tok.encode("abébz").unwrap_err();
        match err {
            DatasetError::UnknownChar {
                ch,
                position,
                vocab_size,
            } => assert_eq!((ch, position, vocab_size), ('é', 2, 3)),
            other => panic!("unexpected error {other:?}"),
        }
        let message = tok.encode("ab\n").unwrap_err().to_string();
        assert!(message.contains("'\\n'"), "{message}");
        assert!(message.contains("U+000A"), "{message}");
        assert!(message.contains("position 2"), "{message}");
        assert!(!message.contains('\n'), "{message}");
    }

    #[test]
    fn json_round_trips_awkward_characters() {
        let tok = CharTokenizer::from_text("a\"\\\n\t\r\u{1}\u{7f}/é—🦀 ");
        let json = tok.to_json();
        assert!(json.starts_with("{\"kind\":\"char\",\"vocab\":["), "{json}");
        assert!(!json.contains('\n'), "{json}");
        assert_eq!(CharTokenizer::from_json(&json).unwrap(), tok);
    }

    #[test]
    fn json_accepts_whitespace_escapes_and_field_order() {
        let json = "{ \"vocab\" : [ \"\\n\", \"A\", \"\\u00e9\", \"\\ud83e\\udd80\" ] ,\n \"kind\": \"char\" }\n";
        let tok = CharTokenizer::from_json(json).unwrap();
        assert_eq!(tok.chars(), &['\n', 'A', 'é', '🦀']);
    }

    #[test]
    fn json_rejects_bad_tokenizers() {
        let cases = [
            (r#"{"kind":"char","vocab":["a","a"]}"#, "repeats"),
            (
                r#"{"kind":"char","vocab":["b","a"]}"#,
                "strictly increasing",
            ),
            (r#"{"kind":"char","vocab":["ab"]}"#, "exactly one"),
            (r#"{"kind":"char","vocab":[""]}"#, "exactly one"),
            (r#"{"kind":"bpe","vocab":["a"]}"#, "expected \"char\""),
            (r#"{"kind":"char","vocab":[]}"#, "empty"),
            (r#"{"kind":"char"}"#, "missing field \"vocab\""),
            (r#"{"vocab":["a"]}"#, "missing field \"kind\""),
            (r#"{"kind":"char","kind":"char","vocab":["a"]}"#, "twice"),
            (r#"{"kind":"char","vocab":["a"],"x":"y"}"#, "unknown field"),
            (r#"{"kind":["char"],"vocab":["a"]}"#, "must be a string"),
            (r#"{"kind":"char","vocab":"a"}"#, "list of strings"),
            (r#"{"kind":"char","vocab":["a"]} x"#, "after the object"),
            (r#"{"kind":"char","vocab":["\ud800"]}"#, "surrogate"),
            (r#"{"kind":"char","vocab":["a"#, "unterminated"),
            ("", "found the end"),
        ];
        for (json, expected) in cases {
            let message = CharTokenizer::from_json(json).unwrap_err().to_string();
            assert!(message.starts_with("bad tokenizer JSON: "), "{message}");
            assert!(message.contains(expected), "{json}: {message}");
        }
    }

    #[test]
    fn save_and_load_round_trip_and_name_the_file() {
        let scratch = Scratch::new("save");
        let path = scratch.0.join("tokenizer.json");
        let tok = CharTokenizer::from_text("to be or not to be");
        tok.save(&path).unwrap();
        assert_eq!(CharTokenizer::load(&path).unwrap(), tok);
        assert!(!scratch.0.join("tokenizer.json.partial").exists());

        fs::write(&path, r#"{"kind":"char","vocab":["z","a"]}"#).unwrap();
        let err = CharTokenizer::load(&path).unwrap_err();
        assert_eq!(err.path(), Some(path.as_path()));
        assert!(
            err.to_string().contains("tokenizer.json: bad tokenizer"),
            "{err}"
        );
        let missing = CharTokenizer::load(&scratch.0.join("absent.json")).unwrap_err();
        assert!(missing.to_string().contains("absent.json"), "{missing}");
    }

    #[test]
    fn split_is_ninety_ten_and_contiguous() {
        let text: String = (0..100)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let data = TextData::from_text(&text, "letters", 0.9).unwrap();
        assert_eq!(data.name, "letters");
        assert_eq!((data.train.len(), data.val.len()), (90, 10));
        assert_eq!(data.tokenizer.vocab_size(), 26);
        // The validation part continues exactly where the training part stops.
        let whole = data.tokenizer.encode(&text).unwrap();
        assert_eq!(whole[..90], data.train[..]);
        assert_eq!(whole[90..], data.val[..]);
        assert_eq!(data.tokenizer.decode(&data.val), &text[90..]);
    }

    #[test]
    fn split_counts_characters_not_bytes() {
        let text = "é".repeat(10);
        let data = TextData::from_text(&text, "accents", 0.7).unwrap();
        assert_eq!((data.train.len(), data.val.len()), (7, 3));
    }

    #[test]
    fn split_rejects_bad_fractions_and_short_text() {
        for fraction in [0.0, 1.0, -0.5, 1.5, f64::NAN] {
            let message = TextData::from_text("abcdefgh", "t", fraction)
                .unwrap_err()
                .to_string();
            assert!(message.contains("strictly between 0 and 1"), "{message}");
        }
        let message = TextData::from_text("abcdefgh", "short", 0.9)
            .unwrap_err()
            .to_string();
        assert!(message.starts_with("text \"short\": "), "{message}");
        assert!(message.contains("at least 16"), "{message}");
        assert!(TextData::from_text(&"x".repeat(16), "ok", 0.9).is_ok());
        assert!(TextData::from_text(&"x".repeat(15), "short", 0.9).is_err());
        assert!(TextData::from_text("", "empty", 0.5).is_err());
    }

    #[test]
    fn min_split_len_is_exact() {
        for fraction in [0.01, 0.1, 0.25, 0.5, 0.9, 0.95, 0.999] {
            let min = min_split_len(fraction);
            let fits = |len: usize| {
                let cut = train_len(len, fraction);
                cut >= MIN_PART && len - cut >= MIN_PART
            };
            assert!(fits(min), "{fraction}: {min}");
            assert!(!fits(min - 1), "{fraction}: {min}");
        }
    }

    #[test]
    fn from_file_names_the_file_and_bad_bytes() {
        let scratch = Scratch::new("file");
        let good = scratch.0.join("poem.txt");
        fs::write(&good, "the quick brown fox jumps over the lazy dog").unwrap();
        let data = TextData::from_file(&good, 0.9).unwrap();
        assert_eq!(data.name, "poem");
        assert_eq!(data.train.len() + data.val.len(), 43);
        assert!(format!("{data:?}").contains("train_len: 39"), "{data:?}");

        let broken = scratch.0.join("broken.txt");
        fs::write(&broken, b"abc\xffdef").unwrap();
        let err = TextData::from_file(&broken, 0.9).unwrap_err();
        assert_eq!(err.path(), Some(broken.as_path()));
        let message = err.to_string();
        assert!(
            message.contains("broken.txt: not valid UTF-8 at byte offset 3"),
            "{message}"
        );

        let empty = scratch.0.join("empty.txt");
        fs::write(&empty, "").unwrap();
        let message = TextData::from_file(&empty, 0.9).unwrap_err().to_string();
        assert!(message.contains("empty.txt: empty"), "{message}");

        let missing = TextData::from_file(&scratch.0.join("absent.txt"), 0.9).unwrap_err();
        assert!(
            missing.to_string().contains("absent.txt: cannot read"),
            "{missing}"
        );
    }

    #[test]
    fn windows_are_deterministic_per_step() {
        let a = window_starts(10_000, 64, 7, 3, 32);
        assert_eq!(a.len(), 32);
        assert_eq!(a, window_starts(10_000, 64, 7, 3, 32));
        assert_ne!(a, window_starts(10_000, 64, 7, 4, 32));
        assert_ne!(a, window_starts(10_000, 64, 8, 3, 32));
        assert!(window_starts(10_000, 64, 7, 3, 0).is_empty());
    }

    #[test]
    fn windows_fit_and_reach_both_ends() {
        let (len, block) = (20, 12);
        let mut seen = [false; 8];
        for step in 0..200 {
            for start in window_starts(len, block, 1, step, 16) {
                // The window covers start..=start + block, so its last token must lie below len.
                assert!(start + block < len, "{start}");
                seen[start] = true;
            }
        }
        // With 3,200 draws over 8 positions every start, including both extremes, turns up.
        assert!(seen.iter().all(|&s| s), "{seen:?}");
        // The tightest case has exactly one valid window.
        assert_eq!(window_starts(13, 12, 5, 9, 4), vec![0; 4]);
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn windows_need_a_longer_stream() {
        window_starts(64, 64, 0, 0, 1);
    }

    #[test]
    fn rank_shares_concatenate_to_the_global_batch() {
        let all = window_starts(5_000, 32, 11, 42, 8);
        for world in [1, 2, 4, 8] {
            let joined: Vec<usize> = (0..world)
                .flat_map(|rank| rank_share(&all, world, rank).to_vec())
                .collect();
            assert_eq!(joined, all, "world {world}");
            assert_eq!(rank_share(&all, world, 0).len(), 8 / world);
        }
        assert_eq!(rank_share(&all, 4, 1), &all[2..4]);
    }

    #[test]
    #[should_panic(expected = "cannot be split evenly")]
    fn rank_share_rejects_uneven_batches() {
        rank_share(&[1, 2, 3], 2, 0);
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn rank_share_rejects_bad_rank() {
        rank_share(&[1, 2], 2, 2);
    }

    #[test]
    fn eval_windows_are_fixed() {
        let a = eval_starts(1_000, 100, 9, 50);
        assert_eq!(a.len(), 50);
        assert_eq!(a, eval_starts(1_000, 100, 9, 50));
        assert_ne!(a, eval_starts(1_000, 100, 10, 50));
        assert!(a.iter().all(|&s| s + 101 <= 1_000));
        // Asking for fewer windows yields a prefix, so a smaller eval set is a subset.
        assert_eq!(eval_starts(1_000, 100, 9, 10), a[..10]);
    }

    #[test]
    fn tiny_shakespeare_url_is_well_formed() {
        assert!(TINY_SHAKESPEARE_URL.starts_with("https://"));
        assert!(TINY_SHAKESPEARE_URL.ends_with("input.txt"));
    }
}
