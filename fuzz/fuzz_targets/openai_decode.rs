//! `openai_decode`: see `aalis_proxy_fuzz::openai_decode` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aalis_proxy_fuzz::openai_decode(data));
