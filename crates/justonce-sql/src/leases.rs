//! Leases: keys held for work outside the transaction, in the same table as claims.

use crate::backend::{Backend, Queries, Reads};
use crate::inbox::Inbox;
use crate::rows::Change;
use crate::shared::{driver_error, millis};
use justonce_core::{Error, Fingerprint, Identity, Lease, LeaseClaim, LeaseFuture, Leases};
use std::time::Duration;
use tracing::Instrument;

/// A lease claim can lose a race: the row it could not take may expire, be released or
/// vanish before it is read. It asks again this many times before answering in progress.
const CLAIM_ATTEMPTS: u32 = 3;

impl<DB: Backend> Inbox<DB> {
    async fn take_lease(
        &self,
        identity: &Identity,
        received: &Fingerprint,
        lease_for: Duration,
    ) -> Result<LeaseClaim, Error> {
        let shared = self.shared();
        for _ in 0..CLAIM_ATTEMPTS {
            let taken = {
                let _writer = shared.queue_writer().await;
                shared
                    .sql
                    .lease_claim(&shared.pool, identity, received, millis(lease_for))
                    .await?
            };
            if let Some(token) = taken {
                if token > 1 {
                    metrics::counter!("justonce_lease_takeovers_total").increment(1);
                }
                return Ok(LeaseClaim::Acquired(Lease {
                    identity: identity.clone(),
                    token,
                }));
            }
            let Some(state) = shared.sql.lease_state(&shared.pool, identity).await? else {
                continue;
            };
            if state.fingerprint != *received {
                return Ok(LeaseClaim::KeyReused {
                    stored: state.fingerprint,
                    received: *received,
                });
            }
            if state.done {
                return Ok(LeaseClaim::Done {
                    result: state.result,
                });
            }
            if state.remaining_ms > 0 {
                return Ok(LeaseClaim::InProgress {
                    remaining: Duration::from_millis(state.remaining_ms.unsigned_abs()),
                });
            }
        }
        Ok(LeaseClaim::InProgress {
            remaining: Duration::ZERO,
        })
    }

    /// What the store holds for a key, or `None` if it is not claimed.
    pub async fn lookup(&self, identity: &Identity) -> Result<Option<StoredKey>, Error> {
        let shared = self.shared();
        let state = shared.sql.lease_state(&shared.pool, identity).await?;
        Ok(state.map(|state| StoredKey {
            fingerprint: state.fingerprint,
            result: state.result,
            lease_remaining: (!state.done)
                .then(|| Duration::from_millis(state.remaining_ms.max(0).unsigned_abs())),
        }))
    }

    /// Stores `result` with a key this transaction claimed, so that the key's work and its
    /// result commit together; [`Inbox::lookup`] and lease claims return it afterwards.
    pub async fn store_result(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        identity: &Identity,
        result: &[u8],
    ) -> Result<(), Error> {
        self.shared().sql.store_result(tx, identity, result).await
    }

    /// Stores `stored`'s result with its key, if there is one, and commits `tx`: the
    /// transaction's writes, the key and the result take effect together.
    pub async fn commit_with_result(
        &self,
        mut tx: sqlx::Transaction<'_, DB>,
        stored: Option<(&Identity, &[u8])>,
    ) -> Result<(), Error> {
        if let Some((identity, result)) = stored {
            self.store_result(&mut tx, identity, result).await?;
        }
        tx.commit().await.map_err(driver_error::<DB>)
    }

    /// Rolls `tx` back at once, so that its connection goes back to the pool clean.
    pub async fn roll_back(&self, tx: sqlx::Transaction<'_, DB>) -> Result<(), Error> {
        tx.rollback().await.map_err(driver_error::<DB>)
    }

    /// Runs one change to a lease; no row changed means another holder has the key.
    async fn change_lease(&self, lease: &Lease, change: Change<'_>) -> Result<(), Error> {
        let shared = self.shared();
        let changed = {
            let _writer = shared.queue_writer().await;
            shared.sql.change(&shared.pool, change).await?
        };
        if changed == 0 {
            return Err(lease.lost());
        }
        Ok(())
    }
}

/// A claimed key as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredKey {
    /// The fingerprint of the payload it was claimed with.
    pub fingerprint: Fingerprint,
    /// The result stored with it, if any.
    pub result: Option<Vec<u8>>,
    /// For a key held as a lease, how long until the lease runs out (zero once it has);
    /// `None` for a done key.
    pub lease_remaining: Option<Duration>,
}

/// Leases on the inbox's store. The identity names its own scope and consumer, so one
/// inbox serves leases for any of them; [`Inbox::identity`] builds this inbox's own.
///
/// ```no_run
/// # async fn example(inbox: justonce_sql::Inbox<sqlx::Postgres>) -> Result<(), justonce_sql::Error> {
/// use justonce_sql::{Fingerprint, Key, LeaseClaim, Leases};
/// use std::time::Duration;
///
/// let request = br#"{"amount": 1250}"#;
/// let identity = inbox.identity(&Key::new("charge:ord_1")?);
/// match inbox.claim_lease(&identity, &Fingerprint::of(request), Duration::from_secs(30)).await? {
///     LeaseClaim::Acquired(lease) => {
///         let receipt = b"ch_123"; // charge the card here
///         inbox.complete(&lease, receipt).await?;
///     }
///     LeaseClaim::Done { result } => println!("charged before: {result:?}"),
///     LeaseClaim::InProgress { remaining } => println!("another worker has it for {remaining:?}"),
///     LeaseClaim::KeyReused { .. } => println!("same key, another request"),
/// }
/// # Ok(())
/// # }
/// ```
impl<DB: Backend> Leases for Inbox<DB> {
    fn claim_lease<'a>(
        &'a self,
        identity: &'a Identity,
        fingerprint: &'a Fingerprint,
        lease_for: Duration,
    ) -> LeaseFuture<'a, LeaseClaim> {
        let span = tracing::debug_span!(
            "justonce.lease",
            scope = %identity.scope,
            consumer = %identity.consumer,
            key = %identity.key,
        );
        Box::pin(
            self.take_lease(identity, fingerprint, lease_for)
                .instrument(span),
        )
    }

    fn complete<'a>(&'a self, lease: &'a Lease, result: &'a [u8]) -> LeaseFuture<'a, ()> {
        Box::pin(self.change_lease(lease, Change::LeaseComplete { lease, result }))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> LeaseFuture<'a, ()> {
        Box::pin(self.change_lease(lease, Change::LeaseRelease { lease }))
    }

    fn renew<'a>(&'a self, lease: &'a Lease, lease_for: Duration) -> LeaseFuture<'a, ()> {
        let lease_ms = millis(lease_for);
        Box::pin(self.change_lease(lease, Change::LeaseRenew { lease, lease_ms }))
    }
}
