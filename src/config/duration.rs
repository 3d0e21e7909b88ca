//! Every duration takes either form: an integer number of milliseconds, or a
//! human-readable string ("1500ms", "2s", "24h"). The `*_ms` keys also answer to
//! their name without `_ms` (`timeout = "10s"`); the old names keep working.

use serde::de::{Deserializer, Error, Visitor};
use std::time::Duration;

struct Either;

impl Visitor<'_> for Either {
    type Value = Duration;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a duration: milliseconds as an integer, or a string such as \"1500ms\", \"2s\", \"24h\"")
    }

    fn visit_u64<E: Error>(self, v: u64) -> Result<Duration, E> {
        Ok(Duration::from_millis(v))
    }

    fn visit_i64<E: Error>(self, v: i64) -> Result<Duration, E> {
        u64::try_from(v)
            .map(Duration::from_millis)
            .map_err(|_| E::custom(format!("{v}: a duration cannot be negative")))
    }

    fn visit_str<E: Error>(self, s: &str) -> Result<Duration, E> {
        humantime::parse_duration(s).map_err(|e| {
            E::custom(format!(
                "{s:?} is not a duration ({e}): write milliseconds (1500) or a number with a unit (\"1500ms\", \"2s\", \"24h\")"
            ))
        })
    }
}

pub(super) fn human<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    d.deserialize_any(Either)
}

pub(super) fn ms<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    human(d).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(super) fn ms_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    ms(d).map(Some)
}

/// A list of durations, each as [`human`] reads one.
pub(super) fn list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Duration>, D::Error> {
    #[derive(serde::Deserialize)]
    struct One(#[serde(deserialize_with = "human")] Duration);
    let v: Vec<One> = serde::Deserialize::deserialize(d)?;
    Ok(v.into_iter().map(|o| o.0).collect())
}
