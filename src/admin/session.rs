//! The operator page's login (SPEC §8, issue 16): the admin token, typed once into
//! a form, becomes a cookie — never a URL parameter — and every state-changing
//! form carries a token a cross-site page cannot know.
//!
//! The cookie holds no token: its value is SHA-256 of a random secret drawn at
//! start-up and the admin token's hash, so it is worth nothing to another process
//! or after a restart (log in again) and changes when the token does. It is
//! `HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page makes
//! the browser send it) and host-only with `Path=/`. Browsers scope cookies by
//! host, not port: docs/operations.md says so.

use http::{header, HeaderMap, HeaderValue};
use sha2::{Digest, Sha256};

use crate::epoch::TokenHash;

use crate::headers::ADMIN_SESSION_COOKIE as COOKIE;

/// What a logged-in browser presents.
pub(crate) struct Session {
    cookie: String,
    csrf: String,
}

fn digest(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    hex::encode(h.finalize())
}

/// Equal strings, compared in constant time (through their hashes).
fn same_secret(a: &str, b: &str) -> bool {
    TokenHash::of(a.as_bytes()).matches(&TokenHash::of(b.as_bytes()))
}

impl Session {
    /// The session of the process whose secret is `secret`, for the admin token
    /// whose hash is `token`.
    pub(crate) fn new(secret: &str, token: &TokenHash) -> Session {
        let cookie = digest(&[
            b"fencegate-session\n",
            secret.as_bytes(),
            token.to_hex().as_bytes(),
        ]);
        let csrf = digest(&[b"fencegate-csrf\n", cookie.as_bytes()]);
        Session { cookie, csrf }
    }

    /// Whether the request carries this session's cookie.
    pub(crate) fn presented(&self, headers: &HeaderMap) -> bool {
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .any(|(n, v)| n == COOKIE && same_secret(v, &self.cookie))
    }

    /// The hidden field every form of the page carries.
    pub(crate) fn csrf(&self) -> &str {
        &self.csrf
    }

    pub(crate) fn csrf_matches(&self, presented: &str) -> bool {
        same_secret(presented, &self.csrf)
    }

    pub(crate) fn set_cookie(&self) -> HeaderValue {
        HeaderValue::from_str(&format!(
            "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict",
            self.cookie
        ))
        .unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    pub(crate) fn clear_cookie() -> HeaderValue {
        HeaderValue::from_static("fencegate_admin=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
    }
}

/// Whether a browser says the request comes from a page of this listener: a
/// `Sec-Fetch-Site` other than `same-origin`, or an `Origin` naming another
/// host, is a cross-site request. (Clients that send neither are judged by the
/// form token alone.)
pub(crate) fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site") {
        if site.as_bytes() != b"same-origin" {
            return false;
        }
    }
    match headers.get(header::ORIGIN) {
        None => true,
        Some(origin) => {
            let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
            let origin = origin.to_str().ok();
            match (origin, host) {
                (Some(o), Some(h)) => {
                    o.strip_prefix("http://")
                        .or_else(|| o.strip_prefix("https://"))
                        == Some(h)
                }
                _ => false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_cookie_is_this_process_s_and_holds_no_token() {
        let t = TokenHash::of(b"admin-secret");
        let (s, other) = (Session::new("one", &t), Session::new("two", &t));
        let set = s.set_cookie();
        let set = set.to_str().unwrap();
        assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict"));
        assert!(!set.contains("admin-secret") && !set.contains(&t.to_hex()));
        let pair = set.split(';').next().unwrap();
        assert!(s.presented(&headers(&[("cookie", &format!("a=b; {pair}"))])));
        // Another process (another secret) does not accept it.
        assert!(!other.presented(&headers(&[("cookie", pair)])));
        assert!(!s.presented(&headers(&[("cookie", "fencegate_admin=admin-secret")])));
        assert!(s.csrf_matches(&s.csrf.clone()) && !s.csrf_matches(other.csrf()));
        // Another token (after a reload): another cookie.
        let rotated = Session::new("one", &TokenHash::of(b"new-token"));
        assert!(!rotated.presented(&headers(&[("cookie", pair)])));
    }

    #[test]
    fn cross_site_requests_are_told_apart() {
        assert!(same_origin(&headers(&[])));
        assert!(same_origin(&headers(&[
            ("host", "127.0.0.1:9090"),
            ("origin", "http://127.0.0.1:9090"),
            ("sec-fetch-site", "same-origin"),
        ])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "cross-site")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "same-site")])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:9090"),
            ("origin", "http://evil.example"),
        ])));
        assert!(!same_origin(&headers(&[("host", "a"), ("origin", "null")])));
    }
}
