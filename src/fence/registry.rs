//! The running fences, one per lease: started (its mark loaded from the state
//! store) and stopped (its requests drained or aborted) as a unit at run time —
//! start-up uses exactly this, a config reload and a cluster's shard handover too.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::refresh::Refresh;
use super::{Fence, FenceError};
use crate::epoch::{Epoch, LeaseName};
use crate::lease::Epochs;
use crate::lock_order::Ordered;
use crate::state::{Owner, StateError, StateStore};

/// The running fences, one per lease.
pub struct Fences {
    epochs: Epochs,
    state: Arc<dyn StateStore>,
    refresh: Arc<Refresh>,
    running: Mutex<BTreeMap<LeaseName, Arc<Fence>>>,
}

impl Fences {
    /// `refresh_interval`: SPEC §4.3's, the most a lease in use waits between listings.
    pub fn new(
        epochs: Epochs,
        state: Arc<dyn StateStore>,
        refresh_interval: Duration,
    ) -> Arc<Fences> {
        Arc::new(Fences {
            epochs,
            state,
            refresh: Refresh::new(refresh_interval),
            running: Mutex::new(BTreeMap::new()),
        })
    }

    /// The refresh schedule every fence started here books its listings on
    /// ([`super::refresh_all`] runs it).
    pub(crate) fn refresh(&self) -> &Arc<Refresh> {
        &self.refresh
    }

    fn running(&self) -> Ordered<'_, BTreeMap<LeaseName, Arc<Fence>>> {
        crate::lock_order::lock("fences", &self.running)
    }

    /// Starts the fence of `lease` from its durable mark, or returns the running
    /// one. `settle` is the longest drain timeout of its routes ([`Fence::new`]).
    pub async fn start(
        &self,
        lease: &LeaseName,
        settle: Duration,
    ) -> Result<Arc<Fence>, StateError> {
        if let Some(f) = self.get(lease) {
            return Ok(f);
        }
        let stored = self.state.marks(lease).await?;
        let fence = Fence::new(
            lease.clone(),
            self.epochs.clone(),
            self.state.clone(),
            Owner::SINGLE,
            settle,
            self.refresh.clone(),
            stored,
            Epoch::NONE,
        );
        // Two starters of one lease: the first one in wins, the other's is dropped
        // unused (nothing was admitted through it).
        Ok(self.running().entry(lease.clone()).or_insert(fence).clone())
    }

    /// A takeover (SPEC §10.2): starts the fence of `lease` under `owner` with
    /// mark = max(stored mark, the latest epoch listed in the store now). A fence
    /// of an older tenure still registered is replaced, and stopped at once (its
    /// tenure is over: its writes would fail anyway).
    pub async fn take_over(
        &self,
        lease: &LeaseName,
        settle: Duration,
        owner: Owner,
    ) -> Result<Arc<Fence>, FenceError> {
        // Listed after the stored mark (an epoch the store had: objects are never
        // deleted), so a takeover does not page through the lease's history.
        let stored = self.state.marks(lease).await.map_err(FenceError::State)?;
        let listed = self
            .epochs
            .latest_after(lease, stored.mark)
            .await
            .map_err(|e| FenceError::StoreUnavailable {
                lease: lease.clone(),
                epoch: Epoch::NONE,
                detail: e.to_string(),
            })?;
        let fence = Fence::new(
            lease.clone(),
            self.epochs.clone(),
            self.state.clone(),
            owner,
            settle,
            self.refresh.clone(),
            stored,
            listed,
        );
        let old = self.running().insert(lease.clone(), fence.clone());
        if let Some(old) = old {
            tokio::spawn(async move { old.stop(Duration::ZERO).await });
        }
        Ok(fence)
    }

    pub fn get(&self, lease: &LeaseName) -> Option<Arc<Fence>> {
        self.running().get(lease).cloned()
    }

    /// Every running fence, by lease name.
    pub fn all(&self) -> Vec<Arc<Fence>> {
        self.running().values().cloned().collect()
    }

    /// Stops the fence of `lease` if it runs under `owner` (a cluster's tenure;
    /// a newer tenure's fence is left alone), aborting what is still in flight
    /// at `deadline`. Returns whether it was stopped.
    pub async fn stop_owned(
        &self,
        lease: &LeaseName,
        owner: Owner,
        deadline: tokio::time::Instant,
    ) -> bool {
        let fence = {
            let mut running = self.running();
            match running.get(lease) {
                Some(f) if f.owner() == owner => running.remove(lease),
                _ => None,
            }
        };
        match fence {
            Some(f) => {
                f.stop_by(deadline).await;
                true
            }
            None => false,
        }
    }

    /// Stops the fence of `lease` ([`Fence::stop`]) and forgets it. Returns
    /// whether it was running.
    pub async fn stop(&self, lease: &LeaseName, drain_timeout: Duration) -> bool {
        let fence = self.running().remove(lease);
        match fence {
            Some(f) => {
                f.stop(drain_timeout).await;
                true
            }
            None => false,
        }
    }
}
