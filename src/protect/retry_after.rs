//! A destination's `Retry-After` (RFC 9110 §10.2.3): delay-seconds or an
//! HTTP-date, turned into how long the route holds.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// How long from now `headers`' `Retry-After` asks to wait, if it asks at all.
/// A date is read against the same answer's `Date` (the destination's own
/// clock, so a skew between its clock and ours does not matter), else against
/// `local_now`. An unparsable value, or one in the past, asks nothing.
pub fn delay(headers: &HeaderMap, local_now: SystemTime) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Saturated: a huge number is a long wait, not a parse error.
        let secs = value.parse::<u64>().unwrap_or(u64::MAX);
        return (secs > 0).then(|| Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let now = headers
        .get(http::header::DATE)
        .and_then(|d| d.to_str().ok())
        .and_then(|d| httpdate::parse_http_date(d).ok())
        .unwrap_or(local_now);
    at.duration_since(now).ok().filter(|d| !d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, String)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.insert(*n, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let d = |pairs: &[(&'static str, String)]| delay(&headers(pairs), now);
        assert_eq!(
            d(&[("retry-after", "7".into())]),
            Some(Duration::from_secs(7))
        );
        assert_eq!(d(&[("retry-after", "0".into())]), None);
        assert_eq!(d(&[("retry-after", "-3".into())]), None);
        assert_eq!(d(&[("retry-after", "soon".into())]), None);
        assert_eq!(d(&[]), None);
        assert_eq!(
            d(&[("retry-after", "99999999999999999999999".into())]),
            Some(Duration::from_secs(u64::MAX))
        );
        let date = |t: SystemTime| httpdate::fmt_http_date(t);
        // Against the local clock without a Date.
        assert_eq!(
            d(&[("retry-after", date(now + Duration::from_secs(30)))]),
            Some(Duration::from_secs(30))
        );
        // Against the destination's Date: its clock is an hour ahead of ours.
        let theirs = now + Duration::from_secs(3600);
        assert_eq!(
            d(&[
                ("retry-after", date(theirs + Duration::from_secs(4))),
                ("date", date(theirs)),
            ]),
            Some(Duration::from_secs(4))
        );
        assert_eq!(
            d(&[("retry-after", date(now - Duration::from_secs(4)))]),
            None,
            "in the past"
        );
    }
}
