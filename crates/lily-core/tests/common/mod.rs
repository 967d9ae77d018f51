//! What the integration tests share: the real Qwen3.6 tokenizer and chat template, from the copy
//! the repository ships (lilycli/tokenizer/), so a checkout needs nothing beside it.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// A directory holding the bundled tokenizer, unpacked: tokenizer.json, tokenizer_config.json,
/// chat_template.jinja, generation_config.json.
///
/// The bundle keeps tokenizer.json xz-compressed. It is unpacked by the code `lily` itself uses
/// (lilycli/bundled_tokenizer.py: every file checked against SHA256SUMS, moved into place
/// atomically) into this build tree's `target/tmp`, once; later calls only check the sums. Python
/// is needed by the test suite anyway (scripts/test.sh), and its standard library decodes xz, so
/// the tests need no Rust xz decoder as a new dependency and the unpacking exists once.
pub fn tokenizer_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(unpack).clone()
}

fn unpack() -> PathBuf {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("lily-test-cache");
    const SCRIPT: &str = "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); \
        from lilycli.bundled_tokenizer import tokenizer_dir; print(tokenizer_dir(Path(sys.argv[2])))";
    let out = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(&repo)
        .arg(&cache)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run python3 to unpack the bundled tokenizer (lilycli/tokenizer/): {e}")
        });
    assert!(
        out.status.success(),
        "python3 could not unpack the bundled tokenizer (lilycli/tokenizer/) into {}:\n{}",
        cache.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}
