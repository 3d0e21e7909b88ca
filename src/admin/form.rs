//! Percent-encoding for the admin listener: query strings, HTML form bodies, and
//! dedup keys in paths — on the `form_urlencoded` and `percent-encoding` crates.

/// A path segment's bytes, `%XX` escapes decoded (a malformed escape is kept as
/// it is; `+` is a `+`).
pub(super) fn decode_segment(s: &str) -> Vec<u8> {
    percent_encoding::percent_decode_str(s).collect()
}

/// `name=value` pairs of an HTML form body (`application/x-www-form-urlencoded`:
/// `+` is a space), decoded as lossy UTF-8; empty pairs are skipped.
pub(super) fn form_pairs(body: &[u8]) -> Vec<(String, String)> {
    // Lossy before decoding as well as after: an invalid byte beside an escape
    // becomes U+FFFD on its own, as it always has.
    form_urlencoded::parse(String::from_utf8_lossy(body).as_bytes())
        .into_owned()
        .collect()
}

/// `name=value` pairs of a query string: as [`form_pairs`], but a `+` stays a
/// `+` (a client may send a cursor or key unescaped; the page's own links escape
/// everything).
pub(super) fn query_pairs(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.replace('+', "%2B").as_bytes())
        .into_owned()
        .collect()
}

/// Escapes everything but RFC 3986's unreserved characters (for a key in a path
/// or a cursor in a query).
pub(super) fn encode(s: &str) -> String {
    crate::dedup::escape_segment(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(n: &str, v: &str) -> (String, String) {
        (n.to_owned(), v.to_owned())
    }

    /// What the hand-written code these replaced answered (issue 40, item 5):
    /// malformed escapes stay text (`%+f` too, which it read as 0x0f: a sign
    /// is no hex digit), `+` is a space in a form body only.
    #[test]
    fn decodes_as_before_and_tolerates_bad_escapes() {
        for (s, want) in [
            ("", &b""[..]),
            ("%", b"%"),
            ("%4", b"%4"),
            ("%41%4", b"A%4"),
            ("%zz+", b"%zz+"),
            ("%%41", b"%A"),
            ("%2b+%20", b"++ "),
            ("%+f", b"%+f"),
            ("%ff%C3%a9", b"\xff\xc3\xa9"),
        ] {
            assert_eq!(decode_segment(s), want, "{s:?}");
        }
        assert_eq!(
            query_pairs("x=1&&y=a%2Bb&z&a+b=c=d&="),
            [
                pair("x", "1"),
                pair("y", "a+b"),
                pair("z", ""),
                pair("a+b", "c=d"),
                pair("", "")
            ]
        );
        assert_eq!(
            form_pairs(b"a+b=%2B&t=%e2%82&u=\xe2%82&v=\xff"),
            [
                pair("a b", "+"),
                pair("t", "\u{fffd}"),
                pair("u", "\u{fffd}\u{fffd}"),
                pair("v", "\u{fffd}")
            ]
        );
    }

    #[test]
    fn escapes_all_but_the_unreserved_and_round_trips() {
        let key = "a/b?c#d%e+f&g=h~ \u{e9}";
        assert_eq!(encode(key), "a%2Fb%3Fc%23d%25e%2Bf%26g%3Dh~%20%C3%A9");
        assert_eq!(encode("AZaz09-._~"), "AZaz09-._~");
        assert_eq!(decode_segment(&encode(key)), key.as_bytes());
    }
}
