//! Paused deliveries (SPEC §11, "Pause and resume"): an operator's pause of a
//! queued route or of a lease, kept in the state beside the messages so that
//! it survives a restart and holds on whichever member serves the lease. While
//! a lease's head message is of a paused route, or the lease is paused, no
//! attempt of that lease starts — nothing behind the head overtakes it
//! (per-lease order holds). Acceptances go on; an attempt out when a pause
//! lands finishes.

use std::collections::BTreeMap;

/// What a pause names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pausable {
    /// A queued route (`[[route]] name`).
    Route(String),
    /// A lease, whatever route its messages came by.
    Lease(String),
}

impl Pausable {
    /// The kind as the state keeps it (`route` or `lease`).
    pub fn kind(&self) -> &'static str {
        match self {
            Pausable::Route(_) => "route",
            Pausable::Lease(_) => "lease",
        }
    }

    /// The route's or the lease's name.
    pub fn name(&self) -> &str {
        match self {
            Pausable::Route(n) | Pausable::Lease(n) => n,
        }
    }

    /// From the state's kind and name; `None` for a kind this build does not know.
    pub fn of(kind: &str, name: &str) -> Option<Pausable> {
        match kind {
            "route" => Some(Pausable::Route(name.to_owned())),
            "lease" => Some(Pausable::Lease(name.to_owned())),
            _ => None,
        }
    }
}

/// The pauses in force, each with when it began (ms since the epoch).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Paused(pub BTreeMap<Pausable, u64>);

impl Paused {
    /// Since when `route` is paused, if it is.
    pub fn route(&self, route: &str) -> Option<u64> {
        self.0.get(&Pausable::Route(route.to_owned())).copied()
    }

    /// Since when `lease` is paused, if it is.
    pub fn lease(&self, lease: &str) -> Option<u64> {
        self.0.get(&Pausable::Lease(lease.to_owned())).copied()
    }

    /// Whether a message of `route` on `lease` may not start an attempt now.
    pub fn holds(&self, lease: &str, route: &str) -> bool {
        self.lease(lease).is_some() || self.route(route).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_of_the_route_or_of_the_lease_holds_a_message() {
        let mut p = Paused::default();
        assert!(!p.holds("l", "r"));
        p.0.insert(Pausable::Route("r".into()), 5);
        assert!(p.holds("l", "r"));
        assert!(p.holds("other", "r"));
        assert!(!p.holds("l", "r2"));
        p.0.insert(Pausable::Lease("l".into()), 7);
        assert!(p.holds("l", "r2"));
        assert_eq!(p.lease("l"), Some(7));
        assert_eq!(
            Pausable::of("lease", "l"),
            Some(Pausable::Lease("l".into()))
        );
        assert_eq!(Pausable::of("shard", "l"), None);
    }
}
