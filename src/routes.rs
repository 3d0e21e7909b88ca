//! The configured routes (what [`crate::live::Live`] holds) and their index:
//! which route a request path belongs to.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::Duration;

use http::Method;

use crate::config::{Delivery, DeriveKey, InDoubtPolicy, RouteConfig};
use crate::epoch::LeaseName;
use crate::fence::Fence;
use crate::forward::sign::Signer;
use crate::forward::{self, HttpsClient, Target};
use crate::metrics::{Metrics, RouteMetrics};
use crate::protect;

/// One configured route, ready to serve.
pub struct Route {
    pub name: String,
    pub target: Target,
    pub lease: LeaseName,
    /// The lease's shard (SPEC §10.2; 0 for a single instance).
    pub shard: u32,
    /// A single instance's fence of the lease, started with the route; in a
    /// cluster the fence runs only while this instance owns the shard, and is
    /// looked up per request.
    pub fence: Option<Arc<Fence>>,
    pub client: HttpsClient,
    /// The instance's upstream share of its descriptor budget, shared by
    /// every route (SPEC §9 "Limits").
    pub upstreams: Arc<crate::budget::Upstreams>,
    pub timeout: Duration,
    pub drain_timeout: Duration,
    pub require_token: bool,
    pub derive_key: DeriveKey,
    pub in_doubt: InDoubtPolicy,
    pub retryable: Vec<u16>,
    pub max_body_bytes: usize,
    pub max_replay_bytes: usize,
    /// Protecting the destination: this snapshot's keys, and the state a reload
    /// keeps ([`RouteTable::carry_over`]).
    pub protect_cfg: protect::Settings,
    pub protect: Arc<protect::Guard>,
    /// Signs each forwarded request the Standard Webhooks way (its body is read
    /// whole first).
    pub signer: Option<Signer>,
    /// `delivery = "queued"` (SPEC §11): accepted durably, delivered later.
    pub queued: bool,
    /// A queued route's bound on the requests it keeps, and the bound over
    /// every route (SPEC §11 `queue_full`).
    pub queue_bound: crate::queue::message::QueueBound,
    /// A queued route's waits between attempts.
    pub retry: Vec<Duration>,
    /// `ordering = "none"`: this many of an epoch's messages at once (the
    /// route's `max_in_flight`, else 16); `None`: one at a time (`"lease"`).
    pub parallel: Option<usize>,
    /// This route's counter and histograms.
    pub(crate) metrics: RouteMetrics,
}

impl Route {
    pub fn new(
        cfg: &RouteConfig,
        fence: Option<Arc<Fence>>,
        shard: u32,
        client: HttpsClient,
        upstreams: Arc<crate::budget::Upstreams>,
        state: &crate::config::StateConfig,
        metrics: &Metrics,
    ) -> Result<Route, String> {
        let headers = cfg.resolve_upstream_headers()?;
        Ok(Route {
            name: cfg.name.clone(),
            target: Target::new(&cfg.path_prefix, &cfg.upstream, &cfg.dedup_header, headers)?,
            lease: cfg.lease.clone(),
            shard,
            fence,
            client,
            upstreams,
            timeout: cfg.timeout(),
            drain_timeout: cfg.drain_timeout(),
            require_token: cfg.require_token,
            derive_key: cfg.derive_key,
            in_doubt: cfg.in_doubt,
            retryable: cfg.retryable_statuses.clone(),
            max_body_bytes: cfg.max_body_bytes,
            max_replay_bytes: cfg.max_replay_bytes,
            protect_cfg: protect::Settings::of(cfg),
            protect: Arc::new(protect::Guard::new(&protect::Settings::of(cfg))),
            signer: cfg.signer()?,
            queued: cfg.delivery == Delivery::Queued,
            retry: cfg.retry.schedule.clone(),
            queue_bound: crate::queue::message::QueueBound {
                route_messages: cfg.queue_max_messages,
                route_bytes: cfg.queue_max_bytes,
                total_messages: state.queue_max_messages,
                total_bytes: state.queue_max_bytes,
            },
            parallel: (cfg.ordering == crate::config::Ordering::None)
                .then(|| cfg.max_in_flight.unwrap_or(16)),
            metrics: metrics.for_route(&cfg.name),
        })
    }
}

/// The configured routes, indexed by path prefix. A reload replaces it whole
/// (inside [`crate::live::Live`]).
pub struct RouteTable {
    /// Longest prefix first.
    routes: Vec<Route>,
    /// Indexes into `routes` by path prefix.
    index: RouteIndex,
}

impl Default for RouteTable {
    fn default() -> RouteTable {
        RouteTable {
            routes: Vec::new(),
            index: RouteIndex::new(std::iter::empty()),
        }
    }
}

impl RouteTable {
    pub fn new(mut routes: Vec<Route>) -> RouteTable {
        routes.sort_by_key(|r| std::cmp::Reverse(r.target.prefix.len()));
        let index = RouteIndex::new(routes.iter().map(|r| r.target.prefix.as_str()));
        RouteTable { routes, index }
    }

    /// The route a request goes to, if any (SPEC §3: never CONNECT, never a path
    /// that is not origin-form or has dot segments).
    pub(crate) fn find(&self, method: &Method, path: &str) -> Option<&Route> {
        if method == Method::CONNECT || !path.starts_with('/') || forward::has_dot_segments(path) {
            return None;
        }
        self.index.find(path).and_then(|i| self.routes.get(i))
    }

    /// The route named `name`.
    pub fn get(&self, name: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.name == name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter()
    }

    /// After a reload: each route whose name and upstream are unchanged keeps
    /// `old`'s protection state (its requests in flight, a hold, its breaker),
    /// adjusted to its new keys; a new route or a new upstream starts afresh
    /// (a new upstream's counters go on from the old one's: they never go down).
    pub fn carry_over(&mut self, old: &RouteTable) {
        for r in &mut self.routes {
            let Some(o) = old.get(&r.name) else { continue };
            if o.target.scheme == r.target.scheme
                && o.target.authority == r.target.authority
                && o.target.base_path == r.target.base_path
            {
                o.protect.reconfigured(&o.protect_cfg, &r.protect_cfg);
                r.protect = o.protect.clone();
            } else {
                r.protect = Arc::new(protect::Guard::continuing(&o.protect, &r.protect_cfg));
            }
        }
    }
}

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
