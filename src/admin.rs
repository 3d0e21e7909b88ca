//! The admin listener (SPEC §8): health, readiness, metrics, lease state, and the
//! dedup records an operator may need to inspect or resolve.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{json, Value};

use crate::clock::rfc3339;
use crate::dedup::{ms_to_system, DedupKey, Resolution, Resolved, State};
use crate::epoch::TokenHash;
use crate::error::AdminError;
use crate::metrics::Metrics;
use crate::shared::Shared;

pub struct Admin {
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    store_timeout: Duration,
}

fn json_response(status: StatusCode, v: Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(
        serde_json::to_vec_pretty(&v).unwrap_or_default(),
    )));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

impl Admin {
    pub fn new(shared: Arc<Shared>, metrics: Arc<Metrics>, store_timeout: Duration) -> Admin {
        Admin {
            shared,
            metrics,
            store_timeout,
        }
    }

    pub async fn handle(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        self.route(req).await.unwrap_or_else(|e| e.to_response())
    }

    async fn route(&self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, AdminError> {
        let path = req.uri().path().to_owned();
        let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        Ok(match (req.method().clone(), segs.as_slice()) {
            (Method::GET, ["healthz"]) => json_response(StatusCode::OK, json!({"status": "ok"})),
            (Method::GET, ["readyz"]) => self.readyz().await,
            (Method::GET, ["metrics"]) => {
                let mut r = Response::new(Full::new(Bytes::from(self.metrics.render())));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static(
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    ),
                );
                r
            }
            (Method::GET, ["v1", "leases"]) => self.leases(),
            (Method::GET, ["v1", "dedup", route, key]) => self.dedup_get(route, key).await?,
            (Method::POST, ["v1", "dedup", route, key, "resolve"]) => {
                self.authorize(&req)?;
                let (route, key) = (route.to_string(), key.to_string());
                let body = Limited::new(req.into_body(), 4096)
                    .collect()
                    .await
                    .map_err(|_| AdminError::BadRequest("body unreadable or over 4 KiB"))?
                    .to_bytes();
                self.dedup_resolve(&route, &key, &body).await?
            }
            _ => return Err(AdminError::NoSuchEndpoint),
        })
    }

    fn authorize(&self, req: &Request<Incoming>) -> Result<(), AdminError> {
        // The token as the last reload left it (SPEC §8).
        let live = self.shared.live.current();
        let expected = live.admin_token.as_ref().ok_or(AdminError::Disabled)?;
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match presented {
            Some(t) if expected.matches(&TokenHash::of(t.as_bytes())) => Ok(()),
            _ => Err(AdminError::Unauthorized),
        }
    }

    async fn readyz(&self) -> Response<Full<Bytes>> {
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
        if problems.is_empty() {
            json_response(StatusCode::OK, json!({"status": "ready"}))
        } else {
            json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"status": "not_ready", "problems": problems}),
            )
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
                    "store_error": v.last_error,
                })
            })
            .collect();
        json_response(StatusCode::OK, json!({"leases": leases}))
    }

    fn parse_route_key(&self, route: &str, key: &str) -> Result<DedupKey, AdminError> {
        if !self.shared.has_route(route) {
            return Err(AdminError::RouteNotFound(route.to_owned()));
        }
        DedupKey::parse(&percent_decode(key)).map_err(AdminError::DedupKeyMalformed)
    }

    async fn dedup_get(&self, route: &str, key: &str) -> Result<Response<Full<Bytes>>, AdminError> {
        let k = self.parse_route_key(route, key)?;
        let r = self
            .shared
            .dedup
            .get(route, &k)
            .await?
            .ok_or(AdminError::RecordNotFound)?;
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
            }),
        ))
    }

    async fn dedup_resolve(
        &self,
        route: &str,
        key: &str,
        body: &[u8],
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        let k = self.parse_route_key(route, key)?;
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
        Ok(json_response(
            StatusCode::OK,
            json!({"route": route, "key": k.as_str(), "state": state}),
        ))
    }
}

fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) =
                u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16)
            {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}
