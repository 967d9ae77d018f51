//! Lily's tokenizer against the Python `tokenizers` package (fixture written by
//! scripts/render_tokenizer_goldens.py), and its streaming detokeniser against full decodes.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use lily_core::text::{ids, Tokenizer};
use serde_json::Value;

use common::tokenizer_dir;

/// The 20 MB tokenizer.json is loaded once per test binary.
fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_dir(&tokenizer_dir()).unwrap())
}

fn fixture(rel: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Concatenated DecodeStream output for `ids` (flushing at the end).
fn stream_decode(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> (String, Vec<String>) {
    let mut s = tok.decode_stream(skip_special);
    let mut deltas: Vec<String> = ids.iter().map(|&id| s.step(id)).collect();
    deltas.push(s.flush());
    (deltas.concat(), deltas)
}

#[test]
fn encode_and_decode_match_python_tokenizers() {
    let tok = tokenizer();
    let doc = fixture("tokenizer/goldens.json");
    assert_eq!(
        tok.vocab_size() as u64,
        doc["vocab_size_with_added"].as_u64().unwrap()
    );
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let want = ids_of(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), want, "{name}: encode");
        assert_eq!(
            tok.decode(&want, false),
            case["decoded"].as_str().unwrap(),
            "{name}: decode"
        );
        assert_eq!(
            tok.decode(&want, true),
            case["decoded_skip_special"].as_str().unwrap(),
            "{name}: decode skip"
        );
    }
}

#[test]
fn streaming_decode_equals_full_decode_and_never_splits_a_character() {
    let tok = tokenizer();
    let doc = fixture("tokenizer/goldens.json");
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let ids = ids_of(&case["ids"]);
        for skip in [false, true] {
            let (joined, deltas) = stream_decode(tok, &ids, skip);
            let want = if skip {
                &case["decoded_skip_special"]
            } else {
                &case["decoded"]
            };
            assert_eq!(joined, want.as_str().unwrap(), "{name} skip={skip}");
            // No delta carries a replacement character the full text does not have.
            if !joined.contains('\u{FFFD}') {
                assert!(
                    deltas.iter().all(|d| !d.contains('\u{FFFD}')),
                    "{name}: {deltas:?}"
                );
            }
        }
    }
}

#[test]
fn emoji_split_over_several_tokens_arrives_whole() {
    let tok = tokenizer();
    let doc = fixture("tokenizer/goldens.json");
    let case = doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "emoji")
        .unwrap();
    let ids = ids_of(&case["ids"]);
    let mut s = tok.decode_stream(false);
    let mut silent = 0;
    for &id in &ids {
        let d = s.step(id);
        if d.is_empty() {
            silent += 1;
        }
    }
    // The fixture's emoji need more than one token each: some steps must have held bytes back.
    assert!(silent > 0, "no token was a partial character");
    assert!(!s.has_pending());
}

#[test]
fn chat_prompts_tokenize_like_transformers() {
    let tok = tokenizer();
    let doc = fixture("chat/goldens.json");
    let mut n = 0;
    for case in doc["cases"].as_array().unwrap() {
        if let (Some(text), Some(want)) = (case["expected"].as_str(), case.get("expected_ids")) {
            assert_eq!(tok.encode(text).unwrap(), ids_of(want), "{}", case["name"]);
            n += 1;
        }
    }
    assert!(n >= 25);
}

#[test]
fn special_token_ids_match_model_md() {
    let tok = tokenizer();
    for (text, id) in [
        ("<|endoftext|>", ids::ENDOFTEXT),
        ("<|im_start|>", ids::IM_START),
        ("<|im_end|>", ids::IM_END),
        ("<tool_call>", ids::TOOL_CALL),
        ("</tool_call>", ids::TOOL_CALL_END),
        ("<tool_response>", ids::TOOL_RESPONSE),
        ("</tool_response>", ids::TOOL_RESPONSE_END),
        ("<think>", ids::THINK),
        ("</think>", ids::THINK_END),
    ] {
        assert_eq!(tok.token_to_id(text), Some(id), "{text}");
    }
    assert!(tok.is_special(ids::IM_END) && tok.is_special(ids::ENDOFTEXT));
    assert!(!tok.is_special(ids::THINK) && !tok.is_special(ids::TOOL_CALL));
    // MODEL.md §4 sanity ids.
    assert_eq!(
        tok.encode("<|im_start|>assistant\n<think>\n").unwrap(),
        vec![248045, 74455, 198, 248068, 198]
    );
}

#[test]
fn random_id_sequences_decode_like_hf_tokenizers() {
    // Arbitrary ids (regular, added, out-of-vocabulary padding rows) from a fixed LCG: our full
    // decode and our stream must both equal the `tokenizers` crate's own decode (the peer), even
    // where tokens are fragments of multi-byte characters.
    let tok = tokenizer();
    let hf = tokenizers::Tokenizer::from_file(tokenizer_dir().join("tokenizer.json")).unwrap();
    let mut x: u64 = 0x1234_5678_9abc_def0;
    for _ in 0..200 {
        let ids: Vec<u32> = (0..30)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % 248_320) as u32
            })
            .collect();
        for skip in [false, true] {
            let want = hf.decode(&ids, skip).unwrap();
            assert_eq!(tok.decode(&ids, skip), want);
            assert_eq!(stream_decode(tok, &ids, skip).0, want);
        }
    }
}

#[test]
fn loading_errors_name_the_file() {
    let missing = std::env::temp_dir().join("lily-no-such-dir");
    let err = format!("{:#}", Tokenizer::from_dir(&missing).unwrap_err());
    assert!(err.contains("lily-no-such-dir/tokenizer.json"), "{err}");
    let bad = std::env::temp_dir().join(format!("lily-bad-tokenizer-{}.json", std::process::id()));
    std::fs::write(&bad, "{\"not\": \"a tokenizer\"}").unwrap();
    let err = format!("{:#}", Tokenizer::from_file(&bad).unwrap_err());
    assert!(
        err.contains(&*bad.to_string_lossy()) && err.contains("not a valid tokenizer.json"),
        "{err}"
    );
    std::fs::remove_file(&bad).unwrap();
}
