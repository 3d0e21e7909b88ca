//! Percent-encoding for the admin listener: query strings, HTML form bodies, and
//! dedup keys in paths.

/// Decodes `%XX` escapes; with `plus_is_space` (form bodies, RFC 1866), `+` too.
/// A malformed escape is kept as it is.
pub(super) fn decode(s: &str, plus_is_space: bool) -> Vec<u8> {
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

/// `name=value` pairs of a query string or form body, decoded (lossy UTF-8).
pub(super) fn pairs(s: &str, plus_is_space: bool) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (n, v) = p.split_once('=').unwrap_or((p, ""));
            let text = |x: &str| String::from_utf8_lossy(&decode(x, plus_is_space)).into_owned();
            (text(n), text(v))
        })
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

    #[test]
    fn round_trips_and_tolerates_bad_escapes() {
        let key = "a/b?c#d%e+f&g=h~";
        assert_eq!(decode(&encode(key), true), key.as_bytes());
        assert_eq!(decode("%41%4", false), b"A%4");
        assert_eq!(decode("%zz+", false), b"%zz+");
        assert_eq!(decode("a+b", true), b"a b");
        assert_eq!(
            pairs("x=1&&y=a%2Bb&z", true),
            vec![
                ("x".into(), "1".into()),
                ("y".into(), "a+b".into()),
                ("z".into(), String::new())
            ]
        );
    }
}
