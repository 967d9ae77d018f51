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
    ])
}

fn run(schemas: ToolSchemas, pieces: &[&str]) -> Vec<ContentPiece> {
    let mut p = ToolCallParser::new(schemas);
    let mut out = Vec::new();
    for s in pieces {
        p.push(s, &mut out);
    }
    p.finish(&mut out);
    out
}

fn text(s: &str) -> ContentPiece {
    ContentPiece::Text(s.into())
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
        vec![ContentPiece::Call(ToolCall {
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
    let ContentPiece::Call(call) = &out[0] else {
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
    let (ContentPiece::Call(a), ContentPiece::Call(b)) = (&out[1], &out[2]) else {
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
    let raw = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\ntrailing junk\n</function>\n</tool_call>";
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
        matches!(&out[..], [ContentPiece::Call(c)] if c.arguments["city"] == "Oslo"),
        "{out:?}"
    );
}

#[test]
fn missing_parameter_close_tag_is_tolerated() {
    let out = run(weather_tools(), &["<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>\n</tool_call>"]);
    let [ContentPiece::Call(c)] = &out[..] else {
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
