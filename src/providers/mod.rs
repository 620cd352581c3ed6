//! Provider frames → normalized [`Chunk`]s.
//!
//! One file per wire format: [`openai_chat`] for OpenAI-compatible chat
//! completion chunks (OpenAI, Azure, DeepSeek, Groq, OpenRouter, Gemini,
//! Mistral, vLLM, Ollama's `/v1`…) and [`ollama`] for Ollama's native
//! `/api/chat` NDJSON. Each decodes one frame's data, synchronously, into
//! chunks handed to a callback (no allocation per chunk) and returns a
//! [`FrameInfo`] the encoders need to inject progress into the frame.
//!
//! Decoding reads only what progress needs, with borrowed views: it never
//! builds a `serde_json::Value` of a whole chunk and never re-serializes one.
//!
//! Read [`Provider`] first.

pub mod ollama;
pub mod openai_chat;

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, Visitor};
use serde_json::value::RawValue;

use crate::chunk::{ArgumentsDelta, Chunk};
use crate::framing::Framing;

/// The wire format of a stream's frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    /// `chat.completion.chunk` objects in SSE `data:` events.
    OpenAiChat,
    /// Ollama native `/api/chat` objects, one per NDJSON line.
    OllamaChat,
}

impl Provider {
    /// The provider format a framing carries.
    pub fn for_framing(framing: Framing) -> Provider {
        match framing {
            Framing::Sse => Provider::OpenAiChat,
            Framing::Ndjson => Provider::OllamaChat,
        }
    }
}

/// What a decoder learned about a frame besides its chunks.
#[derive(Debug, Default)]
pub struct FrameInfo<'a> {
    /// The frame is a JSON object (so a key can be added before its last
    /// `}`); false for `[DONE]`.
    pub is_object: bool,
    /// The frame already has a top-level `toolCallProgress` (the stream was
    /// annotated before): nothing is added again.
    pub already_annotated: bool,
    /// A choice of this frame has a `finish_reason`.
    pub finishes: bool,
    /// The frame carries non-null usage.
    pub has_usage: bool,
    /// Top-level `id`, `object`, `created`, `model`, verbatim, for the
    /// `chunk` inject mode.
    pub id: Option<&'a RawValue>,
    pub object: Option<&'a RawValue>,
    pub created: Option<&'a RawValue>,
    pub model: Option<&'a RawValue>,
}

/// Why a frame's data could not be understood. The frame is forwarded
/// unchanged all the same.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("data is not UTF-8 (byte {valid_up_to} of the data)")]
    NotUtf8 { valid_up_to: usize },
    #[error("invalid JSON: {0}")]
    InvalidJson(serde_json::Error),
    #[error("unexpected JSON shape: {0}")]
    UnexpectedShape(serde_json::Error),
}

impl From<serde_json::Error> for FrameError {
    fn from(err: serde_json::Error) -> Self {
        match err.classify() {
            serde_json::error::Category::Data => FrameError::UnexpectedShape(err),
            serde_json::error::Category::Io
            | serde_json::error::Category::Syntax
            | serde_json::error::Category::Eof => FrameError::InvalidJson(err),
        }
    }
}

/// Decodes one frame's data with `provider`'s rules.
pub fn decode<'a>(
    provider: Provider,
    data: &'a [u8],
    state: &mut DecoderState,
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Result<FrameInfo<'a>, FrameError> {
    let data = std::str::from_utf8(data).map_err(|e| FrameError::NotUtf8 {
        valid_up_to: e.valid_up_to(),
    })?;
    match provider {
        Provider::OpenAiChat => openai_chat::decode(data, emit),
        Provider::OllamaChat => ollama::decode(data, state, emit),
    }
}

/// What a decoder must remember between frames.
#[derive(Debug, Default)]
pub struct DecoderState {
    /// Ollama: tool calls seen so far, to number calls that come without an
    /// index.
    pub ollama_calls: u32,
}

// === shared borrowed views ===

/// A JSON string that borrows from the input when it has no escapes.
#[derive(Debug)]
pub(crate) struct JsonStr<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for JsonStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = JsonStr<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(JsonStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(JsonStr(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(JsonStr(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(PhantomData))
    }
}

impl<'a> JsonStr<'a> {
    /// The string, if not empty (SPEC.md: `""` is no value).
    pub fn non_empty(this: Option<JsonStr<'a>>) -> Option<Cow<'a, str>> {
        this.map(|s| s.0).filter(|s| !s.is_empty())
    }
}

/// A tool call's `arguments`: a string fragment or a whole value.
#[derive(Debug)]
pub(crate) struct ArgumentsView<'a>(pub ArgumentsDelta<'a>);

impl<'de: 'a, 'a> Deserialize<'de> for ArgumentsView<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        fn whole<'a, E>(value: serde_json::Value) -> Result<ArgumentsView<'a>, E> {
            Ok(ArgumentsView(ArgumentsDelta::Replace(
                crate::js::stringify_to_string(&value),
            )))
        }
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = ArgumentsView<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a JSON value")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(ArgumentsView(ArgumentsDelta::Append(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ArgumentsView(ArgumentsDelta::Append(Cow::Owned(
                    v.to_owned(),
                ))))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(ArgumentsView(ArgumentsDelta::Append(Cow::Owned(v))))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(ArgumentsView(ArgumentsDelta::Unchanged))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                whole(serde_json::Value::Bool(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                whole(serde_json::Value::from(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                whole(serde_json::Value::from(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                whole(serde_json::Value::from(v))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                whole(serde_json::Value::deserialize(
                    de::value::MapAccessDeserializer::new(map),
                )?)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                whole(serde_json::Value::deserialize(
                    de::value::SeqAccessDeserializer::new(seq),
                )?)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A JSON number that is a non-negative integer fitting `u32` (`1.0`
/// included, as JavaScript's `Number.isInteger` would say); anything else is
/// `None`.
pub(crate) fn raw_u32(raw: Option<&RawValue>) -> Option<u32> {
    raw_u64(raw).and_then(|n| u32::try_from(n).ok())
}

/// A JSON number that is a non-negative integer; anything else is `None`.
pub(crate) fn raw_u64(raw: Option<&RawValue>) -> Option<u64> {
    let text = raw?.get();
    if let Ok(n) = text.parse::<u64>() {
        return Some(n);
    }
    let f = text.parse::<f64>().ok()?;
    (f.fract() == 0.0 && f >= 0.0 && f <= u64::MAX as f64).then_some(f as u64)
}

/// True when a raw value is present and not `null`.
pub(crate) fn is_set(raw: Option<&RawValue>) -> bool {
    raw.is_some_and(|r| r.get() != "null")
}
