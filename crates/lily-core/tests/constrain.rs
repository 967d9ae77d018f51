//! Constrained decoding with the real tokenizer: random logits (a noisy model) sampled through a
//! grammar must still give valid output — JSON that parses and fits its schema, tool calls that
//! the tool-call parser reads with arguments of the declared types — with reasoning left free.

mod common;

use std::sync::OnceLock;

use lily_core::constrain::{Grammars, OutputSpec, Reasoning};
use lily_core::parse::Event;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::stop::FinishReason;
use lily_core::text::{ids, StreamConfig, TextStream, Tokenizer};
use serde_json::{json, Value};

use common::tokenizer_dir;

/// Logit rows of the real model (the tokenizer has fewer ids; the rest are padding).
const VOCAB: usize = 248_320;

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_dir(&tokenizer_dir()).unwrap())
}

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| Grammars::new(tokenizer(), VOCAB).unwrap())
}

/// Uniform logits in [-4, 4) from a seeded xorshift: a model whose output is noise.
fn noise(state: &mut u64, out: &mut [f32]) {
    for l in out.iter_mut() {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *l = (*state >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0;
    }
}

/// Samples up to `max` tokens under `sampler` until an end-of-turn token.
fn generate(sampler: &mut Sampler, seed: u64, max: usize) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut logits = vec![0.0f32; VOCAB];
    let mut out = Vec::new();
    for _ in 0..max {
        noise(&mut state, &mut logits);
        let t = sampler.sample(&logits);
        sampler.accept(t);
        if ids::EOS.contains(&t) {
            break;
        }
        out.push(t);
    }
    out
}

fn sampler(spec: &OutputSpec, reasoning: Reasoning, seed: u64) -> Sampler {
    let grammar = grammars().compile(spec).unwrap();
    let params = SamplingParams {
        temperature: 1.0,
        seed,
        ..SamplingParams::greedy()
    };
    Sampler::new(params).constrained(Some(grammar.constraint(reasoning)))
}

#[test]
fn noise_under_a_json_schema_is_valid_json() {
    let spec = OutputSpec::JsonSchema(json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": false
    }));
    for seed in 1..=4 {
        let mut s = sampler(&spec, Reasoning::Closed, seed);
        let tokens = generate(&mut s, seed, 400);
        let text = tokenizer().decode(&tokens, false);
        let v: Value = serde_json::from_str(text.trim())
            .unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        let obj = v.as_object().unwrap();
        assert!(
            obj.keys()
                .all(|k| ["name", "age", "tags", "ok"].contains(&k.as_str())),
            "{v}"
        );
        assert!(obj["name"].as_str().unwrap().chars().count() <= 12, "{v}");
        assert!((0..=120).contains(&obj["age"].as_i64().unwrap()), "{v}");
        assert!(obj["ok"].is_boolean(), "{v}");
        if let Some(tags) = obj.get("tags") {
            let tags = tags.as_array().unwrap();
            assert!(
                tags.len() <= 3 && tags.iter().all(|t| t == "red" || t == "green"),
                "{v}"
            );
        }
        let stats = s.mask_stats();
        assert!(
            stats.masks >= tokens.len() && stats.max <= stats.total,
            "{stats:?}"
        );
    }
}

#[test]
fn noise_forced_to_call_a_tool_gives_a_parsed_call_after_free_reasoning() {
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 16},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "days"]}}}),
        json!({"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}),
    ];
    let spec = OutputSpec::ToolCalls {
        tools: tools.clone(),
        only: Some("get_weather".into()),
        parallel: false,
    };
    for seed in 1..=4 {
        // Four free reasoning tokens, then `</think>` is forced and the call must follow.
        let mut s = sampler(&spec, Reasoning::Open { budget: Some(4) }, seed);
        let tokens = generate(&mut s, seed, 400);
        assert_eq!(tokens[4], ids::THINK_END, "seed {seed}");
        let mut stream = TextStream::new(
            tokenizer(),
            StreamConfig {
                starts_in_reasoning: true,
                tools: Some(tools.clone()),
                ..StreamConfig::default()
            },
        );
        let mut events = Vec::new();
        for &t in &tokens {
            events.extend(stream.push_token(t).events);
        }
        events.extend(stream.finish(FinishReason::Stop).events);
        let calls: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                Event::ToolCallEnd(c) => Some(c),
                _ => None,
            })
            .collect();
        let text = tokenizer().decode(&tokens, false);
        assert_eq!(calls.len(), 1, "seed {seed}: {text:?}");
        let args = &calls[0].arguments;
        assert_eq!(calls[0].name, "get_weather");
        assert!(
            args["city"].as_str().unwrap().chars().count() <= 16,
            "{text:?}"
        );
        assert!(
            (1..=14).contains(&args["days"].as_i64().unwrap()),
            "{text:?}"
        );
        if let Some(unit) = args.get("unit") {
            assert!(unit == "celsius" || unit == "fahrenheit", "{text:?}");
        }
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, Event::Content(t) if !t.trim().is_empty())),
            "seed {seed}: text outside the call in {text:?}"
        );
    }
}

#[test]
fn reasoning_is_free_until_the_model_closes_it() {
    let spec = OutputSpec::JsonObject;
    let grammar = grammars().compile(&spec).unwrap();
    let mut c = grammar.constraint(Reasoning::Open { budget: None });
    for &t in &[1234u32, 5678, 90] {
        assert!(c.mask().is_none());
        c.commit(t);
    }
    c.commit(ids::THINK_END);
    let mask = c.mask().expect("the grammar starts after </think>");
    let brace = tokenizer().encode("{").unwrap()[0];
    let letter = tokenizer().encode("x").unwrap()[0];
    assert!(mask.allows(brace) && !mask.allows(letter) && !mask.allows(ids::IM_END));
    assert!(!mask.allows(ids::IM_START), "special tokens are never text");
}

#[test]
fn malformed_schemas_are_refused_with_a_reason() {
    for schema in [
        json!({"type": "strin"}),
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        json!({"type": "integer", "minimum": 5, "maximum": 1}),
    ] {
        let err = grammars()
            .compile(&OutputSpec::JsonSchema(schema.clone()))
            .err()
            .unwrap_or_else(|| panic!("{schema} was accepted"));
        assert!(!err.is_empty());
    }
}

#[test]
fn parameters_may_refer_to_shared_definitions_and_calls_may_be_parallel() {
    let tools = vec![json!({"type": "function", "function": {"name": "draw",
        "parameters": {"type": "object",
          "$defs": {"point": {"type": "object", "properties": {
              "x": {"type": "integer", "minimum": 0, "maximum": 9},
              "y": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": false}},
          "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
          "required": ["from", "to"]}}})];
    let spec = OutputSpec::ToolCalls {
        tools: tools.clone(),
        only: None,
        parallel: true,
    };
    for seed in 1..=3 {
        let mut s = sampler(&spec, Reasoning::Closed, seed);
        let tokens = generate(&mut s, seed, 600);
        let mut stream = TextStream::new(
            tokenizer(),
            StreamConfig {
                tools: Some(tools.clone()),
                ..StreamConfig::default()
            },
        );
        let mut events = Vec::new();
        for &t in &tokens {
            events.extend(stream.push_token(t).events);
        }
        events.extend(stream.finish(FinishReason::Stop).events);
        let text = tokenizer().decode(&tokens, false);
        let calls: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                Event::ToolCallEnd(c) => Some(c),
                _ => None,
            })
            .collect();
        assert!(!calls.is_empty(), "seed {seed}: {text:?}");
        for call in calls {
            for end in ["from", "to"] {
                let p = call.arguments[end].as_object().unwrap();
                assert_eq!(p.len(), 2, "{text:?}");
                assert!((0..=9).contains(&p["x"].as_i64().unwrap()), "{text:?}");
                assert!((0..=9).contains(&p["y"].as_i64().unwrap()), "{text:?}");
            }
        }
    }
}
