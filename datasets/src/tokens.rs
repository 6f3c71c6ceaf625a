//! A text tokenised by character into a file of 16-bit token ids, read window by window: a
//! corpus larger than memory trains without being held in it.
//!
//! [`TokenFile::prepare`] streams the text twice (once for its alphabet, once to write the
//! ids) in 1 MiB pieces, and keeps the result beside a record of the text's size and
//! modification time, so that the next run reuses it and a changed text is tokenised again.
//! The ids are those [`CharTokenizer::from_text`] gives the whole text, so a run that reads
//! from disk sees the same tokens as one that reads the text into memory.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::DatasetError;
use crate::text::CharTokenizer;

const MAGIC: &[u8; 8] = b"KILNTOK1";
const PIECE: usize = 1 << 20;

/// A tokenised text on disk.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    file: File,
    /// Bytes before the first token.
    offset: u64,
    len: usize,
    tokenizer: CharTokenizer,
}

/// The text's size and modification time, which a token file records to know it is current.
fn stamp(text: &Path) -> Result<(u64, u64), DatasetError> {
    let meta = fs::metadata(text).map_err(|e| DatasetError::io(text, "cannot read", e))?;
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64);
    Ok((meta.len(), modified))
}

/// Calls `f` with each piece of the UTF-8 text at `path`, split on character boundaries.
fn for_each_piece(path: &Path, mut f: impl FnMut(&str)) -> Result<(), DatasetError> {
    let mut file = File::open(path).map_err(|e| DatasetError::io(path, "cannot read", e))?;
    let mut buf = vec![0u8; PIECE + 4];
    let (mut held, mut offset, mut any) = (0usize, 0u64, false);
    loop {
        let n = file
            .read(&mut buf[held..held + PIECE])
            .map_err(|e| DatasetError::io(path, "cannot read", e))?;
        let end = held + n;
        if n == 0 && held == 0 {
            break;
        }
        let (text, rest) = match std::str::from_utf8(&buf[..end]) {
            Ok(t) => (t, 0),
            // An incomplete character at the end of the piece waits for the next.
            Err(e) if e.error_len().is_none() && n > 0 => {
                let good = e.valid_up_to();
                (
                    std::str::from_utf8(&buf[..good]).expect("checked up to here"),
                    end - good,
                )
            }
            Err(e) => {
                return Err(DatasetError::BadText {
                    path: Some(path.to_path_buf()),
                    name: path.display().to_string(),
                    reason: format!(
                        "not valid UTF-8 at byte offset {}",
                        offset + e.valid_up_to() as u64
                    ),
                });
            }
        };
        any |= !text.is_empty();
        f(text);
        let used = end - rest;
        offset += used as u64;
        buf.copy_within(used..end, 0);
        held = rest;
        if n == 0 {
            break;
        }
    }
    if !any {
        return Err(DatasetError::BadText {
            path: Some(path.to_path_buf()),
            name: path.display().to_string(),
            reason: "empty, so there is no text to train on".to_string(),
        });
    }
    Ok(())
}

impl TokenFile {
    /// The token file of `text` at `cache`: reused when it records the text's current size
    /// and modification time, otherwise written (through a temporary file, then renamed).
    pub fn prepare(text: &Path, cache: &Path) -> Result<Self, DatasetError> {
        let stamp = stamp(text)?;
        if let Ok(file) = Self::open(cache)
            && file.stamp == stamp
        {
            return Ok(file.inner);
        }
        let mut alphabet = BTreeSet::new();
        for_each_piece(text, |piece| alphabet.extend(piece.chars()))?;
        if alphabet.len() > usize::from(u16::MAX) + 1 {
            return Err(DatasetError::BadText {
                path: Some(text.to_path_buf()),
                name: text.display().to_string(),
                reason: format!(
                    "{} distinct characters; a token file holds at most 65536",
                    alphabet.len()
                ),
            });
        }
        let chars: String = alphabet.iter().collect();
        let tokenizer = CharTokenizer::from_text(&chars);
        let ids: std::collections::HashMap<char, u16> = alphabet
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u16))
            .collect();
        let mut partial = cache.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        if let Some(parent) = cache.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent)
                .map_err(|e| DatasetError::io(parent, "cannot create directory", e))?;
        }
        let write = || -> Result<(), DatasetError> {
            let io = |e| DatasetError::io(&partial, "cannot write", e);
            let mut out = BufWriter::new(File::create(&partial).map_err(io)?);
            let json = tokenizer.to_json();
            out.write_all(MAGIC).map_err(io)?;
            out.write_all(&stamp.0.to_le_bytes()).map_err(io)?;
            out.write_all(&stamp.1.to_le_bytes()).map_err(io)?;
            out.write_all(&(json.len() as u32).to_le_bytes())
                .map_err(io)?;
            out.write_all(json.as_bytes()).map_err(io)?;
            let mut failed = None;
            for_each_piece(text, |piece| {
                if failed.is_some() {
                    return;
                }
                let bytes: Vec<u8> = piece.chars().flat_map(|c| ids[&c].to_le_bytes()).collect();
                if let Err(e) = out.write_all(&bytes) {
                    failed = Some(e);
                }
            })?;
            if let Some(e) = failed {
                return Err(io(e));
            }
            out.into_inner()
                .map_err(|e| io(e.into_error()))?
                .sync_all()
                .map_err(io)?;
            fs::rename(&partial, cache)
                .map_err(|e| DatasetError::io(cache, "cannot rename into", e))
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&partial);
            return Err(e);
        }
        Ok(Self::open(cache)?.inner)
    }

    /// Opens a token file, with the text stamp it records.
    fn open(path: &Path) -> Result<Stamped, DatasetError> {
        let bad =
            |reason: &str| DatasetError::bad(path, format!("not a kiln token file: {reason}"));
        let file = File::open(path).map_err(|e| DatasetError::io(path, "cannot read", e))?;
        let mut head = [0u8; 28];
        file.read_exact_at(&mut head, 0)
            .map_err(|_| bad("shorter than its header"))?;
        if &head[..8] != MAGIC {
            return Err(bad("wrong magic"));
        }
        let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
        let stamp = (word(8), word(16));
        let json_len = u32::from_le_bytes(head[24..28].try_into().expect("4 bytes")) as usize;
        let mut json = vec![0u8; json_len];
        file.read_exact_at(&mut json, 28)
            .map_err(|_| bad("its vocabulary is cut short"))?;
        let json = String::from_utf8(json).map_err(|_| bad("its vocabulary is not UTF-8"))?;
        let tokenizer = CharTokenizer::from_json(&json)?;
        let offset = 28 + json_len as u64;
        let size = file
            .metadata()
            .map_err(|e| DatasetError::io(path, "cannot read", e))?
            .len();
        if size < offset || !(size - offset).is_multiple_of(2) {
            return Err(bad("its token part is not whole 16-bit ids"));
        }
        Ok(Stamped {
            stamp,
            inner: TokenFile {
                path: path.to_path_buf(),
                file,
                offset,
                len: ((size - offset) / 2) as usize,
                tokenizer,
            },
        })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the file holds no tokens (never, once prepared).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tokenizer of the whole text.
    pub fn tokenizer(&self) -> &CharTokenizer {
        &self.tokenizer
    }

    /// Tokens `start .. start + out.len()`, read from the file.
    pub fn read(&self, start: usize, out: &mut [u32]) -> Result<(), DatasetError> {
        if start + out.len() > self.len {
            return Err(DatasetError::bad(
                &self.path,
                format!(
                    "tokens {start}..{} asked for, the file holds {}",
                    start + out.len(),
                    self.len
                ),
            ));
        }
        let mut bytes = vec![0u8; out.len() * 2];
        self.file
            .read_exact_at(&mut bytes, self.offset + 2 * start as u64)
            .map_err(|e| DatasetError::io(&self.path, "cannot read", e))?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = u32::from(u16::from_le_bytes([b[0], b[1]]));
        }
        Ok(())
    }
}

struct Stamped {
    stamp: (u64, u64),
    inner: TokenFile,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::TextData;

    #[test]
    fn a_token_file_reads_the_tokens_of_the_text_in_memory() {
        let dir = std::env::temp_dir().join(format!("kiln-tokens-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        // Multi-byte characters straddle the 1 MiB pieces.
        let text: String = "héllo wörld — ∑ ünïcode\n".repeat(60_000);
        let path = dir.join("t.txt");
        fs::write(&path, &text).unwrap();
        let cache = dir.join("t.kiln-tokens");
        let file = TokenFile::prepare(&path, &cache).unwrap();
        let memory = TextData::from_text(&text, "t", 0.5).unwrap();
        assert_eq!(file.tokenizer(), &memory.tokenizer);
        assert_eq!(file.len(), memory.train.len() + memory.val.len());
        let mut window = vec![0; 300];
        let start = 1_048_000;
        file.read(start, &mut window).unwrap();
        let all: Vec<u32> = memory.train.iter().chain(&memory.val).copied().collect();
        assert_eq!(window, all[start..start + 300]);
        assert!(file.read(file.len() - 1, &mut window).is_err());
        // Reused while the text is unchanged; written again when it changes.
        let before = fs::metadata(&cache).unwrap().modified().unwrap();
        TokenFile::prepare(&path, &cache).unwrap();
        assert_eq!(fs::metadata(&cache).unwrap().modified().unwrap(), before);
        fs::write(&path, "abc").unwrap();
        assert_eq!(TokenFile::prepare(&path, &cache).unwrap().len(), 3);
        fs::write(&path, [b'a', 0xff, b'b']).unwrap();
        let e = TokenFile::prepare(&path, &cache).unwrap_err().to_string();
        assert!(e.contains("byte offset 1"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
