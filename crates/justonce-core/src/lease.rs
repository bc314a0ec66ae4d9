use crate::{Error, Fingerprint, Identity};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// A key held for work that cannot share the key's transaction, such as a card charge or
/// an email: the holder does the work, then [completes](Leases::complete) the key with
/// its result.
///
/// The token fences the holder: each acquisition of a key gets a larger token than the
/// last, and a holder whose lease ran out and was taken over can no longer complete,
/// renew or release the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The key held.
    pub identity: Identity,
    /// This holder's fencing token.
    pub token: i64,
}

impl Lease {
    /// The error for a change this holder may no longer make.
    pub fn lost(&self) -> Error {
        Error::LeaseLost {
            key: self.identity.key.as_str().to_owned(),
            token: self.token,
        }
    }
}

/// What asking for a lease on a key found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "only `Acquired` may do the work"]
pub enum LeaseClaim {
    /// This caller holds the key until the lease runs out: do the work, then complete.
    Acquired(Lease),
    /// The key is done. `result` is what its holder completed it with; `None` for a key
    /// claimed inside a transaction, which stores no result.
    Done {
        /// The stored result.
        result: Option<Vec<u8>>,
    },
    /// Another holder has the key for `remaining` more, by the store's clock.
    InProgress {
        /// How long until the lease runs out and the key may be taken over.
        remaining: Duration,
    },
    /// The key is held or done with another payload: the sender reused a key.
    KeyReused {
        /// The fingerprint stored with the key.
        stored: Fingerprint,
        /// The fingerprint of the payload just received.
        received: Fingerprint,
    },
}

/// A boxed future, so that [`Leases`] can be used as a trait object.
pub type LeaseFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send + 'a>>;

/// A store that holds keys as leases. Expiry is judged by the store's clock, never the
/// caller's.
///
/// A key is claimed once whichever way it was claimed: a key claimed inside a
/// transaction is [`LeaseClaim::Done`] here, and a key held or completed as a lease is a
/// duplicate to a transactional claim.
pub trait Leases: Send + Sync {
    /// Takes the key for `lease_for` if it is free or its lease ran out; otherwise says
    /// who has it.
    fn claim_lease<'a>(
        &'a self,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_for: Duration,
    ) -> LeaseFuture<'a, LeaseClaim>;

    /// Marks the key done with `result`. [`Error::LeaseLost`] if another holder took the
    /// key over.
    fn complete<'a>(&'a self, lease: &'a Lease, result: &'a [u8]) -> LeaseFuture<'a, ()>;

    /// Gives the key up so that the next claim takes it at once, after a failure the
    /// caller wants retried. [`Error::LeaseLost`] if another holder took the key over.
    fn release<'a>(&'a self, lease: &'a Lease) -> LeaseFuture<'a, ()>;

    /// Extends the lease to `lease_for` from now, for long work. [`Error::LeaseLost`] if
    /// another holder took the key over.
    fn renew<'a>(&'a self, lease: &'a Lease, lease_for: Duration) -> LeaseFuture<'a, ()>;
}

/// A shared store is a store, so that one can serve several layers and workers.
impl<L: Leases + ?Sized> Leases for std::sync::Arc<L> {
    fn claim_lease<'a>(
        &'a self,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_for: Duration,
    ) -> LeaseFuture<'a, LeaseClaim> {
        (**self).claim_lease(identity, fingerprint, lease_for)
    }

    fn complete<'a>(&'a self, lease: &'a Lease, result: &'a [u8]) -> LeaseFuture<'a, ()> {
        (**self).complete(lease, result)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> LeaseFuture<'a, ()> {
        (**self).release(lease)
    }

    fn renew<'a>(&'a self, lease: &'a Lease, lease_for: Duration) -> LeaseFuture<'a, ()> {
        (**self).renew(lease, lease_for)
    }
}
