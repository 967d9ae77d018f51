//! The chat template rendered by Lily must equal, byte for byte, what HF transformers (Jinja2)
//! renders for the same request. Fixture: tests/fixtures/chat/goldens.json, written by
//! scripts/render_chat_goldens.py (peer render, never our own output).

mod common;

use std::path::PathBuf;

use lily_core::chat::{ChatError, ChatOptions, ChatTemplate};
use serde_json::Value;

use common::tokenizer_dir;

fn goldens() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/goldens.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn render(t: &ChatTemplate, case: &Value) -> Result<String, ChatError> {
    let messages = case["messages"].as_array().unwrap();
    let tools = case["tools"].as_array().map(Vec::as_slice);
    let opts = ChatOptions {
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
        kwargs: case["kwargs"].as_object().unwrap().clone(),
    };
    t.render(messages, tools, &opts)
}

#[test]
fn every_golden_conversation_renders_byte_identical_to_jinja2() {
    let template = ChatTemplate::from_dir(&tokenizer_dir()).unwrap();
    let doc = goldens();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 25, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let got = render(&template, case);
        match (&case["expected"], &case["error"]) {
            (Value::String(want), _) => match got {
                Ok(got) if &got == want => {}
                Ok(got) => failures.push(format!(
                    "{name}: render differs\n--- want\n{want:?}\n--- got\n{got:?}"
                )),
                Err(e) => failures.push(format!("{name}: error {e}")),
            },
            (_, Value::String(want)) => match (got, case["error_from"].as_str()) {
                // The template's own raise_exception message, verbatim.
                (Err(ChatError::Template(msg)), Some("template")) if &msg == want => {}
                // transformers refused the input before rendering; we must refuse it too.
                (Err(ChatError::Invalid(_)), Some("transformers")) => {}
                (got, _) => failures.push(format!("{name}: expected error {want:?}, got {got:?}")),
            },
            _ => panic!("{name}: fixture case has neither expected nor error"),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
}

#[test]
fn template_is_also_read_from_tokenizer_config() {
    let dir = std::env::temp_dir().join(format!("lily-chat-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = std::fs::read_to_string(tokenizer_dir().join("chat_template.jinja")).unwrap();
    let config = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": source});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let template = ChatTemplate::from_dir(&dir).unwrap();
    let doc = goldens();
    let case = &doc["cases"][0];
    assert_eq!(
        render(&template, case).unwrap(),
        case["expected"].as_str().unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_template_error_names_the_files() {
    let dir = std::env::temp_dir().join(format!("lily-chat-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = format!("{:#}", ChatTemplate::from_dir(&dir).unwrap_err());
    assert!(
        err.contains("chat_template.jinja") && err.contains("tokenizer_config.json"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
