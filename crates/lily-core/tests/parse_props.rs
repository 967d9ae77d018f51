//! The stream parsers give the same result however the output is split into chunks, and they
//! recover tool calls exactly as the chat template (rendered by Jinja2) wrote them.

use std::path::PathBuf;

use lily_core::parse::{push_event, Event, OutputParser, ParserConfig};
use proptest::prelude::*;
use serde_json::{json, Value};

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}})
}

/// Each started call's `function.arguments`, as a client puts the streamed fragments together.
fn streamed_arguments(events: &[Event]) -> Vec<String> {
    let mut calls: Vec<String> = Vec::new();
    for e in events {
        match e {
            Event::ToolCallStart { index, .. } => {
                assert_eq!(*index, calls.len(), "indices count up from 0");
                calls.push(String::new());
            }
            Event::ToolCallArguments { index, fragment } => calls[*index].push_str(fragment),
            _ => {}
        }
    }
    calls
}

fn parse(config: &ParserConfig, chunks: &[&str]) -> Vec<Event> {
    let mut p = OutputParser::new(config);
    let mut raw = Vec::new();
    for c in chunks {
        p.push(c, &mut raw);
    }
    p.finish(&mut raw);
    // Neighbouring text events may be split differently; their merged form must agree.
    let mut merged = Vec::new();
    for e in raw {
        push_event(&mut merged, e);
    }
    merged
}

/// Output-like text built from pieces that stress the parsers: tags, partial tags, newlines,
/// multi-byte characters, well-formed and broken tool calls.
fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z 日😀é\n<>/=_]{0,10}",
        Just("<think>".to_string()),
        Just("</think>".to_string()),
        Just("\n\n".to_string()),
        Just("<tool_call>".to_string()),
        Just("</tool_call>".to_string()),
        Just("<tool_".to_string()),
        Just("</thi".to_string()),
        Just("<function=get_weather>\n".to_string()),
        Just("</function>\n".to_string()),
        ("[a-z]{1,6}", "[a-zA-Z0-9 \n{}\":,日]{0,12}").prop_map(|(city, days)| format!(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>"
        )),
    ]
}

fn split(text: &str, cuts: &[usize]) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    cuts.sort_unstable();
    let mut out = Vec::new();
    let mut last = 0;
    for c in cuts.into_iter().chain([chars.len()]) {
        out.push(chars[last..c].iter().collect());
        last = c;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn any_chunking_gives_the_same_events(
        frags in proptest::collection::vec(fragment(), 0..12),
        cuts in proptest::collection::vec(0usize..400, 0..24),
        starts_in_reasoning: bool,
        with_tools: bool,
    ) {
        let text = frags.concat();
        let config = ParserConfig { starts_in_reasoning, tools: with_tools.then(|| vec![weather_tool()]) };
        let whole = parse(&config, &[&text]);
        let chunks = split(&text, &cuts);
        let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
        prop_assert_eq!(parse(&config, &refs), whole.clone());
        // One character at a time, the most extreme split.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        prop_assert_eq!(parse(&config, &refs), whole.clone());
        // Every complete call's fragments concatenate to exactly its arguments string.
        let streamed = streamed_arguments(&whole);
        for e in &whole {
            if let Event::ToolCallEnd(call) = e {
                prop_assert_eq!(&streamed[call.index], &call.arguments_json());
            }
        }
    }

    #[test]
    fn plain_text_without_tags_is_passed_through(text in "[a-zA-Z0-9 .,!?日本😀]{1,60}", cuts in proptest::collection::vec(0usize..80, 0..8)) {
        let config = ParserConfig { starts_in_reasoning: false, tools: Some(vec![weather_tool()]) };
        let chunks = split(&text, &cuts);
        let refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
        prop_assert_eq!(parse(&config, &refs), vec![Event::Content(text.clone())]);
    }
}

#[test]
fn thinking_output_with_a_tool_call_parses_into_all_three_kinds() {
    let config = ParserConfig {
        starts_in_reasoning: true,
        tools: Some(vec![weather_tool()]),
    };
    let out = "I need the weather.\n</think>\n\nLet me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=opts>\n{\"units\": \"metric\"}\n</parameter>\n</function>\n</tool_call>";
    let events = parse(&config, &[out]);
    assert_eq!(events.len(), 8, "{events:?}");
    assert_eq!(events[0], Event::Reasoning("I need the weather.".into()));
    assert_eq!(events[1], Event::Content("Let me look.".into()));
    assert_eq!(
        streamed_arguments(&events),
        vec![r#"{"city":"São Paulo","days":2,"opts":{"units":"metric"}}"#.to_string()]
    );
    let Event::ToolCallEnd(call) = &events[7] else {
        panic!("{events:?}")
    };
    assert_eq!(call.name, "get_weather");
    assert_eq!(
        Value::Object(call.arguments.clone()),
        json!({"city": "São Paulo", "days": 2, "opts": {"units": "metric"}})
    );
}

/// Every assistant tool call in the chat goldens, as Jinja2 rendered it into the prompt, parses
/// back into the name and arguments the request had.
#[test]
fn tool_calls_rendered_by_jinja2_parse_back_to_the_request() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/goldens.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut checked = 0;
    for case in doc["cases"].as_array().unwrap() {
        let (Some(expected), Some(tools)) = (case["expected"].as_str(), case["tools"].as_array())
        else {
            continue;
        };
        let wanted: Vec<&Value> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["tool_calls"].as_array())
            .flatten()
            .collect();
        // Tool calls inside assistant turns only (the system prompt shows an example call).
        let mut found = Vec::new();
        for turn in expected.split("<|im_start|>assistant\n").skip(1) {
            let turn = turn.split("<|im_end|>").next().unwrap();
            let config = ParserConfig {
                starts_in_reasoning: false,
                tools: Some(tools.clone()),
            };
            let body = turn.rsplit("</think>").next().unwrap();
            let events = parse(&config, &[body]);
            let streamed = streamed_arguments(&events);
            found.extend(events.into_iter().filter_map(|e| match e {
                Event::ToolCallEnd(c) => {
                    // What a streaming client assembles is the same call.
                    assert_eq!(streamed[c.index], c.arguments_json());
                    Some(c)
                }
                _ => None,
            }));
        }
        assert_eq!(found.len(), wanted.len(), "{}", case["name"]);
        for (call, want) in found.iter().zip(wanted) {
            let f = want.get("function").unwrap_or(want);
            assert_eq!(call.name, f["name"].as_str().unwrap());
            let args = match &f["arguments"] {
                Value::String(s) => serde_json::from_str::<Value>(s).unwrap(),
                v => v.clone(),
            };
            let schema_props = tools
                .iter()
                .map(|t| t.get("function").unwrap_or(t))
                .find(|t| t["name"] == f["name"])
                .unwrap()["parameters"]["properties"]
                .clone();
            for (k, v) in args.as_object().unwrap() {
                // A null for a parameter whose schema does not allow null reads back as the text
                // "null" (the schema says string); every other value must come back as sent.
                let allows_null = schema_props[k]["type"]
                    .as_array()
                    .is_some_and(|t| t.contains(&json!("null")));
                let want_v = if v.is_null() && !allows_null && schema_props[k]["type"] == "string" {
                    json!("null")
                } else {
                    v.clone()
                };
                assert_eq!(
                    call.arguments.get(k),
                    Some(&want_v),
                    "{} {}.{k}",
                    case["name"],
                    call.name
                );
            }
            assert_eq!(call.arguments.len(), args.as_object().unwrap().len());
            checked += 1;
        }
    }
    assert!(checked >= 12, "only {checked} calls checked");
}
