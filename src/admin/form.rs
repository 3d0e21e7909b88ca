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

    /// The hand-written decoder these functions replace (issue 40, item 5),
    /// kept here until the comparison below has run.
    fn old_decode(s: &str, plus_is_space: bool) -> Vec<u8> {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'%' if i + 2 < b.len() => {
                    match std::str::from_utf8(&b[i + 1..i + 3])
                        .ok()
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        Some(v) => {
                            out.push(v);
                            i += 3;
                            continue;
                        }
                        None => out.push(b'%'),
                    }
                }
                b'+' if plus_is_space => out.push(b' '),
                c => out.push(c),
            }
            i += 1;
        }
        out
    }

    fn old_pairs(s: &str, plus_is_space: bool) -> Vec<(String, String)> {
        s.split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (n, v) = p.split_once('=').unwrap_or((p, ""));
                let text =
                    |x: &str| String::from_utf8_lossy(&old_decode(x, plus_is_space)).into_owned();
                (text(n), text(v))
            })
            .collect()
    }

    fn old_escape_segment(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        for b in s.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                out.push(char::from(b));
            } else {
                out.push('%');
                out.push(char::from(b"0123456789ABCDEF"[usize::from(b >> 4)]));
                out.push(char::from(b"0123456789ABCDEF"[usize::from(b & 15)]));
            }
        }
        out
    }

    /// The old decoder's one quirk: `u8::from_str_radix` takes a sign, so
    /// `%+f` was the byte 0x0f. A sign is no hex digit: the crates keep it as
    /// text, as they keep any other malformed escape.
    fn signed_escape(s: &str) -> bool {
        s.as_bytes()
            .windows(3)
            .any(|w| w[0] == b'%' && w[1] == b'+' && w[2].is_ascii_hexdigit())
    }

    fn same_as_before(s: &str) {
        if signed_escape(s) {
            return;
        }
        assert_eq!(decode_segment(s), old_decode(s, false), "{s:?}");
        assert_eq!(query_pairs(s), old_pairs(s, false), "{s:?}");
        assert_eq!(form_pairs(s.as_bytes()), old_pairs(s, true), "{s:?}");
        assert_eq!(encode(s), old_escape_segment(s), "{s:?}");
    }

    const TRICKY: &[&str] = &[
        "",
        "&",
        "&&",
        "=",
        "==",
        "a=b=c",
        "+",
        "a+b=c+d",
        "%",
        "%%",
        "%4",
        "%41%4",
        "%zz",
        "%zz+",
        "%2B",
        "%2b+%20",
        "%%41",
        "%2+",
        "%+",
        "%-1",
        "%c3%a9",
        "%C3",
        "%ff%fe",
        "%e2%82",
        "\u{e9}=\u{20ac}",
        "x=1&&y=a%2Bb&z",
        "a/b?c#d%e+f&g=h~",
        "state=in_doubt&after=12%2Fpay%2Fk%2B1",
        "key=a+b%20c",
    ];

    #[test]
    fn the_crates_decode_and_encode_as_the_hand_written_code_did() {
        for s in TRICKY {
            same_as_before(s);
        }
        // Invalid UTF-8 in a form body, raw and escaped.
        for body in [
            &b"a=\xff"[..],
            b"\xe2%82=1",
            b"t=%e2\x82",
            b"\xff\xfe&x=%ff",
        ] {
            let old = old_pairs(&String::from_utf8_lossy(body), true);
            assert_eq!(form_pairs(body), old, "{body:?}");
        }
        assert_eq!(old_decode("%+f", false), b"\x0f");
        assert_eq!(decode_segment("%+f"), b"%+f");
    }

    proptest::proptest! {
        #[test]
        fn the_crates_agree_with_the_hand_written_code(s in "([a-zA-Z0-9%+=&~./ -]|%[0-9a-fA-F]{0,2}|\\PC){0,24}") {
            same_as_before(&s);
        }
    }

    #[test]
    fn round_trips_and_tolerates_bad_escapes() {
        let key = "a/b?c#d%e+f&g=h~";
        assert_eq!(decode_segment(&encode(key)), key.as_bytes());
        assert_eq!(decode_segment("%41%4"), b"A%4");
        assert_eq!(decode_segment("%zz+"), b"%zz+");
        assert_eq!(form_pairs(b"a+b=%2B"), vec![("a b".into(), "+".into())]);
        assert_eq!(
            query_pairs("x=1&&y=a%2Bb&z"),
            vec![
                ("x".into(), "1".into()),
                ("y".into(), "a+b".into()),
                ("z".into(), String::new())
            ]
        );
    }
}
