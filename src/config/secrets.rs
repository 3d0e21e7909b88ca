//! Secrets read from the file without ever quoting them in an error: serde's
//! type errors name the value they got ("invalid type: string \"whsec_…\""),
//! and load errors are logged and printed by `check-config`; and `${NAME}`,
//! a secret read from the environment at load.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use std::fmt;

struct List;

const EXPECTED: &str = "a list of secrets, e.g. [\"${WEBHOOK_SECRET}\"]";

impl<'de> Visitor<'de> for List {
    type Value = Vec<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(EXPECTED)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element::<Secret>()? {
            out.push(v.0);
        }
        Ok(out)
    }

    // Any other type: an error that says what was expected, not what came.
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Vec<String>, E> {
        Err(E::custom(format!(
            "a string where {EXPECTED} goes (its value not shown)"
        )))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Vec<String>, E> {
        Err(E::custom(format!("expected {EXPECTED}")))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Vec<String>, E> {
        Err(E::custom(format!("expected {EXPECTED}")))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Vec<String>, E> {
        Err(E::custom(format!("expected {EXPECTED}")))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Vec<String>, A::Error> {
        Err(de::Error::custom(format!("expected {EXPECTED}")))
    }
}

/// One list item: a string, else an error without the value.
struct Secret(String);

impl<'de> de::Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
        struct One;
        impl<'de> Visitor<'de> for One {
            type Value = Secret;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a secret (a string)")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Secret, E> {
                Ok(Secret(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Secret, E> {
                Ok(Secret(v))
            }
        }
        d.deserialize_str(One)
    }
}

pub(super) fn list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    d.deserialize_any(List)
}

/// A secret's value: `${NAME}` is read from the environment, anything else is literal.
pub(super) fn from_env(key: &str, raw: &str) -> Result<String, String> {
    match raw.strip_prefix("${").and_then(|r| r.strip_suffix('}')) {
        Some(var) => std::env::var(var)
            .map_err(|_| format!("{key} reads ${{{var}}}, which is not set in the environment")),
        None => Ok(raw.to_owned()),
    }
}
