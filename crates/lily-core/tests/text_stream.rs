//! `TextStream` end to end with the real tokenizer: token ids in, events and finish reasons out.

mod common;

use std::sync::OnceLock;

use lily_core::parse::{push_event, Event, OutputParser, ParserConfig};
use lily_core::stop::FinishReason;
use lily_core::text::{ids, StreamConfig, TextStream, Tokenizer};
use proptest::prelude::*;
use serde_json::{json, Value};

use common::tokenizer_dir;

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_dir(&tokenizer_dir()).unwrap())
}

/// The peer decoder for expectations: the `tokenizers` crate itself.
fn hf() -> &'static tokenizers::Tokenizer {
    static HF: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    HF.get_or_init(|| {
        tokenizers::Tokenizer::from_file(tokenizer_dir().join("tokenizer.json")).unwrap()
    })
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}})
}

/// Feeds `ids` until the stream finishes; returns merged events, the finish reason and how many
/// ids were consumed.
fn run(config: StreamConfig, ids: &[u32]) -> (Vec<Event>, Option<FinishReason>, usize) {
    let mut s = TextStream::new(tokenizer(), config);
    let mut events = Vec::new();
    let mut finish = None;
    let mut used = 0;
    for &id in ids {
        let step = s.push_token(id);
        used += 1;
        for e in step.events {
            push_event(&mut events, e);
        }
        if step.finish.is_some() {
            finish = step.finish;
            break;
        }
    }
    if finish.is_none() {
        let step = s.finish(FinishReason::Length);
        for e in step.events {
            push_event(&mut events, e);
        }
        finish = step.finish;
    }
    (events, finish, used)
}

fn encode(text: &str) -> Vec<u32> {
    tokenizer().encode(text).unwrap()
}

#[test]
fn thinking_output_ends_at_im_end_with_reasoning_and_content() {
    let mut ids = encode("The user greets me.\n</think>\n\nHello 世界 👩‍👩‍👧‍👦!");
    ids.push(ids::IM_END);
    ids.extend(encode("never seen"));
    let config = StreamConfig {
        starts_in_reasoning: true,
        ..StreamConfig::default()
    };
    let (events, finish, used) = run(config, &ids);
    assert_eq!(
        events,
        vec![
            Event::Reasoning("The user greets me.".into()),
            Event::Content("Hello 世界 👩‍👩‍👧‍👦!".into())
        ]
    );
    assert_eq!(finish, Some(FinishReason::Stop));
    assert_eq!(
        used,
        ids.iter().position(|&i| i == ids::IM_END).unwrap() + 1
    );
}

#[test]
fn endoftext_also_ends_generation() {
    let mut ids = encode("Short.");
    ids.push(ids::ENDOFTEXT);
    let (events, finish, _) = run(StreamConfig::default(), &ids);
    assert_eq!(
        (events, finish),
        (
            vec![Event::Content("Short.".into())],
            Some(FinishReason::Stop)
        )
    );
}

#[test]
fn stop_string_spanning_tokens_is_cut_and_not_emitted() {
    let ids = encode("The answer is 42.\nEND_OF_ANSWER and more text");
    let config = StreamConfig {
        stop: vec!["END_OF_ANSWER".into()],
        ..StreamConfig::default()
    };
    // The stop string really spans several tokens.
    let stop_tokens = encode("END_OF_ANSWER");
    assert!(stop_tokens.len() > 1);
    let (events, finish, used) = run(config, &ids);
    assert_eq!(events, vec![Event::Content("The answer is 42.\n".into())]);
    assert_eq!(finish, Some(FinishReason::Stop));
    assert!(used < ids.len());
}

#[test]
fn max_tokens_ends_with_length_and_text_of_exactly_those_tokens() {
    let text = "日本語のテキスト 😀 and emoji 🇫🇷";
    let ids = encode(text);
    for max in 1..ids.len() {
        let config = StreamConfig {
            max_tokens: Some(max),
            ..StreamConfig::default()
        };
        let (events, finish, used) = run(config, &ids);
        assert_eq!((finish, used), (Some(FinishReason::Length), max));
        let want = hf().decode(&ids[..max], true).unwrap();
        let got: String = events
            .iter()
            .map(|e| match e {
                Event::Content(c) => c.as_str(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(got, want, "max_tokens={max}");
    }
}

#[test]
fn tool_call_output_finishes_with_tool_calls() {
    let mut ids = encode("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nKyiv\n</parameter>\n<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>");
    assert!(ids.contains(&ids::TOOL_CALL) && ids.contains(&ids::TOOL_CALL_END));
    ids.push(ids::IM_END);
    let config = StreamConfig {
        tools: Some(vec![weather_tool()]),
        ..StreamConfig::default()
    };
    let (events, finish, _) = run(config, &ids);
    assert_eq!(finish, Some(FinishReason::ToolCalls));
    assert_eq!(events[0], Event::Content("Checking.".into()));
    // Name first, then the arguments one parameter at a time, then the whole call.
    let fragment = |f: &str| Event::ToolCallArguments {
        index: 0,
        fragment: f.into(),
    };
    assert_eq!(
        events[1..5],
        [
            Event::ToolCallStart {
                index: 0,
                name: "get_weather".into()
            },
            fragment(r#"{"city":"Kyiv""#),
            fragment(r#","days":5"#),
            fragment("}"),
        ]
    );
    let Event::ToolCallEnd(call) = &events[5] else {
        panic!("{events:?}")
    };
    assert_eq!(
        (call.index, call.name.as_str(), call.arguments_json()),
        (0, "get_weather", r#"{"city":"Kyiv","days":5}"#.to_string())
    );
    assert_eq!(events.len(), 6);
}

#[test]
fn without_tools_a_tool_call_is_plain_content() {
    let raw = "<tool_call>\n<function=f>\n</function>\n</tool_call>";
    let mut ids = encode(raw);
    ids.push(ids::IM_END);
    let (events, finish, _) = run(StreamConfig::default(), &ids);
    assert_eq!(
        (events, finish),
        (vec![Event::Content(raw.into())], Some(FinishReason::Stop))
    );
}

#[test]
fn special_tokens_other_than_eos_are_not_shown() {
    let mut ids = encode("a");
    ids.push(248053); // <|vision_start|>
    ids.extend(encode("b"));
    let (events, _, _) = run(StreamConfig::default(), &ids);
    assert_eq!(events, vec![Event::Content("ab".into())]);
}

#[test]
fn tokens_after_the_finish_are_ignored() {
    let mut s = TextStream::new(
        tokenizer(),
        StreamConfig {
            max_tokens: Some(1),
            ..StreamConfig::default()
        },
    );
    assert_eq!(
        s.push_token(encode("x")[0]).finish,
        Some(FinishReason::Length)
    );
    assert_eq!(s.push_token(encode("y")[0]), Default::default());
    assert_eq!(s.finish(FinishReason::Stop), Default::default());
    assert_eq!(
        (s.tokens(), s.finish_reason()),
        (1, Some(FinishReason::Length))
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Token by token through the real tokenizer gives what the parser gives for the whole text.
    #[test]
    fn token_stream_equals_whole_text_parse(
        reasoning in "[a-z 日😀\n]{0,20}",
        content in "[a-zA-Z 本🇯🇵\n<>]{0,20}",
        city in "[A-Za-zé ]{1,10}",
        call: bool,
    ) {
        let mut text = format!("{reasoning}\n</think>\n\n{content}");
        if call {
            text.push_str(&format!("\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"));
        }
        let mut ids = encode(&text);
        ids.push(ids::IM_END);
        let tools = Some(vec![weather_tool()]);
        let config = StreamConfig { starts_in_reasoning: true, tools: tools.clone(), ..StreamConfig::default() };
        let (events, finish, _) = run(config, &ids);
        let mut whole = OutputParser::new(&ParserConfig { starts_in_reasoning: true, tools });
        let mut want = Vec::new();
        whole.push(&text, &mut want);
        whole.finish(&mut want);
        let mut merged = Vec::new();
        for e in want {
            push_event(&mut merged, e);
        }
        prop_assert_eq!(events, merged);
        prop_assert_eq!(finish, Some(if call { FinishReason::ToolCalls } else { FinishReason::Stop }));
    }
}

#[test]
fn server_facing_types_can_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Tokenizer>();
    send_sync::<lily_core::chat::ChatTemplate>();
    send::<TextStream>();
    send::<lily_core::sampling::Sampler>();
}
