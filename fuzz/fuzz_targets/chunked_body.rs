//! `chunked_body`: see `aalis_proxy_fuzz::chunked_body` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aalis_proxy_fuzz::chunked_body(data));
