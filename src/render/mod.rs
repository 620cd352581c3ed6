//! What a person watching sees: progress on stderr. stdout carries data
//! only.
//!
//! - [`spinner`]: one indicatif spinner per in-progress tool, or plain
//!   lines when stderr is not a terminal; [`spinner::status_line`] is the
//!   pure function every line comes from.

pub mod spinner;

/// A character that must not reach a terminal as it is: a control
/// character (escape sequences start with one), a line or paragraph
/// separator (a line break to some terminals), a bidi control that would
/// reorder the line, or an invisible one (zero-width characters, the soft
/// hyphen, tag characters, which can hide text from the reader). Model
/// text and stream excerpts are checked with it before they are printed.
pub fn is_hostile(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00AD}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{2069}'
                | '\u{061C}'
                | '\u{FEFF}'
                | '\u{E0000}'..='\u{E007F}'
        )
}
