//! What an operator does by hand: free or complete a lease whose holder is stuck, and count
//! what the store holds.

use crate::backend::{Backend, Reads};
use crate::inbox::Inbox;
use crate::rows::{Change, KeyCount, StoredOffset};
use justonce_core::{Error, Identity};
use std::time::Duration;

impl<DB: Backend> Inbox<DB> {
    /// Frees a key whose lease is in progress, whoever holds it, so that the next claim
    /// takes it at once with a larger token: for a worker that is stuck or gone.
    ///
    /// It is the lease running out now, by the store's clock: until another claim takes the
    /// key over, its holder may still complete, renew or release it; afterwards the holder
    /// gets [`Error::LeaseLost`]. Returns `false`, changing nothing, for a key that is not
    /// stored or is done.
    pub async fn release_key(&self, identity: &Identity) -> Result<bool, Error> {
        self.force(Change::ForceRelease { identity }).await
    }

    /// Marks a key whose lease is in progress done, whoever holds it, with `result` (or none)
    /// for later claims to read: for work an operator knows was done.
    ///
    /// The key gets a new token, so its holder's late complete, renew or release gets
    /// [`Error::LeaseLost`]. Returns `false`, changing nothing, for a key that is not stored
    /// or is done already.
    pub async fn complete_key(
        &self,
        identity: &Identity,
        result: Option<&[u8]>,
    ) -> Result<bool, Error> {
        self.force(Change::ForceComplete { identity, result }).await
    }

    /// How many keys each consumer holds in each scope, ordered by consumer and scope. It
    /// counts every row of the keys table.
    pub async fn key_counts(&self) -> Result<Vec<KeyCount>, Error> {
        let shared = self.shared();
        shared.sql.key_counts(&shared.pool).await
    }

    /// How long ago this consumer's oldest key was processed, in any scope; zero without
    /// keys. Past the retention, it is how far the purge is behind.
    pub async fn oldest_key_age(&self) -> Result<Duration, Error> {
        let shared = self.shared();
        let age_ms = shared
            .sql
            .oldest_key_age_ms(&shared.pool, self.consumer().as_str())
            .await?;
        Ok(Duration::from_millis(u64::try_from(age_ms).unwrap_or(0)))
    }

    /// Every stored stream offset of every consumer, ordered by consumer, stream and
    /// partition.
    pub async fn all_offsets(&self) -> Result<Vec<StoredOffset>, Error> {
        let shared = self.shared();
        shared.sql.all_offsets(&shared.pool).await
    }

    async fn force(&self, change: Change<'_>) -> Result<bool, Error> {
        let shared = self.shared();
        let _writer = shared.queue_writer().await;
        Ok(shared.sql.change(&shared.pool, change).await? > 0)
    }
}
