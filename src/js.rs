//! JavaScript-compatible measurements of JSON text: `String.length` and
//! `JSON.stringify`.
//!
//! `charsAccumulated` must equal what the Aalis reference front end computes
//! in JavaScript (SPEC.md, "The protocol"): the length of the arguments
//! string in UTF-16 code units, and, when a provider sends arguments as a JSON
//! object (Ollama, some OpenAI-compatible servers), the length of
//! `JSON.stringify(arguments)`. This module reproduces both exactly, number
//! formatting and key order included. It does not parse JSON; callers hand it
//! a [`serde_json::Value`] (parsed with `preserve_order`, so keys keep their
//! wire order).
//!
//! Read [`stringify()`] first.

use serde_json::Value;

/// Length of `s` in UTF-16 code units (JavaScript `String.length`).
///
/// UTF-8 sequences of one to three bytes are one unit; four-byte sequences
/// (astral characters such as `😀`) are a surrogate pair, two units. Counting
/// lead bytes plus four-byte lead bytes needs no decoding.
pub fn utf16_len(s: &str) -> usize {
    s.as_bytes()
        .iter()
        .map(|&b| usize::from((b & 0xC0) != 0x80) + usize::from(b >= 0xF0))
        .sum()
}

/// Serializes `value` exactly as `JSON.stringify(value)` does in JavaScript,
/// appending to `out`.
///
/// Differences from `serde_json::to_string` that this handles:
/// - numbers are printed as JavaScript prints them (`1.0` → `1`,
///   `1e21` → `1e+21`, `0.0000001` → `1e-7`, integers above 2^53 rounded);
/// - object keys that are array indices (`"0"`, `"17"`) come first in
///   ascending order, as in every JavaScript object; other keys keep their
///   order.
pub fn stringify(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => push_number(n, out),
        Value::String(s) => push_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                stringify(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            let mut first = true;
            let mut push_entry = |key: &str, value: &Value, out: &mut String| {
                if !first {
                    out.push(',');
                }
                first = false;
                push_string(key, out);
                out.push(':');
                stringify(value, out);
            };
            // JavaScript orders integer-like keys first, ascending. They are
            // rare in tool arguments, so the common path is one pass.
            let mut index_keys: Vec<(u32, &str, &Value)> = map
                .iter()
                .filter_map(|(k, v)| array_index(k).map(|i| (i, k.as_str(), v)))
                .collect();
            if index_keys.is_empty() {
                for (k, v) in map {
                    push_entry(k, v, out);
                }
            } else {
                index_keys.sort_unstable_by_key(|&(i, _, _)| i);
                for &(_, k, v) in &index_keys {
                    push_entry(k, v, out);
                }
                for (k, v) in map.iter().filter(|(k, _)| array_index(k).is_none()) {
                    push_entry(k, v, out);
                }
            }
            out.push('}');
        }
    }
}

/// `JSON.stringify(value)` as a new string.
pub fn stringify_to_string(value: &Value) -> String {
    let mut out = String::new();
    stringify(value, &mut out);
    out
}

/// `JSON.parse(json)` for `json` that is valid JSON (the caller's parser
/// checked it): serde_json's parse, but for a number past `f64` (`1e400`),
/// which serde_json refuses and JavaScript reads as `Infinity`, which
/// `JSON.stringify` writes `null`: such a number is read as `null`.
pub fn parse(json: &str) -> Result<Value, serde_json::Error> {
    match serde_json::from_str(json) {
        Err(err) if err.to_string().starts_with("number out of range") => {
            serde_json::from_str(&infinite_numbers_as_null(json))
        }
        parsed => parsed,
    }
}

/// `json` with every number outside strings that is infinite as an `f64`
/// written `null`.
fn infinite_numbers_as_null(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    let mut in_string = false;
    let mut escaped = false;
    let mut number_start = None;
    for (at, c) in json.char_indices() {
        if let Some(start) = number_start {
            if matches!(c, '0'..='9' | '-' | '+' | '.' | 'e' | 'E') {
                continue;
            }
            push_number_or_null(&json[start..at], &mut out);
            number_start = None;
        }
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if matches!(c, '0'..='9' | '-') {
            number_start = Some(at);
            continue;
        }
        out.push(c);
    }
    if let Some(start) = number_start {
        push_number_or_null(&json[start..], &mut out);
    }
    out
}

/// `JSON.stringify(JSON.parse(json))` for `json` that is valid JSON (the
/// caller's parser checked it), lone surrogate escapes included: serde_json
/// refuses them (its strings are UTF-8), JavaScript keeps them, and
/// `JSON.stringify` writes each as an escape again (`\ud800`, six units).
/// Such an escape is read as a noncharacter (U+FDD0) and its four hex
/// digits, and written back as the escape, unless `json` holds U+FDD0
/// itself (then serde_json's refusal stands).
pub fn restringify(json: &str) -> Result<String, serde_json::Error> {
    match parse(json) {
        Ok(value) => Ok(stringify_to_string(&value)),
        Err(err) if refused_surrogate(&err) && !holds_lone_mark(json) => {
            let value = parse(&lone_surrogates_marked(json))?;
            Ok(stringify_to_string(&value).replace(LONE, "\\u"))
        }
        Err(err) => Err(err),
    }
}

/// A noncharacter, which stands for a lone surrogate escape's `\u` while
/// serde_json holds the value.
const LONE: char = '\u{FDD0}';

/// Whether `json` holds [`LONE`], as itself or as an escape (in any case;
/// an escaped backslash before `ufdd0` counts too, which only refuses more).
fn holds_lone_mark(json: &str) -> bool {
    json.contains(LONE) || json.to_ascii_lowercase().contains("\\ufdd0")
}

/// serde_json refused a lone surrogate escape.
fn refused_surrogate(err: &serde_json::Error) -> bool {
    let message = err.to_string();
    message.contains("surrogate") || message.starts_with("unexpected end of hex escape")
}

/// `json` with each lone surrogate escape inside its strings written as
/// [`LONE`] and its four hex digits in lower case (as `JSON.stringify`
/// writes them); pairs and every other byte as they were.
fn lone_surrogates_marked(json: &str) -> String {
    let unit = |at: usize| -> Option<u16> {
        let hex = json.get(at..at + 6)?.strip_prefix("\\u")?;
        u16::from_str_radix(hex, 16).ok()
    };
    let mut out = String::with_capacity(json.len());
    let mut in_string = false;
    let mut at = 0;
    while let Some(c) = json[at..].chars().next() {
        if !in_string {
            in_string = c == '"';
            out.push(c);
            at += c.len_utf8();
            continue;
        }
        match c {
            '"' => in_string = false,
            '\\' => {
                let high = unit(at).filter(|u| (0xD800..0xDC00).contains(u));
                let low_after = unit(at + 6).filter(|u| (0xDC00..0xE000).contains(u));
                match (unit(at), high, low_after) {
                    // A pair: both escapes as they were.
                    (_, Some(_), Some(_)) => {
                        out.push_str(&json[at..at + 12]);
                        at += 12;
                    }
                    (Some(u), _, _) if (0xD800..0xE000).contains(&u) => {
                        out.push(LONE);
                        out.push_str(&format!("{u:04x}"));
                        at += 6;
                    }
                    // Any other escape: its two characters (a `\u` escape's
                    // four digits follow as plain characters).
                    _ => {
                        out.push_str(&json[at..at + 2]);
                        at += 2;
                    }
                }
                continue;
            }
            _ => {}
        }
        out.push(c);
        at += c.len_utf8();
    }
    out
}

/// `number` as it is, or `null` when it is infinite as an `f64`.
fn push_number_or_null(number: &str, out: &mut String) {
    if number.parse::<f64>().is_ok_and(f64::is_infinite) {
        out.push_str("null");
    } else {
        out.push_str(number);
    }
}

/// Whether `JSON.stringify(JSON.parse(json))` is `json` itself, for `json`
/// that is valid JSON (the caller's parser checked it): then its length is
/// the stringified length, with nothing parsed or printed.
///
/// Tool arguments as JSON objects come from servers that print them
/// compactly (Ollama's encoder, `serde_json`), so this is the usual case,
/// and it is checked in one pass over the bytes. It holds when there is no
/// whitespace between tokens, strings are escaped only as [`push_string`]
/// escapes them, every number is printed as JavaScript prints it (no
/// exponent, at most 15 significant digits — which a double keeps exactly
/// and prints back unchanged — no trailing zero in a fraction, not `-0`, at
/// most five zeros after `0.`), no key is an array index (JavaScript
/// enumerates those first) or a duplicate (JavaScript keeps one, where it
/// first appeared) and nesting stays under serde's limit. `false` means
/// "not sure": the caller parses and stringifies, which also reports what
/// serde refuses.
pub fn stringifies_to_itself(json: &str) -> bool {
    /// Keys compared for duplicates per object; a bigger object is handed
    /// to the parser (the comparison is quadratic).
    const MAX_KEYS: usize = 32;
    /// Nesting below serde_json's recursion limit (128).
    const MAX_DEPTH: usize = 100;
    let b = json.as_bytes();
    // The keys of the open objects, and where each open container's keys
    // start in it (`None` for an array).
    let mut keys: Vec<&[u8]> = Vec::new();
    let mut open: Vec<Option<usize>> = Vec::new();
    let mut i = 0;
    while let Some(&byte) = b.get(i) {
        match byte {
            b'{' | b'[' => {
                if open.len() == MAX_DEPTH {
                    return false;
                }
                open.push((byte == b'{').then_some(keys.len()));
                i += 1;
            }
            b'}' | b']' => {
                if let Some(Some(first)) = open.pop() {
                    keys.truncate(first);
                }
                i += 1;
            }
            b',' | b':' => i += 1,
            b'"' => {
                let Some(end) = canonical_string_end(b, i) else {
                    return false;
                };
                if b.get(end) == Some(&b':') {
                    let key = &b[i + 1..end - 1];
                    let Some(&Some(first)) = open.last() else {
                        return false;
                    };
                    // An index key has no escape: its raw text is the key.
                    let index = json.get(i + 1..end - 1).and_then(array_index);
                    if index.is_some()
                        || keys.len() - first == MAX_KEYS
                        || keys[first..].contains(&key)
                    {
                        return false;
                    }
                    keys.push(key);
                }
                i = end;
            }
            b't' | b'f' | b'n' => {
                i += match byte {
                    b'f' => 5,
                    _ => 4,
                }
            }
            b'-' | b'0'..=b'9' => {
                let end = b[i..]
                    .iter()
                    .position(|c| !matches!(c, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
                    .map_or(b.len(), |n| i + n);
                if !canonical_number(&b[i..end]) {
                    return false;
                }
                i = end;
            }
            // Whitespace (or anything else): not what JavaScript prints.
            _ => return false,
        }
    }
    true
}

/// The end (past the closing quote) of the string starting at `b[start]`,
/// if each of its escapes is the one [`push_string`] would write.
fn canonical_string_end(b: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    loop {
        i += memchr::memchr2(b'"', b'\\', b.get(i..)?)?;
        if b[i] == b'"' {
            return Some(i + 1);
        }
        match b.get(i + 1)? {
            b'"' | b'\\' | b'n' | b'r' | b't' | b'b' | b'f' => i += 2,
            b'u' => {
                // `\u00XX`, lowercase, only for the control characters
                // without a short escape.
                let hex = b.get(i + 2..i + 6)?;
                let code = match hex {
                    [
                        b'0',
                        b'0',
                        hi @ (b'0' | b'1'),
                        lo @ (b'0'..=b'9' | b'a'..=b'f'),
                    ] => (hi - b'0') * 16 + (*lo as char).to_digit(16)? as u8,
                    _ => return None,
                };
                if matches!(code, 0x08 | 0x09 | 0x0A | 0x0C | 0x0D) {
                    return None;
                }
                i += 6;
            }
            _ => return None,
        }
    }
}

/// A JSON number's text as JavaScript prints the number it stands for; see
/// [`stringifies_to_itself`].
fn canonical_number(raw: &[u8]) -> bool {
    let (negative, n) = match raw.strip_prefix(b"-") {
        Some(n) => (true, n),
        None => (false, raw),
    };
    let (int, frac) = match n.iter().position(|&c| c == b'.') {
        Some(dot) => (&n[..dot], Some(&n[dot + 1..])),
        None => (n, None),
    };
    let digits = |s: &[u8]| !s.is_empty() && s.iter().all(u8::is_ascii_digit);
    if !digits(int) || (int.len() > 1 && int[0] == b'0') {
        return false;
    }
    let Some(frac) = frac else {
        // `-0` prints as `0`.
        return int.len() <= 15 && !(negative && int == b"0");
    };
    if !digits(frac) || frac.last() == Some(&b'0') {
        return false;
    }
    let significant = if int == b"0" {
        let zeros = frac.iter().take_while(|&&c| c == b'0').count();
        if zeros > 5 {
            return false;
        }
        frac.len() - zeros
    } else {
        int.len() + frac.len()
    };
    significant <= 15
}

/// A JSON text as it came, on one line: its raw line breaks can only lie
/// between tokens (inside a string they are escaped), so dropping them
/// keeps the same value, and a line format (or an SSE `data:` line) whole.
pub fn one_line(json: &str) -> impl Iterator<Item = char> + '_ {
    json.chars().filter(|&c| c != '\n' && c != '\r')
}

/// Appends `s` as a JSON string literal, escaped as `JSON.stringify` does
/// (`"`, `\`, and control characters; nothing else, not even `/`).
pub fn push_string(s: &str, out: &mut String) {
    out.push('"');
    // Most strings (tool names) need no escape at all.
    if !s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        out.push_str(s);
        out.push('"');
        return;
    }
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        let escape: &str = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0C => "\\f",
            0x00..=0x1F => "",
            _ => continue,
        };
        out.push_str(&s[start..i]);
        if escape.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xF)]));
        } else {
            out.push_str(escape);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

/// A canonical array index (`"0"`, `"42"`, not `"01"`, at most 2^32 − 2),
/// which JavaScript enumerates before other keys.
fn array_index(key: &str) -> Option<u32> {
    if key.is_empty() || key.len() > 10 || (key.len() > 1 && key.starts_with('0')) {
        return None;
    }
    if !key.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    key.parse::<u32>().ok().filter(|&i| i != u32::MAX)
}

fn push_number(n: &serde_json::Number, out: &mut String) {
    if let Some(i) = n.as_i64() {
        // Exact in a double: print as is. Larger magnitudes round like JS.
        if i.unsigned_abs() <= (1u64 << 53) {
            out.push_str(&i.to_string());
            return;
        }
    } else if let Some(u) = n.as_u64()
        && u <= (1u64 << 53)
    {
        out.push_str(&u.to_string());
        return;
    }
    match n.as_f64() {
        Some(f) => push_f64(f, out),
        None => out.push_str("null"),
    }
}

/// ECMAScript `Number::toString(x)` for a finite double (ECMA-262 §6.1.6.1.20).
fn push_f64(x: f64, out: &mut String) {
    if !x.is_finite() {
        // JSON.stringify prints non-finite numbers as null.
        out.push_str("null");
        return;
    }
    if x == 0.0 {
        out.push('0');
        return;
    }
    if x < 0.0 {
        out.push('-');
    }
    // Rust's `{:e}` prints the shortest digits that round-trip, the same
    // digits ECMAScript requires: "d.ddde±x".
    let sci = format!("{:e}", x.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let k = digits.len() as i64;
    let n = exponent.parse::<i64>().unwrap_or(0) + 1;
    if k <= n && n <= 21 {
        out.push_str(&digits);
        out.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        out.push_str(&digits[..n as usize]);
        out.push('.');
        out.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-n) as usize));
        out.push_str(&digits);
    } else {
        out.push_str(&digits[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if n > 0 { '+' } else { '-' });
        out.push_str(&(n - 1).abs().to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A number past `f64` reads as JavaScript's `Infinity`, which
    /// `JSON.stringify` writes `null`; the same text in a string, and a
    /// number that underflows, are as they were (node:
    /// `{"a":null,"b":[null,2500],"c":"1e400","d":0}`, 44 units). Before,
    /// serde_json refused the value and its frame was undecodable.
    #[test]
    fn a_number_past_f64_parses_as_javascript_does() {
        let json = r#"{"a":1e400,"b":[-1E999,2.5e3],"c":"1e400","d":1e-400,"e\\\"":1}"#;
        let value = parse(json).expect("parses");
        assert_eq!(
            stringify_to_string(&value),
            r#"{"a":null,"b":[null,2500],"c":"1e400","d":0,"e\\\"":1}"#
        );
        assert_eq!(parse("1e400").expect("a number").to_string(), "null");
        assert!(parse("[1e400").is_err());
    }

    /// Lone surrogate escapes, in values and keys, come back as escapes
    /// (in lower case), a pair as its character, as node prints them:
    /// `{"a":"x\ud800y","\udc00k":["😀","\udbff"]}`, 42 units. Before,
    /// serde_json refused the value and its frame was undecodable.
    #[test]
    fn lone_surrogates_restringify_as_javascript_does() {
        let json = r#"{"a":"x\ud800y","\udc00k":["\ud83d\ude00","\uDBFF"]}"#;
        let out = restringify(json).expect("restringified");
        assert_eq!(out, r#"{"a":"x\ud800y","\udc00k":["😀","\udbff"]}"#);
        assert_eq!(utf16_len(&out), 42);
        // An escaped backslash before `u` is no escape: the text as it is.
        assert_eq!(
            restringify(r#"["\\ud800","\ud800"]"#).expect("restringified"),
            r#"["\\ud800","\ud800"]"#
        );
        // The noncharacter that stands for an escape, already there, as
        // itself or escaped: refused (it came back as `\u`, a key merged
        // with another, before a review found it).
        assert!(restringify("[\"\u{FDD0}\",\"\\ud800\"]").is_err());
        assert!(restringify(r#"{"a":"\ud800","k":"\uFDD0"}"#).is_err());
        assert!(restringify(r#"{"\ufdd0d800":1,"\ud800":2}"#).is_err());
    }

    fn js(json: &str) -> String {
        let value: Value = serde_json::from_str(json).expect("test JSON");
        stringify_to_string(&value)
    }

    #[test]
    fn utf16_length_matches_javascript() {
        assert_eq!(utf16_len(""), 0);
        assert_eq!(utf16_len("abc"), 3);
        assert_eq!(utf16_len("é"), 1);
        assert_eq!(utf16_len("東京"), 2);
        assert_eq!(utf16_len("😀"), 2);
        assert_eq!(utf16_len("a😀é東"), 5);
    }

    #[test]
    fn numbers_print_as_javascript_prints_them() {
        // Expected values are what node prints for JSON.stringify(JSON.parse(x)).
        let cases = [
            ("1.0", "1"),
            ("1.50", "1.5"),
            ("-0.0", "0"),
            ("100", "100"),
            ("1e21", "1e+21"),
            ("1e20", "100000000000000000000"),
            ("123456789012345678901234", "1.2345678901234569e+23"),
            ("0.000001", "0.000001"),
            ("0.0000001", "1e-7"),
            ("1.5e-10", "1.5e-10"),
            ("12345678901234567890", "12345678901234567000"),
            ("-9007199254740993", "-9007199254740992"),
            ("9007199254740992", "9007199254740992"),
            ("0.1", "0.1"),
            ("3.14159", "3.14159"),
            ("-2.5E+3", "-2500"),
        ];
        for (input, expected) in cases {
            assert_eq!(js(input), expected, "JSON.stringify({input})");
        }
    }

    #[test]
    fn keys_keep_wire_order_except_array_indices() {
        assert_eq!(js(r#"{"b":1,"a":2}"#), r#"{"b":1,"a":2}"#);
        assert_eq!(
            js(r#"{"b":1,"10":2,"a":3,"2":4,"01":5}"#),
            r#"{"2":4,"10":2,"b":1,"a":3,"01":5}"#
        );
        // A duplicate key keeps its first position and its last value.
        assert_eq!(js(r#"{"a":1,"b":2,"a":3}"#), r#"{"a":3,"b":2}"#);
    }

    #[test]
    fn text_that_stringifies_to_itself_is_recognized() {
        let itself = [
            r#"{"city":"東京","days":10,"ratio":1.75,"metric":true,"notes":"a\nb \"c\" 😀"}"#,
            r#"{"a":[1,-2,0,0.5,-0.25,0.000001,123456789012345,1.23456789012345],"b":{}}"#,
            r#"{"nested":{"a":{"a":{"a":null}}},"a":false,"x":[[],{},"",[{"k":"v"}]]}"#,
            "{\"ctl\":\"\\u0001\\u001f\\b\\f\\t\\r\\\\\",\"del\":\"\u{7f}\",\"slash\":\"a/b\"}",
            r#"{"a":1,"b":{"a":2},"c":[{"a":3},{"a":4}]}"#,
            r#"[1,"x",null]"#,
            "0",
            "-1.5",
        ];
        for json in itself {
            assert!(stringifies_to_itself(json), "{json}");
            assert_eq!(js(json), json);
        }
        // Each differs from what JSON.stringify prints, or might.
        let not_itself = [
            r#"{"a": 1}"#,
            "{\n\"a\":1}",
            r#"{"a":1.0}"#,
            r#"{"a":1.50}"#,
            r#"{"a":1e3}"#,
            r#"{"a":1E3}"#,
            r#"{"a":-0}"#,
            r#"{"a":-0.0}"#,
            r#"{"a":0.0000001}"#,
            r#"{"a":1234567890123456}"#,
            r#"{"a":0.1234567890123456}"#,
            r#"{"a":"\/"}"#,
            r#"{"a":"\u0041"}"#,
            r#"{"a":"\u000a"}"#,
            r#"{"a":"\u001F"}"#,
            r#"{"a":"\ud83d\ude00"}"#,
            r#"{"b":1,"2":2}"#,
            r#"{"0":1}"#,
            r#"{"a":1,"a":2}"#,
            r#"{"a":{"b":1,"b":2}}"#,
        ];
        for json in not_itself {
            assert!(!stringifies_to_itself(json), "{json}");
        }
        // An object with more keys than are compared, and nesting near
        // serde's limit, go to the parser.
        let many: Vec<String> = (0..40).map(|i| format!("\"k{i}\":{i}")).collect();
        let many = format!("{{{}}}", many.join(","));
        assert!(!stringifies_to_itself(&many));
        assert_eq!(js(&many), many);
        let deep = format!("{}{}", "[".repeat(120), "]".repeat(120));
        assert!(!stringifies_to_itself(&deep));
        let shallow = format!("{}{}", "[".repeat(90), "]".repeat(90));
        assert!(stringifies_to_itself(&shallow));
    }

    #[test]
    fn recognized_text_is_what_stringify_prints() {
        // Every pairing of number spellings and strings, as members of an
        // object and an array: whatever is recognized prints back the same.
        let numbers = [
            "0",
            "-0",
            "7",
            "-7",
            "10",
            "1.5",
            "1.50",
            "0.1",
            "0.01",
            "0.000001",
            "0.0000001",
            "123456789012345",
            "1234567890123456",
            "9007199254740993",
            "99.999999999999",
            "0.30000000000000004",
            "1e2",
            "2.5E-3",
            "-0.5",
            "1.0",
            "100.25",
            "-0.000012",
        ];
        let strings = [
            "", "a", "東京", "😀", "a\"b", "\\", "\n\t", "\u{1}", "\u{1f}", "/", "\u{7f}", "12",
        ];
        let mut recognized = 0;
        for (i, n) in numbers.iter().enumerate() {
            for (j, s) in strings.iter().enumerate() {
                let key = serde_json::to_string(strings[(i + j) % strings.len()]).expect("prints");
                let s = serde_json::to_string(s).expect("prints");
                for json in [
                    format!("{{{key}:{s},\"n\":{n}}}"),
                    format!("[{n},{s},{{{key}:[{n}]}}]"),
                ] {
                    if stringifies_to_itself(&json) {
                        assert_eq!(js(&json), json);
                        recognized += 1;
                    }
                }
            }
        }
        assert!(recognized > 200, "{recognized}");
    }

    #[test]
    fn strings_escape_like_json_stringify() {
        assert_eq!(
            js(r#"["a\"b\\c/d\n\u0001\u007f\u00e9\ud83d\ude00"]"#),
            "[\"a\\\"b\\\\c/d\\n\\u0001\u{7f}é😀\"]"
        );
        assert_eq!(
            js(r#"{"x":[true,false,null,{}],"y":[]}"#),
            r#"{"x":[true,false,null,{}],"y":[]}"#
        );
    }
}
