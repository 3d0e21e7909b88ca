//! Phase 2, place or relay (SPEC §10): the request is served by this
//! instance's fence of the lease, or relayed to the shard's owner.

use std::pin::pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::Response;

use super::claim::Payload;
use super::{Proxy, Route, LOG};
use crate::cluster::{peer as relay, Placement};
use crate::error::{Doubt, ProxyError};
use crate::fence::Fence;
use crate::forward::ClientHop;
use crate::streaming::{ProxyBody, UpBody};
use crate::telemetry::{Kind, Spans};

/// Who serves a request ([`Proxy::place`]).
pub(super) enum Served {
    Here(Result<Arc<Fence>, ProxyError>),
    There(Peer),
}

/// The shard's owner, a cluster peer.
pub(super) struct Peer {
    owner: String,
    url: String,
}

impl Peer {
    /// Its `advertise` URL as the owner hint (SPEC §10.2).
    pub(super) fn hint(&self) -> Option<http::HeaderValue> {
        http::HeaderValue::from_str(&self.url).ok()
    }
}

impl Proxy {
    /// Where the route's request is served: by this instance's fence of the
    /// lease, or by the shard's owner (never for a request a peer relayed: it is
    /// relayed once at most).
    pub(super) fn place(&self, route: &Route, relayed: bool) -> Served {
        let unavailable = || ProxyError::ShardUnavailable {
            lease: route.lease.clone(),
        };
        if self.state.set_up_conflict().is_some() {
            // The database is another set-up's now (SPEC §10): nothing is
            // served here, nor relayed to an owner it names.
            return Served::Here(Err(unavailable()));
        }
        if let Some(f) = &route.fence {
            return Served::Here(Ok(f.clone()));
        }
        let Some(cluster) = self.mode.cluster() else {
            return Served::Here(Err(unavailable()));
        };
        match cluster.place(route.shard) {
            Placement::Local(owner) => Served::Here(
                self.fences
                    .get(&route.lease)
                    .filter(|f| f.owner() == owner)
                    .ok_or_else(unavailable),
            ),
            Placement::Peer { owner, url } if !relayed => Served::There(Peer { owner, url }),
            Placement::Peer { .. } | Placement::Unavailable => {
                cluster.nudge();
                Served::Here(Err(unavailable()))
            }
        }
    }

    /// Relays the request to the shard's owner (SPEC §10.2), traced as
    /// `peer.relay`: the owner's spans are children of this one.
    pub(super) async fn relay(
        &self,
        route: &Route,
        peer: Peer,
        mut parts: Parts,
        body: Payload,
        hop: &ClientHop,
        spans: &mut Spans,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        // A relay holds an upstream socket as a forward does (SPEC §9 "Limits").
        let Some(_budget) = route.upstreams.try_slot() else {
            return Err(ProxyError::UpstreamHeld {
                route: route.name.clone(),
                refused: route.protect.refuse_for_budget(),
            });
        };
        let (body, _) = body.upload(route.max_body_bytes);
        let onward = spans.onward(&mut parts.headers);
        let relayed = pin!(self.send_to_owner(route, &peer, parts, body, hop)).await;
        onward.end(spans, "peer.relay", Kind::Client, &relayed, |relayed, a| {
            a.str("fencegate.peer", peer.owner);
            if let Ok(r) = relayed {
                a.int("http.response.status_code", i64::from(r.status().as_u16()));
            }
            relayed.as_ref().err().map(ProxyError::code)
        });
        relayed
    }

    /// Sends the request to the shard's owner and takes its answer; looks again
    /// for the shard's owner when the owner did not answer or says it no longer
    /// holds the shard.
    async fn send_to_owner(
        &self,
        route: &Route,
        Peer { owner, url }: &Peer,
        parts: Parts,
        body: UpBody,
        hop: &ClientHop,
    ) -> Result<Response<ProxyBody>, ProxyError> {
        let (Some(cluster), Some(client)) = (self.mode.cluster(), &self.peers) else {
            return Err(ProxyError::ShardUnavailable {
                lease: route.lease.clone(),
            });
        };
        // The owner may wait out a drain (or a takeover's settle) and then the
        // upstream: allow for both.
        let timeout = route.timeout + 2 * route.drain_timeout + Duration::from_secs(1);
        cluster.peer_forwards.fetch_add(1, Ordering::Relaxed);
        relay::relay(
            client,
            url,
            cluster.id(),
            cluster.peer_token(),
            parts,
            body,
            hop,
            timeout,
        )
        .await
        .inspect(|resp| {
            // The owner is handing the shard over (or lost it): look again now —
            // only on its own 503 (with an error code), and not when it refused
            // to protect the destination (SPEC §9) or passed on the
            // destination's 503: neither says anything of the shard.
            let owners = resp
                .headers()
                .get(crate::error::ERROR_HEADER)
                .is_some_and(|c| c != "upstream_held");
            if resp.status() == http::StatusCode::SERVICE_UNAVAILABLE && owners {
                cluster.nudge();
            }
        })
        .map_err(|failed| {
            cluster.nudge();
            cluster.peer_failures.fetch_add(1, Ordering::Relaxed);
            match failed {
                relay::RelayFailed::NotSent(detail) => {
                    tracing::warn!(target: LOG, route = %route.name, lease = %route.lease, owner, detail, "the shard's owner could not be reached");
                    ProxyError::ShardUnavailable {
                        lease: route.lease.clone(),
                    }
                }
                // The owner may have forwarded it: 503 would tell the worker it
                // was not (found by the cluster fault campaign, a kill -9 of the
                // owner while it had the relayed request at the destination).
                relay::RelayFailed::Uncertain(detail) => {
                    tracing::warn!(target: LOG, route = %route.name, lease = %route.lease, owner, detail, "the shard's owner did not answer; it may have forwarded the request");
                    ProxyError::UpstreamTimeout {
                        detail,
                        doubt: Doubt::Relayed,
                    }
                }
            }
        })
    }
}
