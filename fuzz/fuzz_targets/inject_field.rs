//! `inject_field`: see `aalis_proxy_fuzz::inject_field` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aalis_proxy_fuzz::inject_field(data));
