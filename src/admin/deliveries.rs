//! The admin API of queued messages (SPEC §11): list, one, retry, drop.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

use super::{form, json_response, Admin};
use crate::error::AdminError;
use crate::proxy::queued::view;
use crate::queue::{Edit, Queue, Status};

impl Admin {
    fn queue(&self) -> Result<&std::sync::Arc<Queue>, AdminError> {
        self.shared
            .queue
            .as_ref()
            .ok_or(AdminError::Delivery(Edit::NotFound))
    }

    /// `GET /v1/deliveries[?route=R][&lease=L][&status=S][&limit=N]`.
    pub(super) fn deliveries<B>(
        &self,
        req: &Request<B>,
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        self.authorize(req)?;
        let (mut route, mut lease, mut status, mut limit) = (None, None, None, 100usize);
        for (name, value) in form::query_pairs(req.uri().query().unwrap_or("")) {
            match name.as_str() {
                "route" => {
                    if !self.shared.has_route(&value) {
                        return Err(AdminError::RouteNotFound(value));
                    }
                    route = Some(value);
                }
                "lease" => lease = Some(value),
                "status" => {
                    status = Some(Status::parse(&value).ok_or(AdminError::BadRequest(
                        "status must be pending, delivering, delivered, failed or dropped",
                    ))?)
                }
                "limit" => {
                    limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or(AdminError::BadRequest("limit must be 1 to 1000"))?
                }
                _ => {
                    return Err(AdminError::BadRequest(
                        "unknown parameter: the listing takes route, lease, status and limit",
                    ))
                }
            }
        }
        let (messages, total) = match &self.shared.queue {
            None => (Vec::new(), 0),
            Some(q) => q
                .store
                .list(route.as_deref(), lease.as_deref(), status, limit)?,
        };
        let messages: Vec<_> = messages.iter().map(view).collect();
        Ok(json_response(
            StatusCode::OK,
            json!({"total": total, "messages": messages}),
        ))
    }

    /// `GET /v1/deliveries/{route}/{key}`.
    pub(super) fn delivery(
        &self,
        route: &str,
        key: &str,
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        let key = String::from_utf8_lossy(&form::decode_segment(key)).into_owned();
        let m = self
            .queue()?
            .store
            .get(route, &key)?
            .ok_or(AdminError::Delivery(Edit::NotFound))?;
        Ok(json_response(StatusCode::OK, view(&m)))
    }

    /// `POST /v1/deliveries/{route}/{key}/retry|drop`.
    pub(super) async fn delivery_edit(
        &self,
        route: &str,
        key: &str,
        retry: bool,
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        let key = String::from_utf8_lossy(&form::decode_segment(key)).into_owned();
        let q = self.queue()?;
        let m = if retry {
            q.retry(route, &key).await?
        } else {
            q.drop_message(route, &key).await?
        };
        tracing::info!(
            route,
            key,
            action = if retry { "retry" } else { "drop" },
            status = m.status.as_str(),
            "operator changed a queued message"
        );
        Ok(json_response(StatusCode::OK, view(&m)))
    }
}
