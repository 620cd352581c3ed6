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
