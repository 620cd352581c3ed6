//! `ndjson_framing`: see `aalis_proxy_fuzz::ndjson_framing` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aalis_proxy_fuzz::ndjson_framing(data));
