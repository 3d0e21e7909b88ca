//! The rule for fencegate's std mutexes on the request path: **a thread holds at
//! most one of them at a time.** Copy what is needed out, release, then take the
//! next. Two mutexes taken in opposite orders on two paths (a `/metrics` scrape
//! holding a fence's known epochs while reading its gate, an admission deciding
//! under the gate's lock while reading the known epochs) block both runtime
//! threads forever, and with them every listener.
//!
//! [`Ordered`] wraps the guard of every mutex under the rule. In debug builds
//! (every test build) taking one while the thread already holds another panics
//! at once, naming both — so any test that merely runs a path that nests them
//! fails deterministically, with no need to hit the deadlocking interleaving. In
//! release builds it is the bare guard.

use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

#[cfg(all(debug_assertions, not(fencegate_loom)))]
mod held {
    use std::cell::Cell;

    thread_local! {
        static HELD: Cell<Option<&'static str>> = const { Cell::new(None) };
    }

    /// Marks `name` as held by this thread until dropped.
    pub(super) struct Held;

    impl Held {
        pub(super) fn take(name: &'static str) -> Held {
            HELD.with(|h| {
                if let Some(other) = h.get() {
                    panic!(
                        "lock order: took the {name} lock while holding the {other} lock \
                         (a thread holds at most one; see src/lock_order.rs)"
                    );
                }
                h.set(Some(name));
            });
            Held
        }
    }

    impl Drop for Held {
        fn drop(&mut self) {
            HELD.with(|h| h.set(None));
        }
    }
}

#[cfg(not(all(debug_assertions, not(fencegate_loom))))]
mod held {
    pub(super) struct Held;

    impl Held {
        #[inline(always)]
        pub(super) fn take(_name: &'static str) -> Held {
            Held
        }
    }
}

/// A guard of a mutex under the one-lock-at-a-time rule.
pub(crate) struct Ordered<'a, T> {
    // Dropped first: the lock is released before the thread is marked free.
    guard: MutexGuard<'a, T>,
    _held: held::Held,
}

/// Locks `m`, named `name` in the panic message of a nesting. A poisoned lock only
/// means another thread panicked elsewhere; the state under it stays consistent on
/// every panic-free path, so its guard is used as is.
pub(crate) fn lock<'a, T>(name: &'static str, m: &'a Mutex<T>) -> Ordered<'a, T> {
    let held = held::Held::take(name);
    Ordered {
        guard: m.lock().unwrap_or_else(|p| p.into_inner()),
        _held: held,
    }
}

impl<T> Deref for Ordered<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Ordered<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

#[cfg(all(test, debug_assertions, not(fencegate_loom)))]
mod tests {
    use super::*;

    #[test]
    fn one_then_another_after_release_is_fine() {
        let (a, b) = (Mutex::new(1), Mutex::new(2));
        let x = *lock("a", &a);
        let y = *lock("b", &b);
        assert_eq!(x + y, 3);
    }

    #[test]
    #[should_panic(expected = "took the b lock while holding the a lock")]
    fn nesting_panics_naming_both() {
        let (a, b) = (Mutex::new(1), Mutex::new(2));
        let _ga = lock("a", &a);
        let _gb = lock("b", &b);
    }
}
