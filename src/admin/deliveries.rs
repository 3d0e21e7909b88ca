//! The admin API of queued messages (SPEC §11): list, one, retry, drop; and
//! the operator page's queue panel, whose Retry and Drop forms post to the
//! same endpoints.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::json;

use super::page::{self, JobRow, MessageRow, Notice, QueuePanel, QueueRoute};
use super::{form, form_field, html, json_response, see_other, Admin};
use crate::dedup::ms_to_system;
use crate::error::AdminError;
use crate::proxy::queued::view;
use crate::queue::job::{Job, JobAction, JobFilter, REFUSED_LISTED};
use crate::queue::pause::Pausable;
use crate::queue::{By, Edit, ListedBy, Listing, Message, Queue, Status};
use crate::state::StateError;

/// The statuses the panel lists, in its order: those an operator acts on
/// first.
const SHOWN: [Status; 3] = [Status::Failed, Status::Delivering, Status::Pending];

/// The queue panel of queued routes `routes` (name, lease; by name): their
/// figures, and rows `offset..offset + MESSAGES_PER_PAGE` of their messages not
/// delivered. Each route's messages are read three times (once per status
/// shown), keeping at most a page and what comes before it.
async fn panel(
    q: &Queue,
    routes: &[(String, String)],
    offset: usize,
) -> Result<QueuePanel, StateError> {
    let need = offset + page::MESSAGES_PER_PAGE;
    let mut figures = Vec::with_capacity(routes.len());
    let mut rows: Vec<Message> = Vec::new();
    let mut total = 0;
    for (route, lease) in routes {
        let mut counts = [0u64; 3];
        for (n, status) in SHOWN.into_iter().enumerate() {
            let (found, count) = q
                .store
                .list(&Listing {
                    route: Some(route.clone()),
                    status: Some(status),
                    limit: need.saturating_sub(rows.len()),
                    ..Listing::default()
                })
                .await?;
            counts[n] = count;
            rows.extend(found);
        }
        total += counts.iter().sum::<u64>();
        // The metric's figure: the lease's head, if it is this route's.
        let oldest = q
            .store
            .head(lease)
            .await?
            .filter(|m| &m.route == route)
            .map(|m| ms_to_system(m.accepted_ms));
        let pauses = q.pauses();
        let paused = match (pauses.route(route), pauses.lease(lease)) {
            (Some(ms), _) => Some(("route", ms_to_system(ms))),
            (None, Some(ms)) => Some(("lease", ms_to_system(ms))),
            (None, None) => None,
        };
        figures.push(QueueRoute {
            route: route.clone(),
            lease: lease.clone(),
            depth: counts[1] + counts[2],
            failed: counts[0],
            oldest,
            paused,
        });
    }
    let messages = rows
        .into_iter()
        .skip(offset)
        .take(page::MESSAGES_PER_PAGE)
        .map(|m| MessageRow {
            next_attempt: (m.status == Status::Pending).then(|| ms_to_system(m.next_attempt_ms)),
            status: m.status.as_str(),
            route: m.route,
            key: m.key,
            lease: m.lease,
            epoch: m.epoch,
            seq: m.seq,
            attempts: m.attempts,
            last_status: m.last_status,
            last_error: m.last_error,
        })
        .collect();
    let jobs = q
        .store
        .jobs()
        .await?
        .into_iter()
        .take(5)
        .map(|j| JobRow {
            id: j.id,
            action: j.action.as_str(),
            route: j.filter.route,
            state: if j.finished { "finished" } else { "running" },
            matched: j.matched,
            done: j.done,
            refused: j.refused,
        })
        .collect();
    Ok(QueuePanel {
        routes: figures,
        messages,
        messages_total: total,
        offset,
        error: None,
        jobs,
    })
}

/// What the page says after a retry or drop from its queue panel:
/// `delivery=retried|dropped|refused` with `route`, `key`, and for a refusal
/// `action` and `why` (`superseded` with `epoch`, `conflict` with `status`,
/// `not_found`, `not_served`). The words are the program's; only route and key come from
/// the query.
fn notice_of(q: &[(String, String)]) -> Option<Notice> {
    if let (Some(id), Some(matched)) = (form_field(q, "job"), form_field(q, "matched")) {
        let matched: u64 = matched.parse().ok()?;
        let id: String = id
            .chars()
            .filter(char::is_ascii_hexdigit)
            .take(32)
            .collect();
        return Some(Notice::done(format!(
            "Bulk retry {id} started: {matched} failed messages, each back to the end of its lease's queue, in order. It goes on in the background (Bulk jobs, below)."
        )));
    }
    let (what, route, key) = (
        form_field(q, "delivery")?,
        form_field(q, "route")?,
        form_field(q, "key")?,
    );
    Some(match what.as_str() {
        "retried" => Notice::done(format!(
            "Retried {route} / {key}: it is pending, and is sent when its turn in its lease's queue comes."
        )),
        "dropped" => Notice::done(format!(
            "Dropped {route} / {key}: it will not be delivered; the messages behind it go on."
        )),
        "refused" => {
            let why = match form_field(q, "why")?.as_str() {
                "superseded" => Edit::Superseded(form_field(q, "epoch")?.parse().ok()?),
                "conflict" => Edit::Conflict(Status::parse(&form_field(q, "status")?)?),
                "not_found" => Edit::NotFound,
                "not_served" => Edit::NotServed,
                _ => return None,
            };
            let action = match form_field(q, "action")?.as_str() {
                "retry" => "retried",
                "drop" => "dropped",
                _ => return None,
            };
            Notice {
                text: format!("Not {action}: {route} / {key}: {why}."),
                refused: true,
            }
        }
        _ => return None,
    })
}

impl Admin {
    /// `POST /v1/routes/{route}/pause|resume`, `POST /v1/leases/{lease}/pause|resume`
    /// (SPEC §11, pause and resume): durable on return, on every member of a
    /// cluster within a second. A route must be a configured queued one; a
    /// lease, the lease of one.
    pub(super) async fn pause(
        &self,
        what: Pausable,
        on: bool,
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        let live = self.shared.live.current();
        match &what {
            Pausable::Route(r) => match live.routes.get(r) {
                None => return Err(AdminError::RouteNotFound(r.clone())),
                Some(route) if !route.queued => return Err(AdminError::RouteNotQueued(r.clone())),
                Some(_) => {}
            },
            Pausable::Lease(l) => {
                if !live
                    .routes
                    .iter()
                    .any(|r| r.queued && r.lease.as_str() == l)
                {
                    return Err(AdminError::LeaseNotFound(l.clone()));
                }
            }
        }
        drop(live);
        let since = self.queue()?.set_paused(&what, on).await?;
        Ok(json_response(
            StatusCode::OK,
            json!({
                what.kind(): what.name(),
                "paused": since.is_some(),
                "since": since.map(|ms| crate::clock::rfc3339(ms_to_system(ms))),
            }),
        ))
    }

    /// `POST /v1/delivery-jobs/retry|drop?{filter}` (SPEC §11, recovering in
    /// bulk): the job is written, answered `202`, and progressed in the
    /// background. A retry takes failed messages (`status` absent or
    /// `failed`); a drop names `status` (`pending` or `failed`).
    pub(super) async fn job_create(
        &self,
        action: &str,
        query: &str,
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        let job = self.make_job(action, query).await?;
        Ok(json_response(StatusCode::ACCEPTED, job_view(&job)))
    }

    /// A bulk job from its action and filter, written and started.
    async fn make_job(&self, action: &str, query: &str) -> Result<Job, AdminError> {
        let l = self.listing_of(query, false)?;
        let (action, status) = match (action, l.status) {
            ("retry", None | Some(Status::Failed)) => (JobAction::Retry, Status::Failed),
            ("retry", _) => {
                return Err(AdminError::BadRequest(
                    "a bulk retry takes failed messages: status absent or failed",
                ))
            }
            ("drop", Some(s @ (Status::Pending | Status::Failed))) => (JobAction::Drop, s),
            _ => {
                return Err(AdminError::BadRequest(
                    "a bulk drop names status=pending or status=failed",
                ))
            }
        };
        let filter = JobFilter {
            route: l.route,
            lease: l.lease,
            status: status.as_str().to_owned(),
            since_ms: l.since_ms,
            until_ms: l.until_ms,
            by_updated: l.by == ListedBy::Updated,
        };
        let job = self.queue()?.start_job(action, filter).await?;
        tracing::info!(
            job = job.id,
            action = action.as_str(),
            matched = job.matched,
            "operator started a bulk job"
        );
        Ok(job)
    }

    /// The page's "Retry all" form ([`Admin::page_form`]'s checks): the job is
    /// made as by the API, then a redirect back to the page with a notice.
    pub(super) async fn job_form(
        &self,
        req: Request<Incoming>,
        action: &str,
        query: &str,
    ) -> Response<Full<Bytes>> {
        let made = async {
            self.page_form(req).await?;
            self.make_job(action, query).await
        };
        match made.await {
            Ok(job) => see_other(&format!("/?job={}&matched={}#queued", job.id, job.matched)),
            Err(e) => {
                let (status, _) = e.status_and_code();
                html(status, page::render_message("Not started", &e.to_string()))
            }
        }
    }

    /// `GET /v1/delivery-jobs`: newest first.
    pub(super) async fn jobs(&self) -> Result<Response<Full<Bytes>>, AdminError> {
        let jobs = match &self.shared.queue {
            Some(q) => q.store.jobs().await?,
            None => Vec::new(),
        };
        let jobs: Vec<_> = jobs.iter().map(job_view).collect();
        Ok(json_response(StatusCode::OK, json!({ "jobs": jobs })))
    }

    /// `GET /v1/delivery-jobs/{id}`.
    pub(super) async fn job(&self, id: &str) -> Result<Response<Full<Bytes>>, AdminError> {
        let jobs = match &self.shared.queue {
            Some(q) => q.store.jobs().await?,
            None => Vec::new(),
        };
        let job = jobs
            .iter()
            .find(|j| j.id == id)
            .ok_or(AdminError::JobNotFound)?;
        Ok(json_response(StatusCode::OK, job_view(job)))
    }

    fn queue(&self) -> Result<&std::sync::Arc<Queue>, AdminError> {
        self.shared
            .queue
            .as_ref()
            .ok_or(AdminError::Delivery(Edit::NotFound))
    }

    /// The listing's filters from a query string (SPEC §11 `GET
    /// /v1/deliveries`); `paged`: `after` and `limit` too (a bulk job's
    /// filter takes neither).
    fn listing_of(&self, query: &str, paged: bool) -> Result<Listing, AdminError> {
        let mut l = Listing {
            limit: 100,
            ..Listing::default()
        };
        let time = |value: &str| {
            humantime::parse_rfc3339_weak(value)
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                .ok_or(AdminError::BadRequest(
                    "since and until are RFC 3339 times, e.g. 2026-12-07T10:00:00Z",
                ))
        };
        for (name, value) in form::query_pairs(query) {
            match name.as_str() {
                "route" => {
                    if !self.shared.has_route(&value) {
                        return Err(AdminError::RouteNotFound(value));
                    }
                    l.route = Some(value);
                }
                "lease" => {
                    // Checked here: PostgreSQL refuses a NUL (a 503 before).
                    crate::epoch::LeaseName::parse(&value).map_err(|_| {
                        AdminError::BadRequest(
                            "lease must be a lease name ([a-z0-9][a-z0-9._-]{0,62})",
                        )
                    })?;
                    l.lease = Some(value)
                }
                "status" => {
                    l.status = Some(Status::parse(&value).ok_or(AdminError::BadRequest(
                        "status must be pending, delivering, delivered, failed or dropped",
                    ))?)
                }
                "since" => l.since_ms = Some(time(&value)?),
                "until" => l.until_ms = Some(time(&value)?),
                "by" => {
                    l.by = match value.as_str() {
                        "accepted" => ListedBy::Accepted,
                        "updated" => ListedBy::Updated,
                        _ => {
                            return Err(AdminError::BadRequest(
                                "by must be accepted or updated",
                            ))
                        }
                    }
                }
                "after" if paged => {
                    // The `next` of the page before: `{route}/{key}`.
                    let (route, key) = value
                        .split_once('/')
                        .filter(|(r, k)| crate::dedup::could_name(r, k))
                        .ok_or(AdminError::BadRequest(
                            "after must be the next of the page before ({route}/{key})",
                        ))?;
                    l.after = Some((route.to_owned(), key.to_owned()));
                }
                "limit" if paged => {
                    l.limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or(AdminError::BadRequest("limit must be 1 to 1000"))?
                }
                _ if paged => {
                    return Err(AdminError::BadRequest(
                        "unknown parameter: the listing takes route, lease, status, since, until, by, after and limit",
                    ))
                }
                _ => {
                    return Err(AdminError::BadRequest(
                        "unknown parameter: a bulk job takes route, lease, status, since, until and by",
                    ))
                }
            }
        }
        Ok(l)
    }

    /// `GET /v1/deliveries[?route=R][&lease=L][&status=S][&since=T][&until=T]
    /// [&by=accepted|updated][&after=CURSOR][&limit=N]`: by route then key;
    /// `next` is the cursor of the page after this one (null at the end).
    pub(super) async fn deliveries<B>(
        &self,
        req: &Request<B>,
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        self.authorize(req)?;
        let l = self.listing_of(req.uri().query().unwrap_or(""), true)?;
        let (messages, total) = match &self.shared.queue {
            None => (Vec::new(), 0),
            Some(q) => {
                let listed = q.store.list(&l).await?;
                q.store.durable().await?;
                listed
            }
        };
        let next = (messages.len() == l.limit)
            .then(|| messages.last().map(|m| format!("{}/{}", m.route, m.key)))
            .flatten();
        let messages: Vec<_> = messages.iter().map(view).collect();
        Ok(json_response(
            StatusCode::OK,
            json!({"total": total, "messages": messages, "next": next}),
        ))
    }

    /// `GET /v1/deliveries/{route}/{key}`.
    pub(super) async fn delivery(
        &self,
        route: &str,
        key: &str,
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        let key = String::from_utf8_lossy(&form::decode_segment(key)).into_owned();
        if !crate::dedup::could_name(route, &key) {
            return Err(AdminError::Delivery(Edit::NotFound));
        }
        let m = self
            .queue()?
            .store
            .get(route, &key)
            .await?
            .ok_or(AdminError::Delivery(Edit::NotFound))?;
        // What is shown is on disk: a settlement written and not yet
        // flushed (the deliverer's next start flushes it) is not shown
        // before it could no longer revert.
        self.queue()?.store.durable().await?;
        Ok(json_response(StatusCode::OK, view(&m)))
    }

    /// An operator's retry or drop of `route`, `key` (the key as the path
    /// has it, escaped).
    async fn edit(&self, route: &str, key: &str, retry: bool) -> Result<Message, AdminError> {
        let key = String::from_utf8_lossy(&form::decode_segment(key)).into_owned();
        if !crate::dedup::could_name(route, &key) {
            return Err(AdminError::Delivery(Edit::NotFound));
        }
        let q = self.queue()?;
        let m = if retry {
            q.retry(route, &key, By::Operator).await?
        } else {
            q.drop_message(route, &key, By::Operator).await?
        };
        tracing::info!(
            route,
            key,
            action = if retry { "retry" } else { "drop" },
            status = m.status.as_str(),
            "operator changed a queued message"
        );
        Ok(m)
    }

    /// `POST /v1/deliveries/{route}/{key}/retry|drop`.
    pub(super) async fn delivery_edit(
        &self,
        route: &str,
        key: &str,
        retry: bool,
    ) -> Result<Response<Full<Bytes>>, AdminError> {
        let m = self.edit(route, key, retry).await?;
        Ok(json_response(StatusCode::OK, view(&m)))
    }

    /// The page's Retry and Drop forms: the checks of every form of the page
    /// ([`Admin::page_form`]), then a redirect back to the page with a notice
    /// — of the refusal too, when the queue refuses (a newer epoch's message,
    /// a message in another state, none).
    pub(super) async fn delivery_form(
        &self,
        req: Request<Incoming>,
        route: &str,
        key: &str,
        retry: bool,
    ) -> Response<Full<Bytes>> {
        let action = if retry { "retry" } else { "drop" };
        let back = |what: &str, key: &str, why: &str| {
            see_other(&format!(
                "/?delivery={what}&route={}&key={}{why}#queued",
                form::encode(route),
                form::encode(key),
            ))
        };
        let done = async {
            self.page_form(req).await?;
            self.edit(route, key, retry).await
        };
        match done.await {
            Ok(m) => back(if retry { "retried" } else { "dropped" }, &m.key, ""),
            Err(AdminError::Delivery(refused)) if !matches!(refused, Edit::State(_)) => {
                let why = match refused {
                    Edit::Superseded(epoch) => format!("superseded&epoch={epoch}"),
                    Edit::Conflict(status) => format!("conflict&status={}", status.as_str()),
                    Edit::NotServed => "not_served".to_owned(),
                    _ => "not_found".to_owned(),
                };
                let key = String::from_utf8_lossy(&form::decode_segment(key)).into_owned();
                back("refused", &key, &format!("&action={action}&why={why}"))
            }
            Err(e) => {
                let (status, _) = e.status_and_code();
                let title = if retry { "Not retried" } else { "Not dropped" };
                html(status, page::render_message(title, &e.to_string()))
            }
        }
    }

    /// The page's queue panel (`queued=OFFSET` pages its messages); `None`
    /// when no route is queued. Read off the async threads: it scans the
    /// queued routes' messages.
    pub(super) async fn queue_panel(&self, q: &[(String, String)]) -> Option<QueuePanel> {
        let queue = self.shared.queue.clone()?;
        let mut routes: Vec<(String, String)> = self
            .shared
            .live
            .current()
            .routes
            .iter()
            .filter(|r| r.queued)
            .map(|r| (r.name.clone(), r.lease.as_str().to_owned()))
            .collect();
        if routes.is_empty() {
            return None;
        }
        routes.sort();
        // Each page is read from the first message on: a bounded number of them.
        let offset = form_field(q, "queued")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0)
            .min(page::MESSAGES_PER_PAGE * (page::MESSAGE_PAGES - 1));
        // On sled the reads block: a blocking thread waits for them.
        let runtime = tokio::runtime::Handle::current();
        let read =
            tokio::task::spawn_blocking(move || runtime.block_on(panel(&queue, &routes, offset)))
                .await;
        let error = match read {
            Ok(Ok(p)) => return Some(p),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "reading it failed".to_owned(),
        };
        Some(QueuePanel {
            offset,
            error: Some(error),
            ..QueuePanel::default()
        })
    }

    /// The notice of a retry or drop just done or refused from the page.
    pub(super) fn delivery_notice(q: &[(String, String)]) -> Option<Notice> {
        notice_of(q)
    }
}

/// A bulk job as the admin API shows it.
fn job_view(j: &Job) -> serde_json::Value {
    let time = |ms: u64| crate::clock::rfc3339(ms_to_system(ms));
    let f = &j.filter;
    json!({
        "job": j.id,
        "action": j.action.as_str(),
        "route": f.route,
        "lease": f.lease,
        "status": f.status,
        "since": f.since_ms.map(time),
        "until": f.until_ms.map(time),
        "by": if f.by_updated { "updated" } else { "accepted" },
        "state": if j.finished { "finished" } else { "running" },
        "matched": j.matched,
        "done": j.done,
        "refused": j.refused,
        "refused_keys": j.refused_keys.iter().take(REFUSED_LISTED).collect::<Vec<_>>(),
        "created_at": time(j.created_ms),
        "updated_at": time(j.updated_ms),
    })
}
