//! `annotate`: see `aalis_proxy_fuzz::annotate` for what it asserts.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| aalis_proxy_fuzz::annotate(data));
