//! The JSON of a character tokenizer (`tokenizer.json` with `kind = "char"`): written by
//! [`crate::text::CharTokenizer`], read back by a strict parser of the subset it uses.

/// Appends `ch` to `out` as a JSON string literal.
pub(crate) fn push_json_char(out: &mut String, ch: char) {
    out.push('"');
    match ch {
        '"' => out.push_str("\\\""),
        '\\' => out.push_str("\\\\"),
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        // JSON forbids raw control characters inside strings, so the rest get \u escapes.
        c if u32::from(c) < 0x20 || c == '\u{7f}' => {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        }
        c => out.push(c),
    }
    out.push('"');
}

/// Parses and validates a character tokenizer's JSON (`kind` must be `expected`), returning
/// its vocabulary or a reason on failure.
pub(crate) fn parse_vocab(text: &str, expected: &str) -> Result<Vec<char>, String> {
    let mut kind = None;
    let mut vocab = None;
    for (key, value) in JsonParser::new(text).document()? {
        match (key.as_str(), value) {
            ("kind" | "vocab", _)
                if (key == "kind" && kind.is_some()) || (key == "vocab" && vocab.is_some()) =>
            {
                return Err(format!("field {key:?} appears twice"));
            }
            ("kind", Value::Str(s)) => kind = Some(s),
            ("kind", Value::List(_)) => return Err("field \"kind\" must be a string".to_string()),
            ("vocab", Value::List(list)) => vocab = Some(list),
            ("vocab", Value::Str(_)) => {
                return Err("field \"vocab\" must be a list of strings".to_string());
            }
            (other, _) => return Err(format!("unknown field {other:?}")),
        }
    }
    let kind = kind.ok_or("missing field \"kind\"")?;
    if kind != expected {
        return Err(format!("kind is {kind:?}, expected {expected:?}"));
    }
    let entries = vocab.ok_or("missing field \"vocab\"")?;
    if entries.is_empty() {
        return Err("the vocabulary is empty".to_string());
    }
    let mut chars: Vec<char> = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        let mut it = entry.chars();
        let ch = match (it.next(), it.next()) {
            (Some(ch), None) => ch,
            _ => {
                return Err(format!(
                    "vocab entry {i} is {entry:?} ({} characters), expected exactly one",
                    entry.chars().count()
                ));
            }
        };
        if let Some(&prev) = chars.last() {
            if ch == prev {
                return Err(format!("vocab entry {i} repeats {ch:?}"));
            }
            if ch < prev {
                return Err(format!(
                    "vocab entry {i} {ch:?} sorts before entry {} {prev:?}; entries must be strictly increasing",
                    i - 1
                ));
            }
        }
        chars.push(ch);
    }
    Ok(chars)
}

/// A field value in a tokenizer file: the format only ever holds strings and lists of them.
enum Value {
    /// A JSON string.
    Str(String),
    /// A JSON array whose elements are all strings.
    List(Vec<String>),
}

/// A strict parser for the subset of JSON a tokenizer file uses: one object whose values are
/// strings or arrays of strings.
///
/// Writing it by hand keeps the crate free of a JSON dependency for a format this small; all
/// string escapes, including surrogate pairs, are handled so that files edited by other tools
/// still load.
struct JsonParser<'a> {
    /// The whole input.
    text: &'a str,
    /// The byte offset of the next unread character.
    pos: usize,
}

impl<'a> JsonParser<'a> {
    /// Starts parsing at the beginning of `text`.
    fn new(text: &'a str) -> Self {
        JsonParser { text, pos: 0 }
    }

    /// Parses the whole input as one object and returns its fields in order.
    fn document(mut self) -> Result<Vec<(String, Value)>, String> {
        self.skip_whitespace();
        self.expect('{')?;
        let mut fields = Vec::new();
        self.skip_whitespace();
        if !self.eat('}') {
            loop {
                self.skip_whitespace();
                let key = self.string()?;
                self.skip_whitespace();
                self.expect(':')?;
                self.skip_whitespace();
                let value = self.value()?;
                fields.push((key, value));
                self.skip_whitespace();
                if self.eat('}') {
                    break;
                }
                self.expect(',')?;
            }
        }
        self.skip_whitespace();
        if self.pos < self.text.len() {
            return Err(format!(
                "unexpected data after the object at byte {}",
                self.pos
            ));
        }
        Ok(fields)
    }

    /// Parses a field value: a string or an array of strings.
    fn value(&mut self) -> Result<Value, String> {
        if !self.eat('[') {
            return self.string().map(Value::Str);
        }
        let mut items = Vec::new();
        self.skip_whitespace();
        if self.eat(']') {
            return Ok(Value::List(items));
        }
        loop {
            self.skip_whitespace();
            items.push(self.string()?);
            self.skip_whitespace();
            if self.eat(']') {
                return Ok(Value::List(items));
            }
            self.expect(',')?;
        }
    }

    /// Parses a string literal, decoding its escapes.
    fn string(&mut self) -> Result<String, String> {
        self.expect('"')?;
        let mut out = String::new();
        loop {
            let start = self.pos;
            let ch = self
                .next_char()
                .ok_or_else(|| format!("unterminated string starting before byte {start}"))?;
            match ch {
                '"' => return Ok(out),
                '\\' => out.push(self.escape()?),
                c if u32::from(c) < 0x20 => {
                    return Err(format!("raw control character in a string at byte {start}"));
                }
                c => out.push(c),
            }
        }
    }

    /// Decodes the escape sequence after a backslash.
    fn escape(&mut self) -> Result<char, String> {
        let at = self.pos;
        let decoded = match self.next_char() {
            Some('"') => '"',
            Some('\\') => '\\',
            Some('/') => '/',
            Some('b') => '\u{8}',
            Some('f') => '\u{c}',
            Some('n') => '\n',
            Some('r') => '\r',
            Some('t') => '\t',
            Some('u') => {
                let high = self.hex4()?;
                let code = if (0xD800..0xDC00).contains(&high) {
                    // A character beyond the Basic Multilingual Plane arrives as a surrogate
                    // pair, and only the pair together names a scalar value.
                    if !(self.eat('\\') && self.eat('u')) {
                        return Err(format!("unpaired surrogate escape at byte {at}"));
                    }
                    let low = self.hex4()?;
                    if !(0xDC00..0xE000).contains(&low) {
                        return Err(format!("unpaired surrogate escape at byte {at}"));
                    }
                    0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)
                } else {
                    high
                };
                char::from_u32(code)
                    .ok_or_else(|| format!("escape at byte {at} is not a valid character"))?
            }
            _ => return Err(format!("invalid escape at byte {at}")),
        };
        Ok(decoded)
    }

    /// Reads four hexadecimal digits.
    fn hex4(&mut self) -> Result<u32, String> {
        let digits = self
            .text
            .get(self.pos..self.pos + 4)
            .filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| format!("expected four hex digits at byte {}", self.pos))?;
        self.pos += 4;
        Ok(u32::from_str_radix(digits, 16).expect("four hex digits fit in u32"))
    }

    /// Consumes and returns the next character, if any.
    fn next_char(&mut self) -> Option<char> {
        let ch = self.text[self.pos..].chars().next()?;
        self.pos += ch.len_utf8();
        Some(ch)
    }

    /// Consumes `ch` if it is next, reporting whether it was.
    fn eat(&mut self, ch: char) -> bool {
        if self.text[self.pos..].starts_with(ch) {
            self.pos += ch.len_utf8();
            true
        } else {
            false
        }
    }

    /// Consumes `ch`, or fails naming what was found instead.
    fn expect(&mut self, ch: char) -> Result<(), String> {
        if self.eat(ch) {
            return Ok(());
        }
        match self.text[self.pos..].chars().next() {
            Some(found) => Err(format!(
                "expected {ch:?} at byte {}, found {found:?}",
                self.pos
            )),
            None => Err(format!(
                "expected {ch:?} at byte {}, found the end",
                self.pos
            )),
        }
    }

    /// Skips the four whitespace characters JSON allows between tokens.
    fn skip_whitespace(&mut self) {
        let rest = &self.text[self.pos..];
        let trimmed = rest.trim_start_matches([' ', '\t', '\n', '\r']);
        self.pos += rest.len() - trimmed.len();
    }
}
