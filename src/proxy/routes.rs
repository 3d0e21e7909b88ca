//! The route index: which configured route a request path belongs to.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Routes by `path_prefix` (each ends in `/`, config validation): the longest
/// prefix of a path wins, found with one hash probe per path segment whatever the
/// number of routes (a linear scan was ~15% of a request's CPU at 10,000 routes).
pub(super) struct RouteIndex {
    /// Prefix without its final `/` → position of the route.
    by_prefix: HashMap<String, usize, BuildHasherDefault<Fnv1a>>,
}

/// FNV-1a: paths are short, and SipHash's flood resistance buys nothing here (the
/// table holds configured prefixes only; a request can only look up).
#[derive(Default)]
struct Fnv1a(u64);

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

impl RouteIndex {
    pub(super) fn new<'a>(prefixes: impl Iterator<Item = &'a str>) -> RouteIndex {
        let mut by_prefix = HashMap::default();
        for (i, p) in prefixes.enumerate() {
            by_prefix
                .entry(p.strip_suffix('/').unwrap_or(p).to_owned())
                .or_insert(i);
        }
        RouteIndex { by_prefix }
    }

    /// The route whose prefix is the longest one `path` starts with, or whose
    /// prefix is `path` plus `/` (`/billing` names the root of `/billing/`).
    pub(super) fn find(&self, path: &str) -> Option<usize> {
        // `path` itself first (the root case, and the longest candidate), then
        // every ancestor that ends before a '/', longest first.
        std::iter::once(path)
            .chain(
                path.bytes()
                    .enumerate()
                    .rev()
                    .filter(|&(_, b)| b == b'/')
                    .map(|(i, _)| &path[..i]),
            )
            .find_map(|c| self.by_prefix.get(c).copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::Target;

    /// The definition the index must agree with: the longest matching prefix.
    fn linear(prefixes: &[String], path: &str) -> Option<usize> {
        let matches = |p: &str| {
            Target::new(p, "http://upstream/", "Idempotency-Key", vec![])
                .is_ok_and(|t| t.matches(path))
        };
        (0..prefixes.len())
            .filter(|&i| matches(&prefixes[i]))
            .max_by_key(|&i| prefixes[i].len())
    }

    #[test]
    fn longest_prefix_and_the_root_case() {
        let prefixes = ["/", "/billing/", "/billing/refunds/", "//"];
        let idx = RouteIndex::new(prefixes.into_iter());
        for (path, want) in [
            ("/billing/x", Some(1)),
            ("/billing", Some(1)),
            ("/billing/", Some(1)),
            ("/billing/refunds", Some(2)),
            ("/billing/refunds/1", Some(2)),
            ("/billingx", Some(0)),
            ("/a", Some(0)),
            // `/` is the root of `//`, the longer prefix.
            ("/", Some(3)),
            ("//x", Some(3)),
        ] {
            assert_eq!(idx.find(path), want, "{path}");
        }
        assert_eq!(RouteIndex::new(["/a/"].into_iter()).find("/b"), None);
    }

    proptest::proptest! {
        #[test]
        fn index_matches_the_linear_definition(
            prefixes in proptest::collection::hash_set("/([ab]{1,2}/){0,3}", 1..6),
            path in "/[ab/]{0,9}",
        ) {
            let prefixes: Vec<String> = prefixes.into_iter().collect();
            let idx = RouteIndex::new(prefixes.iter().map(String::as_str));
            proptest::prop_assert_eq!(idx.find(&path), linear(&prefixes, &path), "{}", path);
        }
    }
}
