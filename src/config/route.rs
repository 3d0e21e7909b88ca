//! `[[route]]` (SPEC §9): a route, its delivery (direct or queued), its retry
//! schedule, its protections, and the rules between routes.

use super::*;

/// The longest `max_retry_after`, `breaker.window` and `breaker.cool_down`
/// (SPEC §9): one day.
pub const MAX_PROTECT_DURATION: std::time::Duration = std::time::Duration::from_secs(86_400);

/// A route as SPEC §11's one rule of kinds sees it: its name, its lease and
/// whether it is queued — a configured route, a running one, or the messages
/// a state holds for a name and lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteKind<'a> {
    /// The route's name (its history: dedup records or messages).
    pub name: &'a str,
    /// The lease it is fenced by.
    pub lease: &'a str,
    /// Queued (SPEC §11), or direct.
    pub queued: bool,
}

impl<'a> RouteKind<'a> {
    /// What a configured route is.
    pub fn of(r: &'a RouteConfig) -> RouteKind<'a> {
        RouteKind {
            name: &r.name,
            lease: r.lease.as_str(),
            queued: r.delivery == Delivery::Queued,
        }
    }
}

/// SPEC §11, the one rule of kinds: a lease's requests are all queued or all
/// direct, and so is a route name's history — else a direct request could
/// overtake a queued message, or a key done on one kind be delivered again by
/// the other. The first queued and direct pair sharing a lease or a name, if
/// any. Used on a config (its routes), a reload (the running routes with the
/// new ones) and a state (the messages it holds, as queued routes, with the
/// routes to run).
pub fn mixed_delivery<'a>(
    routes: impl IntoIterator<Item = RouteKind<'a>>,
) -> Option<(RouteKind<'a>, RouteKind<'a>)> {
    let all: Vec<RouteKind<'a>> = routes.into_iter().collect();
    all.iter().filter(|q| q.queued).find_map(|q| {
        all.iter()
            .find(|d| !d.queued && (d.lease == q.lease || d.name == q.name))
            .map(|d| (*q, *d))
    })
}

/// `[[route]] derive_key`: the dedup key used when the worker sends none (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DeriveKey {
    /// A hash of route, method, path and query, and body: identical requests
    /// deduplicate.
    #[default]
    Content,
    /// A fresh key each time; nothing is recorded.
    None,
}

/// `[[route]] delivery`: forward while the worker waits, or accept into the
/// queue and deliver later (SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    /// Forwarded while the worker waits (SPEC §3–§6).
    #[default]
    Direct,
    /// Written durably, answered 202, delivered in order with retries (SPEC §11).
    Queued,
}

/// `[[route]] ordering` of a queued route (SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// One message of a lease at a time, in acceptance order.
    #[default]
    Lease,
    /// An epoch's messages in parallel (up to `max_in_flight`, else 16); the
    /// next epoch's only once none of this one is left.
    None,
}

/// `[[route]] retry` of a queued route: the waits between its attempts.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// The wait before attempt n+1 is `schedule[n-1]` (±20%); after the last,
    /// the message has failed.
    #[serde(deserialize_with = "duration::list")]
    pub schedule: Vec<Duration>,
}

impl Default for RetryConfig {
    /// Svix's shape: 5 s, 30 s, 5 min, 30 min, 2 h.
    fn default() -> RetryConfig {
        RetryConfig {
            schedule: [5, 30, 300, 1800, 7200]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
        }
    }
}

/// `[[route]] in_doubt`: what a repeat of an in-doubt key gets (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum InDoubtPolicy {
    /// 409 `dedup_in_doubt` until an operator resolves the key.
    #[default]
    Reject,
    /// Forward it again: for upstreams that tolerate a duplicate.
    Resend,
}

impl DeriveKey {
    /// The config's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DeriveKey::Content => "content",
            DeriveKey::None => "none",
        }
    }
}

impl InDoubtPolicy {
    /// The config's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            InDoubtPolicy::Reject => "reject",
            InDoubtPolicy::Resend => "resend",
        }
    }
}

/// `[[route]]`: one path prefix mapped to an upstream and the lease that fences it
/// (SPEC §3, §9).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Names the route in logs, metrics, dedup scopes and admin calls.
    pub name: String,
    /// Requests whose path starts with this go to this route.
    pub path_prefix: String,
    /// Upstream base URL; the prefix is replaced by its path.
    pub upstream: String,
    /// The lease whose epochs admit requests on this route (SPEC §4).
    pub lease: LeaseName,
    /// Bound on one upstream exchange; past it the outcome is in doubt (SPEC §6).
    #[serde(
        default = "d_timeout",
        alias = "timeout",
        deserialize_with = "duration::ms"
    )]
    pub timeout_ms: u64,
    /// Whether `X-Lease-Token` must be sent and checked (SPEC §4 rule 2).
    #[serde(default = "d_true")]
    pub require_token: bool,
    /// Header carrying the dedup key upstream (SPEC §3).
    #[serde(default = "d_dedup_header")]
    pub dedup_header: String,
    /// Key used when the worker sends none.
    #[serde(default)]
    pub derive_key: DeriveKey,
    /// What a repeat of an in-doubt key gets.
    #[serde(default)]
    pub in_doubt: InDoubtPolicy,
    /// Upstream statuses that delete the dedup record instead of keeping it `done`, so
    /// a retry is forwarded.
    #[serde(default = "d_retryable")]
    pub retryable_statuses: Vec<u16>,
    /// Larger request bodies are refused (413).
    #[serde(default = "d_mib")]
    pub max_body_bytes: usize,
    /// Larger responses are not kept for replay; a repeat gets 409 `dedup_done`.
    #[serde(default = "d_mib")]
    pub max_replay_bytes: usize,
    /// A queued route's messages whose request is kept, and their bytes: past
    /// either a new message is refused (503 `queue_full`, SPEC §11); none: only
    /// `[state]`'s bound over every route.
    pub queue_max_messages: Option<u64>,
    /// See `queue_max_messages`.
    pub queue_max_bytes: Option<u64>,
    /// How long a raise waits for lower epochs in flight before aborting them (SPEC
    /// §5); absent: `timeout_ms`.
    #[serde(
        default,
        alias = "drain_timeout",
        deserialize_with = "duration::ms_opt"
    )]
    pub drain_timeout_ms: Option<u64>,
    /// Headers set on every forwarded request; `${NAME}` reads the environment.
    /// Values are secrets: never logged or printed.
    #[serde(default)]
    pub upstream_headers: BTreeMap<String, String>,
    /// PEM bundle of extra CA certificates trusted for this route's https upstream.
    pub ca_file: Option<PathBuf>,
    /// Protecting the destination (SPEC §9, `crate::protect`): requests at the
    /// upstream at once; beyond it a request is refused (503 `upstream_held`).
    pub max_in_flight: Option<usize>,
    /// Hold the route while a 429/503's `Retry-After` runs.
    #[serde(default = "d_true")]
    pub honor_retry_after: bool,
    /// The longest hold a `Retry-After` sets (the worker still gets it as sent).
    #[serde(default = "d_max_retry_after", deserialize_with = "duration::human")]
    pub max_retry_after: Duration,
    /// The route's circuit breaker; absent: none.
    pub breaker: Option<BreakerConfig>,
    /// Requests to the upstream per second, minute or hour (`"50/s"`), per
    /// instance: beyond it a direct request is refused (503 `upstream_held`,
    /// detail `rate`) and a queued attempt waits its turn. Absent: none.
    #[serde(default, deserialize_with = "crate::protect::rate::deserialize")]
    pub rate: Option<crate::protect::rate::Rate>,
    /// How many requests may go at once after a quiet spell (the bucket's
    /// size); default a second's worth of `rate`, at least 1.
    pub rate_burst: Option<u32>,
    /// PEM certificate chain shown to an https upstream that asks for one
    /// (mutual TLS); needs `client_key`. Re-read on reload.
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `client_cert`. Never logged or printed.
    pub client_key: Option<PathBuf>,
    /// Standard Webhooks secrets (`whsec_…`, `${NAME}` reads the environment):
    /// when set, every forwarded request is signed with each, and its body is
    /// read whole first (up to `max_body_bytes`). Never logged or printed.
    #[serde(default, deserialize_with = "secrets::list")]
    pub signing_secrets: Vec<String>,
    /// `"queued"`: accept durably, answer 202, deliver in order with retries
    /// (SPEC §11).
    #[serde(default)]
    pub delivery: Delivery,
    /// A queued route's delivery order.
    #[serde(default)]
    pub ordering: Ordering,
    /// A queued route's retry schedule.
    #[serde(default)]
    pub retry: RetryConfig,
}

/// `[[route]] breaker`: `failures` consecutive upstream failures within `window`
/// open it for `cool_down`; then one probe request decides (SPEC §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures that open it.
    #[serde(default = "d_breaker_failures")]
    pub failures: u32,
    /// They must fall within this long of each other.
    #[serde(default = "d_breaker_window", deserialize_with = "duration::human")]
    pub window: Duration,
    /// How long it stays open before a probe.
    #[serde(default = "d_breaker_cool_down", deserialize_with = "duration::human")]
    pub cool_down: Duration,
}

fn d_max_retry_after() -> Duration {
    Duration::from_secs(300)
}

fn d_breaker_failures() -> u32 {
    5
}

fn d_breaker_window() -> Duration {
    Duration::from_secs(10)
}

fn d_breaker_cool_down() -> Duration {
    Duration::from_secs(5)
}

impl std::fmt::Debug for RouteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteConfig")
            .field("name", &self.name)
            .field("path_prefix", &self.path_prefix)
            .field("upstream", &self.upstream)
            .field("lease", &self.lease)
            .field(
                "upstream_headers",
                &self.upstream_headers.keys().collect::<Vec<_>>(),
            )
            .field("client_cert", &self.client_cert)
            .field("signing_secrets", &self.signing_secrets.len())
            .finish_non_exhaustive()
    }
}

fn d_timeout() -> u64 {
    10_000
}

fn d_true() -> bool {
    true
}

fn d_dedup_header() -> String {
    "Idempotency-Key".into()
}

fn d_retryable() -> Vec<u16> {
    vec![429, 502, 503, 504]
}

fn d_mib() -> usize {
    1 << 20
}

impl RouteConfig {
    /// `timeout_ms` as a [`Duration`].
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// How long a drain waits (SPEC §5): `drain_timeout_ms`, else `timeout_ms`.
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms.unwrap_or(self.timeout_ms))
    }

    /// The keys that protect the destination (SPEC §9), each error naming its key.
    /// Durations are bounded ([`MAX_PROTECT_DURATION`]): an instant that far
    /// ahead must stay representable (a huge `cool_down` once panicked).
    pub(super) fn validate_protection(&self) -> Result<(), String> {
        let name = &self.name;
        if self.max_in_flight == Some(0) {
            return Err(format!(
                "route {name:?}: max_in_flight must be at least 1 (leave it out for no limit)"
            ));
        }
        if self.max_retry_after.is_zero() {
            return Err(format!(
                "route {name:?}: max_retry_after must be positive (honor_retry_after = false turns holding off)"
            ));
        }
        if self.max_retry_after > MAX_PROTECT_DURATION {
            return Err(format!(
                "route {name:?}: max_retry_after must be at most \"1d\""
            ));
        }
        match (self.rate, self.rate_burst) {
            (None, Some(_)) => {
                return Err(format!(
                    "route {name:?}: rate_burst needs rate (e.g. rate = \"50/s\")"
                ))
            }
            (Some(_), Some(0)) => {
                return Err(format!("route {name:?}: rate_burst must be at least 1"))
            }
            _ => {}
        }
        if let Some(b) = &self.breaker {
            if b.failures == 0 {
                return Err(format!(
                    "route {name:?}: breaker.failures must be at least 1 (leave breaker out for none)"
                ));
            }
            if b.window.is_zero() || b.cool_down.is_zero() {
                return Err(format!(
                    "route {name:?}: breaker.window and breaker.cool_down must be positive"
                ));
            }
            if b.window > MAX_PROTECT_DURATION || b.cool_down > MAX_PROTECT_DURATION {
                return Err(format!(
                    "route {name:?}: breaker.window and breaker.cool_down must be at most \"1d\""
                ));
            }
        }
        Ok(())
    }

    /// `signing_secrets` with `${NAME}` read from the environment (none: the
    /// route does not sign).
    pub fn resolve_signing_secrets(&self) -> Result<Vec<String>, String> {
        self.signing_secrets
            .iter()
            .enumerate()
            .map(|(i, raw)| from_env(&format!("route {:?}: signing_secrets[{i}]", self.name), raw))
            .collect()
    }

    /// The route's Standard Webhooks signer, if it signs: secrets resolved and
    /// decoded (an error names the secret by position, never by value).
    pub fn signer(&self) -> Result<Option<crate::forward::sign::Signer>, String> {
        if self.signing_secrets.is_empty() {
            return Ok(None);
        }
        crate::forward::sign::Signer::new(&self.resolve_signing_secrets()?)
            .map(Some)
            .map_err(|e| format!("route {:?}: {e}", self.name))
    }

    /// The route's TLS client certificate and key, read and checked to match
    /// (none: no client certificate).
    pub fn client_identity(&self) -> Result<Option<crate::forward::client_auth::Identity>, String> {
        match (&self.client_cert, &self.client_key) {
            (None, None) => Ok(None),
            (Some(c), Some(k)) => crate::forward::client_auth::Identity::load(c, k)
                .map(Some)
                .map_err(|e| format!("route {:?}: {e}", self.name)),
            _ => Err(format!(
                "route {:?}: client_cert and client_key go together: set both or neither",
                self.name
            )),
        }
    }

    /// Resolves `upstream_headers`, reading `${NAME}` values from the environment.
    pub fn resolve_upstream_headers(&self) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        let mut out = Vec::new();
        for (name, raw) in &self.upstream_headers {
            let hn = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
                format!(
                    "route {:?}: upstream_headers: invalid header name {name:?}",
                    self.name
                )
            })?;
            let value = match raw.strip_prefix("${").and_then(|r| r.strip_suffix('}')) {
                Some(var) => std::env::var(var).map_err(|_| {
                    format!(
                        "route {:?}: upstream_headers.{name} reads ${{{var}}}, which is not set in the environment",
                        self.name
                    )
                })?,
                None => raw.clone(),
            };
            let mut hv = HeaderValue::from_str(&value).map_err(|_| {
                format!(
                    "route {:?}: upstream_headers.{name}: value is not a valid header value",
                    self.name
                )
            })?;
            hv.set_sensitive(true);
            out.push((hn, hv));
        }
        Ok(out)
    }
}

impl Config {
    pub(super) fn validate_routes(&self) -> Result<(), String> {
        if self.routes.is_empty() {
            return Err("no [[route]] configured: fencegate would refuse every request".into());
        }
        let mut names = HashSet::new();
        let mut prefixes = HashSet::new();
        for r in &self.routes {
            LeaseName::parse(&r.name).map_err(|_| {
                format!("route name {:?} must match [a-z0-9][a-z0-9._-]{{0,62}} (it appears in admin URLs)", r.name)
            })?;
            if !names.insert(r.name.as_str()) {
                return Err(format!("route name {:?} is used twice", r.name));
            }
            if !r.path_prefix.starts_with('/') || !r.path_prefix.ends_with('/') {
                return Err(format!(
                    "route {:?}: path_prefix {:?} must start and end with '/'",
                    r.name, r.path_prefix
                ));
            }
            if !prefixes.insert(r.path_prefix.as_str()) {
                return Err(format!(
                    "path_prefix {:?} is used by two routes",
                    r.path_prefix
                ));
            }
            let uri: Uri = r.upstream.parse().map_err(|_| {
                format!("route {:?}: upstream {:?} is not a URL", r.name, r.upstream)
            })?;
            match uri.scheme_str() {
                Some("http" | "https") => {}
                _ => {
                    return Err(format!(
                        "route {:?}: upstream {:?} must be http:// or https://",
                        r.name, r.upstream
                    ))
                }
            }
            if uri.authority().is_none() || uri.query().is_some() {
                return Err(format!(
                    "route {:?}: upstream {:?} needs a host and no query",
                    r.name, r.upstream
                ));
            }
            if r.timeout_ms == 0 {
                return Err(format!("route {:?}: timeout_ms must be positive", r.name));
            }
            HeaderName::from_bytes(r.dedup_header.as_bytes()).map_err(|_| {
                format!(
                    "route {:?}: dedup_header {:?} is not a header name",
                    r.name, r.dedup_header
                )
            })?;
            for s in &r.retryable_statuses {
                if !(100..=599).contains(s) {
                    return Err(format!(
                        "route {:?}: retryable status {s} is not an HTTP status",
                        r.name
                    ));
                }
            }
            r.resolve_upstream_headers()?;
            r.validate_protection()?;
            if let Some(ca) = &r.ca_file {
                if !ca.exists() {
                    return Err(format!(
                        "route {:?}: ca_file {} does not exist",
                        r.name,
                        ca.display()
                    ));
                }
            }
            if r.client_identity()?.is_some() && uri.scheme_str() != Some("https") {
                return Err(format!(
                    "route {:?}: client_cert needs an https:// upstream (it is shown in the TLS handshake)",
                    r.name
                ));
            }
            if r.signer()?.is_some() {
                let signed = crate::forward::sign::SIGNED_HEADERS;
                if let Some(h) = r
                    .upstream_headers
                    .keys()
                    .find(|h| signed.iter().any(|s| s.as_str().eq_ignore_ascii_case(h)))
                {
                    return Err(format!(
                        "route {:?}: upstream_headers sets {h}, which signing_secrets sets on every request",
                        r.name
                    ));
                }
            }
            self.validate_queued(r)?;
        }
        // SPEC §11: the queue's order is the lease's epoch order only if no
        // direct request of the lease can overtake a queued message (once,
        // over every route).
        if let Some((q, d)) = mixed_delivery(self.routes.iter().map(RouteKind::of)) {
            return Err(format!(
                "lease {}: route {:?} is queued and route {:?} is direct; a lease's routes are all queued or all direct (a direct request could reach a destination before an older queued message)",
                q.lease, q.name, d.name
            ));
        }
        Ok(())
    }

    /// SPEC §11: a queued route's keys, and what it may not share.
    pub(super) fn validate_queued(&self, r: &RouteConfig) -> Result<(), String> {
        if r.delivery != Delivery::Queued {
            return Ok(());
        }
        if let Some(o) = self.routes.iter().find(|o| {
            o.lease == r.lease && o.delivery == Delivery::Queued && o.ordering != r.ordering
        }) {
            return Err(format!(
                "lease {}: queued routes {:?} and {:?} order it differently; a lease's queue has one ordering",
                r.lease, r.name, o.name
            ));
        }
        if r.retry.schedule.len() > 20 {
            return Err(format!(
                "route {:?}: retry.schedule has {} steps; at most 20",
                r.name,
                r.retry.schedule.len()
            ));
        }
        if let Some(d) = r
            .retry
            .schedule
            .iter()
            .find(|d| d.is_zero() || **d > Duration::from_secs(7 * 86_400))
        {
            return Err(format!(
                "route {:?}: retry.schedule step {} must be positive and at most 7 days",
                r.name,
                humantime::format_duration(*d)
            ));
        }
        Ok(())
    }
}
