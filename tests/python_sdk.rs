//! The real client (issue 3): the official OpenAI Python SDK streams a
//! parallel tool call through `serve` from `mock`, and reads the progress
//! from `chunk.model_extra["toolCallProgress"]`. The checks are in
//! `tests/python/test_openai_sdk.py`; this test runs it against the binary
//! cargo built, so `cargo test` runs every test.
//!
//! It needs the SDK: `python3 -m pip install 'openai>=1.40,<3'` (`.ci/run`
//! and the README's test command install it). Without it the test fails and
//! says so; it never skips silently.

use std::path::Path;
use std::process::Command;

#[test]
fn the_openai_python_sdk_streams_through_the_proxy() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_openai_sdk.py");
    let output = Command::new("python3")
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_aalis-proxy"))
        .env_remove("RUST_LOG")
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let hint = if stderr.contains("No module named") {
        "\nthe SDK is missing: python3 -m pip install 'openai>=1.40,<3'"
    } else {
        ""
    };
    assert!(
        output.status.success(),
        "the SDK test failed ({}):\n{stdout}\n{stderr}{hint}",
        output.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(
        last.contains(" passed, 0 failed") && !last.starts_with("0 passed"),
        "unexpected summary {last:?}:\n{stdout}"
    );
}
