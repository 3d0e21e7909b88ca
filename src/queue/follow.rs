//! The queue following a cluster's tenures (SPEC §10.2).

use std::sync::Arc;

use super::rules::{conflict_of, history_conflict};
use super::Queue;

/// The queue following a cluster's tenures (SPEC §10.2): a shard's
/// deliverers start with its tenure here, and its attempts out end with it.
pub(crate) struct FollowTenures(pub Arc<Queue>);

impl crate::cluster::TenureWork for FollowTenures {
    fn check(
        &self,
        leases: &[crate::epoch::LeaseName],
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send + '_>> {
        // SPEC §11 at a takeover: members of one cluster share their routes,
        // but a member whose config differs (a route direct here, queued on
        // the others) must not forward the shard's leases directly past
        // messages another member queued.
        let live = self.0.ctx.live.current();
        let routes: Vec<(String, String, bool)> = live
            .routes
            .iter()
            .filter(|r| leases.contains(&r.lease))
            .map(|r| (r.name.clone(), r.lease.as_str().to_owned(), r.queued))
            .collect();
        Box::pin(async move {
            let routes: Vec<(&str, &str, bool)> = routes
                .iter()
                .map(|(n, l, q)| (n.as_str(), l.as_str(), *q))
                .collect();
            // And a route's history: a member that would serve a route of
            // the other kind than its records (members with different
            // configs) does not take the shard either.
            let found = match conflict_of(self.0.store.as_ref(), &routes).await {
                Ok(None) => history_conflict(self.0.store.as_ref(), &routes).await,
                other => other,
            };
            match found {
                Ok(None) => Ok(()),
                Ok(Some(why)) => Err(why),
                Err(e) => Err(e.to_string()),
            }
        })
    }

    fn started(&self, leases: &[crate::epoch::LeaseName]) {
        self.0.serve_shard(leases);
    }

    fn stop(
        &self,
        shard: u32,
        deadline: tokio::time::Instant,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.0.stop_shard(shard, deadline))
    }
}
