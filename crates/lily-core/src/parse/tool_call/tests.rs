use std::collections::HashMap;

use serde_json::json;

use super::*;

fn weather_tools() -> ToolSchemas {
    ToolSchemas::from_tools(&[
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "threshold": {"type": "number"},
                "detailed": {"type": "boolean"},
                "tags": {"type": "array"},
                "options": {"type": "object"},
                "mode": {"type": ["string", "null"]},
                "either": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}
            }
        }}}),
        json!({"type": "function", "function": {"name": "now"}}),
    ])
}

/// All events, neighbouring content merged.
fn events(schemas: ToolSchemas, pieces: &[&str]) -> Vec<Event> {
    let mut p = ToolCallParser::new(schemas);
    let mut raw = Vec::new();
    for s in pieces {
        p.push(s, &mut raw);
    }
    p.finish(&mut raw);
    let mut out = Vec::new();
    for e in raw {
        push_event(&mut out, e);
    }
    out
}

/// Text and complete calls (what a non-streamed answer shows); checks on the way that every
/// complete call's fragments concatenate to its `arguments_json()`.
fn run(schemas: ToolSchemas, pieces: &[&str]) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut args: HashMap<usize, (String, usize)> = HashMap::new();
    for e in events(schemas, pieces) {
        match e {
            Event::Content(t) => match out.last_mut() {
                Some(Piece::Text(s)) => s.push_str(&t),
                _ => out.push(Piece::Text(t)),
            },
            Event::ToolCallArguments { index, fragment } => {
                let (s, n) = args.entry(index).or_default();
                s.push_str(&fragment);
                *n += 1;
            }
            Event::ToolCallEnd(call) => {
                let (streamed, fragments) = &args[&call.index];
                // A repeated parameter is sent twice; a JSON parser keeps the last value, as
                // the whole call does. Otherwise the strings are the same.
                let parsed: Value = serde_json::from_str(streamed).unwrap();
                assert_eq!(parsed, Value::Object(call.arguments.clone()));
                if *fragments == call.arguments.len() + 1 {
                    assert_eq!(*streamed, call.arguments_json());
                }
                out.push(Piece::Call(call));
            }
            Event::ToolCallStart { .. } | Event::Reasoning(_) => {}
        }
    }
    out
}

#[derive(Debug, PartialEq)]
enum Piece {
    Text(String),
    Call(ToolCall),
}

fn text(s: &str) -> Piece {
    Piece::Text(s.into())
}

#[test]
fn arguments_are_typed_by_the_schema() {
    let out = run(
        weather_tools(),
        &["<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n<parameter=days>\n3\n</parameter>\n",
          "<parameter=threshold>\n0.5\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n",
          "<parameter=options>\n{\"x\": {\"y\": null}}\n</parameter>\n<parameter=mode>\nnull\n</parameter>\n<parameter=either>\nfalse\n</parameter>\n</function>\n</tool_call>"],
    );
    let want = json!({"city": "007", "days": 3, "threshold": 0.5, "detailed": true, "tags": ["a", 1],
                      "options": {"x": {"y": null}}, "mode": null, "either": false});
    assert_eq!(
        out,
        vec![Piece::Call(ToolCall {
            index: 0,
            name: "get_weather".into(),
            arguments: want.as_object().unwrap().clone(),
        })]
    );
}

#[test]
fn multi_line_strings_are_kept_verbatim() {
    let code = "def f(x):\n    return x  # </param\n\n";
    let out = run(
        ToolSchemas::from_tools(&[json!({"name": "write", "parameters": {"properties": {"body": {"type": "string"}}}})]),
        &[&format!("<tool_call>\n<function=write>\n<parameter=body>\n{code}\n</parameter>\n</function>\n</tool_call>")],
    );
    let Piece::Call(call) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(call.arguments["body"], json!(code));
}

#[test]
fn unknown_parameters_are_json_if_they_parse() {
    assert_eq!(typed_value("42", None), json!(42));
    assert_eq!(typed_value("[1, 2]", None), json!([1, 2]));
    assert_eq!(typed_value("hello world", None), json!("hello world"));
    // A number where the schema wants one but the model wrote words: kept as the string.
    assert_eq!(
        typed_value("three", Some(&json!({"type": "integer"}))),
        json!("three")
    );
    assert_eq!(
        typed_value("True", Some(&json!({"type": "boolean"}))),
        json!(true)
    );
}

#[test]
fn content_before_and_between_calls() {
    let call = |c: &str| {
        format!("<tool_call>\n<function=get_weather>\n<parameter=city>\n{c}\n</parameter>\n</function>\n</tool_call>")
    };
    let out = run(
        weather_tools(),
        &[&format!(
            "Checking both.\n\n{}\n{}",
            call("Paris"),
            call("Rome")
        )],
    );
    assert_eq!(out.len(), 3, "{out:?}");
    assert_eq!(out[0], text("Checking both."));
    let (Piece::Call(a), Piece::Call(b)) = (&out[1], &out[2]) else {
        panic!("{out:?}")
    };
    assert_eq!((a.index, b.index), (0, 1));
    assert_eq!(
        (&a.arguments["city"], &b.arguments["city"]),
        (&json!("Paris"), &json!("Rome"))
    );
    assert_eq!(a.arguments_json(), r#"{"city":"Paris"}"#);
}

#[test]
fn malformed_call_degrades_to_text() {
    let raw = "<tool_call>\nnot a function\n</tool_call>";
    assert_eq!(run(weather_tools(), &[raw]), vec![text(raw)]);
    let raw = "<tool_call>\n<function=f>\n<parameter=x\n1\n</function>\n</tool_call>";
    assert_eq!(run(weather_tools(), &[raw]), vec![text(raw)]);
    let raw = "<tool_call>\n<function=now>\n<parameter=x>\n1\n</parameter>\ntrailing junk\n</function>\n</tool_call>";
    assert_eq!(run(weather_tools(), &[raw]), vec![text(raw)]);
}

#[test]
fn truncated_call_degrades_to_text() {
    let raw = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
    assert_eq!(
        run(weather_tools(), &["ok ", raw]),
        vec![text(&format!("ok {raw}"))]
    );
}

#[test]
fn call_without_closing_tool_call_tag_counts_when_function_closed() {
    let out = run(weather_tools(), &["<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"]);
    assert!(
        matches!(&out[..], [Piece::Call(c)] if c.arguments["city"] == "Oslo"),
        "{out:?}"
    );
}

#[test]
fn missing_parameter_close_tag_is_tolerated() {
    let out = run(weather_tools(), &["<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>\n</tool_call>"]);
    let [Piece::Call(c)] = &out[..] else {
        panic!("{out:?}")
    };
    assert_eq!(
        c.arguments,
        json!({"city": "Oslo", "days": 2})
            .as_object()
            .unwrap()
            .clone()
    );
}

#[test]
fn partial_tag_in_text_is_released_when_it_is_not_a_tag() {
    assert_eq!(
        run(weather_tools(), &["a <tool", "_c", "at>"]),
        vec![text("a <tool_cat>")]
    );
}

fn start(index: usize, name: &str) -> Event {
    Event::ToolCallStart {
        index,
        name: name.into(),
    }
}

fn args(index: usize, fragment: &str) -> Event {
    Event::ToolCallArguments {
        index,
        fragment: fragment.into(),
    }
}

fn content(s: &str) -> Event {
    Event::Content(s.into())
}

/// Feeds pieces one by one and returns what each push gave.
fn per_push(pieces: &[&str]) -> Vec<Vec<Event>> {
    let mut p = ToolCallParser::new(weather_tools());
    let mut steps: Vec<Vec<Event>> = pieces
        .iter()
        .map(|s| {
            let mut out = Vec::new();
            p.push(s, &mut out);
            out
        })
        .collect();
    let mut last = Vec::new();
    p.finish(&mut last);
    steps.push(last);
    steps
}

#[test]
fn name_and_each_argument_are_sent_as_soon_as_they_are_read() {
    let steps = per_push(&[
        "Sure.\n\n<tool_call>\n<function=get_wea",
        "ther>\n<parameter=city>\nPa",
        "ris\n</parameter>\n<parameter=days>\n3\n</param",
        "eter>\n<parameter=detailed>\ntrue\n</parameter>\n",
        "</function>\n</tool_call>",
    ]);
    let want: Vec<Vec<Event>> = vec![
        vec![content("Sure.")],
        vec![start(0, "get_weather")],
        vec![args(0, r#"{"city":"Paris""#)],
        vec![args(0, r#","days":3"#), args(0, r#","detailed":true"#)],
        vec![
            args(0, "}"),
            Event::ToolCallEnd(ToolCall {
                index: 0,
                name: "get_weather".into(),
                arguments: json!({"city": "Paris", "days": 3, "detailed": true})
                    .as_object()
                    .unwrap()
                    .clone(),
            }),
        ],
        vec![],
    ];
    assert_eq!(steps, want);
}

#[test]
fn fragments_are_json_text_of_each_pair() {
    // Quotes, backslashes, newlines and non-ASCII in a string value are escaped as JSON;
    // `{"type": "object"}` values keep their key order.
    let out = events(
        weather_tools(),
        &["<tool_call>\n<function=get_weather>\n<parameter=city>\nSão \"P\"\\\n2\n</parameter>\n<parameter=options>\n{\"z\": 1, \"a\": [null]}\n</parameter>\n</function>\n</tool_call>"],
    );
    assert_eq!(
        out[..3],
        [
            start(0, "get_weather"),
            args(0, r#"{"city":"São \"P\"\\\n2""#),
            args(0, r#","options":{"z":1,"a":[null]}"#),
        ]
    );
    assert_eq!(out[3], args(0, "}"));
}

#[test]
fn a_call_without_arguments_sends_an_empty_object() {
    let out = events(
        weather_tools(),
        &["<tool_call>\n<function=now>\n</function>\n</tool_call>"],
    );
    assert_eq!(out[..2], [start(0, "now"), args(0, "{}")]);
    assert!(matches!(&out[2], Event::ToolCallEnd(c) if c.arguments.is_empty()));
    assert_eq!(out.len(), 3);
}

#[test]
fn nothing_is_sent_before_the_header_is_certain() {
    let steps = per_push(&["<tool_call>\n<func", "tion=get_weather\n", "<parameter"]);
    assert_eq!(steps[0], vec![]);
    assert_eq!(steps[1], vec![]);
    // The name held a newline and then `<`: not a call; the text passes on.
    assert_eq!(
        steps[2],
        vec![content("<tool_call>\n<function=get_weather\n<parameter")]
    );
}

#[test]
fn a_call_that_breaks_after_its_start_is_left_open_and_its_text_follows() {
    let raw = "<tool_call>\n<function=now>\n<parameter=x>\n1\n</parameter>\ntrailing junk\n</function>\n</tool_call>";
    let mut p = ToolCallParser::new(weather_tools());
    let mut out = Vec::new();
    p.push(raw, &mut out);
    p.push("\nafter", &mut out);
    p.finish(&mut out);
    assert_eq!(
        out,
        vec![
            start(0, "now"),
            args(0, r#"{"x":1"#),
            content(&format!("{raw}after"))
        ]
    );
    assert_eq!(p.calls(), 0);
}

#[test]
fn a_call_to_an_undeclared_function_is_text() {
    let raw = "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>";
    for split in [raw.len(), 20, 7] {
        let (a, b) = raw.split_at(split.min(raw.len()));
        let out = events(weather_tools(), &["Sure. ", a, b]);
        assert_eq!(
            out,
            vec![content(&format!("Sure. {raw}"))],
            "split at {split}"
        );
    }
    // The same call to a declared function is one.
    let declared = raw.replace("rm_rf", "now");
    let out = events(weather_tools(), &[&declared]);
    assert!(matches!(out.last(), Some(Event::ToolCallEnd(c)) if c.name == "now"));
}

#[test]
fn a_broken_call_keeps_its_index() {
    let good = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>";
    let bad = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\noops</tool_call>";
    let mut p = ToolCallParser::new(weather_tools());
    let mut out = Vec::new();
    p.push(&format!("{bad}\n{good}"), &mut out);
    p.finish(&mut out);
    assert_eq!(
        out[..3],
        [
            start(0, "get_weather"),
            args(0, r#"{"city":"Oslo""#),
            content(bad)
        ]
    );
    assert_eq!(out[3], start(1, "get_weather"));
    assert!(matches!(out.last(), Some(Event::ToolCallEnd(c)) if c.index == 1));
    assert_eq!(p.calls(), 1);
}

#[test]
fn truncated_after_start_sends_the_raw_call_as_content() {
    let raw = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2";
    assert_eq!(
        events(weather_tools(), &[raw]),
        vec![
            start(0, "get_weather"),
            args(0, r#"{"city":"Oslo""#),
            content(raw)
        ]
    );
}

#[test]
fn a_complete_call_stands_when_its_block_then_breaks() {
    let out = run(
        weather_tools(),
        &["<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\njunk\n</tool_call>"],
    );
    assert!(
        matches!(&out[0], Piece::Call(c) if c.arguments["city"] == "Oslo"),
        "{out:?}"
    );
    assert_eq!(out[1], text("\njunk\n</tool_call>"));
}

/// The whole-block parser this streaming one replaced, kept as the reference for what a complete
/// block means (the streamed calls must be exactly these).
fn whole_block(inner: &str, schemas: &ToolSchemas) -> Option<Vec<(String, Map<String, Value>)>> {
    let mut calls = Vec::new();
    let mut rest = inner.trim_start();
    while !rest.is_empty() {
        let after = rest.strip_prefix(FUNCTION)?;
        let name_end = after.find('>')?;
        let name = tag_name(&after[..name_end])?;
        let mut body = &after[name_end + 1..];
        let mut args = Map::new();
        loop {
            body = body.trim_start();
            if let Some(r) = body.strip_prefix(FUNCTION_END) {
                rest = r.trim_start();
                break;
            }
            let after = body.strip_prefix(PARAMETER)?;
            let pname_end = after.find('>')?;
            let pname = tag_name(&after[..pname_end])?;
            let value_and_rest = &after[pname_end + 1..];
            let (raw, next) = match value_and_rest.find(PARAMETER_END) {
                Some(end) => (
                    &value_and_rest[..end],
                    &value_and_rest[end + PARAMETER_END.len()..],
                ),
                None => {
                    let end = [PARAMETER, FUNCTION_END]
                        .iter()
                        .filter_map(|t| value_and_rest.find(t))
                        .min()?;
                    (&value_and_rest[..end], &value_and_rest[end..])
                }
            };
            let raw = raw.strip_prefix('\n').unwrap_or(raw);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            args.insert(
                pname.to_owned(),
                typed_value(raw, schemas.param(name, pname)),
            );
            body = next;
        }
        calls.push((name.to_owned(), args));
    }
    (!calls.is_empty()).then_some(calls)
}

fn block_part() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    prop_oneof![
        Just("\n".to_string()),
        Just(" ".to_string()),
        Just("<function=get_weather>".to_string()),
        Just("<function=f\ng>".to_string()),
        Just("<function=".to_string()),
        Just("</function>".to_string()),
        Just("<parameter=city>".to_string()),
        Just("<parameter=days>".to_string()),
        Just("<parameter=tags>".to_string()),
        Just("<parameter=".to_string()),
        Just("</parameter>".to_string()),
        Just("</param".to_string()),
        "[a-z0-9 \n\\[\\]{}\":,<>/=日]{0,8}",
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

    /// A closed block gives exactly the whole-block parser's calls, streamed in any chunking;
    /// a block that did not parse gives its text back (after any call it completed first).
    #[test]
    fn streamed_calls_match_the_whole_block_parser(
        parts in proptest::collection::vec(block_part(), 0..14),
        well_formed in proptest::bool::ANY,
        cut in 0usize..200,
    ) {
        let inner = if well_formed {
            format!("\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n<parameter=days>\n{}\n</parameter>\n</function>\n",
                    parts.concat(), parts.len())
        } else {
            parts.concat()
        };
        let raw = format!("<tool_call>{inner}</tool_call>");
        let cut = raw.char_indices().map(|(i, _)| i).nth(cut).unwrap_or(raw.len());
        let out = run(weather_tools(), &[&raw[..cut], &raw[cut..]]);
        let calls: Vec<(String, Map<String, Value>)> = out.iter().filter_map(|p| match p {
            Piece::Call(c) => Some((c.name.clone(), c.arguments.clone())),
            Piece::Text(_) => None,
        }).collect();
        let texts: Vec<&String> = out.iter().filter_map(|p| match p {
            Piece::Text(t) => Some(t),
            Piece::Call(_) => None,
        }).collect();
        match whole_block(&inner, &weather_tools()) {
            Some(want) => {
                proptest::prop_assert_eq!(calls, want);
                proptest::prop_assert!(texts.is_empty());
            }
            None if calls.is_empty() => proptest::prop_assert_eq!(texts, vec![&raw]),
            None => {
                proptest::prop_assert_eq!(texts.len(), 1);
                proptest::prop_assert!(raw.ends_with(texts[0].as_str()));
            }
        }
    }
}

#[test]
fn a_name_running_onto_a_second_line_is_text_at_once() {
    let steps = per_push(&["<tool_call>\n<function=get weather\n", "now please"]);
    assert_eq!(steps[0], vec![]);
    assert_eq!(
        steps[1],
        vec![content("<tool_call>\n<function=get weather\nnow please")]
    );
}
