//! The inbox: claims keys under the unique constraint, in the caller's transaction.

// The rule implemented here: https://agentwranglers.se/playbook/events/consuming-events/idempotent-consumers

use crate::backend::{Backend, ForwardFailed, OneStatementAnswer, Queries, Reads, Watcher};
use crate::common::migration_script;
use crate::dashboard::DuplicateCounts;
use crate::effect::{CheckedEffects, Effect, with_claimed_row};
use crate::outbox::{Message, Outbox};
use crate::recent::RecentKeys;
use crate::rows::{Announce, Batch, Change, ClaimRow, NewOutboxRow, OffsetRow, Stored};
use crate::shared::{Shared, driver_error, in_batches, millis, random_u64, vanished};
use crate::tables::Tables;
use crate::wake::{Forwards, NOTIFY_EVERY, RelayWake};
use group::CommitQueue;
use justonce_core::{
    Claim, Consumer, Error, Fingerprint, Identity, Key, Offset, OffsetCommit, Outcome, Retention,
    Scope,
};
use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

pub(crate) mod group;

/// The future a unit of work returns: it borrows the transaction for `'t`, and may borrow
/// anything that outlives the call to [`Inbox::run`].
pub type WorkFuture<'t, T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 't>>;

/// Settings shared by every [`Inbox`] made from one connection.
#[derive(Debug, Clone)]
pub struct InboxOptions {
    prefix: String,
    retention: Retention,
    max_attempts: u32,
    recent_keys: usize,
    pool_size: u32,
    acquire_timeout: Duration,
    notify_every: Duration,
    share_commits: bool,
}

impl Default for InboxOptions {
    fn default() -> Self {
        Self {
            prefix: "justonce_".to_owned(),
            retention: Retention::default(),
            max_attempts: 10,
            recent_keys: 10_000,
            pool_size: 10,
            acquire_timeout: Duration::from_secs(30),
            notify_every: NOTIFY_EVERY,
            share_commits: false,
        }
    }
}

impl InboxOptions {
    /// The prefix of justonce's table names (default `justonce_`): 1 to 40 characters of
    /// `a-z`, `0-9` and `_`, not starting with a digit.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long keys are kept (default 7 days, for a sender retrying 3 days).
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }

    /// How many times [`Inbox::run`] tries a unit of work that failed with a serialization
    /// failure, a deadlock or a busy database (default 10), at least once.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// How many keys [`Inbox::run`] remembers having seen committed (default 10,000), each
    /// for at most 5 minutes or the retry horizon if shorter: a duplicate of one is
    /// answered without asking the database. 0 asks the database every time. A key stays
    /// claimed until a purge, which deletes only keys past the retry horizon, so what is
    /// remembered stays true; a purge through this inbox forgets everything.
    pub fn recent_keys(mut self, keys: usize) -> Self {
        self.recent_keys = keys;
        self
    }

    /// The most connections [`Inbox::connect_with`] opens (default 10), at least one.
    pub fn pool_size(mut self, connections: u32) -> Self {
        self.pool_size = connections.max(1);
        self
    }

    /// How long a claim waits for a free connection, or for the database to accept a new
    /// one, before it fails (default 30 s). A service that answers senders waiting on it
    /// sets this short, so that a database outage is answered at once, not timed out.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// On PostgreSQL, the shortest time between two notifications this process sends to
    /// wake the relays of other processes after a run that forwarded commits (default
    /// 5 ms): [`Inbox::run_forward`], or [`Inbox::forward`] in a run's work. They are sent
    /// after the commit, not in it, and one covers every commit since the last: longer
    /// spares the database under load, and a relay elsewhere waits up to that long. This
    /// process's relays are woken at once.
    pub fn notify_every(mut self, interval: Duration) -> Self {
        self.notify_every = interval;
        self
    }

    /// Whether concurrent [`Inbox::run_forward`] calls share transactions (default
    /// false). On: a call that comes while others commit waits for their commit, then
    /// commits with every call that came meanwhile (up to 256), in one commit: one
    /// statement over arrays on PostgreSQL, one transaction elsewhere; a call alone goes at
    /// once. Each call still gets its own outcome, only after the commit that holds it. A
    /// shared commit that fails is run again one call at a time, so one failing call never
    /// fails another. Fewer commits mean fewer flushes of the disk:
    /// more calls per second when many come at once.
    pub fn share_commits(mut self, share: bool) -> Self {
        self.share_commits = share;
        self
    }
}

/// One consumer's view of a key store: claims its keys, runs its work once per key.
///
/// Cloning is cheap and clones share the connection pool. [`Inbox::with_consumer`] and
/// [`Inbox::with_scope`] give other consumers and tenants of the same store.
pub struct Inbox<DB: Backend> {
    shared: Arc<Shared<DB>>,
    consumer: Consumer,
    scope: Scope,
}

impl<DB: Backend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            consumer: self.consumer.clone(),
            scope: self.scope.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("database", &<DB as sqlx::Database>::NAME)
            .field("prefix", &self.shared.tables.prefix)
            .field("consumer", &self.consumer)
            .field("scope", &self.scope)
            .finish()
    }
}

impl<DB: Backend> Inbox<DB> {
    /// Connects to `url` with the default [`InboxOptions`]. A `sqlite://` file is created if
    /// missing.
    pub async fn connect(url: &str, consumer: Consumer) -> Result<Self, Error> {
        Self::connect_with(url, consumer, InboxOptions::default()).await
    }

    /// Connects to `url` with `options`.
    ///
    /// Its pool does not ping the connection of a transaction before handing it out, as
    /// sqlx does by default: see [`Inbox::begin`].
    pub async fn connect_with(
        url: &str,
        consumer: Consumer,
        options: InboxOptions,
    ) -> Result<Self, Error> {
        let pool_options = crate::pool::options(options.pool_size, options.acquire_timeout);
        let (pool, watcher) = DB::connect(url, pool_options).await?;
        Self::owning(pool, watcher, consumer, options)
    }

    /// Uses a pool the application already has. For SQLite, set WAL and a busy timeout on
    /// it, as [`Inbox::connect`] does. Processes that open one new file at once can still
    /// get SQLITE_BUSY while it turns to WAL, whatever the busy timeout; `connect` tries
    /// again for as long as the timeout.
    pub fn from_pool(
        pool: sqlx::Pool<DB>,
        consumer: Consumer,
        options: InboxOptions,
    ) -> Result<Self, Error> {
        Self::owning(pool, None, consumer, options)
    }

    /// An inbox on `pool`, holding the pool's watcher if it has one.
    fn owning(
        pool: sqlx::Pool<DB>,
        watcher: Option<Watcher>,
        consumer: Consumer,
        options: InboxOptions,
    ) -> Result<Self, Error> {
        let tables = Tables::new(&options.prefix)?;
        let sql = DB::statements(&tables);
        Ok(Self {
            shared: Arc::new(Shared {
                pool,
                tables,
                sql,
                retention: options.retention,
                max_attempts: options.max_attempts,
                writer: tokio::sync::Mutex::new(()),
                recent: RecentKeys::new(options.recent_keys, options.retention.retry_horizon()),
                effects: CheckedEffects::default(),
                duplicates: DuplicateCounts::default(),
                relays: RelayWake::new(options.notify_every),
                // One group per two connections commits at once: the other connections
                // stay free for the relay and single runs. One writer takes one.
                commits: options.share_commits.then(|| {
                    let groups = if DB::ONE_WRITER {
                        1
                    } else {
                        options.pool_size as usize / 2
                    };
                    CommitQueue::new(groups)
                }),
                _watcher: watcher,
            }),
            consumer,
            scope: Scope::none(),
        })
    }

    /// The same store for another consumer.
    pub fn with_consumer(&self, consumer: Consumer) -> Self {
        Self {
            consumer,
            ..self.clone()
        }
    }

    /// The same store and consumer within a tenant's scope.
    pub fn with_scope(&self, scope: Scope) -> Self {
        Self {
            scope,
            ..self.clone()
        }
    }

    pub(crate) fn shared(&self) -> &Shared<DB> {
        &self.shared
    }

    /// The SQL that [`Inbox::migrate`] runs, as one script for this database, for teams
    /// whose database administrators apply migrations themselves: the migrations after
    /// version `since` (0 for a new database; an existing one is at the highest version in
    /// its `migrations` table), each recorded in that table, in one transaction.
    pub fn migration_sql(options: &InboxOptions, since: i64) -> Result<String, Error> {
        Ok(migration_script(
            &DB::SCHEMA,
            &Tables::new(&options.prefix)?,
            since,
        ))
    }

    /// The connection pool, for the application's own queries.
    pub fn pool(&self) -> &sqlx::Pool<DB> {
        &self.shared.pool
    }

    /// This inbox's consumer.
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// This inbox's scope: [`Scope::none`] unless made by [`Inbox::with_scope`].
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The unique identity of `key` for this inbox's scope and consumer.
    pub fn identity(&self, key: &Key) -> Identity {
        Identity::new(self.scope.clone(), self.consumer.clone(), key.clone())
    }

    /// Creates or updates justonce's tables and checks them. Safe to call from several
    /// processes at once, and cheap when there is nothing to do. Returns how many
    /// migrations ran.
    pub async fn migrate(&self) -> Result<usize, Error> {
        let applied = DB::migrate(&self.shared.pool, &self.shared.tables).await?;
        self.check().await?;
        Ok(applied)
    }

    /// Checks that the keys table exists with its unique constraint on (scope, consumer,
    /// key). Without the constraint, duplicates would slip through: this is an error.
    pub async fn check(&self) -> Result<(), Error> {
        if self
            .shared
            .sql
            .has_unique_constraint(&self.shared.pool)
            .await?
        {
            Ok(())
        } else {
            Err(Error::Schema(format!(
                "table {} is missing or has no unique constraint on (scope, consumer, key): \
                 run migrate, and do not create or alter the table by hand",
                self.shared.tables.keys
            )))
        }
    }

    /// Opens a writing transaction: `BEGIN IMMEDIATE` on SQLite, so that it waits for the
    /// write lock up front instead of failing with SQLITE_BUSY when it first writes.
    ///
    /// The pool of [`Inbox::connect_with`] hands out its connection without a ping: BEGIN
    /// tests it, one round trip instead of two. A connection found broken by its BEGIN is
    /// replaced at once, up to the pool's size, as a failed ping would have been.
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, DB>, Error> {
        (crate::pool::begin(&self.shared.pool).await).map_err(driver_error::<DB>)
    }

    /// Claims `key` inside the caller's transaction, through the unique constraint.
    ///
    /// [`Claim::First`]: do the work in the same transaction, then commit; the claim and
    /// the work take effect together or not at all. [`Claim::Duplicate`] and
    /// [`Claim::KeyReused`]: skip the work. On PostgreSQL a concurrent claim of the same key
    /// waits until the first transaction ends, then sees its outcome.
    pub async fn claim(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        key: &Key,
        payload: &[u8],
    ) -> Result<Claim, Error> {
        let fingerprint = Fingerprint::of(payload);
        let claim_id = random_claim_id();
        let identity = self.identity(key);
        let stored = self
            .shared
            .sql
            .claim(
                tx,
                ClaimRow {
                    identity: &identity,
                    fingerprint: &fingerprint,
                    claim_id,
                },
            )
            .await?;
        Ok(judge(
            stored.claim_id == claim_id,
            stored.fingerprint,
            fingerprint,
        ))
    }

    /// Claims a batch of keys in one statement inside the caller's transaction (on MariaDB
    /// and MySQL, one per 10,000 keys), and says for each `(key, payload)`, in order, what
    /// it found.
    ///
    /// Keys are inserted in sorted order, so concurrent batches sharing keys cannot
    /// deadlock. A key given twice in one batch is claimed by its first occurrence; the
    /// later ones are duplicates (or key reuses, if their payloads differ).
    pub async fn claim_many<P: AsRef<[u8]>>(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        messages: &[(Key, P)],
    ) -> Result<Vec<Claim>, Error> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<&Key> = messages.iter().map(|(key, _)| key).collect();
        let fingerprints: Vec<Fingerprint> = messages
            .iter()
            .map(|(_, payload)| Fingerprint::of(payload))
            .collect();
        self.claim_fingerprinted(tx, &keys, &fingerprints, random_claim_id())
            .await
    }

    /// [`Inbox::claim_many`] of `keys` with their payloads' `fingerprints`, the rows it
    /// inserts carrying `claim_id`.
    pub(crate) async fn claim_fingerprinted(
        &self,
        tx: &mut DB::Connection,
        keys: &[&Key],
        fingerprints: &[Fingerprint],
        claim_id: i64,
    ) -> Result<Vec<Claim>, Error> {
        let claimed = (self.claim_at_offsets(tx, keys, fingerprints, claim_id, &[])).await?;
        Ok(claimed.expect(NO_OFFSETS))
    }

    /// [`Inbox::claim_fingerprinted`] with `offsets` moved in the same transaction, in its
    /// statement where the database can; `None` when one of them did not move.
    async fn claim_at_offsets(
        &self,
        tx: &mut DB::Connection,
        keys: &[&Key],
        fingerprints: &[Fingerprint],
        claim_id: i64,
        offsets: &[OffsetRow<'_>],
    ) -> Result<Option<Vec<Claim>>, Error> {
        let key_of = |index: usize| keys[index].as_str();
        // Sorted vectors and binary searches rather than hash maps: the batch is sorted
        // anyway, and this runs for every message of every batch.
        let mut in_key_order: Vec<usize> = (0..keys.len()).collect();
        in_key_order.sort_unstable_by_key(|&index| (key_of(index), index));
        // The first message of each distinct key, in key order, and for each message the
        // place of its key among them.
        let mut firsts: Vec<usize> = Vec::with_capacity(keys.len());
        let mut distinct_of = vec![0; keys.len()];
        for &index in &in_key_order {
            if firsts
                .last()
                .is_none_or(|&first| key_of(first) != key_of(index))
            {
                firsts.push(index);
            }
            distinct_of[index] = firsts.len() - 1;
        }
        let batch = Batch {
            scope: &self.scope,
            consumer: &self.consumer,
            keys: firsts.iter().map(|&index| key_of(index)).collect(),
            fingerprints: firsts.iter().map(|&index| &fingerprints[index]).collect(),
            claim_id,
        };
        // The row holding each distinct key, in the batch's order.
        let mut holders: Vec<Option<Stored>> = vec![None; batch.keys.len()];
        let (rows, moved) = DB::insert_many_at(tx, &self.shared.sql, &batch, offsets).await?;
        if !moved {
            return Ok(None);
        }
        put_in_place(&batch.keys, rows, &mut holders);
        let unread: Vec<&str> = batch
            .keys
            .iter()
            .zip(&holders)
            .filter(|(_, holder)| holder.is_none())
            .map(|(key, _)| *key)
            .collect();
        if !unread.is_empty() {
            let rows =
                DB::find_many(tx, &self.shared.sql, &self.scope, &self.consumer, &unread).await?;
            put_in_place(&batch.keys, rows, &mut holders);
        }
        let claims = keys
            .iter()
            .enumerate()
            .map(|(index, key)| {
                let place = distinct_of[index];
                let stored = holders[place].ok_or_else(|| vanished(&self.identity(key)))?;
                // Only the first message of a key this batch inserted holds the claim.
                let holds = stored.claim_id == batch.claim_id && firsts[place] == index;
                Ok(judge(holds, stored.fingerprint, fingerprints[index]))
            })
            .collect::<Result<_, Error>>()?;
        Ok(Some(claims))
    }

    /// Runs a batch in one transaction: claims the keys of `messages` with one statement
    /// ([`Inbox::claim_many`]), runs `work` for each message whose key it claimed first, and
    /// commits; what each message came to, in order. Any failure rolls the whole batch back
    /// and is returned, without a retry: the caller runs the messages one by one with
    /// [`Inbox::run`], which retries, so that one failing message neither loses nor doubles
    /// the others.
    ///
    /// `claim` gives a message's key and payload.
    pub async fn run_batch<M, E, F>(
        &self,
        messages: &[M],
        claim: impl Fn(&M) -> (&Key, &[u8]),
        mut work: F,
    ) -> Result<Vec<Outcome<()>>, RunError<E>>
    where
        F: for<'t> FnMut(&'t mut sqlx::Transaction<'static, DB>, &'t M) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        let begun = self.begin_batch(messages, claim, &[]).await?;
        let (mut tx, claimed) = begun.expect(NO_OFFSETS);
        let forwards = Forwards::new(self.shared(), false);
        for (message, claim) in messages.iter().zip(&claimed) {
            if *claim == Claim::First
                && let Err(error) = forwards.around(work(&mut tx, message)).await
            {
                return Err(roll_back_work(tx, error).await.into());
            }
        }
        let outcomes = commit_batch(tx, claimed).await?;
        self.batch_committed(&outcomes, &forwards);
        Ok(outcomes)
    }

    /// [`Inbox::run_batch`] with `work` run once for the whole batch, in its transaction
    /// before the commit: it gets the messages whose key the batch claimed first, in order
    /// (none when every key was claimed before), so that it can write them with one
    /// statement, and write what goes with the whole batch, such as a stream's position.
    ///
    /// ```no_run
    /// # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), Box<dyn std::error::Error>> {
    /// use justonce_sql::{Key, sqlx};
    ///
    /// let orders = [(Key::new("order:1")?, b"1".to_vec()), (Key::new("order:2")?, b"2".to_vec())];
    /// inbox
    ///     .run_batch_at_once(&orders, |(key, body)| (key, body.as_slice()), |tx, firsts| {
    ///         let keys: Vec<String> = firsts.iter().map(|(key, _)| key.as_str().to_owned()).collect();
    ///         Box::pin(async move {
    ///             sqlx::query("INSERT INTO shipments (order_key) SELECT * FROM UNNEST($1::text[])")
    ///                 .bind(keys)
    ///                 .execute(&mut **tx)
    ///                 .await
    ///                 .map(drop)
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_batch_at_once<'env, M, E, F>(
        &self,
        messages: &[M],
        claim: impl Fn(&M) -> (&Key, &[u8]),
        work: F,
    ) -> Result<Vec<Outcome<()>>, RunError<E>>
    where
        F: for<'t> FnOnce(&'t mut sqlx::Transaction<'env, DB>, Vec<&'t M>) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let ran = self
            .run_batch_at_offsets(messages, claim, &[], work)
            .await?;
        Ok(ran.expect(NO_OFFSETS))
    }

    /// [`Inbox::run_batch_at_once`] for entries read from a stream: the offset of each
    /// span's partition moves to the span's `last` in the batch's transaction, with the
    /// claim (in the claim's statement, on PostgreSQL). `None`, with nothing committed
    /// and the work not run, when a stored offset was at or past its span's `first`: an
    /// entry of the batch was processed or given up before, as
    /// [`Inbox::commit_offset_span`] says. Give one span per partition. With no
    /// messages, nothing runs and no offset moves.
    pub async fn run_batch_at_offsets<'env, M, E, F>(
        &self,
        messages: &[M],
        claim: impl Fn(&M) -> (&Key, &[u8]),
        spans: &[OffsetSpan<'_>],
        work: F,
    ) -> Result<Option<Vec<Outcome<()>>>, RunError<E>>
    where
        F: for<'t> FnOnce(&'t mut sqlx::Transaction<'env, DB>, Vec<&'t M>) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        (self.run_batch_moving(messages, claim, spans, None, work)).await
    }

    /// [`Inbox::run_batch_at_offsets`] for a batch read while the batch before it still
    /// runs, its transaction open: `before` holds that batch's spans. This batch's keys are
    /// claimed and its work runs beside that batch. Its offsets move last: where that batch
    /// moves a partition's offset too, this one waits for its commit, and moves only from
    /// its `last`. `None`, rolled back, when an offset did not move: that batch rolled back
    /// (its entries did not commit, and this batch must not skip them), or a stored offset
    /// was at or past this batch's `first`.
    ///
    /// Start it once the batch before has claimed its keys and moved its offsets (it runs
    /// its work): then this batch only waits for that one, in the database, which sees any
    /// deadlock between them.
    pub async fn run_batch_after<'env, M, E, F>(
        &self,
        messages: &[M],
        claim: impl Fn(&M) -> (&Key, &[u8]),
        spans: &[OffsetSpan<'_>],
        before: &[OffsetSpan<'_>],
        work: F,
    ) -> Result<Option<Vec<Outcome<()>>>, RunError<E>>
    where
        F: for<'t> FnOnce(&'t mut sqlx::Transaction<'env, DB>, Vec<&'t M>) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        (self.run_batch_moving(messages, claim, spans, Some(before), work)).await
    }

    /// [`Inbox::run_batch_at_offsets`], with the offsets moved in the claim's statement,
    /// or, after a batch `before`, once the work ran.
    async fn run_batch_moving<'env, M, E, F>(
        &self,
        messages: &[M],
        claim: impl Fn(&M) -> (&Key, &[u8]),
        spans: &[OffsetSpan<'_>],
        before: Option<&[OffsetSpan<'_>]>,
        work: F,
    ) -> Result<Option<Vec<Outcome<()>>>, RunError<E>>
    where
        F: for<'t> FnOnce(&'t mut sqlx::Transaction<'env, DB>, Vec<&'t M>) -> WorkFuture<'t, (), E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let at_least = |span: &OffsetSpan<'_>| {
            let before = before?.iter();
            let mut same =
                before.filter(|b| (b.stream, b.partition) == (span.stream, span.partition));
            same.next().map(|b| b.last)
        };
        let offsets: Vec<OffsetRow<'_>> = (spans.iter())
            .map(|span| OffsetRow {
                consumer: self.consumer.as_str(),
                stream: span.stream,
                partition: span.partition,
                offset: span.last,
                above: span.first,
                at_least: at_least(span),
            })
            .collect();
        if messages.is_empty() {
            return Ok(Some(Vec::new()));
        }
        let in_claim: &[OffsetRow<'_>] = match before {
            Some(_) => &[],
            None => &offsets,
        };
        let Some((tx, claimed)) = self.begin_batch(messages, claim, in_claim).await? else {
            return Ok(None);
        };
        // 'env, not 'static: the work may borrow what outlives the call.
        let mut tx: sqlx::Transaction<'env, DB> = tx;
        let firsts: Vec<&M> = (messages.iter().zip(&claimed))
            .filter(|(_, claim)| **claim == Claim::First)
            .map(|(message, _)| message)
            .collect();
        let forwards = Forwards::new(self.shared(), false);
        if let Err(error) = forwards.around(work(&mut tx, firsts)).await {
            return Err(roll_back_work(tx, error).await.into());
        }
        if before.is_some() {
            match self.move_offsets_in(&mut tx, &offsets).await {
                Ok(true) => {}
                Ok(false) => {
                    if let Err(error) = tx.rollback().await {
                        tracing::debug!(%error, "rolling back a batch whose offset did not move");
                    }
                    return Ok(None);
                }
                Err(error) => return Err(rolled_back(tx, RunError::Store(error)).await),
            }
        }
        let outcomes = commit_batch(tx, claimed).await?;
        self.batch_committed(&outcomes, &forwards);
        Ok(Some(outcomes))
    }

    /// Moves each of `offsets` in `tx`, one statement each; false at the first that did not
    /// move.
    async fn move_offsets_in(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        offsets: &[OffsetRow<'_>],
    ) -> Result<bool, Error> {
        for at in offsets {
            if !self.shared.sql.commit_offset(tx, *at).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// After a batch's commit: wakes the relays if its work forwarded rows, and counts its
    /// duplicates for the dashboard.
    fn batch_committed(&self, outcomes: &[Outcome<()>], forwards: &Forwards) {
        if forwards.any() {
            self.shared.wake_relays();
        }
        let duplicates = outcomes
            .iter()
            .filter(|outcome| matches!(outcome, Outcome::Duplicate))
            .count();
        self.shared
            .duplicates
            .add(self.consumer.as_str(), duplicates as u64);
    }

    /// Begins a batch's transaction, claims the keys of `messages` in it and moves
    /// `offsets`; `None`, rolled back, when one of them did not move.
    async fn begin_batch<M, E>(
        &self,
        messages: &[M],
        claim: impl Fn(&M) -> (&Key, &[u8]),
        offsets: &[OffsetRow<'_>],
    ) -> Result<Option<(sqlx::Transaction<'static, DB>, Vec<Claim>)>, RunError<E>> {
        let (keys, fingerprints): (Vec<&Key>, Vec<Fingerprint>) = messages
            .iter()
            .map(|message| {
                let (key, payload) = claim(message);
                (key, Fingerprint::of(payload))
            })
            .unzip();
        let mut tx = self.begin().await.map_err(RunError::Store)?;
        let claimed = self
            .claim_at_offsets(&mut tx, &keys, &fingerprints, random_claim_id(), offsets)
            .await;
        match claimed {
            Ok(Some(claimed)) => Ok(Some((tx, claimed))),
            Ok(None) => {
                if let Err(error) = tx.rollback().await {
                    tracing::debug!(%error, "rolling back a batch whose offset was passed");
                }
                Ok(None)
            }
            Err(error) => Err(rolled_back(tx, RunError::Store(error)).await),
        }
    }

    /// Runs `work` once for `key`: opens a transaction, claims the key, runs the work with
    /// the transaction, and commits the claim and the work's writes together.
    ///
    /// - A duplicate key commits nothing and returns [`Outcome::Duplicate`]; the same key
    ///   with another payload returns [`Outcome::KeyReused`]. The work does not run.
    /// - A serialization failure, a deadlock or a busy database, from the claim, the work's
    ///   own statements or the commit, rolls back and runs everything again, up to
    ///   [`InboxOptions::max_attempts`] times with a growing, jittered pause. The work must
    ///   therefore have no effect outside the transaction.
    /// - If the connection breaks after COMMIT was sent, the next attempt's claim reads the
    ///   key back: if the row carries this run's claim id the commit happened and the run
    ///   returns [`Outcome::Processed`] without running the work again. If the database
    ///   cannot be reached to find out, the error is [`Error::CommitUnknown`]: do not
    ///   acknowledge the message; its redelivery will be judged by the same claim.
    ///
    /// - If the run's own connection breaks under the work (its rollback fails), or its
    ///   server turns out to refuse writes (a standby after a failover), the attempt is the
    ///   database's failure, not the work's: it is run again, and if it keeps failing the
    ///   error is [`RunError::Store`]. A broken connection to another database the work
    ///   talks to is the work's failure.
    ///
    /// Any other error from the work rolls back and is returned as [`RunError::Work`].
    pub async fn run<'env, T, E, F>(
        &self,
        key: &Key,
        payload: &[u8],
        work: F,
    ) -> Result<Outcome<T>, RunError<E>>
    where
        F: for<'t> FnMut(&'t mut sqlx::Transaction<'env, DB>) -> WorkFuture<'t, T, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let identity = self.identity(key);
        let fingerprint = Fingerprint::of(payload);
        let span = run_span(&identity);
        if let Some(outcome) = span.in_scope(|| self.recently_settled(&identity, fingerprint)) {
            return Ok(outcome);
        }
        let forwards = Forwards::new(self.shared(), false);
        // Pinned where it is made: the attempts' future is large, and moving it into the
        // span's wrapper copied it on every call.
        let attempts = pin!(self.run_attempts(&identity, fingerprint, &forwards, work, None, 0));
        attempts.instrument(span).await
    }

    /// [`Inbox::run`] with [`Inbox::forward`] of `message` as the whole work: the webhook
    /// receiver's and the pass-through consumer's run. On PostgreSQL the claim, the outbox
    /// row and the commit are one statement, one round trip instead of four; elsewhere, and
    /// when that statement must be tried again, it runs as `run` does, with the same retries
    /// and the same reading back of a commit whose answer was lost.
    ///
    /// ```no_run
    /// # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_sql::Error> {
    /// use justonce_sql::{Key, Message, Outcome};
    ///
    /// let body = br#"{"id":"evt_1"}"#;
    /// let key = Key::new("shop:evt_1")?;
    /// let message = Message::new("shop", body.to_vec()).header("content-type", "application/json");
    /// match inbox.run_forward(&key, body, message).await? {
    ///     Outcome::Processed(()) => println!("stored; the relay sends it on with its key"),
    ///     Outcome::Duplicate => println!("seen before: nothing written"),
    ///     Outcome::KeyReused { .. } => println!("same key, another body: nothing written"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn run_forward(
        &self,
        key: &Key,
        payload: &[u8],
        message: Message,
    ) -> Result<Outcome<()>, Error> {
        let identity = self.identity(key);
        let fingerprint = Fingerprint::of(payload);
        if let Some(commits) = &self.shared.commits {
            let shared = async {
                if let Some(outcome) = self.recently_settled(&identity, fingerprint) {
                    return Ok(outcome);
                }
                let identity = identity.clone();
                (self.forward_shared(commits, identity, fingerprint, message)).await
            };
            return shared.instrument(run_span(&identity)).await;
        }
        self.forward_alone(&identity, fingerprint, &message).await
    }

    /// [`Inbox::run_forward`] of one call in a commit of its own: its one statement where
    /// the database has one, else (or when that must be tried again) its transactions.
    async fn forward_alone(
        &self,
        identity: &Identity,
        fingerprint: Fingerprint,
        message: &Message,
    ) -> Result<Outcome<()>, Error> {
        let key = &identity.key;
        let row = ClaimRow {
            identity,
            fingerprint: &fingerprint,
            claim_id: random_claim_id(),
        };
        let statement = || async move {
            let outbox = NewOutboxRow {
                scope: self.scope.as_str(),
                key: key.as_str(),
                destination: &message.destination,
                payload: &message.payload,
                headers: message.headers_json(),
            };
            Some(DB::claim_and_forward(&self.shared.pool, &self.shared.sql, row, outbox)?.await)
        };
        let run = OneStatementRun {
            row,
            forwards: true,
            lost: (),
        };
        self.run_one_statement(
            run,
            statement,
            |tx| {
                let message = message.clone();
                Box::pin(async move { self.forward(tx, key, message).await.map(drop) })
            },
            |error| error,
        )
        .await
    }

    /// The transactions of [`Inbox::run_forward`], after `tries` tries; `unknown_commit`
    /// holds the claim id of an earlier one whose COMMIT lost its answer.
    async fn forward_in_transactions(
        &self,
        identity: &Identity,
        fingerprint: Fingerprint,
        message: &Message,
        unknown_commit: Option<(i64, ())>,
        tries: u32,
    ) -> Result<Outcome<()>, Error> {
        let key = &identity.key;
        let forwards = Forwards::new(self.shared(), true);
        let forwarded = self.run_attempts(
            identity,
            fingerprint,
            &forwards,
            |tx| {
                let message = message.clone();
                Box::pin(async move { self.forward(tx, key, message).await.map(drop) })
            },
            unknown_commit,
            tries,
        );
        forwarded.await.map_err(|error| match error {
            RunError::Store(error) | RunError::Work(error) => error,
        })
    }

    /// [`Inbox::run`] with one statement as the whole work: the claim and `effect` are one
    /// statement on PostgreSQL, one round trip instead of four. `effect` reads the relation
    /// `claimed`, which has one row only when this run claimed the key (see [`Effect`]).
    /// On SQLite and MariaDB, and when that statement must be tried again, it runs as `run`
    /// does: a transaction that claims the key, then runs `effect` with `claimed` as a
    /// one-row derived table `(SELECT 1 AS justonce_claimed) AS claimed`, whose alias is the
    /// statement's if it gives one.
    ///
    /// The outcomes, retries and the reading back of a commit whose answer was lost are
    /// `run`'s. [`Outcome::Processed`] holds how many rows `effect` changed, or `None` when
    /// the answer to the one statement was lost and the key, read back, showed that it had
    /// committed: it took effect, but its count was not heard.
    ///
    /// A statement that does not read `claimed` as a relation (after `FROM`, `JOIN`,
    /// `USING` or a comma of a list of tables) would take effect for duplicates too: it is
    /// [`Error::InvalidStatement`], before anything is sent. So are more statements than
    /// one and a bind that could not be encoded. On PostgreSQL, a statement that changed
    /// rows for a duplicate all the same fails whole, as [`Error::InvalidStatement`]. A
    /// failing statement, such as one breaking a constraint, leaves no claim.
    ///
    /// ```no_run
    /// # async fn example(inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>) -> Result<(), justonce_sql::Error> {
    /// use justonce_sql::{Effect, Key, Outcome};
    ///
    /// let key = Key::new("payment:pi_1")?;
    /// let credit = Effect::new(
    ///     "UPDATE balances SET amount = amount + $2 FROM claimed WHERE account = $1",
    /// )
    /// .bind("acct_7")
    /// .bind(1250_i64);
    /// match inbox.run_effect(&key, b"pi_1 1250", &credit).await? {
    ///     Outcome::Processed(Some(0)) => println!("no such account"),
    ///     Outcome::Processed(_) => println!("credited"),
    ///     Outcome::Duplicate => println!("seen before: nothing changed"),
    ///     Outcome::KeyReused { .. } => println!("same key, another payload: nothing changed"),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn run_effect(
        &self,
        key: &Key,
        payload: &[u8],
        effect: &Effect<DB>,
    ) -> Result<Outcome<Option<u64>>, Error> {
        let checked = self.shared.effects.check(effect, &self.shared.tables)?;
        let identity = self.identity(key);
        let fingerprint = Fingerprint::of(payload);
        let row = ClaimRow {
            identity: &identity,
            fingerprint: &fingerprint,
            claim_id: random_claim_id(),
        };
        let checked = &*checked;
        let statement = || async move {
            let statement = checked.one_statement.clone()?;
            let arguments = effect.arguments.clone();
            Some(DB::claim_with_effect(&self.shared.pool, statement, row, arguments).await)
        };
        let run = OneStatementRun {
            row,
            forwards: false,
            lost: None,
        };
        self.run_one_statement(
            run,
            statement,
            |tx| {
                let in_transaction = with_claimed_row(effect.trimmed(checked), &checked.places);
                let arguments = effect.arguments.clone();
                let statement = DB::execute_effect(&mut **tx, in_transaction, arguments);
                Box::pin(async move { statement.await.map(Some) })
            },
            driver_error::<DB>,
        )
        .await
    }

    /// What [`Inbox::run_forward`] and [`Inbox::run_effect`] share: a run whose whole work
    /// is one write. `statement` makes the one statement that claims the key and writes,
    /// where the database has one; `work` writes in the transactions of [`Inbox::run`]
    /// where it has none, and when that statement must be tried again. `failed` makes the
    /// work's error the store's.
    async fn run_one_statement<'a, 'env, T, E, F, S>(
        &self,
        run: OneStatementRun<'a, T>,
        statement: impl FnOnce() -> S,
        work: F,
        failed: fn(E) -> Error,
    ) -> Result<Outcome<T>, Error>
    where
        F: for<'t> FnMut(&'t mut sqlx::Transaction<'env, DB>) -> WorkFuture<'t, T, E>,
        E: std::error::Error + Send + Sync + 'static,
        S: Future<Output = Option<OneStatementAnswer<T>>>,
    {
        let OneStatementRun {
            row,
            forwards,
            lost,
        } = run;
        let (identity, fingerprint) = (row.identity, *row.fingerprint);
        let span = run_span(identity);
        if let Some(outcome) = span.in_scope(|| self.recently_settled(identity, fingerprint)) {
            return Ok(outcome);
        }
        // Pinned where it is made, as in `run`: moving it into the span's wrapper copied it.
        let run = pin!(async {
            let forwards = Forwards::new(self.shared(), forwards);
            let settled = self.one_statement(row, &forwards, statement, lost);
            let (unknown_commit, tries) = match settled.await? {
                Settled::Done(outcome) => return Ok(outcome),
                Settled::Resume {
                    unknown_commit,
                    tries,
                } => (unknown_commit, tries),
            };
            let ran = self.run_attempts(
                identity,
                fingerprint,
                &forwards,
                work,
                unknown_commit,
                tries,
            );
            ran.await.map_err(|error| match error {
                RunError::Store(error) => error,
                RunError::Work(error) => failed(error),
            })
        });
        run.instrument(span).await
    }

    /// Runs the one statement that claims the key and writes, where the database has one
    /// (`statement` makes it, and answers nothing where there is none): the outcome it
    /// settled, or where the transactions of [`Inbox::run_attempts`] start from. `lost` is
    /// what a commit whose answer was lost came to, if reading the key back shows that it
    /// happened. The statement's future is made and pinned where it is awaited: passed in
    /// made, or moved into the await, the large future was copied on every run.
    async fn one_statement<T, S>(
        &self,
        row: ClaimRow<'_>,
        forwards: &Forwards,
        statement: impl FnOnce() -> S,
        lost: T,
    ) -> Result<Settled<T>, Error>
    where
        S: Future<Output = Option<OneStatementAnswer<T>>>,
    {
        let (identity, fingerprint, claim_id) = (row.identity, *row.fingerprint, row.claim_id);
        let resume = |unknown_commit, tries| {
            Ok(Settled::Resume {
                unknown_commit,
                tries,
            })
        };
        let Some(answer) = pin!(statement()).await else {
            return resume(None, 0);
        };
        match answer {
            Ok(Some((stored_claim_id, stored_fingerprint, value))) => {
                let stored = Stored::decode(stored_claim_id, stored_fingerprint)?;
                let outcome = if stored.claim_id == claim_id {
                    Outcome::Processed(value)
                } else {
                    skipped(identity, stored.fingerprint, fingerprint)
                };
                self.settled(identity, fingerprint, forwards, &outcome);
                Ok(Settled::Done(outcome))
            }
            // A holder committed after the statement's snapshot: the transactions read it.
            Ok(None) => resume(None, 0),
            // The pool waited its whole acquire timeout for a connection: waiting as long
            // again in the transactions would double what the caller waits.
            Err(ForwardFailed::Connect(error @ sqlx::Error::PoolTimedOut)) => {
                Err(driver_error::<DB>(error))
            }
            // Nothing was sent: the transactions connect as `run`'s do, and fail as theirs
            // would.
            Err(ForwardFailed::Connect(_)) => resume(None, 0),
            Err(ForwardFailed::Invalid(reason)) => Err(Error::InvalidStatement(reason)),
            Err(ForwardFailed::Statement(error)) => {
                // The statement was its own commit: its answer may have been lost.
                let unknown = DB::is_commit_unknown(&error);
                let transient = unknown || DB::is_retryable(&error);
                if !transient || 1 >= self.tries_allowed(unknown) {
                    return Err(driver_error::<DB>(error));
                }
                pause_before_retry(1, unknown).await;
                resume(unknown.then_some((claim_id, lost)), 1)
            }
        }
    }

    /// The outcome of a key this process saw committed recently, without asking the
    /// database.
    fn recently_settled<T>(
        &self,
        identity: &Identity,
        fingerprint: Fingerprint,
    ) -> Option<Outcome<T>> {
        let stored = self.shared.recent.get(identity)?;
        let outcome = if stored == fingerprint {
            Outcome::Duplicate
        } else {
            Outcome::KeyReused {
                stored,
                received: fingerprint,
            }
        };
        count_claim(&outcome, "recent");
        if matches!(outcome, Outcome::Duplicate) {
            self.shared.duplicates.add(identity.consumer.as_str(), 1);
        }
        Some(outcome)
    }

    /// Records a run's outcome that the database answered: the key is committed, and with
    /// it the rows the run forwarded, which the relays are woken for.
    fn settled<T>(
        &self,
        identity: &Identity,
        fingerprint: Fingerprint,
        forwards: &Forwards,
        outcome: &Outcome<T>,
    ) {
        let committed_with = match outcome {
            Outcome::KeyReused { stored, .. } => *stored,
            Outcome::Processed(_) => {
                if forwards.any() {
                    self.shared.wake_relays();
                }
                fingerprint
            }
            Outcome::Duplicate => fingerprint,
        };
        self.shared.recent.insert(identity, committed_with);
        count_claim(outcome, "database");
        if matches!(outcome, Outcome::Duplicate) {
            self.shared.duplicates.add(identity.consumer.as_str(), 1);
        }
    }

    /// The transactions of [`Inbox::run`], until one commits or fails for good.
    /// `unknown_commit` holds the claim id and result of an earlier try whose commit's
    /// answer was lost, if there was one; `tries` counts the earlier tries.
    async fn run_attempts<'env, T, E, F>(
        &self,
        identity: &Identity,
        fingerprint: Fingerprint,
        forwards: &Forwards,
        mut work: F,
        mut unknown_commit: Option<(i64, T)>,
        tries: u32,
    ) -> Result<Outcome<T>, RunError<E>>
    where
        F: for<'t> FnMut(&'t mut sqlx::Transaction<'env, DB>) -> WorkFuture<'t, T, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut attempt = tries + 1;
        loop {
            let failed = match self
                .attempt(
                    identity,
                    fingerprint,
                    forwards,
                    &mut work,
                    &mut unknown_commit,
                )
                .await
            {
                Ok(outcome) => {
                    self.settled(identity, fingerprint, forwards, &outcome);
                    return Ok(outcome);
                }
                Err(failed) => failed,
            };
            let transient = match &failed {
                Failed::Work(error) => is_retryable_work_error::<DB>(error),
                Failed::Lost(_) => true,
                Failed::Store(error) => error.is_retryable() || unknown_commit.is_some(),
            };
            if !transient || attempt >= self.tries_allowed(unknown_commit.is_some()) {
                return Err(match failed {
                    Failed::Store(error) if unknown_commit.is_some() => {
                        RunError::Store(Error::CommitUnknown {
                            source: Box::new(error),
                        })
                    }
                    failed => failed.into(),
                });
            }
            pause_before_retry(attempt, unknown_commit.is_some()).await;
            attempt += 1;
        }
    }

    /// The tries a run gets; a lost COMMIT answer (`unknown`) gets a few of its own to be
    /// resolved.
    fn tries_allowed(&self, unknown: bool) -> u32 {
        self.shared.max_attempts + if unknown { RESOLVE_ATTEMPTS } else { 0 }
    }

    /// One transaction of [`Inbox::run`]. `unknown_commit` holds the claim id and result of
    /// an earlier attempt whose COMMIT answer was lost.
    async fn attempt<'env, T, E, F>(
        &self,
        identity: &Identity,
        fingerprint: Fingerprint,
        forwards: &Forwards,
        work: &mut F,
        unknown_commit: &mut Option<(i64, T)>,
    ) -> Result<Outcome<T>, Failed<E>>
    where
        F: for<'t> FnMut(&'t mut sqlx::Transaction<'env, DB>) -> WorkFuture<'t, T, E>,
        E: std::error::Error + 'static,
    {
        let _writer = self.shared.queue_writer().await;
        let claim_id = random_claim_id();
        // 'env, not 'static: the work may borrow what outlives the call to `run`.
        let mut tx: sqlx::Transaction<'env, DB> = self.begin().await.map_err(Failed::Store)?;
        if unknown_commit.is_some() {
            DB::bound_lock_waits(&mut tx).await.map_err(Failed::Store)?;
        }
        let row = ClaimRow {
            identity,
            fingerprint: &fingerprint,
            claim_id,
        };
        let stored = self
            .shared
            .sql
            .claim(&mut tx, row)
            .await
            .map_err(Failed::Store)?;
        if stored.claim_id != claim_id {
            // Rolled back here, not on drop, so that the write lock is gone before the
            // next writer in the queue begins.
            let _ = tx.rollback().await;
            if let Some((lost_claim_id, value)) = unknown_commit.take()
                && lost_claim_id == stored.claim_id
            {
                tracing::debug!(key = %identity.key, "the commit whose answer was lost had happened");
                return Ok(Outcome::Processed(value));
            }
            return Ok(skipped(identity, stored.fingerprint, fingerprint));
        }
        // This attempt holds the key, so no earlier commit happened.
        *unknown_commit = None;
        let value = match forwards.around(work(&mut tx)).await {
            Ok(value) => value,
            Err(error) => return Err(roll_back_work(tx, error).await),
        };
        match tx.commit().await {
            Ok(()) => Ok(Outcome::Processed(value)),
            Err(error) => {
                if DB::is_commit_unknown(&error) {
                    *unknown_commit = Some((claim_id, value));
                }
                Err(Failed::Store(driver_error::<DB>(error)))
            }
        }
    }

    /// Writes an outbox row in the caller's transaction, keyed by the derived key of
    /// `step` for `key` ([`Identity::derive`]): the same key, step, consumer and scope
    /// always give the same downstream key, so a re-run or a replay sends the same key and
    /// two consumers of one message send two. Returns the row's id.
    ///
    /// The row keeps the message's W3C trace context ([`Message::trace_context`]) and its
    /// delivery sends it on, so that the destination's work joins the trace that caused
    /// this one. A message without one takes the current span's when a
    /// [`crate::trace::TracePropagator`] is installed.
    ///
    /// ```no_run
    /// # async fn example(
    /// #     inbox: justonce_sql::Inbox<justonce_sql::sqlx::Postgres>,
    /// #     traceparent: &str,
    /// # ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// use justonce_sql::{Key, Message, TraceContext};
    ///
    /// // The `traceparent` of the request that asked for the invoice.
    /// let context = TraceContext::parse(traceparent, None);
    /// let key = Key::purpose(["invoice", "2026-10", "cust_481"])?;
    /// let mut email = Message::new("email", br#"{"invoice":"2026-10"}"#.to_vec());
    /// if let Some(context) = &context {
    ///     email = email.trace_context(context);
    /// }
    /// inbox
    ///     .run(&key, b"job", |tx| {
    ///         Box::pin(inbox.enqueue(tx, &key, "invoice-email", email.clone()))
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        key: &Key,
        step: &str,
        message: Message,
    ) -> Result<i64, Error> {
        let derived = self.identity(key).derive(step);
        (self.write_outbox(tx, derived.as_str(), message, Announce::AtCommit)).await
    }

    /// Writes an outbox row that forwards a received message unchanged: it keeps the
    /// message's own key, so the receiver deduplicates it as the same event. Returns the
    /// row's id.
    ///
    /// How the relays hear of the row depends on whose transaction `tx` is:
    ///
    /// - In the work of [`Inbox::run`], [`Inbox::run_batch`] or [`Inbox::run_batch_at_once`]
    ///   (the consumers and readers of justonce-transport run theirs there), on the
    ///   transaction the work was given, the row is written without a notification. The
    ///   run wakes the relays after its commit: this process's at once, other processes'
    ///   by one NOTIFY shared with the commits around it ([`InboxOptions::notify_every`]).
    ///   Concurrent commits then do not queue for PostgreSQL's notification lock.
    /// - In a transaction of your own, from [`Inbox::begin`], a NOTIFY goes with the row and
    ///   wakes the relays at its commit, as [`Inbox::enqueue`]'s does.
    ///
    /// Inside a run's work, forward on the transaction the work was given: a row forwarded
    /// there in another transaction is found by the relays' poll.
    pub async fn forward(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        key: &Key,
        message: Message,
    ) -> Result<i64, Error> {
        let announce = if Forwards::note(self.shared()) {
            Announce::AfterCommit
        } else {
            Announce::AtCommit
        };
        (self.write_outbox(tx, key.as_str(), message, announce)).await
    }

    async fn write_outbox(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        key: &str,
        message: Message,
        announce: Announce,
    ) -> Result<i64, Error> {
        let row = NewOutboxRow {
            scope: self.scope.as_str(),
            key,
            destination: &message.destination,
            payload: &message.payload,
            headers: message.headers_json(),
        };
        self.shared.sql.enqueue(tx, row, announce).await
    }

    /// The outbox of this store: its relay, dead letters and clean-up.
    pub fn outbox(&self) -> Outbox<DB> {
        Outbox {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Stores this consumer's position in `stream`'s `partition` in the caller's
    /// transaction, so that the position and the work commit together. An offset at or
    /// below the stored one is ignored, in SQL, whatever order concurrent commits come in.
    ///
    /// [`OffsetCommit::AlreadyProcessed`] when the stored offset did not move: this entry
    /// was already processed and the transaction must be rolled back: a reader restarted after a crash
    /// can load the offsets before its predecessor's last COMMIT lands, and then meets that
    /// entry again. On PostgreSQL the statement waits for such a predecessor's transaction
    /// and sees its outcome.
    pub async fn commit_offset(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        stream: &str,
        partition: i32,
        offset: Offset,
    ) -> Result<OffsetCommit, Error> {
        (self.commit_offset_span(tx, stream, partition, offset, offset)).await
    }

    /// [`Inbox::commit_offset`] for a batch of entries of one partition, from `first` to
    /// `last`, in one statement: stores `last` if the stored offset is below `first`, and
    /// says [`OffsetCommit::AlreadyProcessed`] otherwise, since an entry of the batch was
    /// then processed or given up before.
    pub async fn commit_offset_span(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        stream: &str,
        partition: i32,
        first: Offset,
        last: Offset,
    ) -> Result<OffsetCommit, Error> {
        let at = OffsetRow {
            consumer: self.consumer.as_str(),
            stream,
            partition,
            offset: last,
            above: first,
            at_least: None,
        };
        Ok(if self.shared.sql.commit_offset(tx, at).await? {
            OffsetCommit::Moved
        } else {
            OffsetCommit::AlreadyProcessed
        })
    }

    /// [`Inbox::commit_offset`] in a transaction of its own, committed if the offset moved:
    /// for a reader that moves past an entry it gave up (dead-lettered) or only found
    /// duplicates in.
    pub async fn move_offset(
        &self,
        stream: &str,
        partition: i32,
        offset: Offset,
    ) -> Result<OffsetCommit, Error> {
        let mut tx = self.begin().await?;
        let moved = self
            .commit_offset(&mut tx, stream, partition, offset)
            .await?;
        match moved {
            OffsetCommit::Moved => tx.commit().await.map_err(driver_error::<DB>)?,
            OffsetCommit::AlreadyProcessed => tx.rollback().await.map_err(driver_error::<DB>)?,
        }
        Ok(moved)
    }

    /// This consumer's stored positions in `stream`, by partition, to resume from.
    pub async fn load_offsets(&self, stream: &str) -> Result<Vec<(i32, Offset)>, Error> {
        self.shared
            .sql
            .load_offsets(&self.shared.pool, self.consumer.as_str(), stream)
            .await
    }

    /// Records that a run of `key` starts, in one statement committed on its own, and
    /// returns how many runs of it this consumer has started in this scope, this one
    /// included. A broker consumer calls it before it runs a delivery that may be a re-run:
    /// a message whose work ends its process is then stopped after its attempts, whatever
    /// the broker counts. The count is kept until [`Inbox::purge`] removes it.
    pub async fn record_run(&self, key: &Key) -> Result<u64, Error> {
        let identity = self.identity(key);
        let _writer = self.shared.queue_writer().await;
        self.shared
            .sql
            .record_run(&self.shared.pool, &identity)
            .await
    }

    /// Records that a run of each of `keys` starts, as [`Inbox::record_run`] does, in one
    /// statement committed on its own, but only when none of them has a run counted yet;
    /// whether it did. A consumer that took several deliveries that may be re-runs runs
    /// them together when it did: none of them is known to have started a run before. When
    /// one has, it runs each alone with its own count, so that a message whose work ends
    /// the process is given up alone. A key given twice is counted once.
    pub async fn record_first_runs(&self, keys: &[&Key]) -> Result<bool, Error> {
        let mut distinct: Vec<&str> = keys.iter().map(|key| key.as_str()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let _writer = self.shared.queue_writer().await;
        let counted = DB::record_first_runs(
            &self.shared.pool,
            &self.shared.sql,
            &self.scope,
            &self.consumer,
            &distinct,
        )
        .await?;
        Ok(counted == distinct.len() as u64)
    }

    /// Deletes this consumer's keys, in every scope, processed more than `older_than` ago
    /// (by the database's clock), `batch_size` rows per statement so that no statement holds many
    /// locks, and returns how many keys were deleted. The counts of runs
    /// ([`Inbox::record_run`]) whose last run started as long ago go too
    /// ([`Inbox::purge_runs_batch`]). A purged key can be claimed again, so `older_than`
    /// shorter than the retention's retry horizon is refused.
    pub async fn purge(&self, older_than: Duration, batch_size: u32) -> Result<u64, Error> {
        let keys = in_batches(batch_size, |limit| {
            self.purge_batch(older_than, u32::try_from(limit).unwrap_or(u32::MAX))
        })
        .await?;
        in_batches(batch_size, |limit| {
            self.purge_runs_batch(older_than, u32::try_from(limit).unwrap_or(u32::MAX))
        })
        .await?;
        Ok(keys)
    }

    /// One batch of [`Inbox::purge`]'s keys: deletes at most `batch_size` of them in one
    /// statement and returns how many it deleted. Fewer than `batch_size` means none are
    /// left; a caller that loops can report its progress between batches.
    pub async fn purge_batch(&self, older_than: Duration, batch_size: u32) -> Result<u64, Error> {
        let keys = Change::PurgeKeys {
            consumer: self.consumer.as_str(),
            older_than_ms: self.purge_cutoff(older_than)?,
            limit: i64::from(batch_size.max(1)),
        };
        let _writer = self.shared.queue_writer().await;
        let purged = self.shared.sql.change(&self.shared.pool, keys).await;
        self.shared.recent.clear();
        purged
    }

    /// Deletes the count of runs of `key` ([`Inbox::record_run`]) in this inbox's scope:
    /// once its message has left the consumer as a dead letter, a replay of it is not
    /// given up for its past runs. Whether there was one.
    pub async fn forget_runs(&self, key: &Key) -> Result<bool, Error> {
        let forget = Change::ForgetRuns {
            scope: self.scope.as_str(),
            consumer: self.consumer.as_str(),
            key: key.as_str(),
        };
        let _writer = self.shared.queue_writer().await;
        Ok(self.shared.sql.change(&self.shared.pool, forget).await? > 0)
    }

    /// One batch of the counts of runs [`Inbox::purge`] deletes, in every scope, whose last
    /// run started more than `older_than` ago: at most `batch_size` in one statement; how
    /// many it deleted.
    pub async fn purge_runs_batch(
        &self,
        older_than: Duration,
        batch_size: u32,
    ) -> Result<u64, Error> {
        let runs = Change::PurgeRuns {
            consumer: self.consumer.as_str(),
            older_than_ms: self.purge_cutoff(older_than)?,
            limit: i64::from(batch_size.max(1)),
        };
        let _writer = self.shared.queue_writer().await;
        self.shared.sql.change(&self.shared.pool, runs).await
    }

    /// `older_than` in milliseconds, or why it is refused: below the retry horizon.
    fn purge_cutoff(&self, older_than: Duration) -> Result<i64, Error> {
        let horizon = self.shared.retention.retry_horizon();
        if older_than < horizon {
            return Err(Error::RetentionBelowHorizon {
                retention: older_than,
                retry_horizon: horizon,
            });
        }
        Ok(millis(older_than))
    }

    /// Purges the keys older than the configured retention; see [`Inbox::purge`].
    pub async fn purge_expired(&self, batch_size: u32) -> Result<u64, Error> {
        self.purge(self.shared.retention.keep(), batch_size).await
    }
}

/// Attempts beyond `max_attempts` that a run may spend finding out whether a COMMIT whose
/// answer was lost happened.
const RESOLVE_ATTEMPTS: u32 = 3;

/// Puts each row read back at its key's place among a batch's sorted `keys`.
fn put_in_place(keys: &[&str], rows: Vec<(String, Stored)>, holders: &mut [Option<Stored>]) {
    for (key, stored) in rows {
        if let Ok(place) = keys.binary_search(&key.as_str()) {
            holders[place] = Some(stored);
        }
    }
}

/// What a claim found, given whether this attempt's row holds the key.
fn judge(holds: bool, stored: Fingerprint, received: Fingerprint) -> Claim {
    if holds {
        Claim::First
    } else if stored == received {
        Claim::Duplicate
    } else {
        Claim::KeyReused { stored, received }
    }
}

/// The outcome of a claim that found the key held by another: a duplicate, or the key
/// reused with another payload.
fn skipped<T>(identity: &Identity, stored: Fingerprint, received: Fingerprint) -> Outcome<T> {
    if stored == received {
        tracing::debug!(key = %identity.key, consumer = %identity.consumer, "duplicate: skipped");
        Outcome::Duplicate
    } else {
        // The caller reports it, with what it knows of the message: one warning, not two.
        tracing::debug!(key = %identity.key, consumer = %identity.consumer, "same key, different payload: skipped");
        Outcome::KeyReused { stored, received }
    }
}

/// Counts and logs the failure of try `attempt` of a run, then waits before the next.
async fn pause_before_retry(attempt: u32, unknown: bool) {
    let cause = if unknown {
        "commit_unknown"
    } else {
        "transient"
    };
    tracing::debug!(attempt, cause, "try failed: retrying");
    metrics::counter!("justonce_retries_total", "cause" => cause).increment(1);
    backoff(attempt).await;
}

/// The span of one run of a key.
fn run_span(identity: &Identity) -> tracing::Span {
    tracing::debug_span!(
        "justonce.run",
        scope = %identity.scope,
        consumer = %identity.consumer,
        key = %identity.key,
    )
}

/// A run of [`Inbox::run_one_statement`]: the key to claim, with the claim id of the one
/// statement, whether it forwards a row, and what it came to if its answer was lost and it
/// committed.
struct OneStatementRun<'a, T> {
    row: ClaimRow<'a>,
    forwards: bool,
    lost: T,
}

/// What the one statement of a run came to.
enum Settled<T> {
    /// The database answered: the run's outcome.
    Done(Outcome<T>),
    /// The run goes on in transactions, after `tries` tries, with the claim id and value
    /// of the one statement if its answer was lost.
    Resume {
        unknown_commit: Option<(i64, T)>,
        tries: u32,
    },
}

/// Why one attempt of [`Inbox::run`] failed.
enum Failed<E> {
    /// The work failed on its own.
    Work(E),
    /// The work failed because our database went away under it: nothing was committed,
    /// and the work is not to blame.
    Lost(E),
    Store(Error),
}

impl<E> From<Failed<E>> for RunError<E>
where
    E: std::error::Error + Send + Sync + 'static,
{
    fn from(failed: Failed<E>) -> Self {
        match failed {
            Failed::Work(error) => RunError::Work(error),
            // The store's, so that a caller gives the message back rather than count a
            // failed attempt.
            Failed::Lost(error) => RunError::Store(Error::database(true, error)),
            Failed::Store(error) => RunError::Store(error),
        }
    }
}

/// Why a claim with no offsets to move has claims: none can have been passed.
const NO_OFFSETS: &str = "a batch with no offsets to move moves them all";

/// The entries of one partition in a batch read from a stream, from the first offset to
/// the last, for [`Inbox::run_batch_at_offsets`]: one span per partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffsetSpan<'a> {
    /// The stream.
    pub stream: &'a str,
    /// The stream's partition.
    pub partition: i32,
    /// The offset of the batch's first entry in the partition.
    pub first: Offset,
    /// The offset of its last entry, which is stored.
    pub last: Offset,
}

/// Why [`Inbox::run`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError<E> {
    /// justonce or the database failed; nothing was committed unless the error is
    /// [`Error::CommitUnknown`].
    #[error(transparent)]
    Store(Error),
    /// The work returned this error; its transaction was rolled back.
    #[error("the work failed")]
    Work(#[source] E),
}

/// `error`, after rolling `tx` back; a failed rollback is logged, since the connection
/// ending rolls it back anyway.
async fn rolled_back<DB: Backend, E>(
    tx: sqlx::Transaction<'_, DB>,
    error: RunError<E>,
) -> RunError<E> {
    if let Err(rollback) = tx.rollback().await {
        tracing::debug!(error = %rollback, "rolling a failed batch back");
    }
    error
}

/// Commits a batch's transaction; what each message came to, in order.
async fn commit_batch<DB: Backend, E>(
    tx: sqlx::Transaction<'_, DB>,
    claimed: Vec<Claim>,
) -> Result<Vec<Outcome<()>>, RunError<E>> {
    tx.commit()
        .await
        .map_err(|e| RunError::Store(driver_error::<DB>(e)))?;
    Ok(claimed
        .into_iter()
        .map(|claim| match claim {
            Claim::First => Outcome::Processed(()),
            Claim::Duplicate => Outcome::Duplicate,
            Claim::KeyReused { stored, received } => Outcome::KeyReused { stored, received },
        })
        .collect())
}

/// Whether the work failed because of its transaction rather than its logic: a
/// serialization failure, deadlock or busy database anywhere in its error's chain.
fn is_retryable_work_error<DB: Backend>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(error) = error.downcast_ref::<sqlx::Error>() {
            return DB::is_retryable(error);
        }
        if let Some(error) = error.downcast_ref::<Error>() {
            return error.is_retryable();
        }
        cause = error.source();
    }
    false
}

/// Rolls back the transaction of work that failed with `error`, and judges whose failure
/// it was, on our own connection: the database's when the rollback finds that connection
/// gone, or when `error` is a server refusing writes (a standby after a failover); the
/// work's otherwise, even a broken connection to another database the work talks to.
///
/// A refusal is judged from the error alone: one from another pool carries the same code,
/// and cannot be told apart.
async fn roll_back_work<DB: Backend, E>(tx: sqlx::Transaction<'_, DB>, error: E) -> Failed<E>
where
    E: std::error::Error + 'static,
{
    let gone = match tx.rollback().await {
        Ok(()) => false,
        Err(rollback) => {
            tracing::debug!(error = %rollback, "rolling failed work back");
            DB::is_commit_unknown(&rollback)
        }
    };
    let chain: &(dyn std::error::Error + 'static) = &error;
    let refused = std::iter::successors(Some(chain), |e| e.source())
        .filter_map(|e| e.downcast_ref::<sqlx::Error>())
        .any(DB::refuses_writes);
    if gone || refused {
        Failed::Lost(error)
    } else {
        Failed::Work(error)
    }
}

/// Counts a run's outcome, and whether the database or the recent keys answered it.
fn count_claim<T>(outcome: &Outcome<T>, answered_by: &'static str) {
    let name = match outcome {
        Outcome::Processed(_) => "processed",
        Outcome::Duplicate => "duplicate",
        Outcome::KeyReused { .. } => "key_reused",
    };
    tracing::debug!(outcome = name, answered_by, "claimed");
    metrics::counter!("justonce_claims_total", "outcome" => name, "answered_by" => answered_by)
        .increment(1);
}

/// A fresh 64-bit claim id.
fn random_claim_id() -> i64 {
    random_u64() as i64
}

/// Waits 10 ms, 20 ms, 40 ms … up to 1 s, each with up to half of it added at random, so
/// that retrying transactions do not collide again.
async fn backoff(attempt: u32) {
    let base = Duration::from_millis(10) * 2u32.pow(attempt.min(8) - 1);
    let base = base.min(Duration::from_secs(1));
    let jitter = random_u64() % (base.as_millis() as u64 / 2 + 1);
    tokio::time::sleep(base + Duration::from_millis(jitter)).await;
}
