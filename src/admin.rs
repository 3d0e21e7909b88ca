//! The admin listener (SPEC §8): health, readiness, metrics, lease state, the
//! dedup records an operator may need to list, inspect or resolve, and — for a
//! browser asking for `/` — the operator's page ([`page`]).
//!
//! HTTP conventions: every `GET` endpoint answers `HEAD`; a known path with
//! another method is 405 with `Allow`; `GET /` for a non-browser client is the
//! endpoint index. Mutating calls need the admin token: as `Authorization:
//! Bearer`, or for the page's forms as its session cookie plus the form token
//! ([`session`]).

mod deliveries;
mod form;
mod guesses;
pub mod markup;
pub mod page;
pub(crate) mod session;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{json, Value};

use crate::clock::rfc3339;
use crate::dedup::{ms_to_system, DedupKey, Resolution, Resolved, State};
use crate::epoch::TokenHash;
use crate::error::AdminError;
use crate::metrics::Metrics;
use crate::shared::{Mode, Shared};
use crate::state::{ListCursor, Listing, Record, RecordKey};
use page::{
    Access, KeyDetail, KeyRecord, KeyRow, LeaseRow, MemberRow, Notice, PageView, ShardRow,
    StoreHealth, Tenure,
};
use session::Session;

/// The admin API and operator page (SPEC §8): leases, in-doubt keys and their
/// resolution, reload, cluster view; mutating calls need the admin token.
pub struct Admin {
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    /// Drawn at start-up: the page's sessions are this process's only.
    session_secret: String,
    store_timeout: Duration,
    /// Every cluster member this instance has seen alive, and when it last did:
    /// a member that stops (killed, or gone from the heartbeat) is shown gone.
    members_seen: std::sync::Mutex<std::collections::BTreeMap<String, std::time::SystemTime>>,
    /// Wrong admin tokens per client address: guessing is slowed.
    guesses: guesses::Guesses,
}

/// The admin request's client address (a request extension).
#[derive(Clone, Copy)]
struct Client(std::net::IpAddr);

/// The admin endpoints, for routing and for the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint<'a> {
    Index,
    Healthz,
    Livez,
    Readyz,
    Metrics,
    Leases,
    Routes,
    Cluster,
    OpenApi,
    DedupList,
    DedupGet(&'a str, &'a str),
    DedupResolve(&'a str, &'a str),
    Login,
    Logout,
    Deliveries,
    DeliveryGet(&'a str, &'a str),
    DeliveryRetry(&'a str, &'a str),
    DeliveryDrop(&'a str, &'a str),
    /// Pause (`true`) or resume a queued route's deliveries.
    RoutePause(&'a str, bool),
    /// Pause (`true`) or resume a lease's deliveries.
    LeasePause(&'a str, bool),
    /// Make a bulk job (`retry` or `drop`).
    JobCreate(&'a str),
    /// The bulk jobs.
    Jobs,
    /// One bulk job.
    Job(&'a str),
}

/// This API's OpenAPI 3.1 description, `GET /v1/openapi.json`: the
/// repository's file, built in so that it cannot differ from the binary.
pub const OPENAPI: &str = include_str!("../docs/openapi.json");

/// Method, path and purpose of each endpoint (the index, `GET /`).
const INDEX: &[(&str, &str, &str)] = &[
    ("GET", "/", "this index; a browser (Accept: text/html) gets the operator's page"),
    ("GET", "/healthz", "the process is up"),
    ("GET", "/livez", "liveness: the process answers; never checks the store or the database, never fails during a shutdown"),
    ("GET", "/readyz", "the lease store and the state backend answer; 503 from the shutdown signal on"),
    ("GET", "/metrics", "Prometheus text"),
    ("GET", "/v1/leases", "per lease: mark, latest known epoch, holder, expiry, in-flight, drains"),
    ("GET", "/v1/routes", "per route: upstream, requests in flight and max_in_flight, a Retry-After hold, the circuit breaker, refusals"),
    ("GET", "/v1/cluster", "this instance's id, the members, the prefix's anchor and, per shard, owner, generation, expiry and leases"),
    ("GET", "/v1/openapi.json", "this API's OpenAPI 3.1 description (docs/openapi.json)"),
    ("GET", "/v1/dedup?state=in_doubt[&route=R][&limit=N][&after=NEXT]", "dedup keys in a state, oldest first; `next` of one page is `after` of the next (admin token)"),
    ("GET", "/v1/dedup/{route}/{key}", "one dedup record"),
    ("POST", "/v1/dedup/{route}/{key}/resolve", "resolve an in-doubt key: {\"outcome\": \"delivered\"|\"not_delivered\"} (admin token)"),
    ("GET", "/v1/deliveries[?route=R][&lease=L][&status=S][&limit=N]", "queued messages (SPEC §11), by route and key (admin token)"),
    ("GET", "/v1/deliveries/{route}/{key}", "one queued message: status, attempts, last status and error, next attempt"),
    ("POST", "/v1/deliveries/{route}/{key}/retry", "a pending message now, or a failed one again at the end of its lease's queue (admin token)"),
    ("POST", "/v1/deliveries/{route}/{key}/drop", "drop a pending or failed message; the ones behind it go on (admin token)"),
    ("POST", "/v1/routes/{route}/pause", "pause a queued route's deliveries: acceptances go on, no attempt starts (admin token)"),
    ("POST", "/v1/routes/{route}/resume", "resume a queued route's deliveries (admin token)"),
    ("POST", "/v1/leases/{lease}/pause", "pause a lease's queued deliveries, whatever their route (admin token)"),
    ("POST", "/v1/leases/{lease}/resume", "resume a lease's queued deliveries (admin token)"),
    ("POST", "/v1/delivery-jobs/retry?[route=R][&lease=L][&since=T][&until=T][&by=B]", "retry every failed message matching, in the background: 202 and the job (admin token)"),
    ("POST", "/v1/delivery-jobs/drop?status=pending|failed[&route=R][&lease=L][&since=T][&until=T][&by=B]", "drop every message matching, in the background: 202 and the job (admin token)"),
    ("GET", "/v1/delivery-jobs", "bulk jobs, newest first, with their progress (admin token)"),
    ("GET", "/v1/delivery-jobs/{id}", "one bulk job (admin token)"),
    ("POST", "/login", "the operator page's login form"),
    ("POST", "/logout", "ends the operator page's session"),
];

impl<'a> Endpoint<'a> {
    fn of(path: &'a str) -> Option<Endpoint<'a>> {
        let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        Some(match segs.as_slice() {
            [""] => Endpoint::Index,
            ["healthz"] => Endpoint::Healthz,
            ["livez"] => Endpoint::Livez,
            ["readyz"] => Endpoint::Readyz,
            ["metrics"] => Endpoint::Metrics,
            ["login"] => Endpoint::Login,
            ["logout"] => Endpoint::Logout,
            ["v1", "leases"] => Endpoint::Leases,
            ["v1", "routes"] => Endpoint::Routes,
            ["v1", "cluster"] => Endpoint::Cluster,
            ["v1", "openapi.json"] => Endpoint::OpenApi,
            ["v1", "dedup"] => Endpoint::DedupList,
            ["v1", "dedup", route, key] => Endpoint::DedupGet(route, key),
            ["v1", "dedup", route, key, "resolve"] => Endpoint::DedupResolve(route, key),
            ["v1", "deliveries"] => Endpoint::Deliveries,
            ["v1", "deliveries", route, key] => Endpoint::DeliveryGet(route, key),
            ["v1", "deliveries", route, key, "retry"] => Endpoint::DeliveryRetry(route, key),
            ["v1", "deliveries", route, key, "drop"] => Endpoint::DeliveryDrop(route, key),
            ["v1", "routes", route, "pause"] => Endpoint::RoutePause(route, true),
            ["v1", "routes", route, "resume"] => Endpoint::RoutePause(route, false),
            ["v1", "leases", lease, "pause"] => Endpoint::LeasePause(lease, true),
            ["v1", "leases", lease, "resume"] => Endpoint::LeasePause(lease, false),
            ["v1", "delivery-jobs"] => Endpoint::Jobs,
            ["v1", "delivery-jobs", action @ ("retry" | "drop")] => Endpoint::JobCreate(action),
            ["v1", "delivery-jobs", id] => Endpoint::Job(id),
            _ => return None,
        })
    }

    /// The one method it takes (`GET` ones take `HEAD` too).
    fn method(self) -> Method {
        match self {
            Endpoint::DedupResolve(..)
            | Endpoint::DeliveryRetry(..)
            | Endpoint::DeliveryDrop(..)
            | Endpoint::RoutePause(..)
            | Endpoint::LeasePause(..)
            | Endpoint::JobCreate(..)
            | Endpoint::Login
            | Endpoint::Logout => Method::POST,
            _ => Method::GET,
        }
    }
}

fn with_type(
    body: impl Into<Bytes>,
    status: StatusCode,
    ctype: &'static str,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn json_response(status: StatusCode, v: Value) -> Response<Full<Bytes>> {
    with_type(
        serde_json::to_vec_pretty(&v).unwrap_or_default(),
        status,
        "application/json",
    )
}

fn html(status: StatusCode, body: markup::Html) -> Response<Full<Bytes>> {
    let mut r = with_type(body.into_string(), status, "text/html; charset=utf-8");
    let h = r.headers_mut();
    // The page loads nothing from elsewhere and runs its one script only (by
    // hash); it may not be framed.
    static CSP: std::sync::OnceLock<HeaderValue> = std::sync::OnceLock::new();
    let csp = CSP.get_or_init(|| {
        HeaderValue::from_str(&format!(
            "default-src 'none'; style-src 'unsafe-inline'; script-src {}; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
            page::script_hash()
        ))
        .unwrap_or_else(|_| HeaderValue::from_static("default-src 'none'"))
    });
    h.insert(header::CONTENT_SECURITY_POLICY, csp.clone());
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Not `no-referrer`: with it, browsers send `Origin: null` on the page's own
    // form posts, which the same-origin check must refuse.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    r
}

/// 303 to `location` (after a form's POST), with optional extra headers.
fn see_other(location: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(v) = HeaderValue::from_str(location) {
        r.headers_mut().insert(header::LOCATION, v);
    }
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

/// Whether the client asked for HTML (a browser) rather than JSON.
fn wants_html(h: &HeaderMap) -> bool {
    h.get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/html"))
}

fn is_form(h: &HeaderMap) -> bool {
    h.get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"))
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, AdminError> {
    Ok(Limited::new(req.into_body(), 4096)
        .collect()
        .await
        .map_err(|_| AdminError::BadRequest("body unreadable or over 4 KiB"))?
        .to_bytes())
}

fn form_field(pairs: &[(String, String)], name: &str) -> Option<String> {
    pairs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

/// A route's upstream for the admin API and the page: host and port only (an
/// authority's userinfo would be a credential).
fn upstream_shown(t: &crate::forward::Target) -> String {
    let port = t
        .authority
        .port()
        .map_or(String::new(), |p| format!(":{p}"));
    format!("{}://{}{port}{}", t.scheme, t.authority.host(), t.base_path)
}

fn key_json(k: &RecordKey, r: &Record) -> Value {
    json!({
        "route": k.route,
        "key": k.key,
        "state": r.state.as_str(),
        "epoch": r.epoch.get(),
        "created_at": rfc3339(ms_to_system(r.created_ms)),
        "updated_at": rfc3339(ms_to_system(r.updated_ms)),
        "method": r.request.as_ref().map(|q| &q.method),
        "path": r.request.as_ref().map(|q| &q.path),
    })
}

impl Admin {
    /// The admin API over the running instance; `store_timeout` bounds its store calls.
    pub fn new(shared: Arc<Shared>, metrics: Arc<Metrics>, store_timeout: Duration) -> Admin {
        Admin {
            shared,
            metrics,
            session_secret: crate::lease::acquire::fresh_token(),
            store_timeout,
            members_seen: std::sync::Mutex::default(),
            guesses: guesses::Guesses::default(),
        }
    }

    /// The admin token (hashed) as the last reload left it (SPEC §8).
    fn token(&self) -> Option<TokenHash> {
        self.shared.live.current().admin_token
    }

    /// The page's session for the current admin token, when there is one (a
    /// reload that changes the token ends every session).
    fn session(&self) -> Option<Session> {
        self.token().map(|t| Session::new(&self.session_secret, &t))
    }

    /// Answers one admin request; every failure becomes its SPEC §7 response.
    pub async fn handle(
        &self,
        mut req: Request<Incoming>,
        client: std::net::IpAddr,
    ) -> Response<Full<Bytes>> {
        let head = req.method() == Method::HEAD;
        req.extensions_mut().insert(Client(client));
        let mut resp = self.route(req).await.unwrap_or_else(|e| e.to_response());
        if head {
            // What GET would send, without the body.
            let len = hyper::body::Body::size_hint(resp.body())
                .exact()
                .unwrap_or(0);
            resp.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
            *resp.body_mut() = Full::new(Bytes::new());
        }
        resp
    }

    async fn route(&self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, AdminError> {
        let path = req.uri().path().to_owned();
        let ep = Endpoint::of(&path).ok_or(AdminError::NoSuchEndpoint)?;
        let method = match req.method() {
            &Method::HEAD => Method::GET,
            m => m.clone(),
        };
        if method != ep.method() {
            return Err(AdminError::MethodNotAllowed(
                if ep.method() == Method::GET {
                    "GET, HEAD"
                } else {
                    "POST"
                },
            ));
        }
        Ok(match ep {
            Endpoint::Index if wants_html(req.headers()) => self.page(&req).await?,
            Endpoint::Index => self.index(),
            Endpoint::Healthz => json_response(StatusCode::OK, json!({"status": "ok"})),
            // Only "this process answers": a liveness probe that followed the
            // store, the database or a drain would restart healthy instances.
            Endpoint::Livez => json_response(StatusCode::OK, json!({"status": "alive"})),
            Endpoint::Readyz => self.readyz().await,
            Endpoint::Metrics => with_type(
                self.metrics.render(),
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            ),
            Endpoint::Leases => self.leases(),
            Endpoint::Routes => self.routes(),
            Endpoint::Cluster => self.cluster(),
            Endpoint::OpenApi => with_type(OPENAPI, StatusCode::OK, "application/json"),
            Endpoint::DedupList => self.dedup_list(&req).await?,
            Endpoint::DedupGet(route, key) => self.dedup_get(route, key).await?,
            Endpoint::DedupResolve(route, key) => {
                let (route, key) = (route.to_string(), key.to_string());
                if req.headers().contains_key(header::AUTHORIZATION) || !is_form(req.headers()) {
                    self.authorize(&req)?;
                    let body = read_body(req).await?;
                    self.dedup_resolve(&route, &key, &body).await?
                } else {
                    self.resolve_form(req, &route, &key).await
                }
            }
            Endpoint::Deliveries => self.deliveries(&req).await?,
            Endpoint::DeliveryGet(route, key) => self.delivery(route, key).await?,
            Endpoint::DeliveryRetry(route, key) | Endpoint::DeliveryDrop(route, key) => {
                let retry = matches!(ep, Endpoint::DeliveryRetry(..));
                let (route, key) = (route.to_string(), key.to_string());
                // As for a resolve: the page's forms carry no Authorization.
                if req.headers().contains_key(header::AUTHORIZATION) || !is_form(req.headers()) {
                    self.authorize(&req)?;
                    self.delivery_edit(&route, &key, retry).await?
                } else {
                    self.delivery_form(req, &route, &key, retry).await
                }
            }
            Endpoint::RoutePause(name, on) | Endpoint::LeasePause(name, on) => {
                self.authorize(&req)?;
                let name = String::from_utf8_lossy(&form::decode_segment(name)).into_owned();
                let what = match ep {
                    Endpoint::RoutePause(..) => crate::queue::pause::Pausable::Route(name),
                    _ => crate::queue::pause::Pausable::Lease(name),
                };
                self.pause(what, on).await?
            }
            Endpoint::JobCreate(action) => {
                let (action, query) = (
                    action.to_owned(),
                    req.uri().query().unwrap_or("").to_owned(),
                );
                // As for a resolve: the page's form carries no Authorization.
                if req.headers().contains_key(header::AUTHORIZATION) || !is_form(req.headers()) {
                    self.authorize(&req)?;
                    self.job_create(&action, &query).await?
                } else {
                    self.job_form(req, &action, &query).await
                }
            }
            Endpoint::Jobs => {
                self.authorize(&req)?;
                self.jobs().await?
            }
            Endpoint::Job(id) => {
                self.authorize(&req)?;
                self.job(id).await?
            }
            Endpoint::Login => self.login(req).await?,
            Endpoint::Logout => {
                let mut r = see_other("/");
                r.headers_mut()
                    .insert(header::SET_COOKIE, Session::clear_cookie());
                r
            }
        })
    }

    /// Whether `req`'s client may present a token now ([`guesses`]).
    fn may_guess<B>(&self, req: &Request<B>) -> Result<(), AdminError> {
        match req.extensions().get::<Client>() {
            Some(c) => self.guesses.allow(c.0).map_err(AdminError::TooManyAttempts),
            None => Ok(()),
        }
    }

    /// `req`'s client presented a wrong token.
    fn guessed_wrong<B>(&self, req: &Request<B>) {
        if let Some(c) = req.extensions().get::<Client>() {
            self.guesses.failed(c.0);
        }
    }

    fn authorize<B>(&self, req: &Request<B>) -> Result<(), AdminError> {
        let expected = self.token().ok_or(AdminError::Disabled)?;
        self.may_guess(req)?;
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match presented {
            Some(t) if expected.matches(&TokenHash::of(t.as_bytes())) => Ok(()),
            Some(_) => {
                self.guessed_wrong(req);
                Err(AdminError::Unauthorized)
            }
            None => Err(AdminError::Unauthorized),
        }
    }

    fn index(&self) -> Response<Full<Bytes>> {
        let endpoints: Vec<Value> = INDEX
            .iter()
            .map(|(m, p, what)| json!({"method": m, "path": p, "what": what}))
            .collect();
        json_response(
            StatusCode::OK,
            json!({"service": "fencegate", "version": env!("CARGO_PKG_VERSION"), "endpoints": endpoints}),
        )
    }

    async fn readyz(&self) -> Response<Full<Bytes>> {
        if self.shared.is_stopping() {
            // Checked first and alone: load balancers must stop sending now,
            // whatever the store says.
            return json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "not_ready", "problems": ["shutting down"]}),
            );
        }
        let mut problems = Vec::new();
        if let Err(e) = self.shared.state.check().await {
            problems.push(format!("state: {e}"));
        }
        let store = self.shared.store.clone();
        let probe = tokio::time::timeout(self.store_timeout, async move {
            store.list("fencegate-readyz-probe/", None).await
        })
        .await;
        match probe {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => problems.push(format!("lease store: {e}")),
            Err(_) => problems.push(format!(
                "lease store: no answer within {} ms",
                self.store_timeout.as_millis()
            )),
        }
        problems.extend(self.shared.fence_problems());
        if let Some(c) = self.shared.mode.cluster() {
            // "I can serve or route": every shard has an owner this instance knows.
            if !c.is_ready() {
                problems.push("cluster: not every shard has a known owner yet".into());
            }
        }
        if problems.is_empty() {
            json_response(StatusCode::OK, json!({"status": "ready"}))
        } else {
            json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "not_ready", "problems": problems}),
            )
        }
    }

    /// SPEC §10.2: this instance's id, the members, the prefix's anchor (the
    /// set-up's gate lease on shard 0: its latest epoch, holder, whether it is
    /// this set-up's, and this member's window of it) and, per shard, its row of
    /// `fencegate_owners` (owner, generation, renewals, expiry on the database's
    /// clock) and leases. A single instance is one shard.
    fn cluster(&self) -> Response<Full<Bytes>> {
        match self.shared.mode.cluster() {
            Some(c) => json_response(
                StatusCode::OK,
                json!({
                    "mode": "cluster",
                    "instance_id": c.id(),
                    "shards": c.shards(),
                    "members": c.members(),
                    "owned": c.owned(),
                    "conflict": c.conflict().map(|c| c.to_string()),
                    "anchor": c.anchor_view(),
                    "shard_map": c.view(),
                }),
            ),
            None => json_response(StatusCode::OK, json!({"mode": "single", "shards": 1})),
        }
    }

    fn leases(&self) -> Response<Full<Bytes>> {
        let fences = self.shared.fences.all();
        let leases: Vec<Value> = fences
            .iter()
            .map(|f| {
                let v = f.view();
                json!({
                    "lease": v.lease.as_str(),
                    "high_water_mark": v.gate.mark.get(),
                    "latest_epoch": v.latest_known.get(),
                    "holder": v.holder,
                    "expires_at": v.expires_at.map(rfc3339),
                    "in_flight": v.gate.in_flight,
                    "in_doubt": v.gate.in_doubt,
                    "drains_started": v.gate.drains_started,
                    "drains_aborted": v.gate.drains_aborted,
                    "store_ok": v.store_ok,
                    "listed_ms_ago": v.listed_ago.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                    "store_error": v.last_error,
                })
            })
            .collect();
        json_response(StatusCode::OK, json!({"leases": leases}))
    }

    /// The page's routes table: at most [`page::ROUTES_SHOWN`], held, open or
    /// full ones first.
    fn route_rows(&self) -> Vec<page::RouteRow> {
        let live = self.shared.live.current();
        let now = tokio::time::Instant::now();
        let mut rows: Vec<page::RouteRow> = live
            .routes
            .iter()
            .map(|r| {
                let v = r.protect.view(&r.protect_cfg, now);
                let t = &r.target;
                page::RouteRow {
                    route: r.name.clone(),
                    upstream: upstream_shown(t),
                    in_flight: v.in_flight,
                    max_in_flight: r.protect_cfg.max_in_flight,
                    held_for: v.held_for,
                    breaker: v.breaker.map(|b| (b.state.as_str(), b.open_for)),
                    refused: v.refused.iter().sum(),
                }
            })
            .collect();
        rows.sort_by_key(|r| (!r.notable(), r.route.clone()));
        rows.truncate(page::ROUTES_SHOWN);
        rows
    }

    /// `GET /v1/routes`: each route's protection of its destination (SPEC §9).
    fn routes(&self) -> Response<Full<Bytes>> {
        let live = self.shared.live.current();
        let now = tokio::time::Instant::now();
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let pauses = self
            .shared
            .queue
            .as_ref()
            .map(|q| q.pauses())
            .unwrap_or_default();
        let since = |ms: Option<u64>| ms.map(|m| rfc3339(ms_to_system(m)));
        let routes: Vec<Value> = live
            .routes
            .iter()
            .map(|r| {
                let (s, v) = (&r.protect_cfg, r.protect.view(&r.protect_cfg, now));
                let t = &r.target;
                let breaker = s.breaker.zip(v.breaker.as_ref()).map(|(c, b)| {
                    json!({
                        "state": b.state.as_str(),
                        "failures": b.failures,
                        "open_for_ms": b.open_for.map(ms),
                        "opened": b.opened,
                        "config": {
                            "failures": c.failures,
                            "window_ms": ms(c.window),
                            "cool_down_ms": ms(c.cool_down),
                        },
                    })
                });
                let refused: serde_json::Map<String, Value> = crate::protect::Reason::ALL
                    .iter()
                    .zip(v.refused)
                    .map(|(k, n)| ((*k).to_owned(), json!(n)))
                    .collect();
                json!({
                    "route": r.name,
                    "path_prefix": t.prefix,
                    "upstream": upstream_shown(t),
                    "lease": r.lease.as_str(),
                    "max_in_flight": s.max_in_flight,
                    "in_flight": v.in_flight,
                    "honor_retry_after": s.honor_retry_after,
                    "max_retry_after_ms": ms(s.max_retry_after),
                    "held_for_ms": v.held_for.map(ms),
                    "breaker": breaker,
                    "rate": s.rate.map(|(rate, burst)| json!({
                        "rate": rate.to_string(),
                        "burst": burst,
                    })),
                    "refused": refused,
                    // SPEC §11: a queued route's deliveries paused, by the
                    // route or by its lease (null: a direct route).
                    "paused": r.queued.then(|| json!({
                        "route": since(pauses.route(&r.name)),
                        "lease": since(pauses.lease(r.lease.as_str())),
                    })),
                })
            })
            .collect();
        json_response(StatusCode::OK, json!({"routes": routes}))
    }

    /// `GET /v1/dedup?state=S[&route=R][&limit=N][&after=NEXT]` (SPEC §8).
    async fn dedup_list<B>(&self, req: &Request<B>) -> Result<Response<Full<Bytes>>, AdminError> {
        self.authorize(req)?;
        let (mut state, mut route, mut limit, mut after) = (None, None, 100usize, None);
        for (name, value) in form::query_pairs(req.uri().query().unwrap_or("")) {
            match name.as_str() {
                "state" => {
                    state = Some(match value.as_str() {
                        "in_doubt" => State::InDoubt,
                        "in_flight" => State::InFlight,
                        "done" => State::Done,
                        _ => {
                            return Err(AdminError::BadRequest(
                                "state must be in_doubt, in_flight or done",
                            ))
                        }
                    })
                }
                "route" => {
                    if !self.shared.has_route(&value) {
                        return Err(AdminError::RouteNotFound(value));
                    }
                    route = Some(value);
                }
                "limit" => {
                    limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or(AdminError::BadRequest("limit must be 1 to 1000"))?
                }
                "after" => {
                    after = Some(
                        ListCursor::parse(&value)
                            .filter(|c| crate::dedup::could_name(&c.key.route, &c.key.key))
                            .ok_or(AdminError::BadRequest(
                                "after must be the `next` of the previous page",
                            ))?,
                    )
                }
                _ => {
                    return Err(AdminError::BadRequest(
                        "unknown parameter: the listing takes state, route, limit and after",
                    ))
                }
            }
        }
        let state = state.ok_or(AdminError::BadRequest(
            "state is required, e.g. state=in_doubt",
        ))?;
        let Listing { records, total } = self
            .shared
            .state
            .list(state, route.as_deref(), after.as_ref(), limit)
            .await?;
        let next = (records.len() == limit)
            .then(|| records.last().map(|(k, r)| cursor(k, r).encode()))
            .flatten();
        let keys: Vec<Value> = records.iter().map(|(k, r)| key_json(k, r)).collect();
        Ok(json_response(
            StatusCode::OK,
            json!({"state": state.as_str(), "total": total, "keys": keys, "next": next}),
        ))
    }

    /// A path's route and key segments: the key percent-decoded.
    fn parse_route_key(&self, route: &str, key: &str) -> Result<DedupKey, AdminError> {
        self.route_key(route, &form::decode_segment(key))
    }

    /// The route named (404 when no route has that name) and the key as given,
    /// decoded already (400 when it is not a key).
    fn route_key(&self, route: &str, key: &[u8]) -> Result<DedupKey, AdminError> {
        if !self.shared.has_route(route) {
            return Err(AdminError::RouteNotFound(route.to_owned()));
        }
        DedupKey::parse(key).map_err(AdminError::DedupKeyMalformed)
    }

    /// The dedup record of `k` on `route` (404 when there is none).
    async fn record(&self, route: &str, k: &DedupKey) -> Result<Record, AdminError> {
        self.shared
            .dedup
            .get(route, k)
            .await?
            .ok_or(AdminError::RecordNotFound)
    }

    async fn dedup_get(&self, route: &str, key: &str) -> Result<Response<Full<Bytes>>, AdminError> {
        let k = self.parse_route_key(route, key)?;
        let r = self.record(route, &k).await?;
        Ok(json_response(
            StatusCode::OK,
            json!({
                "route": route,
                "key": k.as_str(),
                "state": r.state.as_str(),
                "epoch": r.epoch.get(),
                "fingerprint": hex::encode(r.fingerprint),
                "created_at": rfc3339(ms_to_system(r.created_ms)),
                "updated_at": rfc3339(ms_to_system(r.updated_ms)),
                "response_status": r.response.as_ref().map(|s| s.status),
                "response_body_stored": r.response.as_ref().map(|s| s.body.is_some()),
                "method": r.request.as_ref().map(|q| &q.method),
                "path": r.request.as_ref().map(|q| &q.path),
            }),
        ))
    }

    async fn dedup_resolve(
        &self,
        route: &str,
        key: &str,
        body: &[u8],
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Body {
            outcome: Resolution,
        }
        let how = serde_json::from_slice::<Body>(body)
            .map_err(|_| {
                AdminError::BadRequest(
                    r#"body must be {"outcome": "delivered"} or {"outcome": "not_delivered"}"#,
                )
            })?
            .outcome;
        let (k, state) = self.resolve(route, key, how).await?;
        Ok(json_response(
            StatusCode::OK,
            json!({"route": route, "key": k.as_str(), "state": state}),
        ))
    }

    /// Resolves an in-doubt key; the record's new state (`None`: deleted).
    async fn resolve(
        &self,
        route: &str,
        key: &str,
        how: Resolution,
    ) -> Result<(DedupKey, Option<&'static str>), AdminError> {
        let k = self.parse_route_key(route, key)?;
        let owner = self
            .shared
            .owner_of_route(route)
            .ok_or(AdminError::ShardUnavailable)?;
        let state = match self.shared.dedup.resolve(owner, route, &k, how).await? {
            Resolved::Done => Some(State::Done.as_str()),
            Resolved::Deleted => None,
            Resolved::Missing => return Err(AdminError::RecordNotFound),
            Resolved::NotInDoubt(s) => return Err(AdminError::NotInDoubt(s)),
        };
        tracing::info!(
            route,
            key = k.as_str(),
            outcome = how.as_str(),
            "operator resolved an in-doubt dedup key"
        );
        Ok((k, state))
    }

    /// A form posted from the page: its fields, once the session cookie, the
    /// same-origin check and the form token (a cross-site page can make a
    /// browser POST, but not with them) have passed.
    async fn page_form(&self, req: Request<Incoming>) -> Result<Vec<(String, String)>, AdminError> {
        let s = self.session().ok_or(AdminError::Disabled)?;
        if !session::same_origin(req.headers()) {
            return Err(AdminError::CrossSite);
        }
        if !s.presented(req.headers()) {
            return Err(AdminError::Unauthorized);
        }
        let body = read_body(req).await?;
        let fields = form::form_pairs(&body);
        if !form_field(&fields, "csrf").is_some_and(|t| s.csrf_matches(&t)) {
            return Err(AdminError::CrossSite);
        }
        Ok(fields)
    }

    /// The page's resolve form ([`Admin::page_form`]'s checks); answers with a
    /// redirect back to the page.
    async fn resolve_form(
        &self,
        req: Request<Incoming>,
        route: &str,
        key: &str,
    ) -> Response<Full<Bytes>> {
        let attempt = async {
            let fields = self.page_form(req).await?;
            let how = match form_field(&fields, "outcome").as_deref() {
                Some("delivered") => Resolution::Delivered,
                Some("not_delivered") => Resolution::NotDelivered,
                _ => {
                    return Err(AdminError::BadRequest(
                        "outcome must be delivered or not_delivered",
                    ))
                }
            };
            let (k, _) = self.resolve(route, key, how).await?;
            Ok(see_other(&format!(
                "/?resolved={}&route={}&key={}",
                how.as_str(),
                form::encode(route),
                form::encode(k.as_str())
            )))
        };
        attempt.await.unwrap_or_else(|e| {
            let (status, _) = e.status_and_code();
            html(status, page::render_message("Not resolved", &e.to_string()))
        })
    }

    /// `POST /login`: the token from the form becomes the session cookie.
    async fn login(&self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, AdminError> {
        let (Some(expected), Some(s)) = (self.token(), self.session()) else {
            return Ok(see_other("/"));
        };
        if !session::same_origin(req.headers()) {
            return Err(AdminError::CrossSite);
        }
        self.may_guess(&req)?;
        let client = req.extensions().get::<Client>().copied();
        let body = read_body(req).await?;
        let fields = form::form_pairs(&body);
        let presented = form_field(&fields, "token").unwrap_or_default();
        if !expected.matches(&TokenHash::of(presented.as_bytes())) {
            tracing::warn!("operator page: a login with a wrong admin token was refused");
            if let Some(c) = client {
                self.guesses.failed(c.0);
            }
            return Ok(html(
                StatusCode::FORBIDDEN,
                page::render_login(Some("That is not the admin token.")),
            ));
        }
        let mut r = see_other("/");
        r.headers_mut().insert(header::SET_COOKIE, s.set_cookie());
        Ok(r)
    }

    /// `GET /` for a browser: the login form, or the page.
    async fn page<B>(&self, req: &Request<B>) -> Result<Response<Full<Bytes>>, AdminError> {
        let access = match self.session() {
            None => Access::ReadOnly,
            Some(s) if s.presented(req.headers()) => Access::Resolve {
                csrf: s.csrf().to_owned(),
            },
            Some(_) => return Ok(html(StatusCode::OK, page::render_login(None))),
        };
        let q = form::query_pairs(req.uri().query().unwrap_or(""));
        let view = self.gather(&q, access).await;
        Ok(html(StatusCode::OK, page::render(&view)))
    }

    /// What the page shows, for the query `q` (`leases=OFFSET`, `after=NEXT`,
    /// `queued=OFFSET`, and the notice of a resolve, retry or drop just done
    /// or refused).
    pub(crate) async fn gather(&self, q: &[(String, String)], access: Access) -> PageView {
        let offset = form_field(q, "leases")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
        let after = form_field(q, "after")
            .and_then(|v| ListCursor::parse(&v))
            .filter(|c| crate::dedup::could_name(&c.key.route, &c.key.key));
        let fences = self.shared.fences.all();
        // A full view only for the leases on this page: with thousands of leases
        // the others are only counted.
        let leases_failing = fences.iter().filter(|f| f.store_failing()).count();
        let leases = fences
            .iter()
            .skip(offset)
            .take(page::LEASES_PER_PAGE)
            .map(|f| {
                let v = f.view();
                LeaseRow {
                    lease: v.lease.as_str().to_owned(),
                    mark: v.gate.mark.get(),
                    latest: v.latest_known.get(),
                    holder: v.holder,
                    expires_at: v.expires_at,
                    in_flight: v.gate.in_flight,
                    in_doubt: v.gate.in_doubt,
                    drains_started: v.gate.drains_started,
                    drains_aborted: v.gate.drains_aborted,
                    store_error: v.last_error,
                }
            })
            .collect();
        // The page is most needed when something is down: a state store that does
        // not answer is shown, not a failed page.
        let (Listing { records, total }, keys_error) = match self
            .shared
            .state
            .list(State::InDoubt, None, after.as_ref(), page::KEYS_PER_PAGE)
            .await
        {
            Ok(l) => (l, None),
            Err(e) => (Listing::default(), Some(e.to_string())),
        };
        let keys_next = (records.len() == page::KEYS_PER_PAGE)
            .then(|| records.last().map(|(k, r)| cursor(k, r).encode()))
            .flatten();
        let keys = records
            .into_iter()
            .map(|(k, r)| KeyRow {
                route: k.route,
                key: k.key,
                epoch: r.epoch.get(),
                created: ms_to_system(r.created_ms),
                updated: ms_to_system(r.updated_ms),
                method: r.request.as_ref().map(|q| q.method.clone()),
                path: r.request.map(|q| q.path),
            })
            .collect();
        let notice = match (
            form_field(q, "resolved"),
            form_field(q, "route"),
            form_field(q, "key"),
        ) {
            (Some(how), Some(route), Some(key)) if how == "delivered" || how == "not_delivered" => {
                Some(Notice::done(format!(
                    "Resolved {route} / {key} as {}.",
                    how.replace('_', " ")
                )))
            }
            _ => Self::delivery_notice(q),
        };
        let clock = self.shared.store.clock();
        let shards = self.shard_map().await;
        let detail = match form_field(q, "detail") {
            Some(_) => Some(
                self.key_detail(
                    &form_field(q, "route").unwrap_or_default(),
                    &form_field(q, "key").unwrap_or_default(),
                )
                .await,
            ),
            None => None,
        };
        PageView {
            instance: match &self.shared.mode {
                Mode::Single(g) => g.id().to_owned(),
                Mode::Cluster(c) => c.id().to_owned(),
            },
            version: env!("CARGO_PKG_VERSION"),
            now: clock.local_now(),
            store_now: clock.now(),
            health: StoreHealth {
                store: self.shared.store.describe(),
                clock_offset_ms: clock.offset_ms(),
                state_ok: self.shared.state.is_healthy(),
                leases_failing,
            },
            leases,
            leases_total: fences.len(),
            leases_offset: offset,
            routes_total: self.shared.live.current().routes.iter().count(),
            routes: self.route_rows(),
            members: self.members(&shards, clock.local_now()),
            relayed: self
                .shared
                .mode
                .cluster()
                .map(|c| c.peer_forwards.load(std::sync::atomic::Ordering::Relaxed)),
            detail,
            shards,
            keys,
            keys_total: total,
            keys_next,
            keys_paged: after.is_some(),
            keys_error,
            fence_problems: self.shared.fence_problems(),
            queue: self.queue_panel(q).await,
            access,
            notice,
        }
    }

    /// The shard map. A single instance: shard 0 of 1, held by its instance
    /// guard, a gate lease (SPEC §10.1); a cluster: every shard, owned through
    /// its row of `fencegate_owners` (§10.2).
    async fn shard_map(&self) -> Vec<ShardRow> {
        let g = match &self.shared.mode {
            Mode::Single(g) => g,
            Mode::Cluster(c) => {
                let me = c.id();
                return c
                    .shard_statuses()
                    .into_iter()
                    .map(|s| ShardRow {
                        shard: s.shard,
                        shards: c.shards(),
                        this_instance: s.owner.as_deref() == Some(me),
                        owner: s.owner,
                        // The anchor's gate epoch is in /v1/cluster: it is the
                        // set-up's, no shard's tenure.
                        tenure: (s.generation > 0).then_some(Tenure::Generation(s.generation)),
                        expires_at: s.expires_at,
                        serving: s.served_here,
                        leases: s.leases,
                    })
                    .collect();
            }
        };
        let held = g.held().await;
        let mut leases: Vec<String> = self
            .shared
            .live
            .current()
            .routes
            .iter()
            .map(|r| r.lease.as_str().to_owned())
            .collect();
        leases.sort();
        leases.dedup();
        vec![ShardRow {
            shard: 0,
            shards: 1,
            owner: held.map(|_| g.id().to_owned()),
            tenure: held.map(|(e, _)| Tenure::GuardEpoch(e.get())),
            expires_at: held.map(|(_, t)| t),
            this_instance: true,
            serving: g.may_forward(),
            leases,
        }]
    }

    /// The members: a single instance is its own; a cluster's are those alive
    /// at the last heartbeat and every one seen alive before (gone now).
    fn members(&self, shards: &[ShardRow], now: std::time::SystemTime) -> Vec<MemberRow> {
        let owned = |id: &str| -> Vec<u32> {
            shards
                .iter()
                .filter(|s| s.owner.as_deref() == Some(id))
                .map(|s| s.shard)
                .collect()
        };
        let c = match &self.shared.mode {
            Mode::Single(g) => {
                return vec![MemberRow {
                    id: g.id().to_owned(),
                    alive: true,
                    last_seen: Some(now),
                    this_instance: true,
                    shards: owned(g.id()),
                }]
            }
            Mode::Cluster(c) => c,
        };
        let alive: std::collections::BTreeSet<String> = c
            .members()
            .into_iter()
            .chain(shards.iter().filter_map(|s| s.owner.clone()))
            .chain(std::iter::once(c.id().to_owned()))
            .collect();
        let mut seen = self.members_seen.lock().unwrap_or_else(|p| p.into_inner());
        for id in &alive {
            seen.insert(id.clone(), now);
        }
        seen.iter()
            .map(|(id, last)| MemberRow {
                id: id.clone(),
                alive: alive.contains(id),
                last_seen: Some(*last),
                this_instance: id == c.id(),
                shards: owned(id),
            })
            .collect()
    }

    /// One key for the page's detail view.
    async fn key_detail(&self, route: &str, key: &str) -> KeyDetail {
        let record = async {
            // The query is decoded already: the key is taken as it stands.
            let k = self.route_key(route, key.as_bytes())?;
            let r = self.record(route, &k).await?;
            let lease = self
                .shared
                .live
                .current()
                .routes
                .get(route)
                .map(|r| r.lease.as_str().to_owned());
            Ok::<_, AdminError>(KeyRecord {
                state: r.state.as_str(),
                lease,
                epoch: r.epoch.get(),
                created: ms_to_system(r.created_ms),
                updated: ms_to_system(r.updated_ms),
                method: r.request.as_ref().map(|q| q.method.clone()),
                path: r.request.as_ref().map(|q| q.path.clone()),
                status: r.response.as_ref().map(|s| s.status),
                body_bytes: r
                    .response
                    .as_ref()
                    .and_then(|s| s.body.as_ref().map(|b| b.len())),
            })
        }
        .await
        .map_err(|e| e.to_string());
        KeyDetail {
            route: route.to_owned(),
            key: key.to_owned(),
            record,
        }
    }
}

fn cursor(k: &RecordKey, r: &Record) -> ListCursor {
    ListCursor {
        created_ms: r.created_ms,
        key: k.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path the index lists resolves to an endpoint taking the method
    /// the index says; a path it does not list resolves to none (404).
    #[test]
    fn every_listed_path_is_an_endpoint_with_its_method() {
        for (method, path, _) in INDEX {
            let path = path.split(['?', '[']).next().unwrap();
            let path = path.replace("{route}", "r").replace("{key}", "k");
            let e = Endpoint::of(&path).unwrap_or_else(|| panic!("{path} is no endpoint"));
            assert_eq!(e.method().as_str(), *method, "{path}");
        }
        for path in [
            "/v1",
            "/v1/dedup/r",
            "/v1/dedup/r/k/forget",
            "/v1/deliveries/r/k/send",
            "/v1/nothing",
            "/metrics/x",
        ] {
            assert_eq!(Endpoint::of(path), None, "{path}");
        }
        assert_eq!(
            Endpoint::of("/v1/dedup/billing/a%2Fb"),
            Some(Endpoint::DedupGet("billing", "a%2Fb"))
        );
    }

    #[test]
    fn a_browser_is_told_apart_by_accept_and_a_form_by_its_type() {
        let mut h = HeaderMap::new();
        assert!(!wants_html(&h));
        h.append(header::ACCEPT, HeaderValue::from_static("application/json"));
        h.append(
            header::ACCEPT,
            HeaderValue::from_static("text/html,application/xhtml+xml"),
        );
        assert!(wants_html(&h));
        assert!(!is_form(&h));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-www-form-urlencoded; charset=utf-8"),
        );
        assert!(is_form(&h));
    }

    /// The page runs its own script only (by hash), loads nothing from
    /// elsewhere, cannot be framed, and is never cached.
    #[test]
    fn the_page_is_sent_with_its_content_security_policy() {
        let r = html(StatusCode::OK, markup::Html::default());
        let h = r.headers();
        let csp = h[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(csp.starts_with("default-src 'none';"), "{csp}");
        assert!(csp.contains(&format!("script-src {};", page::script_hash())));
        assert!(csp.contains("frame-ancestors 'none'"));
        assert_eq!(h[header::X_FRAME_OPTIONS], "DENY");
        assert_eq!(h[header::REFERRER_POLICY], "same-origin");
        assert_eq!(h[header::CACHE_CONTROL], "no-store");
        assert_eq!(h[header::CONTENT_TYPE], "text/html; charset=utf-8");
    }

    /// A form's POST is answered 303; a location that is no header value is
    /// left out rather than sent broken.
    #[test]
    fn see_other_redirects_and_never_sends_a_broken_location() {
        let r = see_other("/?route=a");
        assert_eq!(r.status(), StatusCode::SEE_OTHER);
        assert_eq!(r.headers()[header::LOCATION], "/?route=a");
        assert_eq!(r.headers()[header::CACHE_CONTROL], "no-store");
        let r = see_other("/\r\nSet-Cookie: x=1");
        assert!(r.headers().get(header::LOCATION).is_none());
    }

    #[test]
    fn a_form_field_is_its_first_value() {
        let pairs = vec![
            ("outcome".to_owned(), "delivered".to_owned()),
            ("outcome".to_owned(), "not_delivered".to_owned()),
        ];
        assert_eq!(form_field(&pairs, "outcome").as_deref(), Some("delivered"));
        assert_eq!(form_field(&pairs, "csrf"), None);
    }

    /// An upstream's userinfo is a credential: never shown.
    #[test]
    fn an_upstream_is_shown_without_its_userinfo() {
        let t = crate::forward::Target::new(
            "/billing/",
            "https://user:secret@api.example:8443/v1",
            "Idempotency-Key",
            vec![],
        )
        .unwrap();
        assert_eq!(upstream_shown(&t), "https://api.example:8443/v1/");
    }
}
