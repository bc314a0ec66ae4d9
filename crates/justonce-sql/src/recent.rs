//! Keys this process has recently seen committed, so that a duplicate of one is answered
//! without a round trip to the database.
//!
//! Safe because a committed key stays claimed until it is purged, and a purge deletes only
//! keys older than the retry horizon at the least: an entry is forgotten well before that
//! (after [`RecentKeys::MAX_AGE`] or the horizon, whichever is shorter), and a purge in this
//! process forgets them all. The fingerprint is kept with the key, so a reuse of the key
//! with another payload is still told apart.

use justonce_core::{Fingerprint, Identity};
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most `capacity` keys, each for at most `max_age`, oldest forgotten first.
pub(crate) struct RecentKeys {
    capacity: usize,
    max_age: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    fingerprints: HashMap<Identity, (Fingerprint, Instant)>,
    /// Insertion order, for forgetting the oldest; an identity seen again is only in the
    /// map once, with its first time.
    order: VecDeque<Identity>,
}

impl RecentKeys {
    /// The longest an entry is trusted, whatever the retry horizon.
    pub(crate) const MAX_AGE: Duration = Duration::from_secs(300);

    pub(crate) fn new(capacity: usize, retry_horizon: Duration) -> Self {
        Self {
            capacity,
            max_age: retry_horizon.min(Self::MAX_AGE),
            state: Mutex::new(State::default()),
        }
    }

    /// The fingerprint this key was committed with, if it was seen recently.
    pub(crate) fn get(&self, identity: &Identity) -> Option<Fingerprint> {
        if self.capacity == 0 {
            return None;
        }
        let state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (fingerprint, seen) = state.fingerprints.get(identity)?;
        (seen.elapsed() < self.max_age).then_some(*fingerprint)
    }

    /// Remembers that `identity` is committed with `fingerprint`.
    pub(crate) fn insert(&self, identity: &Identity, fingerprint: Fingerprint) {
        if self.capacity == 0 {
            return;
        }
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        if state.fingerprints.contains_key(identity) {
            return;
        }
        while state.order.len() >= self.capacity
            || state
                .order
                .front()
                .and_then(|oldest| state.fingerprints.get(oldest))
                .is_some_and(|(_, seen)| now.duration_since(*seen) >= self.max_age)
        {
            let Some(oldest) = state.order.pop_front() else {
                break;
            };
            state.fingerprints.remove(&oldest);
        }
        state
            .fingerprints
            .insert(identity.clone(), (fingerprint, now));
        state.order.push_back(identity.clone());
    }

    /// Forgets every key: after a purge, a key may be claimable again.
    pub(crate) fn clear(&self) {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        state.fingerprints.clear();
        state.order.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use justonce_core::{Consumer, Key, Scope};

    fn identity(key: &str) -> Identity {
        Identity::new(
            Scope::none(),
            Consumer::new("c").unwrap(),
            Key::new(key).unwrap(),
        )
    }

    #[test]
    fn remembers_the_fingerprint_and_forgets_the_oldest_past_capacity() {
        let recent = RecentKeys::new(2, Duration::from_secs(60));
        let (a, b, c) = (identity("a"), identity("b"), identity("c"));
        recent.insert(&a, Fingerprint::of(b"1"));
        recent.insert(&b, Fingerprint::of(b"2"));
        assert_eq!(recent.get(&a), Some(Fingerprint::of(b"1")));
        recent.insert(&c, Fingerprint::of(b"3"));
        assert_eq!(recent.get(&a), None, "the oldest was forgotten");
        assert_eq!(recent.get(&c), Some(Fingerprint::of(b"3")));
        recent.clear();
        assert_eq!(recent.get(&b), None);
    }

    #[test]
    fn an_entry_is_not_trusted_past_its_age() {
        let recent = RecentKeys::new(10, Duration::from_millis(1));
        let a = identity("a");
        recent.insert(&a, Fingerprint::of(b"1"));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(recent.get(&a), None);
    }

    #[test]
    fn capacity_zero_remembers_nothing() {
        let recent = RecentKeys::new(0, Duration::from_secs(60));
        recent.insert(&identity("a"), Fingerprint::of(b"1"));
        assert_eq!(recent.get(&identity("a")), None);
    }
}
