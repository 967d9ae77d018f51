//! Typed reads of request fields with errors that name the field, as OpenAI does (`param`). A field
//! set to `null` counts as absent; fields we do not know are ignored.

use serde_json::{Map, Value};

use super::error::ApiError;

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

    pub fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
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
    fn within<T: PartialOrd + Copy + std::fmt::Display>(
        &self,
        name: &str,
        v: Option<T>,
        lo: T,
        hi: T,
    ) -> Result<Option<T>, ApiError> {
        match v {
            Some(x) if !(lo..=hi).contains(&x) => {
                let param = self.param(name);
                Err(ApiError::invalid_param(
                    &param,
                    format!("'{param}' must be between {lo} and {hi}, got {x}"),
                ))
            }
            _ => Ok(v),
        }
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

    #[test]
    fn malformed_json_is_a_400() {
        let err = parse_object(b"{\"model\": ").unwrap_err();
        assert_eq!(err.status.as_u16(), 400);
        assert!(parse_object(b"[1]").is_err());
    }
}
