//! What a person watching sees: progress on stderr. stdout carries data
//! only.
//!
//! - [`spinner`]: one indicatif spinner per in-progress tool, or plain
//!   lines when stderr is not a terminal; [`spinner::status_line`] is the
//!   pure function every line comes from.

pub mod spinner;
