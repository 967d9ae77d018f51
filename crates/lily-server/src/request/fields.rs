//! Typed reads of request fields with errors that name the field, as OpenAI does (`param`). A field
//! set to `null` counts as absent; fields we do not know are ignored.
//!
//! The OpenAI bodies are read with serde into derived structs ([`read`]): `serde_path_to_error`
//! tracks where the first error happened, which becomes `param` (`messages[2].role`), and serde's
//! "invalid type" error becomes "'messages[2].role' must be a string, got a number". [`Fields`] is
//! the older hand-written reader, still used by the Anthropic parser and `structured.rs`.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::{Map, Value};

use crate::openai::error::ApiError;

/// Parses a request body that must be one JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("the request body is not valid JSON: {e}")))?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::invalid(
            None,
            format!(
                "the request body must be a JSON object, got {}",
                kind(&other)
            ),
        )),
    }
}

/// Deserializes `T` from a request object; on error, a 400 whose `param` is the path of the field
/// that was wrong.
pub fn read<'de, T: Deserialize<'de>>(obj: &'de Map<String, Value>) -> Result<T, ApiError> {
    read_at(obj, "")
}

/// [`read`] for a part of a body found at `prefix` (`messages[0].content[1]`), which leads `param`.
pub fn read_at<'de, T, D>(value: D, prefix: &str) -> Result<T, ApiError>
where
    T: Deserialize<'de>,
    D: Deserializer<'de, Error = serde_json::Error>,
{
    serde_path_to_error::deserialize(value).map_err(|e| {
        let mut param = prefix.to_string();
        for segment in e.path().iter() {
            match segment {
                serde_path_to_error::Segment::Seq { index } => {
                    param.push_str(&format!("[{index}]"))
                }
                serde_path_to_error::Segment::Map { key } => {
                    if !param.is_empty() {
                        param.push('.');
                    }
                    param.push_str(key);
                }
                serde_path_to_error::Segment::Enum { .. } => {}
                serde_path_to_error::Segment::Unknown => break,
            }
        }
        describe(param, &e.into_inner().to_string())
    })
}

/// serde's message for the field at `param`, said as the hand-written reader said it: the kind of
/// JSON value expected and the kind given (never the value itself, which may be megabytes long).
fn describe(mut param: String, message: &str) -> ApiError {
    let text = if let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.strip_suffix('`'))
    {
        if !param.is_empty() {
            param.push('.');
        }
        param.push_str(field);
        format!("'{param}' is required")
    } else if let Some((got, expected)) = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))
        .and_then(|rest| rest.rsplit_once(", expected "))
    {
        format!(
            "'{param}' must be {}, got {}",
            expected_kind(expected),
            given_kind(got)
        )
    } else if let Some((got, expected)) = message
        .strip_prefix("unknown variant `")
        .and_then(|rest| rest.rsplit_once("`, expected one of "))
    {
        let expected = expected.replace('`', "");
        if got.len() <= 64 {
            format!("'{param}' is {got:?}; expected one of {expected}")
        } else {
            format!("'{param}' must be one of {expected}")
        }
    } else if message.starts_with("a ") || message.starts_with("an ") {
        // An untagged enum's `expecting`, given as the whole message.
        format!("'{param}' must be {message}")
    } else {
        // Anything else serde says, cut short: it may quote the request.
        let mut end = message.len().min(200);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        format!("'{param}': {}", &message[..end])
    };
    if param.is_empty() {
        ApiError::invalid(None, text)
    } else {
        ApiError::invalid_param(&param, text)
    }
}

/// serde's name for what it expected, in JSON's words.
fn expected_kind(expected: &str) -> &str {
    match expected {
        "f32" | "f64" => "a number",
        "i8" | "i16" | "i32" | "i64" | "u8" | "u16" | "u32" | "u64" | "usize" => "an integer",
        "a sequence" => "an array",
        "a map" => "an object",
        // serde_json's word for an enum; ours (roles) are all strings.
        "string or map" => "a string",
        e if e.starts_with("struct ") => "an object",
        e => e,
    }
}

/// The kind of value serde was given (`string "hot"` → a string).
fn given_kind(got: &str) -> &'static str {
    match got.split([' ', '`']).next().unwrap_or("") {
        "boolean" => "a boolean",
        "integer" | "floating" => "a number",
        "string" | "character" => "a string",
        "sequence" => "an array",
        "map" => "an object",
        "null" | "unit" => "null",
        _ => "another kind of value",
    }
}

/// A derived struct that must come as a JSON object. serde's derive also takes an array of the
/// fields in declaration order, which no client means: `["user", "hi"]` is not a message.
#[derive(Debug)]
pub struct Obj<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Obj<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            // The map access passed on is the path-tracking one, so errors inside keep their path.
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Obj<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Obj)
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

/// A JSON number as f64.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Num(pub f64);

impl<'de> Deserialize<'de> for Num {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Num;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Num, E> {
                Ok(Num(v as f64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Num, E> {
                Ok(Num(v as f64))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Num, E> {
                Ok(Num(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// A JSON integer; 2.0 counts as one, 2.5 does not.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Int(pub i64);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Int, E> {
                Ok(Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Int, E> {
                i64::try_from(v)
                    .map(Int)
                    .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Int, E> {
                if v.fract() == 0.0 && v.abs() < 9.0e15 {
                    Ok(Int(v as i64))
                } else {
                    Err(E::invalid_type(de::Unexpected::Float(v), &self))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// `v` unchanged when absent or within `lo..=hi`, else a 400 naming `param` and the bounds.
pub fn within<T: PartialOrd + Copy + fmt::Display>(
    param: &str,
    v: Option<T>,
    lo: T,
    hi: T,
) -> Result<Option<T>, ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::invalid_param(
            param,
            format!("'{param}' must be between {lo} and {hi}, got {x}"),
        )),
        _ => Ok(v),
    }
}

/// A JSON object being read, with the path of the object for error messages (`messages[2].`).
pub struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: String,
}

pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl<'a> Fields<'a> {
    pub fn new(obj: &'a Map<String, Value>) -> Self {
        Fields {
            obj,
            path: String::new(),
        }
    }

    pub fn nested(obj: &'a Map<String, Value>, path: String) -> Self {
        Fields { obj, path }
    }

    pub fn param(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    fn wrong(&self, name: &str, expected: &str, got: &Value) -> ApiError {
        let param = self.param(name);
        ApiError::invalid_param(
            &param,
            format!("'{param}' must be {expected}, got {}", kind(got)),
        )
    }

    pub fn get(&self, name: &str) -> Option<&'a Value> {
        match self.obj.get(name) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    pub fn f64(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong(name, "a number", v)),
        }
    }

    /// A number within `lo..=hi`.
    pub fn f64_in(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        let v = self.f64(name)?;
        self.within(name, v, lo, hi)
    }

    pub fn i64(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_i64() {
                Some(n) => Ok(Some(n)),
                // 2.0 is accepted as an integer, 2.5 is not.
                None => match v.as_f64() {
                    Some(x) if x.fract() == 0.0 && x.abs() < 9.0e15 => Ok(Some(x as i64)),
                    _ => Err(self.wrong(name, "an integer", v)),
                },
            },
        }
    }

    /// An integer within `lo..=hi`.
    pub fn i64_in(&self, name: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let v = self.i64(name)?;
        self.within(name, v, lo, hi)
    }

    /// `v` unchanged when absent or within `lo..=hi`, else the field's range error.
    fn within<T: PartialOrd + Copy + fmt::Display>(
        &self,
        name: &str,
        v: Option<T>,
        lo: T,
        hi: T,
    ) -> Result<Option<T>, ApiError> {
        within(&self.param(name), v, lo, hi)
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(name, "a boolean", v)),
        }
    }

    pub fn str(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(name, "a string", v)),
        }
    }

    pub fn array(&self, name: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.wrong(name, "an array", v)),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(v) => Err(self.wrong(name, "an object", v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wrong_type_names_the_field() {
        let v = json!({"temperature": "hot"});
        let f = Fields::new(v.as_object().unwrap());
        let err = f.f64("temperature").unwrap_err();
        assert_eq!(err.param.as_deref(), Some("temperature"));
        assert!(err.message.contains("a number"), "{}", err.message);
    }

    #[test]
    fn null_is_absent_and_integral_floats_are_integers() {
        let v = json!({"seed": null, "n": 2.0, "m": 2.5});
        let f = Fields::new(v.as_object().unwrap());
        assert_eq!(f.i64("seed").unwrap(), None);
        assert_eq!(f.i64("n").unwrap(), Some(2));
        assert!(f.i64("m").is_err());
    }

    #[test]
    fn out_of_range_is_refused_with_bounds() {
        let v = json!({"top_p": 1.5});
        let f = Fields::new(v.as_object().unwrap());
        let err = f.f64_in("top_p", 0.0, 1.0).unwrap_err();
        assert!(err.message.contains("between 0 and 1"), "{}", err.message);
    }

    #[derive(serde::Deserialize, Debug)]
    struct Inner {
        #[allow(dead_code)] // read only for its errors
        id: Int,
    }

    #[derive(serde::Deserialize, Debug)]
    struct Outer {
        #[allow(dead_code)]
        items: Option<Vec<Obj<Inner>>>,
        #[allow(dead_code)]
        ratio: Option<Num>,
    }

    fn read_err(v: Value) -> ApiError {
        read::<Outer>(v.as_object().unwrap()).unwrap_err()
    }

    #[test]
    fn serde_errors_name_the_path_and_the_kinds() {
        for (body, param, message) in [
            (
                json!({"items": [{"id": 1}, {"id": "2"}]}),
                "items[1].id",
                "'items[1].id' must be an integer, got a string",
            ),
            (
                json!({"items": [{"id": 1}, {}]}),
                "items[1].id",
                "'items[1].id' is required",
            ),
            (
                json!({"items": [{"id": 1}, {"id": null}]}),
                "items[1].id",
                "'items[1].id' must be an integer, got null",
            ),
            (
                json!({"items": [{"id": 18446744073709551615u64}]}),
                "items[0].id",
                "'items[0].id' must be an integer, got a number",
            ),
            (
                json!({"items": [[1]]}),
                "items[0]",
                "'items[0]' must be an object, got an array",
            ),
            (
                json!({"items": {"id": 1}}),
                "items",
                "'items' must be an array, got an object",
            ),
            (
                json!({"ratio": true}),
                "ratio",
                "'ratio' must be a number, got a boolean",
            ),
        ] {
            let err = read_err(body.clone());
            assert_eq!(err.status.as_u16(), 400);
            assert_eq!(err.param.as_deref(), Some(param), "{body}");
            assert_eq!(err.message, message, "{body}");
        }
        let ok: Outer = read(
            json!({"items": [{"id": 2.0, "x": 1}], "ratio": 3, "y": [1]})
                .as_object()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(ok.items.unwrap()[0].0.id, Int(2));
        assert_eq!(ok.ratio, Some(Num(3.0)));
    }

    #[test]
    fn malformed_json_is_a_400() {
        let err = parse_object(b"{\"model\": ").unwrap_err();
        assert_eq!(err.status.as_u16(), 400);
        assert!(parse_object(b"[1]").is_err());
    }
}
