//! Reading request fields by name, so that a wrong type or an out-of-range
//! value is answered with an error naming the field (serde's own messages
//! name a line and column, which a client cannot act on).

use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult, Flavor};

/// A request body: a JSON object, fields read one by one.
pub struct Body<'a> {
    pub obj: &'a Map<String, Value>,
    pub flavor: Flavor,
}

impl<'a> Body<'a> {
    pub fn parse(bytes: &[u8], flavor: Flavor) -> ApiResult<Value> {
        let v: Value = serde_json::from_slice(bytes)
            .map_err(|e| ApiError::bad_request(flavor, None, format!("the request body is not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(ApiError::bad_request(flavor, None, "the request body must be a JSON object"));
        }
        Ok(v)
    }

    pub fn new(v: &'a Value, flavor: Flavor) -> Self {
        Body { obj: v.as_object().expect("checked by parse"), flavor }
    }

    pub fn bad(&self, field: &str, what: impl std::fmt::Display) -> ApiError {
        ApiError::bad_request(self.flavor, Some(field), format!("`{field}` {what}"))
    }

    /// The field, None when absent or null.
    pub fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    pub fn f32_in(&self, field: &str, lo: f32, hi: f32) -> ApiResult<Option<f32>> {
        let Some(v) = self.get(field) else { return Ok(None) };
        let x = v.as_f64().ok_or_else(|| self.bad(field, "must be a number"))? as f32;
        if !(lo..=hi).contains(&x) {
            return Err(self.bad(field, format!("must be between {lo} and {hi}, got {x}")));
        }
        Ok(Some(x))
    }

    pub fn u64(&self, field: &str) -> ApiResult<Option<u64>> {
        let Some(v) = self.get(field) else { return Ok(None) };
        v.as_u64().map(Some).ok_or_else(|| self.bad(field, "must be a non-negative integer"))
    }

    pub fn i64(&self, field: &str) -> ApiResult<Option<i64>> {
        let Some(v) = self.get(field) else { return Ok(None) };
        v.as_i64().map(Some).ok_or_else(|| self.bad(field, "must be an integer"))
    }

    pub fn bool(&self, field: &str) -> ApiResult<bool> {
        match self.get(field) {
            None => Ok(false),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(field, "must be true or false")),
        }
    }

    pub fn str(&self, field: &str) -> ApiResult<Option<&'a str>> {
        let Some(v) = self.get(field) else { return Ok(None) };
        v.as_str().map(Some).ok_or_else(|| self.bad(field, "must be a string"))
    }

    /// A string or an array of strings.
    pub fn strings(&self, field: &str) -> ApiResult<Vec<String>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|s| s.as_str().map(str::to_string).ok_or_else(|| self.bad(field, "must hold only strings")))
                .collect(),
            Some(_) => Err(self.bad(field, "must be a string or an array of strings")),
        }
    }

    /// Fails when `field` is present with a value other than the ones this
    /// server implements (`allowed` says which), naming the field: a request
    /// is never answered as if a feature it asked for had run.
    pub fn refuse(&self, field: &str, allowed: impl Fn(&Value) -> bool, why: &str) -> ApiResult<()> {
        match self.get(field) {
            Some(v) if !allowed(v) => Err(self.bad(field, format!("is not supported by this server: {why}"))),
            _ => Ok(()),
        }
    }
}
